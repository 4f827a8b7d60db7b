/*
 * test_npy.c — the .npy reader against files NumPy wrote (every version,
 * byte order and memory order we accept) and write/read round trips of
 * strided tensors.
 */
#define _POSIX_C_SOURCE 200809L /* mkstemp */
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
    /* A 0-d array reads as shape (1,). Its value is -1. */
    char path[512];
    snprintf(path, sizeof path, "%s/npy/f64_scalar.npy", ATTN_TEST_DATA);
    attn_tensor t;
    CHECK_OK(attn_npy_load(path, &t));
    CHECK(t.rank == 1 && t.shape[0] == 1 && ((double *)t.data)[0] == -1.0, "0-d array");
    attn_npy_free(&t);
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

HARNESS_MAIN(T(numpy_fixtures), T(every_truncation_fails), T(round_trips))
