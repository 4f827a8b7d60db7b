/*
 * reference_backward.c — the oracle of the backward pass, in float64, one
 * query row at a time, reading like the formulas. With the forward's
 * out, for row i:
 *
 *   p_j  = exp(s_j - lse_i)                  the weights, recomputed
 *        = exp(s_j - max_i) / sum_i
 *   w_j  = p_j * z_j                         z_j = dropout's 1/(1-p) or 0
 *   dp_j = z_j * dout_i . v_j
 *   D_i  = sum_j p_j dp_j                    = dout_i . out_i
 *   ds_j = p_j * (dp_j - D_i)                d loss / d s_j (s: the modified score)
 *   dx_j = ds_j * cap'(x_j)                  d loss / d x_j (x = scale q_i . k_j;
 *                                            cap' = 1 - tanh² when soft-capping, else 1)
 *
 *   dq_i += scale * sum_j dx_j k_j,  dk_j += scale * dx_j q_i,
 *   dv_j += w_j dout_i,              dmask_ij += ds_j
 *
 * ALiBi's bias is a constant of the scores (its slopes get no gradient, as
 * in FlashAttention), the window and causality only hide keys, and a sink
 * only joins the denominator: sum_i below includes exp(sink - max_i), and
 * the sink's own gradient is attn_sdpa_sinks_backward's.
 *
 * lse_i is the row's own, from its float64 scores, and never formed: a
 * stored lse is rounded by |lse| x 2^-24 (float32) or 2^-53 (float64), an
 * error every weight of the row would take (in float32, 1e-4 at logits of
 * 1e3, hundreds of times a float32 evaluation's own). The forward's lse still says which rows saw
 * no key (-inf), and stays in use where a score is NaN or infinite, so the
 * NaN rules are the forward's. D_i, too, is the row's own rather than
 * dout_i . out_i from the stored out: ds_j is the small difference dp_j -
 * D_i, and a float32 out's rounding there costs ds several ulps.
 *
 * Terms with p_j exactly 0 (masked, underflowed) are skipped, and v_j is
 * not read where w_j is 0 (dropped), the forward's rule: a NaN or Inf there
 * reaches no gradient.
 *
 * A key slice of a larger attention (attn_sdpa_params' k_offset, k_total:
 * a ring step) sees only some of the row's keys, so neither its own sum
 * nor its own D is the row's: there the stored lse and D_i = dout_i . out_i
 * are the only source, and are used.
 *
 * Each batch index's contributions go to a dense
 * float64 buffer, folded into the gradients in a fixed order
 * (attn__grad_fold), so the result does not depend on the thread count.
 */
#include <math.h>

#include "sdpa.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Per-thread row buffers: S entries each, and the row's q and dout read
 * once (E and Ev entries) rather than once per key: the same values in the
 * same sums, a third of the loads (tiny problems run this as their
 * backward, bwd_tiny). */
typedef struct row_buffers {
    double *p, *w, *ds, *dcap; /* dcap: the soft-cap's derivative per key */
    bool *visible;
    double *q_i, *dout_i; /* E, Ev */
} row_buffers;

/* Row i of batch b's q (E) and dout (Ev) into rb. */
static void read_row(const attn__problem *p, int64_t b, int64_t i, row_buffers *rb) {
    const int64_t qo = attn__batch_offset(p, &p->q, b) + i * p->q.rs;
    const int64_t go = attn__batch_offset(p, &p->dout, b) + i * p->dout.rs;
    for (int64_t e = 0; e < p->E; e++)
        rb->q_i[e] = attn__load(p->q.data, p->q.dtype, qo + e * p->q.cs);
    for (int64_t e = 0; e < p->Ev; e++)
        rb->dout_i[e] = attn__load(p->dout.data, p->dout.dtype, go + e * p->dout.cs);
}

/* Row i of batch b: p, w and ds for every key (0 where the row does not see
 * it). Returns false when the row saw no key (everything 0). The forward's
 * out is not read: see D above. */
static bool backward_row(const attn__problem *p, int64_t b, int64_t i, row_buffers *rb) {
    read_row(p, b, i, rb);
    const double max = attn__reference_scores(p, b, i, rb->p, rb->visible, rb->dcap, rb->q_i);
    const double lse = attn__load(p->lse.data, p->lse.dtype,
                                  attn__batch_offset(p, &p->lse, b) + i * p->lse.rs);
    const bool empty = max == -INFINITY || lse == -INFINITY;
    const bool slice = p->S < p->S_total; /* the row's other keys are elsewhere */
    double ref = lse, sum = 1.0; /* p_j = exp(s_j - ref) / sum */
    const double sink = attn__sinks_here(p) ? attn__sink(p, b) : -INFINITY;
    if (!empty && !slice && isfinite(max) && isfinite(lse) && !isnan(sink)) {
        ref = fmax(max, sink); /* the row's own (see above), its sink included */
        sum = sink == -INFINITY ? 0.0 : exp(sink - ref);
        for (int64_t j = 0; j < p->S; j++)
            if (rb->visible[j]) sum += exp(rb->p[j] - ref);
    }
    const int64_t vo = attn__batch_offset(p, &p->v, b);
    const double keep_scale = p->dropout_p < 1.0 ? 1.0 / (1.0 - p->dropout_p) : 0.0;
    for (int64_t j = 0; j < p->S; j++) {
        const double pj = rb->visible[j] && !empty ? exp(rb->p[j] - ref) / sum : 0.0;
        rb->p[j] = pj;
        rb->w[j] = rb->ds[j] = 0.0;
        if (pj == 0.0) continue;
        double z = 1.0;
        if (p->dropout) {
            const uint32_t word = attn__dropout_word(p->seed, p->rng_offset,
                                                     attn__dropout_index(p, b, i, j));
            z = (uint64_t)word >= p->keep_threshold ? keep_scale : 0.0;
        }
        double dp = 0.0;
        if (z != 0.0) {
            const int64_t vj = vo + attn__row_offset(p, &p->v, b, j);
            for (int64_t e = 0; e < p->Ev; e++)
                dp += rb->dout_i[e] * attn__load(p->v.data, p->v.dtype, vj + e * p->v.cs);
            dp *= z;
        }
        rb->w[j] = pj * z;
        rb->ds[j] = dp; /* for now */
    }
    double D = 0.0;
    if (slice) {
        const int64_t oo = attn__batch_offset(p, &p->out, b) + i * p->out.rs;
        for (int64_t e = 0; e < p->Ev && !empty; e++)
            D += rb->dout_i[e] * attn__load(p->out.data, p->out.dtype, oo + e * p->out.cs);
    } else {
        for (int64_t j = 0; j < p->S; j++)
            if (rb->p[j] != 0.0) D += rb->p[j] * rb->ds[j];
    }
    for (int64_t j = 0; j < p->S; j++)
        if (rb->p[j] != 0.0) rb->ds[j] = rb->p[j] * (rb->ds[j] - D);
    return !empty;
}

/* Adds row i of batch b (its q and dout in rb: backward_row) to the dense
 * contributions of b: gq (L x E), gk (S x E), gv (S x Ev); any may be
 * NULL. */
static void accumulate_row(const attn__problem *p, int64_t b, int64_t i, const row_buffers *rb,
                           double *gq, double *gk, double *gv) {
    const int64_t ko = attn__batch_offset(p, &p->k, b);
    /* one loop per gradient, float32 rows of K read directly: the same
     * multiply-adds per element in the same key order as one interleaved
     * loop (the same bits), which the compiler can vectorise (tiny
     * problems run this as their backward) */
    const float *k32 = p->k.dtype == ATTN_DTYPE_F32 && p->k.cs == 1 ? p->k.data : NULL;
    double *gq_i = gq != NULL ? gq + i * p->E : NULL;
    for (int64_t j = 0; j < p->S; j++) {
        if (rb->p[j] == 0.0) continue;
        const double ds = p->scale * rb->ds[j] * (p->softcap > 0 ? rb->dcap[j] : 1.0);
        const int64_t kj = ko + j * p->k.rs;
        if (gq_i != NULL && k32 != NULL)
            for (int64_t e = 0; e < p->E; e++) gq_i[e] += ds * (double)k32[kj + e];
        else if (gq_i != NULL)
            for (int64_t e = 0; e < p->E; e++)
                gq_i[e] += ds * attn__load(p->k.data, p->k.dtype, kj + e * p->k.cs);
        if (gk != NULL)
            for (int64_t e = 0; e < p->E; e++) gk[j * p->E + e] += ds * rb->q_i[e];
        if (gv != NULL && rb->w[j] != 0.0)
            for (int64_t e = 0; e < p->Ev; e++) gv[j * p->Ev + e] += rb->w[j] * rb->dout_i[e];
    }
}

static attn_status alloc_rows(int threads, const attn__problem *pr, row_buffers *all) {
    const size_t n = (size_t)threads * (size_t)pr->S;
    all->p = attn__alloc_array(n, sizeof(double));
    all->w = attn__alloc_array(n, sizeof(double));
    all->ds = attn__alloc_array(n, sizeof(double));
    all->dcap = attn__alloc_array(n, sizeof(double));
    all->visible = attn__alloc_array(n, sizeof(bool));
    all->q_i = attn__alloc_array((size_t)threads * (size_t)pr->E, sizeof(double));
    all->dout_i = attn__alloc_array((size_t)threads * (size_t)pr->Ev, sizeof(double));
    return all->p && all->w && all->ds && all->dcap && all->visible && all->q_i && all->dout_i
               ? ATTN_OK
               : ATTN_ERR_NOMEM;
}

static void free_rows(row_buffers *all) {
    attn__free(all->p);
    attn__free(all->w);
    attn__free(all->ds);
    attn__free(all->dcap);
    attn__free(all->visible);
    attn__free(all->q_i);
    attn__free(all->dout_i);
}

static row_buffers thread_rows(const row_buffers *all, const attn__problem *pr) {
#ifdef _OPENMP
    const size_t t = (size_t)omp_get_thread_num();
#else
    const size_t t = 0;
#endif
    const size_t at = t * (size_t)pr->S;
    return (row_buffers){all->p + at,  all->w + at,       all->ds + at,
                         all->dcap + at, all->visible + at, all->q_i + t * (size_t)pr->E,
                         all->dout_i + t * (size_t)pr->Ev};
}

/* Where the contributions go: batch index b's query rows at qfirst[b] and
 * its keys at kfirst[b] (rows, times E or Ev), only the rows it holds
 * (attn__held_row_starts): a packed batch of one long sequence and many
 * short ones needs its rows' worth, not batch x the longest. */
typedef struct ref_starts {
    int64_t *q, *k; /* nbatch + 1 each */
} ref_starts;

/* Every batch index's dq, dk, dv contributions, one batch index per task. */
static attn_status reference_qkv(const attn__problem *p, const ref_starts *at, double *gq,
                                 double *gk, double *gv) {
    const int threads = attn__threads();
    row_buffers all;
    if (alloc_rows(threads, p, &all) != ATTN_OK) {
        free_rows(&all);
        return ATTN_ERR_NOMEM;
    }
    const double work = (double)p->nbatch * p->L * p->S * (double)(p->E + p->Ev);
    const bool parallel = p->nbatch > 1 && threads > 1 && work >= ATTN_PARALLEL_MIN_WORK;
    (void)parallel; /* only read by the OpenMP pragma */
    int cancelled = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
    for (int64_t b = 0; b < p->nbatch; b++) {
        if (attn__loop_cancelled(&cancelled, p->cancel)) continue;
        row_buffers rb = thread_rows(&all, p);
        double *q = gq ? gq + at->q[b] * p->E : NULL, *k = gk ? gk + at->k[b] * p->E : NULL;
        double *v = gv ? gv + at->k[b] * p->Ev : NULL;
        for (int64_t i = 0; i < attn__rows_of(p, b); i++) { /* a row: S·(2E + Ev) in float64 */
            if (attn__loop_cancelled(&cancelled, p->cancel)) break;
            if (backward_row(p, b, i, &rb)) accumulate_row(p, b, i, &rb, q, k, v);
        }
    }
    free_rows(&all);
    return cancelled ? attn__fail_cancelled() : ATTN_OK;
}

attn_status attn__sdpa_backward_reference(const attn__problem *p) {
    const size_t nb = (size_t)p->nbatch;
    ref_starts at = {attn__alloc_array(nb + 1, sizeof(int64_t)),
                     attn__alloc_array(nb + 1, sizeof(int64_t))};
    if (at.q == NULL || at.k == NULL) {
        attn__free(at.q);
        attn__free(at.k);
        return ATTN_ERR_NOMEM;
    }
    attn__held_row_starts(p, false, at.q);
    attn__held_row_starts(p, true, at.k);
    const size_t qrows = (size_t)at.q[nb], krows = (size_t)at.k[nb];
    double *gq = p->has_dq ? attn__alloc_array(qrows * (size_t)p->E, sizeof(double)) : NULL;
    double *gk = p->has_dk ? attn__alloc_array(krows * (size_t)p->E, sizeof(double)) : NULL;
    double *gv = p->has_dv ? attn__alloc_array(krows * (size_t)p->Ev, sizeof(double)) : NULL;
    attn_status st = ATTN_OK;
    /* (an empty buffer is a valid NULL: no row to hold) */
    if ((p->has_dq && !gq && qrows > 0) || (p->has_dk && !gk && krows > 0) ||
        (p->has_dv && !gv && krows > 0))
        st = ATTN_ERR_NOMEM;
    if (st == ATTN_OK && (gq || gk || gv)) st = reference_qkv(p, &at, gq, gk, gv);
    if (st == ATTN_OK) {
        if (gq) attn__grad_fold(p, &p->dq, gq, false, p->E, at.q);
        if (gk) attn__grad_fold(p, &p->dk, gk, true, p->E, at.k);
        if (gv) attn__grad_fold(p, &p->dv, gv, true, p->Ev, at.k);
    }
    attn__free(at.q);
    attn__free(at.k);
    attn__free(gq);
    attn__free(gk);
    attn__free(gv);
    if (st == ATTN_OK && p->has_dmask) st = attn__sdpa_backward_dmask(p);
    return st;
}

/* ---- dmask ---- */

/* Index of (b, i, j) in a dense buffer over dmask's own elements: C order
 * over the dimensions where it is not broadcast. */
typedef struct dense_index {
    int64_t bstride[ATTN_MAX_RANK], rs, cs, size;
} dense_index;

static dense_index dmask_dense(const attn__problem *p) {
    dense_index x;
    const attn__operand *op = &p->dmask;
    int64_t span = 1;
    x.cs = op->cs == 0 ? 0 : span;
    span *= op->cs == 0 ? 1 : p->S;
    x.rs = op->rs == 0 ? 0 : span;
    span *= op->rs == 0 ? 1 : p->L;
    for (int d = p->nb - 1; d >= 0; d--) {
        x.bstride[d] = op->bstride[d] == 0 ? 0 : span;
        span *= op->bstride[d] == 0 ? 1 : p->bshape[d];
    }
    x.size = span;
    return x;
}

static int64_t dense_batch(const attn__problem *p, const dense_index *x, int64_t b) {
    int64_t off = 0;
    for (int d = p->nb - 1; d >= 0; d--) {
        off += (b % p->bshape[d]) * x->bstride[d];
        b /= p->bshape[d];
    }
    return off;
}

enum { DMASK_ROWS = 64 }; /* rows whose ds are computed at once, in parallel */

/* dmask = sum of ds over what the mask was broadcast to. Rows are computed
 * DMASK_ROWS at a time in parallel, then added to a float64 buffer over
 * dmask's elements in (batch, row, key) order, then stored. */
attn_status attn__sdpa_backward_dmask(const attn__problem *p) {
    const dense_index x = dmask_dense(p);
    const int threads = attn__threads();
    double *acc = attn__alloc_array((size_t)x.size, sizeof(double));
    double *ds = attn__alloc_array((size_t)DMASK_ROWS * (size_t)p->S, sizeof(double));
    row_buffers all;
    attn_status st = alloc_rows(threads, p, &all);
    if (acc == NULL || ds == NULL) st = ATTN_ERR_NOMEM;
    const bool parallel = threads > 1 && (double)p->L * p->S * (p->E + p->Ev) >= ATTN_PARALLEL_MIN_WORK;
    (void)parallel;
    for (int64_t b = 0; st == ATTN_OK && b < p->nbatch; b++) {
        const int64_t held = attn__rows_of(p, b), base = dense_batch(p, &x, b);
        for (int64_t i0 = 0; st == ATTN_OK && i0 < held; i0 += DMASK_ROWS) {
            const int64_t n = held - i0 < DMASK_ROWS ? held - i0 : DMASK_ROWS;
            if (attn__cancelled(p->cancel)) {
                st = attn__fail_cancelled();
                break;
            }
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
            for (int64_t r = 0; r < n; r++) {
                row_buffers rb = thread_rows(&all, p);
                backward_row(p, b, i0 + r, &rb);
                for (int64_t j = 0; j < p->S; j++) ds[r * p->S + j] = rb.ds[j];
            }
            for (int64_t r = 0; r < n; r++)
                for (int64_t j = 0; j < p->S; j++)
                    acc[base + (i0 + r) * x.rs + j * x.cs] += ds[r * p->S + j];
        }
    }
    for (int64_t b = 0; st == ATTN_OK && b < p->nbatch; b++) { /* shared elements: same value */
        const int64_t off = attn__batch_offset(p, &p->dmask, b), base = dense_batch(p, &x, b);
        for (int64_t i = 0; i < p->L; i++)
            for (int64_t j = 0; j < p->S; j++)
                attn__store(p->dmask.data, p->dmask.dtype, off + i * p->dmask.rs + j * p->dmask.cs,
                            acc[base + i * x.rs + j * x.cs]);
    }
    attn__free(acc);
    attn__free(ds);
    free_rows(&all);
    return st;
}
