/*
 * npy_slices.h — parts of .npy files, read and written at their offsets:
 * a rank's shard along one dimension (`attn sdpa --ring`), so that no rank
 * reads or writes a whole tensor. No MPI here.
 */
#ifndef ATTN_NPY_SLICES_H
#define ATTN_NPY_SLICES_H

#include <stddef.h>
#include <stdint.h>

#include "attn.h"

/* Positions along one dimension: the runs attn_ring_shard_runs gives. */
typedef struct npy_runs {
    int nruns;
    int64_t start[2], len[2];
    int64_t count; /* the shard's length: the runs' lengths added */
} npy_runs;

/* An input file, open for reads by offset. */
typedef struct npy_source {
    const char *option, *path;
    int fd;
    attn_dtype dtype;
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    int64_t data_offset;
} npy_source;

/* Opens path and reads its header: a C-order float32 or float64 array in
 * this machine's byte order with 2 to ATTN_MAX_RANK dimensions, whose data
 * is all there. 0, or -1 with the reason in err ("attn: reading -q: ..."). */
int npy_source_open(npy_source *src, const char *option, const char *path, char *err,
                    size_t err_size);
void npy_source_close(npy_source *src);

/* Reads the runs of dimension `dim` (every other dimension whole) into t,
 * a new C-contiguous tensor whose data the caller frees. 0, or -1 with the
 * reason in err. */
int npy_source_read(const npy_source *src, int dim, const npy_runs *runs, attn_tensor *t,
                    char *err, size_t err_size);

/* An output file's frame: its header and size, for outputs_stage_with
 * (npy_frame_write writes the header and sets the file's full size, so
 * that every part can then be written at its offset). */
typedef struct npy_frame {
    attn_dtype dtype;
    int rank;
    int64_t shape[ATTN_MAX_RANK];
} npy_frame;
const char *npy_frame_write(int fd, const void *frame);

/* Writes t, the frame's tensor with dimension `dim` cut to the runs
 * (C-contiguous), at its offsets in the file open on fd. Returns 0 or an
 * errno value. */
int npy_frame_write_runs(int fd, const npy_frame *frame, int dim, const npy_runs *runs,
                         const attn_tensor *t);

#endif
