/* lse_merge.c — see lse_merge.h. Written once, for float and double. */
#include <math.h>

#include "lse_merge.h"

/* The merged lse, max + log(sum), from the largest lse_c (*max; NaN if any
 * lse_c is NaN, -inf if every part saw no key) and sum_c exp(lse_c - max)
 * (*sum, >= 1); part c weighs exp(lse_c - max) / sum. The weights are
 * measured from the largest part, not from the merged lse: at |lse| ~ 1e38
 * (rows masked with torch.finfo(float32).min) max + log(sum) rounds back to
 * max in float64, and exp(lse_c - lse) would weigh n equal parts 1 each
 * instead of 1/n. */
static double lse_scale(int64_t n, const double *lse_parts, int64_t lse_stride, double *max,
                        double *sum) {
    *max = -INFINITY;
    *sum = 0;
    for (int64_t c = 0; c < n; c++) {
        const double x = lse_parts[c * lse_stride];
        if (isnan(x)) {
            *max = NAN;
            return NAN;
        }
        if (x > *max) *max = x;
    }
    if (*max == -INFINITY) return -INFINITY;
    for (int64_t c = 0; c < n; c++) *sum += exp(lse_parts[c * lse_stride] - *max);
    return *max + log(*sum);
}

/* Part c's weight (0 when nothing saw a key or the merge is NaN). */
static double part_weight(double lse_c, double max, double sum) {
    return max > -INFINITY ? exp(lse_c - max) / sum : 0.0;
}

enum { FEATURES = 64 }; /* output features accumulated at once, in float64 */

/* Features are taken FEATURES at a time so each part's weight is computed
 * once per block, not once per feature. */
#define DEFINE_MERGE(REAL, SFX)                                                                 \
    bool attn__lse_merge_##SFX(int64_t n, const REAL *out_parts, int64_t part_stride,           \
                               const double *lse_parts, int64_t lse_stride, int64_t Ev,         \
                               const attn__operand *out, int64_t out_at, double *lse) {         \
        double max, sum;                                                                        \
        const double total = lse_scale(n, lse_parts, lse_stride, &max, &sum);                   \
        bool finite = !isnan(total);                                                            \
        *lse = total;                                                                           \
        for (int64_t e0 = 0; e0 < Ev; e0 += FEATURES) {                                         \
            const int64_t ne = Ev - e0 < FEATURES ? Ev - e0 : FEATURES;                         \
            double acc[FEATURES];                                                               \
            for (int64_t e = 0; e < ne; e++) acc[e] = isnan(total) ? NAN : 0.0;                 \
            for (int64_t c = 0; c < n && total > -INFINITY; c++) {                              \
                const double w = part_weight(lse_parts[c * lse_stride], max, sum);              \
                if (w == 0) continue; /* nothing from it, not even a NaN */                     \
                const REAL *part = out_parts + c * part_stride + e0;                            \
                for (int64_t e = 0; e < ne; e++) acc[e] += w * (double)part[e];                 \
            }                                                                                   \
            for (int64_t e = 0; e < ne; e++) {                                                  \
                finite = finite && isfinite(acc[e]);                                            \
                attn__store(out->data, out->dtype, out_at + (e0 + e) * out->cs, acc[e]);         \
            }                                                                                   \
        }                                                                                       \
        return finite;                                                                          \
    }

DEFINE_MERGE(float, f)
DEFINE_MERGE(double, d)

/* ---- attn_sdpa_merge: the public, strided form for two parts ---- */

/* out (..., L, Ev) and lse (..., L) of a result and of a part: one shape,
 * float dtypes, outputs apart from everything else. */
static attn_status check_merge(attn_tensor *out, attn_tensor *lse, const attn_tensor *part_out,
                               const attn_tensor *part_lse) {
    const attn_tensor *all[4] = {out, lse, part_out, part_lse};
    const char *names[4] = {"out", "lse", "part_out", "part_lse"};
    for (int i = 0; i < 4; i++) {
        attn_status st = attn__check_tensor(all[i], names[i], i % 2 == 0 ? 2 : 1,
                                            i < 2 ? ATTN__OUTPUT : ATTN__INPUT);
        if (st != ATTN_OK) return st;
        const bool is_out = i % 2 == 0; /* out, part_out: any float dtype */
        if (is_out ? !attn__is_floating(all[i]->dtype) : !attn__is_float(all[i]->dtype))
            return attn__fail_arg(ATTN_ERR_DTYPE, names[i], "%s is %s; expected %s", names[i],
                                  attn_dtype_name(all[i]->dtype),
                                  is_out ? "float32, float64, float16 or bfloat16"
                                         : "float32 or float64");
    }
    char a[96], b[96];
    for (int i = 0; i < 4; i++) {
        const int want_rank = i % 2 == 0 ? out->rank : out->rank - 1; /* lse: no Ev */
        bool same = all[i]->rank == want_rank;
        for (int d = 0; same && d < want_rank; d++) same = all[i]->shape[d] == out->shape[d];
        if (!same)
            return attn__fail_arg(ATTN_ERR_SHAPE, names[i],
                                  "%s has shape %s; out has %s, so %s must be %s", names[i],
                                  attn__shape_str(a, sizeof a, all[i]->rank, all[i]->shape),
                                  attn__shape_str(b, sizeof b, out->rank, out->shape), names[i],
                                  i % 2 == 0 ? "of out's shape" : "out's shape without Ev");
    }
    for (int o = 0; o < 2; o++) {
        attn_status st = attn__check_output_layout(all[o], names[o]);
        if (st != ATTN_OK) return st;
        for (int i = o + 1; i < 4; i++)
            if (attn__views_overlap(all[o], all[i]))
                return attn__fail_arg(ATTN_ERR_OVERLAP, names[o], "%s overlaps %s in memory",
                                      names[o], names[i]);
    }
    return ATTN_OK;
}

attn_status attn_sdpa_merge(attn_tensor *out, attn_tensor *lse, const attn_tensor *part_out,
                            const attn_tensor *part_lse) {
    attn__clear_error();
    attn_status st = check_merge(out, lse, part_out, part_lse);
    if (st != ATTN_OK) return st;
    const int nd = out->rank - 1;
    int64_t rows = 1;
    for (int d = 0; d < nd; d++) rows *= out->shape[d];
    const int64_t Ev = out->shape[nd], ocs = out->strides[nd], pcs = part_out->strides[nd];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t lo = attn__linear_offset(lse, nd, r);
        const int64_t plo = attn__linear_offset(part_lse, nd, r);
        const int64_t oo = attn__linear_offset(out, nd, r);
        const int64_t po = attn__linear_offset(part_out, nd, r);
        const double parts[2] = {attn__load(lse->data, lse->dtype, lo),
                                 attn__load(part_lse->data, part_lse->dtype, plo)};
        double max, sum;
        const double total = lse_scale(2, parts, 1, &max, &sum);
        /* A part's weight; exactly 0 (no key, or swamped) takes nothing. */
        const double w0 = part_weight(parts[0], max, sum), w1 = part_weight(parts[1], max, sum);
        for (int64_t e = 0; e < Ev; e++) {
            double acc = isnan(total) ? NAN : 0.0;
            if (w0 != 0) acc += w0 * attn__load(out->data, out->dtype, oo + e * ocs);
            if (w1 != 0) acc += w1 * attn__load(part_out->data, part_out->dtype, po + e * pcs);
            attn__store(out->data, out->dtype, oo + e * ocs, acc);
        }
        attn__store_lse(lse->data, lse->dtype, lo, total);
    }
    return ATTN_OK;
}
