/*
 * test_varlen_backward.c — attn_sdpa_varlen_backward.
 *
 *  - on the reference path (float64), each sequence's gradients are those
 *    of attn_sdpa_backward on its unpacked views, bit for bit (both add the
 *    same float64 terms in the same order; without dropout, whose keep mask
 *    is indexed over the packed batch);
 *  - every fused path against the reference path, dropout, windows,
 *    soft-capping and ALiBi included (float64 tight, float32 within a bound
 *    that scales with the gradient's magnitude);
 *  - bits identical for 1-3 threads on every fused path, with a long
 *    sequence whose keys split into chunks and with GQA;
 *  - rows no sequence holds get 0 (they hold a sentinel before the call),
 *    and ASan builds check that no row outside the sequences is read;
 *  - hostile arguments, each refused naming the argument.
 */
#include <float.h>

#include "testutil.h"

enum { MAXB = 256 };

static const double SENTINEL = 7.25; /* what the gradients hold before a call */

static const attn_causal CAUSALS[3] = {ATTN_CAUSAL_NONE, ATTN_CAUSAL_TOP_LEFT,
                                       ATTN_CAUSAL_BOTTOM_RIGHT};

typedef struct vb_case {
    attn_dtype dt;
    int64_t B, Hq, Hkv, E, Ev, total_q, total_k, max_q, max_k;
    int32_t cu_q[MAXB + 1], cu_k[MAXB + 1];
    attn_tensor tcu_q, tcu_k;
    /* (total_q, Hq, E), (total_k, Hkv, E / Ev), out and dout (total_q, Hq, Ev),
     * lse (Hq, total_q), gradients like q, k, v */
    test_tensor q, k, v, out, lse, dout, dq, dk, dv;
    float slopes[16];
    attn_tensor alibi; /* (Hq,) */
    attn_sdpa_params p;
} vb_case;

static double get3(const attn_tensor *t, int64_t a, int64_t b, int64_t c) {
    const int64_t idx[3] = {a, b, c};
    return tt_get(t, idx);
}

/* Gradients of a case, full of `fill` (the sentinel, or another value:
 * an element two calls both leave unwritten then differs), in random
 * layouts. */
static void vb_grads_filled(vb_case *c, rng *r, double fill) {
    const int64_t qs[3] = {c->total_q, c->Hq, c->E}, ks[3] = {c->total_k, c->Hkv, c->E},
                  vs[3] = {c->total_k, c->Hkv, c->Ev};
    tt_make_output(&c->dq, r, c->dt, 3, qs, LAYOUT_RANDOM);
    tt_make_output(&c->dk, r, c->dt, 3, ks, LAYOUT_RANDOM);
    tt_make_output(&c->dv, r, c->dt, 3, vs, LAYOUT_RANDOM);
    tt_fill(&c->dq.t, fill);
    tt_fill(&c->dk.t, fill);
    tt_fill(&c->dv.t, fill);
}

static void vb_grads(vb_case *c, rng *r) { vb_grads_filled(c, r, SENTINEL); }

/* Tensors for the sizes and offsets set in c; the forward's out and lse
 * (lse_for_backward) computed on the current path. */
static void vb_build(vb_case *c, rng *r) {
    const int64_t qs[3] = {c->total_q, c->Hq, c->E}, ks[3] = {c->total_k, c->Hkv, c->E},
                  vs[3] = {c->total_k, c->Hkv, c->Ev}, os[3] = {c->total_q, c->Hq, c->Ev},
                  ls[2] = {c->Hq, c->total_q}, nb = c->B + 1;
    tt_make(&c->q, r, c->dt, 3, qs, LAYOUT_RANDOM, 1, 0);
    tt_make(&c->k, r, c->dt, 3, ks, LAYOUT_RANDOM, 1, 0);
    tt_make(&c->v, r, c->dt, 3, vs, LAYOUT_RANDOM, 1, 0);
    tt_make(&c->dout, r, c->dt, 3, os, LAYOUT_RANDOM, 1, 0);
    tt_make_output(&c->out, r, c->dt, 3, os, LAYOUT_RANDOM);
    tt_make_output(&c->lse, r, rng_int(r, 0, 1) ? ATTN_DTYPE_F64 : c->dt, 2, ls, LAYOUT_RANDOM);
    attn_tensor_init(&c->tcu_q, c->cu_q, ATTN_DTYPE_I32, 1, &nb);
    attn_tensor_init(&c->tcu_k, c->cu_k, ATTN_DTYPE_I32, 1, &nb);
    vb_grads(c, r);
}

static attn_status vb_forward(vb_case *c) {
    attn_sdpa_params p = c->p;
    p.lse_for_backward = 1;
    return attn_sdpa_varlen(&c->q.t, &c->k.t, &c->v.t, &c->tcu_q, &c->tcu_k, c->max_q, c->max_k,
                            &p, &c->out.t, &c->lse.t);
}

static attn_status vb_backward(vb_case *c) {
    return attn_sdpa_varlen_backward(&c->dout.t, &c->q.t, &c->k.t, &c->v.t, &c->out.t, &c->lse.t,
                                     &c->tcu_q, &c->tcu_k, c->max_q, c->max_k, &c->p, &c->dq.t,
                                     &c->dk.t, &c->dv.t);
}

static void vb_free(vb_case *c) {
    test_tensor *all[] = {&c->q, &c->k, &c->v, &c->out, &c->lse, &c->dout, &c->dq, &c->dk, &c->dv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tt_free(all[i]);
}

/* Offsets for B sequences of random lengths (some empty, some past one key
 * block); returns the total and sets *longest. */
static int64_t draw_offsets(rng *r, int64_t B, int64_t most, int32_t *cu, int64_t *longest) {
    cu[0] = 0;
    *longest = 0;
    for (int64_t n = 0; n < B; n++) {
        const int64_t len = rng_int(r, 0, 7) == 0   ? 0
                            : rng_int(r, 0, 3) == 0 ? rng_int(r, 1, most)
                                                    : rng_int(r, 1, 30);
        cu[n + 1] = (int32_t)(cu[n] + len);
        if (len > *longest) *longest = len;
    }
    return cu[B];
}

/* A random case: sizes, offsets (rows past the last sequence too), causal,
 * scale, and with `mods` dropout, a window, soft-capping and ALiBi. */
static void vb_random(vb_case *c, rng *r, attn_dtype dt, bool mods) {
    memset(c, 0, sizeof *c);
    c->dt = dt;
    c->B = rng_int(r, 1, 6);
    c->Hkv = rng_int(r, 1, 2);
    c->Hq = c->Hkv * rng_int(r, 1, 3);
    c->E = rng_int(r, 0, 3) == 0 ? 64 : rng_int(r, 1, 20);
    c->Ev = rng_int(r, 0, 3) == 0 ? c->E : rng_int(r, 1, 20);
    int64_t longest_q, longest_k;
    c->total_q = draw_offsets(r, c->B, 300, c->cu_q, &longest_q) + rng_int(r, 0, 3);
    c->total_k = draw_offsets(r, c->B, 400, c->cu_k, &longest_k) + rng_int(r, 0, 3);
    if (c->total_q == 0) c->total_q = 1; /* a tensor has rows; no sequence holds this one */
    if (c->total_k == 0) c->total_k = 1;
    c->max_q = longest_q + rng_int(r, 0, 2) * 5;
    c->max_k = longest_k + rng_int(r, 0, 2) * 5;
    attn_sdpa_params_init(&c->p);
    c->p.causal = CAUSALS[rng_int(r, 0, 2)];
    if (rng_int(r, 0, 3) == 0) {
        c->p.has_scale = 1;
        c->p.scale = rng_uniform(r) - 0.25;
    }
    if (mods) {
        if (rng_int(r, 0, 2) == 0) c->p.dropout_p = 0.2;
        c->p.seed = (uint64_t)rng_int(r, 0, 1000);
        if (rng_int(r, 0, 3) == 0) {
            c->p.window_left = rng_int(r, -1, 40);
            c->p.window_right = rng_int(r, -1, 40);
        }
        if (rng_int(r, 0, 3) == 0) c->p.softcap = 2.0 + 10 * rng_uniform(r);
        if (rng_int(r, 0, 3) == 0) {
            for (int64_t h = 0; h < c->Hq; h++) c->slopes[h] = (float)(0.3 * rng_uniform(r));
            attn_tensor_init(&c->alibi, c->slopes, ATTN_DTYPE_F32, 1, &c->Hq);
            c->p.alibi_slopes = &c->alibi;
        }
    }
    vb_build(c, r);
}

/* Rows [from, total) of a packed gradient are 0. */
static void check_zero_tail(const attn_tensor *g, int64_t from, const char *name,
                            const char *what) {
    for (int64_t t = from; t < g->shape[0]; t++)
        for (int64_t h = 0; h < g->shape[1]; h++)
            for (int64_t e = 0; e < g->shape[2]; e++)
                CHECK(get3(g, t, h, e) == 0, "%s: %s row %lld (no sequence's) is %g, not 0", what,
                      name, (long long)t, get3(g, t, h, e));
}

/* A packed operand's rows of one sequence as an attn_sdpa view (H, n, width). */
static attn_tensor unpacked(const attn_tensor *t, int64_t r0, int64_t n) {
    attn_tensor x = *t;
    x.data = (char *)t->data + r0 * t->strides[0] * (int64_t)attn_dtype_size(t->dtype);
    x.shape[0] = t->shape[1];
    x.shape[1] = n;
    x.strides[0] = t->strides[1];
    x.strides[1] = t->strides[0];
    return x;
}

/* lse (Hq, total) columns [r0, r0 + n): (Hq, n). */
static attn_tensor lse_columns(const attn_tensor *t, int64_t r0, int64_t n) {
    attn_tensor x = *t;
    x.data = (char *)t->data + r0 * t->strides[1] * (int64_t)attn_dtype_size(t->dtype);
    x.shape[1] = n;
    return x;
}

/* Whether rows [r0, r0 + n) of packed g equal the (H, n, width) tensor x, bit
 * for bit; a sequence with no keys (or no queries) has zero gradients. */
static bool same_rows(const attn_tensor *g, int64_t r0, int64_t n, const attn_tensor *x) {
    bool same = true;
    for (int64_t h = 0; h < g->shape[1]; h++)
        for (int64_t i = 0; i < n; i++)
            for (int64_t e = 0; e < g->shape[2]; e++) {
                const double want = x != NULL ? get3(x, h, i, e) : 0.0;
                same &= get3(g, r0 + i, h, e) == want;
            }
    return same;
}

/* On the reference path: sequence by sequence, attn_sdpa_backward on the
 * unpacked views gives the same bits. */
static void vs_sdpa_backward(vb_case *c, const char *what) {
    for (int64_t n = 0; n < c->B; n++) {
        const int64_t q0 = c->cu_q[n], L = c->cu_q[n + 1] - q0;
        const int64_t k0 = c->cu_k[n], S = c->cu_k[n + 1] - k0;
        if (L == 0 || S == 0) { /* attn_sdpa takes no empty tensor: zeros */
            CHECK(same_rows(&c->dq.t, q0, L, NULL) && same_rows(&c->dk.t, k0, S, NULL) &&
                      same_rows(&c->dv.t, k0, S, NULL),
                  "%s: sequence %lld (L %lld, S %lld) has nonzero gradients", what, (long long)n,
                  (long long)L, (long long)S);
            continue;
        }
        attn_tensor q = unpacked(&c->q.t, q0, L), k = unpacked(&c->k.t, k0, S),
                    v = unpacked(&c->v.t, k0, S), out = unpacked(&c->out.t, q0, L),
                    dout = unpacked(&c->dout.t, q0, L), lse = lse_columns(&c->lse.t, q0, L);
        const int64_t qs[3] = {c->Hq, L, c->E}, ks[3] = {c->Hkv, S, c->E},
                      vs[3] = {c->Hkv, S, c->Ev};
        test_tensor dq, dk, dv;
        rng r = {(uint64_t)n + 1};
        tt_make_output(&dq, &r, c->dt, 3, qs, LAYOUT_CONTIGUOUS);
        tt_make_output(&dk, &r, c->dt, 3, ks, LAYOUT_CONTIGUOUS);
        tt_make_output(&dv, &r, c->dt, 3, vs, LAYOUT_CONTIGUOUS);
        attn_sdpa_params p = c->p;
        p.enable_gqa = 1;
        CHECK_OK(attn_sdpa_backward(&dout, &q, &k, &v, &out, &lse, &p, &dq.t, &dk.t, &dv.t, NULL));
        CHECK(same_rows(&c->dq.t, q0, L, &dq.t) && same_rows(&c->dk.t, k0, S, &dk.t) &&
                  same_rows(&c->dv.t, k0, S, &dv.t),
              "%s: sequence %lld differs from attn_sdpa_backward on its unpacked views", what,
              (long long)n);
        tt_free(&dq);
        tt_free(&dk);
        tt_free(&dv);
    }
}

static void test_reference_matches_sdpa_backward(void) {
    rng r = {harness_seed() ^ 0x7b1du};
    CHECK_OK(attn_set_isa(ATTN_ISA_REF));
    for (int i = 0; i < 60; i++) {
        vb_case c;
        vb_random(&c, &r, i % 2 ? ATTN_DTYPE_F32 : ATTN_DTYPE_F64, false);
        char what[64];
        snprintf(what, sizeof what, "reference case %d", i);
        CHECK_OK(vb_forward(&c));
        CHECK_OK(vb_backward(&c));
        vs_sdpa_backward(&c, what);
        check_zero_tail(&c.dq.t, c.cu_q[c.B], "dq", what);
        check_zero_tail(&c.dk.t, c.cu_k[c.B], "dk", what);
        check_zero_tail(&c.dv.t, c.cu_k[c.B], "dv", what);
        vb_free(&c);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

static const attn_isa FUSED[] = {ATTN_ISA_GENERIC, ATTN_ISA_AVX2, ATTN_ISA_AVX512,
                                 ATTN_ISA_AVX512_BF16, ATTN_ISA_AMX};

/* The fused path's gradients against the reference path's on the same
 * inputs (test_backward's bound: relative to max(|grad|, 1), float32
 * rounding growing like the square root of the lengths summed over). */
static void check_against_reference(vb_case *c, rng *r, const char *what) {
    vb_case ref = *c; /* the same inputs; gradients of its own, filled otherwise */
    vb_grads_filled(&ref, r, -SENTINEL);
    const attn_isa isa = attn_get_isa();
    CHECK_OK(attn_set_isa(ATTN_ISA_REF));
    CHECK_OK(vb_backward(&ref));
    CHECK_OK(attn_set_isa(isa));
    const double n = (double)(c->max_q + c->max_k + c->E);
    const double tol = c->dt == ATTN_DTYPE_F64 ? 1e-12 : 16 * FLT_EPSILON * sqrt(n);
    const test_tensor *got[3] = {&c->dq, &c->dk, &c->dv}, *want[3] = {&ref.dq, &ref.dk, &ref.dv};
    const char *names[3] = {"dq", "dk", "dv"};
    for (int g = 0; g < 3; g++) {
        double diff, mag;
        tt_compare(&got[g]->t, &want[g]->t, &diff, &mag);
        CHECK(diff <= tol * (mag > 1 ? mag : 1),
              "%s (%s, %s): %s |fused - reference| = %.3g, max |grad| %.3g (B %lld Hq %lld Hkv "
              "%lld E %lld Ev %lld causal %d drop %g window %lld,%lld softcap %g alibi %d)",
              what, attn_isa_name(isa), attn_dtype_name(c->dt), names[g], diff, mag,
              (long long)c->B, (long long)c->Hq, (long long)c->Hkv, (long long)c->E,
              (long long)c->Ev, (int)c->p.causal, c->p.dropout_p, (long long)c->p.window_left,
              (long long)c->p.window_right, c->p.softcap, c->p.alibi_slopes != NULL);
        tt_free((test_tensor *)want[g]);
    }
}

static void test_fused_matches_reference(void) {
    rng r = {harness_seed() ^ 0xbacc};
    for (size_t i = 0; i < sizeof FUSED / sizeof FUSED[0]; i++) {
        if (!attn_isa_supported(FUSED[i])) continue;
        CHECK_OK(attn_set_isa(FUSED[i]));
        for (int n = 0; n < 50; n++) {
            vb_case c;
            vb_random(&c, &r, n % 2 ? ATTN_DTYPE_F32 : ATTN_DTYPE_F64, true);
            char what[64];
            snprintf(what, sizeof what, "case %d", n);
            CHECK_OK(vb_forward(&c));
            CHECK_OK(vb_backward(&c));
            check_zero_tail(&c.dq.t, c.cu_q[c.B], "dq", what);
            check_zero_tail(&c.dk.t, c.cu_k[c.B], "dk", what);
            check_zero_tail(&c.dv.t, c.cu_k[c.B], "dv", what);
            check_against_reference(&c, &r, what);
            vb_free(&c);
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* A fixed batch: B sequences of the given lengths and a few rows past them. */
static void vb_fixed(vb_case *c, rng *r, int64_t B, const int *lq, const int *lk, int64_t Hq,
                     int64_t Hkv, int64_t E, attn_causal causal, double dropout_p, int64_t pad) {
    memset(c, 0, sizeof *c);
    c->dt = ATTN_DTYPE_F32;
    c->B = B;
    c->Hq = Hq;
    c->Hkv = Hkv;
    c->E = c->Ev = E;
    for (int64_t n = 0; n < B; n++) {
        c->cu_q[n + 1] = c->cu_q[n] + lq[n];
        c->cu_k[n + 1] = c->cu_k[n] + lk[n];
        c->max_q = lq[n] > c->max_q ? lq[n] : c->max_q;
        c->max_k = lk[n] > c->max_k ? lk[n] : c->max_k;
    }
    c->total_q = c->cu_q[B] + pad > 0 ? c->cu_q[B] + pad : 1;
    c->total_k = c->cu_k[B] + pad > 0 ? c->cu_k[B] + pad : 1;
    attn_sdpa_params_init(&c->p);
    c->p.causal = causal;
    c->p.dropout_p = dropout_p;
    c->p.seed = 99;
    vb_build(c, r);
}

static void test_bits_for_any_thread_count(void) {
    rng r = {harness_seed() ^ 0x3b17u};
    const int lq0[2] = {1100, 37}, lk0[2] = {1500, 20}; /* one head: key chunks */
    const int lq1[5] = {130, 0, 64, 250, 7}, lk1[5] = {90, 40, 300, 250, 0}; /* GQA */
    for (size_t i = 0; i < sizeof FUSED / sizeof FUSED[0]; i++) {
        if (!attn_isa_supported(FUSED[i])) continue;
        CHECK_OK(attn_set_isa(FUSED[i]));
        for (int n = 0; n < 2; n++) {
            vb_case c;
            if (n == 0) vb_fixed(&c, &r, 2, lq0, lk0, 1, 1, 16, ATTN_CAUSAL_BOTTOM_RIGHT, 0.1, 2);
            else vb_fixed(&c, &r, 5, lq1, lk1, 4, 2, 32, ATTN_CAUSAL_NONE, 0, 3);
            CHECK_OK(vb_forward(&c));
            vb_case base = c;
            vb_grads(&base, &r);
            attn_set_num_threads(1);
            CHECK_OK(vb_backward(&base));
            for (int t = 2; t <= 3; t++) {
                attn_set_num_threads(t);
                CHECK_OK(vb_backward(&c));
                CHECK(tt_same_bits(&c.dq.t, &base.dq.t) && tt_same_bits(&c.dk.t, &base.dk.t) &&
                          tt_same_bits(&c.dv.t, &base.dv.t),
                      "%s case %d: gradients differ between 1 and %d threads",
                      attn_isa_name(FUSED[i]), n, t);
            }
            tt_free(&base.dq);
            tt_free(&base.dk);
            tt_free(&base.dv);
            vb_free(&c);
        }
    }
    attn_set_num_threads(0);
    attn_set_isa(ATTN_ISA_AUTO);
}

/* Batches at the edges, on every path: against attn_sdpa_backward per
 * sequence on the reference path, and the fused paths against it. One
 * query row in all (the row stride of a size-1 dimension is 0, so every
 * sequence starts at that row: the empty one must not store over it),
 * every sequence without queries, every one without keys, queries past
 * their keys under bottom-right causality. */
static void test_edges(void) {
    static const struct {
        int64_t B, pad;
        int lq[3], lk[3];
        attn_causal causal;
    } edges[] = {
        {2, 0, {1, 0}, {6, 1}, ATTN_CAUSAL_BOTTOM_RIGHT},
        {2, 0, {0, 1}, {3, 2}, ATTN_CAUSAL_NONE},
        {3, 1, {0, 0, 0}, {4, 0, 5}, ATTN_CAUSAL_NONE},
        {2, 0, {3, 4}, {0, 0}, ATTN_CAUSAL_TOP_LEFT},
        {3, 2, {7, 2, 9}, {3, 5, 1}, ATTN_CAUSAL_BOTTOM_RIGHT},
    };
    rng r = {harness_seed() ^ 0xed9e};
    for (size_t e = 0; e < sizeof edges / sizeof edges[0]; e++)
        for (int pi = -1; pi < (int)(sizeof FUSED / sizeof FUSED[0]); pi++) {
            const attn_isa isa = pi < 0 ? ATTN_ISA_REF : FUSED[pi];
            if (!attn_isa_supported(isa)) continue;
            CHECK_OK(attn_set_isa(isa));
            vb_case c;
            vb_fixed(&c, &r, edges[e].B, edges[e].lq, edges[e].lk, 2, 1, 5, edges[e].causal, 0,
                     edges[e].pad);
            char what[64];
            snprintf(what, sizeof what, "edge case %zu", e);
            CHECK_OK(vb_forward(&c));
            CHECK_OK(vb_backward(&c));
            check_zero_tail(&c.dq.t, c.cu_q[c.B], "dq", what);
            check_zero_tail(&c.dk.t, c.cu_k[c.B], "dk", what);
            check_zero_tail(&c.dv.t, c.cu_k[c.B], "dv", what);
            if (isa == ATTN_ISA_REF) vs_sdpa_backward(&c, what);
            else check_against_reference(&c, &r, what);
            vb_free(&c);
        }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- workspace that follows the rows, not batch x the longest ---- */

/* An allocator that refuses any block above `limit` bytes (thread-safe:
 * it keeps no state but the limit). */
static void *capped_alloc(void *ctx, size_t size) {
    return size > *(const size_t *)ctx ? NULL : malloc(size);
}
static void capped_release(void *ctx, void *ptr) {
    (void)ctx;
    free(ptr);
}

/* One sequence of 2,048 tokens beside 255 of 4, GQA (4 query heads over
 * 2): 3,068 tokens. Indexed by batch x the longest, the backward's row
 * statistics took 3 x 256 x 4 x 2,048 floats (25 MB) and dQ's partial sums
 * 256 x 4 x 2,048 x 32 (268 MB) where the rows need 0.4 MB and 1.6 MB; under
 * an allocator that refuses any block above 8 MiB, forward and backward
 * now succeed on every path and give the unbounded calls' bits (the
 * reference backward, also the fused paths' fallback, held 537 MB of
 * float64 dQ contributions there). */
static void test_skewed_batch_workspace(void) {
    enum { B = 256 };
    int lq[B], lk[B];
    for (int n = 0; n < B; n++) lq[n] = lk[n] = n == 0 ? 2048 : 4;
    rng r = {harness_seed() ^ 0x5ce3u};
    size_t limit = (size_t)8 << 20;
    const attn_allocator capped = {capped_alloc, capped_release, &limit};
    for (int pi = -1; pi < (int)(sizeof FUSED / sizeof FUSED[0]); pi++) {
        const attn_isa isa = pi < 0 ? ATTN_ISA_REF : FUSED[pi];
        if (!attn_isa_supported(isa)) continue;
        CHECK_OK(attn_set_isa(isa));
        vb_case c;
        vb_fixed(&c, &r, B, lq, lk, 4, 2, 32, ATTN_CAUSAL_BOTTOM_RIGHT, 0, 1);
        CHECK_OK(vb_forward(&c));
        CHECK_OK(vb_backward(&c));
        vb_case capped_case = c;
        vb_grads(&capped_case, &r);
        attn_set_allocator(&capped);
        const attn_status fwd = vb_forward(&capped_case);
        const attn_status bwd = vb_backward(&capped_case);
        attn_set_allocator(NULL);
        CHECK(fwd == ATTN_OK && bwd == ATTN_OK,
              "%s: a skewed batch needs blocks above 8 MiB (forward %d, backward %d: %s)",
              attn_isa_name(isa), (int)fwd, (int)bwd, attn_last_error());
        CHECK(tt_same_bits(&capped_case.dq.t, &c.dq.t) && tt_same_bits(&capped_case.dk.t, &c.dk.t) &&
                  tt_same_bits(&capped_case.dv.t, &c.dv.t),
              "%s: the capped call's gradients differ", attn_isa_name(isa));
        tt_free(&capped_case.dq);
        tt_free(&capped_case.dk);
        tt_free(&capped_case.dv);
        vb_free(&c);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* Each hostile argument is refused, naming it, and writes nothing. */
static void test_arguments(void) {
    rng r = {harness_seed() ^ 0x4a5u};
    const int lq[2] = {5, 3}, lk[2] = {4, 6};
    vb_case c;
    vb_fixed(&c, &r, 2, lq, lk, 2, 1, 8, ATTN_CAUSAL_NONE, 0, 2);
    CHECK_OK(vb_forward(&c));
    tt_fill(&c.dq.t, SENTINEL);
#define REFUSED(call, want_arg)                                                                   \
    do {                                                                                          \
        CHECK((call) != ATTN_OK, "%s was accepted", want_arg);                                   \
        CHECK(strcmp(attn_last_error_arg(), want_arg) == 0, "refusal names %s, not %s",          \
              attn_last_error_arg(), want_arg);                                                   \
    } while (0)
    attn_tensor x;
    /* dq with k's shape */
    REFUSED(attn_sdpa_varlen_backward(&c.dout.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t,
                                      &c.tcu_q, &c.tcu_k, c.max_q, c.max_k, &c.p, &c.dk.t, NULL,
                                      NULL),
            "dq");
    /* dout of the wrong shape */
    x = c.dout.t;
    x.shape[1] = 1;
    REFUSED(attn_sdpa_varlen_backward(&x, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t, &c.tcu_q,
                                      &c.tcu_k, c.max_q, c.max_k, &c.p, &c.dq.t, NULL, NULL),
            "dout");
    /* lse transposed */
    x = c.lse.t;
    x.shape[0] = c.lse.t.shape[1];
    x.shape[1] = c.lse.t.shape[0];
    REFUSED(attn_sdpa_varlen_backward(&c.dout.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &x, &c.tcu_q,
                                      &c.tcu_k, c.max_q, c.max_k, &c.p, &c.dq.t, NULL, NULL),
            "lse");
    /* dk overlapping k */
    x = c.k.t;
    REFUSED(attn_sdpa_varlen_backward(&c.dout.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t,
                                      &c.tcu_q, &c.tcu_k, c.max_q, c.max_k, &c.p, NULL, &x, NULL),
            "dk");
    /* dv overlapping dk */
    REFUSED(attn_sdpa_varlen_backward(&c.dout.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t,
                                      &c.tcu_q, &c.tcu_k, c.max_q, c.max_k, &c.p, NULL, &c.dk.t,
                                      &c.dk.t),
            "dv");
    /* a sequence longer than max_seqlen_k; offsets decreasing */
    REFUSED(attn_sdpa_varlen_backward(&c.dout.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t,
                                      &c.tcu_q, &c.tcu_k, c.max_q, 5, &c.p, &c.dq.t, NULL, NULL),
            "max_seqlen_k");
    c.cu_q[1] = 9;
    REFUSED(attn_sdpa_varlen_backward(&c.dout.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t,
                                      &c.tcu_q, &c.tcu_k, 20, c.max_k, &c.p, &c.dq.t, NULL, NULL),
            "cu_seqlens_q");
    c.cu_q[1] = 5;
    /* dq of another dtype; a mask */
    test_tensor d64;
    const int64_t qs[3] = {c.total_q, c.Hq, c.E};
    tt_make_output(&d64, &r, ATTN_DTYPE_F64, 3, qs, LAYOUT_CONTIGUOUS);
    REFUSED(attn_sdpa_varlen_backward(&c.dout.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t,
                                      &c.tcu_q, &c.tcu_k, c.max_q, c.max_k, &c.p, &d64.t, NULL,
                                      NULL),
            "dq");
    tt_free(&d64);
    attn_sdpa_params p = c.p;
    p.attn_mask = &c.q.t;
    REFUSED(attn_sdpa_varlen_backward(&c.dout.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t,
                                      &c.tcu_q, &c.tcu_k, c.max_q, c.max_k, &p, &c.dq.t, NULL,
                                      NULL),
            "params.attn_mask");
    REFUSED(attn_sdpa_varlen_backward(NULL, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t, &c.tcu_q,
                                      &c.tcu_k, c.max_q, c.max_k, &c.p, &c.dq.t, NULL, NULL),
            "dout");
#undef REFUSED
    /* cancelled before it starts: ATTN_ERR_CANCELLED, nothing written */
    volatile int cancel = 1;
    attn_set_cancel_flag(&cancel);
    CHECK_STATUS(attn_sdpa_varlen_backward(&c.dout.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t,
                                           &c.tcu_q, &c.tcu_k, c.max_q, c.max_k, &c.p, &c.dq.t,
                                           NULL, NULL),
                 ATTN_ERR_CANCELLED);
    attn_set_cancel_flag(NULL);
    for (int64_t t = 0; t < c.total_q; t++) /* nothing was written */
        for (int64_t h = 0; h < c.Hq; h++)
            for (int64_t e = 0; e < c.E; e++)
                CHECK(get3(&c.dq.t, t, h, e) == SENTINEL, "a refused call wrote dq");
    /* all gradients NULL: nothing to do */
    CHECK_OK(attn_sdpa_varlen_backward(&c.dout.t, &c.q.t, &c.k.t, &c.v.t, &c.out.t, &c.lse.t,
                                       &c.tcu_q, &c.tcu_k, c.max_q, c.max_k, &c.p, NULL, NULL,
                                       NULL));
    vb_free(&c);
}

/* ---- attn_sdpa_varlen_sinks_backward ---- */

/* dsinks of a case with sinks (float64, (Hq,) or (B, Hq)), against
 * attn_sdpa_sinks_backward on each sequence's unpacked rows: with (B, Hq)
 * sinks, row n is sequence n's own result; with (Hq,), the sequences'
 * results added in sequence order. Both sum the same float64 terms in the
 * same order, so the bits agree. */
static void vs_sinks_backward(vb_case *c, const attn_tensor *sinks, const attn_tensor *dsinks,
                              const char *what) {
    const bool per_seq = sinks->rank == 2;
    double want[MAXB * 16] = {0};
    for (int64_t n = 0; n < c->B; n++) {
        const int64_t q0 = c->cu_q[n], L = c->cu_q[n + 1] - q0;
        if (L == 0) continue; /* attn_sdpa takes no empty tensor; it adds nothing */
        attn_tensor out = unpacked(&c->out.t, q0, L), dout = unpacked(&c->dout.t, q0, L),
                    lse = lse_columns(&c->lse.t, q0, L), s = *sinks;
        if (per_seq) { /* row n: (Hq,) */
            s.data = (double *)sinks->data + n * sinks->strides[0];
            s.rank = 1;
            s.shape[0] = sinks->shape[1];
            s.strides[0] = sinks->strides[1];
        }
        double got[16];
        attn_tensor tg;
        attn_tensor_init(&tg, got, ATTN_DTYPE_F64, 1, &c->Hq);
        attn_sdpa_params p = c->p;
        p.sinks = &s;
        CHECK_OK(attn_sdpa_sinks_backward(&dout, &out, &lse, &p, &tg));
        for (int64_t h = 0; h < c->Hq; h++) want[(per_seq ? n * c->Hq : 0) + h] += got[h];
    }
    for (int64_t n = 0; n < (per_seq ? c->B : 1); n++)
        for (int64_t h = 0; h < c->Hq; h++) {
            const double g = per_seq ? ((const double *)dsinks->data)[n * dsinks->strides[0] +
                                                                      h * dsinks->strides[1]]
                                     : ((const double *)dsinks->data)[h * dsinks->strides[0]];
            CHECK(g == want[(per_seq ? n * c->Hq : 0) + h],
                  "%s: dsinks[%lld, %lld] is %.17g; per sequence %.17g", what, (long long)n,
                  (long long)h, g, want[(per_seq ? n * c->Hq : 0) + h]);
        }
}

static void test_sinks_gradient(void) {
    rng r = {harness_seed() ^ 0x51c5u};
    for (int i = 0; i < 60; i++) {
        vb_case c;
        vb_random(&c, &r, i % 2 ? ATTN_DTYPE_F32 : ATTN_DTYPE_F64, i % 3 == 0);
        const bool per_seq = i % 4 >= 2;
        double sv[MAXB * 16], dv[MAXB * 16];
        const int64_t shape[2] = {per_seq ? c.B : c.Hq, c.Hq};
        attn_tensor sinks, dsinks;
        attn_tensor_init(&sinks, sv, ATTN_DTYPE_F64, per_seq ? 2 : 1, per_seq ? shape : shape + 1);
        attn_tensor_init(&dsinks, dv, ATTN_DTYPE_F64, sinks.rank, sinks.shape);
        for (int64_t x = 0; x < attn_tensor_numel(&sinks); x++)
            sv[x] = rng_int(&r, 0, 9) == 0 ? -INFINITY : (float)(4 * rng_uniform(&r) - 1);
        c.p.sinks = &sinks;
        CHECK_OK(vb_forward(&c));
        for (int64_t x = 0; x < attn_tensor_numel(&dsinks); x++) dv[x] = SENTINEL;
        CHECK_OK(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, &c.p,
                                                 &dsinks));
        char what[64];
        snprintf(what, sizeof what, "sinks case %d (%s)", i, per_seq ? "(B, Hq)" : "(Hq,)");
        vs_sinks_backward(&c, &sinks, &dsinks, what);
        /* float32 sinks (the same values: sv holds floats): the same sums,
         * rounded once to float32 */
        float sf[MAXB * 16], df[MAXB * 16];
        attn_tensor sinks32 = sinks, dsinks32 = dsinks;
        sinks32.data = sf;
        sinks32.dtype = dsinks32.dtype = ATTN_DTYPE_F32;
        dsinks32.data = df;
        for (int64_t x = 0; x < attn_tensor_numel(&sinks); x++) sf[x] = (float)sv[x];
        attn_sdpa_params p32 = c.p;
        p32.sinks = &sinks32;
        CHECK_OK(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, &p32,
                                                 &dsinks32));
        for (int64_t x = 0; x < attn_tensor_numel(&dsinks); x++)
            CHECK(df[x] == (float)dv[x],
                  "%s: float32 dsinks[%lld] is %.9g, not the float64 one rounded (%.9g)", what,
                  (long long)x, df[x], (float)dv[x]);
        vb_free(&c);
    }
}

/* Each bad argument named, dsinks untouched; no sequence: zeros. */
static void test_sinks_gradient_arguments(void) {
    rng r = {harness_seed() ^ 0x5a6u};
    const int lq[2] = {5, 3}, lk[2] = {4, 6};
    vb_case c;
    vb_fixed(&c, &r, 2, lq, lk, 2, 1, 8, ATTN_CAUSAL_NONE, 0, 2);
    double sv[2] = {0.5, -1.0}, dv[2] = {SENTINEL, SENTINEL};
    const int64_t two = 2, three = 3;
    attn_tensor sinks, dsinks, bad;
    attn_tensor_init(&sinks, sv, ATTN_DTYPE_F64, 1, &two);
    attn_tensor_init(&dsinks, dv, ATTN_DTYPE_F64, 1, &two);
    c.p.sinks = &sinks;
    CHECK_OK(vb_forward(&c));
#define REFUSED(call, want_arg)                                                                   \
    do {                                                                                          \
        CHECK((call) != ATTN_OK, "%s was accepted", want_arg);                                   \
        CHECK(strcmp(attn_last_error_arg(), want_arg) == 0, "refusal names %s, not %s",          \
              attn_last_error_arg(), want_arg);                                                   \
        CHECK(dv[0] == SENTINEL && dv[1] == SENTINEL, "a refused call (%s) wrote dsinks",        \
              want_arg);                                                                          \
    } while (0)
    REFUSED(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, NULL,
                                            &dsinks),
            "params.sinks");
    attn_sdpa_params none = c.p;
    none.sinks = NULL;
    REFUSED(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, &none,
                                            &dsinks),
            "params.sinks");
    attn_tensor_init(&bad, dv, ATTN_DTYPE_F64, 1, &three); /* 3 heads' sinks, 2 heads */
    attn_sdpa_params wrong = c.p;
    wrong.sinks = &bad;
    REFUSED(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, &wrong,
                                            &dsinks),
            "params.sinks");
    bad = dsinks;
    bad.dtype = ATTN_DTYPE_F32;
    REFUSED(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, &c.p, &bad),
            "dsinks");
    CHECK_STATUS(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, &c.p,
                                                 &bad),
                 ATTN_ERR_DTYPE); /* a dtype, not a shape (it was ATTN_ERR_SHAPE) */
    REFUSED(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, &c.p, NULL),
            "dsinks");
    REFUSED(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, &c.p,
                                            &sinks),
            "dsinks"); /* dsinks is the sinks */
    bad = c.lse.t; /* transposed */
    bad.shape[0] = c.lse.t.shape[1];
    bad.shape[1] = c.lse.t.shape[0];
    REFUSED(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &bad, &c.tcu_q, &c.p, &dsinks),
            "lse");
    bad = c.dout.t;
    bad.shape[1] = 1;
    REFUSED(attn_sdpa_varlen_sinks_backward(&bad, &c.out.t, &c.lse.t, &c.tcu_q, &c.p, &dsinks),
            "dout");
    REFUSED(attn_sdpa_varlen_sinks_backward(&c.dout.t, NULL, &c.lse.t, &c.tcu_q, &c.p, &dsinks),
            "out");
    c.cu_q[1] = 11; /* past the 10 rows of out */
    REFUSED(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, &c.p,
                                            &dsinks),
            "cu_seqlens_q");
    c.cu_q[1] = 6;
    c.cu_q[2] = 4; /* decreasing */
    REFUSED(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &c.tcu_q, &c.p,
                                            &dsinks),
            "cu_seqlens_q");
#undef REFUSED
    /* no sequence (cu_seqlens_q = [0]): nothing takes part, dsinks = 0 */
    const int64_t one = 1;
    int32_t zero = 0;
    attn_tensor cu0;
    attn_tensor_init(&cu0, &zero, ATTN_DTYPE_I32, 1, &one);
    CHECK_OK(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &cu0, &c.p, &dsinks));
    CHECK(dv[0] == 0 && dv[1] == 0, "no sequence: dsinks is (%g, %g), not 0", dv[0], dv[1]);
    /* 2^62 + 1 offsets, all 0, through a zero stride: B = 2^62 sequences of
     * nothing, B x Hq overflows int64 (signed overflow, UBSan, before) */
    attn_tensor huge = cu0;
    huge.shape[0] = ((int64_t)1 << 62) + 1;
    huge.strides[0] = 0;
    CHECK_STATUS(attn_sdpa_varlen_sinks_backward(&c.dout.t, &c.out.t, &c.lse.t, &huge, &c.p,
                                                 &dsinks),
                 ATTN_ERR_OVERFLOW);
    CHECK(strcmp(attn_last_error_arg(), "cu_seqlens_q") == 0, "%s", attn_last_error_arg());
    vb_free(&c);
}

int main(int argc, char **argv) {
    static const harness_test tests[] = {
        T(test_reference_matches_sdpa_backward),
        T(test_fused_matches_reference),
        T(test_bits_for_any_thread_count),
        T(test_edges),
        T(test_skewed_batch_workspace),
        T(test_arguments),
        T(test_sinks_gradient),
        T(test_sinks_gradient_arguments),
    };
    return harness_main(argc, argv, tests, (int)(sizeof tests / sizeof tests[0]));
}
