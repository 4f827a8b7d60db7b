/*
 * serving_bench.c — attn_bench's serving cases (issue 14's benchmark), each
 * beside the references it is compared with:
 *
 *   attn_bench decode --lens N,N,... [--heads 32] [--kv-heads 8] [--dim 128]
 *                     [--block-sizes 16,256] [--thp]
 *       One decoding step of B = len(--lens) sequences against a KV cache
 *       (sequence b holds lens[b] cached rows): attn_sdpa_kvcache appends
 *       each sequence's new k/v row at row lens[b] and attends its one query
 *       per head to the lens[b] + 1 rows, causal=bottom-right as
 *       flash_attn_with_kvcache. Variants: "paged<bs>" (a paged cache of
 *       block size bs whose blocks are scattered, as a serving engine's
 *       pool is after a while: the block ids are a seeded permutation),
 *       "contiguous" (the (B, S_max, Hkv, E) cache), "contiguous_bf16" (the
 *       same cache in bfloat16, half the bytes: a low-precision KV cache
 *       under float32 queries, issue 13), and for reference
 *       "sdpa": attn_sdpa per sequence on head-major (1, Hkv, lens[b] + 1, E)
 *       copies that already hold the new row (the kernel without the
 *       cache's layout and the append), and "sdpa_tm": the same calls on
 *       views of the contiguous cache's own rows (its layout, no append).
 *       --thp puts the K/V buffers on transparent huge pages (madvise), to
 *       tell TLB misses from the rest.
 *   attn_bench window --len L --window W [--heads 4] [--dim 64]
 *       "window": L = S, window_size = (W, 0) (query i sees keys i - W .. i);
 *       "blocks": L / W independent (W x 2W) attentions, one attn_sdpa call
 *       with batch L / W (the work a window costs when whole W-row query
 *       blocks visit the 2W keys around them); "causal": full causal
 *       attention of the window's shape.
 *   attn_bench varlen --lens N,N,... [--heads 8] [--dim 64] [--causal]
 *       "varlen": attn_sdpa_varlen on the packed (total, H, E) sequences;
 *       "padded": attn_sdpa on the (B, H, max_len, E) padded batch with a
 *       bool key-padding mask (B, 1, 1, max_len) (and top-left causal with
 *       --causal, which on the padded rows is each sequence's own);
 *       "loop": attn_sdpa once per sequence on its rows of the padded batch;
 *       "loop_packed": the same on views of the packed rows.
 *   attn_bench kv-read [--rows N] [--heads 8] [--dim 128] [--block 16] [--pad 0]
 *       No attention: the read bandwidth of the decode's K/V rows walked
 *       three ways (cmd_kv_read), to tell the layout's cost from the
 *       kernel's; --pad P puts P unused floats after each row.
 *
 * Inputs are bench_hashed() values (bench.h), which bench/run.py draws
 * again in NumPy for PyTorch: element i of a sequence's canonical
 * (rows, heads, E) array of q, k or v is bench_hashed(seed, i), with seeds
 * listed at each case.
 *
 * Driving: after setup and one warm-up call of every variant the program
 * prints {"ready": ...} (shapes, bytes, FLOPs) and then reads commands from
 * stdin, one per line, answering each with one JSON line:
 *   run         one timed call of every variant, the first one rotating
 *               round by round: {"ms": {"variant": ms, ...}}
 *   save DIR    writes every variant's output to DIR/<variant>.npy
 *   quit        (or end of input) exits
 * so bench/run.py can alternate these calls with PyTorch's, call by call,
 * while the caches stay resident here. With --reps N it instead runs N
 * rounds by itself and prints one JSON object with every call's time and
 * the medians (for perf, or a look without Python); --only NAME keeps one
 * variant.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "bench.h"
#include "peak.h"

#define MAX_VARIANTS 8
#define MAX_SEQS     1024

typedef struct serving_case serving_case;
typedef struct variant variant;

struct variant {
    char name[32];
    attn_status (*run)(serving_case *c, variant *v);
    int which;       /* passed to run: a block-size index, say */
    attn_tensor out; /* the output, which `save` writes */
};

struct serving_case {
    variant v[MAX_VARIANTS];
    int nv;
    /* decode */
    int64_t B, Hq, Hkv, E, lens[MAX_SEQS];
    int64_t block_sizes[MAX_VARIANTS], nbs;
    float *q, *knew, *vnew, *out_paged[MAX_VARIANTS], *out_contig, *out_sdpa;
    float *kc_paged[MAX_VARIANTS], *vc_paged[MAX_VARIANTS], *kc, *vc, *out_bf16;
    uint16_t *kc16, *vc16; /* the contiguous cache in bfloat16 */
    float *k_hm[MAX_SEQS], *v_hm[MAX_SEQS];
    int32_t *seqlens, *tables[MAX_VARIANTS];
    attn_tensor tq, tknew, tvnew, tseqlens, ttable[MAX_VARIANTS];
    attn_tensor tkc_paged[MAX_VARIANTS], tvc_paged[MAX_VARIANTS], tkc, tvc, tkc16, tvc16;
    float *out_sdpa_tm;
    /* per-sequence views for attn_sdpa: [0] head-major copies, [1] the
     * contiguous cache's own (token-major) rows */
    attn_tensor tq_seq[2][MAX_SEQS], tk_seq[2][MAX_SEQS], tv_seq[2][MAX_SEQS], to_seq[2][MAX_SEQS];
    attn_sdpa_params p;
    /* window */
    int64_t L, W, H;
    float *wq, *wk, *wv, *wout, *cout, *bq, *bk, *bv, *bout;
    attn_tensor twq, twk, twv, twout, tcout, tbq, tbk, tbv, tbout;
    attn_sdpa_params pw, pc, pb;
    /* varlen */
    int causal;
    int64_t total, Lmax;
    float *pq, *pk, *pv, *pout, *dq, *dk, *dv, *dout, *lout, *lpout;
    unsigned char *mask;
    int32_t *cu;
    attn_tensor tpq, tpk, tpv, tpout, tcu, tdq, tdk, tdv, tdout, tmask, tlout, tlpout;
    attn_sdpa_params pv_params, pd_params;
};

static int fail(const char *what) {
    fprintf(stderr, "attn_bench: %s: %s\n", what, attn_last_error());
    return 1;
}

/* "a,b,c" into x (at most max values); the count, or -1. */
static int parse_list(const char *s, int64_t *x, int max) {
    int n = 0;
    while (s != NULL && *s != '\0') {
        char *end;
        const long long val = strtoll(s, &end, 10);
        if (end == s || val < 0 || n == max) return -1;
        x[n++] = val;
        s = *end == ',' ? end + 1 : end;
        if (*end != ',' && *end != '\0') return -1;
    }
    return n;
}

/* Every buffer a case allocates, freed together when it ends. */
static void *owned[4 * MAX_SEQS + 64];
static int nowned;

static void *own(void *p, size_t bytes) {
    if (p == NULL || nowned == (int)(sizeof owned / sizeof owned[0])) {
        fprintf(stderr, "attn_bench: out of memory (%zu bytes)\n", bytes);
        free(p);
        return NULL;
    }
    return owned[nowned++] = p;
}

static void free_owned(void) {
    while (nowned > 0)
        free(owned[--nowned]);
}

static void *alloc(size_t bytes) {
    return own(malloc(bytes == 0 ? 1 : bytes), bytes);
}

static void *alloc_zero(size_t n, size_t size) {
    return own(calloc(n == 0 ? 1 : n, size), n * size);
}

/* A K/V buffer: malloc's, or with --thp 2 MiB-aligned and advised to use
 * transparent huge pages (what an engine may do with its cache pool; THP
 * is often "madvise" only), to tell page walks from the rest. */
static int use_thp;

static void *alloc_kv(size_t bytes) {
    return use_thp ? own(bench_alloc_huge(bytes == 0 ? 1 : bytes), bytes) : alloc(bytes);
}

static int64_t cdiv(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

static void add_variant(serving_case *c, const char *name,
                        attn_status (*run)(serving_case *, variant *), int which,
                        const attn_tensor *out) {
    variant *v = &c->v[c->nv++];
    snprintf(v->name, sizeof v->name, "%s", name);
    v->run = run;
    v->which = which;
    v->out = *out;
}

/* ---- decode ---- */
/* Seeds: q (B, 1, Hq, E) is one stream, 5000; sequence b's keys are stream
 * 1000 + b and its values 3000 + b, over (lens[b] + 1, Hkv, E): rows 0 ..
 * lens[b] - 1 are the cache, row lens[b] the new one. */

/* Row t of sequence b (Hkv x E floats) of stream seed into dst. */
static void hashed_row(float *dst, uint64_t seed, int64_t t, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = bench_hashed(seed, (uint64_t)(t * n + i));
}

static attn_status run_paged(serving_case *c, variant *v) {
    return attn_sdpa_kvcache(&c->tq, &c->tkc_paged[v->which], &c->tvc_paged[v->which], &c->tknew,
                             &c->tvnew, &c->tseqlens, &c->ttable[v->which], &c->p, &v->out, NULL);
}

static attn_status run_contiguous(serving_case *c, variant *v) {
    return attn_sdpa_kvcache(&c->tq, &c->tkc, &c->tvc, &c->tknew, &c->tvnew, &c->tseqlens, NULL,
                             &c->p, &v->out, NULL);
}

static attn_status run_contiguous_bf16(serving_case *c, variant *v) {
    return attn_sdpa_kvcache(&c->tq, &c->tkc16, &c->tvc16, &c->tknew, &c->tvnew, &c->tseqlens,
                             NULL, &c->p, &v->out, NULL);
}

/* float32 values to bfloat16 bits, rounded to nearest even (finite values). */
static void to_bf16(const float *x, uint16_t *h, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) h[i] = bench_bf16(x[i]);
}

static attn_status run_sdpa_per_seq(serving_case *c, variant *v) {
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.enable_gqa = 1;
    const int w = v->which;
    for (int64_t b = 0; b < c->B; b++) {
        attn_status st = attn_sdpa(&c->tq_seq[w][b], &c->tk_seq[w][b], &c->tv_seq[w][b], &p,
                                   &c->to_seq[w][b], NULL, NULL);
        if (st != ATTN_OK) return st;
    }
    return ATTN_OK;
}

/* Paged variant i: the cache in blocks of block_sizes[i] rows, laid out in
 * a seeded random order, and its block table. Returns 0, or 1 when out of
 * memory. */
static int setup_paged(serving_case *c, int i, int64_t smax) {
    const int64_t B = c->B, Hq = c->Hq, Hkv = c->Hkv, E = c->E, row = Hkv * E;
    const int64_t bs = c->block_sizes[i];
    int64_t nblocks = 0, maxb = cdiv(smax, bs);
    for (int64_t b = 0; b < B; b++)
        nblocks += cdiv(c->lens[b] + 1, bs);
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)(nblocks > 0 ? nblocks : 1));
    c->tables[i] = alloc(sizeof(int32_t) * (size_t)(B * maxb));
    c->kc_paged[i] = alloc_kv(sizeof(float) * (size_t)(nblocks * bs * row));
    c->vc_paged[i] = alloc_kv(sizeof(float) * (size_t)(nblocks * bs * row));
    c->out_paged[i] = alloc(sizeof(float) * (size_t)(B * Hq * E));
    if (!perm || !c->tables[i] || !c->kc_paged[i] || !c->vc_paged[i] || !c->out_paged[i]) {
        free(perm);
        return 1;
    }
    uint32_t s = 12345u + (uint32_t)bs;
    for (int64_t j = 0; j < nblocks; j++)
        perm[j] = (int32_t)j;
    for (int64_t j = nblocks - 1; j > 0; j--) { /* Fisher-Yates */
        s = s * 1664525u + 1013904223u;
        const int64_t r = (int64_t)(((uint64_t)s * (uint64_t)(j + 1)) >> 32);
        const int32_t t = perm[j];
        perm[j] = perm[r], perm[r] = t;
    }
    int64_t next = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < maxb; j++)
            c->tables[i][b * maxb + j] = j < cdiv(c->lens[b] + 1, bs) ? perm[next++] : -1;
    free(perm);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < c->lens[b]; t++) {
            const int64_t off = ((int64_t)c->tables[i][b * maxb + t / bs] * bs + t % bs) * row;
            hashed_row(c->kc_paged[i] + off, 1000 + (uint64_t)b, t, row);
            hashed_row(c->vc_paged[i] + off, 3000 + (uint64_t)b, t, row);
        }
    int64_t cs[4] = {nblocks, bs, Hkv, E}, ts[2] = {B, maxb}, os[4] = {B, 1, Hq, E};
    attn_tensor_init(&c->tkc_paged[i], c->kc_paged[i], ATTN_DTYPE_F32, 4, cs);
    attn_tensor_init(&c->tvc_paged[i], c->vc_paged[i], ATTN_DTYPE_F32, 4, cs);
    attn_tensor_init(&c->ttable[i], c->tables[i], ATTN_DTYPE_I32, 2, ts);
    attn_tensor out;
    attn_tensor_init(&out, c->out_paged[i], ATTN_DTYPE_F32, 4, os);
    char name[32];
    snprintf(name, sizeof name, "paged%lld", (long long)bs);
    add_variant(c, name, run_paged, i, &out);
    return 0;
}

/* attn_sdpa per sequence: on head-major (1, Hkv, S, E) copies holding the
 * new row ("sdpa"), and on the contiguous cache's rows seen as that shape
 * ("sdpa_tm"). Returns 0, or 1 when out of memory. */
static int setup_per_seq(serving_case *c, int64_t smax) {
    const int64_t B = c->B, Hq = c->Hq, Hkv = c->Hkv, E = c->E, row = Hkv * E;
    int64_t os[4] = {B, 1, Hq, E};
    attn_tensor out;
    c->out_sdpa = alloc(sizeof(float) * (size_t)(B * Hq * E));
    c->out_sdpa_tm = alloc(sizeof(float) * (size_t)(B * Hq * E));
    if (!c->out_sdpa || !c->out_sdpa_tm) return 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t S = c->lens[b] + 1;
        c->k_hm[b] = alloc_kv(sizeof(float) * (size_t)(S * row));
        c->v_hm[b] = alloc_kv(sizeof(float) * (size_t)(S * row));
        if (!c->k_hm[b] || !c->v_hm[b]) return 1;
        int64_t sq[4] = {1, Hq, 1, E}, sk[4] = {1, Hkv, S, E};
        attn_tensor_init(&c->tq_seq[0][b], c->q + b * Hq * E, ATTN_DTYPE_F32, 4, sq);
        attn_tensor_init(&c->to_seq[0][b], c->out_sdpa + b * Hq * E, ATTN_DTYPE_F32, 4, sq);
        attn_tensor_init(&c->tk_seq[0][b], c->k_hm[b], ATTN_DTYPE_F32, 4, sk);
        attn_tensor_init(&c->tv_seq[0][b], c->v_hm[b], ATTN_DTYPE_F32, 4, sk);
        /* the contiguous cache's rows 0 .. lens[b] as (1, Hkv, S, E) */
        c->tq_seq[1][b] = c->tq_seq[0][b];
        attn_tensor_init(&c->to_seq[1][b], c->out_sdpa_tm + b * Hq * E, ATTN_DTYPE_F32, 4, sq);
        attn_tensor_init(&c->tk_seq[1][b], c->kc + b * smax * row, ATTN_DTYPE_F32, 4, sk);
        attn_tensor_init(&c->tv_seq[1][b], c->vc + b * smax * row, ATTN_DTYPE_F32, 4, sk);
        attn_tensor *tm[2] = {&c->tk_seq[1][b], &c->tv_seq[1][b]};
        for (int i = 0; i < 2; i++)
            tm[i]->strides[0] = smax * row, tm[i]->strides[1] = E, tm[i]->strides[2] = row;
    }
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t S = c->lens[b] + 1;
            for (int64_t t = 0; t < S; t++)
                for (int64_t e = 0; e < E; e++) {
                    const uint64_t i = (uint64_t)(t * row + h * E + e);
                    c->k_hm[b][(h * S + t) * E + e] = bench_hashed(1000 + (uint64_t)b, i);
                    c->v_hm[b][(h * S + t) * E + e] = bench_hashed(3000 + (uint64_t)b, i);
                }
        }
    attn_tensor_init(&out, c->out_sdpa, ATTN_DTYPE_F32, 4, os);
    add_variant(c, "sdpa", run_sdpa_per_seq, 0, &out);
    attn_tensor_init(&out, c->out_sdpa_tm, ATTN_DTYPE_F32, 4, os);
    add_variant(c, "sdpa_tm", run_sdpa_per_seq, 1, &out);
    return 0;
}

static int setup_decode(serving_case *c, int argc, char **argv) {
    c->Hq = bench_opt_long(argc, argv, "--heads", 32);
    c->Hkv = bench_opt_long(argc, argv, "--kv-heads", 8);
    c->E = bench_opt_long(argc, argv, "--dim", 128);
    use_thp = bench_has_flag(argc, argv, "--thp");
    const int nb = parse_list(bench_opt_str(argc, argv, "--lens"), c->lens, MAX_SEQS);
    const int nbs = parse_list(bench_opt_str(argc, argv, "--block-sizes")
                                   ? bench_opt_str(argc, argv, "--block-sizes")
                                   : "16,256",
                               c->block_sizes, MAX_VARIANTS - 2);
    if (nb < 1 || nbs < 0 || c->Hq < 1 || c->Hkv < 1 || c->E < 1 || c->Hq % c->Hkv) {
        fprintf(stderr, "usage: attn_bench decode --lens N,N,... [--heads 32] [--kv-heads 8] "
                        "[--dim 128] [--block-sizes 16,256] [--thp]\n");
        return 2;
    }
    c->B = nb, c->nbs = nbs;
    const int64_t B = c->B, Hq = c->Hq, Hkv = c->Hkv, E = c->E, row = Hkv * E;
    int64_t smax = 0;
    for (int64_t b = 0; b < B; b++)
        smax = c->lens[b] + 1 > smax ? c->lens[b] + 1 : smax;

    /* q, the new rows, cache_seqlens */
    c->q = alloc(sizeof(float) * (size_t)(B * Hq * E));
    c->knew = alloc(sizeof(float) * (size_t)(B * row));
    c->vnew = alloc(sizeof(float) * (size_t)(B * row));
    c->seqlens = alloc(sizeof(int32_t) * (size_t)B);
    if (!c->q || !c->knew || !c->vnew || !c->seqlens) return 1;
    for (int64_t i = 0; i < B * Hq * E; i++)
        c->q[i] = bench_hashed(5000, (uint64_t)i);
    for (int64_t b = 0; b < B; b++) {
        hashed_row(c->knew + b * row, 1000 + (uint64_t)b, c->lens[b], row);
        hashed_row(c->vnew + b * row, 3000 + (uint64_t)b, c->lens[b], row);
        c->seqlens[b] = (int32_t)c->lens[b];
    }
    int64_t qs[4] = {B, 1, Hq, E}, ns[4] = {B, 1, Hkv, E}, ls[1] = {B};
    attn_tensor_init(&c->tq, c->q, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&c->tknew, c->knew, ATTN_DTYPE_F32, 4, ns);
    attn_tensor_init(&c->tvnew, c->vnew, ATTN_DTYPE_F32, 4, ns);
    attn_tensor_init(&c->tseqlens, c->seqlens, ATTN_DTYPE_I32, 1, ls);
    attn_sdpa_params_init(&c->p);
    c->p.causal = ATTN_CAUSAL_BOTTOM_RIGHT; /* flash_attn_with_kvcache's causal=True */

    for (int i = 0; i < nbs; i++)
        if (setup_paged(c, i, smax)) return 1;

    /* the contiguous cache (B, S_max, Hkv, E) */
    c->kc = alloc_kv(sizeof(float) * (size_t)(B * smax * row));
    c->vc = alloc_kv(sizeof(float) * (size_t)(B * smax * row));
    c->out_contig = alloc(sizeof(float) * (size_t)(B * Hq * E));
    if (!c->kc || !c->vc || !c->out_contig) return 1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) /* the new row too, for sdpa_tm's first call */
        for (int64_t t = 0; t <= c->lens[b]; t++) {
            hashed_row(c->kc + (b * smax + t) * row, 1000 + (uint64_t)b, t, row);
            hashed_row(c->vc + (b * smax + t) * row, 3000 + (uint64_t)b, t, row);
        }
    int64_t cs[4] = {B, smax, Hkv, E}, os[4] = {B, 1, Hq, E};
    attn_tensor_init(&c->tkc, c->kc, ATTN_DTYPE_F32, 4, cs);
    attn_tensor_init(&c->tvc, c->vc, ATTN_DTYPE_F32, 4, cs);
    attn_tensor out;
    attn_tensor_init(&out, c->out_contig, ATTN_DTYPE_F32, 4, os);
    add_variant(c, "contiguous", run_contiguous, c->nv, &out);

    /* the same cache in bfloat16 */
    c->kc16 = alloc_kv(sizeof(uint16_t) * (size_t)(B * smax * row));
    c->vc16 = alloc_kv(sizeof(uint16_t) * (size_t)(B * smax * row));
    c->out_bf16 = alloc(sizeof(float) * (size_t)(B * Hq * E));
    if (!c->kc16 || !c->vc16 || !c->out_bf16) return 1;
    to_bf16(c->kc, c->kc16, B * smax * row);
    to_bf16(c->vc, c->vc16, B * smax * row);
    attn_tensor_init(&c->tkc16, c->kc16, ATTN_DTYPE_BF16, 4, cs);
    attn_tensor_init(&c->tvc16, c->vc16, ATTN_DTYPE_BF16, 4, cs);
    attn_tensor_init(&out, c->out_bf16, ATTN_DTYPE_F32, 4, os);
    add_variant(c, "contiguous_bf16", run_contiguous_bf16, c->nv, &out);

    return setup_per_seq(c, smax);
}

static void print_decode_info(const serving_case *c) {
    int64_t rows = 0;
    for (int64_t b = 0; b < c->B; b++)
        rows += c->lens[b] + 1;
    printf("\"B\": %lld, \"heads\": %lld, \"kv_heads\": %lld, \"dim\": %lld, \"lens\": [",
           (long long)c->B, (long long)c->Hq, (long long)c->Hkv, (long long)c->E);
    for (int64_t b = 0; b < c->B; b++)
        printf("%s%lld", b ? ", " : "", (long long)c->lens[b]);
    /* every K and V row attended to (the cached ones and the new one), read once */
    printf("], \"kv_bytes\": %.0f", 2.0 * (double)rows * (double)(c->Hkv * c->E) * 4);
}

/* ---- window ---- */
/* Seeds: q, k, v of the (1, H, L, E) window and causal cases are streams
 * 7001, 7002, 7003 over (1, H, L, E); the blocks' (L/W, H, W, E) q and
 * (L/W, H, 2W, E) k, v are 7011, 7012, 7013. */

static attn_status run_window(serving_case *c, variant *v) {
    (void)v;
    return attn_sdpa(&c->twq, &c->twk, &c->twv, &c->pw, &c->twout, NULL, NULL);
}
static attn_status run_causal(serving_case *c, variant *v) {
    (void)v;
    return attn_sdpa(&c->twq, &c->twk, &c->twv, &c->pc, &c->tcout, NULL, NULL);
}
static attn_status run_blocks(serving_case *c, variant *v) {
    (void)v;
    return attn_sdpa(&c->tbq, &c->tbk, &c->tbv, &c->pb, &c->tbout, NULL, NULL);
}

static float *hashed_buffer(uint64_t seed, int64_t n) {
    float *x = alloc(sizeof(float) * (size_t)n);
    if (x == NULL) return NULL;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++)
        x[i] = bench_hashed(seed, (uint64_t)i);
    return x;
}

static int setup_window(serving_case *c, int argc, char **argv) {
    c->L = bench_opt_long(argc, argv, "--len", 32768);
    c->W = bench_opt_long(argc, argv, "--window", 4096);
    c->H = bench_opt_long(argc, argv, "--heads", 4);
    c->E = bench_opt_long(argc, argv, "--dim", 64);
    if (c->L < 1 || c->W < 1 || c->L % c->W || c->H < 1 || c->E < 1) {
        fprintf(stderr, "usage: attn_bench window --len L --window W (W divides L) [--heads 4] "
                        "[--dim 64]\n");
        return 2;
    }
    const int64_t L = c->L, W = c->W, H = c->H, E = c->E, n = L / W;
    c->wq = hashed_buffer(7001, H * L * E), c->wk = hashed_buffer(7002, H * L * E);
    c->wv = hashed_buffer(7003, H * L * E), c->wout = hashed_buffer(0, H * L * E);
    c->cout = hashed_buffer(0, H * L * E);
    c->bq = hashed_buffer(7011, n * H * W * E), c->bk = hashed_buffer(7012, n * H * 2 * W * E);
    c->bv = hashed_buffer(7013, n * H * 2 * W * E), c->bout = hashed_buffer(0, n * H * W * E);
    if (!c->wq || !c->wk || !c->wv || !c->wout || !c->cout || !c->bq || !c->bk || !c->bv ||
        !c->bout)
        return 1;
    int64_t ws[4] = {1, H, L, E}, bqs[4] = {n, H, W, E}, bks[4] = {n, H, 2 * W, E};
    attn_tensor_init(&c->twq, c->wq, ATTN_DTYPE_F32, 4, ws);
    attn_tensor_init(&c->twk, c->wk, ATTN_DTYPE_F32, 4, ws);
    attn_tensor_init(&c->twv, c->wv, ATTN_DTYPE_F32, 4, ws);
    attn_tensor_init(&c->twout, c->wout, ATTN_DTYPE_F32, 4, ws);
    attn_tensor_init(&c->tcout, c->cout, ATTN_DTYPE_F32, 4, ws);
    attn_tensor_init(&c->tbq, c->bq, ATTN_DTYPE_F32, 4, bqs);
    attn_tensor_init(&c->tbk, c->bk, ATTN_DTYPE_F32, 4, bks);
    attn_tensor_init(&c->tbv, c->bv, ATTN_DTYPE_F32, 4, bks);
    attn_tensor_init(&c->tbout, c->bout, ATTN_DTYPE_F32, 4, bqs);
    attn_sdpa_params_init(&c->pw);
    c->pw.window_left = W, c->pw.window_right = 0; /* FlashAttention's window_size = (W, 0) */
    attn_sdpa_params_init(&c->pc);
    c->pc.causal = ATTN_CAUSAL_TOP_LEFT;
    attn_sdpa_params_init(&c->pb);
    add_variant(c, "window", run_window, 0, &c->twout);
    add_variant(c, "blocks", run_blocks, 0, &c->tbout);
    add_variant(c, "causal", run_causal, 0, &c->tcout);
    return 0;
}

static void print_window_info(const serving_case *c) {
    const double L = (double)c->L, W = (double)c->W, HE4 = 4.0 * (double)(c->H * c->E);
    /* rows i < W see i + 1 keys, the others W + 1 */
    const double win_pairs = W * (W + 1) / 2 + (L - W) * (W + 1);
    /* rows 0 .. W of the window case see exactly what causal rows see */
    double diff = 0;
    for (int64_t h = 0; h < c->H; h++)
        for (int64_t i = 0; i < c->W * c->E; i++) {
            const double d =
                fabs((double)c->wout[h * c->L * c->E + i] - (double)c->cout[h * c->L * c->E + i]);
            diff = d > diff ? d : diff;
        }
    printf("\"len\": %lld, \"window\": %lld, \"heads\": %lld, \"dim\": %lld, "
           "\"flops\": {\"window\": %.0f, \"blocks\": %.0f, \"causal\": %.0f}, "
           "\"window_vs_causal_first_rows_max_diff\": %.3g",
           (long long)c->L, (long long)c->W, (long long)c->H, (long long)c->E, HE4 * win_pairs,
           HE4 * (L / W) * W * 2 * W, HE4 * L * (L + 1) / 2, diff);
}

/* ---- varlen ---- */
/* Seeds: sequence n's q, k, v are streams 100 + n, 200 + n, 300 + n over its
 * canonical (len, H, E) rows, as packed; the padded batch holds the same
 * values head-major, zeros past each length. */

static attn_status run_varlen(serving_case *c, variant *v) {
    return attn_sdpa_varlen(&c->tpq, &c->tpk, &c->tpv, &c->tcu, &c->tcu, c->Lmax, c->Lmax,
                            &c->pv_params, &v->out, NULL);
}

static attn_status run_padded(serving_case *c, variant *v) {
    return attn_sdpa(&c->tdq, &c->tdk, &c->tdv, &c->pd_params, &v->out, NULL, NULL);
}

static attn_status run_loop(serving_case *c, variant *v) {
    (void)v;
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.causal = c->causal ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    const int64_t H = c->H, E = c->E, Lm = c->Lmax;
    for (int64_t b = 0; b < c->B; b++) {
        /* sequence b's rows of the padded batch: (1, H, len, E), strided */
        int64_t sh[4] = {1, H, c->lens[b], E};
        attn_tensor tq, tk, tv, to;
        attn_tensor_init(&tq, c->dq + b * H * Lm * E, ATTN_DTYPE_F32, 4, sh);
        attn_tensor_init(&tk, c->dk + b * H * Lm * E, ATTN_DTYPE_F32, 4, sh);
        attn_tensor_init(&tv, c->dv + b * H * Lm * E, ATTN_DTYPE_F32, 4, sh);
        attn_tensor_init(&to, c->lout + b * H * Lm * E, ATTN_DTYPE_F32, 4, sh);
        attn_tensor *ts[4] = {&tq, &tk, &tv, &to};
        for (int i = 0; i < 4; i++)
            ts[i]->strides[0] = H * Lm * E, ts[i]->strides[1] = Lm * E;
        attn_status st = attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL);
        if (st != ATTN_OK) return st;
    }
    return ATTN_OK;
}

static attn_status run_loop_packed(serving_case *c, variant *v) {
    (void)v;
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.causal = c->causal ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    const int64_t H = c->H, E = c->E;
    for (int64_t b = 0; b < c->B; b++) {
        /* sequence b's rows of the packed operands as (1, H, len, E) */
        int64_t sh[4] = {1, H, c->lens[b], E};
        attn_tensor tq, tk, tv, to;
        const int64_t off = (int64_t)c->cu[b] * H * E;
        attn_tensor_init(&tq, c->pq + off, ATTN_DTYPE_F32, 4, sh);
        attn_tensor_init(&tk, c->pk + off, ATTN_DTYPE_F32, 4, sh);
        attn_tensor_init(&tv, c->pv + off, ATTN_DTYPE_F32, 4, sh);
        attn_tensor_init(&to, c->lpout + off, ATTN_DTYPE_F32, 4, sh);
        attn_tensor *ts[4] = {&tq, &tk, &tv, &to};
        for (int i = 0; i < 4; i++)
            ts[i]->strides[1] = E, ts[i]->strides[2] = H * E;
        attn_status st = attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL);
        if (st != ATTN_OK) return st;
    }
    return ATTN_OK;
}

static int setup_varlen(serving_case *c, int argc, char **argv) {
    c->H = bench_opt_long(argc, argv, "--heads", 8);
    c->E = bench_opt_long(argc, argv, "--dim", 64);
    c->causal = bench_has_flag(argc, argv, "--causal");
    const int nb = parse_list(bench_opt_str(argc, argv, "--lens"), c->lens, MAX_SEQS);
    if (nb < 1 || c->H < 1 || c->E < 1) {
        fprintf(stderr, "usage: attn_bench varlen --lens N,N,... [--heads 8] [--dim 64] "
                        "[--causal]\n");
        return 2;
    }
    c->B = nb;
    const int64_t B = c->B, H = c->H, E = c->E;
    c->cu = alloc(sizeof(int32_t) * (size_t)(B + 1));
    if (!c->cu) return 1;
    c->total = 0, c->Lmax = 1;
    c->cu[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        c->total += c->lens[b];
        c->cu[b + 1] = (int32_t)c->total;
        c->Lmax = c->lens[b] > c->Lmax ? c->lens[b] : c->Lmax;
    }
    const int64_t T = c->total, Lm = c->Lmax;
    c->pq = alloc(sizeof(float) * (size_t)(T * H * E));
    c->pk = alloc(sizeof(float) * (size_t)(T * H * E));
    c->pv = alloc(sizeof(float) * (size_t)(T * H * E));
    c->pout = alloc(sizeof(float) * (size_t)(T * H * E));
    c->lpout = alloc_zero((size_t)(T * H * E), sizeof(float));
    c->dq = alloc_zero((size_t)(B * H * Lm * E), sizeof(float));
    c->dk = alloc_zero((size_t)(B * H * Lm * E), sizeof(float));
    c->dv = alloc_zero((size_t)(B * H * Lm * E), sizeof(float));
    c->dout = alloc_zero((size_t)(B * H * Lm * E), sizeof(float));
    c->lout = alloc_zero((size_t)(B * H * Lm * E), sizeof(float));
    c->mask = alloc_zero((size_t)(B * Lm), 1);
    if (!c->pq || !c->pk || !c->pv || !c->pout || !c->lpout || !c->dq || !c->dk || !c->dv ||
        !c->dout || !c->lout || !c->mask)
        return 1;
    memset(c->pout, 0, sizeof(float) * (size_t)(T * H * E));
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = c->lens[b];
        for (int64_t t = 0; t < n; t++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t e = 0; e < E; e++) {
                    const uint64_t i = (uint64_t)((t * H + h) * E + e);
                    const int64_t packed = ((c->cu[b] + t) * H + h) * E + e;
                    const int64_t padded = ((b * H + h) * Lm + t) * E + e;
                    c->pq[packed] = c->dq[padded] = bench_hashed(100 + (uint64_t)b, i);
                    c->pk[packed] = c->dk[padded] = bench_hashed(200 + (uint64_t)b, i);
                    c->pv[packed] = c->dv[padded] = bench_hashed(300 + (uint64_t)b, i);
                }
        memset(c->mask + b * Lm, 1, (size_t)n);
    }
    int64_t ps[3] = {T, H, E}, cs[1] = {B + 1}, ds[4] = {B, H, Lm, E}, ms[4] = {B, 1, 1, Lm};
    attn_tensor_init(&c->tpq, c->pq, ATTN_DTYPE_F32, 3, ps);
    attn_tensor_init(&c->tpk, c->pk, ATTN_DTYPE_F32, 3, ps);
    attn_tensor_init(&c->tpv, c->pv, ATTN_DTYPE_F32, 3, ps);
    attn_tensor_init(&c->tpout, c->pout, ATTN_DTYPE_F32, 3, ps);
    attn_tensor_init(&c->tlpout, c->lpout, ATTN_DTYPE_F32, 3, ps);
    attn_tensor_init(&c->tcu, c->cu, ATTN_DTYPE_I32, 1, cs);
    attn_tensor_init(&c->tdq, c->dq, ATTN_DTYPE_F32, 4, ds);
    attn_tensor_init(&c->tdk, c->dk, ATTN_DTYPE_F32, 4, ds);
    attn_tensor_init(&c->tdv, c->dv, ATTN_DTYPE_F32, 4, ds);
    attn_tensor_init(&c->tdout, c->dout, ATTN_DTYPE_F32, 4, ds);
    attn_tensor_init(&c->tlout, c->lout, ATTN_DTYPE_F32, 4, ds);
    attn_tensor_init(&c->tmask, c->mask, ATTN_DTYPE_BOOL, 4, ms);
    attn_sdpa_params_init(&c->pv_params);
    c->pv_params.causal = c->causal ? ATTN_CAUSAL_BOTTOM_RIGHT : ATTN_CAUSAL_NONE;
    attn_sdpa_params_init(&c->pd_params);
    c->pd_params.attn_mask = &c->tmask;
    c->pd_params.causal = c->causal ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    add_variant(c, "varlen", run_varlen, 0, &c->tpout);
    add_variant(c, "padded", run_padded, 1, &c->tdout);
    add_variant(c, "loop", run_loop, 2, &c->tlout);
    add_variant(c, "loop_packed", run_loop_packed, 3, &c->tlpout);
    return 0;
}

static void print_varlen_info(const serving_case *c) {
    double pairs = 0;
    for (int64_t b = 0; b < c->B; b++)
        pairs += c->causal ? (double)c->lens[b] * (double)(c->lens[b] + 1) / 2
                           : (double)c->lens[b] * (double)c->lens[b];
    const double Lm = (double)c->Lmax, HE4 = 4.0 * (double)(c->H * c->E);
    const double padded = (double)c->B * (c->causal ? Lm * (Lm + 1) / 2 : Lm * Lm);
    printf("\"heads\": %lld, \"dim\": %lld, \"causal\": %s, \"total\": %lld, \"max_len\": %lld, "
           "\"lens\": [",
           (long long)c->H, (long long)c->E, c->causal ? "true" : "false", (long long)c->total,
           (long long)c->Lmax);
    for (int64_t b = 0; b < c->B; b++)
        printf("%s%lld", b ? ", " : "", (long long)c->lens[b]);
    /* the FLOPs of the sequences' own scores, and of the padded batch's */
    printf("], \"flops\": {\"varlen\": %.0f, \"padded\": %.0f, \"loop\": %.0f, "
           "\"loop_packed\": %.0f}",
           HE4 * pairs, HE4 * padded, HE4 * pairs, HE4 * pairs);
}

/* ---- driving ---- */

static int run_round(serving_case *c, int round, double *ms) {
    for (int k = 0; k < c->nv; k++) {
        const int i = (round + k) % c->nv;
        const double t0 = bench_now();
        const attn_status st = c->v[i].run(c, &c->v[i]);
        ms[i] = (bench_now() - t0) * 1e3;
        if (st != ATTN_OK) return fail(c->v[i].name);
    }
    return 0;
}

static void print_info(const char *cmd, const serving_case *c) {
    printf("\"case\": \"%s\", \"attn\": \"%s\", \"isa\": \"%s\", \"threads\": %d, "
           "\"variants\": [",
           cmd, attn_version(), attn_isa_name(attn_get_isa()), attn_get_num_threads());
    for (int i = 0; i < c->nv; i++)
        printf("%s\"%s\"", i ? ", " : "", c->v[i].name);
    printf("], ");
    if (strcmp(cmd, "decode") == 0)
        print_decode_info(c);
    else if (strcmp(cmd, "window") == 0)
        print_window_info(c);
    else
        print_varlen_info(c);
}

static int save_outputs(const serving_case *c, const char *dir) {
    char path[4096];
    for (int i = 0; i < c->nv; i++) {
        snprintf(path, sizeof path, "%s/%s.npy", dir, c->v[i].name);
        if (attn_npy_save(path, &c->v[i].out) != ATTN_OK) return fail(path);
    }
    return 0;
}

static int serve(const char *cmd, serving_case *c, int argc, char **argv) {
    const char *only = bench_opt_str(argc, argv, "--only");
    if (only != NULL) {
        int keep = 0;
        for (int i = 0; i < c->nv; i++)
            if (strcmp(c->v[i].name, only) == 0) c->v[keep++] = c->v[i];
        if (keep == 0) {
            fprintf(stderr, "attn_bench %s: no variant '%s'\n", cmd, only);
            return 2;
        }
        c->nv = keep;
    }
    double ms[MAX_VARIANTS];
    if (run_round(c, 0, ms)) return 1; /* warm-up */
    const int reps = (int)bench_opt_long(argc, argv, "--reps", 0);
    if (reps > 0) { /* by itself */
        double *all = malloc(sizeof(double) * (size_t)(reps * c->nv));
        if (all == NULL) return 1;
        for (int r = 0; r < reps; r++) {
            if (run_round(c, r, ms)) return 1;
            for (int i = 0; i < c->nv; i++)
                all[i * reps + r] = ms[i];
        }
        printf("{");
        print_info(cmd, c);
        printf(", \"ms\": {");
        for (int i = 0; i < c->nv; i++) {
            printf("%s\"%s\": [", i ? ", " : "", c->v[i].name);
            for (int r = 0; r < reps; r++)
                printf("%s%.3f", r ? ", " : "", all[i * reps + r]);
            printf("]");
        }
        printf("}, \"median_ms\": {");
        for (int i = 0; i < c->nv; i++)
            printf("%s\"%s\": %.3f", i ? ", " : "", c->v[i].name,
                   bench_median(all + i * reps, reps));
        printf("}}\n");
        free(all);
        return 0;
    }
    printf("{\"ready\": true, ");
    print_info(cmd, c);
    printf("}\n");
    fflush(stdout);
    char line[4096 - 64];
    for (int round = 1; fgets(line, sizeof line, stdin) != NULL; round++) {
        line[strcspn(line, "\r\n")] = '\0';
        if (strcmp(line, "quit") == 0) break;
        if (strcmp(line, "run") == 0) {
            if (run_round(c, round, ms)) return 1;
            printf("{\"ms\": {");
            for (int i = 0; i < c->nv; i++)
                printf("%s\"%s\": %.3f", i ? ", " : "", c->v[i].name, ms[i]);
            printf("}}\n");
        } else if (strncmp(line, "save ", 5) == 0) {
            if (save_outputs(c, line + 5)) return 1;
            printf("{\"saved\": \"%s\"}\n", line + 5);
        } else {
            fprintf(stderr, "attn_bench %s: unknown command '%s' (run, save DIR, quit)\n", cmd,
                    line);
            return 2;
        }
        fflush(stdout);
    }
    return 0;
}

/* ---- kv-read: the decode's K/V traversals without attention ---- */

/* GB/s of reading rows x (H x E) floats, best of 5, three ways: "stream"
 * (each thread a contiguous share), "per_head" (one task per head reading
 * its E floats of every row, as the kernels walk a token-major cache head
 * by head), "blocks" (blocks of `block` rows shared among the threads, each
 * block read head by head). */
static int cmd_kv_read(int argc, char **argv) {
    const int64_t rows = bench_opt_long(argc, argv, "--rows", 2 * 147456);
    const int64_t H = bench_opt_long(argc, argv, "--heads", 8);
    const int64_t E = bench_opt_long(argc, argv, "--dim", 128);
    const int64_t block = bench_opt_long(argc, argv, "--block", 16);
    const int64_t pad = bench_opt_long(argc, argv, "--pad", 0); /* floats after each row */
    if (rows < 1 || H < 1 || E < 1 || block < 1 || pad < 0) {
        fprintf(stderr, "usage: attn_bench kv-read [--rows N] [--heads 8] [--dim 128] "
                        "[--block 16] [--pad 0]\n");
        return 2;
    }
    const int64_t row = H * E + pad, n = rows * row;
    float *x = malloc(sizeof(float) * (size_t)n);
    if (x == NULL) return 1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++)
        x[i] = 1.0f;
    const char *names[3] = {"stream", "per_head", "blocks"};
    double best[3] = {0, 0, 0}, sink = 0;
    for (int round = 0; round < 5; round++)
        for (int m = 0; m < 3; m++) {
            double sum = 0;
            const double t0 = bench_now();
            if (m == 0) {
#pragma omp parallel for schedule(static) reduction(+ : sum)
                for (int64_t r = 0; r < rows; r++)
                    sum += bandwidth_read(x + r * row, row);
            } else if (m == 1) {
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : sum)
                for (int64_t h = 0; h < H; h++)
                    for (int64_t r = 0; r < rows; r++)
                        sum += bandwidth_read(x + r * row + h * E, E);
            } else {
#pragma omp parallel for schedule(static) reduction(+ : sum)
                for (int64_t b0 = 0; b0 < rows; b0 += block)
                    for (int64_t h = 0; h < H; h++)
                        for (int64_t r = b0; r < b0 + block && r < rows; r++)
                            sum += bandwidth_read(x + r * row + h * E, E);
            }
            const double g = (double)(rows * H * E) * 4 / (bench_now() - t0) / 1e9;
            best[m] = g > best[m] ? g : best[m];
            sink += sum;
        }
    printf("{\"rows\": %lld, \"heads\": %lld, \"dim\": %lld, \"block\": %lld, \"pad\": %lld, "
           "\"threads\": %d, \"gbps\": {",
           (long long)rows, (long long)H, (long long)E, (long long)block, (long long)pad,
           attn_get_num_threads());
    for (int m = 0; m < 3; m++)
        printf("%s\"%s\": %.2f", m ? ", " : "", names[m], best[m]);
    printf("}, \"check\": %.0f}\n", sink / 15);
    free(x);
    return 0;
}

int bench_serving(const char *cmd, int argc, char **argv) {
    if (strcmp(cmd, "kv-read") == 0) return cmd_kv_read(argc, argv);
    serving_case *c = alloc_zero(1, sizeof *c);
    if (c == NULL) return 1;
    int rc = strcmp(cmd, "decode") == 0   ? setup_decode(c, argc, argv)
             : strcmp(cmd, "window") == 0 ? setup_window(c, argc, argv)
                                          : setup_varlen(c, argc, argv);
    if (rc == 0) rc = serve(cmd, c, argc, argv);
    free_owned();
    return rc;
}
