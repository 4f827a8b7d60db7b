/* peak_generic.c — portable probes: scalar FMA chains and a streaming read. */
#include <math.h>

#include "peak.h"

double peak_fma_scalar(int64_t iters) {
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    for (int64_t i = 0; i < iters; i++)
        for (int k = 0; k < 8; k++) a[k] = fmaf(a[k], 0.999999f, 1e-6f);
    volatile float sink = a[0] + a[7];
    (void)sink;
    return 2.0 * 8 * (double)iters;
}

float bandwidth_read(const float *x, int64_t n) {
    float s[16] = {0}; /* independent accumulators: the loop is load-bound */
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int k = 0; k < 16; k++) s[k] += x[i + k];
    for (; i < n; i++) s[0] += x[i];
    float t = 0;
    for (int k = 0; k < 16; k++) t += s[k];
    return t;
}
