/*
 * fuzz_serving.c — attn_sdpa_varlen, attn_sdpa_varlen_backward and
 * attn_sdpa_kvcache with shapes, strides, dtypes, offsets, cache lengths,
 * block tables and score modifiers drawn from the fuzz input. Each varlen
 * call that runs is followed by a backward call on its inputs (see
 * varlen_backward: dout and the gradients drawn, lse from the forward or
 * drawn, now and then an offset, max_seqlen or params changed), and, with
 * sinks, by attn_sdpa_varlen_sinks_backward on the same rows.
 *
 * Most inputs describe a consistent call that is then perturbed: an offset,
 * a length or a block id out of range, a dimension, rank or dtype changed, a
 * pointer dropped, a wild window or softcap. Invariants, on every input:
 *  - status and attn_last_error() agree; no library block outlives a call;
 *  - a refused call (any failure but out of memory or cancelled, which may
 *    come after a KV cache's append) writes nothing: out, lse, both caches
 *    and dq, dk, dv keep every byte;
 *  - a kvcache call that succeeds changes exactly the appended elements of
 *    the caches, each to its new value rounded to the cache's dtype;
 *  - on success with finite, moderate inputs: out finite, lse finite or -inf;
 *    and gradients finite when the backward had the forward's out and lse;
 *  - a backward call that succeeds leaves 0 in every gradient row no query
 *    reaches (past the last offset, a sequence without keys or queries);
 *  - an output aliasing an input, or a set cancel flag, never gives ATTN_OK;
 *  - ASan/UBSan: no access outside the exactly sized buffers (the index
 *    tensors' too), no UB.
 */
#include "fuzz_util.h"

enum {
    BUF_LIMIT = 1 << 12,  /* elements backing one view */
    WORK_LIMIT = 1 << 17, /* rows x keys x (E + Ev) for a call that computes */
    MAXB = 6              /* sequences */
};

/* ---- drawing (as fuzz_sdpa.c) ---- */

static attn_dtype pick_dtype(fz *f, attn_dtype usual) {
    if (!fz_one_in(f, 24)) return usual;
    static const attn_dtype odd[] = {ATTN_DTYPE_F32, ATTN_DTYPE_F64,  ATTN_DTYPE_BOOL,
                                     ATTN_DTYPE_I32, ATTN_DTYPE_F16,  (attn_dtype)0,
                                     (attn_dtype)42};
    return odd[fz_u8(f) % 7];
}

/* Rarely: change one dimension or the rank of a view before it is backed. */
static void perturb(fz *f, int *rank, int64_t *shape) {
    if (!fz_one_in(f, 20)) return;
    if (fz_bool(f)) {
        *rank = (int)fz_range(f, 0, ATTN_MAX_RANK + 1);
        for (int d = 0; d < ATTN_MAX_RANK && d < *rank; d++)
            if (shape[d] < 1) shape[d] = 1;
    } else if (*rank >= 1 && *rank <= ATTN_MAX_RANK) {
        int d = (int)fz_range(f, 0, *rank - 1);
        shape[d] = fz_one_in(f, 2) ? fz_wild(f) : fz_range(f, 1, 7);
    }
}

static void make(fz *f, fz_tensor *x, attn_dtype dt, int rank, const int64_t *shape_in,
                 bool output, fz_values *vals) {
    int64_t shape[ATTN_MAX_RANK + 2] = {0}; /* dims a raised rank adds: 1 (perturb) */
    memcpy(shape, shape_in, sizeof(int64_t) * (size_t)rank);
    perturb(f, &rank, shape);
    fz_tensor_make(f, x, dt, rank, shape, output, BUF_LIMIT, vals, !output);
}

/* An int32 index tensor holding values[] (row-major, `cap` of them) in a
 * drawn layout; values[] is then read back through the view (a broadcast
 * layout keeps one of them), so it holds what the library will see.
 * Elements past `cap` (a perturbed shape) keep drawn values. */
static void index_tensor(fz *f, fz_tensor *x, int rank, const int64_t *shape, int32_t *values,
                         int64_t cap) {
    fz_values ignored = {true};
    make(f, x, pick_dtype(f, ATTN_DTYPE_I32), rank, shape, false, &ignored);
    if (!x->backed || x->t.dtype != ATTN_DTYPE_I32 || x->t.rank != rank) return;
    int64_t n = 1; /* elements, at most cap (a broadcast view may have many) */
    for (int d = 0; d < rank; d++)
        if (__builtin_mul_overflow(n, x->t.shape[d], &n) || n > cap) n = cap;
    for (int pass = 0; pass < 2; pass++) {
        int64_t idx[2] = {0, 0};
        for (int64_t i = 0; i < n; i++) {
            int64_t off = 0;
            for (int d = 0; d < rank; d++) off += idx[d] * x->t.strides[d];
            if (pass == 0) ((int32_t *)x->t.data)[off] = values[i];
            else values[i] = ((int32_t *)x->t.data)[off];
            for (int d = rank - 1; d >= 0; d--) {
                if (++idx[d] < x->t.shape[d]) break;
                idx[d] = 0;
            }
        }
    }
}

/* An int32 index value out of any range, or next to one. */
static int32_t wild_index(fz *f, int32_t near) {
    static const int32_t wild[] = {-1, INT32_MIN, INT32_MAX, 1 << 30};
    const uint8_t k = fz_u8(f) % 6;
    return k < 4 ? wild[k] : k == 4 ? near + 1 : near - 1;
}

static double pick_scale(fz *f, fz_values *vals) {
    static const double usual[] = {1.0, 0.5, -0.25, 0.0, 2.0, 0.125};
    if (fz_one_in(f, 12)) {
        vals->tame = false;
        static const double wild[] = {NAN, INFINITY, 1e300, 1e30};
        return wild[fz_u8(f) % 4];
    }
    return usual[fz_u8(f) % 6];
}

static int64_t pick_window(fz *f) {
    if (fz_one_in(f, 24)) {
        static const int64_t wild[] = {-2, -7, INT64_MIN, INT64_MAX, (int64_t)1 << 40};
        return wild[fz_u8(f) % 5];
    }
    return fz_one_in(f, 3) ? fz_range(f, 0, 5) : -1;
}

static double pick_softcap(fz *f, fz_values *vals) {
    if (fz_one_in(f, 24)) {
        static const double wild[] = {-1.0, NAN, INFINITY, 1e-300};
        const double x = wild[fz_u8(f) % 4];
        if (x == 1e-300) vals->tame = false;
        return x;
    }
    static const double caps[] = {0.5, 1.0, 4.0, 30.0};
    return fz_one_in(f, 4) ? caps[fz_u8(f) % 4] : 0.0;
}

/* What a call reads besides its operands: params and their tensors. */
typedef struct extras {
    attn_sdpa_params p;
    fz_tensor alibi, sinks, mask;
} extras;

/* Scalars, window, softcap, ALiBi (Hq,) or (B, Hq), sinks (Hq,); rarely a
 * field a serving call refuses. */
static void draw_params(fz *f, extras *x, int64_t B, int64_t Hq, bool kv, fz_values *vals) {
    memset(x, 0, sizeof *x);
    attn_sdpa_params *p = &x->p;
    attn_sdpa_params_init(p);
    const uint8_t c = fz_u8(f) % 8;
    p->causal = c == 7 ? (attn_causal)(int)fz_range(f, -2, 9)
                : kv && c < 4 ? ATTN_CAUSAL_BOTTOM_RIGHT
                              : (attn_causal)(c % 3);
    p->has_scale = fz_bool(f);
    if (p->has_scale) p->scale = pick_scale(f, vals);
    if (fz_one_in(f, 6)) {
        static const double ps[] = {0.25, 0.5, 1.0, -0.1, NAN};
        p->dropout_p = ps[fz_u8(f) % 5];
        p->seed = fz_u64(f);
    }
    p->window_left = pick_window(f);
    p->window_right = pick_window(f);
    p->softcap = pick_softcap(f, vals);
    if (fz_one_in(f, 4)) {
        const int64_t shape[2] = {B > 0 ? B : 1, Hq};
        const bool per_seq = fz_bool(f);
        make(f, &x->alibi, pick_dtype(f, fz_bool(f) ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32),
             per_seq ? 2 : 1, per_seq ? shape : shape + 1, false, vals);
        p->alibi_slopes = &x->alibi.t;
    }
    if (fz_one_in(f, 4)) {
        make(f, &x->sinks, pick_dtype(f, ATTN_DTYPE_F32), 1, &Hq, false, vals);
        p->sinks = &x->sinks.t;
    }
    switch (fz_one_in(f, 16) ? fz_u8(f) % 4 : 4) {
    case 0: {
        const int64_t one[1] = {1};
        make(f, &x->mask, ATTN_DTYPE_BOOL, 1, one, false, vals);
        p->attn_mask = &x->mask.t;
        break;
    }
    case 1: p->q_offset = 1; break;
    case 2: p->lse_for_backward = 1; break;
    case 3: p->k_total = 5; break;
    default: break;
    }
}

static bool extras_backed(const extras *x) {
    return (x->p.alibi_slopes == NULL || x->alibi.backed) && (x->p.sinks == NULL || x->sinks.backed) &&
           (x->p.attn_mask == NULL || x->mask.backed);
}

static void extras_free(extras *x) {
    fz_tensor_free(&x->alibi);
    fz_tensor_free(&x->sinks);
    fz_tensor_free(&x->mask);
}

/* ---- snapshots: what a refused call must leave alone ---- */

typedef struct snapshot {
    void *bytes;
    size_t size;
} snapshot;

static void snap(snapshot *s, const fz_tensor *x) {
    s->size = x->backed ? (size_t)x->count * attn_dtype_size(x->t.dtype) : 0;
    if (attn_dtype_size(x->t.dtype) == 0) s->size = (size_t)x->count * 8;
    s->bytes = s->size ? malloc(s->size) : NULL;
    if (s->size) memcpy(s->bytes, x->alloc, s->size);
}

static bool unchanged(const snapshot *s, const fz_tensor *x) {
    return s->size == 0 || memcmp(s->bytes, x->alloc, s->size) == 0;
}

/* Whether a status is a refusal: nothing may have been written. */
static bool refused(attn_status st) {
    return st != ATTN_OK && st != ATTN_ERR_NOMEM && st != ATTN_ERR_CANCELLED;
}

/* The product of n sizes, or -1 past `limit` or on overflow. */
static int64_t product(const int64_t *x, int n, int64_t limit) {
    int64_t w = 1;
    for (int i = 0; i < n; i++)
        if (x[i] < 0 || __builtin_mul_overflow(w, x[i], &w) || w > limit) return -1;
    return w;
}

/* After a call: the common invariants. `outs` are the outputs (and, for a
 * kvcache call, the caches unless they were written) that a refused call
 * must leave as they were. */
static void after_call(attn_status st, const char *call, fz_tensor *const *outs,
                       const snapshot *snaps, int n, const fz_tensor *out, const fz_tensor *lse,
                       const fz_values *vals) {
    fz_check_status(st, call);
    FZ_ASSERT(fz_live_blocks() == 0, "%s leaked %ld blocks", call, fz_live_blocks());
    for (int i = 0; i < n && refused(st); i++)
        FZ_ASSERT(unchanged(&snaps[i], outs[i]), "%s refused (%s) but wrote output %d", call,
                  attn_last_error(), i);
    if (st != ATTN_OK || !vals->tame) return;
    FZ_ASSERT(fz_all_finite(&out->t, false), "%s: finite inputs gave a non-finite output", call);
    if (lse != NULL)
        FZ_ASSERT(fz_all_finite(&lse->t, true), "%s: lse is NaN or +inf for finite inputs", call);
}

/* ---- attn_sdpa_varlen ---- */

/* cu_seqlens for B sequences of drawn lengths; the longest in *longest. */
static int64_t draw_offsets(fz *f, int64_t B, int64_t most, int32_t *cu, int64_t *longest) {
    cu[0] = 0;
    *longest = 0;
    for (int64_t n = 0; n < B; n++) {
        const int64_t len = fz_range(f, 0, most);
        cu[n + 1] = (int32_t)(cu[n] + len);
        if (len > *longest) *longest = len;
    }
    if (fz_one_in(f, 8)) { /* not 0 first, decreasing, past the end */
        const int64_t at = fz_range(f, 0, B);
        cu[at] = wild_index(f, cu[at]);
    }
    return cu[B] + fz_range(f, 0, 2);
}

/* ---- attn_sdpa_varlen_backward, on a varlen call's inputs ---- */

/* A forward call as fuzz_varlen drew and made it. */
typedef struct varlen_call {
    attn_dtype dt;
    int64_t max_q, max_k;
    const int64_t *qs, *ks, *vs, *os, *ls; /* the shapes drawn for q, k, v, out, lse */
    fz_tensor *q, *k, *v, *out, *lse, *cuq, *cuk; /* lse NULL: the forward had none */
    const attn_sdpa_params *params;               /* as the forward took them */
    attn_status st;                               /* the forward's status */
} varlen_call;

/* Rows [r0, r1) of a packed (total, heads, width) gradient hold 0. */
static bool zero_rows(const attn_tensor *g, int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; t++)
        for (int64_t h = 0; h < g->shape[1]; h++)
            for (int64_t e = 0; e < g->shape[2]; e++) {
                const int64_t at[3] = {t, h, e};
                if (fz_get(g, at) != 0) return false;
            }
    return true;
}

/* After a backward call that succeeded, whatever the values: the rows no
 * query row reaches are 0, as the header says. dq's rows of a sequence
 * without keys, dk's and dv's of a sequence without queries, and every
 * row past the last offset. The offsets are read from the index tensors
 * (valid, since the call took them). */
static void check_zero_rows(const attn_tensor *cuq, const attn_tensor *cuk,
                            attn_tensor *const *grads) {
    const int64_t B = cuq->shape[0] - 1;
    for (int64_t n = 0; n <= B; n++) {
        const int64_t i0[1] = {n}, i1[1] = {n + 1};
        const int64_t q0 = (int64_t)fz_get(cuq, i0), k0 = (int64_t)fz_get(cuk, i0);
        /* past the last offset: to the end of each gradient */
        const int64_t q1 = n < B ? (int64_t)fz_get(cuq, i1) : -1;
        const int64_t k1 = n < B ? (int64_t)fz_get(cuk, i1) : -1;
        const bool no_keys = n < B && k1 == k0, no_queries = n < B && q1 == q0;
        for (int g = 0; g < 3; g++) {
            const attn_tensor *t = grads[g];
            if (t == NULL) continue;
            const int64_t r0 = g == 0 ? q0 : k0;
            const int64_t r1 = n == B ? t->shape[0] : g == 0 ? q1 : k1;
            if (n < B && !(g == 0 ? no_keys : no_queries)) continue;
            FZ_ASSERT(zero_rows(t, r0, r1),
                      "attn_sdpa_varlen_backward: gradient %d has a nonzero row in [%lld, %lld) "
                      "(%s)",
                      g, (long long)r0, (long long)r1,
                      n == B ? "past the last offset"
                      : g == 0 ? "a sequence without keys"
                               : "a sequence without queries");
        }
    }
}

/* One offset changed in place to a value out of range or next to its own. */
static void poke_offset(fz *f, fz_tensor *cu) {
    if (!cu->backed || cu->t.dtype != ATTN_DTYPE_I32 || cu->t.rank != 1) return;
    const int64_t n = cu->t.shape[0] < 64 ? cu->t.shape[0] : 64;
    int32_t *at = (int32_t *)cu->t.data + (int64_t)(fz_u8(f) % n) * cu->t.strides[0];
    *at = wild_index(f, *at > INT32_MIN && *at < INT32_MAX ? *at : 0);
}

/* The bytes the backward draws from: those the input has left after the
 * forward, then bytes derived from the whole input (splitmix64 from its
 * FNV-1a hash), enough for every draw the backward makes. Past its end an
 * input reads as zeros, which take every rare branch (a dimension 0, a
 * pointer dropped, no gradient asked for): without the derived bytes the
 * checked-in corpus, written before the backward was fuzzed, would almost
 * never reach a backward call. Deterministic, so replay gives the same
 * calls. The caller frees the buffer. */
static uint8_t *backward_bytes(const fz *rest, const fz *whole, size_t *n) {
    const size_t derived = 5 * (BUF_LIMIT + 256) + 1024; /* five views' values and layouts */
    *n = rest->n + derived;
    uint8_t *buf = malloc(*n);
    if (buf == NULL) abort();
    if (rest->n) memcpy(buf, rest->p, rest->n);
    uint64_t h = 0xcbf29ce484222325u;
    for (size_t i = 0; i < whole->n; i++) h = (h ^ whole->p[i]) * 0x100000001b3u;
    for (size_t i = 0; i < derived; i += 8) {
        uint64_t z = (h += 0x9e3779b97f4a7c15u);
        z = (z ^ z >> 30) * 0xbf58476d1ce4e5b9u;
        z = (z ^ z >> 27) * 0x94d049bb133111ebu;
        z ^= z >> 31;
        for (size_t b = 0; b < 8 && i + b < derived; b++)
            buf[rest->n + i + b] = (uint8_t)(z >> 8 * b);
    }
    return buf;
}

/* attn_sdpa_varlen_sinks_backward on a backward's dout, out, lse and
 * cu_seqlens_q (in[0], in[4], in[5], in[6]; any may be NULL or drawn):
 * refusals write nothing, nothing leaks, and with the forward's own rows
 * and tame values the gradient is finite. */
static void varlen_sinks_backward(fz *f, fz_values *vals, const attn_tensor *const *in,
                                  const attn_sdpa_params *params, bool consistent) {
    fz_tensor ds;
    fz_tensor_make(f, &ds, params->sinks->dtype, params->sinks->rank, params->sinks->shape, true,
                   BUF_LIMIT, vals, false);
    if (ds.backed) {
        snapshot before;
        snap(&before, &ds);
        const attn_status st =
            attn_sdpa_varlen_sinks_backward(in[0], in[4], in[5], in[6], params, &ds.t);
        fz_check_status(st, "attn_sdpa_varlen_sinks_backward");
        FZ_ASSERT(fz_live_blocks() == 0, "attn_sdpa_varlen_sinks_backward leaked %ld blocks",
                  fz_live_blocks());
        FZ_ASSERT(!refused(st) || unchanged(&before, &ds),
                  "attn_sdpa_varlen_sinks_backward refused (%s) but wrote dsinks",
                  attn_last_error());
        FZ_ASSERT(st != ATTN_OK || !consistent || !vals->tame || fz_all_finite(&ds.t, false),
                  "attn_sdpa_varlen_sinks_backward: finite inputs gave a non-finite gradient");
        free(before.bytes);
    }
    fz_tensor_free(&ds);
}

/* The backward of a varlen call, on its q, k, v and offsets, with dout,
 * dq, dk, dv drawn (each gradient optional). When the forward succeeded,
 * out and its lse (lse_for_backward; the forward is run again to get it
 * when the first call had none) make a consistent call; otherwise, or now
 * and then all the same, lse is drawn. Rarely: an offset or max_seqlen
 * changed, other params, a pointer dropped, two gradients on one buffer.
 * Invariants: the common ones (a refusal writes no gradient), and on
 * success the rows no query reaches are 0 and, for a consistent call on
 * tame values, every gradient is finite. */
static void varlen_backward(const fz *input, const fz *whole, fz_values *vals,
                            const varlen_call *c) {
    size_t nbytes;
    uint8_t *bytes = backward_bytes(input, whole, &nbytes);
    fz stream = {bytes, nbytes}, *f = &stream;
    attn_sdpa_params pf; /* the forward's params, lse for the backward */
    if (c->params != NULL) pf = *c->params;
    else attn_sdpa_params_init(&pf);
    pf.lse_for_backward = 1;
    fz_tensor dout, own_lse, grad[3];
    memset(&own_lse, 0, sizeof own_lse);
    memset(grad, 0, sizeof grad);
    const fz_tensor *lse = NULL;
    bool consistent = c->st == ATTN_OK && !fz_one_in(f, 16);
    if (consistent && c->lse != NULL && c->params != NULL && c->params->lse_for_backward) {
        lse = c->lse; /* the forward already gave the backward's lse */
    } else if (consistent) {
        const attn_dtype ldt = fz_bool(f) ? ATTN_DTYPE_F64 : c->dt;
        fz_tensor_make(f, &own_lse, ldt, 2, c->ls, true, BUF_LIMIT, vals, false);
        if (own_lse.backed) {
            const attn_status st = attn_sdpa_varlen(&c->q->t, &c->k->t, &c->v->t, &c->cuq->t,
                                                    &c->cuk->t, c->max_q, c->max_k, &pf,
                                                    &c->out->t, &own_lse.t);
            fz_check_status(st, "attn_sdpa_varlen (lse_for_backward)");
            /* the same call as before but for lse, whose drawn layout may be refused */
            FZ_ASSERT(st == ATTN_OK || st == ATTN_ERR_NOMEM ||
                          strcmp(attn_last_error_arg(), "lse") == 0,
                      "attn_sdpa_varlen succeeded, then refused lse_for_backward: %s",
                      attn_last_error());
            consistent = st == ATTN_OK;
        } else {
            consistent = false;
        }
        lse = &own_lse;
    } else { /* drawn: any values, any dtype, now and then any shape */
        make(f, &own_lse, pick_dtype(f, fz_bool(f) ? ATTN_DTYPE_F64 : c->dt), 2, c->ls, false,
             vals);
        lse = &own_lse;
        consistent = false;
    }
    /* dout: usually of tame values only, so that finite gradients can be
     * demanded (random bytes draw a wild value every 40 or so) */
    if (fz_one_in(f, 4)) {
        make(f, &dout, pick_dtype(f, c->dt), 3, c->os, false, vals);
    } else {
        int rank = 3;
        int64_t shape[ATTN_MAX_RANK + 2] = {c->os[0], c->os[1], c->os[2]};
        perturb(f, &rank, shape);
        fz_tensor_make(f, &dout, pick_dtype(f, c->dt), rank, shape, false, BUF_LIMIT, vals,
                       false);
    }
    const int64_t *shapes[3] = {c->qs, c->ks, c->vs};
    attn_tensor *tg[3] = {NULL, NULL, NULL};
    for (int g = 0; g < 3; g++) {
        if (fz_one_in(f, 4)) continue; /* not asked for */
        make(f, &grad[g], pick_dtype(f, c->dt), 3, shapes[g], true, vals);
        tg[g] = &grad[g].t;
    }
    int64_t max_q = c->max_q, max_k = c->max_k; /* results do not depend on them */
    if (fz_one_in(f, 12)) max_q = fz_range(f, -2, c->max_q + 1);
    if (fz_one_in(f, 12)) max_k = fz_range(f, -2, c->max_k + 1);
    if (fz_one_in(f, 10)) {
        poke_offset(f, fz_bool(f) ? c->cuq : c->cuk);
        consistent = false;
    }
    attn_sdpa_params pb; /* rarely: other params than the forward's */
    const attn_sdpa_params *params = c->params;
    if (fz_one_in(f, 16)) {
        pb = pf;
        switch (fz_u8(f) % 5) {
        case 0: pb.causal = (attn_causal)(((int)pb.causal + 1) % 3); break;
        case 1:
            pb.dropout_p = 0.5;
            pb.seed ^= 1;
            break;
        case 2: pb.attn_mask = &c->q->t; break; /* refused */
        case 3: pb.k_offset = 2; break;         /* refused */
        default: pb.lse_for_backward = 0; break;
        }
        params = &pb;
        consistent = false;
    }
    const attn_tensor *in[8] = {&dout.t,    &c->q->t,   &c->k->t, &c->v->t,
                                &c->out->t, &lse->t,    &c->cuq->t, &c->cuk->t};
    bool must_refuse = false;
    if (fz_one_in(f, 24)) { /* a required pointer dropped */
        in[fz_u8(f) % 8] = NULL;
        must_refuse = true;
    }
    const int a = (int)fz_range(f, 0, 2), b = (int)fz_range(f, 0, 2);
    if (fz_one_in(f, 24) && a != b && tg[a] != NULL && tg[b] != NULL) {
        tg[b] = tg[a]; /* two gradients in one buffer */
        must_refuse = true;
    }
    bool backed = dout.backed && lse->backed;
    for (int g = 0; g < 3; g++) backed = backed && (tg[g] == NULL || grad[g].backed);
    if (backed) {
        fz_tensor *outs[3] = {&grad[0], &grad[1], &grad[2]};
        snapshot snaps[3];
        for (int g = 0; g < 3; g++) snap(&snaps[g], &grad[g]);
        fz_tensor *first = NULL;
        for (int g = 2; g >= 0; g--)
            if (tg[g] != NULL) first = &grad[g];
        const fz_tensor *inputs[6] = {&dout, c->q, c->k, c->v, c->out, lse};
        fz_hostile h;
        fz_hostile_begin(f, &h, first, inputs[fz_u8(f) % 6]);
        const attn_status st =
            attn_sdpa_varlen_backward(in[0], in[1], in[2], in[3], in[4], in[5], in[6], in[7],
                                      max_q, max_k, params, tg[0], tg[1], tg[2]);
        fz_hostile_end(&h, st);
        fz_check_status(st, "attn_sdpa_varlen_backward");
        FZ_ASSERT(fz_live_blocks() == 0, "attn_sdpa_varlen_backward leaked %ld blocks",
                  fz_live_blocks());
        FZ_ASSERT(!must_refuse || st != ATTN_OK,
                  "attn_sdpa_varlen_backward accepted a NULL operand or two gradients in one "
                  "buffer");
        for (int g = 0; g < 3 && refused(st); g++)
            FZ_ASSERT(unchanged(&snaps[g], outs[g]),
                      "attn_sdpa_varlen_backward refused (%s) but wrote gradient %d",
                      attn_last_error(), g);
        if (st == ATTN_OK) {
            check_zero_rows(&c->cuq->t, &c->cuk->t, tg);
            for (int g = 0; g < 3 && consistent && vals->tame; g++)
                FZ_ASSERT(tg[g] == NULL || fz_all_finite(tg[g], false),
                          "attn_sdpa_varlen_backward: finite inputs gave a non-finite "
                          "gradient %d",
                          g);
        }
        for (int g = 0; g < 3; g++) free(snaps[g].bytes);
        if (params != NULL && params->sinks != NULL)
            varlen_sinks_backward(f, vals, in, params, consistent && st == ATTN_OK);
    }
    fz_tensor_free(&dout);
    fz_tensor_free(&own_lse);
    for (int g = 0; g < 3; g++) fz_tensor_free(&grad[g]);
    free(bytes);
}

static void fuzz_varlen(fz *f, const fz *whole, fz_values *vals) {
    const attn_dtype dt = fz_bool(f) ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
    const int64_t B = fz_range(f, 0, MAXB - 1);
    const int64_t Hkv = fz_range(f, 1, 3);
    const int64_t Hq = fz_one_in(f, 16) ? fz_dim(f, 5, true) : Hkv * fz_range(f, 1, 3);
    const int64_t E = fz_dim(f, 6, true), Ev = fz_dim(f, 6, true);
    int32_t cu_q[MAXB + 1], cu_k[MAXB + 1];
    int64_t longest_q, longest_k;
    int64_t total_q = draw_offsets(f, B, 6, cu_q, &longest_q);
    int64_t total_k = draw_offsets(f, B, 8, cu_k, &longest_k);
    if (total_q < 1) total_q = 1;
    if (total_k < 1) total_k = 1;
    const int64_t max_q = fz_one_in(f, 10) ? fz_range(f, -2, longest_q) : longest_q + fz_range(f, 0, 2);
    const int64_t max_k = fz_one_in(f, 10) ? fz_range(f, -2, longest_k) : longest_k + fz_range(f, 0, 2);

    fz_tensor q, k, v, out, lse, cuq, cuk;
    memset(&lse, 0, sizeof lse);
    const int64_t qs[3] = {total_q, Hq, E}, ks[3] = {total_k, Hkv, E}, vs[3] = {total_k, Hkv, Ev},
                  os[3] = {total_q, Hq, Ev}, ls[2] = {Hq, total_q};
    const int64_t nq = B + 1, nk = fz_one_in(f, 24) ? B + 2 : B + 1;
    make(f, &q, pick_dtype(f, dt), 3, qs, false, vals);
    make(f, &k, pick_dtype(f, dt), 3, ks, false, vals);
    make(f, &v, pick_dtype(f, dt), 3, vs, false, vals);
    int32_t cu_k_more[MAXB + 2];
    memcpy(cu_k_more, cu_k, sizeof cu_k);
    cu_k_more[MAXB + 1] = cu_k[B];
    index_tensor(f, &cuq, 1, &nq, cu_q, MAXB + 1);
    index_tensor(f, &cuk, 1, &nk, cu_k_more, MAXB + 2);
    make(f, &out, pick_dtype(f, dt), 3, os, true, vals);
    const bool with_lse = fz_bool(f);
    if (with_lse) make(f, &lse, pick_dtype(f, fz_bool(f) ? ATTN_DTYPE_F64 : dt), 2, ls, true, vals);
    extras x;
    draw_params(f, &x, B, Hq, false, vals);

    const attn_tensor *tq = &q.t, *tcu = &cuq.t;
    attn_tensor *tout = &out.t;
    const attn_sdpa_params *params = &x.p;
    if (fz_one_in(f, 24)) {
        switch (fz_u8(f) % 4) {
        case 0: tq = NULL; break;
        case 1: tcu = NULL; break;
        case 2: tout = NULL; break;
        default: params = NULL; break;
        }
    }
    const int64_t work[5] = {total_q, Hq, total_k, E, 2}; /* E + Ev <= 2 max(E, Ev) */
    const int64_t work_v[4] = {total_q, Hq, total_k, Ev};
    const bool backed = q.backed && k.backed && v.backed && cuq.backed && cuk.backed &&
                        out.backed && (!with_lse || lse.backed) && extras_backed(&x);
    if (backed && product(work, 5, WORK_LIMIT) >= 0 && product(work_v, 4, WORK_LIMIT) >= 0) {
        fz_tensor *outs[2] = {&out, &lse};
        snapshot snaps[2];
        snap(&snaps[0], &out);
        snap(&snaps[1], &lse);
        fz_hostile h;
        const fz_tensor *inputs[3] = {&q, &k, &v};
        fz_hostile_begin(f, &h, tout == NULL ? NULL : &out, inputs[fz_u8(f) % 3]);
        attn_status st = attn_sdpa_varlen(tq, &k.t, &v.t, tcu, &cuk.t, max_q, max_k, params, tout,
                                          with_lse ? &lse.t : NULL);
        fz_hostile_end(&h, st);
        after_call(st, "attn_sdpa_varlen", outs, snaps, with_lse ? 2 : 1, &out,
                   with_lse ? &lse : NULL, vals);
        free(snaps[0].bytes);
        free(snaps[1].bytes);
        /* Then the backward on the same inputs (its draws come after all of
         * the forward's, so a corpus input drives the forward as before). */
        const varlen_call c = {.dt = dt,
                               .max_q = max_q,
                               .max_k = max_k,
                               .qs = qs,
                               .ks = ks,
                               .vs = vs,
                               .os = os,
                               .ls = ls,
                               .q = &q,
                               .k = &k,
                               .v = &v,
                               .out = &out,
                               .lse = with_lse ? &lse : NULL,
                               .cuq = &cuq,
                               .cuk = &cuk,
                               .params = params,
                               .st = st};
        varlen_backward(f, whole, vals, &c);
    }
    fz_tensor *all[7] = {&q, &k, &v, &out, &lse, &cuq, &cuk};
    for (int i = 0; i < 7; i++) fz_tensor_free(all[i]);
    extras_free(&x);
}

/* ---- attn_sdpa_kvcache ---- */

/* The sizes and index values of a drawn kvcache call. */
typedef struct kv_draw {
    int64_t B, Lq, Hq, Hkv, E, Ev, Lnew;
    bool paged, with_seqlens;
    int64_t rows;       /* block_size, or S_max when contiguous */
    int64_t max_blocks; /* block table width */
    int64_t slabs;      /* num_blocks, or B when contiguous */
    int32_t seqlens[MAXB];
    int32_t table[MAXB * 4];
} kv_draw;

static void draw_kv(fz *f, kv_draw *d) {
    memset(d, 0, sizeof *d);
    d->B = fz_one_in(f, 24) ? fz_dim(f, 7, true) : fz_range(f, 1, 4);
    d->Lq = fz_dim(f, 4, true);
    d->Hkv = fz_range(f, 1, 2);
    d->Hq = fz_one_in(f, 16) ? fz_dim(f, 5, true) : d->Hkv * fz_range(f, 1, 3);
    d->E = fz_dim(f, 5, true);
    d->Ev = fz_dim(f, 5, true);
    d->Lnew = fz_range(f, 0, 3);
    d->paged = fz_bool(f);
    d->rows = d->paged ? fz_range(f, 1, 5) : fz_range(f, 1, 8);
    d->max_blocks = fz_range(f, 1, 4);
    d->slabs = d->paged ? fz_range(f, 1, 8) : d->B;
    const int64_t capacity = d->paged ? d->max_blocks * d->rows : d->rows;
    d->with_seqlens = !fz_one_in(f, 6);
    const int64_t nb = d->B >= 1 && d->B <= MAXB ? d->B : 0; /* values drawn for sane B only */
    for (int64_t b = 0; b < nb; b++) {
        d->seqlens[b] = (int32_t)fz_range(f, 0, capacity);
        if (fz_one_in(f, 12)) d->seqlens[b] = wild_index(f, d->seqlens[b]);
        for (int64_t t = 0; t < d->max_blocks; t++) {
            int32_t *id = &d->table[b * d->max_blocks + t];
            *id = (int32_t)fz_range(f, 0, d->slabs - 1);
            if (fz_one_in(f, 16)) *id = wild_index(f, (int32_t)d->slabs - 1);
        }
    }
}

typedef struct kv_tensors {
    fz_tensor q, kc, vc, k, v, out, lse, seq, table;
} kv_tensors;

/* A cache element as a double; the new value `x` as the cache keeps it. */
static bool kept_as(attn_dtype dtype, double got, double x) {
    if (isnan(x)) return isnan(got);
    switch (dtype) {
    case ATTN_DTYPE_F32: return got == (double)(float)x;
    case ATTN_DTYPE_F64: return got == x;
    case ATTN_DTYPE_F16:
        if (fabs(x) >= 65520) return got == (x > 0 ? INFINITY : -INFINITY);
        return fabs(got - x) <= fabs(x) * 0x1p-11;
    case ATTN_DTYPE_BF16:
        if (isinf((float)x)) return got == (double)(float)x;
        return fabs(got - x) <= fabs(x) * 0x1p-8 || (isinf(got) && fabs(x) > 3.38e38);
    default: return false;
    }
}

/* After a kvcache call that succeeded with new rows: each appended element
 * holds its new value as the cache keeps it, every other byte is as
 * before. The places follow the header: row cache_seqlens[b] + r of
 * sequence b, through the block table when paged. */
static void check_appended(const kv_draw *d, const kv_tensors *t, const fz_tensor *cache,
                           const snapshot *before, const fz_tensor *rows) {
    const attn_tensor *c = &cache->t;
    const int64_t width = rows->t.shape[3];
    const size_t es = attn_dtype_size(c->dtype);
    unsigned char *mark = calloc((size_t)cache->count, 1);
    const int64_t *n = rows->t.shape; /* (B, Lnew, Hkv, width), as the call took them */
    for (int64_t b = 0; b < n[0]; b++)
        for (int64_t r = 0; r < n[1]; r++)
            for (int64_t h = 0; h < n[2]; h++)
                for (int64_t e = 0; e < width; e++) {
                    const int64_t sb[1] = {b};
                    const int64_t row = (int64_t)fz_get(&t->seq.t, sb) + r;
                    const int64_t entry[2] = {b, row / d->rows};
                    const int64_t at[4] = {d->paged ? (int64_t)fz_get(&t->table.t, entry) : b,
                                           d->paged ? row % d->rows : row, h, e};
                    const int64_t from[4] = {b, r, h, e};
                    int64_t off = 0;
                    for (int i = 0; i < 4; i++) off += at[i] * c->strides[i];
                    const int64_t slot = off - cache->lo;
                    FZ_ASSERT(slot >= 0 && slot < cache->count, "appended element outside the cache");
                    mark[slot] = 1;
                    const double got = fz_get(c, at), x = fz_get(&rows->t, from);
                    FZ_ASSERT(kept_as(c->dtype, got, x), "sequence %lld row %lld: the cache holds "
                              "%g for the new value %g (%s)", (long long)b, (long long)row, got, x,
                              attn_dtype_name(c->dtype));
                }
    for (int64_t s = 0; s < cache->count; s++)
        FZ_ASSERT(mark[s] || memcmp((unsigned char *)cache->alloc + s * (int64_t)es,
                                    (unsigned char *)before->bytes + s * (int64_t)es, es) == 0,
                  "element %lld of a cache changed but is no appended row's", (long long)s);
    free(mark);
}

static void make_kv(fz *f, kv_draw *d, kv_tensors *t, attn_dtype dt, fz_values *vals) {
    memset(t, 0, sizeof *t);
    const attn_dtype cdts[4] = {dt, dt, ATTN_DTYPE_F16, ATTN_DTYPE_BF16};
    const attn_dtype cdt = pick_dtype(f, cdts[fz_u8(f) % 4]);
    const bool writing = d->Lnew > 0;
    const int64_t qs[4] = {d->B, d->Lq, d->Hq, d->E}, os[4] = {d->B, d->Lq, d->Hq, d->Ev},
                  ls[3] = {d->B, d->Hq, d->Lq}, kcs[4] = {d->slabs, d->rows, d->Hkv, d->E},
                  vcs[4] = {d->slabs, d->rows, d->Hkv, d->Ev}, ks[4] = {d->B, d->Lnew, d->Hkv, d->E},
                  vs[4] = {d->B, d->Lnew, d->Hkv, d->Ev}, ts[2] = {d->B, d->max_blocks};
    make(f, &t->q, pick_dtype(f, dt), 4, qs, false, vals);
    /* Caches written are laid out as outputs, but now and then not. */
    const bool as_output = writing && !fz_one_in(f, 16);
    make(f, &t->kc, cdt, 4, kcs, as_output, vals);
    make(f, &t->vc, fz_one_in(f, 24) ? pick_dtype(f, dt) : cdt, 4, vcs, as_output, vals);
    if (writing) {
        make(f, &t->k, pick_dtype(f, dt), 4, ks, false, vals);
        make(f, &t->v, pick_dtype(f, dt), 4, vs, false, vals);
    }
    make(f, &t->out, pick_dtype(f, dt), 4, os, true, vals);
    if (fz_bool(f)) make(f, &t->lse, pick_dtype(f, fz_bool(f) ? ATTN_DTYPE_F64 : dt), 3, ls, true, vals);
    if (d->B >= 1 && d->B <= MAXB) {
        index_tensor(f, &t->seq, 1, &d->B, d->seqlens, MAXB);
        index_tensor(f, &t->table, 2, ts, d->table, MAXB * 4);
    }
}

static void fuzz_kvcache(fz *f, fz_values *vals) {
    const attn_dtype dt = fz_bool(f) ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
    kv_draw d;
    draw_kv(f, &d);
    kv_tensors t;
    make_kv(f, &d, &t, dt, vals);
    extras x;
    draw_params(f, &x, d.B, d.Hq, true, vals);
    const attn_tensor *k = d.Lnew ? &t.k.t : NULL, *v = d.Lnew ? &t.v.t : NULL;
    const attn_tensor *seq = d.with_seqlens ? &t.seq.t : NULL, *table = d.paged ? &t.table.t : NULL;
    attn_tensor *out = &t.out.t, *lse = t.lse.alloc ? &t.lse.t : NULL;
    const attn_sdpa_params *params = &x.p;
    if (fz_one_in(f, 24)) {
        switch (fz_u8(f) % 4) {
        case 0: k = NULL; break;
        case 1: v = NULL; break;
        case 2: out = NULL; break;
        default: params = NULL; break;
        }
    }
    const int64_t capacity = d.paged ? d.max_blocks * d.rows : d.rows;
    const int64_t work[5] = {d.B, d.Hq, d.Lq, capacity, d.E}, work_v[5] = {d.B, d.Hq, d.Lq, capacity, d.Ev};
    const bool backed = d.B >= 1 && d.B <= MAXB && t.q.backed && t.kc.backed && t.vc.backed &&
                        (!d.Lnew || (t.k.backed && t.v.backed)) && t.out.backed &&
                        (lse == NULL || t.lse.backed) && t.seq.backed && t.table.backed &&
                        extras_backed(&x);
    if (backed && product(work, 5, WORK_LIMIT) >= 0 && product(work_v, 5, WORK_LIMIT) >= 0) {
        fz_tensor *outs[4] = {&t.out, &t.lse, &t.kc, &t.vc};
        snapshot snaps[4];
        for (int i = 0; i < 4; i++) snap(&snaps[i], outs[i]);
        fz_hostile h;
        fz_hostile_begin(f, &h, out == NULL ? NULL : &t.out, &t.q);
        attn_status st = attn_sdpa_kvcache(&t.q.t, &t.kc.t, &t.vc.t, k, v, seq, table, params, out,
                                           lse);
        fz_hostile_end(&h, st);
        after_call(st, "attn_sdpa_kvcache", outs, snaps, 4, &t.out, lse ? &t.lse : NULL, vals);
        if (st == ATTN_OK && k != NULL) {
            check_appended(&d, &t, &t.kc, &snaps[2], &t.k);
            check_appended(&d, &t, &t.vc, &snaps[3], &t.v);
        } else if (st == ATTN_OK) {
            FZ_ASSERT(unchanged(&snaps[2], &t.kc) && unchanged(&snaps[3], &t.vc),
                      "a kvcache call without new rows wrote into a cache");
        }
        for (int i = 0; i < 4; i++) free(snaps[i].bytes);
    }
    fz_tensor *all[9] = {&t.q, &t.kc, &t.vc, &t.k, &t.v, &t.out, &t.lse, &t.seq, &t.table};
    for (int i = 0; i < 9; i++) fz_tensor_free(all[i]);
    extras_free(&x);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz f = {data, size};
    const fz whole = f;
    fz_values vals = {true};
    fz_begin_attention(&f);
    if (fz_bool(&f))
        fuzz_kvcache(&f, &vals);
    else
        fuzz_varlen(&f, &whole, &vals);
    return 0;
}
