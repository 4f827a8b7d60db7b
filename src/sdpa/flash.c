/*
 * flash.c — the fused forward driver (see flash.h), written once and
 * instantiated for float and double by including flash_driver.inc twice.
 *
 * Work is split into tasks that never share an output row:
 *   (group, query block[, key chunk])
 * A group is a set of query heads that read the same K and V (one head, or a
 * GQA group of Hq/H heads, or heads over which K/V broadcast): its rows are
 * processed together so K and V are streamed once per group, not per head.
 * Decoding from a cache whose rows hold every K/V head, a group is all the
 * heads of a sequence (ganged decoding, gang_size): each cache row is then
 * read once, whole.
 * Each row's keys are always visited in the same order, so the result does
 * not depend on the thread count. When there are too few query blocks to
 * keep threads busy (decoding: few queries, many keys), keys are split into
 * chunks whose partial results are merged by log-sum-exp in chunk order; the
 * split depends only on the shape, never on the thread count.
 */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "../kernels/exp2.h"
#include "flash.h"
#include "../problem/lse_merge.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define LOG2E 1.4426950408889634
#define LN2 0.6931471805599453

/* ---- shape of the work, shared by both precisions ---- */

typedef struct flash_work {
    int64_t G;        /* query heads per group (a task's heads)            */
    int64_t ngroups;  /* nbatch / G                                        */
    int64_t nrows;    /* rows per group: G * L                             */
    int64_t gang;     /* K/V heads a group reads (1, or ganged decoding)   */
    int64_t kv_rows;  /* rows per K/V head: nrows / gang                   */
    bool direct;      /* few rows: keys-in-columns layout, K read in place */
    int64_t BR;       /* query rows per block                              */
    int64_t lanes;    /* queries-in-lanes layout: lanes of a block (BR)    */
    int64_t nqb;      /* query blocks per group                            */
    int64_t BC;       /* keys per block                                    */
    int64_t chunk;    /* keys per chunk                                    */
    int64_t nchunks;  /* 1 = no split                                      */
    bool across;      /* tasks ordered across groups (task_at)             */
} flash_work;

/* Heads that share K/V: only along the head (last batch) dimension. */
static int64_t group_size(const attn__problem *p) {
    if (p->nb == 0) return 1;
    const int hd = p->nb - 1;
    const int64_t H = p->bshape[hd];
    if (p->k.bstride[hd] == 0 && p->v.bstride[hd] == 0) return H;
    if (p->k.bdiv[hd] == p->v.bdiv[hd]) return p->k.bdiv[hd];
    return 1;
}

/* The largest |score| (natural units) a float32 row keeps in the fused
 * kernels; rows above it get float64 scores (see finish_row). */
#define F32_SCORE_LIMIT 256.0
/* The largest |lse| a float64 backward recomputes weights from: a double
 * lse is rounded by |lse|·2^-53, a relative error every weight of its row
 * takes (2e-13 here; 1e-12 at |lse| = 1e4, where a float64 evaluation that
 * never forms the lse errs ten times less). Above it: the reference. */
#define F64_LSE_LIMIT 2048.0

/* The |lse| from which a row's weights are not rebuilt from its lse by the
 * fused kernels (the backward, merged key chunks) for a compute type of
 * real_size bytes: F32_SCORE_LIMIT in float32, F64_LSE_LIMIT in float64. */
static double coarse_lse(size_t real_size) {
    return real_size == 4 ? F32_SCORE_LIMIT : F64_LSE_LIMIT;
}

/* Whether a head group of `nrows` query rows takes keys in columns (the
 * decoding layout): up to half the context's direct_rows always; up to
 * direct_rows only for decoding shapes, at most DECODE_TOKENS query tokens
 * a head (GQA groups, a few speculative tokens). Short prefills of 9-16
 * tokens a head take the queries-in-lanes tiles: (1,8,16,S,E) on Zen 5 took
 * 0.65-0.81x the time in lanes for S up to 2,048 (E = 128) and 4,096 (E =
 * 64); keys in columns won only once a head's K and V streamed from memory
 * (1.17x at 4 MiB a head), and 8 rows broke even up to 1,024 keys. Not
 * decided by S: a varlen or KV-cache batch must lay each sequence out as
 * that sequence's own call does (its bits), whatever the batch's longest. */
enum { DECODE_TOKENS = 4 };
static bool columns_for_rows(const attn__problem *p, int64_t nrows, const attn__ukernel *kern) {
    return nrows <= kern->direct_rows / 2 || (nrows <= kern->direct_rows && p->L <= DECODE_TOKENS);
}

/* How work is split across threads: the driver's, not an ISA's (the block
 * sizes are the context's, see ukernel.h). */
enum {
    TINY_WORK = 1 << 15, /* keys in columns also for calls of up to this
                            many multiply-adds (B·H·L·S·E)                */
    CHUNK_MIN = 1024,    /* keys per chunk, at least                       */
    MAX_CHUNKS = 64,     /* chunks per query block, at most, but for:      */
    CHUNK_MAX = 1 << 24, /* keys per chunk, at most: a float32 running sum
                            of weights <= 1 adds each key's term, and past
                            2^24 a term of 1 rounds away (2^24 + 1 is
                            2^24): flat weights over 2^25 keys gave 0.5
                            for 1. Chunks merge in float64.               */
    SPLIT_BELOW = 16,    /* split keys when there are fewer query blocks   */
    COLUMN_TASKS = 128,  /* keys in columns (decoding): split keys into
                            chunks of at least COLUMN_CHUNK_MIN until there
                            are this many tasks (64 threads: two each)     */
    COLUMN_CHUNK_MIN = 512,
    LOCAL_BLOCKS = 16    /* query blocks per thread from which tasks go
                            group by group (task_at)                      */
};

/* Pages of a paged KV cache at least this many rows long bound the key
 * blocks (read in place); shorter ones are gathered a block at a time. */
enum { PAGE_IN_PLACE_MIN = 64 };

/* Key blocks the fused kernels computed, forward and backward, since the
 * count was last read (tests check that the window and causality skip
 * blocks; relaxed atomics, one add per task). */
static _Atomic int64_t blocks_visited;

static void attn__count_blocks(int64_t n) {
    atomic_fetch_add_explicit(&blocks_visited, n, memory_order_relaxed);
}

int64_t attn__flash_blocks_visited(void) {
    return atomic_exchange_explicit(&blocks_visited, 0, memory_order_relaxed);
}

/* Ganged decoding: when the keys-in-columns layout runs on a cache whose
 * rows hold every K/V head of a token ((B, S, H_kv, E), as serving engines
 * keep it), one task takes all H_kv heads of a sequence and each key block
 * is copied once, row after row, into a buffer every head then reads from
 * cache. A task per head would read 512 bytes of each 4 KiB row, a stride
 * the hardware prefetchers do not follow (12% of the read bandwidth
 * measured on Zen 4, docs/design.md). Returns the K/V heads per task. */
static int64_t gang_size(const attn__problem *p, const flash_work *w) {
    if (!w->direct || p->nb == 0 || p->has_weights) return 1;
    const int hd = p->nb - 1;
    const int64_t kv_heads = p->bshape[hd] / w->G;
    const bool interleaved = p->k.bstride[hd] > 0 && p->k.bstride[hd] < p->k.rs &&
                             p->v.bstride[hd] > 0 && p->v.bstride[hd] < p->v.rs;
    const bool grouped = p->k.bdiv[hd] == w->G && p->v.bdiv[hd] == w->G;
    return kv_heads > 1 && interleaved && grouped ? kv_heads : 1;
}

/* Keys of a step of ganged decoding (gang_block): every head's share of
 * this many cache rows before the next rows, so the rows are read front to
 * back and no copy is needed; a multiple of the kernels' four-key score
 * groups, so each key's score is the same sum as in one call. */
enum { GANG_STEP = 8 };

/* Rows of a gang step: GANG_STEP rows of the compute type, twice as many
 * 16-bit rows (the same bytes, in the same buffer when copied). Each call
 * of the kernels then covers twice the keys for its fixed costs: a
 * bfloat16 decode is bound by instructions on AVX2, and 16 rows took
 * 0.89-0.93x the time of 8, 32 rows 1.02-1.04x that of 16 (Zen 3,
 * (1,32,1,16384,128), 8 KV heads). Scores are summed per four keys and
 * P·V adds keys in order, so the bits do not depend on the step. */
static int64_t gang_step(bool half) {
    return half ? 2 * GANG_STEP : GANG_STEP;
}

/* Rows ganged decoding requests ahead of its walk (gang_request). The walk
 * reads each head's slice of GANG_STEP rows, a pattern the prefetchers
 * follow poorly (attn_bench kv-read, Zen 4: 24 GB/s against a 33 GB/s
 * stream); whole rows requested in walk order make the misses one stream.
 * A/B on Zen 4: 16, 32 and 64 rows ahead alike, 96 slower. */
enum { GANG_AHEAD = 32 };

/* Rows ganged decoding requests into L1 where a step's run of rows in place
 * ends with the next step (a page's last step: gang_request): two steps.
 * Zen 5, pages of 16 rows: 3-6% faster than none, 2% faster than one step,
 * 3% faster than four. */
enum { GANG_EDGE = 2 * GANG_STEP };

/* Keys per block in the queries-in-lanes layout: the context's size for
 * the first width class that holds the head. */
static int64_t lanes_keys(const attn__ukernel *kern, int64_t width) {
    int c = 0;
    while (c < ATTN__KEY_BLOCK_CLASSES - 1 && width > kern->key_block[c].max_width) c++;
    return kern->key_block[c].keys;
}

/* Keys per chunk when keys are split (few query blocks; decoding), or S:
 * at least CHUNK_MIN and at most MAX_CHUNKS chunks, and in the
 * keys-in-columns layout smaller chunks (down to COLUMN_CHUNK_MIN) until
 * there are COLUMN_TASKS tasks: a decode step of 8 KV heads over 4,096
 * keys is then 64 tasks, not 32 (half of 64 threads idle). Shape only: the
 * chunks set the result's bits, so the thread count may not: `blocks`
 * counts the query blocks of the context's width, not of the narrower
 * blocks lanes_for may choose for many threads. */
static int64_t chunk_keys(const attn__problem *p, const flash_work *w, int64_t blocks) {
    const bool columns = w->direct && blocks < COLUMN_TASKS && p->S >= 2 * COLUMN_CHUNK_MIN;
    const bool lanes = blocks < SPLIT_BELOW && p->S >= 2 * CHUNK_MIN;
    const int64_t most = CHUNK_MAX / w->BC * w->BC;
    if (p->has_weights) return p->S;
    if (!(columns || lanes)) return p->S <= CHUNK_MAX ? p->S : most;
    int64_t chunk = (p->S + MAX_CHUNKS - 1) / MAX_CHUNKS;
    if (chunk < CHUNK_MIN) chunk = CHUNK_MIN;
    if (columns) {
        const int64_t wanted = (COLUMN_TASKS + blocks - 1) / blocks; /* chunks */
        int64_t small = (p->S + wanted - 1) / wanted;
        if (small < COLUMN_CHUNK_MIN) small = COLUMN_CHUNK_MIN;
        if (small < chunk) chunk = small;
    }
    chunk = (chunk + w->BC - 1) / w->BC * w->BC;
    return chunk <= most ? chunk : most;
}

/* Query rows per block in the queries-in-lanes layout on `threads`
 * threads: the context's lanes, or narrower blocks (a lane step less at a
 * time) when they end the work at least 5% sooner. Few blocks per thread
 * need them: (1,8,512,512,64) makes 88 blocks of 48 rows, which keep 64
 * threads 69% busy (128 blocks of 32 keep them all busy), and 256 rows on
 * 2 threads run in 3 rounds of 48 but 4 of 32 (7% faster, (1,1,256,256,128)
 * on Zen 4). Blocks run in rounds of `threads`; one costs its lanes plus
 * BLOCK_OVERHEAD rows' worth (its K/V blocks streamed once per block;
 * measured on Zen 4, one thread, (1,4,512,512,E = 64 and 128): 32 lanes
 * cost 1.02-1.03x and 16 lanes 1.0-1.12x the time per row of 48). */
enum { BLOCK_OVERHEAD = 3 };

static int64_t lanes_for(const flash_work *w, const attn__ukernel *kern, int threads) {
    const int64_t step = kern->lane_step;
    int64_t best = w->lanes;
    double best_time = 0;
    for (int64_t lanes = w->lanes; lanes >= step; lanes -= step) {
        const int64_t blocks = w->ngroups * ((w->nrows + lanes - 1) / lanes);
        const double rounds = (double)((blocks + threads - 1) / threads);
        const double time = rounds * (double)(lanes + BLOCK_OVERHEAD);
        if (lanes == w->lanes || time < 0.95 * best_time) best = lanes, best_time = time;
    }
    return best;
}

static bool bf16_pairs(const attn__problem *p, const flash_work *w, const attn__ukernel *kern);

/* The split for `threads` threads. Only the width of query blocks in the
 * queries-in-lanes layout depends on it, and a row's result does not
 * depend on the rows it shares a block with: lanes are independent and key
 * blocks lie on one grid (block_keys). Whether keys are split counts the
 * blocks of the shape's width (test_sdpa: 15 blocks of 48 rows, 21 of 32). */
static flash_work plan_work(const attn__problem *p, const attn__ukernel *kern, int threads) {
    flash_work w;
    w.G = group_size(p);
    w.ngroups = p->nbatch / w.G;
    w.nrows = w.G * p->L;
    /* Keys in columns for few rows (decoding: K read once, in place when it
     * has unit column stride) and for tiny calls, where speed is moot and
     * its float64-accumulated scores keep the result within rounding of the
     * exact one (float32 scores would dominate the error there). The whole
     * call, not a head: 32 heads of 32 tokens took 1.05x PyTorch's time in
     * keys in columns, and float32 queries in lanes keep the conformance
     * suite's error ratios where they were (median 0.84, worst 11.1 within
     * 2x torch + 1e-6). Not for a backward's lse: that must be the lse of
     * the scores the backward computes, which are the queries-in-lanes
     * layout's. */
    w.direct = !p->lse_for_backward &&
               (columns_for_rows(p, w.nrows, kern) ||
                (double)p->nbatch * (double)p->L * (double)p->S * (double)p->E <= TINY_WORK);
    /* A group of fewer rows than the context's lanes (small heads: MHA with
     * L = 32) gets as few lane steps as it needs, not 48 lanes of which a
     * third idle. */
    const int64_t step = kern->lane_step, width = p->E > p->Ev ? p->E : p->Ev;
    const bool pairs = bf16_pairs(p, &w, kern) && width <= 128; /* its own blocks */
    const int64_t lanes = pairs ? kern->pairs_lanes : kern->lanes;
    w.lanes = w.nrows < lanes ? (w.nrows + step - 1) / step * step : lanes;
    const int64_t shape_lanes = w.direct ? w.nrows : w.lanes; /* rows per block, by shape */
    if (!w.direct) w.lanes = lanes_for(&w, kern, threads); /* many threads, few blocks */
    w.BR = w.direct ? w.nrows : w.lanes;
    w.nqb = (w.nrows + w.BR - 1) / w.BR;
    const int pairs_keys = width > 64 && kern->pairs_keys_wide > 0 ? kern->pairs_keys_wide
                                                                   : kern->pairs_keys;
    w.BC = w.direct ? kern->direct_keys : pairs ? pairs_keys : lanes_keys(kern, width);
    w.gang = gang_size(p, &w);
    w.kv_rows = w.nrows;
    /* The gang's heads are one group of rows. Its key blocks stay
     * direct_keys long, the blocks of a walk one head at a time, so a
     * head's bits do not depend on the cache's layout or on the CPU's L2:
     * blocks sized to half the L2 (32 keys for 8 heads of E = 128 on a
     * 512 KiB L2) made a token-major cache and a head-major one differ,
     * and were no faster since the rows are read in place (Zen 3,
     * docs/design.md, "Ganged decoding"). */
    if (w.gang > 1) {
        w.G *= w.gang;
        w.ngroups /= w.gang;
        w.nrows *= w.gang;
        w.BR = w.nrows;
    }
    /* Ragged keys (varlen, a KV cache) split too: each sequence's slice
     * holds its own keys in the chunk, possibly none. */
    const int64_t shape_blocks =
        w.gang > 1 ? w.ngroups : w.ngroups * ((w.nrows + shape_lanes - 1) / shape_lanes);
    w.chunk = chunk_keys(p, &w, shape_blocks);
    w.nchunks = w.chunk < p->S ? (p->S + w.chunk - 1) / w.chunk : 1;
    w.across = w.ngroups * w.nqb < LOCAL_BLOCKS * (int64_t)threads;
    return w;
}

/* Task number `task`: (group g, query block qb, key chunk c). The last
 * query block comes first, as causal blocks grow down the rows: the largest
 * started first leave the smallest to fill the threads' tails. With many
 * blocks per thread, group by group (a thread's next block reads the K/V
 * its last one left in L2: 1-3% faster than across groups, 2 threads on
 * Zen 4, (4,12,512,512,64) and (1,16,2048,2048,64) causal); with few,
 * across groups, every group's largest block first (64 threads on
 * (1,8,512,512,64) causal: 71% busy group by group, 100% across,
 * test_schedule). The order sets no bit. */
static void task_at(const flash_work *w, int64_t task, int64_t *g, int64_t *qb, int64_t *c) {
    *c = task % w->nchunks;
    if (w->across) {
        *qb = w->nqb - 1 - task / (w->nchunks * w->ngroups);
        *g = (task / w->nchunks) % w->ngroups;
    } else {
        *qb = w->nqb - 1 - (task / w->nchunks) % w->nqb;
        *g = task / (w->nchunks * w->nqb);
    }
}

/* ---- operands and the compute type ---- */

/* The type the kernels compute in: the problem's (float32 or float64). */
static attn_dtype compute_dtype(const attn__problem *p) { return p->dtype; }

/* Whether the kernels may read a K or V operand where it is: rows of the
 * compute type with unit column stride. Otherwise its rows are loaded, the
 * load slots (ukernel.h) converting from the operand's own dtype. */
static bool operand_in_place(const attn__problem *p, const attn__operand *op) {
    return op->cs == 1 && op->dtype == compute_dtype(p);
}

/* Whether K or V rows may need loading into a buffer: not in place, or in
 * pages (a block may straddle two). */
static bool key_buffer(const attn__problem *p, const attn__operand *op) {
    return !operand_in_place(p, op) || op->pages != NULL;
}

/* The address of element `off` of an operand's data, stored as `dtype`. */
static const void *element_at(const void *data, attn_dtype dtype, int64_t off) {
    return (const char *)data + off * (int64_t)attn_dtype_size(dtype);
}

/* The fewest keys for which pack_q copies a block's Q rows before it
 * transposes them (its cost is paid once a block, its gain once a key). */
#define COPY_Q_MIN_KEYS 256

/* n rows of `width` elements of `size` bytes, `rs` elements apart, copied
 * into dst one after another. Cold rows copied this way and then
 * transposed from L1 take half the time of a transpose where they lie (a
 * head's 512 rows of 64 floats: 7-8 us against 15-16 us, Zen 5, one
 * thread): the forward's Q blocks (pack_q) and the backward's Q and dO
 * rows (bwd_copy_rows) go through it. */
static void copy_rows(void *dst, const void *src, int64_t rs, int64_t n, int64_t width,
                      size_t size) {
    if (rs == width) {
        memcpy(dst, src, size * (size_t)(n * width));
        return;
    }
    for (int64_t r = 0; r < n; r++)
        memcpy((char *)dst + (int64_t)size * r * width, (const char *)src + (int64_t)size * r * rs,
               size * (size_t)width);
}

/* Whether a block's products run in bfloat16 (ukernel.h, "bfloat16
 * products"): a bfloat16 call (q, k and v all bfloat16) in the
 * queries-in-lanes layout, on a context that has the kernels (AVX512-BF16),
 * with K and V rows of unit column stride (read, or a page's rows gathered,
 * as they are). Every other call widens its rows to float32. */
static bool bf16_pairs(const attn__problem *p, const flash_work *w, const attn__ukernel *kern) {
    return !w->direct && kern->qkt_bf != NULL && !p->f32_products &&
           compute_dtype(p) == ATTN_DTYPE_F32 && p->q.dtype == ATTN_DTYPE_BF16 &&
           p->k.dtype == ATTN_DTYPE_BF16 && p->v.dtype == ATTN_DTYPE_BF16 && p->k.cs == 1 && p->v.cs == 1;
}

/* Per-row bookkeeping for one query block. */
typedef struct flash_row {
    int64_t b, i;                       /* batch index, query position     */
    int64_t best;                       /* key of the largest score so far,
                                           -1 (tracked when lse is asked) */
    int64_t q, out, lse, weights;       /* element offsets                 */
    int64_t mask[ATTN__MAX_MASKS];      /* mask row offsets                */
    bool sink_max;                      /* the row's sink exceeds its scores
                                           (add_sink): lse = sink + log l */
    int64_t first, limit;               /* first and last visible key (the
                                           window, causality); none when
                                           first > limit                   */
    bool active;                        /* a row its entry holds (ragged
                                           batches: rows past the entry's
                                           length are neither read nor written) */
} flash_row;

/* Rows r0 .. r0+n-1 of group g (dense index h·L + i in the group). */
static void setup_rows_at(const attn__problem *p, const flash_work *w, int64_t g, int64_t r0,
                          int64_t n, flash_row *rows) {
    /* Batch offsets (integer divisions per dimension) only change when the
     * row moves to another head: compute them once per head; (h, i) step
     * along without a division per row (the backward sets up a run of rows
     * at every key block: 2% of its profile with two per row). */
    int64_t b = -1, q0 = 0, out0 = 0, lse0 = 0, w0 = 0, m0[ATTN__MAX_MASKS] = {0}, held = 0;
    if (n <= 0) return; /* (L may be 0 then) */
    int64_t h = r0 / p->L, i = r0 % p->L;
    for (int64_t r = 0; r < n; r++) {
        flash_row *row = &rows[r];
        if (g * w->G + h != b) {
            b = g * w->G + h;
            q0 = attn__batch_offset(p, &p->q, b);
            out0 = attn__batch_offset(p, &p->out, b);
            lse0 = p->has_lse ? attn__batch_offset(p, &p->lse, b) : 0;
            w0 = p->has_weights ? attn__batch_offset(p, &p->weights, b) : 0;
            for (int m = 0; m < p->nmask; m++) m0[m] = attn__batch_offset(p, &p->mask[m].op, b);
            held = attn__rows_of(p, b);
        }
        row->b = b;
        row->i = i;
        row->q = q0 + i * p->q.rs;
        row->out = out0 + i * p->out.rs;
        row->lse = lse0 + i * p->lse.rs;
        row->weights = w0 + i * p->weights.rs;
        for (int m = 0; m < p->nmask; m++) row->mask[m] = m0[m] + i * p->mask[m].op.rs;
        row->active = i < held;
        row->limit = row->active ? attn__last_key(p, b, i) : -1;
        row->first = row->active ? attn__first_key(p, b, i) : 0;
        row->sink_max = false;
        if (++i == p->L) i = 0, h++;
    }
}

/* The keys any of rows [0, nr) sees: [*begin, *end), empty (begin >= end)
 * when none sees a key. Blocks outside it (causal, the window) are never
 * visited. */
static void visible_span(const flash_row *rows, int64_t nr, int64_t S, int64_t *begin,
                         int64_t *end) {
    *begin = S;
    *end = 0;
    for (int64_t r = 0; r < nr; r++) {
        if (rows[r].first > rows[r].limit) continue; /* sees nothing */
        if (rows[r].first < *begin) *begin = rows[r].first;
        if (rows[r].limit + 1 > *end) *end = rows[r].limit + 1;
    }
}

/* The rows' last visible keys as a lanes block asks for them, worked out
 * once per task: a task's rows stay while its key blocks pass, and walking
 * 96 rows for them at every block took 3-4% of a bfloat16 prefill (two
 * chains of dependent compares over 104-byte rows; perf, Zen 5). */
enum { MAX_LANE_GROUPS = 64 };

typedef struct row_limits {
    int64_t lowest; /* the smallest last visible key of any row              */
    int64_t groups; /* lane groups (lanes / lane_step); 0: more than
                       MAX_LANE_GROUPS, every group then takes every key     */
    int64_t last[MAX_LANE_GROUPS]; /* each group's largest last visible key;
                                      INT64_MAX for a group that runs past
                                      the block's rows (it takes them all)  */
} row_limits;

static void row_limits_of(const attn__ukernel *kern, const flash_row *rows, int64_t nr,
                          int64_t lanes, row_limits *out) {
    const int64_t step = kern->lane_step;
    out->lowest = INT64_MAX;
    for (int64_t r = 0; r < nr; r++)
        if (rows[r].limit < out->lowest) out->lowest = rows[r].limit;
    out->groups = lanes / step > MAX_LANE_GROUPS ? 0 : lanes / step;
    for (int64_t g = 0; g < out->groups; g++) {
        int64_t last = (g + 1) * step > nr ? INT64_MAX : -1;
        for (int64_t r = g * step; r < (g + 1) * step && r < nr; r++)
            if (rows[r].limit > last) last = rows[r].limit;
        out->last[g] = last;
    }
}

/* The keys each group of lane_step lanes of a block needs (qkt's `keys`,
 * ukernel.h) for keys j0 .. j0+nk-1: up to its rows' last visible key, so
 * that the scores past the causal diagonal (or a window's right edge) are
 * not computed, only hidden; lanes past the block's rows take the whole
 * block. NULL when every group needs every key. */
static const int64_t *lane_group_keys(const row_limits *lim, int64_t j0, int64_t nk,
                                      int64_t *keys) {
    if (lim->groups == 0) return NULL;
    bool all = true;
    for (int64_t g = 0; g < lim->groups; g++) {
        const int64_t last = lim->last[g];
        keys[g] = last >= j0 + nk - 1 ? nk : last < j0 ? 0 : last - j0 + 1;
        all &= keys[g] == nk;
    }
    return all ? NULL : keys;
}

/* Whether query block qb of group g holds a row of its sequences. Ragged,
 * the query blocks past every head's rows hold none, and their tasks end
 * before any setup: 1,024 sequences of 8 tokens beside one of 8,192 (8
 * query heads over 2) made 1.4 million such tasks, 1.0 of the forward's
 * 1.24 s. */
static bool block_holds_rows(const attn__problem *p, const flash_work *w, int64_t g, int64_t qb) {
    if (p->q.seq_len == NULL) return true;
    const int64_t r0 = qb * w->BR, r1 = w->nrows - r0 < w->BR ? w->nrows : r0 + w->BR;
    for (int64_t h = r0 / p->L; h * p->L < r1; h++) {
        const int64_t first = r0 > h * p->L ? r0 - h * p->L : 0; /* the block's first row in h */
        if (first < attn__rows_of(p, g * w->G + h)) return true;
    }
    return false;
}

/* Rows of query block qb of group g (dense index h·L + i in the group). */
static void setup_rows(const attn__problem *p, const flash_work *w, int64_t g, int64_t qb,
                       flash_row *rows, int64_t *nr) {
    const int64_t r0 = qb * w->BR;
    *nr = w->nrows - r0 < w->BR ? w->nrows - r0 : w->BR;
    setup_rows_at(p, w, g, r0, *nr, rows);
}

/* Keep decisions for weights [index, index + n) of a row, 1 = keep. */
static void dropout_keep(const attn__problem *p, uint64_t index, int64_t n, unsigned char *keep) {
    uint32_t words[4];
    uint64_t block = UINT64_MAX;
    for (int64_t j = 0; j < n; j++) {
        uint64_t at = index + (uint64_t)j;
        if ((at >> 2) != block) {
            block = at >> 2;
            uint32_t ctr[4] = {(uint32_t)block, (uint32_t)(block >> 32), (uint32_t)p->rng_offset,
                               (uint32_t)(p->rng_offset >> 32)};
            uint32_t key[2] = {(uint32_t)p->seed, (uint32_t)(p->seed >> 32)};
            attn__philox4x32_10(ctr, key, words);
        }
        keep[j] = (uint64_t)words[at & 3] >= p->keep_threshold;
    }
}

/* Scratch per thread, in elements of the compute type. */
typedef struct flash_scratch_size {
    int64_t q, kp, vp, s, o, stat, keep;
    int64_t stage;  /* a block's Q rows copied before their transpose (pack_q) */
    int64_t pairs;  /* bf16_pairs: P of a block and vslots blocks of V in key
                       pairs (uint32_t, a float's size) */
    int64_t vslots; /* key blocks of V kept packed (v_pairs)                */
} flash_scratch_size;

/* Bytes per thread of V blocks kept in key pairs (bfloat16 products,
 * v_pairs): a group's whole V up to S·Ev = 1M (a head of 8,192 x 128). */
#define V_PAIRS_BUDGET ((int64_t)4 << 20)

/* Which V block a slot of the V pairs cache holds (v_pairs): the batch
 * index and first key of the block, and its key count; nk 0: empty. */
typedef struct v_pairs_tag {
    int64_t b, j0, nk;
    bool special; /* V held NaN/Inf, packed as 0 (v_pairs) */
} v_pairs_tag;

static flash_scratch_size scratch_size(const attn__problem *p, const flash_work *w,
                                       const attn__ukernel *kern) {
    flash_scratch_size z;
    const int64_t cols = (w->BC + kern->col_step - 1) / kern->col_step * kern->col_step;
    z.q = w->BR * p->E;                        /* Q rows, or Qt (E x lanes)     */
    z.stage = w->direct ? 0 : w->BR * p->E;    /* Q rows (lanes x E)            */
    /* K rows, when loaded: a block's, or a gang's step of every head's rows
     * (gang_at loads GANG_STEP rows at a time, not its 256-key block;
     * gang_step's 16-bit steps of twice the rows take the same bytes) */
    const int64_t loaded = w->gang > 1 ? w->gang * (w->BC < GANG_STEP ? w->BC : GANG_STEP) : w->BC;
    z.kp = w->gang > 1 || key_buffer(p, &p->k) ? loaded * p->E : 0;
    z.vp = w->gang > 1 || key_buffer(p, &p->v) ? loaded * p->Ev : 0; /* likewise */
    /* scores: every row's in keys in columns (gang_block; a tiny call's
     * exact scores, direct_block), or the lanes block's */
    z.s = w->direct ? w->BR * cols : w->BC * w->lanes;
    z.o = w->BR * p->Ev;
    z.stat = 4 * w->BR;                        /* m, l, alpha, best value       */
    z.keep = cols;
    const int64_t key_pairs = (w->BC + 1) / 2, block_bytes = key_pairs * p->Ev * 4;
    z.vslots = 0;
    if (bf16_pairs(p, w, kern)) {
        /* one slot per key block when the budget holds them; a split into
         * key chunks (few query blocks) has little to reuse: one slot */
        const int64_t blocks = (p->S + w->BC - 1) / w->BC, fit = V_PAIRS_BUDGET / block_bytes;
        z.vslots = w->nchunks > 1 ? 1 : blocks < fit ? blocks : fit > 1 ? fit : 1;
    }
    z.pairs = z.vslots > 0 ? key_pairs * (w->lanes + z.vslots * p->Ev) : 0;
    return z;
}

/* ---- the backward's plan (flash_backward.inc), shared by both precisions ---- */

/* Tiny problems (at most this many multiply-adds of the forward) take the
 * reference backward: speed is moot there, and float64 keeps their
 * gradients within rounding of the exact ones, as the forward's
 * keys-in-columns layout does for its results (a gradient that cancels to
 * 0, as every dq of a row that sees one key, comes out 0). */
#define BWD_TINY_WORK ((double)(1 << 16))

static bool bwd_tiny(const attn__problem *p) {
    return (double)p->nbatch * (double)p->L * (double)p->S * (double)(p->E + p->Ev) <=
           BWD_TINY_WORK;
}

enum { BWD_TASKS_MIN = 8 }; /* split keys into chunks while there are fewer tasks */
enum { BWD_FLUSH = 8 };      /* query blocks summed in registers before dK, dV take them */
enum { BWD_KEYS_MAX = 256 };  /* keys per backward block, at most (bwd_keys) */
#define BWD_DQ_BUDGET ((int64_t)32 << 20) /* bytes of dq partial sums, unless one is more */
#define BWD_PACK_BUDGET ((int64_t)8 << 20) /* bytes per thread of a group's packed Qt, dOt */

/* How many query heads share an element of a gradient along the head
 * dimension: all of them where its input had size 1, a GQA group, or 1. */
static int64_t head_sharing(const attn__problem *p, const attn__operand *op) {
    if (p->nb == 0) return 1;
    const int hd = p->nb - 1;
    return op->bstride[hd] == 0 ? p->bshape[hd] : op->bdiv[hd];
}

/* The backward's groups: heads that read one K and one V and whose dK and
 * dV are one sum. The forward's groups when the gradients agree; K and V
 * read through a zero stride are shared by heads that still have gradients
 * of their own, and a gradient may be shared where the other input is not:
 * then every head is its own group and shared gradients are folded. */
static int64_t bwd_group_size(const attn__problem *p) {
    const int64_t reads = group_size(p); /* heads that read one K and one V */
    const int64_t gk = p->has_dk ? head_sharing(p, &p->dk) : reads;
    const int64_t gv = p->has_dv ? head_sharing(p, &p->dv) : reads;
    return gk == reads && gv == reads ? reads : 1; /* else each head alone, sums folded */
}

/* Keys per block of the backward: as many as keep the block's K, V, dK, dV
 * and the dK, dV sums (3·keys·(E + Ev) values) in half the L2, within
 * [the forward's block, BWD_KEYS_MAX], in steps of 32. More keys than the
 * forward's spread the per-block costs (packing Q and dO, the row
 * statistics) over more work; measured on Zen 4 (1 MiB L2), E = 128:
 * 64 keys 536-542 ms, 128: 478-524, 160-256: 462-495 for one backward.
 * Causal: at most S/2 keys (at least 32), so that a head's work splits
 * into key blocks of unequal size that balance. (With the query runs
 * aligned to the diagonal, bwd_next_rows, a larger block wastes nothing
 * more there: (4,12,512,512,64) took 25-29 ms with 256 keys, 30-47 ms with
 * S/8 = 64 in alternating runs.) */
static int64_t bwd_keys(const attn__ukernel *kern, const attn__problem *p, size_t real_size) {
    const int64_t fwd = lanes_keys(kern, p->E > p->Ev ? p->E : p->Ev);
    const int64_t per_key = 3 * (p->E + p->Ev) * (int64_t)real_size;
    int64_t keys = attn__l2_bytes() / 2 / per_key / 32 * 32;
    if (keys > BWD_KEYS_MAX) keys = BWD_KEYS_MAX;
    if (keys < fwd) keys = fwd;
    if (p->causal != ATTN_CAUSAL_NONE) {
        const int64_t diagonal = p->S / 2 / 32 * 32;
        if (keys > diagonal) keys = diagonal > 32 ? diagonal : 32;
    }
    return keys;
}

/* Groups of heads sharing dK and dV, query blocks of `lanes` rows, key blocks
 * of bwd_keys; nchunks key chunks (each a dq partial sum), chosen from the
 * shape alone so that the bits do not depend on the thread count. */
static flash_work bwd_plan(const attn__problem *p, const attn__ukernel *kern, size_t real_size) {
    flash_work w;
    memset(&w, 0, sizeof w);
    w.G = bwd_group_size(p);
    w.ngroups = p->nbatch / w.G;
    w.nrows = w.G * p->L;
    const int64_t step = kern->lane_step;
    w.lanes = w.nrows < kern->lanes ? (w.nrows + step - 1) / step * step : kern->lanes;
    w.gang = 1;
    w.kv_rows = w.nrows;
    w.BR = w.lanes;
    w.nqb = (w.nrows + w.BR - 1) / w.BR;
    w.BC = bwd_keys(kern, p, real_size);
    const int64_t nkb = (p->S + w.BC - 1) / w.BC;
    const int64_t dq_bytes = p->nbatch * p->L * p->E * (int64_t)real_size;
    /* dq sums a row's terms over its chunk's keys in the compute type:
     * at most CHUNK_MAX keys a chunk (see there), whatever the budget */
    const int64_t chunk_blocks = CHUNK_MAX / w.BC; /* key blocks a chunk may hold */
    w.nchunks = real_size == sizeof(float) ? (nkb + chunk_blocks - 1) / chunk_blocks : 1;
    while (w.nchunks < nkb && w.ngroups * w.nchunks < BWD_TASKS_MIN &&
           (!p->has_dq || (w.nchunks + 1) * dq_bytes <= BWD_DQ_BUDGET))
        w.nchunks++;
    return w;
}

/* The first of rows [0, held) of batch index b that sees key j0 (held when
 * none does). A row's last visible key never decreases along the rows
 * (attn__last_key), so a binary search finds it. */
static int64_t bwd_first_row(const attn__problem *p, int64_t b, int64_t j0, int64_t held) {
    int64_t lo = 0, hi = held;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (attn__last_key(p, b, mid) >= j0) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* The first of rows [0, held) of batch index b whose window starts after
 * key j (held when none does): first keys never decrease along the rows. */
static int64_t bwd_end_row(const attn__problem *p, int64_t b, int64_t j, int64_t held) {
    int64_t lo = 0, hi = held;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (attn__first_key(p, b, mid) > j) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* The backward's next run of query rows for keys j0 .. j1, from dense row
 * *r0 of group g on (moved to the run's first row): BR rows in order, or,
 * causal or windowed, runs that start at each head's first row that sees
 * key j0 and end before its first row whose window starts past j1 (or at
 * its last held row). Rows outside see none of the block, and a run
 * aligned to the diagonal leaves no block half empty there
 * ((4,12,512,512,64) causal computed 18% more scores than it used); a
 * window's cost then follows the window. Returns the run's length, 0 past
 * the group's last row. */
static int64_t bwd_next_rows(const attn__problem *p, const flash_work *w, int64_t g, int64_t j0,
                             int64_t j1, int64_t *r0) {
    /* ragged rows take the runs below too: they end at the sequence's last
     * row, and rows past it are another sequence's (or past the tensor) */
    if (p->causal == ATTN_CAUSAL_NONE && p->window_left < 0 && p->window_right < 0 &&
        p->q.seq_len == NULL) {
        const int64_t left = w->nrows - *r0;
        return left < w->BR ? left : w->BR;
    }
    for (; *r0 < w->nrows; *r0 = (*r0 / p->L + 1) * p->L) {
        const int64_t h = *r0 / p->L, i = *r0 % p->L, b = g * w->G + h;
        const int64_t held = attn__rows_of(p, b), first = bwd_first_row(p, b, j0, held);
        const int64_t end = p->window_left < 0 ? held : bwd_end_row(p, b, j1, held);
        const int64_t start = i > first ? i : first;
        if (start < end) {
            *r0 = h * p->L + start;
            return end - start < w->BR ? end - start : w->BR;
        }
    }
    return 0;
}

/* The threads the backward's tasks run on, each with its own scratch: one
 * for a call too small to split. Read once per call: the scratch is sized
 * by it, and attn_set_num_threads may change the setting meanwhile. */
static int bwd_team(const attn__problem *p, const flash_work *w) {
    const int threads = attn__threads();
    const double work = (double)p->nbatch * p->L * p->S * (double)(p->E + p->Ev);
    return threads > 1 && w->ngroups * w->nchunks > 1 && work >= ATTN_PARALLEL_MIN_WORK ? threads
                                                                                         : 1;
}

/* Whether a backward task packs its group's Qt and dOt once
 * (bwd_pack_group): when it visits more than one key block and the copy,
 * (E + Ev) x rows per thread, fits BWD_PACK_BUDGET. */
static bool bwd_packs_group(const attn__problem *p, const flash_work *w, size_t real_size) {
    const int64_t nkb = (p->S + w->BC - 1) / w->BC;
    const int64_t bytes = (p->E + p->Ev) * (w->nrows + w->lanes) * (int64_t)real_size;
    return nkb > w->nchunks && bytes <= BWD_PACK_BUDGET;
}

/* Whether a task that packs its group also keeps the group's Q and dO rows
 * copied, (E + Ev) x rows more within BWD_PACK_BUDGET: the dK and dV
 * products then read them from cache, contiguous (a causal
 * (4,12,512,512,64) backward 2-3% faster than staging each block's rows
 * for its transpose and reading them in place; Zen 5). */
static bool bwd_copies_group(const attn__problem *p, const flash_work *w, size_t real_size) {
    const int64_t bytes = (p->E + p->Ev) * (2 * w->nrows + w->lanes) * (int64_t)real_size;
    return bwd_packs_group(p, w, real_size) && bytes <= BWD_PACK_BUDGET;
}

/* Whether the backward adds dQ straight into dq's rows (bwd_task zeroes a
 * group's rows, then its key blocks add to them): one key chunk, so one
 * task per group and no partial sums to add; dq in place and its own for
 * every batch index; each group's rows one stride apart (heads after each
 * other, as in (B, H, L, E)). Otherwise the chunks' sums go to a zeroed
 * buffer of nchunks times dq's size, added into place afterwards
 * (bwd_reduce_dq): a memset on one thread and a pass over dq more. */
static bool bwd_dq_direct(const attn__problem *p, const flash_work *w) {
    if (!p->has_dq || w->nchunks != 1 || !operand_in_place(p, &p->dq) ||
        attn__operand_shared(p, &p->dq))
        return false;
    for (int64_t b = 0; b < p->nbatch; b++)
        if (b % w->G != 0 && attn__batch_offset(p, &p->dq, b) !=
                                 attn__batch_offset(p, &p->dq, b - 1) + p->L * p->dq.rs)
            return false;
    return true;
}

/* The backward's query rows, compact: batch index b's rows are x =
 * first[b] .. first[b + 1] - 1, first[b] = b·L unless the problem is
 * ragged, where each holds only its sequence's rows. Row statistics and
 * dQ's partial sums are indexed so: a packed batch of one long sequence
 * and many short ones costs its rows, not batch x the longest (1,024
 * sequences of 8 and one of 8,192, 8 query heads: 17 GB and 45 s before).
 * Returns first (nbatch + 1 entries; attn__work_free), or NULL. */
static int64_t *bwd_row_starts(const attn__problem *p) {
    int64_t *first = attn__work_alloc((size_t)(p->nbatch + 1), sizeof(int64_t), false);
    if (first != NULL) attn__held_row_starts(p, false, first);
    return first;
}

/* The batch index holding compact row x (bwd_row_starts; entries with no
 * rows skipped), b the one that held the row before it in a loop going
 * forward: b itself or a step on from it, or, b < 0 (a thread's first row),
 * a binary search. */
static int64_t bwd_row_owner(const int64_t *first, int64_t nbatch, int64_t x, int64_t b) {
    if (b >= 0) {
        while (x >= first[b + 1]) b++;
        return b;
    }
    int64_t lo = 0, hi = nbatch - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (first[mid] <= x) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Whether each group's K (or V) head is its own: shared only along the head
 * dimension, by exactly the group's heads. Otherwise several groups add to
 * one gradient element, and the backward sums them by attn__grad_fold. */
static bool group_owns(const attn__problem *p, const flash_work *w, const attn__operand *op) {
    for (int d = 0; d < p->nb - 1; d++)
        if (p->bshape[d] > 1 && attn__dim_broadcast(op, d)) return false;
    return head_sharing(p, op) == w->G;
}

/* Whether every element of a gradient is finite: of the rows each batch
 * index holds (a key-side gradient's: `keys`). */
static bool grad_finite(const attn__problem *p, const attn__operand *op, bool keys,
                        int64_t width) {
    for (int64_t b = 0; b < p->nbatch; b++) {
        const int64_t base = attn__batch_offset(p, op, b);
        for (int64_t r = 0; r < attn__held(p, b, keys); r++)
            for (int64_t c = 0; c < width; c++)
                if (!isfinite(attn__load(op->data, op->dtype, base + r * op->rs + c * op->cs)))
                    return false;
    }
    return true;
}

/* Whether the gradients are finite where the stores did not already check
 * what they wrote: those stored in place and not folded (bwd_store_kv,
 * bwd_reduce_dq) were. */
static bool bwd_grads_finite(const attn__problem *p, const flash_work *w) {
    const bool dq_checked = operand_in_place(p, &p->dq) && !attn__operand_shared(p, &p->dq);
    const bool dk_checked = operand_in_place(p, &p->dk) && group_owns(p, w, &p->dk);
    const bool dv_checked = operand_in_place(p, &p->dv) && group_owns(p, w, &p->dv);
    return (!p->has_dq || dq_checked || grad_finite(p, &p->dq, false, p->E)) &&
           (!p->has_dk || dk_checked || grad_finite(p, &p->dk, true, p->E)) &&
           (!p->has_dv || dv_checked || grad_finite(p, &p->dv, true, p->Ev));
}

/* tanh for the float32 soft-cap, written so that the compiler vectorizes
 * the tile loop (libm's tanhf is a call per score, which left the loop
 * scalar; see docs/design.md for what soft-capping costs). Below |y| = 1/4 the
 * odd Taylor series through y^11 (next term < 2e-9 relative); above,
 * 1 - 2/(e^2|y| + 1) with e^2|y| from the exp2 polynomial, which loses at
 * most two bits to the subtraction at |y| = 1/4; |y| is clamped at 9, where
 * tanh rounds to 1 in float. Error: at most 6 ulps. Every selection is
 * arithmetic on masks: GCC turns a conditional into a branch, moves the
 * division into it, and (with trapping math, the default) then cannot
 * vectorize the loop. NaN stays NaN. */
static inline float softcap_tanhf(float y) {
    uint32_t y_bits, small_bits, large_bits;
    memcpy(&y_bits, &y, sizeof y_bits);
    const uint32_t abs_bits = y_bits & 0x7fffffffu;
    const uint32_t over = -(uint32_t)(abs_bits > 0x41100000u); /* |y| > 9 (or NaN) */
    const uint32_t a_bits = (0x41100000u & over) | (abs_bits & ~over);
    float a;
    memcpy(&a, &a_bits, sizeof a);
    const float a2 = a * a;
    float small = 1382.0f / 155925.0f;
    small = small * -a2 + 62.0f / 2835.0f;
    small = small * a2 - 17.0f / 315.0f;
    small = small * a2 + 2.0f / 15.0f;
    small = small * a2 - 1.0f / 3.0f;
    small = (small * a2) * a + a;
    const float x = 2.0f * a * (float)LOG2E; /* e^2a = 2^x, 0 <= x < 26 */
    const float n = (float)(int)(x + 0.5f), e = attn__exp2f_poly(x - n);
    const uint32_t pow_bits = (uint32_t)((int)n + 127) << 23; /* 2^n */
    float pow2n;
    memcpy(&pow2n, &pow_bits, sizeof pow2n);
    const float large = 1.0f - 2.0f / (e * pow2n + 1.0f);
    memcpy(&small_bits, &small, sizeof small_bits);
    memcpy(&large_bits, &large, sizeof large_bits);
    const uint32_t below = -(uint32_t)(a_bits < 0x3e800000u); /* |y| < 1/4 */
    const uint32_t nan = -(uint32_t)(abs_bits > 0x7f800000u);
    uint32_t t_bits = ((small_bits & below) | (large_bits & ~below)) | (y_bits & 0x80000000u);
    t_bits = (y_bits & nan) | (t_bits & ~nan);
    float t;
    memcpy(&t, &t_bits, sizeof t);
    return t;
}

/* Whether the keys-in-columns scores of the group holding batch index b
 * are summed in float64 (qk_direct; float32 sums, qk_rows, otherwise): for
 * tiny work, counted over the sequence's whole key count, so that a key
 * chunk, a ring step or a sequence of a ragged batch sums as its whole
 * attention, or its own call, does. Large inputs whose products cancel
 * (|q|, |k| ~ 200) lose accuracy in float32 sums that a tiny problem, where
 * speed is moot, need not lose. */
static bool exact_scores(const attn__problem *p, const flash_work *w, const attn__ukernel *kern,
                         int64_t b) {
    const int64_t S = p->k.seq_len != NULL ? p->k.seq_len[attn__seq_of(p, b)] : p->S_total;
    return w->kv_rows > kern->direct_rows ||
           (double)w->kv_rows * (double)S * (double)p->E <= TINY_WORK; /* no overflow */
}

/* Scores in the keys-in-columns layout: float64 sums when exact, and in
 * float64; float32 sums where the context has them (streamed: the rows of
 * K read in place that the call reads, 0 when K is in a buffer). K's rows
 * hold the compute type, or (half_kv) 16-bit values of dtype kdt. */
static void qk_cols_f(const attn__ukernel *kern, bool exact, int64_t streamed, const float *q,
                      int64_t ldq, const void *k, attn_dtype kdt, int64_t ldk, int64_t E, int rows,
                      int64_t nk, float *s, int64_t lds) {
    if (kdt != ATTN_DTYPE_F32)
        kern->qk_rows_h(q, ldq, k, ldk, kdt, E, rows, nk, s, lds, streamed);
    else if (!exact && kern->qk_rows_f != NULL)
        kern->qk_rows_f(q, ldq, k, ldk, E, rows, nk, s, lds, streamed);
    else
        kern->qk_direct_f(q, ldq, k, ldk, E, rows, nk, s, lds);
}
static void qk_cols_d(const attn__ukernel *kern, bool exact, int64_t streamed, const double *q,
                      int64_t ldq, const void *k, attn_dtype kdt, int64_t ldk, int64_t E, int rows,
                      int64_t nk, double *s, int64_t lds) {
    (void)exact;
    (void)streamed;
    (void)kdt; /* always float64: half_kv_d is false */
    kern->qk_direct_d(q, ldq, k, ldk, E, rows, nk, s, lds);
}

/* The end of the keys of batch index b that a block reads: the sequence's
 * own, or j_end, the end of the keys the block's rows see. */
static int64_t keys_read(const attn__problem *p, int64_t b, int64_t j_end) {
    const int64_t held = attn__keys_of(p, b);
    return held < j_end ? held : j_end;
}

/* Rows of K or V (operand op) from key j0 on that lie one stride apart and
 * come before `end` (keys_read): the `streamed` of qk_cols and pv_cols, so
 * kernels that request rows ahead never request a row of another page, of
 * another sequence or key slice, or that no row sees. */
static int64_t rows_read(const attn__problem *p, const attn__operand *op, int64_t j0,
                         int64_t end) {
    const int64_t together = attn__rows_together(p, op, j0), rows = end - j0;
    const int64_t n = together < rows ? together : rows;
    return n > 0 ? n : 0;
}

/* O = alpha·O + P·V in the keys-in-columns layout, V rows of the compute
 * type or (half_kv) 16-bit values of dtype vdt (streamed: as qk_cols'). */
static void pv_cols_f(const attn__ukernel *kern, int64_t streamed, const float *p, int64_t p_rs,
                      const void *v, attn_dtype vdt, int64_t ldv, int rows, int64_t nk, int64_t Ev,
                      float *o, const float *alpha) {
    if (vdt != ATTN_DTYPE_F32)
        kern->pv_h(p, p_rs, 1, v, ldv, vdt, rows, nk, Ev, o, Ev, alpha, streamed);
    else
        kern->pv_f(p, p_rs, 1, v, ldv, rows, nk, Ev, o, Ev, alpha, streamed);
}
static void pv_cols_d(const attn__ukernel *kern, int64_t streamed, const double *p, int64_t p_rs,
                      const void *v, attn_dtype vdt, int64_t ldv, int rows, int64_t nk, int64_t Ev,
                      double *o, const double *alpha) {
    (void)vdt;
    kern->pv_d(p, p_rs, 1, v, ldv, rows, nk, Ev, o, Ev, alpha, streamed);
}

/* Decoding from 16-bit K and V (a float16/bfloat16 KV cache): the
 * keys-in-columns kernels read them as they are (ukernel.h: qk_rows_h,
 * pv_h) where the context has them; both share the dtype and unit column
 * strides, and a gang's heads lie side by side in each row. Float32 calls
 * only (float64 ones widen). */
static bool half_kv_f(const attn__problem *p, const flash_work *w, const attn__ukernel *kern) {
    const attn__operand *k = &p->k, *v = &p->v;
    const bool side_by_side = w->gang == 1 || (k->bstride[p->nb - 1] == p->E &&
                                               v->bstride[p->nb - 1] == p->Ev);
    return w->direct && kern->qk_rows_h != NULL && kern->pv_h != NULL && attn__is_half(k->dtype) &&
           v->dtype == k->dtype && k->cs == 1 && v->cs == 1 && side_by_side;
}
static bool half_kv_d(const attn__problem *p, const flash_work *w, const attn__ukernel *kern) {
    (void)p;
    (void)w;
    (void)kern;
    return false;
}

/* Instantiate the driver for float and for double. */
typedef uint32_t bits_f;
typedef uint64_t bits_d;
#define EXP_MASK_f UINT32_C(0x7f800000)
#define EXP_MASK_d UINT64_C(0x7ff0000000000000)

#define REAL float
#define SFX(name) name##_f
#define EXP2 attn__exp2f
#define NEXTAFTER nextafterf
#define EPSILON FLT_EPSILON
#define REAL_MAX FLT_MAX
#define TANH_f softcap_tanhf
#include "flash_driver.inc"
#include "flash_backward.inc"
#undef REAL
#undef SFX
#undef EXP2
#undef NEXTAFTER
#undef EPSILON
#undef REAL_MAX

#define REAL double
#define SFX(name) name##_d
#define EXP2 attn__exp2d
#define NEXTAFTER nextafter
#define EPSILON DBL_EPSILON
#define REAL_MAX DBL_MAX
#define TANH_d tanh
#include "flash_driver.inc"
#include "flash_backward.inc"
#undef REAL
#undef SFX
#undef EXP2
#undef NEXTAFTER
#undef EPSILON
#undef REAL_MAX

attn_status attn__sdpa_flash(const attn__problem *problem, const attn__ukernel *ukernel) {
    attn__problem tiny;
    if (problem->lse_for_backward && bwd_tiny(problem)) {
        /* the backward of a tiny problem runs on the reference: give it the
         * exact lse and keep the forward's float64-accumulated scores */
        tiny = *problem;
        tiny.lse_for_backward = false;
        tiny.lse_exact = true;
        problem = &tiny;
    }
    /* Weights are normalized by the whole row's sum, so their keys are not
     * split into chunks (chunk_keys): past CHUNK_MAX keys a float32 sum
     * would stall, and the float64 reference computes them (the weights,
     * 4 bytes a key, already outweigh its cost there). */
    if (problem->has_weights && problem->S > CHUNK_MAX && compute_dtype(problem) == ATTN_DTYPE_F32)
        return attn__sdpa_reference(problem);
    return compute_dtype(problem) == ATTN_DTYPE_F32 ? flash_run_f(problem, ukernel)
                                                    : flash_run_d(problem, ukernel);
}

attn_status attn__sdpa_flash_backward(const attn__problem *problem, const attn__ukernel *ukernel) {
    if (bwd_tiny(problem)) return attn__sdpa_backward_reference(problem);
    return compute_dtype(problem) == ATTN_DTYPE_F32 ? bwd_run_f(problem, ukernel)
                                                    : bwd_run_d(problem, ukernel);
}

/* ---- how evenly the tasks fill the threads (for tests, docs/design.md) ---- */

/* Rows times keys a task computes: its block's lanes (all computed in the
 * queries-in-lanes layout) by the span of keys flash_task visits. */
static double task_cost(const attn__problem *p, const flash_work *w, int64_t task,
                        flash_row *rows) {
    int64_t g, qb, c, nr;
    task_at(w, task, &g, &qb, &c);
    attn__problem slice = *p;
    if (w->nchunks > 1) {
        const int64_t j0 = c * w->chunk;
        attn__problem_key_slice(p, j0, p->S - j0 < w->chunk ? p->S - j0 : w->chunk, &slice);
    }
    setup_rows(&slice, w, g, qb, rows, &nr);
    int64_t j_begin, j_end;
    visible_span(rows, nr, slice.S, &j_begin, &j_end);
    if (j_begin >= j_end) return 0;
    const int64_t keys = j_end - j_begin;
    return (double)(w->direct ? nr : w->lanes) * (double)keys;
}

attn_status attn__flash_balance(const attn__problem *p, const attn__ukernel *kern, int threads,
                                attn__flash_split *out) {
    if (threads < 1) threads = 1;
    const flash_work w = plan_work(p, kern, threads);
    const int64_t ntasks = w.ngroups * w.nqb * w.nchunks;
    double *busy = attn__alloc_array((size_t)threads, sizeof(double));
    int64_t *count = attn__alloc_array((size_t)threads, sizeof(int64_t));
    flash_row *rows = attn__alloc_array((size_t)w.BR, sizeof(flash_row));
    if (!busy || !count || !rows) {
        attn__free(busy);
        attn__free(count);
        attn__free(rows);
        return attn__fail(ATTN_ERR_NOMEM, "out of memory planning the split");
    }
    double total = 0;
    for (int t = 0; t < threads; t++) busy[t] = 0, count[t] = 0;
    for (int64_t task = 0; task < ntasks; task++) { /* schedule(dynamic, 1) */
        int t0 = 0;
        for (int t = 1; t < threads; t++)
            if (busy[t] < busy[t0]) t0 = t;
        const double cost = task_cost(p, &w, task, rows);
        busy[t0] += cost;
        count[t0]++;
        total += cost;
    }
    double longest = 0;
    out->tasks = ntasks;
    out->rows_per_block = w.BR;
    out->chunks = w.nchunks;
    out->chunk = w.chunk;
    out->most = 0;
    out->fewest = ntasks;
    for (int t = 0; t < threads; t++) {
        if (busy[t] > longest) longest = busy[t];
        if (count[t] > out->most) out->most = count[t];
        if (count[t] < out->fewest) out->fewest = count[t];
    }
    out->busy = longest > 0 ? total / (threads * longest) : 1;
    attn__free(busy);
    attn__free(count);
    attn__free(rows);
    return ATTN_OK;
}
