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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static bool ready;
    if (!ready) {
        fz_install_allocator((size_t)1 << 22);
        attn_set_num_threads(1);
        ready = true;
    }
    fz f = {data, size};
    fz_values vals = {true};
    attn_isa isa = (attn_isa)fz_range(&f, ATTN_ISA_AUTO, ATTN_ISA_LAST);
    if (attn_isa_supported(isa)) attn_set_isa(isa);

    /* ---- the module ---- */
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, fz_dim(&f, 8, true), fz_dim(&f, 4, true));
    cfg.head_dim = pick_opt_dim(&f, 4);
    cfg.kdim = pick_opt_dim(&f, 8);
    cfg.vdim = pick_opt_dim(&f, 8);
    cfg.bias = pick_flag(&f);
    cfg.add_bias_kv = pick_flag(&f);
    cfg.add_zero_attn = pick_flag(&f);
    cfg.batch_first = pick_flag(&f);
    cfg.dropout = pick_dropout(&f);
    static const attn_dtype module_dtypes[] = {ATTN_DTYPE_F32, ATTN_DTYPE_F64, ATTN_DTYPE_F16,
                                               ATTN_DTYPE_BF16};
    cfg.dtype = pick_dtype(&f, module_dtypes[fz_u8(&f) % 4]);
    cfg.init_seed = fz_u64(&f);
    attn_mha *m = (attn_mha *)&cfg; /* must become NULL on failure */
    attn_status st = attn_mha_create(fz_one_in(&f, 64) ? NULL : &cfg, &m);
    fz_check_status(st, "attn_mha_create");
    if (st != ATTN_OK) {
        FZ_ASSERT(m == NULL, "a failed attn_mha_create left *mha set");
        FZ_ASSERT(fz_live_blocks() == 0, "a failed attn_mha_create leaked");
        return 0;
    }
    const long module_blocks = fz_live_blocks();
    attn_mha_config c = {.struct_size = sizeof c}; /* how much get_config may write */
    fz_check_status(attn_mha_get_config(m, &c), "attn_mha_get_config");
    FZ_ASSERT(c.head_dim >= 1 && c.kdim >= 1 && c.vdim >= 1, "derived fields not filled");
    const attn_dtype dt = c.dtype;
    if (fz_one_in(&f, 4)) fuzz_params(&f, m, dt, &vals);

    /* ---- the inputs ---- */
    const bool batched = !fz_one_in(&f, 4);
    const int64_t N = fz_dim(&f, 3, true), L = fz_dim(&f, 5, true), S = fz_dim(&f, 5, true);
    const int64_t H = c.num_heads;
    int64_t Sx; /* S' = S + add_bias_kv + add_zero_attn, saturated */
    if (__builtin_add_overflow(S, c.add_bias_kv + c.add_zero_attn, &Sx)) Sx = INT64_MAX;
    const int rank = batched ? 3 : 2;
    fz_tensor query, key, value, kpm, amask, out, weights;
    memset(&kpm, 0, sizeof kpm);
    memset(&amask, 0, sizeof amask);
    memset(&weights, 0, sizeof weights);
    int64_t shape[ATTN_MAX_RANK];
#define SEQ_SHAPE(T, F)                                                         \
    do {                                                                        \
        if (!batched) {                                                         \
            shape[0] = (T), shape[1] = (F);                                     \
        } else if (c.batch_first) {                                             \
            shape[0] = N, shape[1] = (T), shape[2] = (F);                       \
        } else {                                                                \
            shape[0] = (T), shape[1] = N, shape[2] = (F);                       \
        }                                                                       \
    } while (0)
    SEQ_SHAPE(L, c.embed_dim);
    make(&f, &query, pick_dtype(&f, dt), rank, shape, false, &vals);
    const bool self = c.kdim == c.embed_dim && c.vdim == c.embed_dim && L == S && fz_bool(&f);
    if (self) { /* key and value are the query's own view */
        key = query;
        key.alloc = NULL;
        value = key;
    } else {
        SEQ_SHAPE(S, c.kdim);
        make(&f, &key, pick_dtype(&f, dt), rank, shape, false, &vals);
        SEQ_SHAPE(S, c.vdim);
        make(&f, &value, pick_dtype(&f, dt), rank, shape, false, &vals);
    }

    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    uint8_t mk = fz_u8(&f);
    const attn_dtype mask_dtypes[] = {ATTN_DTYPE_BOOL, ATTN_DTYPE_F32, dt}; /* float: any */
    if (mk % 4 != 0) { /* key_padding_mask (N, S) or unbatched (S) */
        int kr = batched ? 2 : 1;
        shape[0] = batched ? N : S;
        shape[1] = S;
        make(&f, &kpm, pick_dtype(&f, mask_dtypes[mk % 4 - 1]), kr, shape, false, &vals);
        fz_sprinkle_neg_inf(&f, &kpm);
        fp.key_padding_mask = &kpm.t;
    }
    mk >>= 2;
    if (mk % 4 != 0) { /* attn_mask (L, S) or (N*H, L, S) / (H, L, S) */
        bool three = fz_bool(&f);
        int64_t NH;
        if (__builtin_mul_overflow(batched ? N : 1, H, &NH)) NH = 1;
        shape[0] = three ? NH : L;
        shape[1] = three ? L : S;
        shape[2] = S;
        make(&f, &amask, pick_dtype(&f, mask_dtypes[mk % 4 - 1]), three ? 3 : 2, shape, false,
             &vals);
        fz_sprinkle_neg_inf(&f, &amask);
        fp.attn_mask = &amask.t;
    }
    fp.average_attn_weights = pick_flag(&f);
    fp.is_causal = pick_flag(&f);
    fp.training = pick_flag(&f);
    fp.seed = fz_u64(&f);
    fp.rng_offset = fz_bool(&f) ? fz_u64(&f) : 0;
    if (fz_one_in(&f, 8)) { /* this call's dropout instead of the module's */
        static const double ps[] = {0.0, 0.5, 1.0, 0.1, -0.1, 1.5, NAN, INFINITY};
        fp.has_dropout = 1;
        fp.dropout = ps[fz_u8(&f) % 8];
    }

    SEQ_SHAPE(L, c.embed_dim);
    make(&f, &out, pick_dtype(&f, dt), rank, shape, true, &vals);
    const bool need_weights = fz_bool(&f);
    if (need_weights) {
        int wr = 0;
        if (batched) shape[wr++] = N;
        if (!fp.average_attn_weights) shape[wr++] = H;
        shape[wr++] = L;
        shape[wr++] = Sx;
        make(&f, &weights, pick_dtype(&f, dt), wr, shape, true, &vals);
    }
#undef SEQ_SHAPE

    /* ---- the calls ---- */
    int out_rank = 0, w_rank = 0;
    int64_t out_shape[ATTN_MAX_RANK], w_shape[ATTN_MAX_RANK];
    const attn_mha_forward_params *fpp = fz_one_in(&f, 32) ? NULL : &fp;
    attn_status st_shape = attn_mha_out_shapes(m, &query.t, &key.t, fpp, need_weights, &out_rank,
                                               out_shape, &w_rank, w_shape);
    fz_check_status(st_shape, "attn_mha_out_shapes");
    FZ_ASSERT(fz_live_blocks() == module_blocks, "attn_mha_out_shapes leaked");
    if (st_shape == ATTN_OK && need_weights && fpp != NULL && out.t.rank == out_rank) {
        /* The shapes it reports are the ones the fuzzer built from the docs. */
        bool same = w_rank == (batched ? 3 : 2) + (fp.average_attn_weights ? 0 : 1);
        FZ_ASSERT(same, "weights rank %d", w_rank);
        /* S' = the key's length (as built, or as perturbed) + appended rows. */
        int64_t S_key = key.t.shape[batched && c.batch_first ? 1 : 0];
        FZ_ASSERT(w_shape[w_rank - 1] == S_key + c.add_bias_kv + c.add_zero_attn,
                  "weights last dim %lld, expected S' = %lld + %d", (long long)w_shape[w_rank - 1],
                  (long long)S_key, c.add_bias_kv + c.add_zero_attn);
    }
    bool backed = query.backed && key.backed && value.backed && out.backed &&
                  (fp.key_padding_mask == NULL || kpm.backed) &&
                  (fp.attn_mask == NULL || amask.backed) && (!need_weights || weights.backed);
    int64_t work = -1;
    if (st_shape == ATTN_OK) {
        /* Projections and attention, from the shapes actually passed. */
        const int qb = batched && c.batch_first ? 1 : 0;
        const int64_t Lq = query.t.shape[qb], Nq = batched ? query.t.shape[1 - qb] : 1;
        const int64_t Sk = key.t.shape[qb] + c.add_bias_kv + c.add_zero_attn;
        const int64_t D = c.num_heads * c.head_dim;
        int64_t rows, a, b;
        if (__builtin_mul_overflow(Sk, 2, &rows) || __builtin_add_overflow(rows, Lq, &rows) ||
            __builtin_mul_overflow(rows, Nq, &rows) || __builtin_mul_overflow(rows, D, &a) ||
            __builtin_mul_overflow(a, c.embed_dim + c.kdim + c.vdim, &a) ||
            __builtin_mul_overflow(Nq, H, &b) || __builtin_mul_overflow(b, Lq, &b) ||
            __builtin_mul_overflow(b, Sk, &b) || __builtin_mul_overflow(b, 2 * c.head_dim + 1, &b) ||
            __builtin_add_overflow(a, b, &work))
            work = -1;
    }
    bool run = st_shape != ATTN_OK || (backed && work >= 0 && work <= WORK_LIMIT);
    if (run) {
        fz_hostile h;
        fz_hostile_begin(&f, &h, &out, fz_bool(&f) ? &query : &value);
        st = attn_mha_forward(m, &query.t, &key.t, &value.t, fpp, &out.t,
                              need_weights ? &weights.t : NULL);
        fz_hostile_end(&h, st);
        fz_check_status(st, "attn_mha_forward");
        FZ_ASSERT(fz_live_blocks() == module_blocks, "attn_mha_forward leaked %ld blocks",
                  fz_live_blocks() - module_blocks);
        /* Rejected query/key are rejected by the forward pass too (with the
         * same status unless the value, which only forward sees, fails first). */
        if (st_shape != ATTN_OK)
            FZ_ASSERT(st != ATTN_OK, "attn_mha_forward accepted what attn_mha_out_shapes "
                      "rejected with %d", (int)st_shape);
        if (st == ATTN_OK && vals.tame) {
            FZ_ASSERT(fz_all_finite(&out.t, false), "finite inputs gave a non-finite output");
            const double dropout = fp.has_dropout ? fp.dropout : c.dropout;
            double p = (fpp != NULL && fp.training) ? dropout : 0.0;
            /* a 16-bit weight is rounded per head, and again when averaged */
            const double u = c.dtype == ATTN_DTYPE_BF16 ? 0x1p-8
                             : c.dtype == ATTN_DTYPE_F16 ? 0x1p-11 : 1e-6;
            double wmax = p < 1.0 ? (1.0 / (1.0 - p)) * (1 + u) * (1 + u) : 0.0;
            if (need_weights)
                FZ_ASSERT(values_in(&weights.t, 0.0, wmax), "a weight is outside [0, %g]", wmax);
        }
        if (st == ATTN_OK) {
            const fz_tensor *in[3] = {&query, &key, &value};
            fuzz_backward(&f, m, &c, in, fpp, &out, &vals, module_blocks);
        }
    }
    if (!run) {
        /* Valid arguments this harness cannot back with memory (huge strides,
         * or too much work): with every allocation refused, the forward pass
         * must stop at its workspace, before it reads an input or writes an
         * output (those point at a PROT_NONE page). This fuzzes the
         * validation and planning arithmetic on extreme but legal views. */
        size_t old = fz_set_alloc_limit(0);
        st = attn_mha_forward(m, &query.t, &key.t, &value.t, fpp, &out.t,
                              need_weights ? &weights.t : NULL);
        fz_set_alloc_limit(old);
        fz_check_status(st, "attn_mha_forward (no memory)");
        FZ_ASSERT(st != ATTN_OK, "attn_mha_forward succeeded without memory");
        FZ_ASSERT(fz_live_blocks() == module_blocks, "attn_mha_forward leaked");
    }
    attn_mha_destroy(m);
    FZ_ASSERT(fz_live_blocks() == 0, "attn_mha_destroy left %ld blocks", fz_live_blocks());
    fz_tensor_free(&query);
    fz_tensor_free(&key);
    if (!self) fz_tensor_free(&value);
    fz_tensor_free(&kpm);
    fz_tensor_free(&amask);
    fz_tensor_free(&out);
    fz_tensor_free(&weights);
    return 0;
}
