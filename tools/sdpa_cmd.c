/* sdpa_cmd.c — `attn sdpa`: attention on .npy files. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "sdpa_args.h"

const char cli_sdpa_options[] =
    "sdpa options:\n"
    "  -o OUT.npy              the output (required)\n"
    "  --mask M.npy            bool (true = attend) or float (added) mask,\n"
    "                          broadcastable to (..., L, S)\n"
    "  --causal[=top-left]     causal mask aligned to the first key (PyTorch)\n"
    "  --causal=bottom-right   causal mask aligned to the last key (KV cache)\n"
    "  --scale S               score scale (default 1/sqrt(E))\n"
    "  --gqa                   grouped-query attention (query heads share K/V heads)\n"
    "  --dropout P --seed N    reproducible dropout on the attention weights\n"
    CLI_MODIFIER_OPTIONS
    "  --weights W.npy         also write the attention weights (..., L, S)\n"
    "  --lse LSE.npy           also write the log-sum-exp per row (..., L)\n"
    "  --threads N             threads, 1 to attn_max_threads() (default:\n"
    "                          ATTN_NUM_THREADS or all cores)\n"
    "  --ring                  ring attention over MPI ranks, run under mpirun -np N\n"
    "                          (attn info says whether this attn has MPI)\n"
    "  --layout L              --ring: how the sequence is split, zigzag (default: an\n"
    "                          early and a late chunk per rank, balanced for\n"
    "                          --causal) or contiguous\n"
    "  --ring-timeout SECONDS  --ring: how long a rank waits for a peer (default 60)\n"
    "  -h, --help              this text\n"
    "\n"
    "Outputs are all written or none: each goes to a temporary file beside its\n"
    "target and is renamed over it only when every output is complete.\n"
    "With --ring, each rank reads only its rows of the inputs (C-order float32 or\n"
    "float64 in this machine's byte order) and writes them into the one output\n"
    "file; every rank must see the same files and folders. --mask, --weights,\n"
    "--window, --alibi-slopes, --softcap and --sinks are not available. Each\n"
    "rank uses --threads, else ATTN_NUM_THREADS, else its\n"
    "share of its machine's cores.\n"
    "Exit status: 0 success, 1 runtime error, 2 usage error.\n";

/* Where a usage error goes: stderr, or this buffer (sdpa_parse_args). */
static char *usage_buf;
static size_t usage_size;

#if defined(__GNUC__)
__attribute__((format(printf, 1, 2)))
#endif
static int usage_error(const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (usage_buf != NULL)
        snprintf(usage_buf, usage_size, "attn sdpa: %s\n(see attn sdpa --help)", msg);
    else
        fprintf(stderr, "attn sdpa: %s\n(see attn sdpa --help)\n", msg);
    return CLI_USAGE;
}

static bool takes_value(const char *opt) {
    static const char *const with_value[] = {
        "-q",     "-k",      "-v",        "--mask",    "-o",      "--weights",     "--lse",
        "--scale", "--dropout", "--seed", "--threads", "--layout", "--ring-timeout"};
    for (size_t i = 0; i < sizeof with_value / sizeof with_value[0]; i++)
        if (strcmp(opt, with_value[i]) == 0) return true;
    return cli_modifier_takes_value(opt);
}

/* --ring's own options; CLI_OK when opt is none of them. */
static int parse_ring_option(const char *opt, const char *val, sdpa_args *a, bool *taken) {
    *taken = true;
    if (strcmp(opt, "--ring") == 0) {
        a->ring = 1;
    } else if (strcmp(opt, "--layout") == 0) {
        if (strcmp(val, "zigzag") != 0 && strcmp(val, "contiguous") != 0)
            return usage_error("--layout: '%s' is not zigzag or contiguous", val);
        a->layout = strcmp(val, "contiguous") == 0;
    } else if (strcmp(opt, "--ring-timeout") == 0) {
        if (!cli_parse_double(val, &a->ring_timeout) || !(a->ring_timeout > 0))
            return usage_error("--ring-timeout: '%s' is not a positive number of seconds", val);
    } else {
        *taken = false;
    }
    return CLI_OK;
}

/* What --ring cannot do, and ring options given without it. */
static int check_ring_args(int argc, char **argv, const sdpa_args *a) {
    for (int i = 0; i < argc; i++) {
        const char *opt = argv[i];
        const bool ring_only = strcmp(opt, "--layout") == 0 || strcmp(opt, "--ring-timeout") == 0;
        if (!a->ring && ring_only) return usage_error("%s needs --ring", opt);
        if (a->ring && strcmp(opt, "--mask") == 0)
            return usage_error("--mask is not available with --ring: a mask of every query "
                               "and key cannot be split by the ranks' keys");
        if (a->ring && strcmp(opt, "--weights") == 0)
            return usage_error("--weights is not available with --ring: no rank holds a "
                               "row's weights for every key at once");
        if (a->ring && cli_modifier_takes_value(opt))
            return usage_error("%s is not available with --ring (the ring takes no score "
                               "modifiers yet)", opt);
        if (takes_value(opt)) i++;
    }
    return CLI_OK;
}

int sdpa_parse_args(int argc, char **argv, sdpa_args *a, char *err, size_t err_size) {
    usage_buf = err;
    usage_size = err_size;
    if (err != NULL && err_size > 0) err[0] = '\0';
    memset(a, 0, sizeof *a);
    attn_sdpa_params_init(&a->params);
    for (int i = 0; i < argc; i++) {
        const char *opt = argv[i];
        if (strcmp(opt, "--help") == 0 || strcmp(opt, "-h") == 0) return SDPA_PARSED_HELP;
        /* Options that take a value: -x VALUE. */
        const char **path = strcmp(opt, "-q") == 0           ? &a->q
                            : strcmp(opt, "-k") == 0         ? &a->k
                            : strcmp(opt, "-v") == 0         ? &a->v
                            : strcmp(opt, "--mask") == 0     ? &a->mask
                            : strcmp(opt, "-o") == 0         ? &a->out
                            : strcmp(opt, "--weights") == 0  ? &a->weights
                            : strcmp(opt, "--lse") == 0      ? &a->lse
                                                             : NULL;
        if (takes_value(opt) && i + 1 >= argc) return usage_error("%s needs a value", opt);
        const char *val = takes_value(opt) ? argv[++i] : NULL;
        bool ring_option;
        int rc = parse_ring_option(opt, val, a, &ring_option);
        if (rc != CLI_OK) return rc;
        if (ring_option) continue;
        char why[256];
        const int modifier = cli_modifier_option(opt, val, &a->params, &a->mods, why, sizeof why);
        if (modifier < 0) return usage_error("%s", why);
        if (modifier > 0) continue;
        if (path != NULL) {
            *path = val;
        } else if (strcmp(opt, "--scale") == 0) {
            if (!cli_parse_double(val, &a->params.scale))
                return usage_error("--scale: '%s' is not a finite, representable number", val);
            a->params.has_scale = 1;
        } else if (strcmp(opt, "--dropout") == 0) {
            if (!cli_parse_double(val, &a->params.dropout_p) || a->params.dropout_p < 0 ||
                a->params.dropout_p > 1)
                return usage_error("--dropout: '%s' is not a probability in [0, 1]", val);
        } else if (strcmp(opt, "--seed") == 0) {
            unsigned long long seed;
            if (!cli_parse_u64(val, &seed))
                return usage_error("--seed: '%s' is not a non-negative integer", val);
            a->params.seed = seed;
            a->seed_given = 1;
        } else if (strcmp(opt, "--threads") == 0) {
            unsigned long long n;
            /* Above the bound the library would clamp it without a word. */
            const int max = attn_max_threads();
            if (!cli_parse_u64(val, &n) || n < 1 || n > (unsigned long long)max)
                return usage_error("--threads: '%s' is not a count from 1 to %d "
                                   "(attn_max_threads() on this machine)",
                                   val, max);
            a->threads = (int)n;
        } else if (strcmp(opt, "--causal") == 0 || strcmp(opt, "--causal=top-left") == 0) {
            a->params.causal = ATTN_CAUSAL_TOP_LEFT;
        } else if (strcmp(opt, "--causal=bottom-right") == 0) {
            a->params.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
        } else if (strcmp(opt, "--gqa") == 0) {
            a->params.enable_gqa = 1;
        } else {
            return usage_error("unknown option '%s'", opt);
        }
    }
    if (a->q == NULL || a->k == NULL || a->v == NULL)
        return usage_error("%s", "-q, -k and -v are required");
    if (a->out == NULL) /* no default: a silent ./out.npy overwrote files */
        return usage_error("%s", "-o OUT.npy is required");
    if (a->params.dropout_p > 0 && !a->seed_given)
        return usage_error("%s", "--dropout needs --seed N, so that the result is reproducible");
    return check_ring_args(argc, argv, a);
}

void sdpa_print_help(void) {
    printf("usage: attn sdpa -q Q.npy -k K.npy -v V.npy -o OUT.npy [options]\n"
           "       mpirun -np N attn sdpa --ring -q Q.npy -k K.npy -v V.npy -o OUT.npy "
           "[options]\n\n%s",
           cli_sdpa_options);
}

/* Whether the options hold --ring (as an option, not as a value). */
static bool wants_ring(int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        if (strcmp(argv[i], "--ring") == 0) return true;
        if (takes_value(argv[i])) i++;
    }
    return false;
}

/* What a run holds: inputs, outputs, the kernel's time. */
typedef struct sdpa_run {
    attn_tensor q, k, v, mask, out, w, lse;
    double ms;
} sdpa_run;

/* Loads one input; CLI_OK, or CLI_RUNTIME with the message printed. -q, -k
 * and -v need 2 or more dimensions: a file of rank 0 or 1 loads as rank 1
 * (a 0-d array as shape (1,)), so the rank reported is the file's own. */
static int load_input(const char *option, const char *path, attn_tensor *t, bool needs_matrix) {
    char what[32];
    snprintf(what, sizeof what, "reading %s", option);
    attn_status st = attn_npy_load(path, t);
    if (st != ATTN_OK) return cli_fail(what, st);
    if (!needs_matrix || t->rank >= 2) return CLI_OK;
    attn_dtype dtype;
    int rank = t->rank;
    int64_t shape[ATTN_MAX_RANK];
    if (attn_npy_read_header(path, &dtype, &rank, shape) != ATTN_OK) rank = t->rank;
    fprintf(stderr, "attn: %s: '%s' holds an array of rank %d%s; sdpa needs 2 to %d dimensions\n",
            what, path, rank, rank == 0 ? " (a 0-d array)" : "", ATTN_MAX_RANK);
    return CLI_RUNTIME;
}

static int load_inputs(const sdpa_args *a, sdpa_run *r) {
    int rc = load_input("-q", a->q, &r->q, true);
    if (rc == CLI_OK) rc = load_input("-k", a->k, &r->k, true);
    if (rc == CLI_OK) rc = load_input("-v", a->v, &r->v, true);
    if (rc == CLI_OK && a->mask) rc = load_input("--mask", a->mask, &r->mask, false);
    return rc;
}

/* The inputs, then the modifiers' files into a->params. */
static int load_all(sdpa_args *a, sdpa_run *r) {
    const int rc = load_inputs(a, r);
    return rc == CLI_OK ? cli_modifiers_load(&a->mods, &a->params) : rc;
}

/* Allocates a C-contiguous tensor of the given shape and q's dtype. */
static attn_status make_output(attn_tensor *t, attn_dtype dtype, int rank, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < rank; d++) n *= shape[d];
    void *data = calloc((size_t)n, attn_dtype_size(dtype));
    if (data == NULL) return ATTN_ERR_NOMEM;
    attn_status st = attn_tensor_init(t, data, dtype, rank, shape);
    if (st != ATTN_OK) free(data);
    return st;
}

/* Allocates the outputs and runs attn_sdpa, timing it. */
static int compute(sdpa_args *a, sdpa_run *r) {
    if (a->mask) a->params.attn_mask = &r->mask;
    int rank;
    int64_t shape[ATTN_MAX_RANK], wshape[ATTN_MAX_RANK];
    attn_status st = attn_sdpa_out_shape(&r->q, &r->k, &r->v, &a->params, &rank, shape);
    if (st != ATTN_OK) return cli_fail("sdpa", st);
    memcpy(wshape, shape, sizeof shape);
    wshape[rank - 1] = r->k.shape[r->k.rank - 2];
    if ((st = make_output(&r->out, r->q.dtype, rank, shape)) != ATTN_OK ||
        (a->weights && (st = make_output(&r->w, r->q.dtype, rank, wshape)) != ATTN_OK) ||
        (a->lse && (st = make_output(&r->lse, cli_lse_dtype(r->q.dtype), rank - 1, shape)) !=
                       ATTN_OK))
        return cli_fail("allocating outputs", st);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    st = attn_sdpa(&r->q, &r->k, &r->v, &a->params, &r->out, a->weights ? &r->w : NULL,
                   a->lse ? &r->lse : NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    r->ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    return st == ATTN_OK ? CLI_OK : cli_fail("sdpa", st);
}

/* Resolves the output files before any work, so that a missing folder or
 * two options naming one file fail at once. */
static int add_outputs(const sdpa_args *a) {
    int rc = cli_modifiers_inputs(&a->mods);
    if (rc == CLI_OK) rc = outputs_input("-q", a->q);
    if (rc == CLI_OK) rc = outputs_input("-k", a->k);
    if (rc == CLI_OK) rc = outputs_input("-v", a->v);
    if (rc == CLI_OK) rc = outputs_input("--mask", a->mask);
    if (rc == CLI_OK) rc = outputs_add("-o", a->out);
    if (rc == CLI_OK && a->weights) rc = outputs_add("--weights", a->weights);
    if (rc == CLI_OK && a->lse) rc = outputs_add("--lse", a->lse);
    return rc;
}

/* All outputs or none: each is staged in full before any is renamed. */
static int stage_outputs(const sdpa_run *r) {
    int rc = outputs_stage("-o", &r->out);
    if (rc == CLI_OK) rc = outputs_stage("--weights", &r->w);
    if (rc == CLI_OK) rc = outputs_stage("--lse", &r->lse);
    return rc;
}

int cli_sdpa(int argc, char **argv) {
    /* Before any parsing: the ring parses once MPI says which rank prints. */
    if (wants_ring(argc, argv)) return cli_sdpa_ring(argc, argv);
    sdpa_args a;
    int rc = sdpa_parse_args(argc, argv, &a, NULL, 0);
    if (rc == SDPA_PARSED_HELP) {
        sdpa_print_help();
        return CLI_OK;
    }
    if (rc != CLI_OK) return rc;
    if (a.threads > 0) attn_set_num_threads(a.threads);
    sdpa_run r;
    memset(&r, 0, sizeof r);
    rc = add_outputs(&a);
    if (rc == CLI_OK) rc = load_all(&a, &r);
    if (rc == CLI_OK) rc = compute(&a, &r);
    if (rc == CLI_OK) rc = stage_outputs(&r);
    if (rc == CLI_OK) { /* the summary before the commit, which checks it arrived */
        char sq[96], sk[96], sv[96], so[96];
        printf("sdpa: q%s k%s v%s -> out%s %s, %s path, %d threads, %.3f ms -> %s\n",
               cli_shape(&r.q, sq, sizeof sq), cli_shape(&r.k, sk, sizeof sk),
               cli_shape(&r.v, sv, sizeof sv), cli_shape(&r.out, so, sizeof so),
               attn_dtype_name(r.out.dtype), attn_isa_name(attn_get_isa()),
               attn_get_num_threads(), r.ms, a.out);
        rc = outputs_commit();
    }
    if (rc != CLI_OK) outputs_abort(); /* removes any temporary */
    attn_npy_free(&r.q);
    attn_npy_free(&r.k);
    attn_npy_free(&r.v);
    attn_npy_free(&r.mask);
    cli_modifiers_free(&a.mods);
    free(r.out.data);
    free(r.w.data);
    free(r.lse.data);
    return rc;
}
