/*
 * fuzz_mha.c — multi-head attention from configuration to forward pass, all
 * drawn from the fuzz input: attn_mha_create (every config field, wild
 * values included), the parameter accessors, attn_mha_out_shapes and
 * attn_mha_forward with key-padding and attention masks (bool/float, 2-D and
 * 3-D), need_weights averaged or per head, causal, training dropout,
 * batched/unbatched/batch_first layouts and exactly-sized buffers.
 *
 * Invariants: status and message agree; a failed create leaves *mha NULL;
 * attn_mha_forward fails when attn_mha_out_shapes rejects query/key; no library allocation outlives a call except the
 * module's own (two blocks), and destroy frees them; finite, moderate inputs
 * give a finite output and weights in [0, 1/(1-p)].
 *
 * After a forward that succeeded, the same call goes through
 * attn_mha_forward_train and attn_mha_backward with fuzzed gradient views
 * (each maybe absent, any layout, sometimes mis-shaped) and a grads module
 * of the same, another, or no configuration (or mha itself): status and
 * message agree, the saved context's blocks are the only ones that
 * outlive forward_train and its destroy frees them, and tame inputs give
 * finite gradients.
 */
#include "fuzz_util.h"

enum {
    BUF_LIMIT = 1 << 14, /* elements backing one view */
    WORK_LIMIT = 1 << 20 /* rough multiply-adds of one forward call */
};

static attn_dtype pick_dtype(fz *f, attn_dtype usual) {
    if (!fz_one_in(f, 32)) return usual;
    static const attn_dtype odd[] = {ATTN_DTYPE_F32, ATTN_DTYPE_F64, ATTN_DTYPE_BOOL,
                                     ATTN_DTYPE_F16, ATTN_DTYPE_BF16, (attn_dtype)0,
                                     (attn_dtype)9};
    return odd[fz_u8(f) % 7];
}

static int64_t pick_opt_dim(fz *f, int64_t max) { /* 0 = derived */
    uint8_t b = fz_u8(f) % 16;
    if (b < 10) return 0;
    if (b < 15) return fz_range(f, 1, max);
    return fz_wild(f);
}

static int pick_flag(fz *f) {
    uint8_t b = fz_u8(f) % 16;
    return b < 14 ? (b & 1) : b == 14 ? 2 : -1; /* any non-zero is true */
}

static double pick_dropout(fz *f) {
    if (!fz_one_in(f, 3)) return 0.0;
    static const double ps[] = {0.25, 0.5, 1.0, 0.9, -0.5, 2.0, NAN, INFINITY};
    return ps[fz_u8(f) % 8];
}

static void make(fz *f, fz_tensor *x, attn_dtype dt, int rank, int64_t *shape, bool output,
                 fz_values *vals) {
    if (fz_one_in(f, 20)) { /* perturb one dimension or the rank */
        if (fz_bool(f)) {
            rank = (int)fz_range(f, 0, 5);
            for (int d = 0; d < rank; d++)
                if (shape[d] < 1) shape[d] = 1;
        } else if (rank >= 1) {
            shape[fz_range(f, 0, rank - 1)] = fz_one_in(f, 2) ? fz_wild(f) : fz_range(f, 1, 6);
        }
    }
    fz_tensor_make(f, x, dt, rank, shape, output, BUF_LIMIT, vals, !output);
}

static bool values_in(const attn_tensor *t, double lo, double hi) {
    int64_t idx[ATTN_MAX_RANK] = {0}, n = attn_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        double x = fz_get(t, idx);
        if (!(x >= lo && x <= hi)) return false;
        for (int d = t->rank - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d]) break;
            idx[d] = 0;
        }
    }
    return true;
}

/* The parameter accessors, on a live module. */
static void fuzz_params(fz *f, attn_mha *m, attn_dtype dt, fz_values *vals) {
    int count = attn_mha_param_count(m);
    FZ_ASSERT(count >= 2 && count <= 8, "%d parameters", count);
    int index = (int)fz_range(f, -1, count);
    const char *name = NULL;
    attn_tensor view;
    attn_status st = attn_mha_param_at(m, index, &name, &view);
    fz_check_status(st, "attn_mha_param_at");
    FZ_ASSERT((st == ATTN_OK) == (index >= 0 && index < count), "param_at(%d) gave %d", index,
              (int)st);
    static const char *junk[] = {"", "bias", "in_proj_weight ", "out_proj", "q_proj_weight",
                                 "bias_k", "in_proj_bias", "out_proj.bias"};
    if (st != ATTN_OK) name = junk[fz_u8(f) % 8];
    attn_tensor view2;
    st = attn_mha_param(m, name, &view2);
    fz_check_status(st, "attn_mha_param");
    if (st != ATTN_OK || !fz_bool(f)) return;
    /* Overwrite it from a tensor of (usually) the right shape and any layout. */
    int64_t shape[ATTN_MAX_RANK];
    memcpy(shape, view2.shape, sizeof shape);
    fz_tensor src;
    make(f, &src, pick_dtype(f, fz_bool(f) ? dt : (dt == ATTN_DTYPE_F32 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32)),
         view2.rank, shape, false, vals);
    if (src.backed) {
        st = attn_mha_set_param(m, name, &src.t);
        fz_check_status(st, "attn_mha_set_param");
    }
    fz_tensor_free(&src);
}

/* forward_train + backward of a call the forward accepted. */
static void fuzz_backward(fz *f, attn_mha *m, const attn_mha_config *c, const fz_tensor *in[3],
                          const attn_mha_forward_params *fpp, fz_tensor *out, fz_values *vals,
                          long module_blocks) {
    attn_mha_saved *saved = NULL;
    attn_status st = attn_mha_forward_train(m, &in[0]->t, &in[1]->t, &in[2]->t, fpp, &out->t,
                                            NULL, &saved);
    fz_check_status(st, "attn_mha_forward_train");
    FZ_ASSERT((st == ATTN_OK) == (saved != NULL), "saved and status disagree");
    if (st != ATTN_OK) return;
    /* the context's blocks (buffers, mask copies, itself) outlive the call */
    FZ_ASSERT(fz_live_blocks() > module_blocks, "forward_train kept nothing");
    fz_tensor dout, d[3];
    memset(d, 0, sizeof d);
    int64_t shape[ATTN_MAX_RANK];
    memcpy(shape, out->t.shape, sizeof shape);
    make(f, &dout, fz_one_in(f, 16) ? ATTN_DTYPE_F32 : c->dtype, out->t.rank, shape, false, vals);
    attn_tensor *dp[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; i++) {
        if (fz_one_in(f, 3)) continue;
        memcpy(shape, in[i]->t.shape, sizeof shape);
        make(f, &d[i], c->dtype, in[i]->t.rank, shape, true, vals);
        dp[i] = &d[i].t;
    }
    attn_mha *g = NULL;
    attn_mha_config gc = *c;
    if (fz_one_in(f, 8)) gc.num_heads = c->num_heads == 1 ? 2 : 1;
    gc.head_dim = c->head_dim;
    const int which = (int)fz_range(f, 0, 7); /* 0: none, 1: mha itself, else a module */
    if (which >= 2 && attn_mha_create(&gc, &g) != ATTN_OK) g = NULL;
    const long before = fz_live_blocks();
    bool backed = dout.backed;
    for (int i = 0; i < 3; i++) backed = backed && (dp[i] == NULL || d[i].backed);
    if (backed) {
        st = attn_mha_backward(m, saved, &in[0]->t, &in[1]->t, &in[2]->t, &dout.t, dp[0], dp[1],
                               dp[2], which == 1 ? m : g);
        fz_check_status(st, "attn_mha_backward");
        FZ_ASSERT(fz_live_blocks() == before, "attn_mha_backward leaked");
        if (st == ATTN_OK && vals->tame)
            for (int i = 0; i < 3; i++)
                FZ_ASSERT(dp[i] == NULL || fz_all_finite(dp[i], false),
                          "tame inputs gave a non-finite gradient");
    }
    attn_mha_destroy(g);
    attn_mha_saved_destroy(saved);
    FZ_ASSERT(fz_live_blocks() == module_blocks, "attn_mha_saved_destroy left %ld blocks",
              fz_live_blocks() - module_blocks);
    fz_tensor_free(&dout);
    for (int i = 0; i < 3; i++) fz_tensor_free(&d[i]);
}

/* One drawn call: the module's configuration as it reports it, and the
 * tensors and parameters of a forward through it. */
typedef struct mha_call {
    attn_mha_config c;
    bool batched, self, need_weights;
    int64_t N, L, S, H, Sx; /* Sx = S + add_bias_kv + add_zero_attn, saturated */
    /* one shape array for every tensor drawn, as make() may perturb a
     * tensor's rank upwards and then read entries an earlier one left */
    int64_t shape[ATTN_MAX_RANK];
    fz_tensor query, key, value, kpm, amask, out, weights;
    attn_mha_forward_params fp;
} mha_call;

/* A module from a fuzzed configuration (wild values included), or NULL
 * when attn_mha_create refused it; *c is its configuration as reported. */
static attn_mha *draw_module(fz *f, fz_values *vals, attn_mha_config *c) {
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, fz_dim(f, 8, true), fz_dim(f, 4, true));
    cfg.head_dim = pick_opt_dim(f, 4);
    cfg.kdim = pick_opt_dim(f, 8);
    cfg.vdim = pick_opt_dim(f, 8);
    cfg.bias = pick_flag(f);
    cfg.add_bias_kv = pick_flag(f);
    cfg.add_zero_attn = pick_flag(f);
    cfg.batch_first = pick_flag(f);
    cfg.dropout = pick_dropout(f);
    static const attn_dtype module_dtypes[] = {ATTN_DTYPE_F32, ATTN_DTYPE_F64, ATTN_DTYPE_F16,
                                               ATTN_DTYPE_BF16};
    cfg.dtype = pick_dtype(f, module_dtypes[fz_u8(f) % 4]);
    cfg.init_seed = fz_u64(f);
    attn_mha *m = (attn_mha *)&cfg; /* must become NULL on failure */
    attn_status st = attn_mha_create(fz_one_in(f, 64) ? NULL : &cfg, &m);
    fz_check_status(st, "attn_mha_create");
    if (st != ATTN_OK) {
        FZ_ASSERT(m == NULL, "a failed attn_mha_create left *mha set");
        FZ_ASSERT(fz_live_blocks() == 0, "a failed attn_mha_create leaked");
        return NULL;
    }
    *c = (attn_mha_config){.struct_size = sizeof *c}; /* how much get_config may write */
    fz_check_status(attn_mha_get_config(m, c), "attn_mha_get_config");
    FZ_ASSERT(c->head_dim >= 1 && c->kdim >= 1 && c->vdim >= 1, "derived fields not filled");
    if (fz_one_in(f, 4)) fuzz_params(f, m, c->dtype, vals);
    return m;
}

/* The shape of a sequence of T rows of F features in the call's layout. */
static void seq_shape(const mha_call *k, int64_t T, int64_t F, int64_t *shape) {
    if (!k->batched) {
        shape[0] = T, shape[1] = F;
    } else if (k->c.batch_first) {
        shape[0] = k->N, shape[1] = T, shape[2] = F;
    } else {
        shape[0] = T, shape[1] = k->N, shape[2] = F;
    }
}

/* query, key, value: batched or not, key and value maybe the query's own. */
static void draw_inputs(fz *f, mha_call *k, fz_values *vals) {
    const attn_dtype dt = k->c.dtype;
    k->batched = !fz_one_in(f, 4);
    k->N = fz_dim(f, 3, true), k->L = fz_dim(f, 5, true), k->S = fz_dim(f, 5, true);
    k->H = k->c.num_heads;
    if (__builtin_add_overflow(k->S, k->c.add_bias_kv + k->c.add_zero_attn, &k->Sx))
        k->Sx = INT64_MAX;
    const int rank = k->batched ? 3 : 2;
    int64_t *shape = k->shape;
    seq_shape(k, k->L, k->c.embed_dim, shape);
    make(f, &k->query, pick_dtype(f, dt), rank, shape, false, vals);
    k->self = k->c.kdim == k->c.embed_dim && k->c.vdim == k->c.embed_dim && k->L == k->S &&
              fz_bool(f);
    if (k->self) { /* key and value are the query's own view */
        k->key = k->query;
        k->key.alloc = NULL;
        k->value = k->key;
    } else {
        seq_shape(k, k->S, k->c.kdim, shape);
        make(f, &k->key, pick_dtype(f, dt), rank, shape, false, vals);
        seq_shape(k, k->S, k->c.vdim, shape);
        make(f, &k->value, pick_dtype(f, dt), rank, shape, false, vals);
    }
}

/* The forward's parameters: masks (bool or float, 2-D or 3-D), causal,
 * training, dropout of the call. */
static void draw_params(fz *f, mha_call *k, fz_values *vals) {
    const attn_dtype dt = k->c.dtype;
    attn_mha_forward_params *fp = &k->fp;
    attn_mha_forward_params_init(fp);
    int64_t *shape = k->shape;
    uint8_t mk = fz_u8(f);
    const attn_dtype mask_dtypes[] = {ATTN_DTYPE_BOOL, ATTN_DTYPE_F32, dt}; /* float: any */
    if (mk % 4 != 0) { /* key_padding_mask (N, S) or unbatched (S) */
        shape[0] = k->batched ? k->N : k->S;
        shape[1] = k->S;
        make(f, &k->kpm, pick_dtype(f, mask_dtypes[mk % 4 - 1]), k->batched ? 2 : 1, shape,
             false, vals);
        fz_sprinkle_neg_inf(f, &k->kpm);
        fp->key_padding_mask = &k->kpm.t;
    }
    mk >>= 2;
    if (mk % 4 != 0) { /* attn_mask (L, S) or (N*H, L, S) / (H, L, S) */
        const bool three = fz_bool(f);
        int64_t NH;
        if (__builtin_mul_overflow(k->batched ? k->N : 1, k->H, &NH)) NH = 1;
        shape[0] = three ? NH : k->L;
        shape[1] = three ? k->L : k->S;
        shape[2] = k->S;
        make(f, &k->amask, pick_dtype(f, mask_dtypes[mk % 4 - 1]), three ? 3 : 2, shape, false,
             vals);
        fz_sprinkle_neg_inf(f, &k->amask);
        fp->attn_mask = &k->amask.t;
    }
    fp->average_attn_weights = pick_flag(f);
    fp->is_causal = pick_flag(f);
    fp->training = pick_flag(f);
    fp->seed = fz_u64(f);
    fp->rng_offset = fz_bool(f) ? fz_u64(f) : 0;
    if (fz_one_in(f, 8)) { /* this call's dropout instead of the module's */
        static const double ps[] = {0.0, 0.5, 1.0, 0.1, -0.1, 1.5, NAN, INFINITY};
        fp->has_dropout = 1;
        fp->dropout = ps[fz_u8(f) % 8];
    }
}

/* out, and the weights when asked for (averaged or per head). */
static void draw_outputs(fz *f, mha_call *k, fz_values *vals) {
    int64_t *shape = k->shape;
    seq_shape(k, k->L, k->c.embed_dim, shape);
    make(f, &k->out, pick_dtype(f, k->c.dtype), k->batched ? 3 : 2, shape, true, vals);
    k->need_weights = fz_bool(f);
    if (k->need_weights) {
        int wr = 0;
        if (k->batched) shape[wr++] = k->N;
        if (!k->fp.average_attn_weights) shape[wr++] = k->H;
        shape[wr++] = k->L;
        shape[wr++] = k->Sx;
        make(f, &k->weights, pick_dtype(f, k->c.dtype), wr, shape, true, vals);
    }
}

/* attn_mha_out_shapes, and the weights' shape it reports against the one
 * built from the docs. */
static attn_status check_out_shapes(attn_mha *m, const mha_call *k,
                                    const attn_mha_forward_params *fpp, long module_blocks) {
    int out_rank = 0, w_rank = 0;
    int64_t out_shape[ATTN_MAX_RANK], w_shape[ATTN_MAX_RANK];
    const attn_status st = attn_mha_out_shapes(m, &k->query.t, &k->key.t, fpp, k->need_weights,
                                               &out_rank, out_shape, &w_rank, w_shape);
    fz_check_status(st, "attn_mha_out_shapes");
    FZ_ASSERT(fz_live_blocks() == module_blocks, "attn_mha_out_shapes leaked");
    if (st == ATTN_OK && k->need_weights && fpp != NULL && k->out.t.rank == out_rank) {
        const bool same = w_rank == (k->batched ? 3 : 2) + (k->fp.average_attn_weights ? 0 : 1);
        FZ_ASSERT(same, "weights rank %d", w_rank);
        /* S' = the key's length (as built, or as perturbed) + appended rows. */
        const int64_t S_key = k->key.t.shape[k->batched && k->c.batch_first ? 1 : 0];
        const int extra = k->c.add_bias_kv + k->c.add_zero_attn;
        FZ_ASSERT(w_shape[w_rank - 1] == S_key + extra,
                  "weights last dim %lld, expected S' = %lld + %d", (long long)w_shape[w_rank - 1],
                  (long long)S_key, extra);
    }
    return st;
}

/* Rough multiply-adds of the forward (projections and attention) from the
 * shapes actually passed; -1 when they overflow. */
static int64_t forward_work(const mha_call *k) {
    const attn_mha_config *c = &k->c;
    const int qb = k->batched && c->batch_first ? 1 : 0;
    const int64_t Lq = k->query.t.shape[qb], Nq = k->batched ? k->query.t.shape[1 - qb] : 1;
    const int64_t Sk = k->key.t.shape[qb] + c->add_bias_kv + c->add_zero_attn;
    const int64_t D = c->num_heads * c->head_dim;
    int64_t rows, a, b, work;
    if (__builtin_mul_overflow(Sk, 2, &rows) || __builtin_add_overflow(rows, Lq, &rows) ||
        __builtin_mul_overflow(rows, Nq, &rows) || __builtin_mul_overflow(rows, D, &a) ||
        __builtin_mul_overflow(a, c->embed_dim + c->kdim + c->vdim, &a) ||
        __builtin_mul_overflow(Nq, k->H, &b) || __builtin_mul_overflow(b, Lq, &b) ||
        __builtin_mul_overflow(b, Sk, &b) || __builtin_mul_overflow(b, 2 * c->head_dim + 1, &b) ||
        __builtin_add_overflow(a, b, &work))
        return -1;
    return work;
}

/* The forward on backed views; after a success, the same call's backward. */
static void run_forward(fz *f, attn_mha *m, mha_call *k, const attn_mha_forward_params *fpp,
                        attn_status st_shape, fz_values *vals, long module_blocks) {
    fz_hostile h;
    fz_hostile_begin(f, &h, &k->out, fz_bool(f) ? &k->query : &k->value);
    const attn_status st = attn_mha_forward(m, &k->query.t, &k->key.t, &k->value.t, fpp, &k->out.t,
                                            k->need_weights ? &k->weights.t : NULL);
    fz_hostile_end(&h, st);
    fz_check_status(st, "attn_mha_forward");
    FZ_ASSERT(fz_live_blocks() == module_blocks, "attn_mha_forward leaked %ld blocks",
              fz_live_blocks() - module_blocks);
    /* Rejected query/key are rejected by the forward pass too (with the
     * same status unless the value, which only forward sees, fails first). */
    if (st_shape != ATTN_OK)
        FZ_ASSERT(st != ATTN_OK, "attn_mha_forward accepted what attn_mha_out_shapes "
                  "rejected with %d", (int)st_shape);
    if (st == ATTN_OK && vals->tame) {
        FZ_ASSERT(fz_all_finite(&k->out.t, false), "finite inputs gave a non-finite output");
        const double dropout = k->fp.has_dropout ? k->fp.dropout : k->c.dropout;
        const double p = (fpp != NULL && k->fp.training) ? dropout : 0.0;
        /* a 16-bit weight is rounded per head, and again when averaged */
        const double u = k->c.dtype == ATTN_DTYPE_BF16  ? 0x1p-8
                         : k->c.dtype == ATTN_DTYPE_F16 ? 0x1p-11
                                                        : 1e-6;
        const double wmax = p < 1.0 ? (1.0 / (1.0 - p)) * (1 + u) * (1 + u) : 0.0;
        if (k->need_weights)
            FZ_ASSERT(values_in(&k->weights.t, 0.0, wmax), "a weight is outside [0, %g]", wmax);
    }
    if (st == ATTN_OK) {
        const fz_tensor *in[3] = {&k->query, &k->key, &k->value};
        fuzz_backward(f, m, &k->c, in, fpp, &k->out, vals, module_blocks);
    }
}

/* Valid arguments this harness cannot back with memory (huge strides, or
 * too much work): with every allocation refused, the forward pass must stop
 * at its workspace, before it reads an input or writes an output (those
 * point at a PROT_NONE page). This fuzzes the validation and planning
 * arithmetic on extreme but legal views. */
static void run_without_memory(attn_mha *m, mha_call *k, const attn_mha_forward_params *fpp,
                               long module_blocks) {
    const size_t old = fz_set_alloc_limit(0);
    const attn_status st = attn_mha_forward(m, &k->query.t, &k->key.t, &k->value.t, fpp,
                                            &k->out.t, k->need_weights ? &k->weights.t : NULL);
    fz_set_alloc_limit(old);
    fz_check_status(st, "attn_mha_forward (no memory)");
    FZ_ASSERT(st != ATTN_OK, "attn_mha_forward succeeded without memory");
    FZ_ASSERT(fz_live_blocks() == module_blocks, "attn_mha_forward leaked");
}

static void free_call(mha_call *k) {
    fz_tensor_free(&k->query);
    fz_tensor_free(&k->key);
    if (!k->self) fz_tensor_free(&k->value);
    fz_tensor_free(&k->kpm);
    fz_tensor_free(&k->amask);
    fz_tensor_free(&k->out);
    fz_tensor_free(&k->weights);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz f = {data, size};
    fz_values vals = {true};
    fz_begin_attention(&f);

    mha_call k;
    memset(&k, 0, sizeof k);
    attn_mha *m = draw_module(&f, &vals, &k.c);
    if (m == NULL) return 0;
    const long module_blocks = fz_live_blocks();
    draw_inputs(&f, &k, &vals);
    draw_params(&f, &k, &vals);
    draw_outputs(&f, &k, &vals);

    const attn_mha_forward_params *fpp = fz_one_in(&f, 32) ? NULL : &k.fp;
    const attn_status st_shape = check_out_shapes(m, &k, fpp, module_blocks);
    const bool backed = k.query.backed && k.key.backed && k.value.backed && k.out.backed &&
                        (k.fp.key_padding_mask == NULL || k.kpm.backed) &&
                        (k.fp.attn_mask == NULL || k.amask.backed) &&
                        (!k.need_weights || k.weights.backed);
    const int64_t work = st_shape == ATTN_OK ? forward_work(&k) : -1;
    if (st_shape != ATTN_OK || (backed && work >= 0 && work <= WORK_LIMIT))
        run_forward(&f, m, &k, fpp, st_shape, &vals, module_blocks);
    else
        run_without_memory(m, &k, fpp, module_blocks);
    attn_mha_destroy(m);
    FZ_ASSERT(fz_live_blocks() == 0, "attn_mha_destroy left %ld blocks", fz_live_blocks());
    free_call(&k);
    return 0;
}
