/*
 * test_npy.c — the .npy reader against files NumPy wrote (every version,
 * byte order and memory order we accept), write/read round trips of
 * strided tensors, and what a failed write leaves on disk.
 */
#define _GNU_SOURCE /* mkdtemp, mkfifo, symlink, RLIMIT_FSIZE */
#include <errno.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#ifndef ATTN_TEST_DATA
#error "ATTN_TEST_DATA must name tests/data"
#endif

/* Fixtures hold value(i) = i / 8 - 1 in C order (bool: i % 3 == 0). */
static void check_fixture(const char *name, attn_dtype dtype, int rank, const int64_t *shape) {
    char path[512];
    snprintf(path, sizeof path, "%s/npy/%s.npy", ATTN_TEST_DATA, name);
    attn_tensor t;
    attn_status st = attn_npy_load(path, &t);
    CHECK(st == ATTN_OK, "%s: %s", name, attn_last_error());
    if (st != ATTN_OK) return;
    CHECK(t.dtype == dtype, "%s: dtype %s", name, attn_dtype_name(t.dtype));
    CHECK(t.rank == rank, "%s: rank %d, expected %d", name, t.rank, rank);
    bool shape_ok = t.rank == rank;
    for (int d = 0; shape_ok && d < rank; d++) shape_ok = t.shape[d] == shape[d];
    CHECK(shape_ok, "%s: wrong shape", name);
    int64_t n = attn_tensor_numel(&t), bad = 0;
    double *x = tt_dense(&t);
    for (int64_t i = 0; shape_ok && i < n; i++) {
        double want = dtype == ATTN_DTYPE_BOOL ? (i % 3 == 0) : (double)i / 8 - 1;
        if (x[i] != want) bad++;
    }
    CHECK(bad == 0, "%s: %lld elements differ from NumPy's", name, (long long)bad);
    free(x);
    attn_npy_free(&t);
    CHECK(t.data == NULL, "attn_npy_free leaves the pointer");
}

static void numpy_fixtures(void) {
    int64_t s234[3] = {2, 3, 4}, s35[2] = {3, 5}, s45[2] = {4, 5}, s7[1] = {7};
    check_fixture("f32_c_v1", ATTN_DTYPE_F32, 3, s234);
    check_fixture("f64_c_v1", ATTN_DTYPE_F64, 2, s35);
    check_fixture("f32_big_endian", ATTN_DTYPE_F32, 3, s234);
    check_fixture("f64_big_endian", ATTN_DTYPE_F64, 2, s35);
    check_fixture("f32_fortran", ATTN_DTYPE_F32, 3, s234);
    check_fixture("f64_fortran_big", ATTN_DTYPE_F64, 2, s35);
    check_fixture("bool_c", ATTN_DTYPE_BOOL, 2, s45);
    check_fixture("f32_v2", ATTN_DTYPE_F32, 3, s234);
    check_fixture("f32_v3", ATTN_DTYPE_F32, 3, s234);
    check_fixture("f32_rank1", ATTN_DTYPE_F32, 1, s7);
    /* A 0-d array (shape ()) reads as shape (1,). Its value is -1. */
    char path[512];
    snprintf(path, sizeof path, "%s/npy/f64_scalar.npy", ATTN_TEST_DATA);
    attn_tensor t;
    CHECK_OK(attn_npy_load(path, &t));
    CHECK(t.rank == 1 && t.shape[0] == 1 && ((double *)t.data)[0] == -1.0, "0-d array");
    attn_npy_free(&t);
}

/* The header alone, as the file has it: a 0-d array is rank 0 there (issue
 * 9: the tool called a 0-d input "rank 1", the shape it is loaded as). */
static void read_header(void) {
    char path[512];
    attn_dtype dtype;
    int rank = -1;
    int64_t shape[ATTN_MAX_RANK];
    snprintf(path, sizeof path, "%s/npy/f64_scalar.npy", ATTN_TEST_DATA);
    CHECK_OK(attn_npy_read_header(path, &dtype, &rank, shape));
    CHECK(dtype == ATTN_DTYPE_F64 && rank == 0, "f64_scalar: %s rank %d", attn_dtype_name(dtype),
          rank);
    snprintf(path, sizeof path, "%s/npy/f32_fortran.npy", ATTN_TEST_DATA);
    CHECK_OK(attn_npy_read_header(path, &dtype, &rank, shape));
    CHECK(dtype == ATTN_DTYPE_F32 && rank == 3 && shape[0] == 2 && shape[1] == 3 && shape[2] == 4,
          "f32_fortran: %s rank %d", attn_dtype_name(dtype), rank);
    CHECK_STATUS(attn_npy_read_header("/nonexistent.npy", &dtype, &rank, shape), ATTN_ERR_IO);
    CHECK_STATUS(attn_npy_read_header(path, NULL, &rank, shape), ATTN_ERR_NULL);
    snprintf(path, sizeof path, "%s/npy", ATTN_TEST_DATA);
    CHECK_STATUS(attn_npy_read_header(path, &dtype, &rank, shape), ATTN_ERR_IO);
    /* Only the header is read: a file whose data is cut short still has one. */
    char cut[] = "/tmp/attn_test_header_XXXXXX";
    int fd = mkstemp(cut);
    CHECK(fd >= 0, "mkstemp");
    if (fd < 0) return;
    static const char head[] = "\x93NUMPY\x01\x00\x40\x00{'descr': '<f4', 'fortran_order': "
                               "False, 'shape': (5, 7), }    \n";
    CHECK(write(fd, head, sizeof head - 1) == (ssize_t)(sizeof head - 1), "write");
    close(fd);
    CHECK_OK(attn_npy_read_header(cut, &dtype, &rank, shape));
    CHECK(rank == 2 && shape[0] == 5 && shape[1] == 7, "cut file: rank %d", rank);
    CHECK(truncate(cut, 20) == 0, "truncate");
    CHECK_STATUS(attn_npy_read_header(cut, &dtype, &rank, shape), ATTN_ERR_FORMAT);
    CHECK(strstr(attn_last_error(), cut) != NULL, "message lacks the path: %s", attn_last_error());
    remove(cut);
}

/* Every truncation of a valid file is rejected, never over-read (ASan). */
static void every_truncation_fails(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/npy/f64_fortran_big.npy", ATTN_TEST_DATA);
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL, "cannot open %s", path);
    if (f == NULL) return;
    unsigned char buf[512];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    for (size_t len = 0; len < n; len++) {
        unsigned char *copy = malloc(len ? len : 1); /* exact size: ASan sees over-reads */
        memcpy(copy, buf, len);
        attn_tensor t;
        attn_status st = attn_npy_parse(copy, len, &t);
        CHECK(st != ATTN_OK, "a file truncated to %zu bytes was accepted", len);
        free(copy);
    }
    attn_tensor t;
    CHECK_OK(attn_npy_parse(buf, n, &t));
    attn_npy_free(&t);
}

static void round_trips(void) {
    rng r = {harness_seed() ^ 0x5555};
    char path[] = "/tmp/attn_test_npy_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd < 0) return;
    close(fd);
    for (int trial = 0; trial < 40; trial++) {
        attn_dtype dt = (attn_dtype)rng_int(&r, 1, 3);
        int rank = (int)rng_int(&r, 1, 6);
        int64_t shape[ATTN_MAX_RANK];
        for (int d = 0; d < rank; d++) shape[d] = rng_int(&r, 1, 5);
        test_tensor x;
        tt_make(&x, &r, dt, rank, shape, LAYOUT_RANDOM, 1, 0.5);
        CHECK_OK(attn_npy_save(path, &x.t));
        attn_tensor back;
        CHECK_OK(attn_npy_load(path, &back));
        bool same = back.rank == rank && back.dtype == dt;
        for (int d = 0; same && d < rank; d++) same = back.shape[d] == shape[d];
        CHECK(same, "trial %d: shape or dtype changed", trial);
        if (same) {
            double *a = tt_dense(&x.t), *b = tt_dense(&back);
            CHECK(max_abs_diff(a, b, attn_tensor_numel(&back)) == 0, "trial %d: values changed",
                  trial);
            free(a);
            free(b);
        }
        attn_npy_free(&back);
        tt_free(&x);
    }
    /* Data starts on a 64-byte boundary, as NumPy writes it. */
    float one = 1;
    int64_t s1[1] = {1};
    attn_tensor t;
    attn_tensor_init(&t, &one, ATTN_DTYPE_F32, 1, s1);
    CHECK_OK(attn_npy_save(path, &t));
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    CHECK(size == 128 + 4, "file size %ld, expected 132 (NumPy writes the same)", size);
    remove(path);
    CHECK_STATUS(attn_npy_save("/nonexistent/dir/x.npy", &t), ATTN_ERR_IO);
    CHECK_STATUS(attn_npy_save(NULL, &t), ATTN_ERR_NULL);
}

/* A float32 vector of n elements, value(i) = i (caller frees t->data). */
static void vector(attn_tensor *t, int64_t n) {
    float *x = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) x[i] = (float)i;
    attn_tensor_init(t, x, ATTN_DTYPE_F32, 1, &n);
}

/* Issue 9: a save that fails part-way (a full disk) truncated the old file.
 * In a child limited to 64 KiB per file (EFBIG, as a full disk gives
 * ENOSPC), saving 128 KiB over an existing file must fail and leave that
 * file byte for byte, with no temporary beside it. */
static void failed_save_keeps_old_file(void) {
    char dir[] = "/tmp/attn_npy_atomic_XXXXXX", path[64], names[256];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof path, "%s/x.npy", dir);
    attn_tensor small, big;
    vector(&small, 10);
    vector(&big, 32768);
    CHECK_OK(attn_npy_save(path, &small));
    size_t old_size = 0, new_size = 0;
    unsigned char *old = tt_read_file(path, &old_size);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit lim = {64 * 1024, 64 * 1024};
        signal(SIGXFSZ, SIG_IGN);
        setrlimit(RLIMIT_FSIZE, &lim);
        attn_status st = attn_npy_save(path, &big);
        _exit(st == ATTN_ERR_IO && strstr(attn_last_error(), strerror(EFBIG)) &&
                      strstr(attn_last_error(), path)
                  ? 0
                  : 1);
    }
    int status = -1;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "the limited save did not fail with ATTN_ERR_IO naming the reason and the path");
    unsigned char *now = tt_read_file(path, &new_size);
    CHECK(old != NULL && now != NULL && new_size == old_size && memcmp(old, now, old_size) == 0,
          "the old file changed: %zu bytes before, %zu after", old_size, new_size);
    CHECK(tt_list_dir(dir, names, sizeof names) == 1 && strcmp(names, "x.npy") == 0,
          "left in the folder: %s", names);
    free(old);
    free(now);
    free(small.data);
    free(big.data);
    tt_remove_tree(dir);
}

/* The atomic save keeps what writing in place did: it writes through a
 * symbolic link (the link stays), keeps the file's permissions, and writes
 * a FIFO (or a device such as /dev/null) in place instead of replacing it. */
static void save_through_links_and_fifos(void) {
    char dir[] = "/tmp/attn_npy_links_XXXXXX", file[64], link[64], fifo[64], names[256];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(file, sizeof file, "%s/file.npy", dir);
    snprintf(link, sizeof link, "%s/link.npy", dir);
    snprintf(fifo, sizeof fifo, "%s/fifo", dir);
    attn_tensor t;
    vector(&t, 3);
    CHECK(tt_write_file(file, "old", 3) == 0 && chmod(file, 0640) == 0 &&
              symlink("file.npy", link) == 0,
          "setup");
    /* Root may keep the owner too (nobody's: 65534). */
    const bool root = geteuid() == 0 && chown(file, 65534, 65534) == 0;
    CHECK_OK(attn_npy_save(link, &t));
    struct stat st;
    CHECK(lstat(link, &st) == 0 && S_ISLNK(st.st_mode), "the link was replaced by a file");
    CHECK(stat(file, &st) == 0 && st.st_size == 128 + 12 && (st.st_mode & 0777) == 0640,
          "file.npy: %lld bytes, mode %o", (long long)st.st_size, (unsigned)(st.st_mode & 0777));
    CHECK(!root || (st.st_uid == 65534 && st.st_gid == 65534), "owner %d:%d, expected 65534",
          (int)st.st_uid, (int)st.st_gid);
    CHECK(mkfifo(fifo, 0600) == 0, "mkfifo");
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) { /* the reader: counts the bytes */
        FILE *f = fopen(fifo, "rb");
        size_t n = 0;
        while (f != NULL && fgetc(f) != EOF) n++;
        _exit(n == 128 + 12 ? 0 : 1);
    }
    CHECK_OK(attn_npy_save(fifo, &t));
    int status = -1;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the FIFO's reader got the wrong bytes");
    CHECK(lstat(fifo, &st) == 0 && S_ISFIFO(st.st_mode), "the FIFO was replaced");
    /* With no reader, a bounded wait and an error, not open(2)'s wait for good. */
    CHECK_STATUS(attn_npy_save(fifo, &t), ATTN_ERR_IO);
    CHECK(strstr(attn_last_error(), "a FIFO that no process opened for reading within 5 s"),
          "message: %s", attn_last_error());
    CHECK(tt_list_dir(dir, names, sizeof names) == 3 &&
              strcmp(names, "fifo file.npy link.npy") == 0,
          "left in the folder: %s", names);
    CHECK_STATUS(attn_npy_save(dir, &t), ATTN_ERR_IO); /* a folder is never replaced */
    CHECK(stat(dir, &st) == 0 && S_ISDIR(st.st_mode), "the folder was replaced");
    /* A dangling link (here a chain: one relative to its folder, one
     * absolute) creates the file it names, as open(2) does; the links stay.
     * Before, the file replaced the first link. */
    char sub[64], chain[64], hop[64], end[64];
    snprintf(sub, sizeof sub, "%s/sub", dir);
    snprintf(chain, sizeof chain, "%s/chain.npy", dir);
    snprintf(hop, sizeof hop, "%s/sub/hop.npy", dir);
    snprintf(end, sizeof end, "%s/sub/end.npy", dir);
    CHECK(mkdir(sub, 0700) == 0 && symlink("sub/hop.npy", chain) == 0 && symlink(end, hop) == 0,
          "setup");
    CHECK_OK(attn_npy_save(chain, &t));
    CHECK(lstat(chain, &st) == 0 && S_ISLNK(st.st_mode), "chain.npy was replaced by a file");
    CHECK(lstat(hop, &st) == 0 && S_ISLNK(st.st_mode), "sub/hop.npy was replaced by a file");
    CHECK(lstat(end, &st) == 0 && S_ISREG(st.st_mode) && st.st_size == 128 + 12,
          "sub/end.npy not created");
    CHECK(unlink(end) == 0 && symlink("hop.npy", end) == 0, "setup"); /* a loop */
    CHECK_STATUS(attn_npy_save(chain, &t), ATTN_ERR_IO);
    CHECK(strstr(attn_last_error(), strerror(ELOOP)) != NULL, "loop: %s", attn_last_error());
    free(t.data);
    tt_remove_tree(dir);
}

/* Issue 9: a long path pushed the reason out of the message. A 4000-byte
 * path (nested folders) fits with its reason; one longer than PATH_MAX
 * fails with ENAMETOOLONG, which must still be named. */
static void long_paths_keep_the_reason(void) {
    char root[] = "/tmp/attn_npy_long_XXXXXX";
    CHECK(mkdtemp(root) != NULL, "mkdtemp");
    static char path[12000];
    size_t used = (size_t)snprintf(path, sizeof path, "%s", root);
    while (used < 3900) {
        used += (size_t)snprintf(path + used, sizeof path - used, "/%0100d", 0);
        CHECK(mkdir(path, 0700) == 0, "mkdir: %s", strerror(errno));
    }
    snprintf(path + used, sizeof path - used, "/bad.npy");
    CHECK(tt_write_file(path, "\x93NUMPY\x01\x00\x10\x00{", 11) == 0, "writing bad.npy");
    attn_tensor t;
    CHECK_STATUS(attn_npy_load(path, &t), ATTN_ERR_FORMAT);
    CHECK(strstr(attn_last_error(), "truncated") && strstr(attn_last_error(), "/bad.npy"),
          "message lacks the reason or the path: ...%s", attn_last_error() + 3900);
    vector(&t, 3);
    snprintf(path + used, sizeof path - used, "/nodir/x.npy");
    CHECK_STATUS(attn_npy_save(path, &t), ATTN_ERR_IO);
    CHECK(strstr(attn_last_error(), strerror(ENOENT)) && strstr(attn_last_error(), "nodir/x.npy"),
          "message lacks the reason or the path: ...%s", attn_last_error() + 3900);
    memset(path, 'a', 9000);
    path[9000] = '\0';
    CHECK_STATUS(attn_npy_save(path, &t), ATTN_ERR_IO);
    CHECK(strstr(attn_last_error(), strerror(ENAMETOOLONG)) != NULL,
          "message lacks the reason: ...%s", attn_last_error() + strlen(attn_last_error()) - 80);
    attn_tensor back;
    CHECK_STATUS(attn_npy_load(path, &back), ATTN_ERR_IO);
    CHECK(strstr(attn_last_error(), strerror(ENAMETOOLONG)) != NULL,
          "message lacks the reason: ...%s", attn_last_error() + strlen(attn_last_error()) - 80);
    free(t.data);
    tt_remove_tree(root);
}

HARNESS_MAIN(T(numpy_fixtures), T(read_header), T(every_truncation_fails), T(round_trips),
             T(failed_save_keeps_old_file), T(save_through_links_and_fifos),
             T(long_paths_keep_the_reason))
