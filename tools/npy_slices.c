/*
 * npy_slices.c — a shard of a .npy file, read or written by offset.
 *
 * In C order, the positions [start, start + len) of dimension d are, for
 * each index of the dimensions before d, one contiguous block of
 * len × (elements after d) elements: a shard of two runs is 2 × (elements
 * before d) preads or pwrites, straight from or into the shard's buffer.
 * The header is parsed by the library's .npy parser (io/io.h), which also
 * checks that the data is as long as the header says, so every offset
 * computed here lies inside the file.
 */
#define _FILE_OFFSET_BITS 64       /* files above 2 GiB on 32-bit systems */
#define _POSIX_C_SOURCE 200809L    /* pread, pwrite, ftruncate */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io/io.h"
#include "npy_slices.h"

static bool host_big_endian(void) { return *(const unsigned char *)&(uint16_t){1} == 0; }

/* Refuses what cannot be read by offset into a tensor of this machine. */
static const char *unreadable(const attn__npy_header *h) {
    if (h->dtype != ATTN_DTYPE_F32 && h->dtype != ATTN_DTYPE_F64 && h->dtype != ATTN_DTYPE_F16)
        return "holds bool; sdpa needs float32, float64 or float16";
    if (h->fortran)
        return "is in Fortran order; --ring reads C-order files by offset (save the array "
               "with np.ascontiguousarray)";
    if (h->big_endian != host_big_endian())
        return host_big_endian() ? "is little-endian; --ring reads files in this machine's "
                                   "byte order (big-endian)"
                                 : "is big-endian; --ring reads files in this machine's byte "
                                   "order (little-endian: dtype '<f4' or '<f8')";
    if (h->rank < 2) return "holds fewer than 2 dimensions; sdpa needs (..., L, E)";
    return NULL;
}

int npy_source_open(npy_source *src, const char *option, const char *path, char *err,
                    size_t err_size) {
    memset(src, 0, sizeof *src);
    src->option = option;
    src->path = path;
    src->fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC); /* a FIFO: never a wait */
    if (src->fd < 0) {
        snprintf(err, err_size, "attn: reading %s: cannot open '%s': %s", option, path,
                 strerror(errno));
        return -1;
    }
    attn__npy_header h;
    if (attn__npy_read_header_fd(src->fd, path, &h) != ATTN_OK) {
        snprintf(err, err_size, "attn: reading %s: %s", option, attn_last_error());
        return -1;
    }
    const char *why = unreadable(&h);
    if (why != NULL) {
        snprintf(err, err_size, "attn: reading %s: '%s' %s", option, path, why);
        return -1;
    }
    src->dtype = h.dtype;
    src->rank = h.rank;
    memcpy(src->shape, h.shape, sizeof h.shape);
    src->data_offset = h.data_offset;
    return 0;
}

void npy_source_close(npy_source *src) {
    if (src->fd >= 0) close(src->fd);
    src->fd = -1;
}

/* pread or pwrite of n bytes at `at`, whole: a call may move fewer. Returns
 * 0, an errno value, or -1 when a read meets the end of the file. */
static int move_all(int fd, bool writing, unsigned char *buf, size_t n, off_t at) {
    while (n > 0) {
        ssize_t r = writing ? pwrite(fd, buf, n, at) : pread(fd, buf, n, at);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) return writing ? EIO : -1;
        buf += r;
        n -= (size_t)r;
        at += r;
    }
    return 0;
}

/* Moves the runs of dimension dim between the file (data at `base`) and
 * the shard's C-contiguous buffer. */
static int transfer(int fd, bool writing, int64_t base, attn_dtype dtype, int rank,
                    const int64_t *shape, int dim, const npy_runs *runs, unsigned char *buf) {
    const int64_t es = (int64_t)attn_dtype_size(dtype);
    int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim; d++) outer *= shape[d];
    for (int d = dim + 1; d < rank; d++) inner *= shape[d];
    for (int64_t o = 0; o < outer; o++) {
        for (int i = 0; i < runs->nruns; i++) {
            const int64_t n = runs->len[i] * inner * es;
            const int64_t at = base + ((o * shape[dim] + runs->start[i]) * inner) * es;
            int err = move_all(fd, writing, buf, (size_t)n, (off_t)at);
            if (err != 0) return err;
            buf += n;
        }
    }
    return 0;
}

int npy_source_read(const npy_source *src, int dim, const npy_runs *runs, attn_tensor *t,
                    char *err, size_t err_size) {
    int64_t shape[ATTN_MAX_RANK];
    memcpy(shape, src->shape, sizeof shape);
    shape[dim] = runs->count;
    int64_t n = 1;
    for (int d = 0; d < src->rank; d++) n *= shape[d];
    void *data = malloc((size_t)n * attn_dtype_size(src->dtype));
    if (data == NULL || attn_tensor_init(t, data, src->dtype, src->rank, shape) != ATTN_OK) {
        free(data);
        snprintf(err, err_size, "attn: reading %s: no memory for this rank's %lld elements",
                 src->option, (long long)n);
        return -1;
    }
    int e = transfer(src->fd, false, src->data_offset, src->dtype, src->rank, src->shape, dim,
                     runs, data);
    if (e != 0) {
        free(data);
        t->data = NULL;
        snprintf(err, err_size, "attn: reading %s: cannot read '%s': %s", src->option, src->path,
                 e < 0 ? "the file ended early (it changed while being read)" : strerror(e));
        return -1;
    }
    return 0;
}

const char *npy_frame_write(int fd, const void *frame) {
    const npy_frame *f = frame;
    unsigned char head[ATTN__NPY_MAX_PREAMBLE];
    const size_t len = attn__npy_preamble(f->dtype, f->rank, f->shape, head);
    int64_t size = (int64_t)attn_dtype_size(f->dtype);
    for (int d = 0; d < f->rank; d++) size *= f->shape[d];
    int err = attn__write_all(fd, head, len);
    /* The data's bytes, as a hole each rank fills with its part. */
    if (err == 0 && ftruncate(fd, (off_t)((int64_t)len + size)) != 0) err = errno;
    return err == 0 ? NULL : strerror(err);
}

int npy_frame_write_runs(int fd, const npy_frame *frame, int dim, const npy_runs *runs,
                         const attn_tensor *t) {
    unsigned char head[ATTN__NPY_MAX_PREAMBLE];
    const size_t len = attn__npy_preamble(frame->dtype, frame->rank, frame->shape, head);
    int e = transfer(fd, true, (int64_t)len, frame->dtype, frame->rank, frame->shape, dim, runs,
                     t->data);
    return e < 0 ? EIO : e;
}
