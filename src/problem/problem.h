/*
 * problem.h — one description for every attention the library runs.
 *
 * attn_sdpa() and attn_mha_forward() both reduce to an attn__problem: a
 * batch of independent attention problems, each (L x E) queries against
 * (S x E) keys and (S x Ev) values, with every operand located by its own
 * dtype and strides. Kernels (src/sdpa, src/kernels) see only problems,
 * never the public argument structs, and validate.c is the one place that
 * builds them: one check, one message.
 *
 * What a problem can say beyond a plain batch, so that later features are
 * fields, not rewrites:
 *  - ragged batches: per sequence (entry of the first batch dimension) an
 *    operand may start at its own row and hold its own number of rows, so a
 *    packed variable-length batch (FlashAttention's cu_seqlens) or a KV cache
 *    filled to cache_seqlens is described with no copy;
 *  - a slice of a larger problem: the global position of query row 0 and of
 *    key 0 and the whole lengths, so causal alignment and the dropout index
 *    are those of the whole sequence wherever a slice is computed (a key
 *    chunk of the split decode path today; a ring step or a cache later);
 *    slices are merged by log-sum-exp (lse_merge.h);
 *  - paged rows: a KV cache in blocks located through a block table
 *    (attn_sdpa_kvcache), rows found by attn__row_offset;
 *  - score modifiers: a sliding window (attn__first_key, attn__last_key),
 *    ALiBi slopes, soft-capping and sinks (attn__sink), each a field below.
 */
#ifndef ATTN_PROBLEM_PROBLEM_H
#define ATTN_PROBLEM_PROBLEM_H

#include <math.h>

#include "../core/internal.h"

/* A 2-D operand repeated over the batch dimensions.
 * Element (batch index b = (b_0, ..., b_{nb-1}), row r, column c) lives at
 *   data + sum_d (b_d / bdiv[d]) * bstride[d] + (start(b_0) + r) * rs + c * cs
 * (elements, not bytes), with start(n) = seq_start ? seq_start[n] : 0.
 * bstride is 0 along broadcast dimensions; bdiv is the GQA group size along
 * the head dimension of k and v, else 1. Rows r >= seq_len[b_0] (when
 * seq_len is set) are not part of sequence b_0. */
typedef struct attn__operand {
    void *data;
    attn_dtype dtype;
    int64_t bstride[ATTN_MAX_RANK];
    int64_t bdiv[ATTN_MAX_RANK];
    int64_t rs, cs;
    const int64_t *seq_start; /* per sequence, or NULL: every one starts at row 0 */
    const int64_t *seq_len;   /* per sequence, or NULL: every one has all rows     */
    /* Paged rows (a KV cache's block_table), or pages == NULL: row r of
     * sequence n lives in page pages[n * pages_rs + r / page_rows], at row
     * r % page_rows of it, pages page_stride elements apart (seq_start is
     * then unused). Pages are ids the builder checked to be in range. */
    const int32_t *pages;
    int64_t pages_rs, page_rows, page_stride;
} attn__operand;

/* A mask over (B..., L, S). Bool masks keep a key where the byte equals
 * `bool_keep` after normalising to 0/1 (1 for attn_sdpa, 0 for torch MHA's
 * "true = masked out"); float masks are added and -inf removes the key. */
typedef struct attn__mask {
    attn__operand op;
    int bool_keep;
} attn__mask;

enum { ATTN__MAX_MASKS = 2 };

/* The operands by role, the first six in the order of
 * attn_sdpa_params.arg_names: validation names them by role. The backward
 * pass's (dout, dq, dk, dv, dmask) always have their C names. */
typedef enum attn__role_id {
    ATTN__Q,
    ATTN__K,
    ATTN__V,
    ATTN__OUT,
    ATTN__WEIGHTS,
    ATTN__LSE,
    ATTN__NAMED_ROLES, /* roles a caller may rename */
    ATTN__DOUT = ATTN__NAMED_ROLES,
    ATTN__DQ,
    ATTN__DK,
    ATTN__DV,
    ATTN__DMASK,
    ATTN__NUM_ROLES
} attn__role_id;

typedef struct attn__problem {
    attn_dtype dtype;               /* compute type: float64, or float32 (also for 16-bit operands) */
    int nb;                         /* number of batch dimensions          */
    int64_t bshape[ATTN_MAX_RANK];  /* their (broadcast) sizes             */
    int64_t nbatch;                 /* product of bshape                   */
    int64_t L, S, E, Ev;            /* rows and keys held here (maxima when ragged) */

    /* Inputs. q: L x E, k: S x E, v: S x Ev. */
    attn__operand q, k, v;
    int nmask;
    attn__mask mask[ATTN__MAX_MASKS];

    /* Outputs. out: L x Ev; lse: L x 1 (rs only); weights: L x S. */
    attn__operand out, lse, weights;
    bool has_lse, has_weights;
    /* lse to float64 accuracy: the kernels track each row's best key and
     * recompute its score exactly. On whenever a caller asks for lse, unless
     * it is for a backward pass (then the lse of the kernels' own rounded
     * scores, which the backward's recomputed weights must be normalised
     * by); the split decode path's internal chunk lse only when the whole
     * call's is asked for (tracking costs a pass over every score tile). */
    bool lse_exact;
    /* lse for a backward pass (attn_sdpa_params.lse_for_backward): the
     * forward then scores in the layout the backward does (queries in
     * lanes, float32 products), so both see the same rounded scores. */
    bool lse_for_backward;
    /* float32 products for bfloat16 operands too (no bfloat16 pairs): the
     * float32 out a 16-bit backward forms D from (sdpa.c). */
    bool f32_products;

    /* Where this problem sits in the whole one (a slice: a key chunk, a ring
     * step). Query row i is position q_pos0 + i of L_total, key j position
     * k_pos0 + j of S_total. A whole problem has 0, 0, L, S. */
    int64_t q_pos0, k_pos0, L_total, S_total;

    /* Backward (attn_sdpa_backward). out and lse are then inputs, and dout
     * (L x Ev) too. The gradients are laid out like the input they belong
     * to (dq like q, dk like k with its GQA divisors, dmask like mask
     * dmask_of): several batch indices may map to one gradient element,
     * whose contributions the kernels sum in a fixed order. */
    attn__operand dout, dq, dk, dv, dmask;
    bool has_dq, has_dk, has_dv, has_dmask;
    int dmask_of;

    /* Score modifiers (attn_sdpa_params' window, alibi_slopes, softcap,
     * sinks). Window sides are -1 when unbounded. The slopes and sinks are
     * operands with one element per batch index (only bstride is used). */
    int64_t window_left, window_right;
    bool has_alibi, has_sinks;
    attn__operand alibi, sinks;
    double softcap;                 /* 0: none                             */

    double scale;
    attn_causal causal;             /* alignment over the whole lengths    */
    bool dropout;
    double dropout_p;
    uint64_t keep_threshold;        /* see attn__dropout_threshold         */
    uint64_t seed, rng_offset;
    const volatile int *cancel;     /* the caller's cancel flag, or NULL   */
} attn__problem;

/* A role's C name in messages and attn_last_error_arg(): "q", "out", ... */
const char *attn__role_name(attn__role_id role);

/* Points `op` at a contiguous (B..., L, width) buffer of p's batch shape:
 * partial results, and buffers the caller lays out itself. */
void attn__operand_dense(const attn__problem *p, attn__operand *op, void *data, attn_dtype dtype,
                         int64_t width);

/* ---- addressing ---- */

/* The sequence of batch index b: its index along the first batch dim. */
static inline int64_t attn__seq_of(const attn__problem *p, int64_t b) {
    return p->nb == 0 ? 0 : b / (p->nbatch / p->bshape[0]);
}

/* Element offset of operand `op` for batch index `b` (linear, row-major over
 * p->bshape), including the sequence's start row; row r is then
 * attn__row_offset further. */
static inline int64_t attn__batch_offset(const attn__problem *p, const attn__operand *op,
                                         int64_t b) {
    int64_t off = 0;
    if (op->seq_start != NULL && op->pages == NULL)
        off = op->seq_start[attn__seq_of(p, b)] * op->rs;
    for (int d = p->nb - 1; d >= 0; d--) {
        int64_t idx = b % p->bshape[d];
        b /= p->bshape[d];
        off += (idx / op->bdiv[d]) * op->bstride[d];
    }
    return off;
}

/* Offset of row r of batch index b from attn__batch_offset: r·rs, or where
 * the row's page puts it. Pages are addressed by the row's position in the
 * whole sequence (a key slice of a paged cache keeps its data pointer and
 * moves k_pos0 instead, see attn__problem_key_slice). */
static inline int64_t attn__row_offset(const attn__problem *p, const attn__operand *op, int64_t b,
                                       int64_t r) {
    if (op->pages == NULL) return r * op->rs;
    const int32_t *table = op->pages + attn__seq_of(p, b) * op->pages_rs;
    r += p->k_pos0;
    return (int64_t)table[r / op->page_rows] * op->page_stride + (r % op->page_rows) * op->rs;
}

/* How many rows from row r on lie one stride apart (the rest of r's page). */
static inline int64_t attn__rows_together(const attn__problem *p, const attn__operand *op,
                                          int64_t r) {
    if (op->pages == NULL) return INT64_MAX;
    return op->page_rows - (p->k_pos0 + r) % op->page_rows;
}

/* Whether op is broadcast along batch dimension d (the same elements for
 * every index there): a zero stride, except along the sequences of a ragged
 * operand, which seq_start locates instead (a packed varlen tensor). */
static inline bool attn__dim_broadcast(const attn__operand *op, int d) {
    return op->bstride[d] == 0 && !(d == 0 && op->seq_start != NULL && op->pages == NULL);
}

/* Query rows and keys that batch index b holds (< L, S when ragged). A key
 * slice of a ragged problem holds the part of each sequence's keys that
 * falls in it: none when the sequence ends before the slice. */
static inline int64_t attn__rows_of(const attn__problem *p, int64_t b) {
    return p->q.seq_len != NULL ? p->q.seq_len[attn__seq_of(p, b)] : p->L;
}
static inline int64_t attn__keys_of(const attn__problem *p, int64_t b) {
    if (p->k.seq_len == NULL) return p->S;
    const int64_t held = p->k.seq_len[attn__seq_of(p, b)] - p->k_pos0;
    return held < 0 ? 0 : held < p->S ? held : p->S;
}
/* The keys (`keys`: a key-side operand's rows) or query rows b holds. */
static inline int64_t attn__held(const attn__problem *p, int64_t b, bool keys) {
    return keys ? attn__keys_of(p, b) : attn__rows_of(p, b);
}

/* The key (local index) on query row i's bottom-right diagonal: position
 * i + S - L over the whole lengths, or the sequence's own when ragged (a
 * cache filled to k.seq_len aligns to its filled length). The sliding
 * window and ALiBi are measured from it, and bottom-right causality ends
 * at it. */
static inline int64_t attn__diagonal(const attn__problem *p, int64_t b, int64_t i) {
    const int64_t L_all = p->q.seq_len != NULL ? attn__rows_of(p, b) : p->L_total;
    const int64_t S_all =
        p->k.seq_len != NULL ? p->k.seq_len[attn__seq_of(p, b)] : p->S_total;
    return p->q_pos0 + i + S_all - L_all - p->k_pos0;
}

/* The last key (local index) query row i of batch index b may see: the
 * causal rule and the window's right side over the whole sequence, then the
 * keys the entry holds; -1 when it sees none. */
static inline int64_t attn__last_key(const attn__problem *p, int64_t b, int64_t i) {
    int64_t last = attn__keys_of(p, b) - 1;
    if (p->causal != ATTN_CAUSAL_NONE || p->window_right >= 0) {
        const int64_t diagonal = attn__diagonal(p, b, i);
        if (p->causal == ATTN_CAUSAL_BOTTOM_RIGHT && diagonal < last) last = diagonal;
        if (p->causal == ATTN_CAUSAL_TOP_LEFT && p->q_pos0 + i - p->k_pos0 < last)
            last = p->q_pos0 + i - p->k_pos0;
        if (p->window_right >= 0 && p->window_right < last - diagonal) /* no overflow */
            last = diagonal + p->window_right;
    }
    return last < -1 ? -1 : last;
}

/* The first key (local index) query row i of batch index b may see: the
 * window's left side, else 0. May exceed attn__last_key (then none). */
static inline int64_t attn__first_key(const attn__problem *p, int64_t b, int64_t i) {
    const int64_t diagonal = attn__diagonal(p, b, i);
    if (p->window_left < 0 || p->window_left >= diagonal) return 0; /* no overflow */
    return diagonal - p->window_left;
}

/* ALiBi's slope for batch index b (0 without ALiBi): the score of key j
 * gains -slope·|diagonal - j|. */
static inline double attn__alibi_slope(const attn__problem *p, int64_t b) {
    return p->has_alibi ? attn__load(p->alibi.data, p->alibi.dtype, attn__batch_offset(p, &p->alibi, b))
                        : 0.0;
}

/* Whether this problem holds the sinks: they have one, and it is the slice
 * that holds key 0 (a sink counts as one more key there, so merged slices
 * count it once). */
static inline bool attn__sinks_here(const attn__problem *p) {
    return p->has_sinks && p->k_pos0 == 0;
}
/* The sink logit of batch index b (natural units, like a scaled score). */
static inline double attn__sink(const attn__problem *p, int64_t b) {
    return attn__load(p->sinks.data, p->sinks.dtype, attn__batch_offset(p, &p->sinks, b));
}

/* A score modified as attn_sdpa_params says, in natural units: scaled
 * score x (scale·q·k) soft-capped, then ALiBi's bias for key j of a row
 * whose diagonal is `diagonal`. Masks come after. */
static inline double attn__modified_score(const attn__problem *p, double x, double slope,
                                          int64_t diagonal, int64_t j) {
    if (p->softcap > 0) x = p->softcap * tanh(x / p->softcap);
    if (p->has_alibi) x -= slope * (double)(diagonal > j ? diagonal - j : j - diagonal);
    return x;
}

/* Dropout's counter for weight (b, i, j): its linear index in the weights of
 * the whole problem, so any slice draws the whole problem's mask. */
static inline uint64_t attn__dropout_index(const attn__problem *p, int64_t b, int64_t i,
                                           int64_t j) {
    return ((uint64_t)b * (uint64_t)p->L_total + (uint64_t)(p->q_pos0 + i)) *
               (uint64_t)p->S_total +
           (uint64_t)(p->k_pos0 + j);
}

/* ---- building ---- */

/* The general form of a problem request, for callers inside the library
 * (MHA passes a key-padding mask as a second mask). attn_sdpa fills one
 * mask. */
typedef struct attn__problem_request {
    const attn_tensor *q, *k, *v;
    int nmask;
    const attn_tensor *mask[ATTN__MAX_MASKS];
    const char *mask_name[ATTN__MAX_MASKS];
    int mask_bool_keep[ATTN__MAX_MASKS];
    attn_causal causal;
    int has_scale;
    double scale;
    int enable_gqa;
    double dropout_p;
    uint64_t seed, rng_offset;
    attn_tensor *out, *weights, *lse; /* out may be NULL to only infer shapes */
    /* What messages call q, k, v, out, weights, lse; NULL: those names. */
    const char *const *names;
    /* lse as the kernels' own scores give it (attn_sdpa_params.lse_for_backward) */
    bool lse_for_backward;
    /* A slice of a larger attention (attn_sdpa_params' q_offset ...); all 0:
     * the whole. */
    int64_t q_offset, k_offset, q_total, k_total;
    /* The score modifiers (window, alibi_slopes, softcap, sinks) of these
     * params, or NULL for none (MHA). attn_sdpa's requests point it at
     * modifiers_copy, their own read of the caller's params. */
    const attn_sdpa_params *modifiers;
    attn_sdpa_params modifiers_copy;
} attn__problem_request;

/* Checks causal, scale and dropout (attn_sdpa_params' fields, named so in
 * messages) into p, whose E must be set (the default scale is 1/sqrt(E)). */
attn_status attn__problem_scalars(attn__problem *p, attn_causal causal, int has_scale,
                                  double scale, double dropout_p, uint64_t seed,
                                  uint64_t rng_offset);

/* Checks a tensor (attn__check_tensor, one element at least) of exactly
 * this shape; the message names `what` the shape is, when not NULL, e.g.
 * "(B, Lq, Hq, Ev)". */
attn_status attn__check_shape(const attn_tensor *t, const char *name, attn__role role, int rank,
                              const int64_t *shape, const char *what);

/* Fills p's score modifiers from params (already read in full by
 * attn__read_params; NULL: none), checking each field; the slopes and sinks
 * broadcast against p's batch shape, which must be set. */
attn_status attn__problem_modifiers(attn__problem *p, const attn_sdpa_params *params);

/* A tensor of one float per query head (ALiBi slopes, sinks, their
 * gradients), broadcastable to p's batch dimensions, as an operand whose
 * bstride finds batch index b's value. */
attn_status attn__per_head_operand(const attn__problem *p, const attn_tensor *t,
                                   const char *name, attn__operand *op);

/* The dtype rules every computing entry point shares (attn.h, "Dtypes"):
 * q, k and v are float32, float64, float16 or bfloat16; k and v share one
 * dtype; q has it too, or is float32 over 16-bit keys and values (a
 * low-precision KV cache). On success *compute is the type the kernels
 * run in: float64 for float64, float32 for everything else. */
attn_status attn__check_qkv_dtypes(const attn_tensor *q, const char *qn, const attn_tensor *k,
                                   const char *kn, const attn_tensor *v, const char *vn,
                                   attn_dtype *compute);
/* lse: the compute dtype (float32 for 16-bit queries), or float64. */
attn_status attn__check_lse_dtype(const attn_tensor *lse, const char *name, attn_dtype compute);

/* Validates a request into a whole problem (offsets 0, no ragged rows). */
attn_status attn__problem_build(attn__problem *p, const attn__problem_request *req);

/* The same from attn_sdpa's public arguments. */
attn_status attn__problem_from_sdpa(attn__problem *p, const attn_tensor *q, const attn_tensor *k,
                                    const attn_tensor *v, const attn_sdpa_params *params,
                                    attn_tensor *out, attn_tensor *weights, attn_tensor *lse);

/* What the backward pass adds to a request: dout, and out and lse as the
 * forward gave them (inputs now), and the gradients wanted (NULL: not
 * wanted). dmask is the gradient of mask number dmask_of of the request. */
typedef struct attn__backward_request {
    const attn_tensor *dout, *out, *lse;
    attn_tensor *dq, *dk, *dv, *dmask;
    int dmask_of;
} attn__backward_request;

/* Validates a backward request (r->out, weights and lse are unused). */
attn_status attn__problem_build_backward(attn__problem *p, const attn__problem_request *r,
                                         const attn__backward_request *g);

/* The same from attn_sdpa_backward's public arguments. */
attn_status attn__problem_from_sdpa_backward(attn__problem *p, const attn_tensor *dout,
                                             const attn_tensor *q, const attn_tensor *k,
                                             const attn_tensor *v, const attn_tensor *out,
                                             const attn_tensor *lse,
                                             const attn_sdpa_params *params, attn_tensor *dq,
                                             attn_tensor *dk, attn_tensor *dv,
                                             attn_tensor *dmask);

/* Whether more than one batch index maps to some element of a gradient laid
 * out by `op` (it was broadcast or grouped there): its contributions then
 * need a reduction. */
bool attn__operand_shared(const attn__problem *p, const attn__operand *op);

/* Where each batch index's rows begin when only the rows it holds are
 * kept, one index after another: first[b] for b <= nbatch (first[nbatch]:
 * them all), counting keys (attn__keys_of) or query rows (attn__rows_of).
 * Unless the problem is ragged, first[b] = b x S or b x L. */
void attn__held_row_starts(const attn__problem *p, bool keys, int64_t *first);

/* Stores gradient contributions into the gradient `op` describes, summing
 * those that share an element in a fixed order (batch index, then row, then
 * column), in float64, and rounding once. `partial` holds batch index b's
 * rows at first[b] x width (attn__held_row_starts), or, with first NULL,
 * dense (nbatch, rows, width), rows = S for a key-side gradient (`keys`:
 * dk, dv), else L; it is overwritten. Only the rows a batch index holds are
 * stored (ragged, the rest belong to other sequences). Rows and columns
 * reduce too where op's row or column stride is 0 (a mask broadcast over
 * queries or keys). */
void attn__grad_fold(const attn__problem *p, const attn__operand *op, double *partial,
                     bool keys, int64_t width, const int64_t *first);

/* A slice of a whole problem: keys [j0, j0 + nk) (nk >= 1), with the
 * slice's global key position, so that causality and dropout stay those of
 * `whole`. Outputs are left as in `whole`; the caller points them at its
 * partial buffers. Ragged keys slice too: each sequence holds its keys that
 * fall in [j0, j0 + nk) (attn__keys_of), paged rows are found from their
 * whole-sequence position (attn__row_offset). */
void attn__problem_key_slice(const attn__problem *whole, int64_t j0, int64_t nk,
                             attn__problem *slice);

#endif /* ATTN_PROBLEM_PROBLEM_H */
