/*
 * attn_ring.h — ring attention over MPI: one attention whose sequence is
 * split over the ranks of a communicator.
 *
 * An optional library (libattn_ring), built when CMake finds MPI; libattn
 * itself has no MPI dependency. attn_ring is written on libattn's public API
 * (attn_sdpa on slices of the whole attention, attn_sdpa_merge), so its
 * results, errors (attn_last_error, attn_last_error_arg) and settings
 * (attn_set_num_threads, ATTN_ISA) are libattn's. Link both: pkg-config
 * attn_ring, or find_package(attn) and attn::attn_ring.
 *
 * The idea (Liu et al., "Ring Attention with Blockwise Transformers", 2023):
 * every rank holds a shard of the sequence of q (its queries) and of k and v
 * (its keys and values). Over N steps the K/V shards travel round the ring
 * (rank r sends to r + 1 and receives from r - 1, non-blocking, the next
 * shard's transfer overlapped with the compute on the current one); each
 * rank attends its queries to every shard as it passes and merges the parts
 * by log-sum-exp. Attention is exact: the result on each rank is its shard
 * of attn_sdpa on the whole tensors, within float32 rounding, and bitwise
 * the same from run to run for a fixed number of ranks (the parts merge in
 * a fixed order, in float64). Every dtype attn_sdpa takes works, under its
 * rules: float16 / bfloat16 operands travel as they are, the steps compute
 * in float32 on their values (never rounding a part to 16 bits: the ring
 * keeps float32 products even on the avx512_bf16 path) and each 16-bit
 * result is rounded once, at the end.
 *
 * Shards. The sequence dimension is dim -2 of q, k and v (L and S); every
 * other dimension (batch, heads, E, Ev) is the same on every rank. A rank's
 * shard holds the positions its layout gives it, in increasing order:
 *   ATTN_RING_ZIGZAG (the default): T positions cut into 2N chunks, chunk c
 *     = [c·T / (2N), (c + 1)·T / (2N)) (integer division); rank r holds
 *     chunks r and 2N - 1 - r. Each rank then has an early and a late part
 *     of the sequence, so causal work is balanced over the ranks (Brandon et
 *     al., "Striped Attention", and ring-flash-attention's zigzag).
 *   ATTN_RING_CONTIGUOUS: rank r holds one run, the runs in rank order; any
 *     lengths >= 1 (each rank's shard length is the length of its tensor).
 * q and k/v may have different totals (cross-attention, bottom-right causal
 * alignment): each is split by the same layout on its own total. Every rank
 * must hold at least one query and one key: T >= 2N for ZIGZAG (T >= N for
 * CONTIGUOUS) is refused otherwise.
 *
 * Masks, dropout, causality are those of the whole attention: causal
 * alignment and the dropout keep mask use global positions (attn_sdpa's
 * slice fields), so dropout draws exactly the mask of the single-process
 * call with the same seed and rng_offset.
 *
 * Agreement: before any compute, the ranks exchange a description of their
 * call (dtypes, shapes but the sequence length, every parameter) and all of
 * them fail with ATTN_ERR_SHAPE / ATTN_ERR_INVALID / ATTN_ERR_DTYPE naming the
 * first rank that differs, when one does; shard lengths must be those of the
 * layout.
 *
 * Faults: every wait (the agreement, each shard) is bounded by
 * params.timeout seconds. A peer that does not answer in time (killed, hung,
 * partitioned) makes the call fail with ATTN_ERR_COMM naming the peer, the
 * step and the timeout; MPI errors on the ring's communicator are returned
 * the same way (the ring sets MPI_ERRORS_RETURN on its own duplicate of
 * comm, never on the caller's). After ATTN_ERR_COMM the job is broken: call
 * MPI_Abort. Under mpirun a rank that dies also makes mpirun end the job.
 * The duplicate is made by the first call on comm and kept as an attribute
 * of comm (freed when comm is freed), so only that first call has a
 * collective wait (MPI_Comm_idup), whose timeout cannot say which rank is
 * missing; every later wait is on one peer and names it.
 *
 * Threads: each rank computes with libattn's threads (attn_set_num_threads;
 * give each rank its share of the cores). MPI must be initialised; a
 * communicator of one rank computes locally with no messages.
 */
#ifndef ATTN_RING_H
#define ATTN_RING_H

#include <mpi.h>

#include "attn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum attn_ring_layout {
    ATTN_RING_ZIGZAG = 0,
    ATTN_RING_CONTIGUOUS = 1
} attn_ring_layout;

/* Where a call's time went, on this rank (seconds, wall clock). A step is one
 * K/V shard: its compute, and the time spent waiting for the next shard after
 * the compute ended (the transfer the compute did not hide). */
typedef struct attn_ring_stats {
    int steps;                 /* N                                         */
    double total;              /* the whole call                            */
    double agree;              /* the agreement exchange                    */
    double compute;            /* attention and merges, all steps           */
    double wait;               /* waiting on messages, all steps            */
    double step_compute[64];   /* per step, for the first 64 steps          */
    double step_wait[64];
    int64_t bytes_sent;        /* K/V (and dK/dV) bytes this rank sent      */
} attn_ring_stats;

typedef struct attn_ring_params {
    size_t struct_size;        /* sizeof(attn_ring_params); set by _init    */
    /* causal, scale, enable_gqa, dropout_p, seed, rng_offset,
     * lse_for_backward, arg_names: as attn_sdpa's, over the whole sequence.
     * sdpa.attn_mask must be NULL (a full L x S mask cannot be split by
     * keys without travelling; use key_mask), and so must its slice fields
     * (the ring sets them). */
    attn_sdpa_params sdpa;
    /* This rank's keys' mask, or NULL: shape (..., 1, S_shard), broadcast
     * over (B..., Hq, L_shard, S_shard) like attn_sdpa's attn_mask (the
     * dimension of size 1 is the queries'): bool (true = the key takes
     * part) or float (added). It travels with its K/V shard. Its dtype and
     * shape but S_shard must agree over the ranks. */
    const attn_tensor *key_mask;
    attn_ring_layout layout;   /* default ATTN_RING_ZIGZAG                  */
    double timeout;            /* seconds per wait, > 0; default 60          */
    attn_ring_stats *stats;    /* optional: filled on success               */
} attn_ring_params;

/* Defaults: attn_sdpa's, no key mask, zigzag, 60 s, no stats. */
ATTN_API void attn_ring_params_init(attn_ring_params *params);

/* Ring attention forward. q, k, v are this rank's shards:
 *   q (..., Hq, L_shard, E), k (..., H, S_shard, E), v (..., H, S_shard, Ev)
 *   out (B..., Hq, L_shard, Ev)   required, q's dtype
 *   lse (B..., Hq, L_shard)       optional: float32 (float64 queries:
 *                                 float64) or float64; the whole
 *                                 row's log-sum-exp (for the backward)
 * Collective over comm (an intracommunicator; an intercommunicator is
 * ATTN_ERR_INVALID naming comm): every rank must call it. */
ATTN_API attn_status attn_ring_sdpa(MPI_Comm comm, const attn_tensor *q, const attn_tensor *k,
                                    const attn_tensor *v, const attn_ring_params *params,
                                    attn_tensor *out, attn_tensor *lse);

/* Ring attention backward: attn_sdpa_backward over the whole sequence. From
 * this rank's dout, q, k, v, out and lse (what attn_ring_sdpa gave, best with
 * sdpa.lse_for_backward and a float64 lse), computes this rank's dq, dk, dv
 * (each optional, shaped like its input). K/V shards travel as in the
 * forward, each with its dK/dV sum (float64), which returns home after the
 * last step. Dropout is replayed from the same seed and rng_offset.
 * Collective over comm. */
ATTN_API attn_status attn_ring_sdpa_backward(MPI_Comm comm, const attn_tensor *dout,
                                             const attn_tensor *q, const attn_tensor *k,
                                             const attn_tensor *v, const attn_tensor *out,
                                             const attn_tensor *lse,
                                             const attn_ring_params *params, attn_tensor *dq,
                                             attn_tensor *dk, attn_tensor *dv);

/* The positions rank `rank` of `nranks` holds of a sequence of `total`
 * under `layout` (CONTIGUOUS: the even split, rank r holding
 * [r·T/N, (r + 1)·T/N)): *nruns runs (1 or 2) starting at start[i] with
 * len[i] positions, in the order the shard holds them. ATTN_ERR_INVALID when
 * some rank would hold no position. */
ATTN_API attn_status attn_ring_shard_runs(attn_ring_layout layout, int64_t total, int nranks,
                                          int rank, int *nruns, int64_t start[2],
                                          int64_t len[2]);

/* Copies rank `rank`'s shard of `whole` along dimension `dim` (negative
 * counts from the end; the sequence is dim -2) into `shard`, whose shape is
 * whole's with that dimension the shard's length (attn_ring_shard_runs).
 * attn_ring_unshard writes a shard back into its place in `whole`. Same
 * dtype on both sides (any attn dtype); strides as attn_tensor allows. */
ATTN_API attn_status attn_ring_shard(const attn_tensor *whole, int dim, attn_ring_layout layout,
                                     int nranks, int rank, attn_tensor *shard);
ATTN_API attn_status attn_ring_unshard(const attn_tensor *shard, int dim,
                                       attn_ring_layout layout, int nranks, int rank,
                                       attn_tensor *whole);

#ifdef __cplusplus
}
#endif

#endif /* ATTN_RING_H */
