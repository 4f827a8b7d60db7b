/*
 * ring_cmd.c — `mpirun -np N attn sdpa --ring ...`: ring attention over MPI
 * (attn_ring_sdpa) on .npy files.
 *
 * Each rank reads only its shard of -q, -k and -v (npy_slices.c: preads of
 * the runs attn_ring_shard_runs gives) and writes only its shard of the
 * outputs, into one file per output that rank 0 frames (header, full size)
 * as a temporary beside the target: every rank pwrites its rows and syncs
 * them, and rank 0 renames the temporary over the target only when every
 * rank succeeded (outputs.c), so a failed run leaves the target as it was.
 *
 * Every step ends in agree(): the ranks' verdicts and messages are gathered
 * to rank 0, which prints each message once, naming the ranks that gave it,
 * and all ranks go on, or all stop with the worst exit code. Only a broken
 * ring (ATTN_ERR_COMM: a peer gone or silent) ends the job with MPI_Abort.
 * MPI is initialised only here, so `attn` without --ring never touches it.
 */
#define _POSIX_C_SOURCE 200809L /* fsync, getenv */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include "attn_ring.h"
#include "cli.h"
#include "npy_slices.h"
#include "sdpa_args.h"

enum { MSG_SIZE = 4096 };

typedef struct ring {
    MPI_Comm comm;
    int rank, size;
    char msg[MSG_SIZE]; /* this rank's messages since the last agreement */
} ring;

/* What a run holds: the inputs (open, then their shards), the outputs. */
typedef struct ring_job {
    npy_source src[3];     /* -q, -k, -v */
    attn_tensor in[3];     /* this rank's shards of them */
    npy_runs lruns, sruns; /* the query and key positions this rank holds */
    attn_tensor out, lse;
    npy_frame out_frame, lse_frame;
    attn_ring_stats stats;
} ring_job;

static ring *current; /* for outputs.c's messages (collect) */

/* Adds a message line for the next agreement to print. */
static void note(ring *r, const char *text) {
    size_t used = strlen(r->msg);
    if (used > 0 && used + 1 < sizeof r->msg) r->msg[used++] = '\n';
    snprintf(r->msg + used, sizeof r->msg - used, "%s", text);
    used = strlen(r->msg);
    while (used > 0 && r->msg[used - 1] == '\n') r->msg[--used] = '\0';
}

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static int fail(ring *r, const char *fmt, ...) {
    char text[MSG_SIZE];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    note(r, text);
    return CLI_RUNTIME;
}

static void collect(const char *message) { note(current, message); }

/* "[rank 2] " or "[ranks 0, 1, 3] ": the ranks whose message is all[i]'s
 * (marked done); "" when that is every rank. */
static void rank_list(const char *all, int n, int i, bool *done, char *out, size_t size) {
    const char *mine = all + (size_t)i * MSG_SIZE;
    char ranks[160] = "";
    int count = 0;
    size_t used = 0;
    for (int j = i; j < n; j++) {
        if (done[j] || strcmp(all + (size_t)j * MSG_SIZE, mine) != 0) continue;
        done[j] = true;
        if (++count <= 16 && used < sizeof ranks)
            used += (size_t)snprintf(ranks + used, sizeof ranks - used, "%s%d",
                                     count > 1 ? ", " : "", j);
        else if (count == 17 && used < sizeof ranks)
            used += (size_t)snprintf(ranks + used, sizeof ranks - used, ", ...");
    }
    if (count == n)
        out[0] = '\0';
    else
        snprintf(out, size, "[rank%s %s] ", count > 1 ? "s" : "", ranks);
}

/* Rank 0: each distinct message once. */
static void print_messages(const char *all, int n) {
    bool *done = calloc((size_t)n, sizeof *done);
    if (done == NULL) return;
    for (int i = 0; i < n; i++) {
        const char *msg = all + (size_t)i * MSG_SIZE;
        if (done[i] || msg[0] == '\0') continue;
        char who[512];
        rank_list(all, n, i, done, who, sizeof who);
        fprintf(stderr, "%s%s\n", who, msg);
    }
    fflush(stderr);
    free(done);
}

/* Every rank's verdict on a step: the worst exit code, the same on every
 * rank; the messages printed by rank 0. Collective. */
static int agree(ring *r, int rc) {
    char *all = r->rank == 0 ? malloc((size_t)r->size * MSG_SIZE) : NULL;
    if (r->rank == 0 && all == NULL) { /* no room to gather: each rank prints its own */
        if (r->msg[0]) fprintf(stderr, "[rank 0] %s\n", r->msg);
    }
    int code = rc, worst = rc, gather = all != NULL;
    MPI_Bcast(&gather, 1, MPI_INT, 0, r->comm);
    if (gather)
        MPI_Gather(r->msg, MSG_SIZE, MPI_CHAR, all, MSG_SIZE, MPI_CHAR, 0, r->comm);
    else if (r->rank != 0 && r->msg[0])
        fprintf(stderr, "[rank %d] %s\n", r->rank, r->msg);
    MPI_Allreduce(&code, &worst, 1, MPI_INT, MPI_MAX, r->comm);
    if (all != NULL) print_messages(all, r->size);
    free(all);
    r->msg[0] = '\0';
    return worst;
}

/* Parses the options on every rank; a usage error is printed once. */
static int parse(ring *r, int argc, char **argv, sdpa_args *a) {
    int rc = sdpa_parse_args(argc, argv, a, r->msg, sizeof r->msg);
    int help = rc == SDPA_PARSED_HELP, any_help = 0;
    rc = agree(r, help ? CLI_OK : rc);
    if (rc != CLI_OK) return rc;
    MPI_Allreduce(&help, &any_help, 1, MPI_INT, MPI_MAX, r->comm);
    if (any_help) {
        if (r->rank == 0) sdpa_print_help();
        return SDPA_PARSED_HELP;
    }
    return CLI_OK;
}

/* Threads: --threads, else ATTN_NUM_THREADS, else this machine's cores
 * shared by the ranks on it (all cores each would oversubscribe them). */
static void set_threads(ring *r, const sdpa_args *a) {
    MPI_Comm node; /* collective: every rank splits, whatever its options */
    int local = 1;
    if (MPI_Comm_split_type(r->comm, MPI_COMM_TYPE_SHARED, r->rank, MPI_INFO_NULL, &node) ==
        MPI_SUCCESS) {
        MPI_Comm_size(node, &local);
        MPI_Comm_free(&node);
    }
    const char *env = getenv("ATTN_NUM_THREADS");
    if (a->threads > 0) {
        attn_set_num_threads(a->threads);
    } else if (env == NULL || env[0] == '\0') {
        const int n = attn_get_num_threads() / (local > 0 ? local : 1);
        attn_set_num_threads(n > 1 ? n : 1);
    }
}

/* Every rank resolves the outputs' folders (outputs_add): each must see
 * the folder in which rank 0 will create the temporaries. */
static int add_outputs(ring *r, const sdpa_args *a) {
    int rc = outputs_input("-q", a->q);
    if (rc == CLI_OK) rc = outputs_input("-k", a->k);
    if (rc == CLI_OK) rc = outputs_input("-v", a->v);
    if (rc == CLI_OK) rc = outputs_add("-o", a->out);
    if (rc == CLI_OK && a->lse) rc = outputs_add("--lse", a->lse);
    const char *opts[2] = {"-o", "--lse"}, *paths[2] = {a->out, a->lse};
    for (int i = 0; i < 2 && rc == CLI_OK; i++)
        if (paths[i] != NULL && outputs_in_place(opts[i]))
            rc = fail(r,
                      "attn: writing %s '%s': --ring writes its output by offset, into a "
                      "regular file; this is a device or FIFO",
                      opts[i], paths[i]);
    return agree(r, rc);
}

/* "float32 (2, 4, 64, 16)" */
static const char *describe(attn_dtype dtype, int rank, const int64_t *shape, char *buf,
                            size_t size) {
    attn_tensor t;
    memset(&t, 0, sizeof t);
    t.rank = rank;
    memcpy(t.shape, shape, sizeof t.shape);
    char dims[160];
    snprintf(buf, size, "%s %s", attn_dtype_name(dtype), cli_shape(&t, dims, sizeof dims));
    return buf;
}

/* The files' headers must be rank 0's: a rank that read other files
 * (another folder of the same name) would compute on a different problem
 * that the shard lengths alone may not reveal. */
static int same_headers(ring *r, const ring_job *j) {
    int64_t mine[3][2 + ATTN_MAX_RANK], root[3][2 + ATTN_MAX_RANK];
    memset(mine, 0, sizeof mine);
    for (int i = 0; i < 3; i++) {
        mine[i][0] = j->src[i].dtype;
        mine[i][1] = j->src[i].rank;
        memcpy(&mine[i][2], j->src[i].shape, sizeof j->src[i].shape);
    }
    memcpy(root, mine, sizeof root);
    MPI_Bcast(root, (int)(sizeof root / sizeof root[0][0]), MPI_INT64_T, 0, r->comm);
    int rc = CLI_OK;
    for (int i = 0; i < 3 && rc == CLI_OK; i++) {
        if (memcmp(mine[i], root[i], sizeof mine[i]) == 0) continue;
        char here[200], there[200];
        rc = fail(r,
                  "attn: reading %s: '%s' holds %s on this rank but %s on rank 0: every rank "
                  "must read the same files",
                  j->src[i].option, j->src[i].path,
                  describe(j->src[i].dtype, j->src[i].rank, j->src[i].shape, here, sizeof here),
                  describe((attn_dtype)root[i][0], (int)root[i][1], &root[i][2], there,
                           sizeof there));
    }
    return rc;
}

/* This rank's runs of a sequence of `total` positions. */
static int shard_runs(ring *r, const sdpa_args *a, const npy_source *src, const char *what,
                      npy_runs *runs) {
    const int64_t total = src->shape[src->rank - 2];
    memset(runs, 0, sizeof *runs);
    if (attn_ring_shard_runs((attn_ring_layout)a->layout, total, r->size, r->rank, &runs->nruns,
                             runs->start, runs->len) != ATTN_OK)
        return fail(r, "attn: %s: %lld %s cannot be split over %d ranks: %s", src->option,
                    (long long)total, what, r->size, attn_last_error());
    runs->count = runs->len[0] + (runs->nruns > 1 ? runs->len[1] : 0);
    return CLI_OK;
}

/* Opens -q, -k, -v, checks that every rank sees the same headers, and reads
 * this rank's shards. */
static int read_inputs(ring *r, const sdpa_args *a, ring_job *j) {
    const char *opts[3] = {"-q", "-k", "-v"}, *paths[3] = {a->q, a->k, a->v};
    int rc = CLI_OK;
    for (int i = 0; i < 3; i++) j->src[i].fd = -1;
    for (int i = 0; i < 3 && rc == CLI_OK; i++) {
        char err[MSG_SIZE];
        if (npy_source_open(&j->src[i], opts[i], paths[i], err, sizeof err) != 0)
            rc = fail(r, "%s", err);
    }
    if ((rc = agree(r, rc)) != CLI_OK) return rc;
    if ((rc = agree(r, same_headers(r, j))) != CLI_OK) return rc;
    const npy_source *k = &j->src[1], *v = &j->src[2];
    if (k->shape[k->rank - 2] != v->shape[v->rank - 2])
        rc = fail(r, "attn: -k holds %lld keys (dimension -2) and -v %lld values: they must agree",
                  (long long)k->shape[k->rank - 2], (long long)v->shape[v->rank - 2]);
    if (rc == CLI_OK) rc = shard_runs(r, a, &j->src[0], "queries", &j->lruns);
    if (rc == CLI_OK) rc = shard_runs(r, a, k, "keys", &j->sruns);
    for (int i = 0; i < 3 && rc == CLI_OK; i++) {
        char err[MSG_SIZE];
        const npy_runs *runs = i == 0 ? &j->lruns : &j->sruns;
        if (npy_source_read(&j->src[i], j->src[i].rank - 2, runs, &j->in[i], err, sizeof err))
            rc = fail(r, "%s", err);
    }
    return agree(r, rc);
}

/* A C-contiguous tensor of q's dtype. */
static int alloc_tensor(attn_tensor *t, attn_dtype dtype, int rank, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < rank; d++) n *= shape[d];
    void *data = calloc((size_t)n, attn_dtype_size(dtype));
    if (data == NULL || attn_tensor_init(t, data, dtype, rank, shape) != ATTN_OK) {
        free(data);
        t->data = NULL;
        return -1;
    }
    return 0;
}

/* The outputs' shards and the frames of their files. */
static int make_outputs(ring *r, const sdpa_args *a, ring_job *j) {
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    if (attn_sdpa_out_shape(&j->in[0], &j->in[1], &j->in[2], &a->params, &rank, shape) !=
        ATTN_OK)
        return fail(r, "attn: sdpa: %s", attn_last_error());
    const attn_dtype dtype = j->in[0].dtype;
    if (alloc_tensor(&j->out, dtype, rank, shape) != 0 ||
        (a->lse && alloc_tensor(&j->lse, cli_lse_dtype(dtype), rank - 1, shape) != 0))
        return fail(r, "attn: allocating outputs: out of memory");
    /* The files hold every query: the shards' shapes with L whole. */
    shape[rank - 2] = j->src[0].shape[j->src[0].rank - 2];
    j->out_frame = (npy_frame){dtype, rank, {0}};
    memcpy(j->out_frame.shape, shape, sizeof shape);
    j->lse_frame = (npy_frame){cli_lse_dtype(dtype), rank - 1, {0}};
    memcpy(j->lse_frame.shape, shape, sizeof shape);
    return CLI_OK;
}

/* attn_ring_sdpa. A broken ring ends the job: its peers may be gone. */
static int compute(ring *r, const sdpa_args *a, ring_job *j) {
    int rc = agree(r, make_outputs(r, a, j));
    if (rc != CLI_OK) return rc;
    attn_ring_params p;
    attn_ring_params_init(&p);
    p.sdpa = a->params;
    p.layout = (attn_ring_layout)a->layout;
    if (a->ring_timeout > 0) p.timeout = a->ring_timeout;
    p.stats = &j->stats;
    attn_status st = attn_ring_sdpa(r->comm, &j->in[0], &j->in[1], &j->in[2], &p, &j->out,
                                    a->lse ? &j->lse : NULL);
    if (st == ATTN_ERR_COMM) {
        fprintf(stderr, "[rank %d] attn: sdpa --ring: %s\n", r->rank, attn_last_error());
        fflush(stderr);
        outputs_abort();
        MPI_Abort(MPI_COMM_WORLD, CLI_RUNTIME);
    }
    return agree(r, st == ATTN_OK ? CLI_OK : fail(r, "attn: sdpa: %s", attn_last_error()));
}

/* This rank's rows into the temporary rank 0 staged. */
static int write_part(ring *r, const char *option, const char *path, const char *temp,
                      const npy_frame *frame, int dim, const npy_runs *runs,
                      const attn_tensor *t) {
    int fd;
    if (outputs_open_temp(option, temp, &fd) != CLI_OK) return CLI_RUNTIME;
    int err = npy_frame_write_runs(fd, frame, dim, runs, t);
    /* Synced by the rank that wrote them: on a shared file system another
     * node's fsync would not cover them. */
    if (err == 0 && fsync(fd) != 0) err = errno;
    if (close(fd) != 0 && err == 0) err = errno;
    if (err != 0) return fail(r, "attn: writing %s '%s': %s", option, path, strerror(err));
    return CLI_OK;
}

/* "(d0, d1, ...)" of a shape, through cli_shape. */
static const char *shape_text(int rank, const int64_t *shape, char *buf, size_t size) {
    attn_tensor t;
    memset(&t, 0, sizeof t);
    t.rank = rank;
    memcpy(t.shape, shape, sizeof t.shape);
    return cli_shape(&t, buf, size);
}

/* Rank 0's line on success: shapes, ranks, the slowest rank's time. */
static void summary(ring *r, const sdpa_args *a, const ring_job *j) {
    double mine[2] = {j->stats.total, j->stats.wait}, worst[2] = {0, 0};
    MPI_Reduce(mine, worst, 2, MPI_DOUBLE, MPI_MAX, 0, r->comm);
    if (r->rank != 0) return;
    char s[3][96], o[96];
    for (int i = 0; i < 3; i++) shape_text(j->src[i].rank, j->src[i].shape, s[i], sizeof s[i]);
    printf("sdpa --ring: q%s k%s v%s -> out%s %s, %d rank%s (%s), %s path, %d thread%s per "
           "rank, %.3f ms (slowest rank; %.3f ms waiting on peers) -> %s\n",
           s[0], s[1], s[2], shape_text(j->out_frame.rank, j->out_frame.shape, o, sizeof o),
           attn_dtype_name(j->out.dtype), r->size,
           r->size > 1 ? "s" : "", a->layout ? "contiguous" : "zigzag",
           attn_isa_name(attn_get_isa()), attn_get_num_threads(),
           attn_get_num_threads() > 1 ? "s" : "", worst[0] * 1e3, worst[1] * 1e3, a->out);
}

/* Rank 0 frames each output as a temporary; every rank writes its rows;
 * rank 0 prints the summary and renames them over their targets once all
 * ranks succeeded (a stdout that cannot take the summary stops the renames,
 * as in the other commands). */
static int write_outputs(ring *r, const sdpa_args *a, ring_job *j) {
    int rc = CLI_OK;
    if (r->rank == 0) {
        rc = outputs_stage_with("-o", npy_frame_write, &j->out_frame);
        if (rc == CLI_OK && a->lse) rc = outputs_stage_with("--lse", npy_frame_write, &j->lse_frame);
    }
    if ((rc = agree(r, rc)) != CLI_OK) return rc;
    char temps[2][NAME_MAX + 1];
    memset(temps, 0, sizeof temps);
    if (r->rank == 0) {
        snprintf(temps[0], sizeof temps[0], "%s", outputs_temp_name("-o"));
        if (a->lse) snprintf(temps[1], sizeof temps[1], "%s", outputs_temp_name("--lse"));
    }
    MPI_Bcast(temps, (int)sizeof temps, MPI_CHAR, 0, r->comm);
    /* The queries' dimension: -2 of out (..., L, Ev), -1 of lse (..., L). */
    const int dim = j->out_frame.rank - 2;
    rc = write_part(r, "-o", a->out, temps[0], &j->out_frame, dim, &j->lruns, &j->out);
    if (rc == CLI_OK && a->lse)
        rc = write_part(r, "--lse", a->lse, temps[1], &j->lse_frame, dim, &j->lruns, &j->lse);
    if ((rc = agree(r, rc)) != CLI_OK) return rc;
    summary(r, a, j);
    /* Rank 0 alone renames; the others only close their folders. */
    if (r->rank == 0) rc = outputs_commit();
    return agree(r, rc);
}

static void free_job(ring_job *j) {
    for (int i = 0; i < 3; i++) {
        npy_source_close(&j->src[i]);
        free(j->in[i].data);
    }
    free(j->out.data);
    free(j->lse.data);
}

static int run(ring *r, int argc, char **argv) {
    sdpa_args a;
    int rc = parse(r, argc, argv, &a);
    if (rc != CLI_OK) return rc == SDPA_PARSED_HELP ? CLI_OK : rc;
    set_threads(r, &a);
    ring_job j;
    memset(&j, 0, sizeof j);
    for (int i = 0; i < 3; i++) j.src[i].fd = -1;
    outputs_set_reporter(collect);
    rc = add_outputs(r, &a);
    if (rc == CLI_OK) rc = read_inputs(r, &a, &j);
    if (rc == CLI_OK) rc = compute(r, &a, &j);
    if (rc == CLI_OK) rc = write_outputs(r, &a, &j);
    outputs_abort(); /* rank 0 after a failure: removes the temporaries */
    outputs_set_reporter(NULL);
    free_job(&j);
    return rc;
}

int cli_sdpa_ring(int argc, char **argv) {
    int provided;
    /* Only this thread calls MPI; libattn's threads compute. */
    MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
    ring r;
    memset(&r, 0, sizeof r);
    r.comm = MPI_COMM_WORLD;
    MPI_Comm_rank(r.comm, &r.rank);
    MPI_Comm_size(r.comm, &r.size);
    current = &r;
    int rc = run(&r, argc, argv);
    fflush(stdout);
    MPI_Finalize();
    return rc;
}

const char *cli_ring_support(void) {
    static char line[MPI_MAX_LIBRARY_VERSION_STRING + 16];
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    /* Allowed before MPI_Init; the first line or clause is the name. */
    MPI_Get_library_version(version, &len);
    version[strcspn(version, ",\n")] = '\0';
    snprintf(line, sizeof line, "yes (%s)", version);
    return line;
}
