/*
 * test_regressions.c — one test per bug found by the fuzzers or by review,
 * named after what broke. Most were undefined behaviour (signed overflow in
 * size arithmetic) that only the ASan+UBSan tier (make test, tier 2) turns
 * into a failure; the quick tier checks the status. The fuzz inputs that
 * found them are kept in tests/fuzz/corpus/ and replayed by replay_*.
 */
#include "testutil.h"

/* fuzz_sdpa, crash-span-int64-max: a view whose strides reach exactly
 * INT64_MAX elements; attn__check_tensor computed span + 1 in int64_t (UB)
 * before checking the byte count. */
static void span_of_int64_max_elements(void) {
    static float x[8];
    int64_t s2[2] = {2, 2}, s1[2] = {1, 2};
    attn_tensor q, k, v, o;
    attn_tensor_init(&q, x, ATTN_DTYPE_F32, 2, s1);
    attn_tensor_init(&k, x, ATTN_DTYPE_F32, 2, s2);
    attn_tensor_init(&v, x, ATTN_DTYPE_F32, 2, s2);
    attn_tensor_init(&o, x + 4, ATTN_DTYPE_F32, 2, s1);
    k.strides[0] = INT64_MAX - 1; /* span (INT64_MAX - 1) + 1 = INT64_MAX */
    CHECK_STATUS(attn_sdpa(&q, &k, &v, NULL, &o, NULL, NULL), ATTN_ERR_OVERFLOW);
    k.strides[0] = 2;
    v.strides[0] = 0;
    v.strides[1] = INT64_MAX; /* span INT64_MAX on the last dimension */
    CHECK_STATUS(attn_sdpa(&q, &k, &v, NULL, &o, NULL, NULL), ATTN_ERR_OVERFLOW);
    v.strides[1] = -INT64_MAX;
    CHECK_STATUS(attn_sdpa(&q, &k, &v, NULL, &o, NULL, NULL), ATTN_ERR_OVERFLOW);
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    CHECK_STATUS(attn_sdpa_out_shape(&q, &k, &v, NULL, &rank, shape), ATTN_ERR_OVERFLOW);
}

/* Review: a 3-D MHA attn_mask (N*H, L, S) is viewed as (N, H, L, S) with
 * batch stride strides[0] * H. With one batch (N = 1 or unbatched) that
 * product was computed although unused, and overflows for a legal view whose
 * span strides[0] * (H - 1) fits. With every allocation refused, the call
 * stops at its workspace, before it would touch the (fictitious) mask. */
static long refused;
static void *refuse_alloc(void *ctx, size_t size) {
    (void)ctx;
    (void)size;
    refused++;
    return NULL;
}
static void refuse_release(void *ctx, void *p) {
    (void)ctx;
    (void)p;
}

static void mha_3d_mask_stride_times_heads(void) {
    attn_mha_config c;
    attn_mha_config_init(&c, 6, 3);
    attn_mha *m = NULL;
    CHECK_OK(attn_mha_create(&c, &m));
    if (m == NULL) return;
    /* The mask's span reaches ~2^63 bytes above it: the output lies below,
     * so that only the huge stride is under test, not the overlap check. */
    static float x[6];
    static struct {
        float y[6];
        unsigned char mask[1];
    } below;
    float *y = below.y;
    unsigned char *mask = below.mask;
    for (int batched = 0; batched < 2; batched++) {
        int64_t xs3[3] = {1, 1, 6}, xs2[2] = {1, 6}, ms[3] = {3, 1, 1};
        attn_tensor tx, ty, tm;
        attn_tensor_init(&tx, x, ATTN_DTYPE_F32, batched ? 3 : 2, batched ? xs3 : xs2);
        attn_tensor_init(&ty, y, ATTN_DTYPE_F32, batched ? 3 : 2, batched ? xs3 : xs2);
        attn_tensor_init(&tm, mask, ATTN_DTYPE_BOOL, 3, ms);
        tm.strides[0] = INT64_MAX / 2; /* span INT64_MAX - 1: legal */
        attn_mha_forward_params fp;
        attn_mha_forward_params_init(&fp);
        fp.attn_mask = &tm;
        attn_allocator none = {refuse_alloc, refuse_release, NULL};
        attn_set_allocator(&none);
        refused = 0;
        CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, &fp, &ty, NULL), ATTN_ERR_NOMEM);
        attn_set_allocator(NULL);
        CHECK(refused > 0, "no allocation was attempted");
    }
    attn_mha_destroy(m);
}

/* fuzz_mha, crash-mha-null-workspace: when the Q/K/V workspace could not be
 * allocated, attn_mha_forward still derived the K and V pointers from the
 * NULL block (NULL + offset: UB) before returning ATTN_ERR_NOMEM. Both
 * layouts: self-attention (one product for Q, K, V) and separate inputs. */
static void mha_failed_workspace_no_null_offset(void) {
    attn_mha_config c;
    attn_mha_config_init(&c, 8, 2);
    attn_mha *m = NULL;
    CHECK_OK(attn_mha_create(&c, &m));
    if (m == NULL) return;
    static float x[3 * 2 * 8], y[3 * 2 * 8], o[3 * 2 * 8];
    int64_t xs[3] = {3, 2, 8};
    attn_tensor tx, ty, to;
    attn_tensor_init(&tx, x, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&ty, y, ATTN_DTYPE_F32, 3, xs);
    attn_tensor_init(&to, o, ATTN_DTYPE_F32, 3, xs);
    attn_allocator none = {refuse_alloc, refuse_release, NULL};
    attn_set_allocator(&none);
    CHECK_STATUS(attn_mha_forward(m, &tx, &tx, &tx, NULL, &to, NULL), ATTN_ERR_NOMEM);
    CHECK_STATUS(attn_mha_forward(m, &tx, &ty, &ty, NULL, &to, NULL), ATTN_ERR_NOMEM);
    attn_set_allocator(NULL);
    CHECK_OK(attn_mha_forward(m, &tx, &tx, &tx, NULL, &to, NULL));
    attn_mha_destroy(m);
}

/* fuzz_mha, crash-mha-huge-unit-stride: a query of length 1 may have any
 * stride on that dimension (here 2^62). The projection passed it to BLAS as
 * the leading dimension, cast to int (0), so BLAS refused the call and the
 * Q workspace was never written: garbage out. Fresh blocks are filled with
 * NaN here so that any unwritten workspace shows. Both for the input and
 * for an output with the same stride. */
static void *nan_alloc(void *ctx, size_t size) {
    (void)ctx;
    void *p = malloc(size);
    if (p) memset(p, 0xFF, size);
    return p;
}
static void nan_release(void *ctx, void *p) {
    (void)ctx;
    free(p);
}

static void mha_huge_stride_on_unit_length(void) {
    attn_mha_config c;
    attn_mha_config_init(&c, 4, 2);
    attn_mha *m = NULL;
    CHECK_OK(attn_mha_create(&c, &m));
    if (m == NULL) return;
    /* query (L=1, N=2, E=4), key/value (S=3, N=2, E=4), sequence first */
    static float q[8], kv[24], out[8], out_ref[8];
    for (int i = 0; i < 8; i++) q[i] = (float)(i % 5) - 2;
    for (int i = 0; i < 24; i++) kv[i] = (float)(i % 7) / 3 - 1;
    int64_t qs[3] = {1, 2, 4}, ks[3] = {3, 2, 4};
    attn_tensor tq, tk, to, tref;
    attn_tensor_init(&tq, q, ATTN_DTYPE_F32, 3, qs);
    attn_tensor_init(&tk, kv, ATTN_DTYPE_F32, 3, ks);
    attn_tensor_init(&tref, out_ref, ATTN_DTYPE_F32, 3, qs);
    attn_tensor_init(&to, out, ATTN_DTYPE_F32, 3, qs);
    attn_allocator nan = {nan_alloc, nan_release, NULL};
    attn_set_allocator(&nan);
    CHECK_OK(attn_mha_forward(m, &tq, &tk, &tk, NULL, &tref, NULL));
    tq.strides[0] = (int64_t)1 << 62; /* the length-1 dimension */
    CHECK_OK(attn_mha_forward(m, &tq, &tk, &tk, NULL, &to, NULL));
    CHECK(memcmp(out, out_ref, sizeof out) == 0, "a huge stride on the query's length-1 "
          "dimension changed the result: %g vs %g", (double)out[0], (double)out_ref[0]);
    to.strides[0] = (int64_t)1 << 62; /* and on the output's */
    memset(out, 0, sizeof out);
    CHECK_OK(attn_mha_forward(m, &tq, &tk, &tk, NULL, &to, NULL));
    CHECK(memcmp(out, out_ref, sizeof out) == 0, "a huge stride on the output's length-1 "
          "dimension changed the result: %g vs %g", (double)out[0], (double)out_ref[0]);
    attn_set_allocator(NULL);
    attn_mha_destroy(m);
}

/* Review (issue 13's MHA tests): a float mask of the dtype's most negative
 * finite value, torch.finfo(float32).min as Hugging Face models pad with,
 * was folded into raw scores as b / scale, which overflows float32 to -inf
 * for any scale below 1: a row whose every key carries it came out as an
 * empty row (0), where torch weighs those keys alike (the mean of V). Row 0
 * masks every key so, row 1 every key but one; the other rows have random
 * masks and must match the float64 reference path. */
static void mask_of_dtype_min_weighs_keys_alike(void) {
    rng r = {harness_seed() ^ 0x3e38};
    const double scales[] = {0.125, 0.01, 3.0, -0.5};
    const int64_t Es[] = {4, 64}, Ls[] = {3, 40, 200};
    for (int di = 0; di < 2; di++) {
        const attn_dtype dt = di ? ATTN_DTYPE_BF16 : ATTN_DTYPE_F32;
        const double lowest = di ? -0x1.fep127 : -0x1.fffffep127; /* each dtype's min */
        for (int ei = 0; ei < 2; ei++)
            for (int li = 0; li < 3; li++)
                for (int si = 0; si < 4; si++) {
                    const int64_t E = Es[ei], L = Ls[li], S = L + 2;
                    const int64_t qs[2] = {L, E}, ks[2] = {S, E}, ms[2] = {L, S};
                    test_tensor q, k, v, mask, out;
                    tt_make(&q, &r, dt, 2, qs, LAYOUT_CONTIGUOUS, 1, 0);
                    tt_make(&k, &r, dt, 2, ks, LAYOUT_CONTIGUOUS, 1, 0);
                    tt_make(&v, &r, dt, 2, ks, LAYOUT_CONTIGUOUS, 1, 0);
                    tt_make(&mask, &r, dt, 2, ms, LAYOUT_CONTIGUOUS, 1, 0);
                    for (int64_t j = 0; j < S; j++) {
                        tt_set(&mask.t, (int64_t[]){0, j}, lowest);
                        tt_set(&mask.t, (int64_t[]){1, j}, j == 1 ? 0.0 : lowest);
                    }
                    tt_make_output(&out, &r, dt, 2, qs, LAYOUT_CONTIGUOUS);
                    attn_sdpa_params prm;
                    attn_sdpa_params_init(&prm);
                    prm.attn_mask = &mask.t;
                    prm.has_scale = 1;
                    prm.scale = scales[si];
                    double *ref = NULL;
                    for (int isa = ATTN_ISA_REF; isa <= ATTN_ISA_LAST; isa++) {
                        if (!attn_isa_supported((attn_isa)isa)) continue;
                        CHECK_OK(attn_set_isa((attn_isa)isa));
                        CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, &prm, &out.t, NULL, NULL));
                        double *o = tt_dense(&out.t);
                        if (ref == NULL) ref = tt_dense(&out.t); /* the float64 reference */
                        const double u = di ? 0x1p-8 : 0x1p-20;
                        for (int64_t e = 0; e < E; e++) {
                            double mean = 0;
                            for (int64_t j = 0; j < S; j++) mean += tt_get(&v.t, (int64_t[]){j, e});
                            mean /= (double)S;
                            CHECK(fabs(o[e] - mean) <= 4 * u * (1 + fabs(mean)),
                                  "%s %s E=%lld L=%lld scale %g: row 0 [%lld] is %g, the mean of "
                                  "V is %g", attn_isa_name((attn_isa)isa), attn_dtype_name(dt),
                                  (long long)E, (long long)L, scales[si], (long long)e, o[e], mean);
                            CHECK(o[E + e] == tt_get(&v.t, (int64_t[]){1, e}),
                                  "%s %s E=%lld L=%lld scale %g: row 1 is not V's row 1",
                                  attn_isa_name((attn_isa)isa), attn_dtype_name(dt), (long long)E,
                                  (long long)L, scales[si]);
                        }
                        double mag = 0, err = 0;
                        for (int64_t i = 2 * E; i < L * E; i++) {
                            mag = fmax(mag, fabs(ref[i]));
                            err = fmax(err, fabs(o[i] - ref[i]));
                        }
                        CHECK(err <= 64 * u * (1 + mag), "%s %s E=%lld L=%lld scale %g: other rows "
                              "%.3g from the reference", attn_isa_name((attn_isa)isa),
                              attn_dtype_name(dt), (long long)E, (long long)L, scales[si], err);
                        free(o);
                    }
                    attn_set_isa(ATTN_ISA_AUTO);
                    free(ref);
                    test_tensor *all[] = {&q, &k, &v, &mask, &out};
                    for (int i = 0; i < 5; i++) tt_free(all[i]);
                }
    }
}

HARNESS_MAIN(T(span_of_int64_max_elements), T(mask_of_dtype_min_weighs_keys_alike), T(mha_3d_mask_stride_times_heads),
             T(mha_failed_workspace_no_null_offset), T(mha_huge_stride_on_unit_length))
