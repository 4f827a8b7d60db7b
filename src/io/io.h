/*
 * io.h — what the file formats share: whole writes to a descriptor, the
 * atomic replacement of a file (atomic.c), the .npy preamble read from and
 * written to a descriptor (npy.c, npy_write.c: for readers and writers of
 * parts of a file, such as `attn sdpa --ring`), and the safetensors dtype
 * table and view checks (safetensors.c) that its writer reuses.
 */
#ifndef ATTN_IO_IO_H
#define ATTN_IO_IO_H

#include "../core/internal.h"

/* write(2) until done: a signal or a pipe may cut a write short. Returns 0
 * or an errno value. */
int attn__write_all(int fd, const void *bytes, size_t n);

/* The file a write to path creates when path is a symbolic link (or a
 * chain of them) whose target is not there: its path in out (cap bytes).
 * Returns 0, ENOENT when path is no link, or an errno value (ELOOP, ...). */
int attn__dangling_link_target(const char *path, char *out, size_t cap);

/* Opens an existing non-regular file (a device, a FIFO) for writing in
 * place into *fd (blocking, close-on-exec); returns 0 or an errno value. A
 * FIFO waits at most ATTN__FIFO_READER_WAIT_MS for a process to open it
 * for reading, then gives ENXIO: open(2) would wait for good, and with no
 * reader coming the caller hung (as a FIFO input without a writer did). */
#define ATTN__FIFO_READER_WAIT_MS 5000
int attn__open_in_place(const char *path, int *fd);

/* What went wrong opening path in place: strerror(err), or for ENXIO on a
 * FIFO, that no process reads it. */
const char *attn__in_place_error(const char *path, int err);

/* Writes a whole file to fd; returns 0 or an errno value. */
typedef int (*attn__file_writer)(int fd, const void *ctx);

/* Replaces path with what `writer` produces, atomically: a temporary file in
 * path's folder (".NAME.XXXXXXXX.tmp"), fsync, rename over path. Symbolic
 * links are followed, an existing non-regular file (/dev/null, a FIFO) is
 * written in place, a folder is never replaced; the new file keeps the old
 * one's permission bits (and owner, where allowed). ATTN_ERR_IO with the
 * step, the path and the system's reason; path is then as it was and the
 * temporary removed. */
attn_status attn__save_atomic(const char *path, attn__file_writer writer, const void *ctx);

/* ---- .npy (npy.c, npy_write.c) ---- */

/* What a .npy file's preamble says. */
typedef struct attn__npy_header {
    attn_dtype dtype;
    bool big_endian;
    bool fortran;
    int rank; /* 0 for a 0-d array */
    int64_t shape[ATTN_MAX_RANK];
    int64_t numel;
    int64_t data_offset; /* where the data starts */
} attn__npy_header;

/* Reads the preamble of the .npy file open on fd (by pread from offset 0:
 * fd's position is not used), and no more than the preamble, and checks
 * that fd is a regular file whose data is the size the header promises, so
 * that a reader of parts of the data can trust every offset. `path` names
 * the file in messages. ATTN_ERR_FORMAT / _DTYPE / _SHAPE as attn_npy_load,
 * ATTN_ERR_IO for a failed read. */
attn_status attn__npy_read_header_fd(int fd, const char *path, attn__npy_header *h);

/* The longest preamble attn__npy_preamble writes. */
#define ATTN__NPY_MAX_PREAMBLE 512

/* The preamble attn writes before the data of a little-endian, C-order
 * array (float32, float64 or bool) of this shape: into out, which holds at
 * least ATTN__NPY_MAX_PREAMBLE bytes; returns its length (a multiple of 64,
 * as NumPy pads it). */
size_t attn__npy_preamble(attn_dtype dtype, int rank, const int64_t *shape, unsigned char *out);

/* ---- safetensors (safetensors.c) ---- */

/* The longest header read or written: the reference implementation's limit,
 * far above any real header (a 7B model's is about 30 KB), small enough to
 * bound what a hostile file can make the parser allocate (about twice it). */
#define ATTN__ST_MAX_HEADER 100000000

/* A dtype the format names: its name, bits per element, attn's dtype (0
 * when attn has none). */
typedef struct attn__st_dtype {
    const char *name;
    int bits;
    attn_dtype dtype;
} attn__st_dtype;

/* The file's name for one of attn's dtypes ("F32", ..., "BF16"). */
const char *attn__st_dtype_name(attn_dtype dtype);

/* Whether bytes [s, s + n) are valid UTF-8 (no overlong forms, surrogates
 * or code points above U+10FFFF). */
bool attn__utf8_valid(const unsigned char *s, size_t n);

/* Checks a view the safetensors calls may take: rank 0 .. ATTN_MAX_RANK,
 * dimensions >= 0 (zero: an empty tensor, whose data may be NULL), a known
 * dtype, and for a non-empty tensor what attn__check_tensor checks (plus no
 * self-overlap for an output). *numel gets the element count. */
attn_status attn__st_check_view(const attn_tensor *t, const char *name, attn__role role,
                                int64_t *numel);

/* attn_safetensors_open without mmap: the file read into memory (the
 * fallback when mmap fails; tests call it to cover that path). */
attn_status attn__safetensors_open_read(const char *path, attn_safetensors **file);

#endif
