/* peak.h — FMA and memory probes for the benchmark: what this machine can
 * do at best, measured in the same run as the kernels they grade. */
#ifndef ATTN_BENCH_PEAK_H
#define ATTN_BENCH_PEAK_H

#include <stdint.h>

/* FMA throughput loops: flops done by one thread in `iters` iterations.
 * Each runs independent FMA chains (more than latency x ports) so only
 * throughput limits them. */
double peak_fma_avx512(int64_t iters);
double peak_fma_avx2(int64_t iters);
double peak_fma_scalar(int64_t iters);
/* AVX512-BF16 dot products (vdpbf16ps), where compiled (ATTN_BENCH_AVX512BF16). */
double peak_dp_bf16(int64_t iters);
/* AMX-BF16 tile products (tdpbf16ps), where compiled (ATTN_BENCH_AMX) and
 * attn_isa_supported(ATTN_ISA_AMX). */
double peak_amx_bf16(int64_t iters);

/* Sums n floats with independent accumulators (a pure streaming read). */
float bandwidth_read(const float *x, int64_t n);

#endif
