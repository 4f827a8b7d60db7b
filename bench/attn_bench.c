/*
 * attn_bench — the C side of the benchmark: machine probes and the runs
 * that need no Python. bench/run.py calls it for the probes, in the same run
 * as the attn-vs-PyTorch comparison. Every command prints one JSON object.
 *
 *   attn_bench peak [--threads N] [--bf16] [--rounds R]
 *                                        measured FMA peak, GFLOP/s, best
 *                                        of R rounds (7); --bf16: the
 *                                        bfloat16 products' peak on the
 *                                        path in use: AMX tiles ("isa":
 *                                        "amx"), else the AVX512-BF16 dot
 *                                        product ("none" where the CPU or
 *                                        the compiler lacks it)
 *   attn_bench bandwidth [--threads N] [--mib M] [--thp]
 *                                        streaming read bandwidth, GB/s
 *                                        (--thp: the buffer on transparent
 *                                        huge pages, as decode --thp's caches)
 *   attn_bench memory [--len L] [--dim E]
 *                                        one SDPA with L = S, H = 1; checks peak
 *                                        RSS <= inputs + outputs + 64 MiB
 *   attn_bench memory-backward [--len L] [--dim E]
 *                                        one forward + backward with L = S, H = 1;
 *                                        checks the backward's peak RSS <= inputs
 *                                        (q, k, v, dout, out, lse) + dq, dk, dv + 64 MiB
 *   attn_bench sdpa B H L S E [--causal] [--kv-heads H] [--reps N] [--cpu-time]
 *                  [--softcap C] [--dtype D] [--kv-dtype D]
 *                                        times attn alone (median ms, GFLOP/s);
 *                                        --softcap: with logit soft-capping at C;
 *                                        D: float32 (default), float16, bfloat16
 *                                        (q and out in --dtype, k and v in
 *                                        --kv-dtype, which defaults to it)
 *   attn_bench backward B H L S E [--causal] [--kv-heads H] [--reps N]
 *                       [--load DIR] [--save DIR] [--cpu-time]
 *                                        times attn_sdpa (with lse) then
 *                                        attn_sdpa_backward: per-rep and median
 *                                        ms of the backward and of both; inputs
 *                                        q, k, v, dout from DIR/NAME.npy, dq, dk,
 *                                        dv written to DIR/NAME.npy
 *
 *   attn_bench decode|window|varlen|kv-read ...
 *                                        the serving cases (bench/serving_bench.c):
 *                                        attn_sdpa_kvcache, the sliding window,
 *                                        attn_sdpa_varlen, each beside the
 *                                        references it is compared with
 *
 * --cpu-time (with --threads 1) measures the calling thread's CPU time
 * instead of wall time: on a shared machine it excludes the time the thread
 * is preempted, which makes kernel tuning repeatable. `peak --cpu-time` does
 * the same for the FMA probe, so their ratio is an efficiency.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, getrusage */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attn.h"
#include "bench.h"
#include "peak.h"

/* The vector probes exist when the build compiled them (as the kernels). */
#ifdef ATTN_BENCH_AVX512
#define PEAK_AVX512(n) peak_fma_avx512(n)
#else
#define PEAK_AVX512(n) peak_fma_scalar(n)
#endif
#ifdef ATTN_BENCH_AVX2
#define PEAK_AVX2(n) peak_fma_avx2(n)
#else
#define PEAK_AVX2(n) peak_fma_scalar(n)
#endif


/* ---- peak: all threads run FMA chains at once; best of several rounds ---- */

/* Whether this CPU and OS run AVX512-BF16 (CPUID leaf 7 subleaf 1, EAX bit
 * 5; the library's AVX-512 check covers the OS's register state). */
static bool cpu_has_bf16(void) {
#if defined(ATTN_BENCH_AVX512BF16) && (defined(__x86_64__) || defined(__i386__))
    unsigned a, b, c, d;
    if (!attn_isa_supported(ATTN_ISA_AVX512) || __get_cpuid_max(0, NULL) < 7) return false;
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 5) & 1;
#else
    return false;
#endif
}

/* The bfloat16 products' peak on the path bfloat16 prefills take: AMX
 * tiles where the path is amx, vdpbf16ps where the CPU has AVX512-BF16. */
static int cmd_peak_bf16(int threads, int rounds) {
    double best = 0;
    const char *isa = "none";
#ifdef ATTN_BENCH_AMX
    const bool amx = attn_get_isa() == ATTN_ISA_AMX;
#else
    const bool amx = false;
#endif
#ifdef ATTN_BENCH_AVX512BF16
    for (int round = 0; round < rounds && (amx || cpu_has_bf16()); round++) {
        double flops = 0;
        const double t0 = bench_now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
#ifdef ATTN_BENCH_AMX
        flops += amx ? peak_amx_bf16(2000000) : peak_dp_bf16(4000000);
#else
        flops += peak_dp_bf16(4000000);
#endif
        const double g = flops / (bench_now() - t0) / 1e9;
        if (g > best) best = g;
    }
    isa = amx ? "amx" : cpu_has_bf16() ? "avx512_bf16" : "none";
#endif
    printf("{\"isa\": \"%s\", \"threads\": %d, \"gflops\": %.2f}\n", isa, threads, best);
    return 0;
}

static int cmd_peak(int argc, char **argv) {
    const int threads = (int)bench_opt_long(argc, argv, "--threads", attn_get_num_threads());
    /* best of `rounds` (7; fewer for the probes run beside a case's rounds) */
    const long rounds_opt = bench_opt_long(argc, argv, "--rounds", 7);
    const int rounds = rounds_opt < 1 ? 1 : rounds_opt > 100 ? 100 : (int)rounds_opt;
    if (bench_has_flag(argc, argv, "--bf16")) return cmd_peak_bf16(threads, rounds);
    const char *isa = attn_isa_supported(ATTN_ISA_AVX512) ? "avx512"
                      : attn_isa_supported(ATTN_ISA_AVX2) ? "avx2"
                                                          : "scalar";
    double best = 0;
    for (int round = 0; round < rounds; round++) {
        double flops = 0;
        const double t0 = bench_now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
        {
            const int64_t iters = 4000000;
            flops += strcmp(isa, "avx512") == 0 ? PEAK_AVX512(iters)
                     : strcmp(isa, "avx2") == 0 ? PEAK_AVX2(iters)
                                                 : peak_fma_scalar(iters / 4);
        }
        const double g = flops / (bench_now() - t0) / 1e9;
        if (g > best) best = g;
    }
    printf("{\"isa\": \"%s\", \"threads\": %d, \"gflops\": %.2f}\n", isa, threads, best);
    return 0;
}

/* ---- bandwidth: every thread streams its share of a large buffer ---- */

static int cmd_bandwidth(int argc, char **argv) {
    const int threads = (int)bench_opt_long(argc, argv, "--threads", attn_get_num_threads());
    const int64_t n = bench_opt_long(argc, argv, "--mib", 512) * (1 << 20) / 4;
    const int thp = bench_has_flag(argc, argv, "--thp");
    float *x = thp ? bench_alloc_huge((size_t)n * sizeof(float)) : malloc((size_t)n * sizeof(float));
    if (x == NULL) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) x[i] = 1.0f; /* first touch by the reading thread */
    double best = 0, sink = 0;
    for (int round = 0; round < 5; round++) {
        const double t0 = bench_now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
#ifdef _OPENMP
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
            const int t = 0, nt = 1;
#endif
            const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
            sink += bandwidth_read(x + lo, hi - lo);
        }
        const double g = (double)n * 4 / (bench_now() - t0) / 1e9;
        if (g > best) best = g;
    }
    free(x);
    printf("{\"threads\": %d, \"mib\": %lld, \"gbps\": %.2f, \"check\": %.0f}\n", threads,
           (long long)(n * 4 >> 20), best, sink / 5);
    return 0;
}

/* ---- memory: the fused kernel's footprint at a length the math path cannot do ---- */

/* The peak RSS of this process image, in MiB. On Linux from VmHWM: the
 * getrusage maximum survives exec, so a child of a big process (run.py,
 * with PyTorch loaded) would report its parent's peak. */
static double rss_mib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (f != NULL) {
        char line[256];
        long kib = -1;
        while (fgets(line, sizeof line, f) != NULL)
            if (sscanf(line, "VmHWM: %ld kB", &kib) == 1) break;
        fclose(f);
        if (kib >= 0) return (double)kib / 1024.0;
    }
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)u.ru_maxrss / 1024.0; /* Linux: KiB */
}

static float *filled(int64_t n, unsigned seed) {
    float *x = malloc((size_t)n * sizeof(float));
    if (x == NULL) return NULL;
    unsigned s = seed;
    for (int64_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)(s >> 8) / 16777216.0f - 0.5f;
    }
    return x;
}

/* float32 values as `dtype` (float32, or 16-bit, rounded to nearest even)
 * in place: the buffer keeps its float32 room. */
static void narrow_to(float *x, int64_t n, attn_dtype dtype) {
    if (dtype == ATTN_DTYPE_F32) return;
    uint16_t *h = (uint16_t *)x;
    for (int64_t i = 0; i < n; i++) {
        if (dtype == ATTN_DTYPE_BF16) {
            h[i] = bench_bf16(x[i]);
        } else { /* binary16; the bench's values are in (-0.5, 0.5): normal or subnormal */
            _Float16 f = (_Float16)x[i];
            memcpy(&h[i], &f, sizeof f);
        }
    }
}

/* --dtype / --kv-dtype: float32, float16 or bfloat16 (0: anything else). */
static attn_dtype dtype_opt(int argc, char **argv, const char *name, attn_dtype fallback) {
    const char *s = bench_opt_str(argc, argv, name);
    if (s == NULL) return fallback;
    return strcmp(s, "float32") == 0   ? ATTN_DTYPE_F32
           : strcmp(s, "float16") == 0 ? ATTN_DTYPE_F16
           : strcmp(s, "bfloat16") == 0 ? ATTN_DTYPE_BF16
                                        : (attn_dtype)0;
}

static int cmd_memory(int argc, char **argv) {
    const int64_t L = bench_opt_long(argc, argv, "--len", 65536), E = bench_opt_long(argc, argv, "--dim", 64);
    const double baseline = rss_mib();
    const int64_t n = L * E;
    float *q = filled(n, 1), *k = filled(n, 2), *v = filled(n, 3), *o = filled(n, 4);
    if (!q || !k || !v || !o) return 1;
    int64_t shape[4] = {1, 1, L, E};
    attn_tensor tq, tk, tv, to;
    attn_tensor_init(&tq, q, ATTN_DTYPE_F32, 4, shape);
    attn_tensor_init(&tk, k, ATTN_DTYPE_F32, 4, shape);
    attn_tensor_init(&tv, v, ATTN_DTYPE_F32, 4, shape);
    attn_tensor_init(&to, o, ATTN_DTYPE_F32, 4, shape);
    const double before = rss_mib();
    const double t0 = bench_now();
    attn_status st = attn_sdpa(&tq, &tk, &tv, NULL, &to, NULL, NULL);
    const double secs = bench_now() - t0;
    if (st != ATTN_OK) {
        fprintf(stderr, "attn_bench memory: %s\n", attn_last_error());
        return 1;
    }
    double checksum = 0;
    for (int64_t i = 0; i < n; i += 997) checksum += o[i];
    const double peak = rss_mib();
    const double io_mib = 4.0 * (double)n * 4 / (1 << 20);
    const double budget = io_mib + 64;
    const double used = peak - baseline;
    printf("{\"L\": %lld, \"E\": %lld, \"seconds\": %.2f, \"baseline_rss_mib\": %.1f, "
           "\"rss_before_call_mib\": %.1f, \"peak_rss_mib\": %.1f, \"inputs_outputs_mib\": %.1f, "
           "\"used_mib\": %.1f, \"budget_mib\": %.1f, \"within_budget\": %s, "
           "\"scores_matrix_mib\": %.0f, \"checksum\": %.6f}\n",
           (long long)L, (long long)E, secs, baseline, before, peak, io_mib, used, budget,
           used <= budget ? "true" : "false", (double)L * (double)L * 4 / (1 << 20), checksum);
    free(q);
    free(k);
    free(v);
    free(o);
    return used <= budget ? 0 : 1;
}

/* ---- the backward: one forward (with lse) and its backward on seeded or loaded inputs ---- */

/* A backward problem: q (B,H,L,E), k and v (B,Hk,S,E), dout and out like q,
 * lse (B,H,L), gradients like their inputs; every buffer owned here. */
typedef struct {
    int64_t B, H, Hk, L, S, E;
    int causal;
    float *q, *k, *v, *dout, *out, *lse, *dq, *dk, *dv;
    attn_tensor tq, tk, tv, tdout, tout, tlse, tdq, tdk, tdv;
    attn_sdpa_params p;
} bwd_problem;

static void bwd_free(bwd_problem *b) {
    float *bufs[] = {b->q, b->k, b->v, b->dout, b->out, b->lse, b->dq, b->dk, b->dv};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
}

/* Replaces dst's n floats by DIR/NAME.npy (float32, n elements), so that
 * run.py can give attn and PyTorch the same inputs. 0 on success. */
static int load_npy(const char *dir, const char *name, float *dst, int64_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.npy", dir, name);
    attn_tensor t;
    if (attn_npy_load(path, &t) != ATTN_OK) {
        fprintf(stderr, "attn_bench: %s: %s\n", path, attn_last_error());
        return 1;
    }
    const int ok = t.dtype == ATTN_DTYPE_F32 && attn_tensor_numel(&t) == n;
    if (ok) memcpy(dst, t.data, (size_t)n * sizeof(float));
    else fprintf(stderr, "attn_bench: %s: expected %lld float32 values\n", path, (long long)n);
    attn_npy_free(&t);
    return !ok;
}

/* Allocates and fills every buffer (seeded, or q, k, v, dout from
 * load_dir), sets the tensor views and params. Outputs and gradients are
 * filled too: their pages are resident before any timing or RSS reading. */
static int bwd_setup(bwd_problem *b, const char *load_dir) {
    const int64_t nq = b->B * b->H * b->L * b->E, nk = b->B * b->Hk * b->S * b->E;
    b->q = filled(nq, 1), b->k = filled(nk, 2), b->v = filled(nk, 3), b->dout = filled(nq, 5);
    b->out = filled(nq, 4), b->lse = filled(b->B * b->H * b->L, 6);
    b->dq = filled(nq, 7), b->dk = filled(nk, 8), b->dv = filled(nk, 9);
    if (!b->q || !b->k || !b->v || !b->dout || !b->out || !b->lse || !b->dq || !b->dk || !b->dv)
        return 1;
    if (load_dir != NULL &&
        (load_npy(load_dir, "q", b->q, nq) || load_npy(load_dir, "k", b->k, nk) ||
         load_npy(load_dir, "v", b->v, nk) || load_npy(load_dir, "dout", b->dout, nq)))
        return 1;
    int64_t qs[4] = {b->B, b->H, b->L, b->E}, ks[4] = {b->B, b->Hk, b->S, b->E};
    attn_tensor_init(&b->tq, b->q, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&b->tk, b->k, ATTN_DTYPE_F32, 4, ks);
    attn_tensor_init(&b->tv, b->v, ATTN_DTYPE_F32, 4, ks);
    attn_tensor_init(&b->tdout, b->dout, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&b->tout, b->out, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&b->tlse, b->lse, ATTN_DTYPE_F32, 3, qs);
    attn_tensor_init(&b->tdq, b->dq, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&b->tdk, b->dk, ATTN_DTYPE_F32, 4, ks);
    attn_tensor_init(&b->tdv, b->dv, ATTN_DTYPE_F32, 4, ks);
    attn_sdpa_params_init(&b->p);
    b->p.causal = b->causal ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    b->p.enable_gqa = b->Hk != b->H;
    b->p.lse_for_backward = 1; /* as training calls it (the torch operator does) */
    return 0;
}

/* The forward, writing out and lse. */
static attn_status bwd_forward(bwd_problem *b) {
    return attn_sdpa(&b->tq, &b->tk, &b->tv, &b->p, &b->tout, NULL, &b->tlse);
}

/* The backward, writing dq, dk and dv. */
static attn_status bwd_backward(bwd_problem *b) {
    return attn_sdpa_backward(&b->tdout, &b->tq, &b->tk, &b->tv, &b->tout, &b->tlse, &b->p,
                              &b->tdq, &b->tdk, &b->tdv, NULL);
}

/* The forward then the backward; their times in ms. */
static attn_status bwd_run(bwd_problem *b, double *fwd_ms, double *bwd_ms) {
    const double t0 = bench_now();
    attn_status st = bwd_forward(b);
    const double t1 = bench_now();
    if (st == ATTN_OK) st = bwd_backward(b);
    *fwd_ms = (t1 - t0) * 1e3;
    *bwd_ms = (bench_now() - t1) * 1e3;
    return st;
}

/* Writes DIR/{dq,dk,dv}.npy, for run.py to compare with PyTorch's. */
static int bwd_save(const bwd_problem *b, const char *dir) {
    const char *names[3] = {"dq", "dk", "dv"};
    const attn_tensor *ts[3] = {&b->tdq, &b->tdk, &b->tdv};
    char path[4096];
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s.npy", dir, names[i]);
        if (attn_npy_save(path, ts[i]) != ATTN_OK) {
            fprintf(stderr, "attn_bench: %s: %s\n", path, attn_last_error());
            return 1;
        }
    }
    return 0;
}


/* Prints a JSON list of n values (in the order they were measured). */
static void print_list(const char *name, const double *x, int n) {
    printf("\"%s\": [", name);
    for (int i = 0; i < n; i++) printf("%s%.3f", i ? ", " : "", x[i]);
    printf("], ");
}


/* ---- backward: forward + backward timed, one warm-up then N reps ---- */

static int cmd_backward(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: attn_bench backward B H L S E [--causal] [--kv-heads H] "
                        "[--reps N] [--load DIR] [--save DIR]\n");
        return 2;
    }
    bwd_problem b = {.B = atol(argv[0]), .H = atol(argv[1]), .L = atol(argv[2]),
                     .S = atol(argv[3]), .E = atol(argv[4])};
    b.Hk = bench_opt_long(argc, argv, "--kv-heads", b.H);
    b.causal = bench_has_flag(argc, argv, "--causal");
    const int reps = (int)bench_opt_long(argc, argv, "--reps", 10);
    if (reps < 1) {
        fprintf(stderr, "attn_bench backward: --reps must be >= 1\n");
        return 2;
    }
    const char *save_dir = bench_opt_str(argc, argv, "--save");
    double *fwd = malloc(sizeof(double) * (size_t)reps);
    double *bwd = malloc(sizeof(double) * (size_t)reps);
    double *both = malloc(sizeof(double) * (size_t)reps);
    int rc = !fwd || !bwd || !both || bwd_setup(&b, bench_opt_str(argc, argv, "--load"));
    for (int r = -1; r < reps && rc == 0; r++) { /* r = -1: the warm-up */
        double f, g;
        if (bwd_run(&b, &f, &g) != ATTN_OK) {
            fprintf(stderr, "attn_bench backward: %s\n", attn_last_error());
            rc = 1;
        } else if (r >= 0) {
            fwd[r] = f, bwd[r] = g, both[r] = f + g;
        }
    }
    if (rc == 0 && save_dir != NULL) rc = bwd_save(&b, save_dir);
    if (rc == 0) {
        const double bhlse = (double)(b.B * b.H * b.L) * (double)b.S * (double)b.E;
        const double half = b.causal ? 0.5 : 1, mb = bench_median(bwd, reps), mt = bench_median(both, reps);
        double checksum = 0;
        for (int64_t i = 0; i < b.B * b.H * b.L * b.E; i += 101) checksum += b.dq[i];
        printf("{\"shape\": [%lld, %lld, %lld, %lld, %lld], \"kv_heads\": %lld, \"causal\": %s, "
               "\"isa\": \"%s\", \"threads\": %d, ",
               (long long)b.B, (long long)b.H, (long long)b.L, (long long)b.S, (long long)b.E,
               (long long)b.Hk, b.causal ? "true" : "false", attn_isa_name(attn_get_isa()),
               attn_get_num_threads());
        print_list("fwd_ms", fwd, reps);
        print_list("bwd_ms", bwd, reps);
        print_list("fwd_bwd_ms", both, reps);
        printf("\"median_bwd_ms\": %.3f, \"median_fwd_bwd_ms\": %.3f, \"bwd_gflops\": %.2f, "
               "\"fwd_bwd_gflops\": %.2f, \"dq_checksum\": %.6f}\n",
               mb, mt, 10 * bhlse * half / mb / 1e6, 14 * bhlse * half / mt / 1e6, checksum);
    }
    bwd_free(&b);
    free(fwd);
    free(bwd);
    free(both);
    return rc;
}

/* ---- memory-backward: the backward's footprint at L = S = 65536 ---- */

/* Resets the kernel's RSS high-water mark to the current RSS (Linux: "5"
 * to clear_refs), so that the next peak is the backward's alone. */
static int reset_hwm(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (f == NULL) return 0;
    const int ok = fputs("5", f) >= 0;
    return fclose(f) == 0 && ok;
}

static int cmd_memory_backward(int argc, char **argv) {
    const int64_t L = bench_opt_long(argc, argv, "--len", 65536), E = bench_opt_long(argc, argv, "--dim", 64);
    const double baseline = rss_mib();
    bwd_problem b = {.B = 1, .H = 1, .Hk = 1, .L = L, .S = L, .E = E};
    if (bwd_setup(&b, NULL)) return 1;
    const double t0 = bench_now();
    attn_status st = bwd_forward(&b);
    const int reset = st == ATTN_OK && reset_hwm(); /* the forward's peak is not counted */
    const double before = rss_mib(), t1 = bench_now();
    if (st == ATTN_OK) st = bwd_backward(&b);
    const double fwd_s = t1 - t0, bwd_s = bench_now() - t1;
    if (st != ATTN_OK) {
        fprintf(stderr, "attn_bench memory-backward: %s\n", attn_last_error());
        return 1;
    }
    const double peak = rss_mib();
    double checksum = 0;
    for (int64_t i = 0; i < L * E; i += 997) checksum += b.dq[i] + b.dk[i] + b.dv[i];
    /* q, k, v, dout, out (4 bytes x L x E each), lse (4 x L), dq, dk, dv */
    const double io_mib = (8.0 * (double)(L * E) + (double)L) * 4 / (1 << 20);
    const double used = peak - baseline, budget = io_mib + 64;
    printf("{\"L\": %lld, \"E\": %lld, \"seconds\": %.2f, \"fwd_seconds\": %.2f, "
           "\"baseline_rss_mib\": %.1f, \"rss_before_backward_mib\": %.1f, "
           "\"hwm_reset_after_forward\": %s, \"peak_rss_mib\": %.1f, "
           "\"inputs_outputs_gradients_mib\": %.1f, \"used_mib\": %.1f, \"budget_mib\": %.1f, "
           "\"within_budget\": %s, \"checksum\": %.6f}\n",
           (long long)L, (long long)E, bwd_s, fwd_s, baseline, before,
           reset ? "true" : "false", peak, io_mib, used, budget, used <= budget ? "true" : "false",
           checksum);
    bwd_free(&b);
    return used <= budget ? 0 : 1;
}

/* ---- sdpa: attn alone, seeded inputs, median of N after warm-up ---- */

static int cmd_sdpa(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: attn_bench sdpa B H L S E [--causal] [--kv-heads H] [--reps N] "
                        "[--softcap C]\n");
        return 2;
    }
    const int64_t B = atol(argv[0]), H = atol(argv[1]), L = atol(argv[2]), S = atol(argv[3]),
                  E = atol(argv[4]);
    const int64_t Hk = bench_opt_long(argc, argv, "--kv-heads", H);
    const int reps = (int)bench_opt_long(argc, argv, "--reps", 10);
    const int causal = bench_has_flag(argc, argv, "--causal");
    const attn_dtype dt = dtype_opt(argc, argv, "--dtype", ATTN_DTYPE_F32);
    const attn_dtype kdt = dtype_opt(argc, argv, "--kv-dtype", dt);
    if (dt == 0 || kdt == 0) {
        fprintf(stderr, "attn_bench sdpa: --dtype and --kv-dtype take float32, float16 or "
                        "bfloat16\n");
        return 2;
    }
    int64_t qs[4] = {B, H, L, E}, ks[4] = {B, Hk, S, E};
    float *q = filled(B * H * L * E, 1), *k = filled(B * Hk * S * E, 2),
          *v = filled(B * Hk * S * E, 3), *o = filled(B * H * L * E, 4);
    double *ms = malloc(sizeof(double) * (size_t)reps);
    if (!q || !k || !v || !o || !ms) return 1;
    narrow_to(q, B * H * L * E, dt);
    narrow_to(k, B * Hk * S * E, kdt);
    narrow_to(v, B * Hk * S * E, kdt);
    attn_tensor tq, tk, tv, to;
    attn_tensor_init(&tq, q, dt, 4, qs);
    attn_tensor_init(&tk, k, kdt, 4, ks);
    attn_tensor_init(&tv, v, kdt, 4, ks);
    attn_tensor_init(&to, o, dt, 4, qs);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.causal = causal ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    p.enable_gqa = Hk != H;
    const char *softcap = bench_opt_str(argc, argv, "--softcap");
    p.softcap = softcap != NULL ? strtod(softcap, NULL) : 0;
    if (attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL) != ATTN_OK) { /* warm-up */
        fprintf(stderr, "attn_bench sdpa: %s\n", attn_last_error());
        return 1;
    }
    for (int r = 0; r < reps; r++) {
        const double t0 = bench_now();
        attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL);
        ms[r] = (bench_now() - t0) * 1e3;
    }
    const double flops = 4.0 * (double)(B * H * L) * (double)S * (double)E * (causal ? 0.5 : 1);
    const double med = bench_median(ms, reps);
    double best = ms[0], checksum = 0;
    for (int r = 1; r < reps; r++) best = ms[r] < best ? ms[r] : best;
    for (int64_t i = 0; i < B * H * L * E && dt == ATTN_DTYPE_F32; i += 101) checksum += o[i];
    printf("{\"shape\": [%lld, %lld, %lld, %lld, %lld], \"kv_heads\": %lld, \"causal\": %s, "
           "\"softcap\": %g, \"dtype\": \"%s\", \"kv_dtype\": \"%s\", \"isa\": \"%s\", "
           "\"threads\": %d, \"median_ms\": %.3f, \"best_ms\": %.3f, \"gflops\": %.2f, "
           "\"checksum\": %.6f}\n",
           (long long)B, (long long)H, (long long)L, (long long)S, (long long)E, (long long)Hk,
           causal ? "true" : "false", p.softcap, attn_dtype_name(dt), attn_dtype_name(kdt),
           attn_isa_name(attn_get_isa()), attn_get_num_threads(), med, best, flops / med / 1e6,
           checksum);
    free(q);
    free(k);
    free(v);
    free(o);
    free(ms);
    return 0;
}


int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr,
                "usage: attn_bench peak|bandwidth|memory|memory-backward|sdpa|backward|"
                "decode|window|varlen|kv-read ...\n");
        return 2;
    }
    const long threads = bench_opt_long(argc, argv, "--threads", 0);
    if (threads > 0) attn_set_num_threads((int)threads);
    if (bench_has_flag(argc, argv, "--cpu-time")) {
        if (attn_get_num_threads() != 1) {
            fprintf(stderr, "attn_bench: --cpu-time needs --threads 1\n");
            return 2;
        }
        bench_use_cpu_time();
    }
    if (strcmp(argv[1], "peak") == 0) return cmd_peak(argc - 2, argv + 2);
    if (strcmp(argv[1], "bandwidth") == 0) return cmd_bandwidth(argc - 2, argv + 2);
    if (strcmp(argv[1], "memory") == 0) return cmd_memory(argc - 2, argv + 2);
    if (strcmp(argv[1], "sdpa") == 0) return cmd_sdpa(argc - 2, argv + 2);
    if (strcmp(argv[1], "backward") == 0) return cmd_backward(argc - 2, argv + 2);
    if (strcmp(argv[1], "memory-backward") == 0) return cmd_memory_backward(argc - 2, argv + 2);
    if (strcmp(argv[1], "decode") == 0 || strcmp(argv[1], "window") == 0 ||
        strcmp(argv[1], "varlen") == 0 || strcmp(argv[1], "kv-read") == 0)
        return bench_serving(argv[1], argc - 2, argv + 2);
    fprintf(stderr, "attn_bench: unknown command '%s'\n", argv[1]);
    return 2;
}
