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

HARNESS_MAIN(T(span_of_int64_max_elements))
