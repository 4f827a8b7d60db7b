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

HARNESS_MAIN(T(span_of_int64_max_elements), T(mha_3d_mask_stride_times_heads),
             T(mha_failed_workspace_no_null_offset), T(mha_huge_stride_on_unit_length))
