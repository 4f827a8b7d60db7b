/* mha_cmd.c — `attn mha`: multi-head attention with a checkpoint's weights
 * (a safetensors file) on .npy inputs. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <ctype.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"

/* A tensor name built from --prefix and a parameter's own name (at most
 * "output.dense.weight", 19 bytes): parse_args keeps the prefix short enough
 * that no name is cut (two names cut alike would find the wrong tensor). */
enum { NAME_BYTES = 512, SUFFIX_MAX = 32 };

typedef struct mha_args {
    const char *weights, *prefix, *q, *k, *v, *out, *attn_weights, *kpm, *mask;
    long long num_heads;
    int causal, batch_first, average, threads;
} mha_args;

const char cli_mha_options[] =
    "mha options:\n"
    "  --weights M.safetensors the module's weights (required), found under --prefix\n"
    "                          by torch.nn.MultiheadAttention's state_dict names\n"
    "                          (in_proj_weight or q/k/v_proj_weight, in_proj_bias,\n"
    "                          bias_k, bias_v, out_proj.weight, out_proj.bias) or, when\n"
    "                          those are absent, by Hugging Face BERT's (self.query.weight,\n"
    "                          self.key.*, self.value.*, output.dense.weight/bias)\n"
    "  --prefix P              the names' prefix, e.g. encoder.layer.0.attention.\n"
    "  --num-heads H           heads (required); embed_dim, kdim, vdim, bias and\n"
    "                          add_bias_kv come from the weights found\n"
    "  -q Q.npy                the query (L, N, E), (N, L, E) with --batch-first, or (L, E)\n"
    "  -k K.npy -v V.npy       key and value (default: the query: self-attention)\n"
    "  -o OUT.npy              the output, shaped like the query (required)\n"
    "  --attn-weights W.npy    also write the attention weights\n"
    "  --average-attn-weights 0|1  average them over the heads (default 1)\n"
    "  --key-padding-mask M.npy (N, S): bool true = ignore that key; float: added\n"
    "  --attn-mask M.npy       (L, S) or (N*H, L, S): bool true = not allowed; float: added\n"
    "  --causal                mask out keys after each query position\n"
    "  --batch-first           inputs and output are (N, L, E)\n"
    "  --threads N             threads, 1 to attn_max_threads()\n"
    "  -h, --help              this text\n"
    "\n"
    "The module computes in the query's dtype (float32, float64 or float16: as\n"
    "torch's module does in it); the weights are converted to it, exactly from\n"
    "float16 and bfloat16 checkpoints. Outputs are all written or none.\n"
    "Exit status: 0 success, 1 runtime error, 2 usage error.\n";

enum { PARSED_HELP = -1 };

#define usage_error(...) cli_usage_error("mha", __VA_ARGS__)

/* A whole number in [lo, hi]. */
static bool parse_count(const char *s, long long lo, long long hi, long long *out) {
    const char *p = s;
    while (isspace((unsigned char)*p)) p++;
    if (*p == '-' || *p == '+') return false;
    char *end;
    errno = 0;
    long long v = strtoll(p, &end, 10);
    if (end == p || *end != '\0' || errno != 0 || v < lo || v > hi) return false;
    *out = v;
    return true;
}

/* The option's string slot, or NULL when it takes no path. */
static const char **path_slot(mha_args *a, const char *opt) {
    static const char *const names[] = {"--weights", "--prefix", "-q", "-k", "-v", "-o",
                                        "--attn-weights", "--key-padding-mask", "--attn-mask"};
    const char **slots[] = {&a->weights, &a->prefix, &a->q, &a->k, &a->v, &a->out,
                            &a->attn_weights, &a->kpm, &a->mask};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(opt, names[i]) == 0) return slots[i];
    return NULL;
}

static int parse_args(int argc, char **argv, mha_args *a) {
    memset(a, 0, sizeof *a);
    a->prefix = "";
    a->average = 1;
    for (int i = 0; i < argc; i++) {
        const char *opt = argv[i];
        if (strcmp(opt, "--help") == 0 || strcmp(opt, "-h") == 0) return PARSED_HELP;
        const char **slot = path_slot(a, opt);
        const bool takes_value = slot != NULL || strcmp(opt, "--num-heads") == 0 ||
                                 strcmp(opt, "--average-attn-weights") == 0 ||
                                 strcmp(opt, "--threads") == 0;
        if (takes_value && i + 1 >= argc) return usage_error("%s needs a value", opt);
        const char *val = takes_value ? argv[++i] : NULL;
        long long n;
        if (slot != NULL) {
            *slot = val;
        } else if (strcmp(opt, "--num-heads") == 0) {
            if (!parse_count(val, 1, INT64_MAX, &a->num_heads))
                return usage_error("--num-heads: '%s' is not a count >= 1", val);
        } else if (strcmp(opt, "--average-attn-weights") == 0) {
            if (!parse_count(val, 0, 1, &n))
                return usage_error("--average-attn-weights: '%s' is not 0 or 1", val);
            a->average = (int)n;
        } else if (strcmp(opt, "--threads") == 0) {
            if (!parse_count(val, 1, attn_max_threads(), &n))
                return usage_error("--threads: '%s' is not a count from 1 to %d", val,
                                   attn_max_threads());
            a->threads = (int)n;
        } else if (strcmp(opt, "--causal") == 0) {
            a->causal = 1;
        } else if (strcmp(opt, "--batch-first") == 0) {
            a->batch_first = 1;
        } else {
            return usage_error("unknown option '%s'", opt);
        }
    }
    if (a->weights == NULL) return usage_error("%s", "--weights M.safetensors is required");
    if (a->num_heads == 0) return usage_error("%s", "--num-heads H is required");
    if (a->q == NULL) return usage_error("%s", "-q Q.npy is required");
    if (a->out == NULL) return usage_error("%s", "-o OUT.npy is required");
    if ((a->k == NULL) != (a->v == NULL))
        return usage_error("%s", "give -k and -v together, or neither (self-attention)");
    if (strlen(a->prefix) >= NAME_BYTES - SUFFIX_MAX)
        return usage_error("--prefix is %zu bytes; at most %d", strlen(a->prefix),
                           NAME_BYTES - SUFFIX_MAX - 1);
    return CLI_OK;
}

/* ---- the weights ---- */

/* Where a module parameter comes from: up to three tensors of the file,
 * stacked along dim 0 (BERT's query, key and value into in_proj_*). */
typedef struct source {
    const char *param;
    char file[3][NAME_BYTES];
    int nfile;
} source;

typedef struct weights {
    attn_safetensors *file;
    const char *scheme; /* "torch" or "BERT" */
    int64_t E, D, kdim, vdim;
    bool bias, bias_kv, packed;
    source src[8];
    int nsrc;
} weights;

static bool has(const weights *w, const char *name) {
    return attn_safetensors_find(w->file, name) >= 0;
}

/* The rank and shape of a tensor that must exist. */
static int shape_of(const weights *w, const char *name, int *rank, int64_t shape[ATTN_MAX_RANK]) {
    const int64_t at = attn_safetensors_find(w->file, name);
    if (at < 0) {
        fprintf(stderr, "attn: --weights: the file has no tensor '%s'\n", name);
        return CLI_RUNTIME;
    }
    attn_safetensors_info(w->file, at, NULL, NULL, NULL, rank, shape);
    return CLI_OK;
}

/* "(3, 4)", "(5,)". */
static const char *shape_text(int rank, const int64_t *shape, char *buf, size_t size) {
    if (rank > ATTN_MAX_RANK) { /* the file's shape past what the library holds */
        snprintf(buf, size, "of %d dimensions", rank);
        return buf;
    }
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int d = 0; d < rank && d < ATTN_MAX_RANK && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, d ? ", %lld" : "%lld",
                                 (long long)shape[d]);
    if (used < size) snprintf(buf + used, size - used, rank == 1 ? ",)" : ")");
    return buf;
}

/* A tensor of the file must have rank `rank` and, when `want` is given,
 * that shape; `what` says what it is, for the message. */
static int check_shape(const weights *w, const char *name, int rank, const int64_t *want,
                       const char *what) {
    int r;
    int64_t s[ATTN_MAX_RANK];
    int rc = shape_of(w, name, &r, s);
    bool ok = rc == CLI_OK && r == rank;
    for (int d = 0; ok && want != NULL && d < rank; d++) ok = s[d] == want[d];
    if (rc != CLI_OK || ok) return rc;
    char got[160], exp[96];
    if (want != NULL)
        fprintf(stderr, "attn: --weights: '%s' has shape %s; expected %s (%s)\n", name,
                shape_text(r, s, got, sizeof got), shape_text(rank, want, exp, sizeof exp), what);
    else
        fprintf(stderr, "attn: --weights: '%s' has shape %s; expected %d dimensions (%s)\n",
                name, shape_text(r, s, got, sizeof got), rank, what);
    return CLI_RUNTIME;
}

/* Shorthands: a matrix (d0, d1), a vector (d0,), bias_k's (1, 1, d0). */
static int check_matrix(const weights *w, const char *name, int64_t d0, int64_t d1,
                        const char *what) {
    return check_shape(w, name, 2, (const int64_t[2]){d0, d1}, what);
}
static int check_vector(const weights *w, const char *name, int64_t d0, const char *what) {
    return check_shape(w, name, 1, (const int64_t[1]){d0}, what);
}

static void add_source(weights *w, const char *param, const char *prefix, const char *a,
                       const char *b, const char *c) {
    source *s = &w->src[w->nsrc++];
    s->param = param;
    const char *names[3] = {a, b, c};
    s->nfile = 0;
    for (int i = 0; i < 3 && names[i] != NULL; i++)
        snprintf(s->file[s->nfile++], sizeof s->file[0], "%s%s", prefix, names[i]);
}

/* Both or neither: a bias without its partner is an error naming it. */
static int pair(const weights *w, const char *a, const char *b, bool *both) {
    const bool ha = has(w, a), hb = has(w, b);
    *both = ha && hb;
    if (ha == hb) return CLI_OK;
    fprintf(stderr, "attn: --weights: '%s' is present but '%s' is missing (both or neither)\n",
            ha ? a : b, ha ? b : a);
    return CLI_RUNTIME;
}

/* torch.nn.MultiheadAttention's state_dict names under prefix P. */
static int torch_names(weights *w, const char *P) {
    char n[6][NAME_BYTES];
    const char *suffix[6] = {"out_proj.weight", "in_proj_weight", "q_proj_weight",
                             "in_proj_bias", "out_proj.bias", "bias_k"};
    for (int i = 0; i < 6; i++) snprintf(n[i], sizeof n[i], "%s%s", P, suffix[i]);
    int r, rc;
    int64_t s[ATTN_MAX_RANK];
    if ((rc = shape_of(w, n[0], &r, s)) != CLI_OK) return rc;
    if (r != 2) return check_shape(w, n[0], 2, NULL, "out_proj.weight: (embed_dim, D)");
    w->E = s[0];
    w->D = s[1];
    w->packed = has(w, n[1]) || !has(w, n[2]);
    if (w->packed) {
        if ((rc = check_matrix(w, n[1], 3 * w->D, w->E, "in_proj_weight: (3 D, embed_dim)")))
            return rc;
        w->kdim = w->vdim = w->E;
        add_source(w, "in_proj_weight", P, "in_proj_weight", NULL, NULL);
    } else {
        char k[NAME_BYTES], v[NAME_BYTES];
        snprintf(k, sizeof k, "%sk_proj_weight", P);
        snprintf(v, sizeof v, "%sv_proj_weight", P);
        int64_t ks[ATTN_MAX_RANK], vs[ATTN_MAX_RANK];
        if ((rc = check_matrix(w, n[2], w->D, w->E, "q_proj_weight: (D, embed_dim)")) ||
            (rc = shape_of(w, k, &r, ks)) || (rc = check_shape(w, k, 2, NULL, "(D, kdim)")) ||
            (rc = check_matrix(w, k, w->D, ks[1], "k_proj_weight: (D, kdim)")) ||
            (rc = shape_of(w, v, &r, vs)) || (rc = check_shape(w, v, 2, NULL, "(D, vdim)")) ||
            (rc = check_matrix(w, v, w->D, vs[1], "v_proj_weight: (D, vdim)")))
            return rc;
        w->kdim = ks[1];
        w->vdim = vs[1];
        add_source(w, "q_proj_weight", P, "q_proj_weight", NULL, NULL);
        add_source(w, "k_proj_weight", P, "k_proj_weight", NULL, NULL);
        add_source(w, "v_proj_weight", P, "v_proj_weight", NULL, NULL);
    }
    char bv[NAME_BYTES];
    snprintf(bv, sizeof bv, "%sbias_v", P);
    if ((rc = pair(w, n[3], n[4], &w->bias)) || (rc = pair(w, n[5], bv, &w->bias_kv))) return rc;
    if (w->bias && ((rc = check_vector(w, n[3], 3 * w->D, "in_proj_bias: (3 D,)")) ||
                    (rc = check_vector(w, n[4], w->E, "out_proj.bias: (embed_dim,)"))))
        return rc;
    if (w->bias_kv &&
        ((rc = check_shape(w, n[5], 3, (const int64_t[3]){1, 1, w->D}, "bias_k: (1, 1, D)")) ||
         (rc = check_shape(w, bv, 3, (const int64_t[3]){1, 1, w->D}, "bias_v: (1, 1, D)"))))
        return rc;
    if (w->bias) add_source(w, "in_proj_bias", P, "in_proj_bias", NULL, NULL);
    if (w->bias_kv) {
        add_source(w, "bias_k", P, "bias_k", NULL, NULL);
        add_source(w, "bias_v", P, "bias_v", NULL, NULL);
    }
    add_source(w, "out_proj.weight", P, "out_proj.weight", NULL, NULL);
    if (w->bias) add_source(w, "out_proj.bias", P, "out_proj.bias", NULL, NULL);
    return CLI_OK;
}

/* Hugging Face BERT's BertAttention names under prefix P: self.query,
 * self.key, self.value and output.dense (Linear weights and biases). */
static int bert_names(weights *w, const char *P) {
    static const char *const lin[4] = {"self.query", "self.key", "self.value", "output.dense"};
    char wn[4][NAME_BYTES], bn[4][NAME_BYTES];
    int64_t s[4][ATTN_MAX_RANK];
    int r, rc, nbias = 0;
    for (int i = 0; i < 4; i++) {
        snprintf(wn[i], sizeof wn[i], "%s%s.weight", P, lin[i]);
        snprintf(bn[i], sizeof bn[i], "%s%s.bias", P, lin[i]);
        if ((rc = shape_of(w, wn[i], &r, s[i])) != CLI_OK) return rc;
        if (r != 2) return check_shape(w, wn[i], 2, NULL, "a Linear weight: (out, in)");
        nbias += has(w, bn[i]);
    }
    w->D = s[0][0];
    w->E = s[0][1];
    w->kdim = s[1][1];
    w->vdim = s[2][1];
    if ((rc = check_matrix(w, wn[1], w->D, w->kdim, "self.key: (D, kdim)")) ||
        (rc = check_matrix(w, wn[2], w->D, w->vdim, "self.value: (D, vdim)")) ||
        (rc = check_matrix(w, wn[3], w->E, w->D, "output.dense: (hidden, D)")))
        return rc;
    if (nbias != 0 && nbias != 4) {
        for (int i = 0; i < 4; i++)
            if (!has(w, bn[i]))
                fprintf(stderr, "attn: --weights: '%s' is missing (the other biases are there)\n",
                        bn[i]);
        return CLI_RUNTIME;
    }
    w->bias = nbias == 4;
    for (int i = 0; w->bias && i < 4; i++)
        if ((rc = check_vector(w, bn[i], i == 3 ? w->E : w->D, "a Linear bias: (out,)")))
            return rc;
    w->packed = w->kdim == w->E && w->vdim == w->E;
    if (w->packed) {
        add_source(w, "in_proj_weight", P, "self.query.weight", "self.key.weight", "self.value.weight");
    } else {
        add_source(w, "q_proj_weight", P, "self.query.weight", NULL, NULL);
        add_source(w, "k_proj_weight", P, "self.key.weight", NULL, NULL);
        add_source(w, "v_proj_weight", P, "self.value.weight", NULL, NULL);
    }
    if (w->bias) add_source(w, "in_proj_bias", P, "self.query.bias", "self.key.bias", "self.value.bias");
    add_source(w, "out_proj.weight", P, "output.dense.weight", NULL, NULL);
    if (w->bias) add_source(w, "out_proj.bias", P, "output.dense.bias", NULL, NULL);
    return CLI_OK;
}

static int find_weights(weights *w, const char *P) {
    char probe[2][NAME_BYTES];
    snprintf(probe[0], sizeof probe[0], "%sout_proj.weight", P);
    snprintf(probe[1], sizeof probe[1], "%sself.query.weight", P);
    if (has(w, probe[0])) {
        w->scheme = "torch";
        return torch_names(w, P);
    }
    if (has(w, probe[1])) {
        w->scheme = "BERT";
        return bert_names(w, P);
    }
    fprintf(stderr,
            "attn: --weights: no attention weights under the prefix '%s': expected '%s' "
            "(torch.nn.MultiheadAttention) or '%s' (BERT). The file's first tensors:\n",
            P, probe[0], probe[1]);
    for (int64_t i = 0; i < attn_safetensors_count(w->file) && i < 8; i++) {
        const char *name;
        attn_safetensors_info(w->file, i, &name, NULL, NULL, NULL, NULL);
        fprintf(stderr, "  %s\n", name);
    }
    return CLI_RUNTIME;
}

/* Copies every source into the module's parameters (converted exactly to
 * the module's dtype; stacked sources fill consecutive rows). */
static int load_params(const weights *w, attn_mha *m) {
    for (int i = 0; i < w->nsrc; i++) {
        const source *s = &w->src[i];
        attn_tensor view;
        attn_status st = attn_mha_param(m, s->param, &view);
        if (st != ATTN_OK) return cli_fail(s->param, st);
        size_t offset = 0;
        for (int j = 0; j < s->nfile; j++) {
            int rank;
            int64_t shape[ATTN_MAX_RANK];
            attn_safetensors_info(w->file, attn_safetensors_find(w->file, s->file[j]), NULL,
                                  NULL, NULL, &rank, shape);
            attn_tensor dst;
            memset(&dst, 0, sizeof dst);
            dst.data = (char *)view.data + offset * attn_dtype_size(view.dtype);
            dst.dtype = view.dtype;
            dst.rank = rank;
            int64_t stride = 1;
            for (int d = rank - 1; d >= 0; d--) {
                dst.shape[d] = shape[d];
                dst.strides[d] = stride;
                stride *= shape[d];
            }
            char what[600];
            snprintf(what, sizeof what, "reading '%s'", s->file[j]);
            if ((st = attn_safetensors_read_into(w->file, s->file[j], &dst)) != ATTN_OK)
                return cli_fail(what, st);
            offset += (size_t)stride;
        }
    }
    return CLI_OK;
}

/* ---- the run ---- */

typedef struct mha_run {
    attn_tensor q, k, v, kpm, mask, out, w;
    weights wt;
    attn_mha *m;
    double ms;
} mha_run;

static int load_npy(const char *option, const char *path, attn_tensor *t) {
    char what[48];
    snprintf(what, sizeof what, "reading %s", option);
    attn_status st = attn_npy_load(path, t);
    return st == ATTN_OK ? CLI_OK : cli_fail(what, st);
}

static int make_module(const mha_args *a, mha_run *r) {
    weights *w = &r->wt;
    attn_status st = attn_safetensors_open(a->weights, &w->file);
    if (st != ATTN_OK) return cli_fail("reading --weights", st);
    int rc = find_weights(w, a->prefix);
    if (rc != CLI_OK) return rc;
    if (w->D % a->num_heads != 0) {
        fprintf(stderr,
                "attn: --num-heads %lld does not divide the projection size D = %lld of the %s "
                "weights under '%s'\n",
                a->num_heads, (long long)w->D, w->scheme, a->prefix);
        return CLI_RUNTIME;
    }
    attn_mha_config c;
    attn_mha_config_init(&c, w->E, a->num_heads);
    c.head_dim = w->D / a->num_heads;
    c.kdim = w->kdim;
    c.vdim = w->vdim;
    c.bias = w->bias;
    c.add_bias_kv = w->bias_kv;
    c.batch_first = a->batch_first;
    c.dtype = r->q.dtype;
    if ((st = attn_mha_create(&c, &r->m)) != ATTN_OK) return cli_fail("mha", st);
    if (c.dtype == ATTN_DTYPE_F32 || c.dtype == ATTN_DTYPE_F64) return load_params(w, r->m);
    /* A 16-bit module: the checkpoint (any float dtype) read into a float64
     * module, which holds each value exactly, then every parameter rounded
     * once to the query's dtype. */
    attn_mha *wide = NULL;
    c.dtype = ATTN_DTYPE_F64;
    if ((st = attn_mha_create(&c, &wide)) != ATTN_OK) return cli_fail("mha", st);
    rc = load_params(w, wide);
    for (int i = 0; rc == CLI_OK && i < attn_mha_param_count(wide); i++) {
        const char *name;
        attn_tensor view;
        if ((st = attn_mha_param_at(wide, i, &name, &view)) != ATTN_OK ||
            (st = attn_mha_set_param(r->m, name, &view)) != ATTN_OK)
            rc = cli_fail("mha", st);
    }
    attn_mha_destroy(wide);
    return rc;
}

static int compute(const mha_args *a, mha_run *r) {
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    fp.key_padding_mask = a->kpm ? &r->kpm : NULL;
    fp.attn_mask = a->mask ? &r->mask : NULL;
    fp.is_causal = a->causal;
    fp.average_attn_weights = a->average;
    const attn_tensor *k = a->k ? &r->k : &r->q, *v = a->v ? &r->v : &r->q;
    int orank, wrank;
    int64_t oshape[ATTN_MAX_RANK], wshape[ATTN_MAX_RANK];
    attn_status st = attn_mha_out_shapes(r->m, &r->q, k, &fp, a->attn_weights != NULL, &orank,
                                         oshape, &wrank, wshape);
    if (st != ATTN_OK) return cli_fail("mha", st);
    const size_t es = attn_dtype_size(r->q.dtype);
    int64_t on = 1, wn = 1;
    for (int d = 0; d < orank; d++) on *= oshape[d];
    for (int d = 0; a->attn_weights && d < wrank; d++) wn *= wshape[d];
    void *od = calloc((size_t)on, es), *wd = a->attn_weights ? calloc((size_t)wn, es) : NULL;
    if (od == NULL || (a->attn_weights && wd == NULL)) {
        free(od);
        free(wd);
        fprintf(stderr, "attn: allocating outputs: out of memory\n");
        return CLI_RUNTIME;
    }
    attn_tensor_init(&r->out, od, r->q.dtype, orank, oshape);
    if (wd != NULL) attn_tensor_init(&r->w, wd, r->q.dtype, wrank, wshape);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    st = attn_mha_forward(r->m, &r->q, k, v, &fp, &r->out, wd ? &r->w : NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    r->ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    return st == ATTN_OK ? CLI_OK : cli_fail("mha", st);
}

static int run(const mha_args *a, mha_run *r) {
    const char *in_opts[6] = {"--weights", "-q", "-k", "-v", "--key-padding-mask", "--attn-mask"};
    const char *ins[6] = {a->weights, a->q, a->k, a->v, a->kpm, a->mask};
    int rc = CLI_OK;
    for (int i = 0; i < 6 && rc == CLI_OK; i++) rc = outputs_input(in_opts[i], ins[i]);
    if (rc == CLI_OK) rc = outputs_add("-o", a->out);
    if (rc == CLI_OK && a->attn_weights) rc = outputs_add("--attn-weights", a->attn_weights);
    if (rc == CLI_OK) rc = load_npy("-q", a->q, &r->q);
    if (rc == CLI_OK && a->k) rc = load_npy("-k", a->k, &r->k);
    if (rc == CLI_OK && a->v) rc = load_npy("-v", a->v, &r->v);
    if (rc == CLI_OK && a->kpm) rc = load_npy("--key-padding-mask", a->kpm, &r->kpm);
    if (rc == CLI_OK && a->mask) rc = load_npy("--attn-mask", a->mask, &r->mask);
    if (rc == CLI_OK && r->q.dtype == ATTN_DTYPE_BOOL) {
        fprintf(stderr, "attn: -q: '%s' is %s; mha needs float32, float64 or float16\n", a->q,
                attn_dtype_name(r->q.dtype));
        rc = CLI_RUNTIME;
    }
    if (rc == CLI_OK) rc = make_module(a, r);
    if (rc == CLI_OK) rc = compute(a, r);
    if (rc == CLI_OK) rc = outputs_stage("-o", &r->out);
    if (rc == CLI_OK) rc = outputs_stage("--attn-weights", &r->w);
    if (rc != CLI_OK) outputs_abort(); /* removes any temporary */
    return rc; /* (committed by cli_mha after its summary line) */
}

int cli_mha(int argc, char **argv) {
    mha_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc == PARSED_HELP) {
        printf("usage: attn mha --weights M.safetensors [--prefix P] --num-heads H -q Q.npy\n"
               "                -o OUT.npy [options]\n\n%s",
               cli_mha_options);
        return CLI_OK;
    }
    if (rc != CLI_OK) return rc;
    if (a.threads > 0) attn_set_num_threads(a.threads);
    mha_run r;
    memset(&r, 0, sizeof r);
    rc = run(&a, &r);
    if (rc == CLI_OK) { /* the summary before the commit, which checks it arrived */
        char sq[96], so[96];
        printf("mha: query%s -> out%s %s, %lld heads, %s weights under '%s', %s path, %d "
               "threads, %.3f ms -> %s\n",
               cli_shape(&r.q, sq, sizeof sq), cli_shape(&r.out, so, sizeof so),
               attn_dtype_name(r.out.dtype), a.num_heads, r.wt.scheme, a.prefix,
               attn_isa_name(attn_get_isa()), attn_get_num_threads(), r.ms, a.out);
        rc = outputs_commit();
    }
    attn_safetensors_close(r.wt.file);
    attn_mha_destroy(r.m);
    attn_npy_free(&r.q);
    attn_npy_free(&r.k);
    attn_npy_free(&r.v);
    attn_npy_free(&r.kpm);
    attn_npy_free(&r.mask);
    free(r.out.data);
    free(r.w.data);
    return rc;
}
