/* lse_merge.c — see lse_merge.h. Written once, for float and double. */
#include <math.h>

#include "lse_merge.h"

/* log sum_c exp(lse_c), NaN if any lse_c is NaN. */
static double merged_lse(int64_t n, const double *lse_parts, int64_t lse_stride) {
    double max = -INFINITY;
    for (int64_t c = 0; c < n; c++) {
        const double x = lse_parts[c * lse_stride];
        if (isnan(x)) return NAN;
        if (x > max) max = x;
    }
    if (max == -INFINITY) return -INFINITY;
    double sum = 0;
    for (int64_t c = 0; c < n; c++) sum += exp(lse_parts[c * lse_stride] - max);
    return max + log(sum);
}

enum { FEATURES = 64 }; /* output features accumulated at once, in float64 */

/* Features are taken FEATURES at a time so each part's weight is computed
 * once per block, not once per feature. */
#define DEFINE_MERGE(REAL, SFX)                                                                 \
    void attn__lse_merge_##SFX(int64_t n, const REAL *out_parts, int64_t part_stride,           \
                               const double *lse_parts, int64_t lse_stride, int64_t Ev,         \
                               REAL *out, int64_t out_cs, double *lse) {                        \
        const double total = merged_lse(n, lse_parts, lse_stride);                              \
        *lse = total;                                                                           \
        for (int64_t e0 = 0; e0 < Ev; e0 += FEATURES) {                                         \
            const int64_t ne = Ev - e0 < FEATURES ? Ev - e0 : FEATURES;                         \
            double acc[FEATURES];                                                               \
            for (int64_t e = 0; e < ne; e++) acc[e] = isnan(total) ? NAN : 0.0;                 \
            for (int64_t c = 0; c < n && total > -INFINITY; c++) {                              \
                const double w = exp(lse_parts[c * lse_stride] - total);                        \
                if (w == 0) continue; /* nothing from it, not even a NaN */                     \
                const REAL *part = out_parts + c * part_stride + e0;                            \
                for (int64_t e = 0; e < ne; e++) acc[e] += w * (double)part[e];                 \
            }                                                                                   \
            for (int64_t e = 0; e < ne; e++) out[(e0 + e) * out_cs] = (REAL)acc[e];             \
        }                                                                                       \
    }

DEFINE_MERGE(float, f)
DEFINE_MERGE(double, d)
