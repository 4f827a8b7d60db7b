/*
 * fuzz_npy.c — the .npy reader on arbitrary bytes.
 *
 *  - attn_npy_parse on the input (libFuzzer hands it over in an exactly
 *    sized heap block, so ASan sees any over-read);
 *  - for about one input in four, the same bytes written to a file and read
 *    with attn_npy_load: same status, same tensor;
 *  - every accepted array is written back with attn_npy_write_fd (the
 *    serializer of attn_npy_save, whose fsync per call would slow fuzzing
 *    several times; its temporary-and-rename is tested in test_npy) and read
 *    again: the same shape, dtype and bytes.
 * Invariants: status and message agree; an accepted array has a valid rank,
 * shape and dtype, fits in the input, holds only 0/1 when bool; nothing the
 * library allocates outlives attn_npy_free.
 */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <unistd.h>

#include "fuzz_util.h"

static char path[64];

static void remove_file(void) { remove(path); }

static void write_file(const char *p, const uint8_t *data, size_t size) {
    FILE *f = fopen(p, "wb");
    FZ_ASSERT(f != NULL, "cannot create %s", p);
    FZ_ASSERT(fwrite(data, 1, size, f) == size, "short write");
    FZ_ASSERT(fclose(f) == 0, "close");
}

static void check_tensor(const attn_tensor *t, size_t input_size) {
    FZ_ASSERT(t->rank >= 1 && t->rank <= ATTN_MAX_RANK, "rank %d", t->rank);
    FZ_ASSERT(t->data != NULL, "no data");
    size_t es = attn_dtype_size(t->dtype);
    FZ_ASSERT(es != 0, "dtype %d", (int)t->dtype);
    int64_t n = attn_tensor_numel(t);
    FZ_ASSERT(n >= 1, "numel %lld", (long long)n);
    FZ_ASSERT((uint64_t)n * es + 10 <= input_size, "%lld elements from %zu bytes", (long long)n,
              input_size);
    int64_t stride = 1;
    for (int d = t->rank - 1; d >= 0; d--) { /* C-contiguous */
        FZ_ASSERT(t->strides[d] == stride, "stride %d", d);
        stride *= t->shape[d];
    }
    if (t->dtype == ATTN_DTYPE_BOOL)
        for (int64_t i = 0; i < n; i++)
            FZ_ASSERT(((const unsigned char *)t->data)[i] <= 1, "bool byte %d",
                      ((const unsigned char *)t->data)[i]);
}

static bool same_tensor(const attn_tensor *a, const attn_tensor *b) {
    if (a->rank != b->rank || a->dtype != b->dtype) return false;
    for (int d = 0; d < a->rank; d++)
        if (a->shape[d] != b->shape[d] || a->strides[d] != b->strides[d]) return false;
    return memcmp(a->data, b->data, (size_t)attn_tensor_numel(a) * attn_dtype_size(a->dtype)) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (path[0] == '\0') {
        fz_install_allocator((size_t)1 << 26);
        snprintf(path, sizeof path, "/tmp/attn_fuzz_npy_%ld.npy", (long)getpid());
        atexit(remove_file);
    }
    attn_tensor t;
    attn_status st = attn_npy_parse(data, size, &t);
    fz_check_status(st, "attn_npy_parse");
    char parse_msg[512];
    snprintf(parse_msg, sizeof parse_msg, "%s", attn_last_error());
    if (st != ATTN_OK) {
        FZ_ASSERT(t.data == NULL && t.rank == 0, "a failed parse left a tensor");
        FZ_ASSERT(fz_live_blocks() == 0, "a failed parse leaked");
    } else {
        check_tensor(&t, size);
    }

    /* The same bytes through a file. */
    if (size > 0 && data[size - 1] % 4 == 0) {
        write_file(path, data, size);
        attn_tensor u;
        attn_status st2 = attn_npy_load(path, &u);
        fz_check_status(st2, "attn_npy_load");
        FZ_ASSERT(st2 == st, "attn_npy_load gave %d, attn_npy_parse %d", (int)st2, (int)st);
        if (st != ATTN_OK)
            FZ_ASSERT(strstr(attn_last_error(), parse_msg) != NULL,
                      "load's message '%s' lacks parse's '%s'", attn_last_error(), parse_msg);
        else
            FZ_ASSERT(same_tensor(&t, &u), "attn_npy_load and attn_npy_parse disagree");
        attn_npy_free(&u);
    }

    /* Accepted arrays survive a write and a read. */
    if (st == ATTN_OK) {
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        FZ_ASSERT(fd >= 0, "cannot create %s", path);
        fz_check_status(attn_npy_write_fd(fd, &t), "attn_npy_write_fd");
        FZ_ASSERT(close(fd) == 0, "close");
        attn_tensor back;
        attn_status st3 = attn_npy_load(path, &back);
        fz_check_status(st3, "attn_npy_load (round trip)");
        FZ_ASSERT(st3 == ATTN_OK, "a saved array does not load back: %s", attn_last_error());
        FZ_ASSERT(same_tensor(&t, &back), "the round trip changed the array");
        attn_npy_free(&back);
    }
    attn_npy_free(&t);
    FZ_ASSERT(t.data == NULL, "attn_npy_free left the pointer");
    FZ_ASSERT(fz_live_blocks() == 0, "%ld blocks outlive attn_npy_free", fz_live_blocks());
    return 0;
}
