/*
 * test_ring.c — attn_ring against the single-process attn_sdpa, run under
 * `mpirun -np N` (ctest runs N = 1 .. 4). Every rank makes the whole inputs
 * from one seed, computes the whole attention alone (the reference), takes
 * its shard, runs the ring, and compares its shard of the result.
 */
#include <mpi.h>
#include <stdint.h>

#include "attn_ring.h"
#include "harness.h"
#include "testutil.h"

static int RANK, NRANKS;

/* A dense tensor filled from a seeded generator (same on every rank). */
typedef struct buf {
    attn_tensor t;
    void *data;
} buf;

static buf make(attn_dtype dt, int rank, const int64_t *shape, uint64_t seed, double amp) {
    buf b;
    int64_t n = 1;
    for (int i = 0; i < rank; i++) n *= shape[i];
    b.data = calloc((size_t)n, attn_dtype_size(dt));
    attn_tensor_init(&b.t, b.data, dt, rank, shape);
    rng r = {seed};
    for (int64_t i = 0; i < n; i++) {
        const double x = amp * rng_normal(&r);
        if (dt == ATTN_DTYPE_F32) ((float *)b.data)[i] = (float)x;
        else if (dt == ATTN_DTYPE_F64) ((double *)b.data)[i] = x;
        else if (dt == ATTN_DTYPE_BOOL) ((unsigned char *)b.data)[i] = x > -0.8 * amp; /* mostly kept */
        else ((uint16_t *)b.data)[i] = tt_half_bits(x, dt);
    }
    return b;
}

/* This rank's shard of `whole` along `dim` (layout, or `lens` for uneven
 * contiguous shards). */
static buf shard_of(const buf *whole, int dim, attn_ring_layout layout, const int64_t *lens) {
    const int d = dim < 0 ? dim + whole->t.rank : dim;
    int64_t shape[ATTN_MAX_RANK], start = 0;
    memcpy(shape, whole->t.shape, sizeof shape);
    buf s;
    if (lens != NULL) { /* contiguous, uneven: a plain slice */
        for (int r = 0; r < RANK; r++) start += lens[r];
        shape[d] = lens[RANK];
        s = make(whole->t.dtype, whole->t.rank, shape, 0, 0);
        attn_tensor w = whole->t;
        w.data = (char *)w.data + (size_t)(start * w.strides[d]) * attn_dtype_size(w.dtype);
        w.shape[d] = lens[RANK];
        int64_t n = 1;
        for (int i = 0; i < s.t.rank; i++) n *= s.t.shape[i];
        const int64_t outer = n / (lens[RANK] * w.strides[d]);
        for (int64_t o = 0; o < outer; o++) /* rows of the slice are contiguous per outer index */
            memcpy((char *)s.data + (size_t)(o * lens[RANK] * w.strides[d]) * attn_dtype_size(w.dtype),
                   (char *)w.data + (size_t)(o * whole->t.shape[d] * w.strides[d]) *
                                        attn_dtype_size(w.dtype),
                   (size_t)(lens[RANK] * w.strides[d]) * attn_dtype_size(w.dtype));
        return s;
    }
    int nruns;
    int64_t st[2], len[2];
    CHECK_OK(attn_ring_shard_runs(layout, whole->t.shape[d], NRANKS, RANK, &nruns, st, len));
    shape[d] = len[0] + (nruns > 1 ? len[1] : 0);
    s = make(whole->t.dtype, whole->t.rank, shape, 0, 0);
    CHECK_OK(attn_ring_shard(&whole->t, dim, layout, NRANKS, RANK, &s.t));
    return s;
}

static size_t ring_bytes_of(const buf *b) {
    size_t n = attn_dtype_size(b->t.dtype);
    for (int i = 0; i < b->t.rank; i++) n *= (size_t)b->t.shape[i];
    return n;
}

static double value(const buf *b, int64_t i) {
    switch (b->t.dtype) {
    case ATTN_DTYPE_F32: return ((float *)b->data)[i];
    case ATTN_DTYPE_F64: return ((double *)b->data)[i];
    default: return tt_half_value(((uint16_t *)b->data)[i], b->t.dtype);
    }
}

/* A float32 copy of a 16-bit buffer (exact), or a plain copy of another. */
static buf widened(const buf *b) {
    const attn_dtype dt = b->t.dtype == ATTN_DTYPE_F64 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
    buf w = make(dt, b->t.rank, b->t.shape, 0, 0);
    CHECK_OK(attn_tensor_convert(&b->t, &w.t));
    return w;
}

/* How many elements of a and b differ (16-bit results: the ring's and the
 * reference's float32 values round to neighbours now and then, never
 * often; a part rounded to 16 bits at every step would move most). */
static double share_differing(const buf *a, const buf *b) {
    int64_t n = 1, differ = 0;
    for (int i = 0; i < a->t.rank; i++) n *= a->t.shape[i];
    for (int64_t i = 0; i < n; i++) differ += value(a, i) != value(b, i);
    return (double)differ / (double)n;
}

static double worst_diff(const buf *a, const buf *b) {
    int64_t n = 1;
    for (int i = 0; i < a->t.rank; i++) n *= a->t.shape[i];
    double w = 0;
    for (int64_t i = 0; i < n; i++) {
        const double x = value(a, i), y = value(b, i);
        if (x == y) continue; /* equal infinities too */
        const double d = fabs(x - y) / (1.0 + fabs(y));
        w = d > w || isnan(d) ? d : w;
    }
    return w;
}

typedef struct ring_case {
    const char *name;
    attn_dtype dt;
    int64_t B, Hq, H, L, S, E, Ev;
    attn_causal causal;
    double dropout;
    attn_ring_layout layout;
    int key_mask, uneven, backward; /* key_mask: 0 none, 1 (B,1,1,S), 2 (B,1,1,1) */
} ring_case;

/* The whole call and the ring on this rank's shard; out, lse (and the
 * gradients) compared. */
static void run_case(const ring_case *c) {
    const uint64_t seed = harness_seed() ^ (uint64_t)(c->L * 131 + c->S * 7 + c->causal);
    const int64_t qs[4] = {c->B, c->Hq, c->L, c->E}, ks[4] = {c->B, c->H, c->S, c->E};
    const int64_t vs[4] = {c->B, c->H, c->S, c->Ev}, os[4] = {c->B, c->Hq, c->L, c->Ev};
    /* key_mask 2: one value per batch entry, broadcast over the keys */
    const int64_t ls[3] = {c->B, c->Hq, c->L}, ms[4] = {c->B, 1, 1, c->key_mask == 2 ? 1 : c->S};
    buf q = make(c->dt, 4, qs, seed, 1.0), k = make(c->dt, 4, ks, seed + 1, 1.0);
    buf v = make(c->dt, 4, vs, seed + 2, 1.0), dout = make(c->dt, 4, os, seed + 3, 1.0);
    buf mask = make(ATTN_DTYPE_BOOL, 4, ms, seed + 4, 1.0);
    buf out = make(c->dt, 4, os, 0, 0), lse = make(ATTN_DTYPE_F64, 3, ls, 0, 0);
    attn_ring_params rp;
    attn_ring_params_init(&rp);
    attn_sdpa_params *sp = &rp.sdpa;
    sp->causal = c->causal;
    sp->enable_gqa = c->Hq != c->H;
    sp->dropout_p = c->dropout;
    sp->seed = 7;
    sp->rng_offset = 11;
    sp->lse_for_backward = c->backward;
    rp.layout = c->layout;
    attn_sdpa_params whole_p = *sp;
    whole_p.attn_mask = c->key_mask ? &mask.t : NULL;
    /* The reference: the whole call, for 16-bit operands on their float32
     * values (what the ring computes), each result rounded once. */
    buf q32 = widened(&q), k32 = widened(&k), v32 = widened(&v), out32 = widened(&out);
    CHECK_OK(attn_sdpa(&q32.t, &k32.t, &v32.t, &whole_p, &out32.t, NULL, &lse.t));
    CHECK_OK(attn_tensor_convert(&out32.t, &out.t));

    int64_t lq[4], lk[4]; /* uneven contiguous shards: rank r holds r + 1 parts */
    const int64_t parts = (int64_t)NRANKS * (NRANKS + 1) / 2;
    for (int r = 0; r < NRANKS; r++) {
        lq[r] = c->L * (r + 1) / parts, lk[r] = c->S * (r + 1) / parts;
        if (r == NRANKS - 1) { /* the rest */
            int64_t sq = 0, sk = 0;
            for (int i = 0; i < r; i++) sq += lq[i], sk += lk[i];
            lq[r] = c->L - sq, lk[r] = c->S - sk;
        }
    }
    const int64_t *ql = c->uneven ? lq : NULL, *kl = c->uneven ? lk : NULL;
    buf sq = shard_of(&q, -2, c->layout, ql), sk = shard_of(&k, -2, c->layout, kl);
    buf sv = shard_of(&v, -2, c->layout, kl);
    buf sm = c->key_mask == 2 ? make(ATTN_DTYPE_BOOL, 4, ms, seed + 4, 1.0) /* the same values */
                              : shard_of(&mask, -1, c->layout, kl);
    buf so_ref = shard_of(&out, -2, c->layout, ql), sl_ref = shard_of(&lse, -1, c->layout, ql);
    buf so = make(c->dt, 4, so_ref.t.shape, 0, 0), sl = make(ATTN_DTYPE_F64, 3, sl_ref.t.shape, 0, 0);
    buf so2 = make(c->dt, 4, so_ref.t.shape, 0, 0);
    rp.key_mask = c->key_mask ? &sm.t : NULL;
    attn_ring_stats stats;
    rp.stats = &stats;
    CHECK_OK(attn_ring_sdpa(MPI_COMM_WORLD, &sq.t, &sk.t, &sv.t, &rp, &so.t, &sl.t));
    /* 16-bit: one unit in the last place more, where the float32 results
     * round to neighbours */
    const double ulp = c->dt == ATTN_DTYPE_BF16 ? 0x1p-7 : c->dt == ATTN_DTYPE_F16 ? 0x1p-10 : 0;
    const double tol = (c->dt == ATTN_DTYPE_F64 ? 1e-12 : 3e-5) + ulp;
    const double e_out = worst_diff(&so, &so_ref), e_lse = worst_diff(&sl, &sl_ref);
    CHECK(e_out <= tol && e_lse <= tol, "%s, %d ranks, rank %d: out differs by %g, lse by %g",
          c->name, NRANKS, RANK, e_out, e_lse);
    CHECK(ulp == 0 || share_differing(&so, &so_ref) <= 0.02,
          "%s, %d ranks, rank %d: %.1f%% of the 16-bit outputs differ from the reference's",
          c->name, NRANKS, RANK, 100 * share_differing(&so, &so_ref));
    CHECK(stats.steps == NRANKS && stats.total > 0, "%s: stats steps %d", c->name, stats.steps);
    CHECK_OK(attn_ring_sdpa(MPI_COMM_WORLD, &sq.t, &sk.t, &sv.t, &rp, &so2.t, NULL));
    CHECK(memcmp(so.data, so2.data, ring_bytes_of(&so)) == 0, "%s: a second run differs", c->name);

    if (c->backward) {
        buf dq = make(c->dt, 4, qs, 0, 0), dk = make(c->dt, 4, ks, 0, 0), dv = make(c->dt, 4, vs, 0, 0);
        buf dout32 = widened(&dout), outr = widened(&out); /* the rounded out, as stored */
        buf g32[3] = {widened(&dq), widened(&dk), widened(&dv)};
        CHECK_OK(attn_sdpa_backward(&dout32.t, &q32.t, &k32.t, &v32.t, &outr.t, &lse.t, &whole_p,
                                    &g32[0].t, &g32[1].t, &g32[2].t, NULL));
        CHECK_OK(attn_tensor_convert(&g32[0].t, &dq.t));
        CHECK_OK(attn_tensor_convert(&g32[1].t, &dk.t));
        CHECK_OK(attn_tensor_convert(&g32[2].t, &dv.t));
        buf *wb[] = {&dout32, &outr, &g32[0], &g32[1], &g32[2]};
        for (size_t i = 0; i < sizeof wb / sizeof wb[0]; i++) free(wb[i]->data);
        buf sdo = shard_of(&dout, -2, c->layout, ql);
        buf rdq = shard_of(&dq, -2, c->layout, ql), rdk = shard_of(&dk, -2, c->layout, kl);
        buf rdv = shard_of(&dv, -2, c->layout, kl);
        buf gq = make(c->dt, 4, rdq.t.shape, 0, 0), gk = make(c->dt, 4, rdk.t.shape, 0, 0);
        buf gv = make(c->dt, 4, rdv.t.shape, 0, 0);
        CHECK_OK(attn_ring_sdpa_backward(MPI_COMM_WORLD, &sdo.t, &sq.t, &sk.t, &sv.t, &so.t, &sl.t,
                                         &rp, &gq.t, &gk.t, &gv.t));
        const double gtol = (c->dt == ATTN_DTYPE_F64 ? 1e-10 : 2e-4) + ulp;
        const double eq = worst_diff(&gq, &rdq), ek = worst_diff(&gk, &rdk), ev = worst_diff(&gv, &rdv);
        CHECK(eq <= gtol && ek <= gtol && ev <= gtol,
              "%s backward, %d ranks, rank %d: dq %g, dk %g, dv %g", c->name, NRANKS, RANK, eq,
              ek, ev);
        const double sh[3] = {share_differing(&gq, &rdq), share_differing(&gk, &rdk),
                              share_differing(&gv, &rdv)};
        CHECK(ulp == 0 || (sh[0] <= 0.05 && sh[1] <= 0.05 && sh[2] <= 0.05),
              "%s backward, rank %d: %.1f%%, %.1f%%, %.1f%% of dq, dk, dv differ", c->name, RANK,
              100 * sh[0], 100 * sh[1], 100 * sh[2]);
        buf *bs[] = {&dq, &dk, &dv, &sdo, &rdq, &rdk, &rdv, &gq, &gk, &gv};
        for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++) free(bs[i]->data);
    }
    buf *all[] = {&q, &k, &v, &dout, &mask, &out, &lse, &sq, &sk, &sv, &sm, &so_ref, &sl_ref, &so,
                  &sl, &so2, &q32, &k32, &v32, &out32};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->data);
}

static const ring_case CASES[] = {
    /* name             dtype          B  Hq H  L    S    E   Ev  causal                    p    layout                 mask uneven bwd */
    {"plain",          ATTN_DTYPE_F32, 1, 2, 2, 300, 300, 32, 32, ATTN_CAUSAL_NONE,         0,   ATTN_RING_ZIGZAG,      0, 0, 1},
    {"causal zigzag",  ATTN_DTYPE_F32, 2, 2, 2, 301, 301, 16, 24, ATTN_CAUSAL_TOP_LEFT,     0,   ATTN_RING_ZIGZAG,      0, 0, 1},
    {"causal L != S",  ATTN_DTYPE_F32, 1, 2, 2, 97,  260, 16, 16, ATTN_CAUSAL_BOTTOM_RIGHT, 0,   ATTN_RING_ZIGZAG,      0, 0, 1},
    {"top-left L > S", ATTN_DTYPE_F32, 1, 1, 1, 260, 97,  16, 16, ATTN_CAUSAL_TOP_LEFT,     0,   ATTN_RING_ZIGZAG,      0, 0, 0},
    {"gqa",            ATTN_DTYPE_F32, 1, 6, 2, 200, 180, 32, 16, ATTN_CAUSAL_TOP_LEFT,     0,   ATTN_RING_ZIGZAG,      0, 0, 1},
    {"dropout",        ATTN_DTYPE_F32, 1, 2, 2, 150, 170, 16, 16, ATTN_CAUSAL_TOP_LEFT,     0.2, ATTN_RING_ZIGZAG,      0, 0, 1},
    {"key mask",       ATTN_DTYPE_F32, 2, 2, 2, 120, 140, 16, 16, ATTN_CAUSAL_NONE,         0,   ATTN_RING_ZIGZAG,      1, 0, 1},
    {"mask over keys", ATTN_DTYPE_F64, 3, 2, 2, 64,  72,  8,  8,  ATTN_CAUSAL_NONE,         0,   ATTN_RING_ZIGZAG,      2, 0, 1},
    {"uneven",         ATTN_DTYPE_F32, 1, 2, 2, 211, 199, 16, 16, ATTN_CAUSAL_TOP_LEFT,     0.1, ATTN_RING_CONTIGUOUS,  1, 1, 1},
    {"contiguous",     ATTN_DTYPE_F32, 1, 2, 2, 256, 256, 64, 64, ATTN_CAUSAL_TOP_LEFT,     0,   ATTN_RING_CONTIGUOUS,  0, 0, 1},
    {"float64",        ATTN_DTYPE_F64, 1, 2, 1, 90,  110, 8,  8,  ATTN_CAUSAL_TOP_LEFT,     0.3, ATTN_RING_ZIGZAG,      1, 0, 1},
    {"bfloat16",       ATTN_DTYPE_BF16, 1, 4, 2, 230, 210, 32, 32, ATTN_CAUSAL_TOP_LEFT,    0,   ATTN_RING_ZIGZAG,      1, 0, 1},
    {"float16 uneven", ATTN_DTYPE_F16, 1, 2, 2, 150, 170, 16, 24, ATTN_CAUSAL_BOTTOM_RIGHT, 0.2, ATTN_RING_CONTIGUOUS,  0, 1, 1},
};

static void test_ring_matches_single_process(void) {
    test_failer count; /* fails nothing: counts attn's blocks, which must all come back */
    failer_install(&count, 0, false);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) run_case(&CASES[i]);
    attn_set_allocator(NULL);
    CHECK(count.live == 0 && count.allocs > 0, "%ld of attn's %ld blocks not freed", count.live,
          count.allocs);
}

/* A call that differs on one rank fails on all of them, before compute. */
static void test_disagreement_fails_everywhere(void) {
    const int64_t qs[3] = {2, 8 * NRANKS, 16}, ks[3] = {2, 8 * NRANKS, RANK == NRANKS - 1 ? 8 : 16};
    buf q = make(ATTN_DTYPE_F32, 3, qs, 5, 1), k = make(ATTN_DTYPE_F32, 3, ks, 6, 1);
    buf v = make(ATTN_DTYPE_F32, 3, qs, 7, 1), out = make(ATTN_DTYPE_F32, 3, qs, 0, 0);
    attn_ring_params rp;
    attn_ring_params_init(&rp);
    /* k.shape[-1] differs on the last rank: its own check fails, the others
     * hear of it */
    CHECK_STATUS(attn_ring_sdpa(MPI_COMM_WORLD, &q.t, &k.t, &v.t, &rp, &out.t, NULL),
                 ATTN_ERR_SHAPE);
    /* a parameter that differs: the scale on rank 0 */
    free(k.data);
    k = make(ATTN_DTYPE_F32, 3, qs, 6, 1);
    rp.sdpa.has_scale = RANK == 0;
    rp.sdpa.scale = 0.5;
    if (NRANKS > 1) {
        CHECK_STATUS(attn_ring_sdpa(MPI_COMM_WORLD, &q.t, &k.t, &v.t, &rp, &out.t, NULL),
                     ATTN_ERR_INVALID);
        CHECK(strstr(attn_last_error(), "scale") != NULL, "message: %s", attn_last_error());
    }
    /* a bad argument on one rank only: the others fail with its message */
    attn_ring_params_init(&rp);
    rp.timeout = RANK == NRANKS - 1 ? -1 : 60;
    CHECK_STATUS(attn_ring_sdpa(MPI_COMM_WORLD, &q.t, &k.t, &v.t, &rp, &out.t, NULL),
                 ATTN_ERR_INVALID);
    CHECK(strstr(attn_last_error(), "timeout") != NULL, "message: %s", attn_last_error());
    /* shards that are not the zigzag layout's */
    attn_ring_params_init(&rp);
    const int64_t odd[3] = {2, RANK == 0 ? 3 : 8, 16}; /* rank 0 is short of its share */
    buf q2 = make(ATTN_DTYPE_F32, 3, odd, 5, 1), o2 = make(ATTN_DTYPE_F32, 3, odd, 0, 0);
    if (NRANKS > 1)
        CHECK_STATUS(attn_ring_sdpa(MPI_COMM_WORLD, &q2.t, &k.t, &v.t, &rp, &o2.t, NULL),
                     ATTN_ERR_SHAPE);
    /* a full attn_mask is refused */
    rp.sdpa.attn_mask = &q.t;
    CHECK_STATUS(attn_ring_sdpa(MPI_COMM_WORLD, &q.t, &k.t, &v.t, &rp, &out.t, NULL),
                 ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "params.sdpa.attn_mask") == 0, "arg %s",
          attn_last_error_arg());
    buf *all[] = {&q, &k, &v, &out, &q2, &o2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->data);
}

/* The ring's own communicator is made on the first call on a communicator
 * and kept on it: calls on MPI_COMM_WORLD, on a duplicate, and on a new
 * duplicate after that one was freed (its cached communicator freed with it)
 * give the same bits. */
static void test_communicators_are_cached_and_freed(void) {
    const int64_t shape[3] = {2, 16 * NRANKS, 16};
    buf q = make(ATTN_DTYPE_F32, 3, shape, 11, 1), k = make(ATTN_DTYPE_F32, 3, shape, 12, 1);
    buf v = make(ATTN_DTYPE_F32, 3, shape, 13, 1);
    buf qs = shard_of(&q, 1, ATTN_RING_ZIGZAG, NULL), ks = shard_of(&k, 1, ATTN_RING_ZIGZAG, NULL);
    buf vs = shard_of(&v, 1, ATTN_RING_ZIGZAG, NULL);
    buf first = make(ATTN_DTYPE_F32, 3, qs.t.shape, 0, 0), out = make(ATTN_DTYPE_F32, 3, qs.t.shape, 0, 0);
    const size_t bytes = (size_t)(qs.t.shape[0] * qs.t.shape[1] * qs.t.shape[2]) * sizeof(float);
    attn_ring_params rp;
    attn_ring_params_init(&rp);
    rp.sdpa.causal = ATTN_CAUSAL_TOP_LEFT;
    CHECK_STATUS(attn_ring_sdpa(MPI_COMM_WORLD, &qs.t, &ks.t, &vs.t, &rp, &first.t, NULL), ATTN_OK);
    for (int round = 0; round < 2; round++) {
        MPI_Comm c;
        MPI_Comm_dup(MPI_COMM_WORLD, &c);
        for (int call = 0; call < 2; call++) {
            memset(out.data, 0xff, bytes);
            CHECK_STATUS(attn_ring_sdpa(c, &qs.t, &ks.t, &vs.t, &rp, &out.t, NULL), ATTN_OK);
            CHECK(memcmp(out.data, first.data, bytes) == 0,
                  "round %d, call %d on a duplicate: other bits than on MPI_COMM_WORLD", round, call);
        }
        MPI_Comm_free(&c); /* frees the ring's communicator cached on c */
    }
    buf *all[] = {&q, &k, &v, &qs, &ks, &vs, &first, &out};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->data);
}

/* The shard helpers: runs cover the sequence once; shard + unshard is the
 * identity. */
static void test_shard_helpers(void) {
    for (int n = 1; n <= 5; n++)
        for (int64_t total = 2 * n; total < 2 * n + 9; total++)
            for (int lay = 0; lay < 2; lay++) {
                char *seen = calloc((size_t)total, 1);
                for (int r = 0; r < n; r++) {
                    int nr;
                    int64_t st[2], len[2];
                    CHECK_OK(attn_ring_shard_runs((attn_ring_layout)lay, total, n, r, &nr, st, len));
                    for (int i = 0; i < nr; i++)
                        for (int64_t x = st[i]; x < st[i] + len[i]; x++) seen[x]++;
                }
                for (int64_t x = 0; x < total; x++)
                    CHECK(seen[x] == 1, "n %d total %lld layout %d: position %lld held %d times", n,
                          (long long)total, lay, (long long)x, seen[x]);
                free(seen);
            }
    int nr;
    int64_t st[2], len[2];
    CHECK_STATUS(attn_ring_shard_runs(ATTN_RING_ZIGZAG, 5, 3, 0, &nr, st, len), ATTN_ERR_INVALID);
    CHECK_STATUS(attn_ring_shard_runs(ATTN_RING_ZIGZAG, 8, 3, 3, &nr, st, len), ATTN_ERR_INVALID);
    const int64_t ws[3] = {3, 17, 5};
    buf w = make(ATTN_DTYPE_F64, 3, ws, 9, 1), back = make(ATTN_DTYPE_F64, 3, ws, 0, 0);
    for (int r = 0; r < 3; r++) {
        CHECK_OK(attn_ring_shard_runs(ATTN_RING_ZIGZAG, 17, 3, r, &nr, st, len));
        const int64_t ss[3] = {3, len[0] + (nr > 1 ? len[1] : 0), 5};
        buf s = make(ATTN_DTYPE_F64, 3, ss, 0, 0);
        CHECK_OK(attn_ring_shard(&w.t, 1, ATTN_RING_ZIGZAG, 3, r, &s.t));
        CHECK_OK(attn_ring_unshard(&s.t, -2, ATTN_RING_ZIGZAG, 3, r, &back.t));
        s.t.shape[1]++;
        CHECK_STATUS(attn_ring_shard(&w.t, 1, ATTN_RING_ZIGZAG, 3, r, &s.t), ATTN_ERR_SHAPE);
        free(s.data);
    }
    CHECK(memcmp(w.data, back.data, 3 * 17 * 5 * sizeof(double)) == 0, "unshard(shard) != whole");
    free(w.data);
    free(back.data);
}

/* Allocation n fails on one rank, for every n of a forward and a backward:
 * that rank gets ATTN_ERR_NOMEM, every other rank an error too (never a
 * hang, never a success that hides a missing part), and nothing leaks. */
static void test_allocation_failures(void) {
    const int64_t qs[3] = {2, 12 * NRANKS, 8};
    buf q = make(ATTN_DTYPE_F32, 3, qs, 5, 1), k = make(ATTN_DTYPE_F32, 3, qs, 6, 1);
    buf v = make(ATTN_DTYPE_F32, 3, qs, 7, 1), out = make(ATTN_DTYPE_F32, 3, qs, 0, 0);
    buf dout = make(ATTN_DTYPE_F32, 3, qs, 8, 1), dq = make(ATTN_DTYPE_F32, 3, qs, 0, 0);
    buf dk = make(ATTN_DTYPE_F32, 3, qs, 0, 0), dv = make(ATTN_DTYPE_F32, 3, qs, 0, 0);
    const int64_t ls[2] = {2, 12 * NRANKS};
    buf lse = make(ATTN_DTYPE_F64, 2, ls, 0, 0);
    attn_ring_params rp;
    attn_ring_params_init(&rp);
    rp.sdpa.causal = ATTN_CAUSAL_TOP_LEFT;
    rp.timeout = 5; /* a rank that fails before the agreement leaves the others waiting */
    const int victim = NRANKS - 1;
    for (int pass = 0; pass < 2; pass++) {
        for (long n = 1;; n++) {
            test_failer f;
            failer_install(&f, RANK == victim ? n : 0, false);
            attn_status st = pass == 0
                                 ? attn_ring_sdpa(MPI_COMM_WORLD, &q.t, &k.t, &v.t, &rp, &out.t, &lse.t)
                                 : attn_ring_sdpa_backward(MPI_COMM_WORLD, &dout.t, &q.t, &k.t, &v.t,
                                                           &out.t, &lse.t, &rp, &dq.t, &dk.t, &dv.t);
            attn_set_allocator(NULL);
            CHECK(f.live == 0, "pass %d, failure %ld: %ld blocks leaked", pass, n, f.live);
            int failed = RANK == victim ? f.failed > 0 : 0, any = 0;
            MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
            if (RANK == victim && failed)
                CHECK(st == ATTN_ERR_NOMEM, "pass %d, failure %ld: status %d (%s)", pass, n, st,
                      attn_last_error());
            CHECK((st != ATTN_OK) == (any != 0), "pass %d, failure %ld on rank %d: rank %d says %d",
                  pass, n, victim, RANK, st);
            if (!any) break; /* the call allocated fewer than n blocks */
            MPI_Barrier(MPI_COMM_WORLD);
        }
    }
    buf *all[] = {&q, &k, &v, &out, &dout, &dq, &dk, &dv, &lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->data);
}

/* Every argument out of range, on every rank: a clear error naming it. */
#define CHECK_ARG(call, status, name)                                                         \
    do {                                                                                      \
        CHECK_STATUS(call, status);                                                           \
        CHECK(strcmp(attn_last_error_arg(), name) == 0, "%s: names '%s', not '%s' (%s)",      \
              #call, attn_last_error_arg(), name, attn_last_error());                         \
    } while (0)

static void test_hostile_arguments(void) {
    const int64_t qs[3] = {2, 4 * NRANKS, 8}, ls[2] = {2, 4 * NRANKS};
    buf q = make(ATTN_DTYPE_F32, 3, qs, 5, 1), k = make(ATTN_DTYPE_F32, 3, qs, 6, 1);
    buf v = make(ATTN_DTYPE_F32, 3, qs, 7, 1), out = make(ATTN_DTYPE_F32, 3, qs, 0, 0);
    buf lse = make(ATTN_DTYPE_F64, 2, ls, 0, 0), blse = make(ATTN_DTYPE_BOOL, 2, ls, 0, 0);
    const int64_t ms_bad[3] = {2, 2, 4 * NRANKS}, ms_wide[3] = {2, 1, 4 * NRANKS + 1};
    buf mask2 = make(ATTN_DTYPE_BOOL, 3, ms_bad, 1, 1), maskw = make(ATTN_DTYPE_BOOL, 3, ms_wide, 1, 1);
    const int64_t small[3] = {2, 4 * NRANKS, 4};
    buf dsmall = make(ATTN_DTYPE_F32, 3, small, 0, 0), d64 = make(ATTN_DTYPE_F64, 3, qs, 0, 0);
    const MPI_Comm W = MPI_COMM_WORLD;
    attn_ring_params rp;

    attn_ring_params_init(&rp);
    rp.struct_size = 0;
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_INVALID,
              "params.struct_size");
    attn_ring_params_init(&rp);
    rp.sdpa.struct_size = 0;
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_INVALID,
              "params.sdpa.struct_size");
    attn_ring_params_init(&rp);
    rp.layout = (attn_ring_layout)7;
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_INVALID,
              "params.layout");
    attn_ring_params_init(&rp);
    rp.timeout = NAN;
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_INVALID,
              "params.timeout");
    attn_ring_params_init(&rp);
    rp.sdpa.k_offset = 3;
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_INVALID,
              "params.sdpa.q_offset");
    attn_ring_params_init(&rp);
    rp.sdpa.window_left = 8; /* the score modifiers: not taken by the ring yet */
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_UNSUPPORTED,
              "params.sdpa.window_left");
    attn_ring_params_init(&rp);
    rp.sdpa.softcap = 30;
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_UNSUPPORTED,
              "params.sdpa.softcap");
    attn_ring_params_init(&rp);
    rp.key_mask = &mask2.t; /* differs per query: cannot travel with the keys */
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_SHAPE,
              "params.key_mask");
    rp.key_mask = &maskw.t; /* one key too many */
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_SHAPE,
              "params.key_mask");
    CHECK(strstr(attn_last_error(), "params.key_mask: params.key_mask") == NULL,
          "message repeats itself: %s", attn_last_error());
    attn_ring_params_init(&rp);
    CHECK_ARG(attn_ring_sdpa(W, NULL, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_NULL, "q");
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, NULL, NULL), ATTN_ERR_NULL, "out");
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &dsmall.t, NULL), ATTN_ERR_SHAPE, "out");
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &d64.t, NULL), ATTN_ERR_DTYPE, "out");
    CHECK_ARG(attn_ring_sdpa(W, &q.t, &k.t, &v.t, &rp, &out.t, &blse.t), ATTN_ERR_DTYPE, "lse");
    { /* 16-bit operands: out in q's dtype, lse float32 or float64 */
        attn_tensor hq = q.t, hk = k.t, hv = v.t, ho = out.t;
        hq.dtype = hk.dtype = hv.dtype = ho.dtype = ATTN_DTYPE_BF16;
        CHECK_ARG(attn_ring_sdpa(W, &hq, &hk, &hv, &rp, &out.t, NULL), ATTN_ERR_DTYPE, "out");
        attn_tensor hl = blse.t;
        hl.dtype = ATTN_DTYPE_BF16;
        CHECK_ARG(attn_ring_sdpa(W, &hq, &hk, &hv, &rp, &ho, &hl), ATTN_ERR_DTYPE, "lse");
    }
    CHECK_ARG(attn_ring_sdpa(MPI_COMM_NULL, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_INVALID,
              "comm");
    if (NRANKS >= 2) { /* an intercommunicator (even ranks against odd ones) is refused */
        MPI_Comm half, inter;
        MPI_Comm_split(W, RANK % 2, RANK, &half);
        MPI_Intercomm_create(half, 0, W, RANK % 2 == 0 ? 1 : 0, 77, &inter);
        CHECK_ARG(attn_ring_sdpa(inter, &q.t, &k.t, &v.t, &rp, &out.t, NULL), ATTN_ERR_INVALID,
                  "comm");
        CHECK(strstr(attn_last_error(), "intercommunicator") != NULL, "message: %s",
              attn_last_error());
        MPI_Comm_free(&inter);
        MPI_Comm_free(&half);
    }
    /* the backward's own */
    CHECK_ARG(attn_ring_sdpa_backward(W, &out.t, &q.t, &k.t, &v.t, &out.t, NULL, &rp, NULL, NULL,
                                      NULL), ATTN_ERR_NULL, "lse");
    CHECK_ARG(attn_ring_sdpa_backward(W, NULL, &q.t, &k.t, &v.t, &out.t, &lse.t, &rp, NULL, NULL,
                                      NULL), ATTN_ERR_NULL, "dout");
    CHECK_ARG(attn_ring_sdpa_backward(W, &out.t, &q.t, &k.t, &v.t, &out.t, &lse.t, &rp, &dsmall.t,
                                      NULL, NULL), ATTN_ERR_SHAPE, "dq");
    CHECK_ARG(attn_ring_sdpa_backward(W, &out.t, &q.t, &k.t, &v.t, &out.t, &lse.t, &rp, NULL,
                                      &d64.t, NULL), ATTN_ERR_DTYPE, "dk");
    /* the shard helpers */
    CHECK_ARG(attn_ring_shard(&q.t, 3, ATTN_RING_ZIGZAG, 1, 0, &out.t), ATTN_ERR_INVALID, "dim");
    CHECK_ARG(attn_ring_shard(&q.t, 1, ATTN_RING_ZIGZAG, 1, 0, &d64.t), ATTN_ERR_DTYPE, "shard");
    CHECK_ARG(attn_ring_shard(NULL, 1, ATTN_RING_ZIGZAG, 1, 0, &out.t), ATTN_ERR_NULL, "whole");
    CHECK_ARG(attn_ring_unshard(&out.t, 1, ATTN_RING_ZIGZAG, 2, 2, &q.t), ATTN_ERR_INVALID, "rank");
    buf *all[] = {&q, &k, &v, &out, &lse, &blse, &mask2, &maskw, &dsmall, &d64};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->data);
}

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &RANK);
    MPI_Comm_size(MPI_COMM_WORLD, &NRANKS);
    static const harness_test tests[] = {T(test_shard_helpers), T(test_ring_matches_single_process),
                                         T(test_disagreement_fails_everywhere),
                                         T(test_communicators_are_cached_and_freed),
                                         T(test_allocation_failures), T(test_hostile_arguments)};
    if (RANK != 0) { /* one summary, from rank 0; the others speak on failure */
        if (freopen("/dev/null", "w", stdout) == NULL) return 1;
    }
    const int rc = harness_main(argc, argv, tests, (int)(sizeof tests / sizeof tests[0]));
    int all_rc = 0;
    MPI_Allreduce(&rc, &all_rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return all_rc;
}
