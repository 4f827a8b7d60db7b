/*
 * test_alloc_fail.c — allocation-failure injection, SQLite-style.
 *
 * Through the public hook (attn_set_allocator), each scenario is run with
 * the n-th allocation failing, for n = 1, 2, ... until a run succeeds. Every
 * failed run must return ATTN_ERR_NOMEM with a message and leave no block
 * allocated (the hook counts the blocks it has live; LSan checks the
 * rest in the sanitizer tier). The run that finally succeeds must give
 * bit-for-bit the result of a run with the default allocator.
 *
 * Two modes: "transient" (only the n-th allocation fails) and "persistent"
 * (the n-th and every later one fail, as when memory stays exhausted).
 * The number of failure points walked per API is printed.
 */
#define _POSIX_C_SOURCE 200809L /* mkstemp */
#include <unistd.h>

#include "io/io.h" /* attn__is_float, attn__safetensors_open_read */
#include "testutil.h"

#ifndef ATTN_TEST_DATA
#error "ATTN_TEST_DATA must name tests/data"
#endif

static test_failer F; /* the allocator of the walk in progress (testutil.h) */

/* A scenario runs one API call sequence (creating and destroying whatever it
 * needs) and compares its outputs with `expect` when it succeeds. */
typedef struct scenario {
    const char *name;
    attn_status (*run)(void *state, bool compare);
    void *state;
} scenario;

/* Walks the failure points; returns how many were walked. */
static long walk(const scenario *s, bool persistent) {
    /* The default allocator's result is the reference. */
    attn_set_allocator(NULL);
    CHECK_OK(s->run(s->state, false));
    long n;
    for (n = 1; n < 10000; n++) {
        failer_install(&F, n, persistent);
        attn_status st = s->run(s->state, true);
        attn_set_allocator(NULL);
        CHECK(F.live == 0, "%s: failing allocation %ld leaks %ld blocks", s->name, n, F.live);
        if (st == ATTN_OK) {
            CHECK(F.failed == 0, "%s: allocation %ld failed but the call returned ATTN_OK",
                  s->name, n);
            break;
        }
        CHECK(st == ATTN_ERR_NOMEM, "%s: failing allocation %ld gave %s: %s", s->name, n,
              attn_strerror(st), attn_last_error());
        CHECK(attn_last_error()[0] != '\0', "%s: allocation %ld failed without a message",
              s->name, n);
        CHECK(F.failed > 0, "%s: failed without a failed allocation", s->name);
    }
    return n - 1;
}

/* ---- SDPA ---- */

typedef struct sdpa_state {
    test_tensor q, k, v, mask, out, weights, lse;
    attn_sdpa_params p;
    bool with_weights, with_lse;
    double *expect_out, *expect_w, *expect_lse;
} sdpa_state;

static bool same_dense(const attn_tensor *t, const double *expect) {
    double *x = tt_dense(t);
    bool same = memcmp(x, expect, sizeof(double) * (size_t)attn_tensor_numel(t)) == 0;
    free(x);
    return same;
}

static attn_status sdpa_run(void *state, bool compare) {
    sdpa_state *s = state;
    attn_status st = attn_sdpa(&s->q.t, &s->k.t, &s->v.t, &s->p, &s->out.t,
                               s->with_weights ? &s->weights.t : NULL,
                               s->with_lse ? &s->lse.t : NULL);
    if (st != ATTN_OK) return st;
    if (!compare) {
        free(s->expect_out);
        free(s->expect_w);
        free(s->expect_lse);
        s->expect_out = tt_dense(&s->out.t);
        s->expect_w = s->with_weights ? tt_dense(&s->weights.t) : NULL;
        s->expect_lse = s->with_lse ? tt_dense(&s->lse.t) : NULL;
    } else {
        CHECK(same_dense(&s->out.t, s->expect_out), "out differs after failure injection");
        if (s->with_weights)
            CHECK(same_dense(&s->weights.t, s->expect_w), "weights differ");
        if (s->with_lse) CHECK(same_dense(&s->lse.t, s->expect_lse), "lse differs");
    }
    return st;
}

static void sdpa_setup(sdpa_state *s, rng *r, attn_dtype dt, bool weights, bool lse, bool extras) {
    memset(s, 0, sizeof *s);
    int64_t qs[4] = {2, 4, 5, 8}, ks[4] = {2, extras ? 2 : 4, 7, 8}, vs[4] = {2, extras ? 2 : 4, 7, 6};
    int64_t os[4] = {2, 4, 5, 6}, ws[4] = {2, 4, 5, 7}, ms[2] = {5, 7};
    tt_make(&s->q, r, dt, 4, qs, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->k, r, dt, 4, ks, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->v, r, dt, 4, vs, LAYOUT_RANDOM, 1, 0);
    tt_make_output(&s->out, r, dt, 4, os, LAYOUT_RANDOM);
    tt_make_output(&s->weights, r, dt, 4, ws, LAYOUT_CONTIGUOUS);
    /* lse: the compute type (float32 for 16-bit operands) */
    tt_make_output(&s->lse, r, dt == ATTN_DTYPE_F64 ? dt : ATTN_DTYPE_F32, 3, os, LAYOUT_CONTIGUOUS);
    attn_sdpa_params_init(&s->p);
    if (extras) {
        tt_make(&s->mask, r, ATTN_DTYPE_BOOL, 2, ms, LAYOUT_RANDOM, 1, 0.7);
        s->p.attn_mask = &s->mask.t;
        s->p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
        s->p.enable_gqa = 1;
        s->p.dropout_p = 0.25;
        s->p.seed = 7;
    }
    s->with_weights = weights;
    s->with_lse = lse;
}

static void sdpa_teardown(sdpa_state *s) {
    tt_free(&s->q);
    tt_free(&s->k);
    tt_free(&s->v);
    tt_free(&s->mask);
    tt_free(&s->out);
    tt_free(&s->weights);
    tt_free(&s->lse);
    free(s->expect_out);
    free(s->expect_w);
    free(s->expect_lse);
}

/* ---- MHA: create + forward + destroy ---- */

typedef struct mha_state {
    attn_mha_config cfg;
    test_tensor query, key, value, kpm, mask, out, weights;
    attn_mha_forward_params fp;
    bool need_weights;
    double *expect_out, *expect_w;
} mha_state;

static attn_status mha_run(void *state, bool compare) {
    mha_state *s = state;
    attn_mha *m = NULL;
    attn_status st = attn_mha_create(&s->cfg, &m);
    if (st != ATTN_OK) {
        CHECK(m == NULL, "a failed create leaves a module");
        return st;
    }
    st = attn_mha_forward(m, &s->query.t, &s->key.t, &s->value.t, &s->fp, &s->out.t,
                          s->need_weights ? &s->weights.t : NULL);
    attn_mha_destroy(m);
    if (st != ATTN_OK) return st;
    if (!compare) {
        free(s->expect_out);
        free(s->expect_w);
        s->expect_out = tt_dense(&s->out.t);
        s->expect_w = s->need_weights ? tt_dense(&s->weights.t) : NULL;
    } else {
        CHECK(same_dense(&s->out.t, s->expect_out), "MHA out differs after failure injection");
        if (s->need_weights) CHECK(same_dense(&s->weights.t, s->expect_w), "MHA weights differ");
    }
    return st;
}

/* kind 0: packed projections, sequence-first, add_bias_kv + add_zero_attn
 *         (padded masks), bool key_padding_mask, float 2-D attn_mask,
 *         is_causal, averaged weights;
 * kind 1: kdim != vdim != E, batch_first, strided inputs (packed copies),
 *         a non-contiguous output, 3-D bool attn_mask, per-head weights,
 *         float64, dropout in training;
 * kind 2: unbatched, float key_padding_mask, add_zero_attn, causal, this
 *         call's own dropout (params.has_dropout) on a module without.
 * `half` (0: none) runs kind 0 or 2 as a float16 / bfloat16 module, whose
 * GEMMs allocate widened copies and float32 tiles. */
static void mha_setup(mha_state *s, rng *r, int kind, attn_dtype half) {
    memset(s, 0, sizeof *s);
    const int64_t N = 2, L = 4, S = 5, E = 8, H = 2;
    attn_mha_config_init(&s->cfg, E, H);
    s->cfg.init_seed = 11 + (uint64_t)kind;
    attn_mha_forward_params_init(&s->fp);
    s->need_weights = true;
    attn_dtype dt = half ? half : kind == 1 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
    s->cfg.dtype = dt;
    int64_t Sx = S;
    if (kind == 0) {
        s->cfg.add_bias_kv = s->cfg.add_zero_attn = 1;
        Sx = S + 2;
        int64_t qs[3] = {L, N, E}, ks[3] = {S, N, E}, kp[2] = {N, S}, am[2] = {L, S},
                ws[3] = {N, L, Sx};
        tt_make(&s->query, r, dt, 3, qs, LAYOUT_CONTIGUOUS, 1, 0);
        tt_make(&s->key, r, dt, 3, ks, LAYOUT_CONTIGUOUS, 1, 0);
        tt_make(&s->value, r, dt, 3, ks, LAYOUT_CONTIGUOUS, 1, 0);
        tt_make(&s->kpm, r, ATTN_DTYPE_BOOL, 2, kp, LAYOUT_RANDOM, 1, 0.3);
        tt_make(&s->mask, r, ATTN_DTYPE_F32, 2, am, LAYOUT_RANDOM, 1, 0);
        tt_make_output(&s->out, r, dt, 3, qs, LAYOUT_CONTIGUOUS);
        tt_make_output(&s->weights, r, dt, 3, ws, LAYOUT_RANDOM);
        s->fp.is_causal = 1;
    } else if (kind == 1) {
        s->cfg.kdim = 3;
        s->cfg.vdim = 5;
        s->cfg.batch_first = 1;
        s->cfg.dropout = 0.3;
        s->fp.training = 1;
        s->fp.seed = 5;
        s->fp.average_attn_weights = 0;
        int64_t qs[3] = {N, L, E}, ks[3] = {N, S, 3}, vs[3] = {N, S, 5}, am[3] = {N * H, L, S},
                ws[4] = {N, H, L, S};
        tt_make(&s->query, r, dt, 3, qs, LAYOUT_RANDOM, 1, 0);
        tt_make(&s->key, r, dt, 3, ks, LAYOUT_RANDOM, 1, 0);
        tt_make(&s->value, r, dt, 3, vs, LAYOUT_RANDOM, 1, 0);
        tt_make(&s->mask, r, ATTN_DTYPE_BOOL, 3, am, LAYOUT_RANDOM, 1, 0.2);
        tt_make_output(&s->out, r, dt, 3, qs, LAYOUT_CONTIGUOUS);
        s->out.t.strides[2] = -1; /* reversed features: never the direct GEMM path */
        s->out.t.data = (char *)s->out.t.data + (E - 1) * (int64_t)attn_dtype_size(dt);
        tt_make_output(&s->weights, r, dt, 4, ws, LAYOUT_RANDOM);
    } else {
        s->cfg.add_zero_attn = 1;
        Sx = S + 1;
        int64_t qs[2] = {L, E}, ks[2] = {S, E}, kp[1] = {S}, ws[2] = {L, Sx};
        tt_make(&s->query, r, dt, 2, qs, LAYOUT_RANDOM, 1, 0);
        tt_make(&s->key, r, dt, 2, ks, LAYOUT_RANDOM, 1, 0);
        tt_make(&s->value, r, dt, 2, ks, LAYOUT_RANDOM, 1, 0);
        tt_make(&s->kpm, r, ATTN_DTYPE_F64, 1, kp, LAYOUT_RANDOM, 1, 0);
        tt_make_output(&s->out, r, dt, 2, qs, LAYOUT_RANDOM);
        tt_make_output(&s->weights, r, dt, 2, ws, LAYOUT_RANDOM);
        s->fp.is_causal = 1;
        s->fp.training = 1;
        s->fp.has_dropout = 1;
        s->fp.dropout = 0.4;
    }
    if (s->kpm.storage) s->fp.key_padding_mask = &s->kpm.t;
    if (s->mask.storage) s->fp.attn_mask = &s->mask.t;
}

static void mha_teardown(mha_state *s) {
    tt_free(&s->query);
    tt_free(&s->key);
    tt_free(&s->value);
    tt_free(&s->kpm);
    tt_free(&s->mask);
    tt_free(&s->out);
    tt_free(&s->weights);
    free(s->expect_out);
    free(s->expect_w);
}

/* ---- .npy ---- */

typedef struct npy_state {
    char path[512];
    unsigned char *bytes;
    size_t size;
    bool parse; /* attn_npy_parse on bytes, else attn_npy_load on path */
    double *expect;
} npy_state;

static attn_status npy_run(void *state, bool compare) {
    npy_state *s = state;
    attn_tensor t;
    attn_status st = s->parse ? attn_npy_parse(s->bytes, s->size, &t) : attn_npy_load(s->path, &t);
    if (st != ATTN_OK) {
        CHECK(t.data == NULL, "a failed read leaves data");
        return st;
    }
    if (!compare) {
        free(s->expect);
        s->expect = tt_dense(&t);
    } else {
        CHECK(same_dense(&t, s->expect), "the array differs after failure injection");
    }
    attn_npy_free(&t);
    return st;
}

static void npy_setup(npy_state *s, const char *fixture, bool parse) {
    memset(s, 0, sizeof *s);
    snprintf(s->path, sizeof s->path, "%s/npy/%s.npy", ATTN_TEST_DATA, fixture);
    s->parse = parse;
    FILE *f = fopen(s->path, "rb");
    CHECK(f != NULL, "cannot open %s", s->path);
    if (f == NULL) return;
    s->bytes = malloc(1 << 16);
    s->size = fread(s->bytes, 1, 1 << 16, f);
    fclose(f);
}

/* ---- safetensors ---- */

typedef struct st_state {
    char path[512], out[64];
    unsigned char *bytes;
    size_t size;
    int how; /* 0 open + read every tensor, 1 parse + read, 2 save, 3 open without mmap */
    unsigned char *expect;
    size_t expect_size;
} st_state;

/* Every tensor attn reads, as float64 (bool and the rest: their own). */
static attn_status st_read_all(attn_safetensors *f, unsigned char **sum, size_t *n) {
    *sum = NULL;
    *n = 0;
    for (int64_t i = 0; i < attn_safetensors_count(f); i++) {
        const char *name;
        attn_dtype dt;
        attn_safetensors_info(f, i, &name, NULL, &dt, NULL, NULL);
        if (dt == 0) continue;
        attn_tensor t;
        attn_status st = attn_safetensors_read(f, name, attn__is_float(dt) ? ATTN_DTYPE_F64 : 0, &t);
        if (st != ATTN_OK) {
            CHECK(t.data == NULL, "a failed read leaves data");
            free(*sum);
            *sum = NULL;
            return st;
        }
        int64_t numel = 1;
        for (int d = 0; d < t.rank; d++) numel *= t.shape[d];
        const size_t bytes = (size_t)numel * attn_dtype_size(t.dtype);
        *sum = realloc(*sum, *n + bytes + 1);
        memcpy(*sum + *n, t.data, bytes);
        *n += bytes;
        attn_safetensors_free(&t);
    }
    return ATTN_OK;
}

static attn_status st_run(void *state, bool compare) {
    st_state *s = state;
    attn_safetensors *f = (attn_safetensors *)s; /* must come back NULL on failure */
    attn_status st = s->how == 1   ? attn_safetensors_parse(s->bytes, s->size, &f)
                     : s->how == 3 ? attn__safetensors_open_read(s->path, &f)
                                   : attn_safetensors_open(s->path, &f);
    if (st != ATTN_OK) {
        CHECK(f == NULL, "a failed open leaves a handle");
        return st;
    }
    unsigned char *sum = NULL;
    size_t n = 0;
    if (s->how != 2) {
        st = st_read_all(f, &sum, &n);
    } else { /* save every tensor attn reads, as views, with metadata */
        const char *names[64];
        attn_tensor views[64];
        size_t count = 0;
        for (int64_t i = 0; i < attn_safetensors_count(f) && count < 64; i++) {
            attn_dtype dt;
            attn_safetensors_info(f, i, &names[count], NULL, &dt, NULL, NULL);
            if (dt != 0 && attn_safetensors_get(f, names[count], &views[count]) == ATTN_OK) count++;
        }
        const char *meta[] = {"format", "pt", NULL};
        st = attn_safetensors_save(s->out, count, names, views, meta);
        if (st == ATTN_OK) sum = tt_read_file(s->out, &n);
    }
    attn_safetensors_close(f);
    if (st != ATTN_OK) return st;
    if (!compare) {
        free(s->expect);
        s->expect = sum;
        s->expect_size = n;
        return st;
    }
    CHECK(n == s->expect_size && memcmp(sum, s->expect, n) == 0,
          "the tensors differ after failure injection");
    free(sum);
    return st;
}

/* ---- the walks ---- */

static void report(const char *name, long transient, long persistent) {
    printf("  %-42s %3ld failure points (transient), %3ld (persistent)\n", name, transient,
           persistent);
}

static void run_scenario(const scenario *s) {
    long a = walk(s, false), b = walk(s, true);
    CHECK(a >= 1, "%s: no allocation to fail", s->name);
    CHECK(a == b, "%s: %ld transient vs %ld persistent failure points", s->name, a, b);
    report(s->name, a, b);
}

static void st_failures(void) {
    const char *files[2] = {"numpy.safetensors", "torch_bf16.safetensors"};
    const char *hows[4] = {"attn_safetensors_open+read", "attn_safetensors_parse+read",
                           "attn_safetensors_save", "open without mmap+read"};
    for (int i = 0; i < 2; i++)
        for (int how = 0; how < 4; how++) {
            st_state st;
            memset(&st, 0, sizeof st);
            snprintf(st.path, sizeof st.path, "%s/safetensors/%s", ATTN_TEST_DATA, files[i]);
            snprintf(st.out, sizeof st.out, "/tmp/attn_alloc_fail_XXXXXX");
            close(mkstemp(st.out));
            st.how = how;
            st.bytes = tt_read_file(st.path, &st.size);
            char name[96];
            snprintf(name, sizeof name, "%s (%s)", hows[how], files[i]);
            scenario s = {name, st_run, &st};
            run_scenario(&s);
            free(st.bytes);
            free(st.expect);
            remove(st.out);
        }
}

static void sdpa_failures(void) {
    rng r = {harness_seed() ^ 0xa110c};
    struct {
        const char *name;
        attn_dtype dt;
        bool weights, lse, extras;
    } cases[] = {
        {"attn_sdpa (f32, out only)", ATTN_DTYPE_F32, false, false, false},
        {"attn_sdpa (f64, weights + lse)", ATTN_DTYPE_F64, true, true, false},
        {"attn_sdpa (mask, causal, gqa, dropout)", ATTN_DTYPE_F32, true, true, true},
        {"attn_sdpa (bf16, weights + lse, mask, causal, gqa, dropout)", ATTN_DTYPE_BF16, true,
         true, true},
        {"attn_sdpa (f16, out only)", ATTN_DTYPE_F16, false, false, false},
    };
    attn_isa paths[8];
    int npaths = 0;
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++)
        if (attn_isa_supported((attn_isa)i)) paths[npaths++] = (attn_isa)i;
    for (int pi = 0; pi < npaths; pi++) {
        CHECK_OK(attn_set_isa(paths[pi]));
        printf(" path %s:\n", attn_isa_name(paths[pi]));
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            sdpa_state st;
            sdpa_setup(&st, &r, cases[i].dt, cases[i].weights, cases[i].lse, cases[i].extras);
            scenario s = {cases[i].name, sdpa_run, &st};
            run_scenario(&s);
            sdpa_teardown(&st);
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- attn_sdpa_backward ---- */

typedef struct bwd_state {
    test_tensor q, k, v, mask, out, lse, dout, grad[4]; /* dq, dk, dv, dmask */
    attn_sdpa_params p;
    double *expect[4];
} bwd_state;

static attn_status bwd_run(void *state, bool compare) {
    bwd_state *s = state;
    attn_status st = attn_sdpa_backward(&s->dout.t, &s->q.t, &s->k.t, &s->v.t, &s->out.t,
                                        &s->lse.t, &s->p, &s->grad[0].t, &s->grad[1].t,
                                        &s->grad[2].t, &s->grad[3].t);
    if (st != ATTN_OK) return st;
    for (int g = 0; g < 4; g++) {
        if (!compare) {
            free(s->expect[g]);
            s->expect[g] = tt_dense(&s->grad[g].t);
        } else {
            CHECK(same_dense(&s->grad[g].t, s->expect[g]), "gradient %d differs", g);
        }
    }
    return st;
}

/* q (B, H, L, E) against K/V broadcast over the batch (the folded path), a
 * float mask with its gradient, causal, dropout: every buffer the backward
 * allocates. `long_keys`: one head and many keys (dq partial sums). */
static void bwd_setup(bwd_state *s, rng *r, attn_dtype dt, bool long_keys) {
    memset(s, 0, sizeof *s);
    const int64_t S = long_keys ? 2100 : 9, H = long_keys ? 1 : 2;
    const int64_t qs[4] = {2, H, 6, 8}, ks[4] = {1, H, S, 8}, vs[4] = {1, H, S, 5},
                  os[4] = {2, H, 6, 5}, ms[2] = {6, S};
    tt_make(&s->q, r, dt, 4, qs, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->k, r, dt, 4, ks, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->v, r, dt, 4, vs, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->mask, r, dt, 2, ms, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->dout, r, dt, 4, os, LAYOUT_RANDOM, 1, 0);
    tt_make_output(&s->out, r, dt, 4, os, LAYOUT_RANDOM);
    tt_make_output(&s->lse, r, dt == ATTN_DTYPE_F64 ? dt : ATTN_DTYPE_F32, 3, os, LAYOUT_RANDOM);
    const int64_t *shapes[4] = {qs, ks, vs, ms};
    const int ranks[4] = {4, 4, 4, 2};
    for (int g = 0; g < 4; g++)
        tt_make_output(&s->grad[g], r, dt, ranks[g], shapes[g], LAYOUT_RANDOM);
    attn_sdpa_params_init(&s->p);
    s->p.attn_mask = &s->mask.t;
    s->p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    s->p.dropout_p = 0.25;
    s->p.seed = 99;
    CHECK_OK(attn_sdpa(&s->q.t, &s->k.t, &s->v.t, &s->p, &s->out.t, NULL, &s->lse.t));
}

static void bwd_teardown(bwd_state *s) {
    test_tensor *all[7] = {&s->q, &s->k, &s->v, &s->mask, &s->out, &s->lse, &s->dout};
    for (int i = 0; i < 7; i++) tt_free(all[i]);
    for (int g = 0; g < 4; g++) {
        tt_free(&s->grad[g]);
        free(s->expect[g]);
    }
}

static void backward_failures(void) {
    rng r = {harness_seed() ^ 0xbacc};
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++) {
        if (!attn_isa_supported((attn_isa)i)) continue;
        CHECK_OK(attn_set_isa((attn_isa)i));
        printf(" path %s:\n", attn_isa_name((attn_isa)i));
        for (int kind = 0; kind < 3; kind++) { /* f64 folded, f32 long keys, bf16 folded */
            static const char *const names[3] = {"attn_sdpa_backward (f64, folded K/V, dmask)",
                                                 "attn_sdpa_backward (f32, 2100 keys)",
                                                 "attn_sdpa_backward (bf16, folded K/V, dmask)"};
            static const attn_dtype dts[3] = {ATTN_DTYPE_F64, ATTN_DTYPE_F32, ATTN_DTYPE_BF16};
            bwd_state st;
            bwd_setup(&st, &r, dts[kind], kind == 1);
            scenario s = {names[kind], bwd_run, &st};
            run_scenario(&s);
            bwd_teardown(&st);
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- serving: attn_sdpa_varlen and attn_sdpa_kvcache ---- */

/* Three sequences (one empty), Hq = 4 over Hkv = 2, E = 8, Ev = 6:
 * varlen packs them; the KV cache holds 5, 0 and 9 rows and gets 2 more
 * per sequence, contiguous (float32) or paged (float16, blocks of 4); or,
 * long, 2,500, 0 and 3,000 rows of a contiguous cache, which the decode
 * splits into key chunks merged by lse (their partial buffers allocated). */
typedef struct serving_state {
    bool kvcache, paged;
    test_tensor q, k, v, out, lse;      /* varlen: packed; kvcache: q, new k, v, out, lse */
    int32_t cu_q[4], cu_k[4], seqlens[3], table[9];
    attn_tensor tcu_q, tcu_k, tseq, ttable, kc, vc;
    void *kc_buf, *vc_buf;
    float alibi[4];
    attn_tensor talibi;
    attn_sdpa_params p;
    double *expect_out, *expect_lse;
} serving_state;

static attn_status serving_run(void *state, bool compare) {
    serving_state *s = state;
    /* A kvcache call writes its new rows first, the same bytes every run
     * (cache_seqlens is not advanced), so runs compare like attn_sdpa's. */
    attn_status st =
        s->kvcache
            ? attn_sdpa_kvcache(&s->q.t, &s->kc, &s->vc, &s->k.t, &s->v.t, &s->tseq,
                                s->paged ? &s->ttable : NULL, &s->p, &s->out.t, &s->lse.t)
            : attn_sdpa_varlen(&s->q.t, &s->k.t, &s->v.t, &s->tcu_q, &s->tcu_k, 9, 12, &s->p,
                               &s->out.t, &s->lse.t);
    if (st != ATTN_OK) return st;
    if (!compare) {
        free(s->expect_out);
        free(s->expect_lse);
        s->expect_out = tt_dense(&s->out.t);
        s->expect_lse = tt_dense(&s->lse.t);
    } else {
        CHECK(same_dense(&s->out.t, s->expect_out), "out differs after failure injection");
        CHECK(same_dense(&s->lse.t, s->expect_lse), "lse differs after failure injection");
    }
    return st;
}

/* A cache (B or blocks, rows, 2, E) of dtype dt over a new buffer, every
 * element drawn (rows past the filled ones are never read). */
static void *serving_cache(attn_tensor *t, rng *r, attn_dtype dt, int64_t n0, int64_t n1,
                           int64_t E) {
    const int64_t shape[4] = {n0, n1, 2, E}, n = n0 * n1 * 2 * E;
    void *buf = malloc((size_t)n * attn_dtype_size(dt));
    attn_tensor_init(t, buf, dt, 4, shape);
    for (int64_t i = 0; i < n; i++) {
        const float x = (float)rng_normal(r);
        if (dt == ATTN_DTYPE_F16)
            ((uint16_t *)buf)[i] = attn__float_to_f16(x);
        else
            ((float *)buf)[i] = x;
    }
    return buf;
}

static void serving_setup(serving_state *s, rng *r, bool kvcache, bool paged, bool modifiers,
                          bool long_cache) {
    memset(s, 0, sizeof *s);
    s->kvcache = kvcache;
    s->paged = paged;
    attn_sdpa_params_init(&s->p);
    s->p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    if (modifiers) {
        for (int h = 0; h < 4; h++) s->alibi[h] = 0.25f * (float)(h + 1);
        const int64_t hs = 4;
        attn_tensor_init(&s->talibi, s->alibi, ATTN_DTYPE_F32, 1, &hs);
        s->p.alibi_slopes = &s->talibi;
        s->p.window_left = 3;
        s->p.softcap = 2.0;
    }
    const attn_dtype dt = ATTN_DTYPE_F32;
    if (!kvcache) {
        const int32_t cu_q[4] = {0, 5, 5, 14}, cu_k[4] = {0, 7, 10, 22};
        memcpy(s->cu_q, cu_q, sizeof cu_q);
        memcpy(s->cu_k, cu_k, sizeof cu_k);
        const int64_t nb = 4, qs[3] = {14, 4, 8}, ks[3] = {22, 2, 8}, vs[3] = {22, 2, 6},
                      os[3] = {14, 4, 6}, ls[2] = {4, 14};
        attn_tensor_init(&s->tcu_q, s->cu_q, ATTN_DTYPE_I32, 1, &nb);
        attn_tensor_init(&s->tcu_k, s->cu_k, ATTN_DTYPE_I32, 1, &nb);
        tt_make(&s->q, r, dt, 3, qs, LAYOUT_RANDOM, 1, 0);
        tt_make(&s->k, r, dt, 3, ks, LAYOUT_RANDOM, 1, 0);
        tt_make(&s->v, r, dt, 3, vs, LAYOUT_RANDOM, 1, 0);
        tt_make_output(&s->out, r, dt, 3, os, LAYOUT_RANDOM);
        tt_make_output(&s->lse, r, ATTN_DTYPE_F64, 2, ls, LAYOUT_RANDOM);
        return;
    }
    const int32_t seqlens[3] = {5, 0, 9}, table[9] = {6, 2, -1, 0, -1, -1, 5, 1, 3};
    const int32_t long_lens[3] = {2500, 0, 3000};
    memcpy(s->seqlens, long_cache ? long_lens : seqlens, sizeof seqlens);
    memcpy(s->table, table, sizeof table);
    const int64_t B = 3, ts[2] = {3, 3}, qs[4] = {3, 2, 4, 8}, ks[4] = {3, 2, 2, 8},
                  vs[4] = {3, 2, 2, 6}, os[4] = {3, 2, 4, 6}, ls[3] = {3, 4, 2};
    attn_tensor_init(&s->tseq, s->seqlens, ATTN_DTYPE_I32, 1, &B);
    attn_tensor_init(&s->ttable, s->table, ATTN_DTYPE_I32, 2, ts);
    const attn_dtype cdt = paged ? ATTN_DTYPE_F16 : dt;
    const int64_t rows = paged ? 4 : long_cache ? 3100 : 16;
    s->kc_buf = serving_cache(&s->kc, r, cdt, paged ? 7 : 3, rows, 8);
    s->vc_buf = serving_cache(&s->vc, r, cdt, paged ? 7 : 3, rows, 6);
    tt_make(&s->q, r, dt, 4, qs, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->k, r, dt, 4, ks, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->v, r, dt, 4, vs, LAYOUT_RANDOM, 1, 0);
    tt_make_output(&s->out, r, dt, 4, os, LAYOUT_RANDOM);
    tt_make_output(&s->lse, r, dt, 3, ls, LAYOUT_RANDOM);
}

static void serving_teardown(serving_state *s) {
    test_tensor *all[5] = {&s->q, &s->k, &s->v, &s->out, &s->lse};
    for (int i = 0; i < 5; i++) tt_free(all[i]);
    free(s->kc_buf);
    free(s->vc_buf);
    free(s->expect_out);
    free(s->expect_lse);
}

static void serving_failures(void) {
    rng r = {harness_seed() ^ 0x5e7};
    const struct {
        const char *name;
        bool kvcache, paged, modifiers, long_cache;
    } cases[] = {
        {"attn_sdpa_varlen (f32, lse)", false, false, false, false},
        {"attn_sdpa_varlen (window, ALiBi, softcap)", false, false, true, false},
        {"attn_sdpa_kvcache (contiguous, append)", true, false, false, false},
        {"attn_sdpa_kvcache (paged f16, ALiBi)", true, true, true, false},
        {"attn_sdpa_kvcache (long: key chunks)", true, false, false, true},
    };
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++) {
        if (!attn_isa_supported((attn_isa)i)) continue;
        CHECK_OK(attn_set_isa((attn_isa)i));
        printf(" path %s:\n", attn_isa_name((attn_isa)i));
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            serving_state st;
            serving_setup(&st, &r, cases[c].kvcache, cases[c].paged, cases[c].modifiers,
                          cases[c].long_cache);
            scenario s = {cases[c].name, serving_run, &st};
            run_scenario(&s);
            serving_teardown(&st);
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- serving: attn_sdpa_varlen_backward ---- */

/* Four sequences packed as attn_sdpa_varlen takes them, one with queries and
 * no keys, one with keys and no queries, and rows past the last offset in
 * every operand (their gradients are 0); or, long, two sequences of which
 * one has 2,100 keys over one head (dq's partial sums per key chunk). out
 * and lse come from the forward (lse_for_backward) on the path walked. */
typedef struct vbwd_state {
    test_tensor q, k, v, out, lse, dout, grad[3]; /* dq, dk, dv */
    bool has[3];                                  /* which gradients the call asks for */
    int32_t cu_q[5], cu_k[5];
    attn_tensor tcu_q, tcu_k;
    int64_t max_q, max_k;
    float alibi[4];
    attn_tensor talibi;
    attn_sdpa_params p;
    double *expect[3];
} vbwd_state;

static attn_status vbwd_run(void *state, bool compare) {
    vbwd_state *s = state;
    /* The reference run starts from zeros, every later one from a sentinel:
     * the call that succeeds must write every element of a gradient (rows
     * no sequence holds and keys no query sees get 0), whatever the failed
     * calls before it left there. */
    for (int g = 0; g < 3; g++)
        if (s->has[g]) tt_fill(&s->grad[g].t, compare ? 7.25 : 0.0);
    attn_status st = attn_sdpa_varlen_backward(
        &s->dout.t, &s->q.t, &s->k.t, &s->v.t, &s->out.t, &s->lse.t, &s->tcu_q, &s->tcu_k,
        s->max_q, s->max_k, &s->p, s->has[0] ? &s->grad[0].t : NULL,
        s->has[1] ? &s->grad[1].t : NULL, s->has[2] ? &s->grad[2].t : NULL);
    if (st != ATTN_OK) return st;
    for (int g = 0; g < 3; g++) {
        if (!s->has[g]) continue;
        if (!compare) {
            free(s->expect[g]);
            s->expect[g] = tt_dense(&s->grad[g].t);
        } else {
            CHECK(same_dense(&s->grad[g].t, s->expect[g]),
                  "varlen gradient %d differs after failure injection", g);
        }
    }
    return st;
}

/* Hq query heads over Hkv key/value heads, E = 8, Ev = 6; lse in lse_dt;
 * `grads` a bit mask of dq (1), dk (2), dv (4); dropout 0.25 or none;
 * `mods`: a window, ALiBi and soft-capping. */
static void vbwd_setup(vbwd_state *s, rng *r, attn_dtype dt, attn_dtype lse_dt, int64_t Hq,
                       int64_t Hkv, int grads, double dropout_p, bool mods, bool long_keys) {
    memset(s, 0, sizeof *s);
    int64_t B;
    if (long_keys) {
        const int32_t cu_q[3] = {0, 6, 9}, cu_k[3] = {0, 2100, 2105};
        B = 2;
        memcpy(s->cu_q, cu_q, sizeof cu_q);
        memcpy(s->cu_k, cu_k, sizeof cu_k);
        s->max_q = 6;
        s->max_k = 2100;
    } else {
        const int32_t cu_q[5] = {0, 5, 5, 9, 14}, cu_k[5] = {0, 7, 10, 10, 22};
        B = 4;
        memcpy(s->cu_q, cu_q, sizeof cu_q);
        memcpy(s->cu_k, cu_k, sizeof cu_k);
        s->max_q = 6; /* above the longest, as a caller may round them */
        s->max_k = 12;
    }
    const int64_t nb = B + 1, total_q = s->cu_q[B] + 2, total_k = s->cu_k[B] + 3;
    const int64_t qs[3] = {total_q, Hq, 8}, ks[3] = {total_k, Hkv, 8}, vs[3] = {total_k, Hkv, 6},
                  os[3] = {total_q, Hq, 6}, ls[2] = {Hq, total_q};
    attn_tensor_init(&s->tcu_q, s->cu_q, ATTN_DTYPE_I32, 1, &nb);
    attn_tensor_init(&s->tcu_k, s->cu_k, ATTN_DTYPE_I32, 1, &nb);
    tt_make(&s->q, r, dt, 3, qs, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->k, r, dt, 3, ks, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->v, r, dt, 3, vs, LAYOUT_RANDOM, 1, 0);
    tt_make(&s->dout, r, dt, 3, os, LAYOUT_RANDOM, 1, 0);
    tt_make_output(&s->out, r, dt, 3, os, LAYOUT_RANDOM);
    tt_make_output(&s->lse, r, lse_dt, 2, ls, LAYOUT_RANDOM);
    const int64_t *shapes[3] = {qs, ks, vs};
    for (int g = 0; g < 3; g++) {
        s->has[g] = (grads >> g & 1) != 0;
        if (s->has[g]) tt_make_output(&s->grad[g], r, dt, 3, shapes[g], LAYOUT_RANDOM);
    }
    attn_sdpa_params_init(&s->p);
    s->p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    s->p.dropout_p = dropout_p;
    s->p.seed = 41;
    if (mods) {
        for (int64_t h = 0; h < Hq; h++) s->alibi[h] = 0.25f * (float)(h + 1);
        attn_tensor_init(&s->talibi, s->alibi, ATTN_DTYPE_F32, 1, &Hq);
        s->p.alibi_slopes = &s->talibi;
        s->p.window_left = 3;
        s->p.softcap = 2.0;
    }
    attn_sdpa_params fwd = s->p;
    fwd.lse_for_backward = 1;
    CHECK_OK(attn_sdpa_varlen(&s->q.t, &s->k.t, &s->v.t, &s->tcu_q, &s->tcu_k, s->max_q,
                              s->max_k, &fwd, &s->out.t, &s->lse.t));
}

static void vbwd_teardown(vbwd_state *s) {
    test_tensor *all[6] = {&s->q, &s->k, &s->v, &s->out, &s->lse, &s->dout};
    for (int i = 0; i < 6; i++) tt_free(all[i]);
    for (int g = 0; g < 3; g++) {
        tt_free(&s->grad[g]);
        free(s->expect[g]);
    }
}

static void varlen_backward_failures(void) {
    rng r = {harness_seed() ^ 0x7a1b};
    const struct {
        const char *name;
        attn_dtype dt, lse_dt;
        int64_t Hq, Hkv;
        int grads;
        double dropout_p;
        bool mods, long_keys;
    } cases[] = {
        {"attn_sdpa_varlen_backward (f32)", ATTN_DTYPE_F32, ATTN_DTYPE_F32, 2, 2, 7, 0, false,
         false},
        {"attn_sdpa_varlen_backward (f64)", ATTN_DTYPE_F64, ATTN_DTYPE_F64, 2, 2, 7, 0, false,
         false},
        {"attn_sdpa_varlen_backward (f32, gqa, dropout)", ATTN_DTYPE_F32, ATTN_DTYPE_F64, 4, 2, 7,
         0.25, false, false},
        {"attn_sdpa_varlen_backward (f64, gqa, dropout, window, ALiBi, softcap)", ATTN_DTYPE_F64,
         ATTN_DTYPE_F64, 4, 2, 7, 0.25, true, false},
        {"attn_sdpa_varlen_backward (f32, gqa, dk + dv only)", ATTN_DTYPE_F32, ATTN_DTYPE_F32, 4,
         1, 6, 0, false, false},
        {"attn_sdpa_varlen_backward (f32, dq only)", ATTN_DTYPE_F32, ATTN_DTYPE_F32, 2, 2, 1, 0,
         false, false},
        {"attn_sdpa_varlen_backward (bf16, gqa, dropout)", ATTN_DTYPE_BF16, ATTN_DTYPE_F32, 4, 2,
         7, 0.25, false, false},
        {"attn_sdpa_varlen_backward (f32, 2100 keys, dropout)", ATTN_DTYPE_F32, ATTN_DTYPE_F32, 1,
         1, 7, 0.25, false, true},
        {"attn_sdpa_varlen_backward (f64, 2100 keys)", ATTN_DTYPE_F64, ATTN_DTYPE_F64, 1, 1, 7, 0,
         false, true},
    };
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++) {
        if (!attn_isa_supported((attn_isa)i)) continue;
        CHECK_OK(attn_set_isa((attn_isa)i));
        printf(" path %s:\n", attn_isa_name((attn_isa)i));
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            vbwd_state st;
            vbwd_setup(&st, &r, cases[c].dt, cases[c].lse_dt, cases[c].Hq, cases[c].Hkv,
                       cases[c].grads, cases[c].dropout_p, cases[c].mods, cases[c].long_keys);
            scenario s = {cases[c].name, vbwd_run, &st};
            run_scenario(&s);
            vbwd_teardown(&st);
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- serving: attn_sdpa_varlen_sinks_backward ---- */

/* vbwd_state's batch with sinks (Hq,) in the forward, and their gradient. */
typedef struct vsink_state {
    vbwd_state b;
    double sinks[4], dsinks[4], expect[4];
    attn_tensor tsinks, tdsinks;
} vsink_state;

static attn_status vsink_run(void *state, bool compare) {
    vsink_state *s = state;
    for (int h = 0; h < 4; h++) s->dsinks[h] = compare ? 7.25 : 0.0;
    attn_status st = attn_sdpa_varlen_sinks_backward(&s->b.dout.t, &s->b.out.t, &s->b.lse.t,
                                                     &s->b.tcu_q, &s->b.p, &s->tdsinks);
    if (st != ATTN_OK) return st;
    for (int64_t h = 0; h < s->tdsinks.shape[0]; h++) {
        if (!compare) s->expect[h] = s->dsinks[h];
        else CHECK(s->dsinks[h] == s->expect[h], "dsinks[%lld] differs after failure injection",
                   (long long)h);
    }
    return st;
}

static void varlen_sinks_failures(void) {
    rng r = {harness_seed() ^ 0x51f};
    vsink_state st;
    vbwd_setup(&st.b, &r, ATTN_DTYPE_F32, ATTN_DTYPE_F64, 4, 2, 0, 0, false, false);
    for (int h = 0; h < 4; h++) st.sinks[h] = 0.5 * h - 1;
    const int64_t Hq = 4;
    attn_tensor_init(&st.tsinks, st.sinks, ATTN_DTYPE_F64, 1, &Hq);
    attn_tensor_init(&st.tdsinks, st.dsinks, ATTN_DTYPE_F64, 1, &Hq);
    st.b.p.sinks = &st.tsinks;
    attn_sdpa_params fwd = st.b.p; /* the forward again, with the sinks */
    fwd.lse_for_backward = 1;
    CHECK_OK(attn_sdpa_varlen(&st.b.q.t, &st.b.k.t, &st.b.v.t, &st.b.tcu_q, &st.b.tcu_k,
                              st.b.max_q, st.b.max_k, &fwd, &st.b.out.t, &st.b.lse.t));
    scenario s = {"attn_sdpa_varlen_sinks_backward", vsink_run, &st};
    run_scenario(&s);
    vbwd_teardown(&st.b);
}

static void mha_failures(void) {
    rng r = {harness_seed() ^ 0x3a};
    const char *names[5] = {"attn_mha_create+forward (padded masks)",
                            "attn_mha_create+forward (kdim/vdim, 3-D)",
                            "attn_mha_create+forward (unbatched)",
                            "attn_mha_create+forward (padded masks, float16)",
                            "attn_mha_create+forward (unbatched, bfloat16)"};
    for (int kind = 0; kind < 5; kind++) {
        mha_state st;
        mha_setup(&st, &r, kind == 3 ? 0 : kind == 4 ? 2 : kind,
                  kind == 3 ? ATTN_DTYPE_F16 : kind == 4 ? ATTN_DTYPE_BF16 : (attn_dtype)0);
        scenario s = {names[kind], mha_run, &st};
        run_scenario(&s);
        mha_teardown(&st);
    }
}

/* ---- encoder layer: create + forward (post-norm, masks) + destroy ---- */

typedef struct encoder_state {
    test_tensor src, out, kpm;
    attn_encoder_forward_params fp;
    int norm_first;
    attn_dtype dtype;
    double *expect;
} encoder_state;

static attn_status encoder_run(void *state, bool compare) {
    encoder_state *s = state;
    attn_encoder_layer_config c;
    attn_encoder_layer_config_init(&c, 8, 2);
    c.dim_feedforward = 24;
    c.norm_first = s->norm_first;
    c.activation = ATTN_ACTIVATION_GELU;
    c.dtype = s->dtype;
    attn_encoder_layer *l = NULL;
    attn_status st = attn_encoder_layer_create(&c, &l);
    if (st != ATTN_OK) return st;
    st = attn_encoder_layer_forward(l, &s->src.t, &s->fp, &s->out.t);
    attn_encoder_layer_destroy(l);
    if (st != ATTN_OK) return st;
    if (!compare) {
        free(s->expect);
        s->expect = tt_dense(&s->out.t);
    } else {
        CHECK(same_dense(&s->out.t, s->expect), "encoder out differs after failure injection");
    }
    return st;
}

static void encoder_failures(void) {
    rng r = {harness_seed() ^ 0xec};
    for (int kind = 0; kind < 3; kind++) { /* post-norm, pre-norm, pre-norm in bfloat16 */
        const int norm_first = kind > 0;
        encoder_state st;
        memset(&st, 0, sizeof st);
        st.norm_first = norm_first;
        st.dtype = kind == 2 ? ATTN_DTYPE_BF16 : ATTN_DTYPE_F32;
        int64_t shape[3] = {5, 2, 8}, ks[2] = {2, 5};
        tt_make(&st.src, &r, st.dtype, 3, shape, LAYOUT_RANDOM, 1, 0);
        tt_make_output(&st.out, &r, st.dtype, 3, shape, LAYOUT_RANDOM);
        tt_make(&st.kpm, &r, ATTN_DTYPE_BOOL, 2, ks, LAYOUT_RANDOM, 1, 0.3);
        attn_encoder_forward_params_init(&st.fp);
        st.fp.src_key_padding_mask = &st.kpm.t;
        st.fp.is_causal = 1;
        static const char *const names[3] = {
            "attn_encoder_layer (post-norm, causal, padding)",
            "attn_encoder_layer (pre-norm, causal, padding)",
            "attn_encoder_layer (pre-norm, causal, padding, bfloat16)"};
        scenario s = {names[kind], encoder_run, &st};
        run_scenario(&s);
        tt_free(&st.src);
        tt_free(&st.out);
        tt_free(&st.kpm);
        free(st.expect);
    }
}

static void npy_failures(void) {
    const char *fixtures[2] = {"f64_fortran_big", "bool_c"};
    for (int i = 0; i < 2; i++)
        for (int parse = 0; parse < 2; parse++) {
            npy_state st;
            npy_setup(&st, fixtures[i], parse);
            char name[96];
            snprintf(name, sizeof name, "%s (%s)", parse ? "attn_npy_parse" : "attn_npy_load",
                     fixtures[i]);
            scenario s = {name, npy_run, &st};
            run_scenario(&s);
            free(st.bytes);
            free(st.expect);
        }
}

HARNESS_MAIN(T(sdpa_failures), T(backward_failures), T(serving_failures),
             T(varlen_backward_failures), T(varlen_sinks_failures), T(mha_failures), T(encoder_failures), T(npy_failures),
             T(st_failures))
