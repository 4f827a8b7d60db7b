/*
 * npy_write.c — writing .npy files: the serializer (any strided tensor, to a
 * file descriptor) and attn_npy_save, which replaces its target atomically
 * (atomic.c: temporary, fsync, rename).
 */
#include <stdio.h>
#include <string.h>

#include "io.h"

/* The header: magic, version 1.0, length, then the dictionary padded with
 * spaces so that the data starts on a 64-byte boundary (as NumPy does).
 * Eight dimensions of 19 digits fit in ATTN__NPY_MAX_PREAMBLE bytes. */
size_t attn__npy_preamble(attn_dtype dtype, int rank, const int64_t *shape, unsigned char *out) {
    const char *descr = dtype == ATTN_DTYPE_F32   ? "<f4"
                        : dtype == ATTN_DTYPE_F64 ? "<f8"
                        : dtype == ATTN_DTYPE_F16 ? "<f2"
                                                  : "|b1";
    char shape_text[256];
    attn__shape_str(shape_text, sizeof shape_text, rank, shape);
    char *dict = (char *)out + 10;
    int n = snprintf(dict, ATTN__NPY_MAX_PREAMBLE - 10,
                     "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", descr, shape_text);
    size_t total = 10 + (size_t)n + 1;
    size_t pad = (64 - total % 64) % 64;
    memset(dict + n, ' ', pad);
    dict[(size_t)n + pad] = '\n';
    size_t hlen = (size_t)n + pad + 1;
    const unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
                                   (unsigned char)(hlen & 0xff), (unsigned char)(hlen >> 8)};
    memcpy(out, pre, sizeof pre);
    return 10 + hlen;
}

/* The whole file to fd: elements in C order through the strides,
 * little-endian, in 16 KiB writes. Returns 0 or an errno value. */
static int write_npy(int fd, const attn_tensor *t) {
    unsigned char chunk[1 << 14];
    size_t used = attn__npy_preamble(t->dtype, t->rank, t->shape, chunk);
    size_t es = attn_dtype_size(t->dtype);
    int64_t numel = attn_tensor_numel(t), idx[ATTN_MAX_RANK] = {0};
    const bool big = *(const unsigned char *)&(uint16_t){1} == 0;
    int err = 0;
    for (int64_t i = 0; err == 0 && i < numel; i++) {
        int64_t off = 0;
        for (int d = 0; d < t->rank; d++) off += idx[d] * t->strides[d];
        const unsigned char *src = (const unsigned char *)t->data + off * (int64_t)es;
        for (size_t k = 0; k < es; k++) chunk[used + k] = src[big ? es - 1 - k : k];
        if (t->dtype == ATTN_DTYPE_BOOL) chunk[used] = chunk[used] != 0;
        used += es;
        if (used + 8 > sizeof chunk) {
            err = attn__write_all(fd, chunk, used);
            used = 0;
        }
        for (int d = t->rank - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d]) break;
            idx[d] = 0;
        }
    }
    if (err == 0 && used > 0) err = attn__write_all(fd, chunk, used);
    return err;
}

/* A tensor .npy can hold: float32, float64, float16 or bool (the descr
 * written). NumPy has no bfloat16 descr. */
static attn_status check_npy_tensor(const attn_tensor *t) {
    attn_status st = attn__check_tensor(t, "tensor", 1, ATTN__INPUT);
    if (st == ATTN_OK && (t->dtype == ATTN_DTYPE_BF16 || t->dtype == ATTN_DTYPE_I32))
        return attn__fail_arg(ATTN_ERR_DTYPE, "tensor",
                              "tensor is %s; attn writes .npy files of float32, float64, "
                              "float16 or bool (save bfloat16 with attn_safetensors_save)",
                              attn_dtype_name(t->dtype));
    return st;
}

attn_status attn_npy_write_fd(int fd, const attn_tensor *t) {
    attn__clear_error();
    attn_status st = check_npy_tensor(t);
    if (st != ATTN_OK) return st;
    if (fd < 0) return attn__fail(ATTN_ERR_INVALID, "fd is %d, not an open file descriptor", fd);
    int err = write_npy(fd, t);
    if (err != 0) return attn__fail(ATTN_ERR_IO, "cannot write the .npy data: %s", strerror(err));
    return ATTN_OK;
}

/* attn__save_atomic's writer. */
static int write_npy_ctx(int fd, const void *t) { return write_npy(fd, t); }

attn_status attn_npy_save(const char *path, const attn_tensor *t) {
    attn__clear_error();
    if (path == NULL) return attn__fail(ATTN_ERR_NULL, "path is NULL");
    attn_status st = check_npy_tensor(t);
    if (st != ATTN_OK) return st;
    return attn__save_atomic(path, write_npy_ctx, t);
}
