/*
 * test_concurrency.c — attn.h's thread-safety promise: "every call may run
 * concurrently with any other call on different outputs, including
 * attn_mha_forward() on one shared attn_mha".
 *
 * 8 threads call SDPA and MHA at once, repeatedly, on inputs shared
 * read-only by all of them (one shared attn_mha handle too) and on inputs of
 * their own; every result must equal, bit for bit, the single-threaded
 * result computed before the threads start. Each thread also makes failing
 * calls and checks that the message it reads is its own (per-thread
 * errors) and now and then hands back the workspace attn keeps between
 * calls while the others run. The first test races the lazy first-use
 * initialisation (CPU detection, kernel choice, thread count) from 8
 * threads.
 *
 * This file is the ThreadSanitizer tier (make test-tsan): there the library
 * is built with -fsanitize=thread and without OpenMP (GCC's libgomp is not
 * instrumented), so TSan checks the library's own shared state while the 8
 * caller threads race. Iterations: ATTN_CONCURRENCY_ITERS (default 25).
 */
#define _POSIX_C_SOURCE 200809L /* pthread_barrier */
#include <pthread.h>
#include <stdatomic.h>

#include "testutil.h"

#ifdef _OPENMP
#include <omp.h>
#endif

enum { THREADS = 8 };

static int iterations(void) {
    const char *env = getenv("ATTN_CONCURRENCY_ITERS");
    int n = env ? atoi(env) : 25;
    return n > 0 ? n : 25;
}

/* ---- first use: lazy initialisation raced from 8 threads ---- */

static pthread_barrier_t barrier;

typedef struct first_use {
    attn_isa isa;
    int avx2, threads;
    const char *version;
} first_use;

static void *first_use_thread(void *arg) {
    first_use *r = arg;
    pthread_barrier_wait(&barrier);
    r->avx2 = attn_isa_supported(ATTN_ISA_AVX2);
    r->isa = attn_get_isa();
    r->threads = attn_get_num_threads();
    r->version = attn_version();
    return NULL;
}

static void first_use_race(void) {
    pthread_t t[THREADS];
    first_use r[THREADS];
    pthread_barrier_init(&barrier, NULL, THREADS);
    for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, first_use_thread, &r[i]);
    for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    pthread_barrier_destroy(&barrier);
    for (int i = 1; i < THREADS; i++)
        CHECK(r[i].isa == r[0].isa && r[i].avx2 == r[0].avx2 && r[i].threads == r[0].threads &&
                  r[i].version == r[0].version,
              "thread %d saw a different first-use state", i);
}

/* ---- the shared and private work ---- */

typedef struct sdpa_job {
    test_tensor q, k, v, mask;
    attn_sdpa_params p;
    double *expect_out, *expect_w, *expect_lse;
    int64_t out_shape[4], w_shape[4];
} sdpa_job;

typedef struct mha_job {
    test_tensor query, key, value, kpm, mask;
    attn_mha_forward_params fp;
    double *expect_out, *expect_w;
    int64_t out_shape[3], w_shape[3];
} mha_job;

static attn_mha *shared_module;
static sdpa_job shared_sdpa;
static mha_job shared_mha;

typedef struct worker {
    int id;
    sdpa_job own_sdpa;
    mha_job own_mha;      /* run through the shared module */
    attn_mha *own_module; /* and a module of its own */
    mha_job own_module_job;
    long calls, mismatches, wrong_messages, errors;
} worker;

static void sdpa_make(sdpa_job *j, rng *r, attn_dtype dt) {
    memset(j, 0, sizeof *j);
    int64_t qs[4] = {2, 3, 9, 16}, ks[4] = {2, 3, 12, 16}, vs[4] = {2, 3, 12, 8}, ms[2] = {9, 12};
    tt_make(&j->q, r, dt, 4, qs, LAYOUT_RANDOM, 1, 0);
    tt_make(&j->k, r, dt, 4, ks, LAYOUT_RANDOM, 1, 0);
    tt_make(&j->v, r, dt, 4, vs, LAYOUT_RANDOM, 1, 0);
    tt_make(&j->mask, r, ATTN_DTYPE_BOOL, 2, ms, LAYOUT_RANDOM, 1, 0.8);
    attn_sdpa_params_init(&j->p);
    j->p.attn_mask = &j->mask.t;
    j->p.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    j->p.dropout_p = 0.2;
    j->p.seed = rng_next(r);
    int64_t os[4] = {2, 3, 9, 8}, ws[4] = {2, 3, 9, 12};
    memcpy(j->out_shape, os, sizeof os);
    memcpy(j->w_shape, ws, sizeof ws);
}

/* Runs one SDPA job into fresh outputs; compares with (or records) the
 * expected result. Returns the number of mismatching outputs. */
static int sdpa_do(sdpa_job *j, bool record) {
    attn_dtype dt = j->q.t.dtype;
    size_t es = attn_dtype_size(dt);
    void *o = calloc(2 * 3 * 9 * 8, es), *w = calloc(2 * 3 * 9 * 12, es), *l = calloc(2 * 3 * 9, es);
    attn_tensor to, tw, tl;
    attn_tensor_init(&to, o, dt, 4, j->out_shape);
    attn_tensor_init(&tw, w, dt, 4, j->w_shape);
    attn_tensor_init(&tl, l, dt, 3, j->out_shape);
    int bad = 0;
    if (attn_sdpa(&j->q.t, &j->k.t, &j->v.t, &j->p, &to, &tw, &tl) != ATTN_OK) {
        bad = 100;
    } else {
        double *d[3] = {tt_dense(&to), tt_dense(&tw), tt_dense(&tl)};
        double **e[3] = {&j->expect_out, &j->expect_w, &j->expect_lse};
        size_t n[3] = {2 * 3 * 9 * 8, 2 * 3 * 9 * 12, 2 * 3 * 9};
        for (int i = 0; i < 3; i++) {
            if (record) {
                *e[i] = d[i];
                continue;
            }
            bad += memcmp(d[i], *e[i], n[i] * sizeof(double)) != 0;
            free(d[i]);
        }
    }
    free(o);
    free(w);
    free(l);
    return bad;
}

enum { N = 2, L = 6, S = 7, E = 16, H = 4 };

static void mha_make(mha_job *j, rng *r, attn_dtype dt) {
    memset(j, 0, sizeof *j);
    int64_t qs[3] = {L, N, E}, ks[3] = {S, N, E}, kp[2] = {N, S}, am[3] = {N * H, L, S};
    tt_make(&j->query, r, dt, 3, qs, LAYOUT_RANDOM, 1, 0);
    tt_make(&j->key, r, dt, 3, ks, LAYOUT_RANDOM, 1, 0);
    tt_make(&j->value, r, dt, 3, ks, LAYOUT_RANDOM, 1, 0);
    tt_make(&j->kpm, r, ATTN_DTYPE_BOOL, 2, kp, LAYOUT_RANDOM, 1, 0.2);
    tt_make(&j->mask, r, ATTN_DTYPE_F32, 3, am, LAYOUT_RANDOM, 1, 0);
    attn_mha_forward_params_init(&j->fp);
    j->fp.key_padding_mask = &j->kpm.t;
    j->fp.attn_mask = &j->mask.t;
    j->fp.is_causal = 1;
    memcpy(j->out_shape, qs, sizeof qs);
    int64_t ws[3] = {N, L, S + 2}; /* add_bias_kv + add_zero_attn */
    memcpy(j->w_shape, ws, sizeof ws);
}

static int mha_do(const attn_mha *m, mha_job *j, bool record) {
    attn_dtype dt = j->query.t.dtype;
    size_t es = attn_dtype_size(dt);
    void *o = calloc(L * N * E, es), *w = calloc(N * L * (S + 2), es);
    attn_tensor to, tw;
    attn_tensor_init(&to, o, dt, 3, j->out_shape);
    attn_tensor_init(&tw, w, dt, 3, j->w_shape);
    int bad = 0;
    if (attn_mha_forward(m, &j->query.t, &j->key.t, &j->value.t, &j->fp, &to, &tw) != ATTN_OK) {
        bad = 100;
    } else {
        double *d[2] = {tt_dense(&to), tt_dense(&tw)};
        double **e[2] = {&j->expect_out, &j->expect_w};
        size_t n[2] = {L * N * E, N * L * (S + 2)};
        for (int i = 0; i < 2; i++) {
            if (record) {
                *e[i] = d[i];
                continue;
            }
            bad += memcmp(d[i], *e[i], n[i] * sizeof(double)) != 0;
            free(d[i]);
        }
    }
    free(o);
    free(w);
    return bad;
}

static attn_mha *module(attn_dtype dt, uint64_t seed) {
    attn_mha_config c;
    attn_mha_config_init(&c, E, H);
    c.add_bias_kv = c.add_zero_attn = 1;
    c.dtype = dt;
    c.init_seed = seed;
    attn_mha *m = NULL;
    attn_mha_create(&c, &m);
    return m;
}

/* A failing call whose message names this thread's own number. */
static bool own_error(int id) {
    static float x[4];
    int64_t qs[2] = {1, 1}, ks[2] = {1, 2 + id}; /* E differs: 1 vs 2 + id */
    attn_tensor q, k, o;
    attn_tensor_init(&q, x, ATTN_DTYPE_F32, 2, qs);
    attn_tensor_init(&k, x, ATTN_DTYPE_F32, 2, ks);
    attn_tensor_init(&o, x, ATTN_DTYPE_F32, 2, qs);
    if (attn_sdpa(&q, &k, &k, NULL, &o, NULL, NULL) != ATTN_ERR_SHAPE) return false;
    char want[64];
    snprintf(want, sizeof want, "k.shape[-1] is %d but", 2 + id);
    return strstr(attn_last_error(), want) != NULL;
}

static void *worker_main(void *arg) {
    worker *w = arg;
    int iters = iterations();
    pthread_barrier_wait(&barrier);
    for (int it = 0; it < iters; it++) {
        /* Vary the order so that different calls overlap. */
        for (int step = 0; step < 5; step++) {
            switch ((step + w->id + it) % 5) {
            case 0: w->mismatches += sdpa_do(&shared_sdpa, false); break;
            case 1: w->mismatches += sdpa_do(&w->own_sdpa, false); break;
            case 2: w->mismatches += mha_do(shared_module, &shared_mha, false); break;
            case 3: w->mismatches += mha_do(shared_module, &w->own_mha, false); break;
            default: w->mismatches += mha_do(w->own_module, &w->own_module_job, false); break;
            }
            w->calls++;
        }
        /* Kept workspace handed back while the other threads' calls run
         * (attn.h: safe at any time); their results must not change. */
        if ((it + w->id) % 3 == 0) attn_release_workspace();
        if (!own_error(w->id)) w->wrong_messages++;
        /* After a success, the message is empty again on this thread. */
        w->errors += sdpa_do(&w->own_sdpa, false);
        if (attn_last_error()[0] != '\0') w->wrong_messages++;
        w->calls += 2;
    }
    return NULL;
}

static void free_sdpa(sdpa_job *j) {
    tt_free(&j->q);
    tt_free(&j->k);
    tt_free(&j->v);
    tt_free(&j->mask);
    free(j->expect_out);
    free(j->expect_w);
    free(j->expect_lse);
}
static void free_mha(mha_job *j) {
    tt_free(&j->query);
    tt_free(&j->key);
    tt_free(&j->value);
    tt_free(&j->kpm);
    tt_free(&j->mask);
    free(j->expect_out);
    free(j->expect_w);
}

static void eight_threads_bitwise(void) {
    rng r = {harness_seed() ^ 0xc0c0};
    static worker w[THREADS];
    /* Single-threaded results first. */
    shared_module = module(ATTN_DTYPE_F32, 1);
    CHECK(shared_module != NULL, "module");
    if (shared_module == NULL) return;
    sdpa_make(&shared_sdpa, &r, ATTN_DTYPE_F32);
    mha_make(&shared_mha, &r, ATTN_DTYPE_F32);
    CHECK(sdpa_do(&shared_sdpa, true) == 0, "shared SDPA failed: %s", attn_last_error());
    CHECK(mha_do(shared_module, &shared_mha, true) == 0, "shared MHA failed: %s",
          attn_last_error());
    for (int i = 0; i < THREADS; i++) {
        memset(&w[i], 0, sizeof w[i]);
        w[i].id = i;
        attn_dtype dt = i % 2 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
        sdpa_make(&w[i].own_sdpa, &r, dt);
        mha_make(&w[i].own_mha, &r, ATTN_DTYPE_F32);
        w[i].own_module = module(dt, 100 + (uint64_t)i);
        mha_make(&w[i].own_module_job, &r, dt);
        CHECK(sdpa_do(&w[i].own_sdpa, true) == 0, "own SDPA");
        CHECK(mha_do(shared_module, &w[i].own_mha, true) == 0, "own MHA");
        CHECK(mha_do(w[i].own_module, &w[i].own_module_job, true) == 0, "own module");
    }
    /* Then all at once. */
    pthread_t t[THREADS];
    pthread_barrier_init(&barrier, NULL, THREADS);
    for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, worker_main, &w[i]);
    for (int i = 0; i < THREADS; i++) pthread_join(t[i], NULL);
    pthread_barrier_destroy(&barrier);
    long calls = 0;
    for (int i = 0; i < THREADS; i++) {
        CHECK(w[i].mismatches == 0 && w[i].errors == 0,
              "thread %d: %ld results differ from the single-threaded ones", i, w[i].mismatches);
        CHECK(w[i].wrong_messages == 0, "thread %d read %ld messages that were not its own", i,
              w[i].wrong_messages);
        calls += w[i].calls;
    }
    printf("eight_threads_bitwise: %d threads x %d iterations, %ld calls, all bitwise equal to "
           "the single-threaded results (library threads: %d)\n",
           THREADS, iterations(), calls, attn_get_num_threads());
    for (int i = 0; i < THREADS; i++) {
        free_sdpa(&w[i].own_sdpa);
        free_mha(&w[i].own_mha);
        free_mha(&w[i].own_module_job);
        attn_mha_destroy(w[i].own_module);
    }
    free_sdpa(&shared_sdpa);
    free_mha(&shared_mha);
    attn_mha_destroy(shared_module);
}

/* ---- the thread count changed while calls run ---- */

/* attn_set_num_threads from one thread while another runs fused forward and
 * backward calls large enough to go parallel: a call sizes its per-thread
 * scratch by the setting it reads once and starts that many threads (the
 * backward read it twice, and more threads than its scratch held wrote past
 * its end; under ASan a heap-buffer-overflow, else a corrupted heap). The
 * results stay those of one thread, bit for bit. */
static _Atomic int toggling;

static void *toggle_main(void *arg) {
    (void)arg;
    while (atomic_load(&toggling)) {
        attn_set_num_threads(1);
        attn_set_num_threads(attn_max_threads());
    }
    return NULL;
}

static void thread_count_changes_during_calls(void) {
    rng r = {harness_seed() ^ 0x70661e};
    int64_t shape[4] = {1, 4, 256, 64};
    test_tensor q, k, v, dout;
    tt_make(&q, &r, ATTN_DTYPE_F32, 4, shape, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&k, &r, ATTN_DTYPE_F32, 4, shape, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&v, &r, ATTN_DTYPE_F32, 4, shape, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&dout, &r, ATTN_DTYPE_F32, 4, shape, LAYOUT_CONTIGUOUS, 1, 0);
    const size_t n = 4 * 256 * 64;
    float *o = malloc(4 * n), *g = malloc(3 * 4 * n), *first = malloc(4 * 4 * n);
    double *lse = malloc(sizeof(double) * 4 * 256);
    attn_tensor to, tl, tg[3];
    attn_tensor_init(&to, o, ATTN_DTYPE_F32, 4, shape);
    attn_tensor_init(&tl, lse, ATTN_DTYPE_F64, 3, shape);
    for (int i = 0; i < 3; i++) attn_tensor_init(&tg[i], g + i * n, ATTN_DTYPE_F32, 4, shape);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    int mismatches = 0, failures = 0;
    pthread_t toggler;
    for (int round = 0; round < 1 + 4 * iterations(); round++) {
        if (round == 0) attn_set_num_threads(1);
        if (round == 1) { /* the single-threaded results are in `first` */
            atomic_store(&toggling, 1);
            pthread_create(&toggler, NULL, toggle_main, NULL);
        }
        failures += attn_sdpa(&q.t, &k.t, &v.t, &p, &to, NULL, &tl) != ATTN_OK;
        failures += attn_sdpa_backward(&dout.t, &q.t, &k.t, &v.t, &to, &tl, &p, &tg[0], &tg[1],
                                       &tg[2], NULL) != ATTN_OK;
        if (round == 0) {
            memcpy(first, o, 4 * n);
            memcpy(first + n, g, 3 * 4 * n);
        } else {
            mismatches += memcmp(first, o, 4 * n) != 0 || memcmp(first + n, g, 3 * 4 * n) != 0;
        }
    }
    atomic_store(&toggling, 0);
    pthread_join(toggler, NULL);
    CHECK(failures == 0 && mismatches == 0, "%d calls failed, %d results differ from one thread's",
          failures, mismatches);
    attn_set_num_threads(0);
    free(o);
    free(g);
    free(first);
    free(lse);
    tt_free(&q);
    tt_free(&k);
    tt_free(&v);
    tt_free(&dout);
}

/* ---- calls from inside the caller's own OpenMP region ---- */

/* A caller's OpenMP threads, each making its own one-thread call (and one
 * call from a `single` construct): attn runs a one-thread call without a
 * team of its own only outside any region; inside one, its worksharing
 * loops would bind to the caller's team (the tasks split across calls, or
 * a wait at a barrier the other threads never reach). Forward and backward
 * must give the serial calls' bits. */
#ifdef _OPENMP /* (the TSan tier builds without OpenMP) */
enum { OH = 8, OL = 64, OE = 32, ON = OH * OL * OE };

typedef struct omp_case {
    float q[ON], k[ON], v[ON], dout[ON];
    float out[ON], lse[OH * OL], dq[ON], dk[ON], dv[ON];
} omp_case;

static attn_tensor omp_view(float *d, int rank) {
    const int64_t shape[3] = {OH, OL, OE};
    attn_tensor t;
    attn_tensor_init(&t, d, ATTN_DTYPE_F32, rank, shape);
    return t;
}

static void omp_call(omp_case *c) {
    attn_tensor q = omp_view(c->q, 3), k = omp_view(c->k, 3), v = omp_view(c->v, 3);
    attn_tensor out = omp_view(c->out, 3), lse = omp_view(c->lse, 2), go = omp_view(c->dout, 3);
    attn_tensor dq = omp_view(c->dq, 3), dk = omp_view(c->dk, 3), dv = omp_view(c->dv, 3);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.lse_for_backward = true;
    CHECK_OK(attn_sdpa(&q, &k, &v, &p, &out, NULL, &lse));
    CHECK_OK(attn_sdpa_backward(&go, &q, &k, &v, &out, &lse, &p, &dq, &dk, &dv, NULL));
}

static void omp_compare(const omp_case *got, const omp_case *want, const char *where) {
    CHECK(memcmp(got->out, want->out, sizeof want->out) == 0, "%s: out differs", where);
    CHECK(memcmp(got->dq, want->dq, sizeof want->dq) == 0 &&
              memcmp(got->dk, want->dk, sizeof want->dk) == 0 &&
              memcmp(got->dv, want->dv, sizeof want->dv) == 0,
          "%s: a gradient differs", where);
}

#endif

static void calls_inside_a_callers_openmp_region(void) {
#ifdef _OPENMP
    static omp_case want, got[2];
    rng r = {harness_seed() ^ 0x0e9};
    float *inputs[4] = {want.q, want.k, want.v, want.dout};
    for (int i = 0; i < 4; i++)
        for (int e = 0; e < ON; e++) inputs[i][e] = (float)rng_normal(&r);
    attn_set_num_threads(1);
    omp_call(&want);
    for (int t = 0; t < 2; t++) {
        memcpy(&got[t], &want, sizeof want);
        memset(got[t].out, 0xff, sizeof got[t].out); /* NaN: an unwritten output shows */
        memset(got[t].dq, 0xff, sizeof got[t].dq);
    }
#pragma omp parallel num_threads(2)
    omp_call(&got[omp_get_thread_num()]);
    omp_compare(&got[0], &want, "thread 0 of the caller's team");
    omp_compare(&got[1], &want, "thread 1 of the caller's team");
    memset(got[0].out, 0xff, sizeof got[0].out);
#pragma omp parallel num_threads(2)
    {
#pragma omp single
        omp_call(&got[0]);
    }
    omp_compare(&got[0], &want, "a call from a single construct");
    attn_set_num_threads(0); /* the default again */
#else
    printf("  (built without OpenMP: nothing to check)\n");
#endif
}

HARNESS_MAIN(T(first_use_race), T(eight_threads_bitwise), T(thread_count_changes_during_calls),
             T(calls_inside_a_callers_openmp_region))
