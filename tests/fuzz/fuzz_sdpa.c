/*
 * fuzz_sdpa.c — attn_sdpa and attn_sdpa_out_shape with shapes, strides,
 * ranks, dtypes, masks, flags and buffers drawn from the fuzz input.
 *
 * Most inputs describe a consistent problem (batch dims, heads, L, S, E, Ev)
 * that is then perturbed: a dimension, a rank or a dtype changed, a pointer
 * dropped, a wild stride or size. Invariants, checked on every input:
 *  - status and attn_last_error() agree (fz_check_status);
 *  - attn_sdpa fails exactly as attn_sdpa_out_shape does when the latter
 *    rejects the inputs (the same validation, and no memory touched);
 *  - no allocation made by the library outlives a call;
 *  - on success with finite, moderate inputs: out finite, weights in
 *    [0, 1/(1-p)], lse finite or -inf (a row with no visible key);
 *  - an output aliasing an input, or a set cancel flag, never gives ATTN_OK;
 *  - ASan/UBSan: no access outside the exactly-sized buffers, no UB.
 */
#include "fuzz_util.h"

enum {
    BUF_LIMIT = 1 << 14, /* elements backing one view */
    WORK_LIMIT = 1 << 18 /* nbatch * L * S * (E + Ev) for a call that computes */
};

typedef struct problem {
    fz_tensor q, k, v, mask, out, weights, lse;
    bool has_mask, has_weights, has_lse;
    attn_sdpa_params p;
    /* the drawn sizes: batch dims B[0..nb) (the last is the head dim) */
    attn_dtype dt;
    int nb;
    int64_t B[ATTN_MAX_RANK], L, S, Ev;
    /* one shape array for every tensor drawn, as make() may perturb a
     * tensor's rank upwards and then read entries an earlier one left */
    int64_t shape[ATTN_MAX_RANK + 2];
} problem;

/* Shape of an operand right-aligned against batch dims B[0..nb): it drops
 * `drop` leading dims and turns some of the others into 1 (broadcast). */
static int operand_shape(fz *f, int64_t *shape, const int64_t *B, int nb, int64_t head,
                         int64_t rows, int64_t cols) {
    int drop = fz_one_in(f, 3) ? (int)fz_range(f, 0, nb) : 0;
    int r = 0;
    for (int d = drop; d < nb; d++) {
        int64_t size = (d == nb - 1 && head > 0) ? head : B[d];
        shape[r++] = fz_one_in(f, 5) ? 1 : size;
    }
    shape[r++] = rows;
    shape[r++] = cols;
    return r;
}

static attn_dtype pick_dtype(fz *f, attn_dtype usual) {
    if (!fz_one_in(f, 24)) return usual;
    static const attn_dtype odd[] = {ATTN_DTYPE_F32, ATTN_DTYPE_F64, ATTN_DTYPE_BOOL,
                                     ATTN_DTYPE_F16, ATTN_DTYPE_BF16, ATTN_DTYPE_I32,
                                     (attn_dtype)0, (attn_dtype)42, (attn_dtype)-1};
    return odd[fz_u8(f) % 9];
}

/* Rarely: change one dimension or the rank of a view before it is backed. */
static void perturb(fz *f, int *rank, int64_t *shape) {
    if (!fz_one_in(f, 16)) return;
    if (fz_bool(f)) {
        *rank = (int)fz_range(f, -1, ATTN_MAX_RANK + 1);
        for (int d = 0; d < ATTN_MAX_RANK && d < *rank; d++)
            if (shape[d] < 1) shape[d] = 1;
    } else if (*rank >= 1 && *rank <= ATTN_MAX_RANK) {
        int d = (int)fz_range(f, 0, *rank - 1);
        shape[d] = fz_one_in(f, 2) ? fz_wild(f) : fz_range(f, 1, 7);
    }
}

static void make(fz *f, fz_tensor *x, attn_dtype dt, int rank, int64_t *shape, bool output,
                 fz_values *vals) {
    perturb(f, &rank, shape);
    fz_tensor_make(f, x, dt, rank, shape, output, BUF_LIMIT, vals, !output);
}

static double pick_scale(fz *f, fz_values *vals) {
    static const double usual[] = {1.0, 0.5, -0.25, 0.0, 1e-3, 2.0, 0.125, -3.0};
    static const double wild[] = {NAN, INFINITY, -INFINITY, 1e300, -1e300, 1e-300, 1e30};
    if (fz_one_in(f, 12)) {
        vals->tame = false;
        return wild[fz_u8(f) % 7];
    }
    return usual[fz_u8(f) % 8];
}

static double pick_dropout(fz *f) {
    if (!fz_one_in(f, 4)) return 0.0;
    static const double ps[] = {0.25, 0.5, 1.0, 1e-9, 0.999999, 0.1,
                                -0.1, 1.5, NAN,  INFINITY, -0.0, 1.0 + 1e-15};
    return ps[fz_u8(f) % 12];
}

/* A small, odd corner of the API: views built and reshaped from the input. */
static void fuzz_views(fz *f) {
    int64_t shape[ATTN_MAX_RANK + 2];
    int rank = (int)fz_range(f, -1, ATTN_MAX_RANK + 1);
    for (int d = 0; d < ATTN_MAX_RANK + 2; d++) shape[d] = fz_dim(f, 9, true);
    attn_tensor t;
    attn_status st = attn_tensor_init(&t, fz_forbidden_page(), ATTN_DTYPE_F32, rank, shape);
    fz_check_status(st, "attn_tensor_init");
    if (st != ATTN_OK) return;
    int64_t n = attn_tensor_numel(&t);
    FZ_ASSERT(n >= 1, "numel %lld of a valid view", (long long)n);
    int perm[ATTN_MAX_RANK];
    for (int d = 0; d < ATTN_MAX_RANK; d++) perm[d] = (int)fz_range(f, -9, 9);
    fz_check_status(attn_tensor_permute(&t, perm), "attn_tensor_permute");
    fz_check_status(attn_tensor_transpose(&t, (int)fz_range(f, -9, 9), (int)fz_range(f, -9, 9)),
                    "attn_tensor_transpose");
    FZ_ASSERT(attn_tensor_numel(&t) == n, "reshaping changed numel");
}

static void check_outputs(const problem *pr, double p, const fz_values *vals) {
    if (!vals->tame) return;
    /* |tame values| < 8, so only dropout's 1/(1-p) takes a float16 output
     * past 65504, where rounding gives infinity */
    if (pr->out.t.dtype != ATTN_DTYPE_F16 || p < 0.99)
        FZ_ASSERT(fz_all_finite(&pr->out.t, false), "finite inputs gave a non-finite output");
    /* a 16-bit weight may round up by half its ulp */
    const attn_dtype wdt = pr->has_weights ? pr->weights.t.dtype : ATTN_DTYPE_F32;
    const double slack = wdt == ATTN_DTYPE_BF16 ? 0x1p-8 : wdt == ATTN_DTYPE_F16 ? 0x1p-11 : 1e-6;
    double wmax = p < 1.0 ? (1.0 / (1.0 - p)) * (1 + slack) : 0.0;
    if (pr->has_weights) {
        const attn_tensor *w = &pr->weights.t;
        int64_t idx[ATTN_MAX_RANK] = {0}, n = attn_tensor_numel(w);
        for (int64_t i = 0; i < n; i++) {
            double x = fz_get(w, idx);
            FZ_ASSERT(x >= 0.0 && x <= wmax, "weight %g outside [0, %g]", x, wmax);
            for (int d = w->rank - 1; d >= 0; d--) {
                if (++idx[d] < w->shape[d]) break;
                idx[d] = 0;
            }
        }
    }
    if (pr->has_lse)
        FZ_ASSERT(fz_all_finite(&pr->lse.t, true), "lse is NaN or +inf for finite inputs");
    if (p == 1.0) {
        const attn_tensor *o = &pr->out.t;
        int64_t idx[ATTN_MAX_RANK] = {0}, n = attn_tensor_numel(o);
        for (int64_t i = 0; i < n; i++) {
            FZ_ASSERT(fz_get(o, idx) == 0.0, "dropout_p = 1 left a non-zero output");
            for (int d = o->rank - 1; d >= 0; d--) {
                if (++idx[d] < o->shape[d]) break;
                idx[d] = 0;
            }
        }
    }
}

/* The backward of a forward that succeeded (with lse): gradients shaped
 * like the inputs (sometimes perturbed: hostile shapes), dmask when the mask
 * is a float one. Must not leak or crash; finite for tame inputs. */
static void fuzz_backward(fz *f, problem *pr, const attn_sdpa_params *params, fz_values *vals) {
    fz_tensor dout, g[4];
    memset(&dout, 0, sizeof dout);
    memset(g, 0, sizeof g);
    int64_t shape[ATTN_MAX_RANK + 2];
    memcpy(shape, pr->out.t.shape, sizeof(int64_t) * (size_t)pr->out.t.rank);
    make(f, &dout, pr->out.t.dtype, pr->out.t.rank, shape, false, vals);
    const fz_tensor *like[4] = {&pr->q, &pr->k, &pr->v, &pr->mask};
    const bool want_dmask = pr->has_mask && pr->mask.t.dtype != ATTN_DTYPE_BOOL && fz_bool(f);
    bool backed = dout.backed;
    for (int i = 0; i < 4; i++) {
        if (i == 3 && !want_dmask) continue;
        if (i < 3 && fz_one_in(f, 8)) continue; /* a gradient not wanted */
        memcpy(shape, like[i]->t.shape, sizeof(int64_t) * (size_t)like[i]->t.rank);
        make(f, &g[i], like[i]->t.dtype, like[i]->t.rank, shape, true, vals);
        backed &= g[i].backed;
    }
    if (backed) {
        attn_status st = attn_sdpa_backward(
            &dout.t, &pr->q.t, &pr->k.t, &pr->v.t, &pr->out.t, &pr->lse.t, params,
            g[0].alloc ? &g[0].t : NULL, g[1].alloc ? &g[1].t : NULL,
            g[2].alloc ? &g[2].t : NULL, g[3].alloc ? &g[3].t : NULL);
        fz_check_status(st, "attn_sdpa_backward");
        FZ_ASSERT(fz_live_blocks() == 0, "attn_sdpa_backward leaked %ld blocks", fz_live_blocks());
        for (int i = 0; st == ATTN_OK && vals->tame && i < 4; i++)
            if (g[i].alloc)
                FZ_ASSERT(fz_all_finite(&g[i].t, false), "finite inputs gave a non-finite gradient");
    }
    fz_tensor_free(&dout);
    for (int i = 0; i < 4; i++) fz_tensor_free(&g[i]);
}

/* nbatch * L * S * (E + Ev) from the shapes, or -1 on overflow. */
static int64_t work_of(int out_rank, const int64_t *out_shape, const attn_tensor *k) {
    int64_t w = 1;
    for (int d = 0; d < out_rank - 1; d++)
        if (__builtin_mul_overflow(w, out_shape[d], &w)) return -1;
    int64_t S = k->shape[k->rank - 2], E = k->shape[k->rank - 1], Ev = out_shape[out_rank - 1];
    if (__builtin_mul_overflow(w, S, &w) || __builtin_mul_overflow(w, E + Ev, &w)) return -1;
    return w;
}

/* q, k, v: the dtypes (16-bit K/V under a float32 query sometimes: a
 * low-precision KV cache), batch dims, GQA heads, L, S, E, Ev. */
static void draw_operands(fz *f, problem *pr, fz_values *vals) {
    static const attn_dtype dts[4] = {ATTN_DTYPE_F32, ATTN_DTYPE_F64, ATTN_DTYPE_F16,
                                      ATTN_DTYPE_BF16};
    const attn_dtype dt = pr->dt = dts[fz_u8(f) % 4];
    const attn_dtype kvdt = dt == ATTN_DTYPE_F32 && fz_one_in(f, 4)
                                ? (fz_bool(f) ? ATTN_DTYPE_F16 : ATTN_DTYPE_BF16)
                                : dt;
    const int nb = pr->nb = (int)fz_range(f, 0, 3);
    for (int d = 0; d < nb; d++) pr->B[d] = fz_dim(f, 3, true);
    const bool gqa = nb >= 1 && fz_one_in(f, 3);
    int64_t Hkv = 0;
    if (gqa) {
        Hkv = fz_range(f, 1, 3);
        pr->B[nb - 1] = Hkv * fz_range(f, 1, 3);
    }
    pr->L = fz_dim(f, 6, true), pr->S = fz_dim(f, 6, true);
    const int64_t E = fz_dim(f, 5, true);
    pr->Ev = fz_dim(f, 5, true);
    pr->p.enable_gqa = gqa ? 1 : fz_one_in(f, 16);
    int64_t *shape = pr->shape;
    int r = operand_shape(f, shape, pr->B, nb, 0, pr->L, E);
    make(f, &pr->q, pick_dtype(f, dt), r, shape, false, vals);
    r = operand_shape(f, shape, pr->B, nb, Hkv, pr->S, E);
    make(f, &pr->k, pick_dtype(f, kvdt), r, shape, false, vals);
    r = operand_shape(f, shape, pr->B, nb, Hkv, pr->S, pr->Ev);
    make(f, &pr->v, pick_dtype(f, kvdt), r, shape, false, vals);
}

/* The mask (bool or float, broadcast against (B..., L, S)) and the scalars. */
static void draw_params(fz *f, problem *pr, fz_values *vals) {
    const uint8_t mk = fz_u8(f) % 4;
    if (mk != 0) {
        const attn_dtype mdt = mk == 1 ? ATTN_DTYPE_BOOL : mk == 2 ? pr->dt : ATTN_DTYPE_F64;
        const int mr = (int)fz_range(f, 1, pr->nb + 2);
        int64_t full[ATTN_MAX_RANK + 2], *shape = pr->shape;
        for (int d = 0; d < pr->nb; d++) full[d] = pr->B[d];
        full[pr->nb] = pr->L;
        full[pr->nb + 1] = pr->S;
        for (int d = 0; d < mr; d++) shape[d] = fz_one_in(f, 3) ? 1 : full[pr->nb + 2 - mr + d];
        make(f, &pr->mask, pick_dtype(f, mdt), mr, shape, false, vals);
        fz_sprinkle_neg_inf(f, &pr->mask);
        pr->has_mask = true;
        pr->p.attn_mask = &pr->mask.t;
    }
    const uint8_t c = fz_u8(f);
    pr->p.causal = c % 8 < 3   ? (attn_causal)(c % 8)
                   : c % 8 == 7 ? (attn_causal)(int)fz_range(f, -2, 9)
                                : ATTN_CAUSAL_NONE;
    pr->p.has_scale = fz_bool(f);
    if (pr->p.has_scale) pr->p.scale = pick_scale(f, vals);
    pr->p.dropout_p = pick_dropout(f);
    pr->p.seed = fz_u64(f);
    pr->p.rng_offset = fz_bool(f) ? fz_u64(f) : 0;
}

/* shape = (B..., L, cols). */
static void rows_shape(const problem *pr, int64_t *shape, int64_t cols) {
    for (int d = 0; d < pr->nb; d++) shape[d] = pr->B[d];
    shape[pr->nb] = pr->L;
    shape[pr->nb + 1] = cols;
}

/* Outputs: out (B..., L, Ev), weights (B..., L, S), lse (B..., L). */
static void draw_outputs(fz *f, problem *pr, fz_values *vals) {
    const int ob = pr->nb;
    const attn_dtype lsedt = pr->dt == ATTN_DTYPE_F64 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
    int64_t *shape = pr->shape; /* filled afresh for each: make may perturb it */
    rows_shape(pr, shape, pr->Ev);
    make(f, &pr->out, pick_dtype(f, pr->dt), ob + 2, shape, true, vals);
    pr->has_weights = fz_bool(f);
    if (pr->has_weights) {
        rows_shape(pr, shape, pr->S);
        make(f, &pr->weights, pick_dtype(f, pr->dt), ob + 2, shape, true, vals);
    }
    pr->has_lse = fz_bool(f);
    if (pr->has_lse) {
        for (int d = 0; d < ob; d++) shape[d] = pr->B[d];
        shape[ob] = pr->L; /* past it: what the last make left */
        make(f, &pr->lse, pick_dtype(f, lsedt), ob + 1, shape, true, vals);
    }
}

/* The call's arguments: the problem's, one maybe dropped (NULL). */
typedef struct call_args {
    const attn_tensor *q, *k, *v;
    attn_tensor *out;
    const attn_sdpa_params *params;
} call_args;

static call_args draw_args(fz *f, problem *pr) {
    call_args a = {&pr->q.t, &pr->k.t, &pr->v.t, &pr->out.t, &pr->p};
    if (fz_one_in(f, 24)) {
        switch (fz_u8(f) % 6) {
        case 0: a.q = NULL; break;
        case 1: a.k = NULL; break;
        case 2: a.v = NULL; break;
        case 3: a.out = NULL; break;
        case 4: a.params = NULL; break;
        default: pr->k.t.data = NULL; break;
        }
    }
    return a;
}

static attn_status call_sdpa(problem *pr, const call_args *a) {
    return attn_sdpa(a->q, a->k, a->v, a->params, a->out, pr->has_weights ? &pr->weights.t : NULL,
                     pr->has_lse ? &pr->lse.t : NULL);
}

/* attn_sdpa on backed views: it agrees with attn_sdpa_out_shape (status,
 * message, shape); a success's outputs are checked and its backward run. */
static void run_call(fz *f, problem *pr, const call_args *a, attn_status st_shape,
                     const char *shape_msg, int orank, const int64_t *oshape, fz_values *vals) {
    fz_hostile h;
    const fz_tensor *inputs[3] = {&pr->q, &pr->k, &pr->v};
    fz_hostile_begin(f, &h, a->out == NULL ? NULL : &pr->out, inputs[fz_u8(f) % 3]);
    const attn_status st = call_sdpa(pr, a);
    fz_hostile_end(&h, st);
    fz_check_status(st, "attn_sdpa");
    FZ_ASSERT(fz_live_blocks() == 0, "attn_sdpa leaked %ld blocks", fz_live_blocks());
    if (st_shape != ATTN_OK) {
        if (a->out == NULL) {
            FZ_ASSERT(st == ATTN_ERR_NULL, "out NULL gave %d", (int)st);
        } else {
            FZ_ASSERT(st == st_shape, "attn_sdpa gave %d, attn_sdpa_out_shape %d (%s)", (int)st,
                      (int)st_shape, shape_msg);
            FZ_ASSERT(strcmp(shape_msg, attn_last_error()) == 0, "messages differ: '%s' vs '%s'",
                      shape_msg, attn_last_error());
        }
    }
    if (st == ATTN_OK) {
        FZ_ASSERT(a->out->rank == orank, "out rank %d, out_shape said %d", a->out->rank, orank);
        for (int d = 0; d < orank; d++)
            FZ_ASSERT(a->out->shape[d] == oshape[d], "out dim %d differs from out_shape", d);
        check_outputs(pr, a->params ? a->params->dropout_p : 0.0, vals);
        if (pr->has_lse) fuzz_backward(f, pr, a->params, vals);
    }
}

/* Valid inputs too large to back: the reference kernel allocates its row
 * buffers before it reads anything, so with every allocation refused the
 * call must fail cleanly, without touching the PROT_NONE page the unbacked
 * views point at. This fuzzes output validation on extreme but legal views.
 * (Fused kernels may need no workspace, so this runs on the reference path
 * only.) */
static void run_without_memory(problem *pr, const call_args *a) {
    const size_t old = fz_set_alloc_limit(0);
    const attn_status st = call_sdpa(pr, a);
    fz_set_alloc_limit(old);
    fz_check_status(st, "attn_sdpa (no memory)");
    FZ_ASSERT(st != ATTN_OK, "attn_sdpa succeeded without memory");
    FZ_ASSERT(fz_live_blocks() == 0, "attn_sdpa leaked");
}

static void free_problem(problem *pr) {
    fz_tensor *all[] = {&pr->q, &pr->k, &pr->v, &pr->mask, &pr->out, &pr->weights, &pr->lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) fz_tensor_free(all[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz f = {data, size};
    fz_values vals = {true};
    fz_begin_attention(&f);
    if (fz_one_in(&f, 16)) fuzz_views(&f);

    problem pr;
    memset(&pr, 0, sizeof pr);
    attn_sdpa_params_init(&pr.p);
    draw_operands(&f, &pr, &vals);
    draw_params(&f, &pr, &vals);
    draw_outputs(&f, &pr, &vals);
    const call_args a = draw_args(&f, &pr);

    /* Shape inference: validation only, never touches data. */
    int orank = 0;
    int64_t oshape[ATTN_MAX_RANK];
    const attn_status st_shape = attn_sdpa_out_shape(a.q, a.k, a.v, a.params, &orank, oshape);
    fz_check_status(st_shape, "attn_sdpa_out_shape");
    FZ_ASSERT(fz_live_blocks() == 0, "attn_sdpa_out_shape leaked");
    char shape_msg[512];
    snprintf(shape_msg, sizeof shape_msg, "%s", attn_last_error());
    if (st_shape == ATTN_OK) {
        FZ_ASSERT(orank >= 2 && orank <= ATTN_MAX_RANK, "out rank %d", orank);
        for (int d = 0; d < orank; d++) FZ_ASSERT(oshape[d] >= 1, "out dim %d", d);
    }

    const bool backed = pr.q.backed && pr.k.backed && pr.v.backed && pr.out.backed &&
                        (!pr.has_mask || pr.mask.backed) &&
                        (!pr.has_weights || pr.weights.backed) && (!pr.has_lse || pr.lse.backed);
    const int64_t work = st_shape == ATTN_OK ? work_of(orank, oshape, a.k) : 0;
    if (st_shape != ATTN_OK || (backed && work >= 0 && work <= WORK_LIMIT))
        run_call(&f, &pr, &a, st_shape, shape_msg, orank, oshape, &vals);
    else if (attn_get_isa() == ATTN_ISA_REF)
        run_without_memory(&pr, &a);
    free_problem(&pr);
    return 0;
}
