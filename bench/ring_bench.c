/*
 * ring_bench — times attn_ring_sdpa on this communicator (bench/ring_run.py
 * launches it on 1 and 2 ranks, on one host and over the veth pair).
 *
 *   mpirun -np N ring_bench [-B 1] [-H 4] [-L 16384] [-S L] [-E 64] [--causal]
 *           [--reps 3] [--warmup 1] [--threads 1] [--local]
 *
 * Each rank draws its own shard (the values do not matter to the time), all
 * ranks start each call together (a barrier), and a call's time is the
 * slowest rank's. --local times single-process attn_sdpa on the whole
 * tensors instead (needs one rank): the baseline the ring must match.
 * Prints one JSON object on rank 0: every call's time, the median, and for
 * the median call each rank's attn_ring_stats (per step: compute, and the
 * wait for the next shard that the compute did not hide) and its CPU time
 * (wall well above CPU time means the rank was preempted: a busy machine).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attn.h"
#include "attn_ring.h"

static int g_rank, g_size;

static void die(const char *what, const char *msg) {
    fprintf(stderr, "ring_bench: rank %d: %s: %s\n", g_rank, what, msg);
    MPI_Abort(MPI_COMM_WORLD, 2);
    exit(2);
}

static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static float *random_floats(int64_t n, uint64_t seed) {
    float *x = malloc((size_t)n * sizeof(float));
    if (!x)
        die("malloc", "out of memory");
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17; /* xorshift64 */
        x[i] = (float)((double)(s >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    }
    return x;
}

static attn_tensor view4(float *data, int64_t a, int64_t b, int64_t c, int64_t d) {
    attn_tensor t;
    int64_t shape[4] = {a, b, c, d};
    if (attn_tensor_init(&t, data, ATTN_DTYPE_F32, 4, shape) != ATTN_OK)
        die("attn_tensor_init", attn_last_error());
    return t;
}

static int64_t shard_len(int64_t total, int n, int r) {
    int nruns;
    int64_t start[2], len[2];
    if (attn_ring_shard_runs(ATTN_RING_ZIGZAG, total, n, r, &nruns, start, len) != ATTN_OK)
        die("attn_ring_shard_runs", attn_last_error());
    return len[0] + (nruns > 1 ? len[1] : 0);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* What each rank reports of one call (gathered to rank 0). */
typedef struct rank_report {
    double total, agree, compute, wait, cpu;
    int32_t steps, pad;
    double step_compute[64], step_wait[64];
    int64_t bytes_sent;
} rank_report;

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    int64_t B = 1, H = 4, L = 16384, S = 0, E = 64;
    int causal = 0, reps = 3, warmup = 1, threads = 1, local = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "--causal"))
            causal = 1;
        else if (!strcmp(a, "--local"))
            local = 1;
        else if (more && !strcmp(a, "-B"))
            B = atoll(argv[++i]);
        else if (more && !strcmp(a, "-H"))
            H = atoll(argv[++i]);
        else if (more && !strcmp(a, "-L"))
            L = atoll(argv[++i]);
        else if (more && !strcmp(a, "-S"))
            S = atoll(argv[++i]);
        else if (more && !strcmp(a, "-E"))
            E = atoll(argv[++i]);
        else if (more && !strcmp(a, "--reps"))
            reps = atoi(argv[++i]);
        else if (more && !strcmp(a, "--warmup"))
            warmup = atoi(argv[++i]);
        else if (more && !strcmp(a, "--threads"))
            threads = atoi(argv[++i]);
        else
            die(a, "unknown option (see the comment at the top of ring_bench.c)");
    }
    if (!S)
        S = L;
    if (B < 1 || H < 1 || L < 1 || S < 1 || E < 1 || reps < 1 || warmup < 0 || threads < 1)
        die("options", "sizes and counts must be >= 1");
    if (local && g_size != 1)
        die("--local", "times one process: run it with -np 1");
    attn_set_num_threads(threads);

    const int64_t Lr = local ? L : shard_len(L, g_size, g_rank);
    const int64_t Sr = local ? S : shard_len(S, g_size, g_rank);
    float *q = random_floats(B * H * Lr * E, 1 + 3 * (uint64_t)g_rank);
    float *k = random_floats(B * H * Sr * E, 2 + 3 * (uint64_t)g_rank);
    float *v = random_floats(B * H * Sr * E, 3 + 3 * (uint64_t)g_rank);
    float *o = malloc((size_t)(B * H * Lr * E) * sizeof(float));
    if (!o)
        die("malloc", "out of memory");
    attn_tensor tq = view4(q, B, H, Lr, E), tk = view4(k, B, H, Sr, E), tv = view4(v, B, H, Sr, E),
                to = view4(o, B, H, Lr, E);
    attn_ring_params p;
    attn_ring_params_init(&p);
    p.sdpa.causal = causal ? ATTN_CAUSAL_TOP_LEFT : ATTN_CAUSAL_NONE;
    attn_ring_stats st;
    p.stats = &st;

    double *times = calloc((size_t)reps, sizeof(double));
    rank_report *mine = calloc((size_t)reps, sizeof(rank_report));
    if (!times || !mine)
        die("calloc", "out of memory");
    for (int it = -warmup; it < reps; it++) {
        memset(&st, 0, sizeof st);
        MPI_Barrier(MPI_COMM_WORLD);
        double c0 = cpu_seconds(), t0 = MPI_Wtime();
        attn_status s = local ? attn_sdpa(&tq, &tk, &tv, &p.sdpa, &to, NULL, NULL)
                              : attn_ring_sdpa(MPI_COMM_WORLD, &tq, &tk, &tv, &p, &to, NULL);
        double t = MPI_Wtime() - t0, c = cpu_seconds() - c0;
        if (s != ATTN_OK)
            die(local ? "attn_sdpa" : "attn_ring_sdpa", attn_last_error());
        double slowest;
        MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (it < 0)
            continue;
        times[it] = slowest;
        rank_report *m = &mine[it];
        m->total = local ? t : st.total;
        m->agree = st.agree, m->compute = local ? t : st.compute, m->wait = st.wait, m->cpu = c;
        m->steps = local ? 1 : st.steps;
        memcpy(m->step_compute, st.step_compute, sizeof m->step_compute);
        memcpy(m->step_wait, st.step_wait, sizeof m->step_wait);
        if (local)
            m->step_compute[0] = t;
        m->bytes_sent = st.bytes_sent;
    }

    /* the median call (by the slowest rank's time), the same on all ranks */
    double *sorted = malloc((size_t)reps * sizeof(double));
    memcpy(sorted, times, (size_t)reps * sizeof(double));
    qsort(sorted, (size_t)reps, sizeof(double), cmp_d);
    const double med = sorted[reps / 2];
    int mi = 0;
    while (times[mi] != med)
        mi++;
    rank_report *all = g_rank == 0 ? malloc((size_t)g_size * sizeof(rank_report)) : NULL;
    MPI_Gather(&mine[mi], (int)sizeof(rank_report), MPI_BYTE, all, (int)sizeof(rank_report),
               MPI_BYTE, 0, MPI_COMM_WORLD);

    if (g_rank == 0) {
        char name[MPI_MAX_PROCESSOR_NAME];
        int nl;
        MPI_Get_processor_name(name, &nl);
        const double flops = 4.0 * (double)(B * H * L * S * E) * (causal ? 0.5 : 1.0);
        printf("{\"ranks\": %d, \"local\": %s, \"B\": %lld, \"H\": %lld, \"L\": %lld, \"S\": %lld, "
               "\"E\": %lld, \"causal\": %s, \"threads\": %d, \"host\": \"%s\", \"flops\": %.6g,\n",
               g_size, local ? "true" : "false", (long long)B, (long long)H, (long long)L,
               (long long)S, (long long)E, causal ? "true" : "false", threads, name, flops);
        printf(" \"times\": [");
        for (int i = 0; i < reps; i++)
            printf("%s%.6f", i ? ", " : "", times[i]);
        printf("], \"median\": %.6f, \"gflops\": %.3f,\n \"per_rank\": [\n", med,
               flops / med / 1e9);
        for (int r = 0; r < g_size; r++) {
            const rank_report *m = &all[r];
            printf("  {\"rank\": %d, \"total\": %.6f, \"agree\": %.6f, \"compute\": %.6f, "
                   "\"wait\": %.6f, \"cpu\": %.6f, \"steps\": %d, \"bytes_sent\": %lld,\n"
                   "   \"step_compute\": [",
                   r, m->total, m->agree, m->compute, m->wait, m->cpu, m->steps,
                   (long long)m->bytes_sent);
            const int ns = m->steps < 64 ? m->steps : 64;
            for (int s = 0; s < ns; s++)
                printf("%s%.6f", s ? ", " : "", m->step_compute[s]);
            printf("], \"step_wait\": [");
            for (int s = 0; s < ns; s++)
                printf("%s%.6f", s ? ", " : "", m->step_wait[s]);
            printf("]}%s\n", r + 1 < g_size ? "," : "");
        }
        printf(" ]}\n");
        fflush(stdout);
        free(all);
    }
    free(q), free(k), free(v), free(o), free(times), free(mine), free(sorted);
    MPI_Finalize();
    return 0;
}
