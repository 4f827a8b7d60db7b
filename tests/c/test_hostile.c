/*
 * test_hostile.c — regressions for what hostile users broke in the library
 * (issue 9): fork, cancellation, outputs overlapping inputs, an address-space
 * limit under the BLAS, and the BLAS kernels chosen for the CPU. Each test
 * failed (or hung) before its fix.
 */
#define _GNU_SOURCE /* RLIMIT_AS, usleep */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/gemm.h"
#include "core/internal.h"
#include "testutil.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* q, k, v (B, H, T, E) float32 filled with N(0, 1), and out. */
typedef struct problem {
    float *q, *k, *v, *out;
    attn_tensor tq, tk, tv, tout;
} problem;

static void problem_make(problem *p, int64_t B, int64_t H, int64_t T, int64_t E, unsigned seed) {
    const size_t n = (size_t)(B * H * T * E);
    const int64_t shape[4] = {B, H, T, E};
    rng r = {seed};
    float **bufs[4] = {&p->q, &p->k, &p->v, &p->out};
    attn_tensor *views[4] = {&p->tq, &p->tk, &p->tv, &p->tout};
    for (int i = 0; i < 4; i++) {
        *bufs[i] = malloc(n * sizeof(float));
        for (size_t j = 0; j < n; j++) (*bufs[i])[j] = i < 3 ? (float)rng_normal(&r) : 0.0f;
        attn_tensor_init(views[i], *bufs[i], ATTN_DTYPE_F32, 4, shape);
    }
}

static void problem_free(problem *p) {
    free(p->q);
    free(p->k);
    free(p->v);
    free(p->out);
}

/* Waits up to `seconds` for a child; kills it on timeout. Returns its exit
 * status, or -1 when it hung or died of a signal. */
static int wait_child(pid_t pid, double seconds) {
    const double end = now() + seconds;
    int status;
    while (now() < end) {
        pid_t got = waitpid(pid, &status, WNOHANG);
        if (got == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        usleep(10000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
}

/* ---- fork: a child of a process that ran parallel calls must not hang ---- */

static void fork_after_parallel_call(void) {
    if (attn_max_threads() < 2) return; /* no OpenMP: nothing to hang */
    problem p;
    problem_make(&p, 2, 4, 256, 64, 11);
    attn_set_num_threads(2);
    CHECK_OK(attn_sdpa(&p.tq, &p.tk, &p.tv, NULL, &p.tout, NULL, NULL));
    const size_t n = (size_t)(2 * 4 * 256 * 64);
    float *parent = malloc(n * sizeof(float));
    memcpy(parent, p.out, n * sizeof(float));
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, 64, 4);
    attn_mha *m = NULL;
    CHECK_OK(attn_mha_create(&cfg, &m));
    const int64_t xs[3] = {256, 8, 64};
    attn_tensor tx, ty;
    attn_tensor_init(&tx, p.q, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&ty, p.out, ATTN_DTYPE_F32, 3, xs);
    CHECK_OK(attn_mha_forward(m, &tx, &tx, &tx, NULL, &ty, NULL));
    float *parent_mha = malloc(n * sizeof(float));
    memcpy(parent_mha, p.out, n * sizeof(float));

    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) { /* the child: the same calls, the same bits */
        alarm(60);
        int bad = attn_sdpa(&p.tq, &p.tk, &p.tv, NULL, &p.tout, NULL, NULL) != ATTN_OK ||
                  memcmp(p.out, parent, n * sizeof(float)) != 0;
        bad |= (attn_mha_forward(m, &tx, &tx, &tx, NULL, &ty, NULL) != ATTN_OK ||
                memcmp(p.out, parent_mha, n * sizeof(float)) != 0)
               << 1;
        _exit(bad);
    }
    CHECK(pid > 0, "fork failed: %s", strerror(errno));
    if (pid > 0) {
        int rc = wait_child(pid, 30);
        CHECK(rc == 0, "forked child: %s",
              rc < 0 ? "hung or crashed" : rc == 1 ? "SDPA differs" : "MHA differs");
    }
    attn_set_num_threads(0);
    attn_mha_destroy(m);
    free(parent);
    free(parent_mha);
    problem_free(&p);
}

/* ---- cancellation ---- */

typedef struct canceller {
    volatile int *flag;
    double delay, fired_at;
} canceller;

static void *cancel_later(void *arg) {
    canceller *c = arg;
    usleep((useconds_t)(c->delay * 1e6));
    c->fired_at = now();
    __atomic_store_n(c->flag, 1, __ATOMIC_RELAXED);
    return NULL;
}

typedef attn_status (*long_call)(void *ctx);

/* Runs `call`, sets the flag after 0.2 s from another thread, and checks the
 * call stopped with ATTN_ERR_CANCELLED soon after. The uncancelled calls take
 * many seconds, so a return within 2 s of the flag shows the checks work;
 * the latency is printed. */
static void expect_cancel(const char *what, long_call call, void *ctx) {
    volatile int flag = 0;
    attn_set_cancel_flag(&flag);
    canceller c = {&flag, 0.2, 0};
    pthread_t th;
    pthread_create(&th, NULL, cancel_later, &c);
    attn_status st = call(ctx);
    const double done = now();
    pthread_join(th, NULL);
    attn_set_cancel_flag(NULL);
    CHECK(st == ATTN_ERR_CANCELLED, "%s: status %d (%s), expected cancelled", what, (int)st,
          attn_strerror(st));
    CHECK(strstr(attn_last_error(), "cancel") != NULL, "%s: message '%s'", what,
          attn_last_error());
    CHECK(done - c.fired_at < 2.0, "%s: stopped %.3f s after the flag", what, done - c.fired_at);
    printf("  %s: stopped %.0f ms after the flag\n", what, 1e3 * (done - c.fired_at));
}

static attn_status sdpa_call(void *ctx) {
    problem *p = ctx;
    return attn_sdpa(&p->tq, &p->tk, &p->tv, NULL, &p->tout, NULL, NULL);
}

/* A backward call on `big`: its forward's out and lse, dout, and dq, dk, dv. */
typedef struct backward_ctx {
    problem *p;
    float *lse, *dout, *grads;
    attn_tensor tlse, tdout, tdq, tdk, tdv;
} backward_ctx;

static void backward_make(backward_ctx *c, problem *p, int64_t B, int64_t H, int64_t T,
                          int64_t E) {
    const size_t n = (size_t)(B * H * T * E);
    const int64_t shape[4] = {B, H, T, E};
    c->p = p;
    c->lse = malloc((size_t)(B * H * T) * sizeof(float));
    c->dout = malloc(n * sizeof(float));
    c->grads = malloc(3 * n * sizeof(float));
    for (size_t j = 0; j < n; j++) c->dout[j] = (float)((j * 7919) % 1000) / 1000.0f - 0.5f;
    attn_tensor_init(&c->tlse, c->lse, ATTN_DTYPE_F32, 3, shape);
    attn_tensor_init(&c->tdout, c->dout, ATTN_DTYPE_F32, 4, shape);
    attn_tensor_init(&c->tdq, c->grads, ATTN_DTYPE_F32, 4, shape);
    attn_tensor_init(&c->tdk, c->grads + n, ATTN_DTYPE_F32, 4, shape);
    attn_tensor_init(&c->tdv, c->grads + 2 * n, ATTN_DTYPE_F32, 4, shape);
    CHECK_OK(attn_sdpa(&p->tq, &p->tk, &p->tv, NULL, &p->tout, NULL, &c->tlse));
}

static attn_status backward_call(void *ctx) {
    backward_ctx *c = ctx;
    problem *p = c->p;
    return attn_sdpa_backward(&c->tdout, &p->tq, &p->tk, &p->tv, &p->tout, &c->tlse, NULL,
                              &c->tdq, &c->tdk, &c->tdv, NULL);
}

typedef struct mha_ctx {
    attn_mha *m;
    attn_tensor x, y;
} mha_ctx;

static attn_status mha_call(void *ctx) {
    mha_ctx *c = ctx;
    return attn_mha_forward(c->m, &c->x, &c->x, &c->x, NULL, &c->y, NULL);
}

static void cancellation(void) {
    /* Fused: (1, 8, 8192, 64) float32 is ~70 GFLOP, many seconds on 2 cores. */
    problem big;
    problem_make(&big, 1, 8, 8192, 64, 3);
    expect_cancel("fused SDPA", sdpa_call, &big);
    /* The reference path: float64 row by row, far slower still. */
    CHECK_OK(attn_set_isa(ATTN_ISA_REF));
    expect_cancel("reference SDPA", sdpa_call, &big);
    CHECK_OK(attn_set_isa(ATTN_ISA_AUTO));
    /* The backward, fused and reference (which checks row by row: one of
     * its batch indices alone is tens of seconds here). */
    backward_ctx bw;
    backward_make(&bw, &big, 1, 8, 8192, 64);
    expect_cancel("fused backward", backward_call, &bw);
    CHECK_OK(attn_set_isa(ATTN_ISA_REF));
    expect_cancel("reference backward", backward_call, &bw);
    CHECK_OK(attn_set_isa(ATTN_ISA_AUTO));
    free(bw.lse);
    free(bw.dout);
    free(bw.grads);

    /* A flag already set: nothing runs. */
    volatile int set = 1;
    attn_set_cancel_flag(&set);
    CHECK_STATUS(sdpa_call(&big), ATTN_ERR_CANCELLED);
    attn_set_cancel_flag(NULL);

    /* MHA: the projections (GEMM tiles) and the attention check the flag. */
    const int64_t E = 1024, T = 4096;
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, E, 16);
    mha_ctx mc;
    CHECK_OK(attn_mha_create(&cfg, &mc.m));
    float *x = calloc((size_t)(T * 4 * E), sizeof(float)), *y = malloc((size_t)(T * 4 * E) * 4);
    for (int64_t i = 0; i < T * 4 * E; i++) x[i] = (float)((i * 7919) % 1000) / 1000.0f;
    const int64_t xs[3] = {T, 4, E};
    attn_tensor_init(&mc.x, x, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&mc.y, y, ATTN_DTYPE_F32, 3, xs);
    expect_cancel("MHA", mha_call, &mc);

    /* Still usable afterwards, and the same bits as before any cancel. */
    problem small;
    problem_make(&small, 1, 2, 64, 16, 5);
    CHECK_OK(sdpa_call(&small));
    float first = small.out[17];
    memset(small.out, 0, 2 * 64 * 16 * sizeof(float));
    volatile int unset = 0;
    attn_set_cancel_flag(&unset);
    CHECK_OK(sdpa_call(&small));
    attn_set_cancel_flag(NULL);
    CHECK(small.out[17] == first, "a call with a clear flag gives the same result");
    problem_free(&small);
    attn_mha_destroy(mc.m);
    free(x);
    free(y);
    problem_free(&big);
}

/* ---- outputs that overlap inputs ---- */

static void overlapping_outputs(void) {
    problem p;
    problem_make(&p, 1, 2, 8, 8, 7);
    /* in place: out == q */
    CHECK_STATUS(attn_sdpa(&p.tq, &p.tk, &p.tv, NULL, &p.tq, NULL, NULL), ATTN_ERR_OVERLAP);
    CHECK(strstr(attn_last_error(), "out overlaps q") != NULL, "message: %s", attn_last_error());
    CHECK_STATUS(attn_sdpa(&p.tq, &p.tk, &p.tv, NULL, &p.tv, NULL, NULL), ATTN_ERR_OVERLAP);
    /* out inside k's buffer, shifted by one element */
    attn_tensor shifted = p.tk;
    shifted.data = p.k + 1;
    shifted.shape[2] = 7;
    attn_tensor q7 = p.tq;
    q7.shape[2] = 7;
    CHECK_STATUS(attn_sdpa(&q7, &p.tk, &p.tv, NULL, &shifted, NULL, NULL), ATTN_ERR_OVERLAP);
    /* weights over out; lse inside out */
    float w[2 * 8 * 8], lse[16];
    const int64_t ws[4] = {1, 2, 8, 8}, ls[3] = {1, 2, 8};
    attn_tensor tw, tl, tl_in_out;
    attn_tensor_init(&tw, w, ATTN_DTYPE_F32, 4, ws);
    attn_tensor_init(&tl, lse, ATTN_DTYPE_F32, 3, ls);
    attn_tensor_init(&tl_in_out, p.out + 3, ATTN_DTYPE_F32, 3, ls);
    attn_tensor w_on_out = tw;
    w_on_out.data = p.out;
    CHECK_STATUS(attn_sdpa(&p.tq, &p.tk, &p.tv, NULL, &p.tout, &w_on_out, NULL), ATTN_ERR_OVERLAP);
    CHECK(strstr(attn_last_error(), "out and weights overlap") != NULL, "message: %s",
          attn_last_error());
    CHECK_STATUS(attn_sdpa(&p.tq, &p.tk, &p.tv, NULL, &p.tout, &tw, &tl_in_out), ATTN_ERR_OVERLAP);
    /* a mask shared with weights */
    attn_tensor mask_on_w = tw;
    attn_sdpa_params prm;
    attn_sdpa_params_init(&prm);
    prm.attn_mask = &mask_on_w;
    CHECK_STATUS(attn_sdpa(&p.tq, &p.tk, &p.tv, &prm, &p.tout, &tw, NULL), ATTN_ERR_OVERLAP);
    CHECK(strstr(attn_last_error(), "weights overlaps attn_mask") != NULL, "message: %s",
          attn_last_error());
    /* an output whose own strides collide: rows 4 elements apart, 8 wide */
    attn_tensor self = p.tout;
    self.strides[2] = 4;
    CHECK_STATUS(attn_sdpa(&p.tq, &p.tk, &p.tv, NULL, &self, NULL, NULL), ATTN_ERR_OVERLAP);
    CHECK(strstr(attn_last_error(), "share one address") != NULL, "message: %s",
          attn_last_error());
    /* negative strides that do not collide are fine; separate buffers too */
    attn_tensor flipped = p.tout;
    flipped.strides[2] = -8;
    flipped.data = p.out + 7 * 8;
    CHECK_OK(attn_sdpa(&p.tq, &p.tk, &p.tv, NULL, &flipped, &tw, &tl));

    /* Outputs over the modifiers' tensors, which are read as rows run: the
     * sinks and slopes of later rows changed under them (a wrong result). */
    const int64_t hs[1] = {2};
    attn_tensor sinks_on_out, slopes_on_lse;
    attn_tensor_init(&sinks_on_out, p.out + 5, ATTN_DTYPE_F32, 1, hs);
    attn_tensor_init(&slopes_on_lse, lse + 1, ATTN_DTYPE_F32, 1, hs);
    attn_sdpa_params mods;
    attn_sdpa_params_init(&mods);
    mods.sinks = &sinks_on_out;
    CHECK_STATUS(attn_sdpa(&p.tq, &p.tk, &p.tv, &mods, &p.tout, NULL, NULL), ATTN_ERR_OVERLAP);
    CHECK(strstr(attn_last_error(), "out overlaps params.sinks") != NULL, "message: %s",
          attn_last_error());
    mods.sinks = NULL;
    mods.alibi_slopes = &slopes_on_lse;
    CHECK_STATUS(attn_sdpa(&p.tq, &p.tk, &p.tv, &mods, &p.tout, NULL, &tl), ATTN_ERR_OVERLAP);
    CHECK(strstr(attn_last_error(), "lse overlaps params.alibi_slopes") != NULL, "message: %s",
          attn_last_error());
    /* and a gradient over them */
    float slopes[2 * 8 * 8] = {0.5f, 0.25f}; /* room for dq, were it written */
    attn_tensor ts;
    attn_tensor_init(&ts, slopes, ATTN_DTYPE_F32, 1, hs);
    mods.alibi_slopes = &ts;
    CHECK_OK(attn_sdpa(&p.tq, &p.tk, &p.tv, &mods, &p.tout, NULL, &tl));
    float *grads = calloc(3 * 2 * 8 * 8, sizeof(float));
    attn_tensor dq = p.tq, dk = p.tk, dv = p.tv;
    dq.data = grads;
    dk.data = grads + 128;
    dv.data = grads + 256;
    attn_tensor dq_on_slopes = dq;
    dq_on_slopes.data = slopes;
    CHECK_OK(attn_sdpa_backward(&p.tout, &p.tq, &p.tk, &p.tv, &p.tout, &tl, &mods, &dq, &dk, &dv,
                                NULL));
    CHECK_STATUS(attn_sdpa_backward(&p.tout, &p.tq, &p.tk, &p.tv, &p.tout, &tl, &mods,
                                    &dq_on_slopes, &dk, &dv, NULL),
                 ATTN_ERR_OVERLAP);
    CHECK(strstr(attn_last_error(), "dq overlaps params.alibi_slopes") != NULL, "message: %s",
          attn_last_error());
    free(grads);

    /* MHA: out over the query (self-attention in place) */
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, 8, 2);
    attn_mha *m = NULL;
    CHECK_OK(attn_mha_create(&cfg, &m));
    const int64_t xs[3] = {8, 2, 8};
    attn_tensor tx, ty;
    attn_tensor_init(&tx, p.q, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&ty, p.out, ATTN_DTYPE_F32, 3, xs);
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, NULL, &tx, NULL), ATTN_ERR_OVERLAP);
    CHECK(strstr(attn_last_error(), "out overlaps query") != NULL, "message: %s",
          attn_last_error());
    CHECK_OK(attn_mha_forward(m, &tx, &tx, &tx, NULL, &ty, NULL));
    /* out over the module's own out_proj.weight, read after out is written */
    const char *name = NULL;
    attn_tensor param, on_param = ty;
    CHECK_OK(attn_mha_param_at(m, 2, &name, &param));
    on_param.data = param.data;
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, NULL, &on_param, NULL), ATTN_ERR_OVERLAP);
    CHECK(strstr(attn_last_error(), "out overlaps the module's parameters") != NULL,
          "message: %s (%s)", attn_last_error(), name);
    attn_mha_destroy(m);
    problem_free(&p);
}

/* ---- an address-space limit under the BLAS ---- */

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define UNDER_SANITIZER 1
#endif
#endif
#ifndef UNDER_SANITIZER
#define UNDER_SANITIZER 0
#endif

#if !UNDER_SANITIZER
static long vm_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f != NULL && fgets(line, sizeof line, f) != NULL)
        if (strncmp(line, "VmSize:", 7) == 0) kib = atol(line + 7);
    if (f != NULL) fclose(f);
    return kib;
}
#endif

/* OpenBLAS 0.3.21 retried its buffer mapping forever when `ulimit -v` left
 * no room for it: the call spun at 100% CPU. In a fresh child (no BLAS call
 * made yet) with 64 MiB of address space to spare, MHA must fail with
 * ATTN_ERR_NOMEM. Not under ASan, whose shadow memory ignores the limit. */
static void address_space_limit(void) {
#if UNDER_SANITIZER
    printf("  skipped under a sanitizer\n");
#else
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(60);
        attn_set_num_threads(1);
        attn_mha_config cfg;
        attn_mha_config_init(&cfg, 256, 4);
        attn_mha *m = NULL;
        if (attn_mha_create(&cfg, &m) != ATTN_OK) _exit(3);
        static float x[64 * 4 * 256], y[64 * 4 * 256];
        const int64_t xs[3] = {64, 4, 256};
        attn_tensor tx, ty;
        attn_tensor_init(&tx, x, ATTN_DTYPE_F32, 3, xs);
        attn_tensor_init(&ty, y, ATTN_DTYPE_F32, 3, xs);
        const long kib = vm_kib();
        struct rlimit lim = {(rlim_t)(kib + 64 * 1024) * 1024, (rlim_t)(kib + 64 * 1024) * 1024};
        if (kib < 0 || setrlimit(RLIMIT_AS, &lim) != 0) _exit(4);
        attn_status st = attn_mha_forward(m, &tx, &tx, &tx, NULL, &ty, NULL);
        _exit(st == ATTN_ERR_NOMEM ? 0 : st == ATTN_OK ? 5 : 6);
    }
    int rc = wait_child(pid, 40);
    CHECK(rc == 0 || rc == 5, "MHA under an address-space limit: %s",
          rc < 0 ? "hung (killed) or crashed" : "unexpected status");
    if (rc == 5) printf("  (the BLAS needed no new buffer here: call succeeded)\n");
#endif
}

/* ---- which OpenBLAS kernels run ---- */

static void blas_core_choice(void) {
    const attn__cpu_features none = {false, false, false, false, false},
                             avx2 = {true, false, false, false, false},
                             avx512f_only = {true, true, false, false, false},
                             avx512 = {true, true, true, false, false};
    /* An OpenBLAS older than the CPU: upgrade. */
    CHECK(strcmp(attn__blas_core_upgrade("Prescott", &avx2), "Haswell") == 0, "Prescott on AVX2");
    CHECK(strcmp(attn__blas_core_upgrade("Prescott", &avx512), "SkylakeX") == 0,
          "Prescott on AVX-512");
    CHECK(strcmp(attn__blas_core_upgrade("Haswell", &avx512), "SkylakeX") == 0,
          "AVX2 kernels on an AVX-512 Zen 5");
    CHECK(strcmp(attn__blas_core_upgrade("Zen", &avx512), "SkylakeX") == 0, "Zen on AVX-512");
    /* Already right, or nothing better: keep. */
    CHECK(attn__blas_core_upgrade("Zen", &avx2) == NULL, "Zen on Zen 3");
    CHECK(attn__blas_core_upgrade("Haswell", &avx512f_only) == NULL,
          "AVX-512F without BW/DQ/VL: SkylakeX kernels would not run");
    CHECK(attn__blas_core_upgrade("Cooperlake", &avx512) == NULL, "Cooperlake kept");
    CHECK(attn__blas_core_upgrade("Prescott", &none) == NULL, "SSE-only machine");

    /* The switch itself, through OpenBLAS's own mechanism: to Prescott (any
     * x86-64 runs it) and back; the user's OPENBLAS_CORETYPE survives. */
    const char *info = attn_blas_info();
    if (strstr(info, "DYNAMIC_ARCH") == NULL) {
        printf("  not a DYNAMIC_ARCH OpenBLAS (%s): switch not tested\n", info);
        return;
    }
    char before[64];
    const char *core = strstr(info, "core ");
    snprintf(before, sizeof before, "%s", core != NULL ? core + 5 : "?");
    const char *user = getenv("OPENBLAS_CORETYPE");
    CHECK(attn__blas_switch_core("Prescott"), "switch refused");
    CHECK(strstr(attn_blas_info(), "core Prescott") != NULL, "after switch: %s", attn_blas_info());
    CHECK(attn__blas_switch_core(before), "switch back refused");
    CHECK(strstr(attn_blas_info(), before) != NULL, "after switching back: %s", attn_blas_info());
    const char *after = getenv("OPENBLAS_CORETYPE");
    CHECK((user == NULL) == (after == NULL) && (user == NULL || strcmp(user, after) == 0),
          "OPENBLAS_CORETYPE changed");
    /* Where the machine can run better kernels than OpenBLAS picked, the
     * library has switched at load (unless the user chose). */
    if (user == NULL)
        CHECK(attn__blas_core_upgrade(before, attn__cpu()) == NULL,
              "core %s left in place on a CPU that runs better kernels", before);
}

/* ---- serving: cancellation, and index tensors changed during a call ---- */

/* The big problem (1, H, T, E) as a packed batch of one sequence (varlen)
 * and as a prefill chunk of T queries against a full contiguous cache of T
 * rows (kvcache): the same work as attn_sdpa on it. */
typedef struct serving_ctx {
    problem *p;
    attn_tensor q, k, v, out, q4, k4, v4, out4;
    int32_t cu[2];
    attn_tensor tcu;
} serving_ctx;

/* (1, H, T, E) viewed as packed (T, H, E) and as (1, T, H, E). */
static void packed_views(const attn_tensor *t, attn_tensor *packed, attn_tensor *rows) {
    *packed = *t;
    packed->rank = 3;
    packed->shape[0] = t->shape[2];
    packed->shape[1] = t->shape[1];
    packed->shape[2] = t->shape[3];
    packed->strides[0] = t->strides[2];
    packed->strides[1] = t->strides[1];
    packed->strides[2] = t->strides[3];
    *rows = *t;
    rows->shape[1] = t->shape[2];
    rows->shape[2] = t->shape[1];
    rows->strides[1] = t->strides[2];
    rows->strides[2] = t->strides[1];
}

static void serving_ctx_make(serving_ctx *c, problem *p) {
    c->p = p;
    packed_views(&p->tq, &c->q, &c->q4);
    packed_views(&p->tk, &c->k, &c->k4);
    packed_views(&p->tv, &c->v, &c->v4);
    packed_views(&p->tout, &c->out, &c->out4);
    c->cu[0] = 0;
    c->cu[1] = (int32_t)c->q.shape[0];
    const int64_t n = 2;
    attn_tensor_init(&c->tcu, c->cu, ATTN_DTYPE_I32, 1, &n);
}

static attn_status varlen_call(void *ctx) {
    serving_ctx *c = ctx;
    return attn_sdpa_varlen(&c->q, &c->k, &c->v, &c->tcu, &c->tcu, c->cu[1], c->cu[1], NULL,
                            &c->out, NULL);
}

static attn_status kvcache_call(void *ctx) {
    serving_ctx *c = ctx;
    return attn_sdpa_kvcache(&c->q4, &c->k4, &c->v4, NULL, NULL, NULL, NULL, NULL, &c->out4,
                             NULL);
}

/* Both entry points stop on the cancel flag, fused and reference. */
static void serving_cancellation(void) {
    problem big;
    problem_make(&big, 1, 8, 8192, 64, 3);
    serving_ctx c;
    serving_ctx_make(&c, &big);
    expect_cancel("fused varlen", varlen_call, &c);
    expect_cancel("fused kvcache", kvcache_call, &c);
    CHECK_OK(attn_set_isa(ATTN_ISA_REF));
    expect_cancel("reference varlen", varlen_call, &c);
    expect_cancel("reference kvcache", kvcache_call, &c);
    CHECK_OK(attn_set_isa(ATTN_ISA_AUTO));
    problem_free(&big);
}

/* A caller thread rewriting cu_seqlens and a block table while calls run
 * (a race on its side, which it may lose): each call sees the values it
 * checked, never one it did not, so every call returns ATTN_OK or refuses
 * the values and none reads outside the buffers (ASan in the sanitizer
 * tier; far pages fault here). */
typedef struct flipper {
    int32_t *slot;
    int32_t good, bad;
    volatile int stop;
} flipper;

static void *flip(void *arg) {
    flipper *f = arg;
    for (unsigned n = 0; !__atomic_load_n(&f->stop, __ATOMIC_RELAXED); n++)
        __atomic_store_n(f->slot, n & 1 ? f->bad : f->good, __ATOMIC_RELAXED);
    return NULL;
}

static void serving_indices_changing(void) {
    /* 2 sequences of 40 tokens, 2 heads, E = 16; the cache is 8 blocks of 16 rows. */
    enum { T = 80, H = 2, E = 16, NB = 8, BS = 16 };
    static float q[T * H * E], k[T * H * E], v[T * H * E], out[T * H * E];
    static float kc[NB * BS * H * E], vc[NB * BS * H * E];
    for (int i = 0; i < T * H * E; i++) q[i] = k[i] = v[i] = (float)((i * 7919) % 100) / 50.0f - 1.0f;
    for (int i = 0; i < NB * BS * H * E; i++) kc[i] = vc[i] = (float)((i * 31) % 17) / 17.0f;
    int32_t cu[3] = {0, 40, 80}, seqlens[2] = {30, 33}, table[2][4] = {{0, 1, 2, 3}, {4, 5, 6, 7}};
    const int64_t ps[3] = {T, H, E}, ns = 3, bs = 2, ts[2] = {2, 4}, cs[4] = {NB, BS, H, E},
                  qs[4] = {2, 40, H, E};
    attn_tensor tq, tk, tv, tout, tcu, tseq, ttable, tkc, tvc, q4, out4;
    attn_tensor_init(&tq, q, ATTN_DTYPE_F32, 3, ps);
    attn_tensor_init(&tk, k, ATTN_DTYPE_F32, 3, ps);
    attn_tensor_init(&tv, v, ATTN_DTYPE_F32, 3, ps);
    attn_tensor_init(&tout, out, ATTN_DTYPE_F32, 3, ps);
    attn_tensor_init(&tcu, cu, ATTN_DTYPE_I32, 1, &ns);
    attn_tensor_init(&tseq, seqlens, ATTN_DTYPE_I32, 1, &bs);
    attn_tensor_init(&ttable, table, ATTN_DTYPE_I32, 2, ts);
    attn_tensor_init(&tkc, kc, ATTN_DTYPE_F32, 4, cs);
    attn_tensor_init(&tvc, vc, ATTN_DTYPE_F32, 4, cs);
    attn_tensor_init(&q4, q, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&out4, out, ATTN_DTYPE_F32, 4, qs);
    struct { int32_t *slot, good, bad; const char *what; } races[3] = {
        {&cu[1], 40, 1 << 30, "cu_seqlens_q[1]"},
        {&seqlens[1], 33, 1 << 20, "cache_seqlens[1]"},
        {&table[1][2], 6, 1 << 28, "block_table[1, 2]"}};
    static float expect[T * H * E];
    for (int i = 0; i < 3; i++) {
#define CALL()                                                                               \
    (i == 0 ? attn_sdpa_varlen(&tq, &tk, &tv, &tcu, &tcu, 40, 40, NULL, &tout, NULL)          \
            : attn_sdpa_kvcache(&q4, &tkc, &tvc, NULL, NULL, &tseq, &ttable, NULL, &out4, NULL))
        CHECK_OK(CALL());
        memcpy(expect, out, sizeof out);
        flipper f = {races[i].slot, races[i].good, races[i].bad, 0};
        pthread_t th;
        pthread_create(&th, NULL, flip, &f);
        int ok = 0, refused = 0, other = 0;
        for (int n = 0; n < 300; n++) {
            attn_status st = CALL();
            /* Each value is read once: a call that succeeded saw good ones only. */
            if (st == ATTN_OK)
                CHECK(memcmp(out, expect, sizeof out) == 0, "%s changing: a call that "
                      "succeeded computed something else", races[i].what);
            ok += st == ATTN_OK;
            refused += st == ATTN_ERR_INVALID || st == ATTN_ERR_SHAPE;
            other += st != ATTN_OK && st != ATTN_ERR_INVALID && st != ATTN_ERR_SHAPE;
        }
        __atomic_store_n(&f.stop, 1, __ATOMIC_RELAXED);
        pthread_join(th, NULL);
        *races[i].slot = races[i].good;
        CHECK(other == 0, "%s changing: %d calls failed otherwise", races[i].what, other);
        printf("  %s changing during calls: %d succeeded, %d refused\n", races[i].what, ok,
               refused);
#undef CALL
    }
}

/* ---- the caller's stack ---- */

/* attn.h's promise: a call takes at most 64 KiB of the calling thread's
 * stack (its large buffers are workspace), so a thread with a small stack
 * (musl's default is 128 KiB) can call it. Each call below runs on a thread
 * whose stack is painted first; the bytes it touched below the thread's
 * first frame are what the call took. One thread, so every kernel runs on
 * that stack; every path the machine has; the shapes that take each kernel
 * family (tiny calls, decoding, prefill with and without causal, wide
 * heads, float64, 16-bit, the backward, MHA forward and backward). */
enum { STACK_BYTES = 4 << 20, STACK_PAINT = 0xA5, STACK_BOUND = 64 << 10 };

/* One call per kernel family: SDPA of (1, H, L|S, E) zeros (with its
 * backward when `backward`), or MHA (E = 64, 4 heads, (L = 40, N = 2, E))
 * forward_train and backward when `mha`. */
typedef struct stack_case {
    const char *name;
    int64_t H, L, S, E;
    attn_dtype dt;
    bool causal, backward, mha;
} stack_case;

static const stack_case stack_cases[] = {
    {"tiny (1,1,16,16,128)", 1, 16, 16, 128, ATTN_DTYPE_F32, false, false, false},
    {"decode (1,2,1,600,128)", 2, 1, 600, 128, ATTN_DTYPE_F32, false, false, false},
    {"prefill (1,2,300,300,64) causal", 2, 300, 300, 64, ATTN_DTYPE_F32, true, false, false},
    {"wide head (1,2,100,100,256)", 2, 100, 100, 256, ATTN_DTYPE_F32, false, false, false},
    {"float64 (1,2,100,100,64)", 2, 100, 100, 64, ATTN_DTYPE_F64, false, false, false},
    {"bfloat16 (1,2,300,300,128) causal", 2, 300, 300, 128, ATTN_DTYPE_BF16, true, false, false},
    {"float16 (1,2,100,100,64)", 2, 100, 100, 64, ATTN_DTYPE_F16, false, false, false},
    {"backward (1,2,100,100,64) causal", 2, 100, 100, 64, ATTN_DTYPE_F32, true, true, false},
    {"MHA forward_train + backward", 0, 0, 0, 0, ATTN_DTYPE_F32, false, false, true},
};

typedef struct stack_job {
    const stack_case *c;
    const unsigned char *base; /* the painted stack's lowest byte */
    size_t used;               /* bytes the call touched */
    attn_status st;
    char message[256];         /* the job thread's own error message */
} stack_job;

static attn_status stack_sdpa(const stack_case *c) {
    const int64_t qs[4] = {1, c->H, c->L, c->E}, ks[4] = {1, c->H, c->S, c->E};
    const attn_dtype dts[8] = {c->dt, c->dt, c->dt, c->dt, ATTN_DTYPE_F32, c->dt, c->dt, c->dt};
    const int64_t *shapes[8] = {qs, ks, ks, qs, qs, qs, ks, ks};
    rng r = {1};
    test_tensor t[8]; /* q, k, v, out, lse (rank 3), dq, dk, dv: zeros */
    for (int i = 0; i < 8; i++)
        tt_make_output(&t[i], &r, dts[i], i == 4 ? 3 : 4, shapes[i], LAYOUT_CONTIGUOUS);
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    p.causal = c->causal ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    attn_status st = attn_sdpa(&t[0].t, &t[1].t, &t[2].t, &p, &t[3].t, NULL,
                               c->backward ? &t[4].t : NULL);
    if (st == ATTN_OK && c->backward) /* dout: the zeroed output itself */
        st = attn_sdpa_backward(&t[3].t, &t[0].t, &t[1].t, &t[2].t, &t[3].t, &t[4].t, &p,
                                &t[5].t, &t[6].t, &t[7].t, NULL);
    for (int i = 0; i < 8; i++) tt_free(&t[i]);
    return st;
}

static attn_status stack_mha(void) {
    const int64_t xs[3] = {40, 2, 64};
    rng r = {1};
    test_tensor t[3]; /* x (query, key and value), y, dx: zeros */
    for (int i = 0; i < 3; i++) tt_make_output(&t[i], &r, ATTN_DTYPE_F32, 3, xs, LAYOUT_CONTIGUOUS);
    attn_mha *m = NULL;
    attn_mha_saved *saved = NULL;
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, 64, 4);
    attn_status st = attn_mha_create(&cfg, &m);
    if (st == ATTN_OK)
        st = attn_mha_forward_train(m, &t[0].t, &t[0].t, &t[0].t, NULL, &t[1].t, NULL, &saved);
    if (st == ATTN_OK)
        st = attn_mha_backward(m, saved, &t[0].t, &t[0].t, &t[0].t, &t[1].t, &t[2].t, NULL, NULL,
                               NULL);
    attn_mha_saved_destroy(saved);
    attn_mha_destroy(m);
    for (int i = 0; i < 3; i++) tt_free(&t[i]);
    return st;
}

static void *stack_job_run(void *arg) {
    stack_job *j = arg;
    volatile unsigned char top = 0; /* the thread's first frame */
    j->st = j->c->mha ? stack_mha() : stack_sdpa(j->c);
    snprintf(j->message, sizeof j->message, "%s", attn_last_error());
    const unsigned char *low = j->base;
    while (low < (const unsigned char *)&top && *low == STACK_PAINT) low++;
    j->used = (size_t)((const unsigned char *)&top - low);
    return NULL;
}

static void caller_stack(void) {
    /* sanitizers' frames are larger by design (ASan: 476 KiB) */
    const bool bounded = !UNDER_SANITIZER;
    const int threads = attn_get_num_threads();
    attn_set_num_threads(1);
    unsigned char *stack = NULL;
    CHECK(posix_memalign((void **)&stack, 4096, STACK_BYTES) == 0, "no stack");
    for (int isa = ATTN_ISA_REF; stack != NULL && isa <= ATTN_ISA_LAST; isa++) {
        if (!attn_isa_supported((attn_isa)isa)) continue;
        CHECK_OK(attn_set_isa((attn_isa)isa));
        size_t most = 0;
        for (size_t c = 0; c < sizeof stack_cases / sizeof *stack_cases; c++) {
            const char *name = stack_cases[c].name, *path = attn_isa_name((attn_isa)isa);
            memset(stack, STACK_PAINT, STACK_BYTES);
            stack_job j = {&stack_cases[c], stack, 0, ATTN_OK, ""};
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setstack(&attr, stack, STACK_BYTES);
            pthread_t t;
            const bool started = pthread_create(&t, &attr, stack_job_run, &j) == 0;
            pthread_attr_destroy(&attr);
            CHECK(started, "%s on %s: no thread", name, path);
            if (!started) continue;
            pthread_join(t, NULL);
            CHECK(j.st == ATTN_OK, "%s on %s: %s", name, path, j.message);
            CHECK(!bounded || j.used <= STACK_BOUND, "%s on %s took %zu bytes of stack (at most %d)",
                  name, path, j.used, STACK_BOUND);
            most = j.used > most ? j.used : most;
        }
        printf("  %s: at most %.1f KiB of the caller's stack\n", attn_isa_name((attn_isa)isa),
               most / 1024.0);
    }
    free(stack);
    CHECK_OK(attn_set_isa(ATTN_ISA_AUTO));
    attn_set_num_threads(threads);
}

HARNESS_MAIN(T(address_space_limit), T(fork_after_parallel_call), T(cancellation),
             T(overlapping_outputs), T(blas_core_choice), T(serving_cancellation),
             T(serving_indices_changing), T(caller_stack))
