/*
 * exp2.h — the one exp2 of the fused kernels.
 *
 * The softmax's weights are 2^x with x = (s - m)·c <= 0. Every path computes
 * them with this polynomial (but for weights rounded to bfloat16 next, which
 * take the shorter fit below): the portable kernels through
 * attn__exp2f_inline, the AVX2 and AVX-512 kernels with their own
 * instruction sequences (round, Horner with FMA, build 2^n) on these
 * coefficients and this threshold, the driver's log-sum-exp merge and the
 * vector kernels' scalar steps through attn__exp2f. Changing a coefficient
 * here changes every path together.
 */
#ifndef ATTN_KERNELS_EXP2_H
#define ATTN_KERNELS_EXP2_H

#include <math.h>

/* 2^f on [-0.5, 0.5], f = x - round(x): a degree-6 fit with relative error
 * 1.9e-9, evaluated by Horner from C6 down to C0, then scaled by 2^round(x). */
#define ATTN__EXP2F_C0 1.0f
#define ATTN__EXP2F_C1 0.693147182464599609375f
#define ATTN__EXP2F_C2 0.2402264624834060669f
#define ATTN__EXP2F_C3 0.05550328642129898071f
#define ATTN__EXP2F_C4 0.009618489071726799011f
#define ATTN__EXP2F_C5 0.001339993206784129143f
#define ATTN__EXP2F_C6 0.0001534581097075715661f

/* 2^f on [-0.5, 0.5] for weights that are rounded to bfloat16 next (the
 * bfloat16 products' P, softmax_t_bf): a degree-4 fit, relative error
 * below ATTN__EXP2F_BF16_ERR, under 1/1000 of that rounding's 2^-8, for two
 * multiply-adds fewer per weight (about 4% of a bfloat16 prefill at E = 64,
 * where the softmax is a fifth of the time). The sums l add the same
 * weights, so out moves by at most 2·ERR of itself beyond the rounding. */
#define ATTN__EXP2F_BF16_C0 0.9999992847442627f
#define ATTN__EXP2F_BF16_C1 0.6931218504905701f
#define ATTN__EXP2F_BF16_C2 0.2402474582195282f
#define ATTN__EXP2F_BF16_C3 0.05591750144958496f
#define ATTN__EXP2F_BF16_C4 0.009569964371621609f
#define ATTN__EXP2F_BF16_ERR 3e-6

/* Below this (and at -inf: a masked key) the weight is an exact 0, so no
 * subnormal is ever produced: on Intel cores each costs a microcode assist
 * per lane. Weights that small are below float32 resolution next to the
 * row's largest weight (1). NaN is never flushed. */
#define ATTN__EXP2F_MIN (-125.0f)
/* Above this, +inf (the scalar version; the softmax's x is <= 0, so the
 * vector versions have no such branch). */
#define ATTN__EXP2F_MAX 128.0f

/* 2^f for f in [-0.5, 0.5]: the polynomial alone, Horner from C6 down. */
static inline float attn__exp2f_poly(float f) {
    float p = ATTN__EXP2F_C6;
    p = p * f + ATTN__EXP2F_C5;
    p = p * f + ATTN__EXP2F_C4;
    p = p * f + ATTN__EXP2F_C3;
    p = p * f + ATTN__EXP2F_C2;
    p = p * f + ATTN__EXP2F_C1;
    p = p * f + ATTN__EXP2F_C0;
    return p;
}

/* The scalar polynomial, for portable files: the generic kernels call it in
 * their inner loops, where an out-of-line call would cost speed. */
static inline float attn__exp2f_inline(float x) {
    if (isnan(x)) return x;
    if (x < ATTN__EXP2F_MIN) return 0.0f;
    if (x > ATTN__EXP2F_MAX) return INFINITY;
    float n = floorf(x + 0.5f), f = x - n;
    return ldexpf(attn__exp2f_poly(f), (int)n);
}

/* float64 uses libm's exp2: the float64 path is the accurate one, and no
 * vector kernel needs a cheaper one yet. */
static inline double attn__exp2d_inline(double x) { return exp2(x); }

/* The same functions out of line (exp2.c, compiled without ISA flags), for
 * the driver and for the vector kernels' scalar steps. The ISA files must
 * not inline the polynomial: built with -mfma, a compiler that contracts
 * a * b + c into an FMA (clang does by default) would round it differently
 * from the portable path. */
float attn__exp2f(float x);
double attn__exp2d(double x);

#endif /* ATTN_KERNELS_EXP2_H */
