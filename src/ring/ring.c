/*
 * ring.c — ring attention: the forward and backward passes (attn_ring.h).
 *
 * Step t of N on rank r: the K/V shard of rank o = r - t (mod N) is in
 * hand; the next one is on its way from r - 1 while this one is sent on to
 * r + 1. Each pair of a query run of r and a key run of o is an attn_sdpa
 * call on a slice of the whole attention (q_offset, k_offset: causality and
 * dropout stay the whole's), cut into pieces of query rows so MPI can move
 * the messages between them (without a progress thread, MPI moves data only
 * inside its calls). Parts merge into float64 sums in step order.
 *
 * The backward sends each shard's dK/dV sums (float64) along with it: step t
 * adds rank r's terms to the sums of shard o and passes them on; after step
 * N - 1 they are one hop from home, and take it.
 *
 * 16-bit operands travel as they are, but no part is ever rounded to 16
 * bits: the pieces run on float32 copies of q (and, backward, of out, dout
 * and each step's K/V), their parts merge in float64, and each 16-bit
 * result is rounded once at the end, the float32 computation's rounding as
 * attn_sdpa's 16-bit calls promise.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ring_internal.h"

enum { TAG_KV = 0, TAG_DKV = 1, TAG_HOME = 2, TAGS = 3 };
enum { PIECES = 8, PIECE_ROWS_MIN = 128 }; /* query rows per call: progress points */

typedef struct ring_call {
    ring_comm rc;
    attn_ring_params prm;
    attn_sdpa_params sdpa;          /* the caller's, slice fields set per call */
    const attn_tensor *q, *k, *v, *mask;
    int orank;                      /* out: (B..., Hq, L_shard, Ev) */
    int64_t oshape[ATTN_MAX_RANK];
    int64_t Ltot, Stot, Smax;
    int64_t *Ls, *Ss;               /* every rank's shard lengths */
    ring_runs qruns;
    char *kv[2];                    /* K/V (+ mask) messages, dense */
    size_t kv_bytes;                /* room in each */
    attn_status status;             /* this rank's compute so far */
    double t_compute, t_wait;
} ring_call;

/* ---- geometry of a shard's message ---- */

/* `t` with dimension `dim` set to n (a shard of another rank). */
static attn_tensor resized(const attn_tensor *t, int dim, int64_t n) {
    attn_tensor r = *t;
    r.shape[dim] = n;
    return r;
}

static size_t align64(size_t x) { return (x + 63) / 64 * 64; }

/* Where K, V and the mask of rank o's shard sit in a message. */
typedef struct kv_layout {
    attn_tensor k, v, mask; /* dense views, once `base` is set */
    size_t bytes;
} kv_layout;

static kv_layout kv_layout_of(const ring_call *c, int o, char *base) {
    kv_layout m;
    memset(&m, 0, sizeof m);
    const attn_tensor ks = resized(c->k, c->k->rank - 2, c->Ss[o]);
    const attn_tensor vs = resized(c->v, c->v->rank - 2, c->Ss[o]);
    const size_t kb = align64(ring_bytes(&ks, c->k->dtype));
    const size_t vb = align64(ring_bytes(&vs, c->v->dtype));
    m.k = ring_dense_like(&ks, base, c->k->dtype);
    m.v = ring_dense_like(&vs, base + kb, c->v->dtype);
    m.bytes = kb + vb;
    if (c->mask != NULL) {
        const attn_tensor ms = resized(c->mask, c->mask->rank - 1, c->Ss[o]);
        m.mask = ring_dense_like(&ms, base + kb + vb, c->mask->dtype);
        m.bytes += align64(ring_bytes(&ms, c->mask->dtype));
    }
    return m;
}

/* ---- parameters and local checks ---- */

static bool is_16bit(attn_dtype d) { return d == ATTN_DTYPE_F16 || d == ATTN_DTYPE_BF16; }

/* What the pieces compute in (and their parts' dtype): float64 for float64
 * queries, float32 for the rest. */
static attn_dtype compute_dtype(const ring_call *c) {
    return c->q->dtype == ATTN_DTYPE_F64 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
}

/* `t` itself, or for a 16-bit t a float32 copy in *own (exact; NULL: none
 * made, or out of memory when *copy is NULL). */
static const attn_tensor *widened(const attn_tensor *t, attn_tensor *copy, void **own) {
    *own = NULL;
    if (!is_16bit(t->dtype)) return t;
    *own = attn_alloc(ring_bytes(t, ATTN_DTYPE_F32));
    if (*own == NULL) return NULL;
    *copy = ring_dense_like(t, *own, ATTN_DTYPE_F32);
    ring_copy(t, copy);
    return copy;
}

static attn_status read_params(ring_call *c, const attn_ring_params *user) {
    attn_ring_params_init(&c->prm);
    if (user != NULL) {
        if (user->struct_size < offsetof(attn_ring_params, stats) || user->struct_size > 4096)
            return attn_set_error(ATTN_ERR_INVALID, "params.struct_size",
                                  "params.struct_size is %zu: initialise params with "
                                  "attn_ring_params_init() before setting its fields",
                                  user->struct_size);
        memcpy(&c->prm, user,
               user->struct_size < sizeof c->prm ? user->struct_size : sizeof c->prm);
    }
    const size_t ss = c->prm.sdpa.struct_size;
    if (ss < offsetof(attn_sdpa_params, arg_names) || ss > 4096)
        return attn_set_error(ATTN_ERR_INVALID, "params.sdpa.struct_size",
                              "params.sdpa.struct_size is %zu: initialise it with "
                              "attn_ring_params_init()", ss);
    attn_sdpa_params_init(&c->sdpa);
    memcpy(&c->sdpa, &c->prm.sdpa, ss < sizeof c->sdpa ? ss : sizeof c->sdpa);
    c->sdpa.struct_size = sizeof c->sdpa;
    if (c->sdpa.attn_mask != NULL)
        return attn_set_error(ATTN_ERR_INVALID, "params.sdpa.attn_mask",
                              "attn_ring: params.sdpa.attn_mask must be NULL: a mask over the "
                              "whole (L, S) does not travel; give the keys' mask as "
                              "params.key_mask");
    /* The score modifiers would compute correctly on slices (positions are
     * global), but the ranks' agreement does not compare them yet, and the
     * sinks' gradient would need a sum over the ranks: refused until then. */
    const char *modifier = c->sdpa.window_left != -1    ? "params.sdpa.window_left"
                           : c->sdpa.window_right != -1 ? "params.sdpa.window_right"
                           : c->sdpa.alibi_slopes       ? "params.sdpa.alibi_slopes"
                           : c->sdpa.softcap != 0       ? "params.sdpa.softcap"
                           : c->sdpa.sinks              ? "params.sdpa.sinks"
                                                        : NULL;
    if (modifier != NULL)
        return attn_set_error(ATTN_ERR_UNSUPPORTED, modifier,
                              "attn_ring: %s is set, but the ring does not take the score "
                              "modifiers (window, ALiBi, softcap, sinks) yet; use attn_sdpa",
                              modifier);
    if (c->sdpa.q_offset || c->sdpa.k_offset || c->sdpa.q_total || c->sdpa.k_total)
        return attn_set_error(ATTN_ERR_INVALID, "params.sdpa.q_offset",
                              "attn_ring: the slice fields of params.sdpa must be 0; the ring "
                              "sets them from the shards");
    if (c->prm.layout != ATTN_RING_ZIGZAG && c->prm.layout != ATTN_RING_CONTIGUOUS)
        return attn_set_error(ATTN_ERR_INVALID, "params.layout",
                              "params.layout is %d; expected ATTN_RING_ZIGZAG or "
                              "ATTN_RING_CONTIGUOUS", (int)c->prm.layout);
    if (!(c->prm.timeout > 0) || !isfinite(c->prm.timeout))
        return attn_set_error(ATTN_ERR_INVALID, "params.timeout",
                              "params.timeout is %g; expected a number of seconds > 0",
                              c->prm.timeout);
    c->mask = c->prm.key_mask;
    return ATTN_OK;
}

/* q, k, v, the key mask and out as attn_sdpa would take them on this shard. */
static attn_status check_local(ring_call *c, const attn_tensor *out, const attn_tensor *lse) {
    attn_sdpa_params sp = c->sdpa;
    sp.attn_mask = c->mask;
    attn_status st = attn_sdpa_out_shape(c->q, c->k, c->v, &sp, &c->orank, c->oshape);
    if (st != ATTN_OK) {
        if (strcmp(attn_last_error_arg(), "attn_mask") == 0)
            return attn_set_error(st, "params.key_mask", "params.key_mask: %s", attn_last_error());
        return st;
    }
    if (c->mask != NULL && c->mask->rank >= 2 && c->mask->shape[c->mask->rank - 2] != 1)
        return attn_set_error(ATTN_ERR_SHAPE, "params.key_mask",
                              "params.key_mask.shape[-2] is %lld; a key mask is the same for "
                              "every query (1 there): it travels with its keys",
                              (long long)c->mask->shape[c->mask->rank - 2]);
    const char *which[2] = {"out", "lse"};
    const attn_tensor *t[2] = {out, lse};
    for (int i = 0; i < 2; i++) {
        if (t[i] == NULL) {
            if (i == 0) return attn_set_error(ATTN_ERR_NULL, "out", "attn_ring: out is NULL");
            continue;
        }
        const int want = c->orank - i;
        bool ok = t[i]->rank == want && t[i]->data != NULL;
        for (int d = 0; ok && d < want; d++) ok = t[i]->shape[d] == c->oshape[d];
        if (!ok)
            return attn_set_error(ATTN_ERR_SHAPE, which[i], "attn_ring: %s has the wrong shape "
                                  "or no data: expected (B..., Hq, L_shard%s) of rank %d",
                                  which[i], i == 0 ? ", Ev" : "", want);
        /* out: q's dtype; lse: float32 (float64 queries: float64) or float64 */
        const attn_dtype want_dt = i == 0 ? c->q->dtype : compute_dtype(c);
        const bool dt_ok = t[i]->dtype == want_dt || (i == 1 && t[i]->dtype == ATTN_DTYPE_F64);
        if (!dt_ok)
            return attn_set_error(ATTN_ERR_DTYPE, which[i], "attn_ring: %s is %s; expected %s%s",
                                  which[i], attn_dtype_name(t[i]->dtype),
                                  attn_dtype_name(want_dt),
                                  i == 1 && want_dt != ATTN_DTYPE_F64 ? " or float64" : "");
    }
    return ATTN_OK;
}

/* ---- agreement ---- */

static void put_shape(ring_desc *d, int *n, const char *name, const attn_tensor *t, int skip) {
    char key[24];
    snprintf(key, sizeof key, "%s.rank", name);
    ring_desc_put(d, n, key, t != NULL ? t->rank : -1);
    if (t == NULL) return;
    snprintf(key, sizeof key, "%s.dtype", name);
    ring_desc_put_dtype(d, n, key, t);
    for (int i = 0; i < t->rank; i++) {
        if (i == t->rank + skip) continue; /* the shard's own length */
        snprintf(key, sizeof key, "%s.shape[%d]", name, i - t->rank);
        ring_desc_put(d, n, key, t->shape[i]);
    }
}

/* This rank's call, for comparison with every other rank's. */
static int describe(const ring_call *c, attn_status local, int kind, const attn_tensor *const g[5],
                    ring_desc *d) {
    memset(d, 0, sizeof *d);
    int n = 0;
    d->status = local;
    if (local != ATTN_OK) {
        snprintf(d->msg, sizeof d->msg, "%s", attn_last_error());
        snprintf(d->arg, sizeof d->arg, "%s", attn_last_error_arg());
        return 0;
    }
    d->L = c->q->shape[c->q->rank - 2];
    d->S = c->k->shape[c->k->rank - 2];
    ring_desc_put(d, &n, "call", kind);
    ring_desc_put(d, &n, "params.layout", c->prm.layout);
    put_shape(d, &n, "q", c->q, -2);
    put_shape(d, &n, "k", c->k, -2);
    put_shape(d, &n, "v", c->v, -2);
    put_shape(d, &n, "params.key_mask", c->mask, -1);
    ring_desc_put(d, &n, "params.sdpa.causal", c->sdpa.causal);
    ring_desc_put(d, &n, "params.sdpa.has_scale", c->sdpa.has_scale);
    ring_desc_put_double(d, &n, "params.sdpa.scale", c->sdpa.has_scale ? c->sdpa.scale : 0.0);
    ring_desc_put(d, &n, "params.sdpa.enable_gqa", c->sdpa.enable_gqa != 0);
    ring_desc_put_double(d, &n, "params.sdpa.dropout_p", c->sdpa.dropout_p);
    ring_desc_put(d, &n, "params.sdpa.seed", (int64_t)c->sdpa.seed);
    ring_desc_put(d, &n, "params.sdpa.rng_offset", (int64_t)c->sdpa.rng_offset);
    ring_desc_put(d, &n, "params.sdpa.lse_for_backward", c->sdpa.lse_for_backward != 0);
    static const char *const grad_names[5] = {"out", "lse", "dq", "dk", "dv"};
    for (int i = 0; i < 5; i++) {
        char key[24];
        snprintf(key, sizeof key, "%s.dtype", grad_names[i]);
        ring_desc_put_dtype(d, &n, key, g[i]);
    }
    return n;
}

/* Exchanges the descriptions; the totals, runs and message room. */
static attn_status agree(ring_call *c, attn_status local, int kind, const attn_tensor *const g[5]) {
    const int N = c->rc.n;
    ring_desc mine, *all = attn_alloc(sizeof(ring_desc) * (size_t)N);
    c->Ls = attn_alloc(sizeof(int64_t) * (size_t)N);
    c->Ss = attn_alloc(sizeof(int64_t) * (size_t)N);
    /* First only whether everyone has the room to listen: a rank without it
     * cannot take part in the exchange below. */
    attn_status room = ATTN_OK;
    if (all == NULL || c->Ls == NULL || c->Ss == NULL)
        room = attn_set_error(ATTN_ERR_NOMEM, NULL, "attn_ring: out of memory (agreement)");
    attn_status st = ring_finish(&c->rc, room, "agreement message");
    if (st != ATTN_OK) {
        attn_free(all);
        return st;
    }
    const int count = describe(c, local, kind, g, &mine);
    st = ring_agree(&c->rc, &mine, count, all);
    for (int r = 0; r < N && st == ATTN_OK; r++) {
        c->Ls[r] = all[r].L;
        c->Ss[r] = all[r].S;
    }
    attn_free(all);
    if (st != ATTN_OK) return st;
    c->Ltot = c->Stot = c->Smax = 0;
    for (int r = 0; r < N; r++) {
        c->Ltot += c->Ls[r], c->Stot += c->Ss[r];
        c->Smax = c->Ss[r] > c->Smax ? c->Ss[r] : c->Smax;
    }
    for (int r = 0; r < N && c->prm.layout == ATTN_RING_ZIGZAG; r++) {
        ring_runs qr, kr;
        ring_runs_of(ATTN_RING_ZIGZAG, c->Ltot, N, r, NULL, &qr);
        ring_runs_of(ATTN_RING_ZIGZAG, c->Stot, N, r, NULL, &kr);
        const int64_t lq = qr.len[0] + (qr.n > 1 ? qr.len[1] : 0);
        const int64_t lk = kr.len[0] + (kr.n > 1 ? kr.len[1] : 0);
        if (c->Ltot < 2 * N || c->Stot < 2 * N || lq != c->Ls[r] || lk != c->Ss[r])
            return attn_set_error(ATTN_ERR_SHAPE, lq != c->Ls[r] ? "q" : "k",
                                  "attn_ring: rank %d holds %lld queries and %lld keys, but the "
                                  "zigzag layout of %lld and %lld over %d ranks gives it %lld "
                                  "and %lld (attn_ring_shard_runs; at least 2 per rank)",
                                  r, (long long)c->Ls[r], (long long)c->Ss[r], (long long)c->Ltot,
                                  (long long)c->Stot, N, (long long)lq, (long long)lk);
    }
    ring_runs_of(c->prm.layout, c->Ltot, N, c->rc.rank, c->Ls, &c->qruns);
    for (int r = 0; r < N; r++) {
        const size_t b = kv_layout_of(c, r, NULL).bytes;
        c->kv_bytes = b > c->kv_bytes ? b : c->kv_bytes;
    }
    return ATTN_OK;
}

/* ---- the steps ---- */

/* Whether any query of run [q0, q0 + nq) sees a key of [k0, ...): causal
 * over the whole lengths (bottom-right: aligned to the last key). */
static bool pair_visible(const ring_call *c, int64_t q0, int64_t nq, int64_t k0) {
    if (c->sdpa.causal == ATTN_CAUSAL_NONE) return true;
    const int64_t shift = c->sdpa.causal == ATTN_CAUSAL_BOTTOM_RIGHT ? c->Stot - c->Ltot : 0;
    return q0 + nq - 1 + shift >= k0;
}

static int64_t piece_rows(int64_t n) {
    const int64_t rows = (n + PIECES - 1) / PIECES;
    return rows > PIECE_ROWS_MIN ? rows : PIECE_ROWS_MIN;
}

/* The sdpa parameters of one piece: query rows from q0, keys from k0. */
static attn_sdpa_params slice_params(const ring_call *c, int64_t q0, int64_t k0,
                                     const attn_tensor *mask) {
    attn_sdpa_params sp = c->sdpa;
    sp.q_offset = q0;
    sp.q_total = c->Ltot;
    sp.k_offset = k0;
    sp.k_total = c->Stot;
    sp.attn_mask = mask;
    /* A part's lse as its kernel scored it, which is what its out is
     * normalised by: the merge then weighs each part by its own sum (the
     * exact-lse tracking cost a third of the forward). */
    sp.lse_for_backward = 1;
    return sp;
}

/* Key run b of a message as one piece sees it, and the piece's parameters:
 * its query rows start at row p0 of this rank's run a. */
typedef struct piece_keys {
    attn_tensor k, v, mask;
    attn_sdpa_params sp; /* sp.attn_mask points at mask */
} piece_keys;

static void piece_keys_of(const ring_call *c, const kv_layout *m, const ring_runs *kr, int b, int a,
                          int64_t p0, piece_keys *pk) {
    pk->k = ring_rows(&m->k, m->k.rank - 2, kr->row[b], kr->len[b]);
    pk->v = ring_rows(&m->v, m->v.rank - 2, kr->row[b], kr->len[b]);
    if (c->mask != NULL) pk->mask = ring_rows(&m->mask, m->mask.rank - 1, kr->row[b], kr->len[b]);
    pk->sp = slice_params(c, c->qruns.start[a] + p0, kr->start[b],
                          c->mask != NULL ? &pk->mask : NULL);
}

/* One piece of the forward: attention of query rows [row, row + n) of this
 * rank on key run b of origin o, merged into the sums. */
typedef struct fwd_bufs {
    const attn_tensor *out;     /* the caller's, for the shapes            */
    const attn_tensor *q;       /* c->q, or its float32 copy (q32)         */
    attn_tensor q32;
    void *q32_data;
    attn_tensor acc, acc_lse;   /* (B..., Hq, L_shard, Ev) and (..., L_shard), float64 */
    void *part, *part_lse;      /* room for L_shard rows */
} fwd_bufs;

static attn_status forward_piece(ring_call *c, const kv_layout *m, const ring_runs *kr, int b,
                                 int a, int64_t p0, int64_t np, void *ctx) {
    fwd_bufs *f = ctx;
    const int ld = c->q->rank - 2, od = c->orank - 2;
    const attn_tensor q = ring_rows(f->q, ld, c->qruns.row[a] + p0, np);
    piece_keys pk;
    piece_keys_of(c, m, kr, b, a, p0, &pk);
    attn_tensor acc = ring_rows(&f->acc, od, c->qruns.row[a] + p0, np);
    attn_tensor acc_lse = ring_rows(&f->acc_lse, od, c->qruns.row[a] + p0, np);
    attn_tensor part = ring_dense_like(&acc, f->part, compute_dtype(c));
    attn_tensor part_lse = ring_dense_like(&acc_lse, f->part_lse, ATTN_DTYPE_F64);
    attn_status st = attn_sdpa(&q, &pk.k, &pk.v, &pk.sp, &part, NULL, &part_lse);
    if (st == ATTN_OK) st = attn_sdpa_merge(&acc, &acc_lse, &part, &part_lse);
    return st;
}

/* Every piece of rank o's shard for this rank, MPI moving `pending` between
 * pieces. `piece` is forward_piece or the backward's. */
typedef attn_status (*piece_fn)(ring_call *c, const kv_layout *m, const ring_runs *kr, int b,
                                int a, int64_t p0, int64_t np, void *ctx);

static void compute_step(ring_call *c, int o, const kv_layout *m, piece_fn piece, void *ctx,
                         ring_msgs *pending, int npending) {
    const double t0 = MPI_Wtime();
    ring_runs kr;
    ring_runs_of(c->prm.layout, c->Stot, c->rc.n, o, c->Ss, &kr);
    for (int a = 0; a < c->qruns.n && c->status == ATTN_OK; a++)
        for (int b = 0; b < kr.n && c->status == ATTN_OK; b++) {
            if (!pair_visible(c, c->qruns.start[a], c->qruns.len[a], kr.start[b])) continue;
            const int64_t rows = piece_rows(c->qruns.len[a]);
            for (int64_t p0 = 0; p0 < c->qruns.len[a] && c->status == ATTN_OK; p0 += rows) {
                const int64_t np = c->qruns.len[a] - p0 < rows ? c->qruns.len[a] - p0 : rows;
                c->status = piece(c, m, &kr, b, a, p0, np, ctx);
                for (int i = 0; i < npending; i++) ring_progress(&pending[i]);
            }
        }
    const double dt = MPI_Wtime() - t0;
    c->t_compute += dt;
    if (c->prm.stats != NULL && c->rc.step >= 0 && c->rc.step < 64)
        c->prm.stats->step_compute[c->rc.step] = dt;
}

/* Waits for the step's messages, timing it. */
static attn_status wait_step(ring_call *c, ring_msgs *msgs, int n) {
    const double t0 = MPI_Wtime();
    attn_status st = ATTN_OK;
    for (int i = 0; i < n && st == ATTN_OK; i++) st = ring_wait(&c->rc, &msgs[i]);
    const double dt = MPI_Wtime() - t0;
    c->t_wait += dt;
    if (c->prm.stats != NULL && c->rc.step >= 0 && c->rc.step < 64)
        c->prm.stats->step_wait[c->rc.step] += dt;
    return st;
}

/* Posts step t's K/V traffic: this shard on to r + 1, the next from r - 1. */
static attn_status post_kv(ring_call *c, int t, ring_msgs *m) {
    const int N = c->rc.n, r = c->rc.rank, next = (r + 1) % N, prev = (r + N - 1) % N;
    const int o = (r - t + 2 * N) % N, o_next = (r - t - 1 + 2 * N) % N;
    memset(m, 0, sizeof *m);
    m->what = "K/V shard";
    if (t == N - 1) return ATTN_OK;
    const size_t in = kv_layout_of(c, o_next, NULL).bytes, out = kv_layout_of(c, o, NULL).bytes;
    attn_status st = ring_recv(&c->rc, c->kv[(t + 1) % 2], in, prev, t * TAGS + TAG_KV, m);
    if (st == ATTN_OK) st = ring_send(&c->rc, c->kv[t % 2], out, next, t * TAGS + TAG_KV, m);
    if (c->prm.stats != NULL) c->prm.stats->bytes_sent += (int64_t)out;
    return st;
}

/* Packs this rank's K, V and mask into the first message buffer. A mask
 * broadcast over the keys (last dimension 1, as attn_sdpa takes it) is
 * spelled out: the message holds one entry per key of the shard. */
static void pack_own(ring_call *c) {
    const kv_layout m = kv_layout_of(c, c->rc.rank, c->kv[0]);
    ring_copy(c->k, &m.k);
    ring_copy(c->v, &m.v);
    if (c->mask != NULL) {
        attn_tensor mask = *c->mask;
        const int last = mask.rank - 1;
        if (mask.shape[last] == 1) {
            mask.shape[last] = m.mask.shape[last];
            mask.strides[last] = 0;
        }
        ring_copy(&mask, &m.mask);
    }
}

/* ---- set-up shared by both passes ---- */

/* Reads the parameters and opens the ring's communicator. A bad argument
 * is not returned at once: it goes into the agreement (*local), so that the
 * other ranks fail with it instead of waiting for this one. */
static attn_status begin(ring_call *c, MPI_Comm comm, const attn_ring_params *params,
                         const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                         attn_status *local) {
    memset(c, 0, sizeof *c);
    c->rc.comm = MPI_COMM_NULL;
    c->q = q, c->k = k, c->v = v;
    *local = read_params(c, params);
    if (*local == ATTN_OK && (q == NULL || k == NULL || v == NULL))
        *local = attn_set_error(ATTN_ERR_NULL, q == NULL ? "q" : k == NULL ? "k" : "v",
                                "attn_ring: %s is NULL", q == NULL ? "q" : k == NULL ? "k" : "v");
    if (*local == ATTN_OK && c->prm.stats != NULL) memset(c->prm.stats, 0, sizeof *c->prm.stats);
    const double timeout = c->prm.timeout > 0 && isfinite(c->prm.timeout) ? c->prm.timeout : 60.0;
    return ring_comm_open(comm, timeout, &c->rc); /* sets no message when it succeeds */
}

static attn_status alloc_kv(ring_call *c) {
    c->kv[0] = attn_alloc(c->kv_bytes);
    c->kv[1] = c->rc.n > 1 ? attn_alloc(c->kv_bytes) : NULL;
    if (c->kv[0] == NULL || (c->rc.n > 1 && c->kv[1] == NULL))
        return attn_set_error(ATTN_ERR_NOMEM, NULL,
                              "attn_ring: out of memory for two K/V messages of %zu bytes",
                              c->kv_bytes);
    return ATTN_OK;
}

static void end(ring_call *c, double t0) {
    attn_free(c->kv[0]);
    attn_free(c->kv[1]);
    attn_free(c->Ls);
    attn_free(c->Ss);
    if (c->prm.stats != NULL) {
        c->prm.stats->steps = c->rc.n;
        c->prm.stats->compute = c->t_compute;
        c->prm.stats->wait = c->t_wait;
        c->prm.stats->total = MPI_Wtime() - t0;
    }
    ring_comm_close(&c->rc);
}

/* The course of a call once begin() has opened the ring: the agreement
 * (this rank's own checks in `local`), every rank's buffers or none, the
 * steps, and the final status, which makes every rank fail when one did. */
typedef attn_status (*stage_fn)(ring_call *c, void *ctx);

static attn_status run(ring_call *c, attn_status local, int kind, const attn_tensor *const g[5],
                       stage_fn alloc, stage_fn steps, void *ctx) {
    const double ta = MPI_Wtime();
    attn_status st = agree(c, local, kind, g);
    if (c->prm.stats != NULL) c->prm.stats->agree = MPI_Wtime() - ta;
    if (st == ATTN_OK) {
        attn_status mine = alloc_kv(c);
        if (mine == ATTN_OK) mine = alloc(c, ctx);
        st = ring_finish(&c->rc, mine, "buffers-ready message");
    }
    if (st == ATTN_OK) {
        pack_own(c);
        st = steps(c, ctx);
        if (st == ATTN_OK) st = ring_finish(&c->rc, c->status, "final status");
    }
    return st;
}

/* ---- forward ---- */

void attn_ring_params_init(attn_ring_params *params) {
    if (params == NULL) return;
    memset(params, 0, sizeof *params);
    params->struct_size = sizeof *params;
    attn_sdpa_params_init(&params->sdpa);
    params->layout = ATTN_RING_ZIGZAG;
    params->timeout = 60.0;
}

/* The N steps of the forward into f's sums. */
static attn_status forward_steps(ring_call *c, void *ctx) {
    fwd_bufs *f = ctx;
    const int N = c->rc.n;
    for (int t = 0; t < N; t++) {
        c->rc.step = t;
        const int o = (c->rc.rank - t + N) % N;
        ring_msgs msgs;
        attn_status st = post_kv(c, t, &msgs);
        if (st != ATTN_OK) return st;
        const kv_layout m = kv_layout_of(c, o, c->kv[t % 2]);
        compute_step(c, o, &m, forward_piece, f, &msgs, 1);
        if ((st = wait_step(c, &msgs, 1)) != ATTN_OK) return st;
    }
    return ATTN_OK;
}

/* The forward's float64 sums and part buffers, shaped like out. */
static attn_status forward_alloc(ring_call *c, void *ctx) {
    fwd_bufs *f = ctx;
    f->q = widened(c->q, &f->q32, &f->q32_data);
    if (f->q == NULL) return attn_set_error(ATTN_ERR_NOMEM, NULL, "attn_ring: out of memory (q)");
    const attn_tensor *out = f->out;
    const size_t obytes = ring_bytes(out, ATTN_DTYPE_F64);
    const size_t lbytes = obytes / (size_t)out->shape[out->rank - 1];
    void *acc = attn_alloc(obytes), *acc_lse = attn_alloc(lbytes);
    f->part = attn_alloc(obytes);
    f->part_lse = attn_alloc(lbytes);
    f->acc = ring_dense_like(out, acc, ATTN_DTYPE_F64);
    attn_tensor rows = *out; /* lse: out's shape without Ev */
    rows.rank--;
    f->acc_lse = ring_dense_like(&rows, acc_lse, ATTN_DTYPE_F64);
    if (acc == NULL || acc_lse == NULL || f->part == NULL || f->part_lse == NULL)
        return attn_set_error(ATTN_ERR_NOMEM, NULL, "attn_ring: out of memory for the sums");
    memset(acc, 0, obytes);
    for (size_t i = 0; i < lbytes / sizeof(double); i++)
        ((double *)acc_lse)[i] = -INFINITY; /* no key yet */
    return ATTN_OK;
}

static void forward_free(fwd_bufs *f) {
    attn_free(f->q32_data);
    attn_free(f->acc.data);
    attn_free(f->acc_lse.data);
    attn_free(f->part);
    attn_free(f->part_lse);
}

attn_status attn_ring_sdpa(MPI_Comm comm, const attn_tensor *q, const attn_tensor *k,
                           const attn_tensor *v, const attn_ring_params *params, attn_tensor *out,
                           attn_tensor *lse) {
    attn_clear_error();
    const double t0 = MPI_Wtime();
    ring_call c;
    fwd_bufs f;
    memset(&f, 0, sizeof f);
    f.out = out;
    attn_status local;
    attn_status st = begin(&c, comm, params, q, k, v, &local);
    if (st == ATTN_OK) {
        const attn_tensor *g[5] = {out, lse, NULL, NULL, NULL};
        if (local == ATTN_OK) local = check_local(&c, out, lse);
        st = run(&c, local, 0, g, forward_alloc, forward_steps, &f);
    }
    if (st == ATTN_OK) {
        ring_copy(&f.acc, out);
        if (lse != NULL) ring_copy(&f.acc_lse, lse);
    }
    forward_free(&f);
    end(&c, t0);
    return st;
}

/* ---- backward ---- */

typedef struct bwd_bufs {
    const attn_tensor *dout, *out, *lse;
    /* what the pieces read: the caller's, or float32 copies of 16-bit ones */
    const attn_tensor *q_c, *out_c, *dout_c;
    attn_tensor wide[3];         /* the copies: q, out, dout                    */
    void *wide_data[3];
    void *k32, *v32;             /* a 16-bit K/V step widened (room for Smax)   */
    attn_tensor acc_dq;          /* float64, q's shape                          */
    void *part_dq, *part_dk, *part_dv; /* one piece's gradients, compute dtype   */
    void *step;                  /* this step's dK, dV terms (float64)         */
    char *dkv[2];                /* travelling dK, dV sums (float64)           */
    size_t dkv_bytes;
    bool want_dq, want_dkv;
} bwd_bufs;

/* dK and dV sums of rank o's shard, float64, in a buffer at `base`. */
static void dkv_views(const ring_call *c, int o, void *base, attn_tensor *dk, attn_tensor *dv) {
    const attn_tensor ks = resized(c->k, c->k->rank - 2, c->Ss[o]);
    const attn_tensor vs = resized(c->v, c->v->rank - 2, c->Ss[o]);
    *dk = ring_dense_like(&ks, base, ATTN_DTYPE_F64);
    *dv = ring_dense_like(&vs, (char *)base + align64(ring_bytes(&ks, ATTN_DTYPE_F64)),
                          ATTN_DTYPE_F64);
}

static size_t dkv_bytes_of(const ring_call *c, int o) {
    const attn_tensor ks = resized(c->k, c->k->rank - 2, c->Ss[o]);
    const attn_tensor vs = resized(c->v, c->v->rank - 2, c->Ss[o]);
    return align64(ring_bytes(&ks, ATTN_DTYPE_F64)) + ring_bytes(&vs, ATTN_DTYPE_F64);
}

/* One piece of the backward: gradients of query rows [row, row + np) on key
 * run b of origin o, added to dq's sums and this step's dK, dV terms. */
static attn_status backward_piece(ring_call *c, const kv_layout *m, const ring_runs *kr, int b,
                                  int a, int64_t p0, int64_t np, void *ctx) {
    bwd_bufs *w = ctx;
    const int ld = c->q->rank - 2, od = c->orank - 2;
    const int64_t row = c->qruns.row[a] + p0;
    const attn_tensor q = ring_rows(w->q_c, ld, row, np);
    const attn_tensor dout = ring_rows(w->dout_c, od, row, np);
    const attn_tensor out = ring_rows(w->out_c, od, row, np);
    const attn_tensor lse = ring_rows(w->lse, od, row, np);
    piece_keys pk;
    piece_keys_of(c, m, kr, b, a, p0, &pk);
    const attn_dtype cd = compute_dtype(c);
    attn_tensor gq = ring_dense_like(&q, w->part_dq, cd);
    attn_tensor gk = ring_dense_like(&pk.k, w->part_dk, cd);
    attn_tensor gv = ring_dense_like(&pk.v, w->part_dv, cd);
    attn_status st = attn_sdpa_backward(&dout, &q, &pk.k, &pk.v, &out, &lse, &pk.sp,
                                        w->want_dq ? &gq : NULL, w->want_dkv ? &gk : NULL,
                                        w->want_dkv ? &gv : NULL, NULL);
    if (st != ATTN_OK) return st;
    if (w->want_dq) {
        const attn_tensor acc = ring_rows(&w->acc_dq, ld, row, np);
        ring_add(&gq, &acc);
    }
    if (w->want_dkv) {
        attn_tensor dk, dv;
        dkv_views(c, (c->rc.rank - c->rc.step + c->rc.n) % c->rc.n, w->step, &dk, &dv);
        const attn_tensor sk = ring_rows(&dk, dk.rank - 2, kr->row[b], kr->len[b]);
        const attn_tensor sv = ring_rows(&dv, dv.rank - 2, kr->row[b], kr->len[b]);
        ring_add(&gk, &sk);
        ring_add(&gv, &sv);
    }
    return ATTN_OK;
}

/* Posts, at the start of step t, the receive of the dK, dV sums this rank
 * works on next: shard o - 1's from r - 1 after its step t, or after the
 * last step our own shard's, coming home. Posted a step ahead, so that a
 * rank finishing step t finds its send's receiver waiting (a rendezvous
 * send completes only then): no cycle of ranks waiting on each other. */
static attn_status post_dkv_recv(ring_call *c, bwd_bufs *w, int t, ring_msgs *in) {
    const int N = c->rc.n, r = c->rc.rank, prev = (r + N - 1) % N;
    memset(in, 0, sizeof *in);
    in->what = "dK/dV sums";
    if (N == 1 || !w->want_dkv) return ATTN_OK;
    const int o_next = t < N - 1 ? (r - t - 1 + 2 * N) % N : r;
    const int tag = t < N - 1 ? t * TAGS + TAG_DKV : TAG_HOME;
    return ring_recv(&c->rc, w->dkv[(t + 1) % 2], dkv_bytes_of(c, o_next), prev, tag, in);
}

/* After step t's compute: the sums of shard o (received, or zero at step 0)
 * take this rank's terms and go on to r + 1 (home after the last step). */
static attn_status pass_dkv(ring_call *c, bwd_bufs *w, int t, ring_msgs *in, ring_msgs *out) {
    const int N = c->rc.n, r = c->rc.rank, o = (r - t + N) % N, next = (r + 1) % N;
    attn_status st = t > 0 ? wait_step(c, in, 1) : ATTN_OK;
    if (st != ATTN_OK) return st;
    char *sums = w->dkv[t % 2];
    const size_t bytes = dkv_bytes_of(c, o);
    if (t == 0) memset(sums, 0, bytes);
    const double *terms = w->step;
    for (size_t i = 0; i < bytes / sizeof(double); i++) ((double *)sums)[i] += terms[i];
    memset(out, 0, sizeof *out);
    out->what = "dK/dV sums";
    if (N == 1) return ATTN_OK;
    const int tag = t < N - 1 ? t * TAGS + TAG_DKV : TAG_HOME;
    if (c->prm.stats != NULL) c->prm.stats->bytes_sent += (int64_t)bytes;
    return ring_send(&c->rc, sums, bytes, next, tag, out);
}

/* The N steps of the backward; the own shard's dK, dV sums end in
 * w->dkv[N % 2] (received home after the last step; w->dkv[0] for one
 * rank, where they never left). */
static attn_status backward_steps(ring_call *c, void *ctx) {
    bwd_bufs *w = ctx;
    const int N = c->rc.n;
    ring_msgs dkv_in; /* the sums this step adds to, posted a step ahead */
    memset(&dkv_in, 0, sizeof dkv_in);
    for (int t = 0; t < N; t++) {
        c->rc.step = t;
        const int o = (c->rc.rank - t + N) % N;
        ring_msgs msgs[3]; /* K/V in and out, the next sums in, the sums out */
        attn_status st = post_kv(c, t, &msgs[0]);
        if (st == ATTN_OK) st = post_dkv_recv(c, w, t, &msgs[1]);
        if (st != ATTN_OK) return st;
        if (w->want_dkv) memset(w->step, 0, dkv_bytes_of(c, o));
        kv_layout m = kv_layout_of(c, o, c->kv[t % 2]);
        if (w->k32 != NULL) { /* 16-bit K/V: the pieces' gradients need float32 ones */
            attn_tensor k32 = ring_dense_like(&m.k, w->k32, ATTN_DTYPE_F32);
            attn_tensor v32 = ring_dense_like(&m.v, w->v32, ATTN_DTYPE_F32);
            ring_copy(&m.k, &k32);
            ring_copy(&m.v, &v32);
            m.k = k32;
            m.v = v32;
        }
        compute_step(c, o, &m, backward_piece, w, msgs, 2);
        memset(&msgs[2], 0, sizeof msgs[2]);
        if (w->want_dkv && (st = pass_dkv(c, w, t, &dkv_in, &msgs[2])) != ATTN_OK) return st;
        if ((st = wait_step(c, &msgs[0], 1)) != ATTN_OK ||
            (st = wait_step(c, &msgs[2], 1)) != ATTN_OK)
            return st;
        dkv_in = msgs[1];
    }
    return wait_step(c, &dkv_in, 1); /* our own sums, home */
}

/* dout like out; dq, dk, dv like q, k, v in their dtypes; lse required. */
static attn_status check_backward(ring_call *c, const attn_tensor *dout, const attn_tensor *out,
                                  const attn_tensor *lse, const attn_tensor *const g[3]) {
    if (lse == NULL)
        return attn_set_error(ATTN_ERR_NULL, "lse", "attn_ring_sdpa_backward: lse is NULL");
    attn_status st = check_local(c, out, lse);
    if (st != ATTN_OK) return st;
    const attn_tensor *like[4] = {out, c->q, c->k, c->v};
    const attn_tensor *mine[4] = {dout, g[0], g[1], g[2]};
    static const char *const names[4] = {"dout", "dq", "dk", "dv"};
    for (int i = 0; i < 4; i++) {
        if (mine[i] == NULL) {
            if (i == 0) return attn_set_error(ATTN_ERR_NULL, "dout", "attn_ring: dout is NULL");
            continue;
        }
        bool ok = mine[i]->rank == like[i]->rank && mine[i]->data != NULL;
        for (int d = 0; ok && d < like[i]->rank; d++) ok = mine[i]->shape[d] == like[i]->shape[d];
        if (!ok)
            return attn_set_error(ATTN_ERR_SHAPE, names[i],
                                  "attn_ring: %s must have the shape of %s (and data)", names[i],
                                  i == 0 ? "out" : i == 1 ? "q" : i == 2 ? "k" : "v");
        if (mine[i]->dtype != like[i]->dtype)
            return attn_set_error(ATTN_ERR_DTYPE, names[i], "attn_ring: %s is %s; expected %s",
                                  names[i], attn_dtype_name(mine[i]->dtype),
                                  attn_dtype_name(like[i]->dtype));
    }
    return ATTN_OK;
}

static attn_status backward_alloc(ring_call *c, void *ctx) {
    bwd_bufs *w = ctx;
    size_t dkv = 0;
    for (int r = 0; r < c->rc.n; r++) dkv = dkv_bytes_of(c, r) > dkv ? dkv_bytes_of(c, r) : dkv;
    const attn_tensor kmax = resized(c->k, c->k->rank - 2, c->Smax);
    const attn_tensor vmax = resized(c->v, c->v->rank - 2, c->Smax);
    const attn_dtype cd = compute_dtype(c);
    const attn_tensor *const from[3] = {c->q, w->out, w->dout};
    const attn_tensor **to[3] = {&w->q_c, &w->out_c, &w->dout_c};
    for (int i = 0; i < 3; i++)
        if ((*to[i] = widened(from[i], &w->wide[i], &w->wide_data[i])) == NULL)
            return attn_set_error(ATTN_ERR_NOMEM, NULL, "attn_ring: out of memory (copies)");
    if (is_16bit(c->k->dtype)) {
        w->k32 = attn_alloc(ring_bytes(&kmax, ATTN_DTYPE_F32));
        w->v32 = attn_alloc(ring_bytes(&vmax, ATTN_DTYPE_F32));
        if (w->k32 == NULL || w->v32 == NULL)
            return attn_set_error(ATTN_ERR_NOMEM, NULL, "attn_ring: out of memory (K/V copies)");
    }
    void *acc = attn_alloc(ring_bytes(c->q, ATTN_DTYPE_F64));
    w->acc_dq = ring_dense_like(c->q, acc, ATTN_DTYPE_F64);
    w->part_dq = attn_alloc(ring_bytes(c->q, cd));
    w->part_dk = attn_alloc(ring_bytes(&kmax, cd));
    w->part_dv = attn_alloc(ring_bytes(&vmax, cd));
    w->step = attn_alloc(dkv);
    w->dkv[0] = attn_alloc(dkv);
    w->dkv[1] = attn_alloc(dkv);
    w->dkv_bytes = dkv;
    if (!acc || !w->part_dq || !w->part_dk || !w->part_dv || !w->step || !w->dkv[0] || !w->dkv[1])
        return attn_set_error(ATTN_ERR_NOMEM, NULL, "attn_ring: out of memory (backward sums)");
    memset(acc, 0, ring_bytes(c->q, ATTN_DTYPE_F64));
    return ATTN_OK;
}

static void backward_free(bwd_bufs *w) {
    for (int i = 0; i < 3; i++) attn_free(w->wide_data[i]);
    attn_free(w->k32);
    attn_free(w->v32);
    attn_free(w->acc_dq.data);
    attn_free(w->part_dq);
    attn_free(w->part_dk);
    attn_free(w->part_dv);
    attn_free(w->step);
    attn_free(w->dkv[0]);
    attn_free(w->dkv[1]);
}

attn_status attn_ring_sdpa_backward(MPI_Comm comm, const attn_tensor *dout, const attn_tensor *q,
                                    const attn_tensor *k, const attn_tensor *v,
                                    const attn_tensor *out, const attn_tensor *lse,
                                    const attn_ring_params *params, attn_tensor *dq,
                                    attn_tensor *dk, attn_tensor *dv) {
    attn_clear_error();
    const double t0 = MPI_Wtime();
    ring_call c;
    bwd_bufs w;
    memset(&w, 0, sizeof w);
    w.dout = dout, w.out = out, w.lse = lse;
    w.want_dq = dq != NULL;
    w.want_dkv = dk != NULL || dv != NULL;
    attn_status local;
    attn_status st = begin(&c, comm, params, q, k, v, &local);
    if (st == ATTN_OK) {
        const attn_tensor *const g[3] = {dq, dk, dv};
        const attn_tensor *gd[5] = {out, lse, dq, dk, dv};
        if (local == ATTN_OK) local = check_backward(&c, dout, out, lse, g);
        st = run(&c, local, 1, gd, backward_alloc, backward_steps, &w);
    }
    if (st == ATTN_OK) {
        if (dq != NULL) ring_copy(&w.acc_dq, dq);
        attn_tensor sk, sv;
        dkv_views(&c, c.rc.rank, w.dkv[c.rc.n == 1 ? 0 : c.rc.n % 2], &sk, &sv);
        if (dk != NULL) ring_copy(&sk, dk);
        if (dv != NULL) ring_copy(&sv, dv);
    }
    backward_free(&w);
    end(&c, t0);
    return st;
}
