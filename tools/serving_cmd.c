/* serving_cmd.c — `attn varlen` (attn_sdpa_varlen: a batch of sequences of
 * different lengths, packed without padding) and `attn kvcache`
 * (attn_sdpa_kvcache: decoding against a KV cache, paged or not), on .npy
 * files, with FlashAttention's meanings. The updated caches of kvcache go
 * to new files: no input file is ever written. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, stat */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "modifiers.h"

static const char varlen_options[] =
    "varlen options (attn varlen -q Q.npy -k K.npy -v V.npy --cu-seqlens-q CQ.npy\n"
    "                --cu-seqlens-k CK.npy -o OUT.npy [options]):\n"
    "  -q, -k, -v F.npy        packed q (total_q, Hq, E), k (total_k, Hkv, E), v\n"
    "                          (total_k, Hkv, Ev), float32, float64 or float16; Hq\n"
    "                          a multiple of Hkv (grouped-query attention is\n"
    "                          implicit)\n"
    "  --cu-seqlens-q F.npy    int32 (or int64) (B+1,): 0, then each sequence's end\n"
    "  --cu-seqlens-k F.npy    row in q / in k and v; sequence n attends only to its\n"
    "                          own keys\n"
    "  --max-seqlen-q N        at least every sequence's length (default: computed\n"
    "  --max-seqlen-k N        from the offsets)\n"
    "  -o OUT.npy              the output (total_q, Hq, Ev) (required)\n"
    "  --lse LSE.npy           also write the log-sum-exp (Hq, total_q)\n"
    "  --causal                causal mask per sequence, aligned bottom-right\n"
    "                          (FlashAttention's causal=True)\n"
    "  --scale S               score scale (default 1/sqrt(E))\n"
    "  --dropout P --seed N    reproducible dropout on the attention weights\n"
    CLI_MODIFIER_OPTIONS
    "  --threads N             threads, 1 to attn_max_threads()\n"
    "  -h, --help              this text\n";

static const char kvcache_options[] =
    "kvcache options (attn kvcache -q Q.npy --k-cache KC.npy --v-cache VC.npy\n"
    "                 -o OUT.npy [options]):\n"
    "  -q Q.npy                queries (B, Lq, Hq, E), float32, float64 or float16\n"
    "  --k-cache, --v-cache F  the caches (B, S_max, Hkv, E / Ev), or paged with\n"
    "                          --block-table: (num_blocks, block_size, Hkv, E / Ev)\n"
    "  --k K.npy --v V.npy     new rows (B, Lnew, Hkv, E / Ev), appended to each\n"
    "                          sequence at cache_seqlens before attending\n"
    "  --cache-seqlens F.npy   int32 (B,): rows already filled (default: all)\n"
    "  --block-table F.npy     int32 (B, max_blocks): sequence b's row r lives in\n"
    "                          block table[b, r / block_size]\n"
    "  -o OUT.npy              the output (B, Lq, Hq, Ev) (required)\n"
    "  --lse LSE.npy           also write the log-sum-exp (B, Hq, Lq)\n"
    "  --k-cache-out F.npy     write the caches with the new rows to new files (an\n"
    "  --v-cache-out F.npy     input file is never written)\n"
    "  --causal, --no-causal   causal mask aligned bottom-right (the default) or none\n"
    "  --scale S               score scale (default 1/sqrt(E))\n"
    CLI_MODIFIER_OPTIONS
    "  --threads N             threads, 1 to attn_max_threads()\n"
    "  -h, --help              this text\n";

static const char serving_notes[] =
    "\nIndex files are .npy int32 arrays (int64 is converted when it fits). Outputs\n"
    "are all written or none. Exit status: 0 success, 1 runtime error, 2 usage error.\n";

/* What both commands take; each reads the fields of its own options. */
typedef struct serving_args {
    const char *cmd; /* "varlen" or "kvcache" */
    const char *q, *k, *v, *out, *lse;
    const char *cu_q, *cu_k;                       /* varlen */
    long long max_q, max_k;                        /* varlen; -1: computed */
    const char *k_cache, *v_cache, *seqlens, *table; /* kvcache */
    const char *k_cache_out, *v_cache_out;
    attn_sdpa_params params;
    cli_modifiers mods;
    int threads, seed_given;
} serving_args;

enum { PARSED_HELP = -1 };

static const char *command; /* for usage errors */

#define usage_error(...) cli_usage_error(command, __VA_ARGS__)

/* The option's path slot in this command, or NULL. */
static const char **path_slot(serving_args *a, const char *opt) {
    const bool varlen = strcmp(a->cmd, "varlen") == 0;
    struct {
        const char *name;
        const char **slot;
        bool varlen, kvcache;
    } table[] = {
        {"-q", &a->q, true, true},
        {"-o", &a->out, true, true},
        {"--lse", &a->lse, true, true},
        {"-k", &a->k, true, false},
        {"-v", &a->v, true, false},
        {"--cu-seqlens-q", &a->cu_q, true, false},
        {"--cu-seqlens-k", &a->cu_k, true, false},
        {"--k", &a->k, false, true},
        {"--v", &a->v, false, true},
        {"--k-cache", &a->k_cache, false, true},
        {"--v-cache", &a->v_cache, false, true},
        {"--cache-seqlens", &a->seqlens, false, true},
        {"--block-table", &a->table, false, true},
        {"--k-cache-out", &a->k_cache_out, false, true},
        {"--v-cache-out", &a->v_cache_out, false, true},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (strcmp(opt, table[i].name) == 0 && (varlen ? table[i].varlen : table[i].kvcache))
            return table[i].slot;
    return NULL;
}

/* The options with a value that are not paths. */
static bool takes_number(const serving_args *a, const char *opt) {
    static const char *const both[] = {"--scale", "--threads"};
    static const char *const varlen_only[] = {"--dropout", "--seed", "--max-seqlen-q",
                                              "--max-seqlen-k"};
    for (size_t i = 0; i < sizeof both / sizeof both[0]; i++)
        if (strcmp(opt, both[i]) == 0) return true;
    if (strcmp(a->cmd, "varlen") != 0) return false;
    for (size_t i = 0; i < sizeof varlen_only / sizeof varlen_only[0]; i++)
        if (strcmp(opt, varlen_only[i]) == 0) return true;
    return false;
}

/* One numeric option or flag; CLI_OK, or a usage error. */
static int parse_value(serving_args *a, const char *opt, const char *val) {
    unsigned long long n;
    if (strcmp(opt, "--scale") == 0) {
        if (!cli_parse_double(val, &a->params.scale))
            return usage_error("--scale: '%s' is not a finite, representable number", val);
        a->params.has_scale = 1;
    } else if (strcmp(opt, "--threads") == 0) {
        const int max = attn_max_threads();
        if (!cli_parse_u64(val, &n) || n < 1 || n > (unsigned long long)max)
            return usage_error("--threads: '%s' is not a count from 1 to %d", val, max);
        a->threads = (int)n;
    } else if (strcmp(opt, "--dropout") == 0) {
        if (!cli_parse_double(val, &a->params.dropout_p) || a->params.dropout_p < 0 ||
            a->params.dropout_p > 1)
            return usage_error("--dropout: '%s' is not a probability in [0, 1]", val);
    } else if (strcmp(opt, "--seed") == 0) {
        if (!cli_parse_u64(val, &n))
            return usage_error("--seed: '%s' is not a non-negative integer", val);
        a->params.seed = n;
        a->seed_given = 1;
    } else { /* --max-seqlen-q, --max-seqlen-k */
        if (!cli_parse_u64(val, &n) || n > (unsigned long long)INT64_MAX)
            return usage_error("%s: '%s' is not a non-negative integer", opt, val);
        *(strcmp(opt, "--max-seqlen-q") == 0 ? &a->max_q : &a->max_k) = (long long)n;
    }
    return CLI_OK;
}

/* A flag (no value); CLI_OK, or a usage error for an unknown option. */
static int parse_flag(serving_args *a, const char *opt) {
    const bool kvcache = strcmp(a->cmd, "kvcache") == 0;
    if (strcmp(opt, "--causal") == 0)
        a->params.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    else if (kvcache && strcmp(opt, "--no-causal") == 0)
        a->params.causal = ATTN_CAUSAL_NONE;
    else
        return usage_error("unknown option '%s'", opt);
    return CLI_OK;
}

/* What each command requires, once every option is read. */
static int check_required(const serving_args *a) {
    if (a->out == NULL) return usage_error("%s", "-o OUT.npy is required");
    if (strcmp(a->cmd, "varlen") == 0) {
        if (a->q == NULL || a->k == NULL || a->v == NULL)
            return usage_error("%s", "-q, -k and -v are required");
        if (a->cu_q == NULL || a->cu_k == NULL)
            return usage_error("%s", "--cu-seqlens-q and --cu-seqlens-k are required");
        if (a->params.dropout_p > 0 && !a->seed_given)
            return usage_error("%s", "--dropout needs --seed N, so that the result is "
                                     "reproducible");
        return CLI_OK;
    }
    if (a->q == NULL || a->k_cache == NULL || a->v_cache == NULL)
        return usage_error("%s", "-q, --k-cache and --v-cache are required");
    if ((a->k == NULL) != (a->v == NULL))
        return usage_error("%s", "give --k and --v together (new rows), or neither");
    return CLI_OK;
}

static int parse_args(int argc, char **argv, serving_args *a) {
    for (int i = 0; i < argc; i++) {
        const char *opt = argv[i];
        if (strcmp(opt, "--help") == 0 || strcmp(opt, "-h") == 0) return PARSED_HELP;
        const char **slot = path_slot(a, opt);
        const bool number = takes_number(a, opt);
        const bool has_value = slot != NULL || number || cli_modifier_takes_value(opt);
        if (has_value && i + 1 >= argc) return usage_error("%s needs a value", opt);
        const char *val = has_value ? argv[++i] : NULL;
        char why[256];
        const int modifier = cli_modifier_option(opt, val, &a->params, &a->mods, why, sizeof why);
        int rc = CLI_OK;
        if (modifier < 0)
            rc = usage_error("%s", why);
        else if (modifier > 0)
            continue;
        else if (slot != NULL)
            *slot = val;
        else if (number)
            rc = parse_value(a, opt, val);
        else
            rc = parse_flag(a, opt);
        if (rc != CLI_OK) return rc;
    }
    return check_required(a);
}

/* ---- files ---- */

/* Whether two paths name one existing file (links, "./x", hard links). */
/* Every output resolved, none of them an input file: the outputs replace
 * their targets, and an input must stay as it was (kvcache's updated caches
 * go to new files, never over --k-cache). */
static int add_outputs(const serving_args *a) {
    const char *out_opts[4] = {"-o", "--lse", "--k-cache-out", "--v-cache-out"};
    const char *outs[4] = {a->out, a->lse, a->k_cache_out, a->v_cache_out};
    const char *in_opts[9] = {"-q", "-k/--k", "-v/--v", "--cu-seqlens-q", "--cu-seqlens-k",
                              "--k-cache", "--v-cache", "--cache-seqlens", "--block-table"};
    const char *ins[9] = {a->q, a->k, a->v, a->cu_q, a->cu_k,
                          a->k_cache, a->v_cache, a->seqlens, a->table};
    int rc = cli_modifiers_inputs(&a->mods);
    for (int i = 0; i < 9 && rc == CLI_OK; i++) rc = outputs_input(in_opts[i], ins[i]);
    for (int o = 0; o < 4 && rc == CLI_OK; o++)
        if (outs[o] != NULL) rc = outputs_add(out_opts[o], outs[o]);
    return rc;
}

static int load(const char *option, const char *path, attn_tensor *t) {
    if (path == NULL) return CLI_OK;
    char what[48];
    snprintf(what, sizeof what, "reading %s", option);
    const attn_status st = attn_npy_load(path, t);
    return st == ATTN_OK ? CLI_OK : cli_fail(what, st);
}

static int load_index(const char *option, const char *path, attn_tensor *t) {
    return path == NULL ? CLI_OK : cli_load_index(option, path, t);
}

/* A zero-filled C-contiguous tensor; every element set to `fill` unless 0
 * (a fill only for float32 and float64 tensors: lse). */
static int make_output(attn_tensor *t, attn_dtype dtype, int rank, const int64_t *shape,
                       double fill) {
    int64_t n = 1;
    for (int d = 0; d < rank; d++) n *= shape[d];
    void *data = calloc((size_t)n, attn_dtype_size(dtype));
    if (data == NULL || attn_tensor_init(t, data, dtype, rank, shape) != ATTN_OK) {
        free(data);
        return cli_fail("allocating outputs", ATTN_ERR_NOMEM);
    }
    for (int64_t i = 0; fill != 0 && i < n; i++) {
        if (dtype == ATTN_DTYPE_F32) ((float *)data)[i] = (float)fill;
        else if (dtype == ATTN_DTYPE_F64) ((double *)data)[i] = fill;
    }
    return CLI_OK;
}

/* A tensor's rank, or a runtime error saying which layout was expected. */
static int require_rank(const char *option, const attn_tensor *t, int rank, const char *layout) {
    if (t->rank == rank) return CLI_OK;
    char shown[96];
    fprintf(stderr, "attn: %s: %s holds %s; expected %d dimensions %s\n", command, option,
            cli_shape(t, shown, sizeof shown), rank, layout);
    return CLI_RUNTIME;
}

static double elapsed_ms(const struct timespec *t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) * 1e3 + (double)(t1.tv_nsec - t0->tv_nsec) / 1e6;
}

/* ---- attn varlen ---- */

typedef struct varlen_run {
    attn_tensor q, k, v, cu_q, cu_k, out, lse;
} varlen_run;

/* The longest sequence the offsets describe (what FlashAttention's callers
 * pass as max_seqlen); decreasing offsets are left to the library to
 * refuse. */
static long long longest(const attn_tensor *cu) {
    const int32_t *c = cu->data;
    const int64_t n = attn_tensor_numel(cu);
    long long most = 0;
    for (int64_t i = 0; i + 1 < n; i++)
        if ((long long)c[i + 1] - c[i] > most) most = (long long)c[i + 1] - c[i];
    return most;
}

static int varlen_compute(serving_args *a, varlen_run *r, double *ms) {
    int rc = require_rank("-q", &r->q, 3, "(total_q, Hq, E)");
    if (rc == CLI_OK) rc = require_rank("-v", &r->v, 3, "(total_k, Hkv, Ev)");
    if (rc != CLI_OK) return rc;
    const int64_t oshape[3] = {r->q.shape[0], r->q.shape[1], r->v.shape[2]};
    const int64_t lshape[2] = {r->q.shape[1], r->q.shape[0]};
    /* Rows no sequence holds are left as they are: out 0, lse -inf. */
    rc = make_output(&r->out, r->q.dtype, 3, oshape, 0.0);
    if (rc == CLI_OK && a->lse)
        rc = make_output(&r->lse, cli_lse_dtype(r->q.dtype), 2, lshape, -INFINITY);
    if (rc != CLI_OK) return rc;
    const long long max_q = a->max_q >= 0 ? a->max_q : longest(&r->cu_q);
    const long long max_k = a->max_k >= 0 ? a->max_k : longest(&r->cu_k);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    attn_status st = attn_sdpa_varlen(&r->q, &r->k, &r->v, &r->cu_q, &r->cu_k, max_q, max_k,
                                      &a->params, &r->out, a->lse ? &r->lse : NULL);
    *ms = elapsed_ms(&t0);
    return st == ATTN_OK ? CLI_OK : cli_fail("varlen", st);
}

static int varlen_main(serving_args *a) {
    varlen_run r;
    memset(&r, 0, sizeof r);
    double ms = 0;
    int rc = add_outputs(a);
    if (rc == CLI_OK) rc = load("-q", a->q, &r.q);
    if (rc == CLI_OK) rc = load("-k", a->k, &r.k);
    if (rc == CLI_OK) rc = load("-v", a->v, &r.v);
    if (rc == CLI_OK) rc = load_index("--cu-seqlens-q", a->cu_q, &r.cu_q);
    if (rc == CLI_OK) rc = load_index("--cu-seqlens-k", a->cu_k, &r.cu_k);
    if (rc == CLI_OK) rc = cli_modifiers_load(&a->mods, &a->params);
    if (rc == CLI_OK) rc = varlen_compute(a, &r, &ms);
    if (rc == CLI_OK) rc = outputs_stage("-o", &r.out);
    if (rc == CLI_OK) rc = outputs_stage("--lse", &r.lse);
    if (rc == CLI_OK) { /* the summary before the commit, which checks it arrived */
        char sq[96], so[96];
        printf("varlen: %lld sequences, q%s -> out%s %s, %s path, %d threads, %.3f ms -> %s\n",
               (long long)attn_tensor_numel(&r.cu_q) - 1, cli_shape(&r.q, sq, sizeof sq),
               cli_shape(&r.out, so, sizeof so), attn_dtype_name(r.out.dtype),
               attn_isa_name(attn_get_isa()), attn_get_num_threads(), ms, a->out);
        rc = outputs_commit();
    }
    if (rc != CLI_OK) outputs_abort();
    attn_tensor *loaded[5] = {&r.q, &r.k, &r.v, &r.cu_q, &r.cu_k};
    for (int i = 0; i < 5; i++) attn_npy_free(loaded[i]);
    free(r.out.data);
    free(r.lse.data);
    return rc;
}

/* ---- attn kvcache ---- */

typedef struct kvcache_run {
    attn_tensor q, k_cache, v_cache, k, v, seqlens, table, out, lse;
} kvcache_run;

static int kvcache_load(serving_args *a, kvcache_run *r) {
    int rc = load("-q", a->q, &r->q);
    if (rc == CLI_OK) rc = load("--k-cache", a->k_cache, &r->k_cache);
    if (rc == CLI_OK) rc = load("--v-cache", a->v_cache, &r->v_cache);
    if (rc == CLI_OK) rc = load("--k", a->k, &r->k);
    if (rc == CLI_OK) rc = load("--v", a->v, &r->v);
    if (rc == CLI_OK) rc = load_index("--cache-seqlens", a->seqlens, &r->seqlens);
    if (rc == CLI_OK) rc = load_index("--block-table", a->table, &r->table);
    if (rc == CLI_OK) rc = cli_modifiers_load(&a->mods, &a->params);
    return rc;
}

static int kvcache_compute(serving_args *a, kvcache_run *r, double *ms) {
    int rc = require_rank("-q", &r->q, 4, "(B, Lq, Hq, E)");
    if (rc == CLI_OK)
        rc = require_rank("--v-cache", &r->v_cache, 4,
                          "(B, S_max, Hkv, Ev), or (num_blocks, block_size, Hkv, Ev) paged");
    if (rc != CLI_OK) return rc;
    const int64_t oshape[4] = {r->q.shape[0], r->q.shape[1], r->q.shape[2], r->v_cache.shape[3]};
    const int64_t lshape[3] = {r->q.shape[0], r->q.shape[2], r->q.shape[1]};
    rc = make_output(&r->out, r->q.dtype, 4, oshape, 0.0);
    if (rc == CLI_OK && a->lse)
        rc = make_output(&r->lse, cli_lse_dtype(r->q.dtype), 3, lshape, 0.0);
    if (rc != CLI_OK) return rc;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    attn_status st = attn_sdpa_kvcache(
        &r->q, &r->k_cache, &r->v_cache, a->k ? &r->k : NULL, a->v ? &r->v : NULL,
        a->seqlens ? &r->seqlens : NULL, a->table ? &r->table : NULL, &a->params, &r->out,
        a->lse ? &r->lse : NULL);
    *ms = elapsed_ms(&t0);
    return st == ATTN_OK ? CLI_OK : cli_fail("kvcache", st);
}

static int kvcache_main(serving_args *a) {
    kvcache_run r;
    memset(&r, 0, sizeof r);
    double ms = 0;
    int rc = add_outputs(a);
    if (rc == CLI_OK) rc = kvcache_load(a, &r);
    if (rc == CLI_OK) rc = kvcache_compute(a, &r, &ms);
    if (rc == CLI_OK) rc = outputs_stage("-o", &r.out);
    if (rc == CLI_OK) rc = outputs_stage("--lse", &r.lse);
    if (rc == CLI_OK) rc = outputs_stage("--k-cache-out", &r.k_cache);
    if (rc == CLI_OK) rc = outputs_stage("--v-cache-out", &r.v_cache);
    if (rc == CLI_OK) { /* the summary before the commit, which checks it arrived */
        char sq[96], sc[96], so[96];
        printf("kvcache: q%s cache%s%s -> out%s %s, %s path, %d threads, %.3f ms -> %s\n",
               cli_shape(&r.q, sq, sizeof sq), cli_shape(&r.k_cache, sc, sizeof sc),
               a->table ? " paged" : "", cli_shape(&r.out, so, sizeof so),
               attn_dtype_name(r.out.dtype), attn_isa_name(attn_get_isa()),
               attn_get_num_threads(), ms, a->out);
        rc = outputs_commit();
    }
    if (rc != CLI_OK) outputs_abort();
    attn_tensor *loaded[7] = {&r.q, &r.k_cache, &r.v_cache, &r.k, &r.v, &r.seqlens, &r.table};
    for (int i = 0; i < 7; i++) attn_npy_free(loaded[i]);
    free(r.out.data);
    free(r.lse.data);
    return rc;
}

/* ---- entry points ---- */

static int serving_main(const char *cmd, int argc, char **argv) {
    command = cmd;
    serving_args a;
    memset(&a, 0, sizeof a);
    a.cmd = cmd;
    a.max_q = a.max_k = -1;
    attn_sdpa_params_init(&a.params);
    const bool kvcache = strcmp(cmd, "kvcache") == 0;
    if (kvcache) a.params.causal = ATTN_CAUSAL_BOTTOM_RIGHT; /* flash_attn_with_kvcache's */
    int rc = parse_args(argc, argv, &a);
    if (rc == PARSED_HELP) {
        printf("%s%s", kvcache ? kvcache_options : varlen_options, serving_notes);
        return CLI_OK;
    }
    if (rc != CLI_OK) return rc;
    if (a.threads > 0) attn_set_num_threads(a.threads);
    rc = kvcache ? kvcache_main(&a) : varlen_main(&a);
    cli_modifiers_free(&a.mods);
    return rc;
}

int cli_varlen(int argc, char **argv) { return serving_main("varlen", argc, argv); }

int cli_kvcache(int argc, char **argv) { return serving_main("kvcache", argc, argv); }
