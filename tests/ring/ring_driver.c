/*
 * ring_driver — one MPI program for the ring's tests that run outside one
 * process's control: two hosts (scripts/ring_netns.sh), faults
 * (tests/ring/faults.sh) and the link's speed.
 *
 *   ring_driver [check] [shape and options]   attn_ring_sdpa on this rank's
 *       shard of seeded random q, k, v, against single-process attn_sdpa on
 *       the whole tensors (rows picked by the layout's formula, written out
 *       here, not taken from the library); prints each rank's max |error|
 *       and PASS/FAIL. Exit 0 when every check on this rank passes.
 *   ring_driver pingpong [--bytes N]...   rank 0 <-> rank 1: one-way latency
 *       of small messages and bandwidth of large ones, both one way and in
 *       the ring's pattern (every rank sends and receives at once).
 *
 * Options: -B -H --kv-heads -L -S -E --Ev (sizes; L and S are the whole
 * sequence), --causal, --layout zigzag|contiguous, --dropout P, --seed N,
 * --timeout S (params.timeout), --threads N, --repeat N (calls; all must
 * give the same bits), --tol X, --no-check (skip the reference: for faults),
 * --pid-dir DIR (write DIR/rank<r>.pid just before the ring call, so a test
 * knows the ranks are computing), --mismatch seq|E|heads|causal with
 * --mismatch-rank R (rank R calls with that one thing different) and
 * --expect-error NAME[,NAME] (pass only if the call fails with ATTN_ERR_<NAME>
 * before any compute: sooner than half of one step's local compute),
 * --stop-after-call N with --stop-rank R (rank R stops itself with SIGSTOP
 * once its call N has returned: a peer hung between two calls).
 * After ATTN_ERR_COMM the driver calls MPI_Abort, as attn_ring.h says.
 */
#define _GNU_SOURCE /* getopt_long, gethostname */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "attn.h"
#include "attn_ring.h"

typedef struct opts {
    int64_t B, H, Hkv, L, S, E, Ev;
    int causal;
    attn_ring_layout layout;
    double dropout;
    uint64_t seed;
    double timeout;
    int threads, repeat, check;
    double tol;
    const char *pid_dir;
    const char *mismatch;
    int mismatch_rank;
    const char *expect_error;
    int stop_after, stop_rank;
} opts;

static int g_rank, g_size;

static void die(const char *msg) {
    fprintf(stderr, "ring_driver: rank %d: %s\n", g_rank, msg);
    MPI_Abort(MPI_COMM_WORLD, 2);
    exit(2);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p)
        die("out of memory");
    return p;
}

/* splitmix64: the same values on every rank, from (seed, tensor, index). */
static uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void fill(float *x, int64_t n, uint64_t seed, uint64_t tag) {
    uint64_t base = mix(seed ^ mix(tag));
    for (int64_t i = 0; i < n; i++)
        x[i] = (float)((double)(mix(base + (uint64_t)i) >> 11) * 0x1.0p-53 * 4.0 - 2.0);
}

/* The positions of rank r's shard of T, straight from attn_ring.h's words. */
static int shard_runs(attn_ring_layout layout, int64_t T, int N, int r, int64_t start[2],
                      int64_t len[2]) {
    if (layout == ATTN_RING_ZIGZAG) {
        int64_t c0 = r, c1 = 2 * N - 1 - r;
        start[0] = c0 * T / (2 * N);
        len[0] = (c0 + 1) * T / (2 * N) - start[0];
        start[1] = c1 * T / (2 * N);
        len[1] = (c1 + 1) * T / (2 * N) - start[1];
        return 2;
    }
    start[0] = r * T / N;
    len[0] = (r + 1) * T / N - start[0];
    return 1;
}

/* Rows [positions of the shard] of a (outer, T, inner) array into dst, then
 * `pad` rows of zeros (a shard longer than the layout's, for --mismatch). */
static void gather_rows(const float *src, float *dst, int64_t outer, int64_t T, int64_t inner,
                        int nruns, const int64_t *start, const int64_t *len, int64_t pad) {
    int64_t n = pad;
    for (int i = 0; i < nruns; i++)
        n += len[i];
    for (int64_t o = 0; o < outer; o++) {
        float *d = dst + o * n * inner;
        for (int i = 0; i < nruns; i++) {
            memcpy(d, src + (o * T + start[i]) * inner, (size_t)(len[i] * inner) * sizeof(float));
            d += len[i] * inner;
        }
        memset(d, 0, (size_t)(pad * inner) * sizeof(float));
    }
}

static attn_tensor view4(float *data, int64_t a, int64_t b, int64_t c, int64_t d) {
    attn_tensor t;
    int64_t shape[4] = {a, b, c, d};
    if (attn_tensor_init(&t, data, ATTN_DTYPE_F32, 4, shape) != ATTN_OK)
        die(attn_last_error());
    return t;
}

static const char *status_name(attn_status s) {
    static const char *names[] = {"OK",       "NULL",  "INVALID",     "SHAPE",     "DTYPE",
                                  "OVERFLOW", "NOMEM", "IO",          "FORMAT",    "UNSUPPORTED",
                                  "CANCELLED", "OVERLAP", "COMM"};
    return (unsigned)s < sizeof names / sizeof names[0] ? names[s] : "?";
}

static void write_pid(const char *dir) {
    char path[4096], tmp[4200], host[256] = "?";
    gethostname(host, sizeof host - 1);
    snprintf(path, sizeof path, "%s/rank%d.pid", dir, g_rank);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        die(strerror(errno));
    fprintf(f, "%ld %s\n", (long)getpid(), host);
    /* rename: a reader never sees a half-written file */
    if (fclose(f) != 0 || rename(tmp, path) != 0)
        die(strerror(errno));
}

/* The whole tensors (the same on every rank; a mismatched rank draws its
 * own) and this rank's shards of them. */
typedef struct shards {
    int64_t B, H, Hkv, L, S, E, Ev;
    float *q, *k, *v;    /* (B, H or Hkv, L or S, E or Ev) */
    int nq, nk;          /* runs of this rank's query and key positions */
    int64_t qs[2], ql[2], ks[2], kl[2];
    int64_t Lr, Sr, Sx;  /* this rank's lengths; Sx = Sr + 1 under --mismatch seq */
    float *qr, *kr, *vr; /* the shards: (B, H or Hkv, Lr or Sx, E or Ev) */
} shards;

static void make_shards(const opts *o, int mis_seq, int mis_E, int mis_heads, shards *sh) {
    const int N = g_size, r = g_rank;
    sh->B = o->B, sh->H = o->H + mis_heads, sh->Hkv = o->Hkv + mis_heads;
    sh->L = o->L, sh->S = o->S, sh->E = o->E + mis_E, sh->Ev = o->Ev;
    const int64_t B = sh->B, H = sh->H, Hkv = sh->Hkv, L = sh->L, S = sh->S, E = sh->E,
                  Ev = sh->Ev;
    sh->q = xmalloc((size_t)(B * H * L * E) * sizeof(float));
    sh->k = xmalloc((size_t)(B * Hkv * S * E) * sizeof(float));
    sh->v = xmalloc((size_t)(B * Hkv * S * Ev) * sizeof(float));
    fill(sh->q, B * H * L * E, o->seed, 1);
    fill(sh->k, B * Hkv * S * E, o->seed, 2);
    fill(sh->v, B * Hkv * S * Ev, o->seed, 3);
    sh->nq = shard_runs(o->layout, L, N, r, sh->qs, sh->ql);
    sh->nk = shard_runs(o->layout, S, N, r, sh->ks, sh->kl);
    sh->Lr = sh->Sr = 0;
    for (int i = 0; i < sh->nq; i++) sh->Lr += sh->ql[i];
    for (int i = 0; i < sh->nk; i++) sh->Sr += sh->kl[i];
    if (sh->Lr < 1 || sh->Sr < 1)
        die("a rank would hold no position: make L and S at least 2 x ranks");
    /* mis_seq: one key more than the layout gives (taken from the next one) */
    const int64_t Lr = sh->Lr, Sx = sh->Sx = sh->Sr + mis_seq;
    sh->qr = xmalloc((size_t)(B * H * Lr * E) * sizeof(float));
    sh->kr = xmalloc((size_t)(B * Hkv * Sx * E) * sizeof(float));
    sh->vr = xmalloc((size_t)(B * Hkv * Sx * Ev) * sizeof(float));
    gather_rows(sh->q, sh->qr, B * H, L, E, sh->nq, sh->qs, sh->ql, 0);
    gather_rows(sh->k, sh->kr, B * Hkv, S, E, sh->nk, sh->ks, sh->kl, mis_seq);
    gather_rows(sh->v, sh->vr, B * Hkv, S, Ev, sh->nk, sh->ks, sh->kl, mis_seq);
}

static void free_shards(shards *sh) {
    free(sh->q), free(sh->k), free(sh->v), free(sh->qr), free(sh->kr), free(sh->vr);
}

/* The library's shard helper must agree with the formula above. */
static int check_shard_helper(const opts *o, const shards *sh) {
    const size_t bytes = (size_t)(sh->B * sh->H * sh->Lr * sh->E) * sizeof(float);
    attn_tensor whole = view4(sh->q, sh->B, sh->H, sh->L, sh->E);
    float *qh = xmalloc(bytes);
    attn_tensor part = view4(qh, sh->B, sh->H, sh->Lr, sh->E);
    attn_status st = attn_ring_shard(&whole, -2, o->layout, g_size, g_rank, &part);
    const int bad = st != ATTN_OK || memcmp(qh, sh->qr, bytes) != 0;
    if (bad)
        fprintf(stderr, "rank %d: attn_ring_shard %s: %s\n", g_rank,
                st ? "failed" : "gives other rows than attn_ring.h's layout",
                st ? attn_last_error() : "");
    free(qh);
    return bad;
}

/* --expect-error: whether the call was refused with one of the names
 * (NAME or NAME,NAME) before computing (in under half of one step's local
 * compute, t_step); prints the verdict. */
static int refused_as_expected(const opts *o, attn_status st, double dt, double t_step) {
    char want[64], got[32];
    snprintf(want, sizeof want, ",%s,", o->expect_error);
    snprintf(got, sizeof got, ",%s,", status_name(st));
    const int ok = st != ATTN_OK && strstr(want, got) && dt < 0.5 * t_step;
    printf("rank %d: %s (one of %s, before compute) after %.4f s, one step computing "
           "in %.3f s: ATTN_ERR_%s: %s\n",
           g_rank, ok ? "refused as expected" : "FAIL: expected a refusal", o->expect_error, dt,
           t_step, status_name(st), st ? attn_last_error() : "the call succeeded");
    fflush(stdout);
    return ok;
}

/* The first call's output against attn_sdpa on the whole tensors, and its
 * bits' FNV-1a (runs elsewhere, two hosts, must give these bits too).
 * Returns whether it passes. */
static int check_against_whole(const opts *o, const shards *sh, const attn_sdpa_params *sp,
                               const float *first, int fails) {
    const int64_t B = sh->B, H = sh->H, Hkv = sh->Hkv, L = sh->L, S = sh->S, E = sh->E,
                  Ev = sh->Ev, Lr = sh->Lr, n = B * H * Lr * Ev;
    attn_tensor wq = view4(sh->q, B, H, L, E), wk = view4(sh->k, B, Hkv, S, E),
                wv = view4(sh->v, B, Hkv, S, Ev);
    float *ref = xmalloc((size_t)(B * H * L * Ev) * sizeof(float));
    float *refr = xmalloc((size_t)n * sizeof(float));
    attn_tensor tref = view4(ref, B, H, L, Ev);
    if (attn_sdpa(&wq, &wk, &wv, sp, &tref, NULL, NULL) != ATTN_OK) die(attn_last_error());
    gather_rows(ref, refr, B * H, L, Ev, sh->nq, sh->qs, sh->ql, 0);
    double err = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)first[i] - (double)refr[i]);
        if (!(d <= err)) /* NaN counts */
            err = isnan(d) ? INFINITY : d;
    }
    char host[256] = "?";
    gethostname(host, sizeof host - 1);
    uint64_t h = 0xcbf29ce484222325ull;
    const unsigned char *bytes = (const unsigned char *)first;
    for (size_t i = 0; i < (size_t)n * sizeof(float); i++) h = (h ^ bytes[i]) * 0x100000001b3ull;
    const int pass = err <= o->tol && !fails;
    printf("rank %d of %d on %s: L_shard %lld S_shard %lld, max |ring - attn_sdpa| = %.3g "
           "(tol %.1g)%s, out fnv1a %016llx: %s\n",
           g_rank, g_size, host, (long long)Lr, (long long)sh->Sr, err, o->tol,
           o->repeat > 1 ? (fails ? ", repeats differ" : ", repeats bitwise equal") : "",
           (unsigned long long)h, pass ? "PASS" : "FAIL");
    free(ref);
    free(refr);
    return pass;
}

/* --repeat ring calls: each the first's bits; a stop after one of them
 * (--stop-after). Returns the number of differing repeats, or -1 - exit
 * status when the run ends here (--expect-error, a failed call). */
static int run_calls(const opts *o, const shards *sh, const attn_ring_params *p,
                     attn_ring_stats *stats, double t_step, float *out, float *first) {
    const size_t bytes = (size_t)(sh->B * sh->H * sh->Lr * sh->Ev) * sizeof(float);
    attn_tensor tq = view4(sh->qr, sh->B, sh->H, sh->Lr, sh->E),
                tk = view4(sh->kr, sh->B, sh->Hkv, sh->Sx, sh->E),
                tv = view4(sh->vr, sh->B, sh->Hkv, sh->Sx, sh->Ev),
                tout = view4(out, sh->B, sh->H, sh->Lr, sh->Ev);
    int fails = 0;
    for (int it = 0; it < o->repeat; it++) {
        memset(out, 0xff, bytes); /* NaN: no stale rows */
        double t0 = MPI_Wtime();
        attn_status st = attn_ring_sdpa(MPI_COMM_WORLD, &tq, &tk, &tv, p, &tout, NULL);
        double dt = MPI_Wtime() - t0;
        if (o->expect_error) return -1 - !refused_as_expected(o, st, dt, t_step);
        if (st != ATTN_OK) {
            fprintf(stderr, "rank %d: attn_ring_sdpa failed after %.3f s: ATTN_ERR_%s: %s\n",
                    g_rank, dt, status_name(st), attn_last_error());
            fflush(stderr);
            if (st == ATTN_ERR_COMM) /* the job is broken: attn_ring.h */
                MPI_Abort(MPI_COMM_WORLD, 4);
            return -1 - 3;
        }
        if (it == 0) {
            memcpy(first, out, bytes);
            printf("rank %d: ring call %.3f s (compute %.3f, wait %.3f, agree %.4f; %d steps, "
                   "%lld bytes sent)\n",
                   g_rank, dt, stats->compute, stats->wait, stats->agree, stats->steps,
                   (long long)stats->bytes_sent);
        } else if (memcmp(first, out, bytes)) {
            fprintf(stderr, "rank %d: FAIL: call %d gave other bits than call 1\n", g_rank, it + 1);
            fails++;
        }
        if (it + 1 == o->stop_after && g_rank == o->stop_rank) {
            printf("rank %d: call %d returned; stopping (SIGSTOP)\n", g_rank, it + 1);
            fflush(stdout);
            raise(SIGSTOP);
        }
    }
    return fails;
}

static int run_check(const opts *o) {
    int mis_seq = 0, mis_E = 0, mis_heads = 0, mis_causal = 0;
    if (o->mismatch && g_rank == o->mismatch_rank) {
        mis_seq = !strcmp(o->mismatch, "seq");
        mis_E = !strcmp(o->mismatch, "E");
        mis_heads = !strcmp(o->mismatch, "heads");
        mis_causal = !strcmp(o->mismatch, "causal");
    }
    shards sh;
    make_shards(o, mis_seq, mis_E, mis_heads, &sh);
    if (!o->mismatch && check_shard_helper(o, &sh)) return 1;

    const size_t out_bytes = (size_t)(sh.B * sh.H * sh.Lr * sh.Ev) * sizeof(float);
    float *out = xmalloc(out_bytes), *first = xmalloc(out_bytes);
    attn_ring_params p;
    attn_ring_params_init(&p);
    p.sdpa.causal = (o->causal ^ mis_causal) ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    p.sdpa.enable_gqa = sh.Hkv != sh.H;
    p.sdpa.dropout_p = o->dropout;
    p.sdpa.seed = o->seed;
    p.layout = o->layout;
    p.timeout = o->timeout;
    attn_ring_stats stats;
    p.stats = &stats;

    /* For --expect-error: one step's local compute, what "before any
     * compute" is measured against. */
    double t_step = 0;
    if (o->expect_error) {
        attn_sdpa_params sp = p.sdpa;
        sp.causal = ATTN_CAUSAL_NONE;
        sp.dropout_p = 0;
        attn_tensor tq = view4(sh.qr, sh.B, sh.H, sh.Lr, sh.E),
                    tk = view4(sh.kr, sh.B, sh.Hkv, sh.Sx, sh.E),
                    tv = view4(sh.vr, sh.B, sh.Hkv, sh.Sx, sh.Ev),
                    tout = view4(out, sh.B, sh.H, sh.Lr, sh.Ev);
        double t0 = MPI_Wtime();
        if (attn_sdpa(&tq, &tk, &tv, &sp, &tout, NULL, NULL) != ATTN_OK) die(attn_last_error());
        t_step = MPI_Wtime() - t0;
    }

    /* All ranks start together: a refusal's time is then the call's own.
     * Only here: between the calls a barrier would be a wait with no
     * deadline, where a rank stopped at the end of one call hangs the job
     * (tests/ring/faults.sh stop); the next call's bounded waits find it. */
    MPI_Barrier(MPI_COMM_WORLD);
    if (o->pid_dir) write_pid(o->pid_dir);
    int fails = run_calls(o, &sh, &p, &stats, t_step, out, first);
    if (fails < 0) return -1 - fails; /* the run ends here, with this status */
    if (o->check) fails += !check_against_whole(o, &sh, &p.sdpa, first, fails);
    fflush(stdout);
    free_shards(&sh);
    free(out), free(first);
    return fails ? 1 : 0;
}

/* Median of n doubles (sorts them). */
static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, cmp_d);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

/* Rank 0 <-> 1. Latency: half the round trip of 8 bytes. Bandwidth: n bytes
 * one way, timed to the 8-byte reply; and both ways at once (Sendrecv), as
 * the ring moves its shards. JSON on rank 0's stdout. */
static int run_pingpong(int reps) {
    if (g_size < 2)
        die("pingpong needs 2 ranks");
    const int peer = 1 - g_rank;
    if (g_rank > 1) {
        MPI_Barrier(MPI_COMM_WORLD);
        return 0;
    }
    const size_t big = (size_t)64 << 20;
    char *a = xmalloc(big), *b = xmalloc(big);
    memset(a, 1, big);
    memset(b, 2, big);
    double *t = xmalloc((size_t)reps * sizeof(double));
    if (g_rank == 0)
        printf("{\"hosts\": 2, \"results\": [\n");
    static const size_t sizes[] = {8, 1024, 65536, 1 << 20, 16 << 20, 64 << 20};
    const int nsizes = (int)(sizeof sizes / sizeof sizes[0]);
    for (int si = 0; si < nsizes; si++) {
        const size_t n = sizes[si];
        const int nr = n <= 65536 ? reps * 20 : reps;
        double *tt = n <= 65536 ? xmalloc((size_t)nr * sizeof(double)) : t;
        for (int it = -2; it < nr; it++) { /* two warm-ups: connections, pages */
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            if (g_rank == 0) {
                MPI_Send(a, (int)n, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
                MPI_Recv(b, 8, MPI_CHAR, peer, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            } else {
                MPI_Recv(b, (int)n, MPI_CHAR, peer, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                MPI_Send(a, 8, MPI_CHAR, peer, 2, MPI_COMM_WORLD);
            }
            if (it >= 0)
                tt[it] = MPI_Wtime() - t0;
        }
        double one = median(tt, nr);
        /* both ways at once */
        double both = 0;
        if (n >= 65536) {
            for (int it = -2; it < reps; it++) {
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                MPI_Sendrecv(a, (int)n, MPI_CHAR, peer, 3, b, (int)n, MPI_CHAR, peer, 3,
                             MPI_COMM_WORLD, MPI_STATUS_IGNORE);
                if (it >= 0)
                    t[it] = MPI_Wtime() - t0;
            }
            both = median(t, reps);
        }
        if (g_rank == 0) {
            if (n == 8)
                printf("  {\"bytes\": 8, \"round_trip_us\": %.2f, \"latency_us\": %.2f},\n",
                       one * 1e6, one * 0.5e6);
            else if (both > 0)
                printf("  {\"bytes\": %zu, \"one_way_s\": %.6g, \"one_way_gbit_s\": %.3f, "
                       "\"both_ways_s\": %.6g, \"both_ways_gbit_s_each\": %.3f}%s\n",
                       n, one, n * 8.0 / one / 1e9, both, n * 8.0 / both / 1e9,
                       si + 1 < nsizes ? "," : "");
            else
                printf("  {\"bytes\": %zu, \"one_way_s\": %.6g, \"one_way_gbit_s\": %.3f}%s\n",
                       n, one, n * 8.0 / one / 1e9, si + 1 < nsizes ? "," : "");
        }
        if (tt != t)
            free(tt);
    }
    if (g_rank == 0)
        printf("]}\n");
    fflush(stdout);
    MPI_Barrier(MPI_COMM_WORLD);
    free(a), free(b), free(t);
    return 0;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);

    opts o = {.B = 1, .H = 2, .Hkv = 0, .L = 512, .S = 0, .E = 64, .Ev = 0, .seed = 1,
              .timeout = 60, .threads = 1, .repeat = 1, .check = 1, .tol = 1e-5,
              .layout = ATTN_RING_ZIGZAG, .mismatch_rank = -1, .stop_rank = -1};
    int mode_pingpong = 0, reps = 5;
    if (argc > 1 && argv[1][0] != '-') {
        if (!strcmp(argv[1], "pingpong"))
            mode_pingpong = 1;
        else if (strcmp(argv[1], "check"))
            die("the mode is check or pingpong");
        argv++, argc--;
    }
    static const struct option lo[] = {
        {"kv-heads", 1, 0, 'K'}, {"Ev", 1, 0, 'V'},      {"causal", 0, 0, 'c'},
        {"layout", 1, 0, 'y'},   {"dropout", 1, 0, 'd'}, {"seed", 1, 0, 's'},
        {"timeout", 1, 0, 't'},  {"threads", 1, 0, 'T'}, {"repeat", 1, 0, 'r'},
        {"tol", 1, 0, 'o'},      {"no-check", 0, 0, 'n'}, {"pid-dir", 1, 0, 'p'},
        {"mismatch", 1, 0, 'm'}, {"mismatch-rank", 1, 0, 'R'}, {"expect-error", 1, 0, 'x'},
        {"reps", 1, 0, 'e'},     {"stop-after-call", 1, 0, 'a'}, {"stop-rank", 1, 0, 'b'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "B:H:L:S:E:", lo, NULL)) != -1) {
        switch (c) {
        case 'B': o.B = atoll(optarg); break;
        case 'H': o.H = atoll(optarg); break;
        case 'K': o.Hkv = atoll(optarg); break;
        case 'L': o.L = atoll(optarg); break;
        case 'S': o.S = atoll(optarg); break;
        case 'E': o.E = atoll(optarg); break;
        case 'V': o.Ev = atoll(optarg); break;
        case 'c': o.causal = 1; break;
        case 'y':
            if (!strcmp(optarg, "zigzag"))
                o.layout = ATTN_RING_ZIGZAG;
            else if (!strcmp(optarg, "contiguous"))
                o.layout = ATTN_RING_CONTIGUOUS;
            else
                die("--layout is zigzag or contiguous");
            break;
        case 'd': o.dropout = atof(optarg); break;
        case 's': o.seed = strtoull(optarg, NULL, 0); break;
        case 't': o.timeout = atof(optarg); break;
        case 'T': o.threads = atoi(optarg); break;
        case 'r': o.repeat = atoi(optarg); break;
        case 'o': o.tol = atof(optarg); break;
        case 'n': o.check = 0; break;
        case 'p': o.pid_dir = optarg; break;
        case 'm': o.mismatch = optarg; break;
        case 'R': o.mismatch_rank = atoi(optarg); break;
        case 'x': o.expect_error = optarg; break;
        case 'e': reps = atoi(optarg); break;
        case 'a': o.stop_after = atoi(optarg); break;
        case 'b': o.stop_rank = atoi(optarg); break;
        default: die("bad option (see the comment at the top of ring_driver.c)");
        }
    }
    if (!o.S)
        o.S = o.L;
    if (!o.Hkv)
        o.Hkv = o.H;
    if (!o.Ev)
        o.Ev = o.E;
    if (o.mismatch && (o.mismatch_rank < 0 || o.mismatch_rank >= g_size))
        o.mismatch_rank = g_size - 1;
    if (o.repeat < 1 || reps < 1 || o.B < 1 || o.H < 1 || o.L < 1 || o.E < 1)
        die("sizes and counts must be >= 1");
    attn_set_num_threads(o.threads);

    int rc = mode_pingpong ? run_pingpong(reps) : run_check(&o);
    MPI_Finalize();
    return rc;
}
