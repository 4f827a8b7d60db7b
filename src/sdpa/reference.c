/*
 * reference.c — the oracle. One query row at a time, in float64, reading
 * like the formula:
 *
 *   x_j = scale * q_i . k_j
 *   s_j = cap(x_j) - slope * |d_i - j| + mask_ij   for the keys j row i may see
 *   p_j = exp(s_j - m) / (exp(sink - m) + sum_j exp(s_j - m)),  m = max(sink, s_j)
 *   out_i = sum_j dropout(p_j) * v_j
 *
 * with cap(x) = softcap * tanh(x / softcap) when soft-capping, the ALiBi
 * slope and sink of the row's head (none: 0 and -inf), and d_i the row's
 * diagonal (attn__diagonal); the window and causality decide which keys
 * the row sees (attn__first_key, attn__last_key).
 *
 * Every fused kernel is tested against this file; keep it simple.
 */
#include <math.h>
#include <stdio.h>

#include "sdpa.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Combines the causal rule and every mask for (row i, key j). Returns false
 * when the key is masked out; otherwise adds the float mask values to *bias. */
static bool key_visible(const attn__problem *p, const int64_t *mask_off, int64_t i, int64_t j,
                        int64_t first, int64_t last, double *bias) {
    if (j < first || j > last) return false; /* window, causal, past the entry's keys */
    *bias = 0.0;
    for (int m = 0; m < p->nmask; m++) {
        const attn__mask *mk = &p->mask[m];
        int64_t at = mask_off[m] + i * mk->op.rs + j * mk->op.cs;
        double x = attn__load(mk->op.data, mk->op.dtype, at);
        if (mk->op.dtype == ATTN_DTYPE_BOOL) {
            if ((int)x != mk->bool_keep) return false;
        } else {
            if (x == -INFINITY) return false;
            *bias += x;
        }
    }
    return true;
}

/* Scores s_j (see the top of this file) of the keys row i of batch b may
 * see (visible[j]); returns their maximum, NaN when one is NaN (a NaN score
 * poisons its row, as in PyTorch), -inf when there are none. With
 * soft-capping and dcap != NULL, dcap[j] = d cap(x_j) / d x_j = 1 - tanh²,
 * which the backward pass needs. */
double attn__reference_scores(const attn__problem *p, int64_t b, int64_t i, double *s,
                              bool *visible, double *dcap, const double *q_i) {
    const int64_t qo = attn__batch_offset(p, &p->q, b) + i * p->q.rs;
    const int64_t ko = attn__batch_offset(p, &p->k, b);
    int64_t mask_off[ATTN__MAX_MASKS];
    for (int m = 0; m < p->nmask; m++) mask_off[m] = attn__batch_offset(p, &p->mask[m].op, b);
    const int64_t first = attn__first_key(p, b, i), last = attn__last_key(p, b, i);
    const int64_t diagonal = attn__diagonal(p, b, i);
    const double slope = attn__alibi_slope(p, b);
    double max = -INFINITY;
    bool nan = false;
    for (int64_t j = 0; j < p->S; j++) {
        double bias;
        visible[j] = key_visible(p, mask_off, i, j, first, last, &bias);
        if (!visible[j]) continue;
        const int64_t kr = ko + attn__row_offset(p, &p->k, b, j);
        double dot = 0.0;
        for (int64_t e = 0; e < p->E; e++)
            dot += (q_i ? q_i[e] : attn__load(p->q.data, p->q.dtype, qo + e * p->q.cs)) *
                   attn__load(p->k.data, p->k.dtype, kr + e * p->k.cs);
        const double x = p->scale * dot;
        s[j] = attn__modified_score(p, x, slope, diagonal, j) + bias;
        if (dcap != NULL && p->softcap > 0) {
            const double t = tanh(x / p->softcap);
            dcap[j] = 1.0 - t * t;
        }
        nan |= isnan(s[j]);
        if (s[j] > max) max = s[j];
    }
    return nan ? NAN : max;
}

/* The reference row's softmax over its visible scores and its sink (when
 * this problem holds one): s[j] <- exp(s_j - m), 0 where not visible;
 * returns the denominator's log (lse, -inf for a row with nothing to
 * weigh, NaN when a score or the sink is NaN) and sets *sum and *m. */
static double softmax_row(const attn__problem *p, int64_t b, double max, double *s,
                          const bool *visible, double *sum, double *m) {
    const double sink = attn__sinks_here(p) ? attn__sink(p, b) : -INFINITY;
    const double top = isnan(max) || isnan(sink) ? NAN : fmax(max, sink);
    *m = top;
    *sum = 0.0;
    const bool empty = top == -INFINITY;
    for (int64_t j = 0; j < p->S; j++) {
        if (!visible[j] || empty) {
            s[j] = 0.0;
            continue;
        }
        s[j] = exp(s[j] - top);
        *sum += s[j];
    }
    if (empty) return -INFINITY;
    if (sink != -INFINITY) *sum += exp(sink - top);
    return top + log(*sum);
}

/* Computes one query row; `s` has room for S doubles. */
void attn__sdpa_reference_row(const attn__problem *p, int64_t b, int64_t i, double *s,
                              bool *visible) {
    const int64_t vo = attn__batch_offset(p, &p->v, b);
    const int64_t oo = attn__batch_offset(p, &p->out, b) + i * p->out.rs;
    const double max = attn__reference_scores(p, b, i, s, visible, NULL, NULL);

    /* Softmax. A row with no visible key (or only -inf scores) and no sink
     * is empty: its output and weights are 0 and its log-sum-exp is -inf.
     * With only a sink, the weights and output are 0 and lse is the sink. */
    double sum, top;
    const double lse = softmax_row(p, b, max, s, visible, &sum, &top);
    const bool empty = top == -INFINITY;
    if (p->has_lse) {
        int64_t lo = attn__batch_offset(p, &p->lse, b) + i * p->lse.rs;
        attn__store_lse(p->lse.data, p->lse.dtype, lo, lse);
    }

    /* Normalise, drop out, and write the weights. */
    const double keep_scale = p->dropout_p < 1.0 ? 1.0 / (1.0 - p->dropout_p) : 0.0;
    const int64_t wo = p->has_weights ? attn__batch_offset(p, &p->weights, b) + i * p->weights.rs
                                      : 0;
    for (int64_t j = 0; j < p->S; j++) {
        double w = empty ? 0.0 : s[j] / sum;
        if (p->dropout) {
            const uint64_t index = attn__dropout_index(p, b, i, j);
            const uint32_t word = attn__dropout_word(p->seed, p->rng_offset, index);
            w = (uint64_t)word >= p->keep_threshold ? w * keep_scale : 0.0;
        }
        s[j] = w;
        if (p->has_weights) attn__store(p->weights.data, p->weights.dtype, wo + j * p->weights.cs, w);
    }

    /* Weighted sum of the values. A key whose weight is exactly 0 (masked,
     * dropped or underflowed) contributes nothing, even a NaN or Inf value;
     * the fused kernels keep the same rule. Keys the row does not see are
     * never read: in a NaN row their weight is NaN too, and past a ragged
     * sequence's keys there is no row to read. */
    for (int64_t e = 0; e < p->Ev; e++) {
        double acc = 0.0;
        for (int64_t j = 0; j < p->S; j++)
            if (visible[j] && s[j] != 0.0)
                acc += s[j] * attn__load(p->v.data, p->v.dtype,
                                         vo + attn__row_offset(p, &p->v, b, j) + e * p->v.cs);
        attn__store(p->out.data, p->out.dtype, oo + e * p->out.cs, acc);
    }
}

attn_status attn__sdpa_reference(const attn__problem *p) {
    const int threads = attn__threads();
    const int64_t rows = p->nbatch * p->L;
    const size_t per_thread = (size_t)p->S;
    double *scores = attn__alloc_array((size_t)threads * per_thread, sizeof(double));
    bool *visible = attn__alloc_array((size_t)threads * per_thread, sizeof(bool));
    if (scores == NULL || visible == NULL) {
        attn__free(scores);
        attn__free(visible);
        return ATTN_ERR_NOMEM;
    }
    const double work = (double)rows * (double)p->S * (double)(p->E + p->Ev);
    const bool parallel = rows > 1 && threads > 1 && work >= ATTN_PARALLEL_MIN_WORK;
    (void)parallel; /* only read by the OpenMP pragma */
    int cancelled = 0; /* rows after a cancel are skipped, on every thread */
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
    for (int64_t r = 0; r < rows; r++) {
#ifdef _OPENMP
        size_t t = (size_t)omp_get_thread_num();
#else
        size_t t = 0;
#endif
        if (attn__loop_cancelled(&cancelled, p->cancel)) continue;
        const int64_t b = r / p->L, i = r % p->L;
        if (i >= attn__rows_of(p, b)) continue; /* a ragged entry: not one of its rows */
        attn__sdpa_reference_row(p, b, i, scores + t * per_thread, visible + t * per_thread);
    }
    attn__free(scores);
    attn__free(visible);
    return cancelled ? attn__fail_cancelled() : ATTN_OK;
}
