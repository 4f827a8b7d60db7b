/* sdpa_cmd.c — `attn sdpa`: attention on .npy files. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <errno.h>
#include <stdbool.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

typedef struct sdpa_args {
    const char *q, *k, *v, *mask, *out, *weights, *lse;
    attn_sdpa_params params;
    int threads;
    int seed_given;
} sdpa_args;

static int usage_error(const char *fmt, const char *arg) {
    fprintf(stderr, "attn sdpa: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(see attn --help)\n");
    return CLI_USAGE;
}

static int parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    *out = strtod(s, &end);
    return end != s && *end == '\0' && errno == 0 && isfinite(*out);
}

static int parse_u64(const char *s, unsigned long long *out) {
    char *end;
    errno = 0;
    if (*s == '-') return 0;
    *out = strtoull(s, &end, 10);
    return end != s && *end == '\0' && errno == 0;
}

/* Returns CLI_OK or CLI_USAGE. */
static int parse_args(int argc, char **argv, sdpa_args *a) {
    memset(a, 0, sizeof *a);
    attn_sdpa_params_init(&a->params);
    a->out = "out.npy";
    for (int i = 0; i < argc; i++) {
        const char *opt = argv[i];
        /* Options that take a value: -x VALUE. */
        const char **path = strcmp(opt, "-q") == 0           ? &a->q
                            : strcmp(opt, "-k") == 0         ? &a->k
                            : strcmp(opt, "-v") == 0         ? &a->v
                            : strcmp(opt, "--mask") == 0     ? &a->mask
                            : strcmp(opt, "-o") == 0         ? &a->out
                            : strcmp(opt, "--weights") == 0  ? &a->weights
                            : strcmp(opt, "--lse") == 0      ? &a->lse
                                                             : NULL;
        bool takes_value = path != NULL || strcmp(opt, "--scale") == 0 ||
                           strcmp(opt, "--dropout") == 0 || strcmp(opt, "--seed") == 0 ||
                           strcmp(opt, "--threads") == 0;
        if (takes_value && i + 1 >= argc) return usage_error("%s needs a value", opt);
        const char *val = takes_value ? argv[++i] : NULL;
        if (path != NULL) {
            *path = val;
        } else if (strcmp(opt, "--scale") == 0) {
            if (!parse_double(val, &a->params.scale))
                return usage_error("--scale: '%s' is not a finite number", val);
            a->params.has_scale = 1;
        } else if (strcmp(opt, "--dropout") == 0) {
            if (!parse_double(val, &a->params.dropout_p) || a->params.dropout_p < 0 ||
                a->params.dropout_p > 1)
                return usage_error("--dropout: '%s' is not a probability in [0, 1]", val);
        } else if (strcmp(opt, "--seed") == 0) {
            unsigned long long seed;
            if (!parse_u64(val, &seed))
                return usage_error("--seed: '%s' is not a non-negative integer", val);
            a->params.seed = seed;
            a->seed_given = 1;
        } else if (strcmp(opt, "--threads") == 0) {
            unsigned long long n;
            if (!parse_u64(val, &n) || n < 1 || n > 4096)
                return usage_error("--threads: '%s' is not a count from 1 to 4096", val);
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
    if (a->params.dropout_p > 0 && !a->seed_given)
        return usage_error("%s", "--dropout needs --seed N, so that the result is reproducible");
    return CLI_OK;
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

int cli_sdpa(int argc, char **argv) {
    sdpa_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc != CLI_OK) return rc;
    if (a.threads > 0) attn_set_num_threads(a.threads);

    attn_tensor q = {0}, k = {0}, v = {0}, mask = {0}, out = {0}, w = {0}, lse = {0};
    attn_status st;
    rc = CLI_OK;
    const char *what = NULL;
    if ((st = attn_npy_load(a.q, &q)) != ATTN_OK) what = "reading -q";
    else if ((st = attn_npy_load(a.k, &k)) != ATTN_OK) what = "reading -k";
    else if ((st = attn_npy_load(a.v, &v)) != ATTN_OK) what = "reading -v";
    else if (a.mask && (st = attn_npy_load(a.mask, &mask)) != ATTN_OK) what = "reading --mask";
    if (what == NULL) {
        if (a.mask) a.params.attn_mask = &mask;
        int rank;
        int64_t shape[ATTN_MAX_RANK];
        if ((st = attn_sdpa_out_shape(&q, &k, &v, &a.params, &rank, shape)) != ATTN_OK) {
            what = "sdpa";
        } else {
            int64_t wshape[ATTN_MAX_RANK];
            memcpy(wshape, shape, sizeof shape);
            wshape[rank - 1] = k.shape[k.rank - 2];
            if ((st = make_output(&out, q.dtype, rank, shape)) != ATTN_OK ||
                (a.weights && (st = make_output(&w, q.dtype, rank, wshape)) != ATTN_OK) ||
                (a.lse && (st = make_output(&lse, q.dtype, rank - 1, shape)) != ATTN_OK))
                what = "allocating outputs";
        }
    }
    double ms = 0;
    if (what == NULL) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        st = attn_sdpa(&q, &k, &v, &a.params, &out, a.weights ? &w : NULL, a.lse ? &lse : NULL);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
        if (st != ATTN_OK) what = "sdpa";
    }
    if (what == NULL && (st = attn_npy_save(a.out, &out)) != ATTN_OK) what = "writing -o";
    if (what == NULL && a.weights && (st = attn_npy_save(a.weights, &w)) != ATTN_OK)
        what = "writing --weights";
    if (what == NULL && a.lse && (st = attn_npy_save(a.lse, &lse)) != ATTN_OK)
        what = "writing --lse";
    if (what != NULL) {
        rc = cli_fail(what, st);
    } else {
        char sq[96], sk[96], sv[96], so[96];
        printf("sdpa: q%s k%s v%s -> out%s %s, %s path, %d threads, %.3f ms -> %s\n",
               cli_shape(&q, sq, sizeof sq), cli_shape(&k, sk, sizeof sk),
               cli_shape(&v, sv, sizeof sv), cli_shape(&out, so, sizeof so),
               attn_dtype_name(out.dtype), attn_isa_name(attn_get_isa()),
               attn_get_num_threads(), ms, a.out);
    }
    attn_npy_free(&q);
    attn_npy_free(&k);
    attn_npy_free(&v);
    attn_npy_free(&mask);
    free(out.data);
    free(w.data);
    free(lse.data);
    return rc;
}
