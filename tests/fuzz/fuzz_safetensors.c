/*
 * fuzz_safetensors.c — the safetensors reader on arbitrary bytes.
 *
 *  - attn_safetensors_parse on the input (an exactly sized heap block, so
 *    ASan sees any over-read);
 *  - for about one input in four, the same bytes through a file and
 *    attn_safetensors_open: the same status;
 *  - every tensor of an accepted file is listed, looked up by name, viewed,
 *    read (in its own dtype and, for floats, as float64) and its raw bytes
 *    compared with the read;
 *  - the tensors attn reads and the metadata are written back with
 *    attn_safetensors_write_fd (attn_safetensors_save's serializer; its
 *    temporary-and-rename is tested in test_safetensors) and parsed again:
 *    the same names, dtypes, shapes, bytes and metadata.
 * Invariants: status and message agree; a failed parse leaves no handle
 * and no allocation; nothing outlives attn_safetensors_close.
 */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <unistd.h>

#include "fuzz_util.h"

static char path[64];

static void remove_file(void) { remove(path); }

static unsigned char *slurp(const char *p, size_t *size) {
    FILE *f = fopen(p, "rb");
    FZ_ASSERT(f != NULL, "cannot open %s", p);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(n > 0 ? (size_t)n : 1);
    FZ_ASSERT(b != NULL && fread(b, 1, (size_t)n, f) == (size_t)n, "cannot read %s", p);
    fclose(f);
    *size = (size_t)n;
    return b;
}

static int64_t numel_of(const attn_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->rank; d++) n *= t->shape[d];
    return n;
}

/* One tensor: info, find, raw, read, get agree. Returns its read copy
 * (caller frees) or a zeroed tensor when attn does not read it. */
static attn_tensor check_tensor(attn_safetensors *f, int64_t i, size_t input_size) {
    const char *name, *fdt;
    attn_dtype dt;
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    fz_check_status(attn_safetensors_info(f, i, &name, &fdt, &dt, &rank, shape), "info");
    FZ_ASSERT(attn_safetensors_find(f, name) == i, "find('%s') is not %lld", name, (long long)i);
    const void *raw;
    uint64_t size;
    fz_check_status(attn_safetensors_raw(f, name, &raw, &size), "raw");
    FZ_ASSERT(size <= input_size, "%llu raw bytes from a %zu-byte input",
              (unsigned long long)size, input_size);
    attn_tensor t, v, wide;
    attn_status st = attn_safetensors_read(f, name, 0, &t);
    fz_check_status(st, "read");
    if (st != ATTN_OK) {
        FZ_ASSERT(t.data == NULL, "a failed read left data");
        FZ_ASSERT(st == ATTN_ERR_DTYPE || st == ATTN_ERR_SHAPE || st == ATTN_ERR_NOMEM,
                  "read of '%s' (%s, rank %d) failed with %d: %s", name, fdt, rank, (int)st,
                  attn_last_error());
        return t;
    }
    FZ_ASSERT(t.dtype == dt && t.rank == rank, "read changed the dtype or rank");
    const size_t es = attn_dtype_size(dt), bytes = (size_t)numel_of(&t) * es;
    FZ_ASSERT(bytes == size, "read %zu bytes, raw %llu", bytes, (unsigned long long)size);
    if (dt == ATTN_DTYPE_BOOL)
        for (size_t k = 0; k < bytes; k++)
            FZ_ASSERT(((unsigned char *)t.data)[k] == (((const unsigned char *)raw)[k] != 0),
                      "bool byte %zu", k);
    else /* little-endian host: the file's bytes */
        FZ_ASSERT(memcmp(t.data, raw, bytes) == 0, "read and raw bytes differ");
    st = attn_safetensors_get(f, name, &v);
    fz_check_status(st, "get");
    FZ_ASSERT(st == ATTN_OK || st == ATTN_ERR_UNSUPPORTED, "get failed with %d", (int)st);
    if (st == ATTN_OK) FZ_ASSERT(v.data == raw, "the view is not the raw bytes");
    if (dt != ATTN_DTYPE_BOOL) {
        st = attn_safetensors_read(f, name, ATTN_DTYPE_F64, &wide);
        fz_check_status(st, "read as float64");
        if (st == ATTN_OK) {
            for (int64_t k = 0; k < numel_of(&wide) && dt == ATTN_DTYPE_F64; k++)
                FZ_ASSERT(memcmp((double *)wide.data + k, (double *)t.data + k, 8) == 0,
                          "float64 to float64 changed bits");
            attn_safetensors_free(&wide);
        }
    }
    return t;
}

/* Writes what attn reads of f back, parses it, compares. */
static void round_trip(attn_safetensors *f, attn_tensor *copies) {
    const int64_t n = attn_safetensors_count(f), nmeta = attn_safetensors_metadata_count(f);
    const char **names = calloc((size_t)n + 1, sizeof *names);
    attn_tensor *ts = calloc((size_t)n + 1, sizeof *ts);
    const char **meta = calloc(2 * (size_t)nmeta + 1, sizeof *meta);
    size_t count = 0;
    for (int64_t i = 0; i < n; i++)
        if (copies[i].data != NULL) {
            attn_safetensors_info(f, i, &names[count], NULL, NULL, NULL, NULL);
            ts[count++] = copies[i];
        }
    for (int64_t j = 0; j < nmeta; j++)
        attn_safetensors_metadata_at(f, j, &meta[2 * j], &meta[2 * j + 1]);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    FZ_ASSERT(fd >= 0, "cannot create %s", path);
    attn_status st = attn_safetensors_write_fd(fd, count, names, ts, meta);
    fz_check_status(st, "write_fd");
    FZ_ASSERT(st == ATTN_OK || st == ATTN_ERR_NOMEM, "what was read does not write: %s",
              attn_last_error());
    FZ_ASSERT(close(fd) == 0, "close");
    if (st == ATTN_OK) {
        size_t size;
        unsigned char *b = slurp(path, &size);
        attn_safetensors *g = NULL;
        st = attn_safetensors_parse(b, size, &g);
        fz_check_status(st, "parse (round trip)");
        FZ_ASSERT(st == ATTN_OK || st == ATTN_ERR_NOMEM, "a written file does not parse: %s",
                  attn_last_error());
        FZ_ASSERT(st != ATTN_OK || attn_safetensors_count(g) == (int64_t)count, "count");
        for (size_t i = 0; st == ATTN_OK && i < count; i++) {
            attn_tensor back;
            attn_status rs = attn_safetensors_read(g, names[i], 0, &back);
            if (rs == ATTN_ERR_NOMEM) continue;
            FZ_ASSERT(rs == ATTN_OK, "'%s' does not read back: %s", names[i], attn_last_error());
            FZ_ASSERT(back.dtype == ts[i].dtype && back.rank == ts[i].rank, "dtype or rank");
            for (int d = 0; d < back.rank; d++) FZ_ASSERT(back.shape[d] == ts[i].shape[d], "shape");
            FZ_ASSERT(memcmp(back.data, ts[i].data,
                             (size_t)numel_of(&back) * attn_dtype_size(back.dtype)) == 0,
                      "'%s' changed in the round trip", names[i]);
            attn_safetensors_free(&back);
        }
        for (int64_t j = 0; st == ATTN_OK && j < nmeta; j++) {
            const char *v = attn_safetensors_metadata(g, meta[2 * j]);
            FZ_ASSERT(v != NULL && strcmp(v, meta[2 * j + 1]) == 0, "metadata changed");
        }
        attn_safetensors_close(g);
        free(b);
    }
    free(names);
    free(ts);
    free(meta);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (path[0] == '\0') {
        fz_install_allocator((size_t)1 << 26);
        snprintf(path, sizeof path, "/tmp/attn_fuzz_st_%ld.safetensors", (long)getpid());
        atexit(remove_file);
    }
    attn_safetensors *f = NULL;
    attn_status st = attn_safetensors_parse(data, size, &f);
    fz_check_status(st, "attn_safetensors_parse");
    if (st != ATTN_OK) {
        FZ_ASSERT(f == NULL, "a failed parse left a handle");
        FZ_ASSERT(fz_live_blocks() == 0, "a failed parse leaked");
    }
    if (size > 0 && data[size - 1] % 4 == 0) { /* the same bytes through a file */
        FILE *out = fopen(path, "wb");
        FZ_ASSERT(out != NULL && fwrite(data, 1, size, out) == size && fclose(out) == 0,
                  "cannot write %s", path);
        attn_safetensors *g = NULL;
        attn_status st2 = attn_safetensors_open(path, &g);
        fz_check_status(st2, "attn_safetensors_open");
        FZ_ASSERT(st2 == st, "open gave %d, parse %d: %s", (int)st2, (int)st, attn_last_error());
        attn_safetensors_close(g);
    }
    if (st == ATTN_OK) {
        const int64_t n = attn_safetensors_count(f);
        attn_tensor *copies = calloc((size_t)n + 1, sizeof *copies);
        for (int64_t i = 0; i < n; i++) copies[i] = check_tensor(f, i, size);
        for (int64_t j = 0; j < attn_safetensors_metadata_count(f); j++) {
            const char *k, *v;
            fz_check_status(attn_safetensors_metadata_at(f, j, &k, &v), "metadata_at");
            FZ_ASSERT(attn_safetensors_metadata(f, k) == v, "metadata lookup of '%s'", k);
        }
        round_trip(f, copies);
        for (int64_t i = 0; i < n; i++) attn_safetensors_free(&copies[i]);
        free(copies);
    }
    attn_safetensors_close(f);
    FZ_ASSERT(fz_live_blocks() == 0, "%ld blocks outlive attn_safetensors_close",
              fz_live_blocks());
    return 0;
}
