/*
 * test_problem.c — the problem description: global offsets, key slices
 * merged by log-sum-exp, and ragged batches (KV caches filled to a length,
 * packed variable-length sequences), on every kernel path this machine has.
 */
#include "problem/lse_merge.h"
#include "problem/problem.h"
#include "sdpa/flash.h"
#include "sdpa/sdpa.h"
#include "testutil.h"

static const attn_isa FUSED[] = {ATTN_ISA_GENERIC, ATTN_ISA_AVX2, ATTN_ISA_AVX512,
                                 ATTN_ISA_AVX512_BF16, ATTN_ISA_AMX};
static const attn_isa ALL[] = {ATTN_ISA_REF, ATTN_ISA_GENERIC, ATTN_ISA_AVX2, ATTN_ISA_AVX512,
                               ATTN_ISA_AVX512_BF16, ATTN_ISA_AMX};

static void fill(void *data, attn_dtype dt, int64_t n, rng *r) {
    for (int64_t i = 0; i < n; i++) {
        const double x = rng_normal(r);
        if (dt == ATTN_DTYPE_F32)
            ((float *)data)[i] = (float)x;
        else
            ((double *)data)[i] = x;
    }
}

/* A dense row of `dt` at data, as the merge writes it. */
static attn__operand row_operand(void *data, attn_dtype dt) {
    attn__operand op;
    memset(&op, 0, sizeof op);
    op.data = data;
    op.dtype = dt;
    op.cs = 1;
    return op;
}

static attn_tensor view(void *data, attn_dtype dt, int rank, const int64_t *shape) {
    attn_tensor t;
    attn_tensor_init(&t, data, dt, rank, shape);
    return t;
}

/* ---- dropout over the key chunks, merged, equals the whole call ---- */

enum { H = 4, L = 3, S = 2048, E = 64 }; /* a decode shape: the split path */
enum { MAX_PARTS = 16 };

static void chunks_case(attn_isa isa, attn_dtype dt, attn_causal causal, bool float_mask) {
    const size_t es = attn_dtype_size(dt);
    rng r = {harness_seed() ^ (unsigned)(isa * 31 + dt * 7 + causal)};
    const int64_t qs[4] = {1, H, L, E}, ks[4] = {1, H, S, E}, os[4] = {1, H, L, E},
                  ms[2] = {L, S}, ls[3] = {1, H, L};
    void *qd = malloc(H * L * E * es), *kd = malloc(H * S * E * es), *vd = malloc(H * S * E * es);
    void *md = malloc(L * S * es), *whole = malloc(H * L * E * es), *whole_lse = malloc(H * L * es);
    void *chunk_out = malloc(MAX_PARTS * H * L * E * es), *merged = malloc(H * L * E * es);
    double lse_h[MAX_PARTS][H * L], lse_m[H * L];
    fill(qd, dt, H * L * E, &r);
    fill(kd, dt, H * S * E, &r);
    fill(vd, dt, H * S * E, &r);
    fill(md, dt, L * S, &r);
    attn_tensor q = view(qd, dt, 4, qs), k = view(kd, dt, 4, ks), v = view(vd, dt, 4, ks);
    attn_tensor mask = view(md, dt, 2, ms), out = view(whole, dt, 4, os);
    attn_tensor lse = view(whole_lse, dt, 3, ls);
    attn_sdpa_params prm;
    attn_sdpa_params_init(&prm);
    prm.causal = causal;
    prm.dropout_p = 0.25;
    prm.seed = 1234;
    prm.rng_offset = 5;
    prm.attn_mask = float_mask ? &mask : NULL;

    CHECK_OK(attn_set_isa(isa));
    CHECK_OK(attn_sdpa(&q, &k, &v, &prm, &out, NULL, &lse));
    attn__problem whole_p, half;
    CHECK_OK(attn__problem_from_sdpa(&whole_p, &q, &k, &v, &prm, &out, NULL, &lse));
    /* the slices are the whole call's own key chunks (the split is by shape) */
    attn__flash_split split;
    CHECK_OK(attn__flash_balance(&whole_p, attn__ukernel_for(isa), 1, &split));
    const int parts = (int)split.chunks;
    CHECK(parts >= 2 && parts <= MAX_PARTS && split.chunk * parts == S,
          "%s: the call splits S = %d into %d chunks of %lld", attn_isa_name(isa), S, parts,
          (long long)split.chunk);
    if (parts < 2 || parts > MAX_PARTS || split.chunk * parts != S) goto done;
    for (int c = 0; c < parts; c++) {
        attn__problem_key_slice(&whole_p, c * split.chunk, split.chunk, &half);
        attn__operand_dense(&half, &half.out, (char *)chunk_out + c * H * L * E * es, dt, E);
        attn__operand_dense(&half, &half.lse, lse_h[c], ATTN_DTYPE_F64, 1);
        half.has_lse = true;
        CHECK_OK(attn__sdpa_execute(&half));
    }
    const attn__operand merged_op = row_operand(merged, dt);
    for (int64_t row = 0; row < H * L; row++) {
        if (dt == ATTN_DTYPE_F32)
            attn__lse_merge_f(parts, (float *)chunk_out + row * E, H * L * E, &lse_h[0][row],
                              H * L, E, &merged_op, row * E, &lse_m[row]);
        else
            attn__lse_merge_d(parts, (double *)chunk_out + row * E, H * L * E, &lse_h[0][row],
                              H * L, E, &merged_op, row * E, &lse_m[row]);
    }
    CHECK(memcmp(merged, whole, H * L * E * es) == 0,
          "%s %s causal=%d mask=%d: chunks merged differ from the whole call",
          attn_isa_name(isa), attn_dtype_name(dt), (int)causal, (int)float_mask);
    int lse_same = 1;
    for (int64_t row = 0; row < H * L; row++) {
        const double want = dt == ATTN_DTYPE_F32 ? ((float *)whole_lse)[row] : ((double *)whole_lse)[row];
        const double got = dt == ATTN_DTYPE_F32 ? (double)(float)lse_m[row] : lse_m[row];
        lse_same &= memcmp(&got, &want, sizeof got) == 0;
    }
    CHECK(lse_same, "%s %s: merged lse differs from the whole call's", attn_isa_name(isa),
          attn_dtype_name(dt));

    /* Not vacuous: the dropout mask changed the result, and a half with its
     * offset forgotten (as if it were keys 0..S/2-1) draws another mask. */
    prm.dropout_p = 0;
    void *plain = malloc(H * L * E * es);
    attn_tensor out0 = view(plain, dt, 4, os);
    CHECK_OK(attn_sdpa(&q, &k, &v, &prm, &out0, NULL, NULL));
    CHECK(memcmp(plain, whole, H * L * E * es) != 0, "dropout left the output unchanged");
    attn__problem_key_slice(&whole_p, split.chunk, split.chunk, &half);
    half.k_pos0 = 0;
    attn__operand_dense(&half, &half.out, merged, dt, E);
    attn__operand_dense(&half, &half.lse, lse_m, ATTN_DTYPE_F64, 1);
    CHECK_OK(attn__sdpa_execute(&half));
    CHECK(memcmp(merged, (char *)chunk_out + H * L * E * es, H * L * E * es) != 0,
          "the key offset does not reach the dropout mask");
    free(plain);
done:
    free(qd), free(kd), free(vd), free(md), free(whole), free(whole_lse), free(chunk_out), free(merged);
}

static void test_dropout_chunks_merge_bitwise(void) {
    for (size_t i = 0; i < sizeof FUSED / sizeof FUSED[0]; i++) {
        if (!attn_isa_supported(FUSED[i])) continue;
        for (int f64 = 0; f64 < 2; f64++) {
            const attn_dtype dt = f64 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
            chunks_case(FUSED[i], dt, ATTN_CAUSAL_NONE, false);
            chunks_case(FUSED[i], dt, ATTN_CAUSAL_BOTTOM_RIGHT, true);
            chunks_case(FUSED[i], dt, ATTN_CAUSAL_TOP_LEFT, false); /* later chunks see nothing */
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- lse_merge's own rules ---- */

static void test_lse_merge_rules(void) {
    const float outs[3][2] = {{1, 2}, {INFINITY, NAN}, {3, 4}};
    double lse_parts[3] = {0.5, -INFINITY, 0.5}, lse;
    float out[2];
    const attn__operand op = row_operand(out, ATTN_DTYPE_F32);
    bool finite = attn__lse_merge_f(3, &outs[0][0], 2, lse_parts, 1, 2, &op, 0, &lse);
    CHECK(finite && out[0] == 2 && out[1] == 3, "merge of equal parts: %g %g", out[0], out[1]);
    CHECK(fabs(lse - (0.5 + log(2.0))) < 1e-15, "merged lse %.17g", lse);
    lse_parts[0] = lse_parts[2] = -INFINITY;
    finite = attn__lse_merge_f(3, &outs[0][0], 2, lse_parts, 1, 2, &op, 0, &lse);
    CHECK(finite && out[0] == 0 && out[1] == 0 && lse == -INFINITY, "no keys: %g %g %g", out[0],
          out[1], lse);
    lse_parts[1] = NAN;
    finite = attn__lse_merge_f(3, &outs[0][0], 2, lse_parts, 1, 2, &op, 0, &lse);
    CHECK(!finite && isnan(out[0]) && isnan(out[1]) && isnan(lse), "a NaN lse poisons the row");
    /* A part whose weight underflows to 0 contributes nothing, even Inf. */
    lse_parts[0] = 0;
    lse_parts[1] = -2000;
    finite = attn__lse_merge_f(2, &outs[0][0], 2, lse_parts, 1, 2, &op, 0, &lse);
    CHECK(finite && out[0] == 1 && out[1] == 2, "a zero-weight part leaked: %g %g", out[0], out[1]);

    /* A 16-bit output takes the float64 sum rounded once. Parts 2 + 2^-7 and
     * 2^-29 of equal weight mix to 1 + 2^-8 + 2^-30: just above the tie
     * between bfloat16's 1 and 1 + 2^-7, so it rounds up; through float32
     * (1 + 2^-8, the tie itself) it would round to even, down to 1. */
    const float pair[2] = {2.0f + 0x1p-7f, 0x1p-29f};
    double even[2] = {0, 0};
    uint16_t b16 = 0;
    const attn__operand bop = row_operand(&b16, ATTN_DTYPE_BF16);
    finite = attn__lse_merge_f(2, pair, 1, even, 1, 1, &bop, 0, &lse);
    CHECK(finite && b16 == 0x3f81, "bfloat16 merge: bits %04x, expected 3f81 (1 + 2^-7)", b16);
    CHECK(attn__float_to_bf16((float)(1.0 + 0x1p-8 + 0x1p-30)) == 0x3f80,
          "the case does not separate rounding once from rounding twice");

    /* Parts of equal lse ~ -3.4e38 (rows masked with finfo(float32).min):
     * max + log(2) rounds back to max, and weights exp(lse_c - lse) were 1
     * each, the sum of the parts instead of their mean. The same in the
     * public two-part merge. */
    const double far = -3.4028234663852886e38, pair_lse[2] = {far, far};
    const float halves[2] = {1, 3};
    float mixed = 0;
    const attn__operand mop = row_operand(&mixed, ATTN_DTYPE_F32);
    finite = attn__lse_merge_f(2, halves, 1, pair_lse, 1, 1, &mop, 0, &lse);
    CHECK(finite && mixed == 2 && lse == far, "merge at lse %g: %g, expected 2", far, mixed);
    float acc_out = 1, part_out = 3;
    double acc_lse = far, part_lse = far;
    attn_tensor ao = view(&acc_out, ATTN_DTYPE_F32, 2, (int64_t[]){1, 1});
    attn_tensor al = view(&acc_lse, ATTN_DTYPE_F64, 1, (int64_t[]){1});
    attn_tensor po = view(&part_out, ATTN_DTYPE_F32, 2, (int64_t[]){1, 1});
    attn_tensor pl = view(&part_lse, ATTN_DTYPE_F64, 1, (int64_t[]){1});
    CHECK_OK(attn_sdpa_merge(&ao, &al, &po, &pl));
    CHECK(acc_out == 2, "attn_sdpa_merge at lse %g: %g, expected 2", far, acc_out);
}

/* ---- a KV cache filled to a length per sequence ---- */

enum { N = 2, CH = 2, CL = 4, CS = 300, CE = 32 };

static void cache_case(attn_isa isa) {
    rng r = {harness_seed() + 77};
    static float q[N * CH * CL * CE], k[N * CH * CS * CE], v[N * CH * CS * CE];
    static float out[N * CH * CL * CE], one[CH * CL * CE];
    const int64_t lens[N] = {CS, 123};
    fill(q, ATTN_DTYPE_F32, N * CH * CL * CE, &r);
    fill(k, ATTN_DTYPE_F32, N * CH * CS * CE, &r);
    fill(v, ATTN_DTYPE_F32, N * CH * CS * CE, &r);
    for (int n = 0; n < N; n++) /* past the filled length: poison that must not leak */
        for (int h = 0; h < CH; h++)
            for (int64_t j = lens[n]; j < CS; j++)
                for (int e = 0; e < CE; e++) {
                    k[((n * CH + h) * CS + j) * CE + e] = NAN;
                    v[((n * CH + h) * CS + j) * CE + e] = INFINITY;
                }
    const int64_t qs[4] = {N, CH, CL, CE}, ks[4] = {N, CH, CS, CE};
    attn_tensor tq = view(q, ATTN_DTYPE_F32, 4, qs), tk = view(k, ATTN_DTYPE_F32, 4, ks),
                tv = view(v, ATTN_DTYPE_F32, 4, ks), to = view(out, ATTN_DTYPE_F32, 4, qs);
    attn_sdpa_params prm;
    attn_sdpa_params_init(&prm);
    prm.causal = ATTN_CAUSAL_BOTTOM_RIGHT; /* aligned to each cache's own length */
    CHECK_OK(attn_set_isa(isa));
    attn__problem p;
    CHECK_OK(attn__problem_from_sdpa(&p, &tq, &tk, &tv, &prm, &to, NULL, NULL));
    p.k.seq_len = p.v.seq_len = lens;
    CHECK_OK(attn__sdpa_execute(&p));
    for (int n = 0; n < N; n++) { /* each sequence alone, its cache cut to its length */
        const int64_t q1[3] = {CH, CL, CE}, k1[3] = {CH, lens[n], CE};
        attn_tensor sq = view(q + n * CH * CL * CE, ATTN_DTYPE_F32, 3, q1);
        attn_tensor sk = view(k + n * CH * CS * CE, ATTN_DTYPE_F32, 3, k1);
        attn_tensor sv = view(v + n * CH * CS * CE, ATTN_DTYPE_F32, 3, k1);
        sk.strides[0] = sv.strides[0] = CS * CE;
        attn_tensor so = view(one, ATTN_DTYPE_F32, 3, q1);
        CHECK_OK(attn_sdpa(&sq, &sk, &sv, &prm, &so, NULL, NULL));
        CHECK(memcmp(one, out + n * CH * CL * CE, sizeof one) == 0,
              "%s: sequence %d of the cache differs from its own call", attn_isa_name(isa), n);
    }
}

/* ---- packed variable-length sequences (cu_seqlens), read in place ---- */

enum { PH = 2, PE = 16, TQ = 3 + 5, TK = 7 + 4 };

static void packed_case(attn_isa isa) {
    rng r = {harness_seed() + 99};
    static double q[TQ * PH * PE], k[TK * PH * PE], v[TK * PH * PE];
    static double out[(TQ + 1) * PH * PE], one[PH * 5 * PE];
    const int64_t q_start[2] = {0, 3}, q_len[2] = {3, 5}, k_start[2] = {0, 7}, k_len[2] = {7, 4};
    fill(q, ATTN_DTYPE_F64, TQ * PH * PE, &r);
    fill(k, ATTN_DTYPE_F64, TK * PH * PE, &r);
    fill(v, ATTN_DTYPE_F64, TK * PH * PE, &r);
    for (int i = 0; i < (TQ + 1) * PH * PE; i++) out[i] = NAN; /* the last row: a canary */
    /* Padded views (N, H, max len, E) give the problem its shape; the packed
     * layout comes from the operands' starts and lengths. */
    const int64_t qs[4] = {2, PH, 5, PE}, ks[4] = {2, PH, 7, PE};
    attn_tensor tq = view(q, ATTN_DTYPE_F64, 4, qs), tk = view(k, ATTN_DTYPE_F64, 4, ks),
                tv = view(v, ATTN_DTYPE_F64, 4, ks);
    static double scratch_out[2 * PH * 5 * PE];
    attn_tensor to = view(scratch_out, ATTN_DTYPE_F64, 4, qs);
    attn_tensor *packed[3] = {&tq, &tk, &tv};
    for (int i = 0; i < 3; i++) { /* (N, H, T, E) over a (total, H, E) buffer */
        packed[i]->strides[0] = 0;
        packed[i]->strides[1] = PE;
        packed[i]->strides[2] = PH * PE;
    }
    attn_sdpa_params prm;
    attn_sdpa_params_init(&prm);
    prm.causal = ATTN_CAUSAL_BOTTOM_RIGHT;
    CHECK_OK(attn_set_isa(isa));
    attn__problem p;
    CHECK_OK(attn__problem_from_sdpa(&p, &tq, &tk, &tv, &prm, &to, NULL, NULL));
    p.q.seq_start = q_start, p.q.seq_len = q_len;
    p.k.seq_start = p.v.seq_start = k_start, p.k.seq_len = p.v.seq_len = k_len;
    p.out = p.q; /* the same packed layout, over out's buffer */
    p.out.data = out;
    CHECK_OK(attn__sdpa_execute(&p));
    for (int n = 0; n < 2; n++) {
        const int64_t q1[3] = {PH, q_len[n], PE}, k1[3] = {PH, k_len[n], PE};
        attn_tensor sq = view(q + q_start[n] * PH * PE, ATTN_DTYPE_F64, 3, q1);
        attn_tensor sk = view(k + k_start[n] * PH * PE, ATTN_DTYPE_F64, 3, k1);
        attn_tensor sv = view(v + k_start[n] * PH * PE, ATTN_DTYPE_F64, 3, k1);
        for (attn_tensor *t = &sq; t; t = t == &sq ? &sk : t == &sk ? &sv : NULL) {
            t->strides[0] = PE;
            t->strides[1] = PH * PE;
        }
        attn_tensor so = view(one, ATTN_DTYPE_F64, 3, q1);
        CHECK_OK(attn_sdpa(&sq, &sk, &sv, &prm, &so, NULL, NULL));
        bool same = true;
        for (int h = 0; h < PH; h++)
            for (int64_t i = 0; i < q_len[n]; i++)
                same &= memcmp(&one[(h * q_len[n] + i) * PE],
                               &out[((q_start[n] + i) * PH + h) * PE], PE * sizeof(double)) == 0;
        CHECK(same, "%s: packed sequence %d differs from its own call", attn_isa_name(isa), n);
    }
    bool canary = true;
    for (int i = TQ * PH * PE; i < (TQ + 1) * PH * PE; i++) canary &= isnan(out[i]);
    CHECK(canary, "%s: a write past the packed rows", attn_isa_name(isa));
}

static void test_ragged_batches(void) {
    for (size_t i = 0; i < sizeof ALL / sizeof ALL[0]; i++) {
        if (!attn_isa_supported(ALL[i])) continue;
        cache_case(ALL[i]);
        packed_case(ALL[i]);
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* ---- a binding's names in messages ---- */

static void test_binding_names_in_messages(void) {
    float qd[2 * 8] = {0}, kd[3 * 7] = {0}, od[2 * 7];
    const int64_t qs[2] = {2, 8}, ks[2] = {3, 7}, os[2] = {2, 7};
    attn_tensor q = view(qd, ATTN_DTYPE_F32, 2, qs), k = view(kd, ATTN_DTYPE_F32, 2, ks);
    attn_tensor out = view(od, ATTN_DTYPE_F32, 2, os);
    static const char *const names[6] = {"query", "key", "value", "output", NULL, NULL};
    attn_sdpa_params prm;
    attn_sdpa_params_init(&prm);
    CHECK_STATUS(attn_sdpa(&q, &k, &k, &prm, &out, NULL, NULL), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "k") == 0 && strstr(attn_last_error(), "k.shape[-1]"),
          "C names: %s / %s", attn_last_error_arg(), attn_last_error());
    prm.arg_names = names;
    CHECK_STATUS(attn_sdpa(&q, &k, &k, &prm, &out, NULL, NULL), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "key") == 0 &&
              strstr(attn_last_error(), "key.shape[-1] is 7 but query.shape[-1] is 8"),
          "binding names: %s / %s", attn_last_error_arg(), attn_last_error());
    CHECK_STATUS(attn_sdpa(&q, &q, &q, &prm, NULL, NULL, NULL), ATTN_ERR_NULL);
    CHECK(strcmp(attn_last_error_arg(), "output") == 0, "out named: %s", attn_last_error_arg());
}


/* ---- public slices (attn_sdpa_params' q_offset ...) and attn_sdpa_merge ---- */

/* Query rows [q0, q0 + n) of a dense (1, SH, rows, width) tensor. */
static attn_tensor rows_of(void *data, attn_dtype dt, int64_t rows, int64_t width, int64_t q0,
                           int64_t n) {
    enum { SH = 2 };
    attn_tensor t = view(data, dt, 4, (int64_t[]){1, SH, rows, width});
    t.data = (char *)data + (size_t)(q0 * width) * attn_dtype_size(dt);
    t.shape[2] = n;
    return t;
}

enum { SH = 2, SL = 37, SS = 53, SE = 16, SEV = 8 };

/* The whole call against a 2 x 3 grid of slices merged in float64: out and
 * lse within float32 rounding; then the backward over key slices (global
 * out and lse) summed against the whole backward. */
static void slices_case(attn_isa isa, attn_causal causal, double dropout_p) {
    const attn_dtype dt = ATTN_DTYPE_F32;
    rng r = {harness_seed() ^ (unsigned)(isa * 131 + causal * 17 + (int)(dropout_p * 8))};
    float *q = malloc(sizeof(float) * SH * SL * SE), *k = malloc(sizeof(float) * SH * SS * SE);
    float *v = malloc(sizeof(float) * SH * SS * SEV), *out = malloc(sizeof(float) * SH * SL * SEV);
    float *dout = malloc(sizeof(float) * SH * SL * SEV), *part = malloc(sizeof(float) * SH * SL * SEV);
    double *lse = malloc(sizeof(double) * SH * SL), *plse = malloc(sizeof(double) * SH * SL);
    double *acc = malloc(sizeof(double) * SH * SL * SEV), *alse = malloc(sizeof(double) * SH * SL);
    fill(q, dt, SH * SL * SE, &r);
    fill(k, dt, SH * SS * SE, &r);
    fill(v, dt, SH * SS * SEV, &r);
    fill(dout, dt, SH * SL * SEV, &r);
    attn_sdpa_params prm;
    attn_sdpa_params_init(&prm);
    prm.causal = causal;
    prm.dropout_p = dropout_p;
    prm.seed = 99;
    prm.rng_offset = 3;
    prm.lse_for_backward = 1;
    CHECK_OK(attn_set_isa(isa));
    attn_tensor tq = rows_of(q, dt, SL, SE, 0, SL), tk = rows_of(k, dt, SS, SE, 0, SS);
    attn_tensor tv = rows_of(v, dt, SS, SEV, 0, SS), to = rows_of(out, dt, SL, SEV, 0, SL);
    attn_tensor tl = view(lse, ATTN_DTYPE_F64, 3, (int64_t[]){1, SH, SL});
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &prm, &to, NULL, &tl));

    const int64_t qcut[3] = {0, 15, SL}, kcut[4] = {0, 20, 41, SS};
    for (int64_t x = 0; x < SH * SL; x++) alse[x] = -INFINITY;
    for (int a = 0; a < 2; a++) {
        const int64_t q0 = qcut[a], nq = qcut[a + 1] - q0;
        for (int b = 0; b < 3; b++) {
            const int64_t k0 = kcut[b], nk = kcut[b + 1] - k0;
            attn_sdpa_params sp = prm;
            sp.q_offset = q0, sp.q_total = SL, sp.k_offset = k0, sp.k_total = SS;
            attn_tensor sq = rows_of(q, dt, SL, SE, q0, nq), sk = rows_of(k, dt, SS, SE, k0, nk);
            attn_tensor sv = rows_of(v, dt, SS, SEV, k0, nk);
            attn_tensor po = view(part, dt, 4, (int64_t[]){1, SH, nq, SEV});
            attn_tensor pl = view(plse, ATTN_DTYPE_F64, 3, (int64_t[]){1, SH, nq});
            CHECK_OK(attn_sdpa(&sq, &sk, &sv, &sp, &po, NULL, &pl));
            attn_tensor ao = rows_of(acc, ATTN_DTYPE_F64, SL, SEV, q0, nq);
            attn_tensor al = view(alse + q0, ATTN_DTYPE_F64, 3, (int64_t[]){1, SH, nq});
            al.strides[1] = SL;
            CHECK_OK(attn_sdpa_merge(&ao, &al, &po, &pl));
        }
    }
    double worst = 0, worst_lse = 0;
    for (int64_t x = 0; x < SH * SL * SEV; x++) {
        const double d = fabs(acc[x] - out[x]) / (1 + fabs(out[x]));
        worst = d > worst ? d : worst;
    }
    for (int64_t x = 0; x < SH * SL; x++)
        if (!(isinf(lse[x]) && lse[x] == alse[x]))
            worst_lse = fmax(worst_lse, fabs(alse[x] - lse[x]) / (1 + fabs(lse[x])));
    CHECK(worst < 4e-6 && worst_lse < 4e-6, "%s causal %d p %g: slices merged differ by %g (lse %g)",
          attn_isa_name(isa), (int)causal, dropout_p, worst, worst_lse);

    /* Backward: key slices with the whole out and lse sum to the whole dq and
     * give the whole dk, dv rows. */
    float *dq = calloc(SH * SL * SE, sizeof(float)), *dk = calloc(SH * SS * SE, sizeof(float));
    float *dv = calloc(SH * SS * SEV, sizeof(float)), *sdq = calloc(SH * SL * SE, sizeof(float));
    float *sdk = calloc(SH * SS * SE, sizeof(float)), *sdv = calloc(SH * SS * SEV, sizeof(float));
    double *dq_sum = calloc(SH * SL * SE, sizeof(double));
    attn_tensor tdo = rows_of(dout, dt, SL, SEV, 0, SL), tdq = rows_of(dq, dt, SL, SE, 0, SL);
    attn_tensor tdk = rows_of(dk, dt, SS, SE, 0, SS), tdv = rows_of(dv, dt, SS, SEV, 0, SS);
    CHECK_OK(attn_sdpa_backward(&tdo, &tq, &tk, &tv, &to, &tl, &prm, &tdq, &tdk, &tdv, NULL));
    double worst_dq = 0, worst_dkv = 0;
    for (int b = 0; b < 3; b++) {
        const int64_t k0 = kcut[b], nk = kcut[b + 1] - k0;
        attn_sdpa_params sp = prm;
        sp.k_offset = k0, sp.k_total = SS;
        attn_tensor sk = rows_of(k, dt, SS, SE, k0, nk), sv = rows_of(v, dt, SS, SEV, k0, nk);
        attn_tensor gq = rows_of(sdq, dt, SL, SE, 0, SL);
        attn_tensor gk = rows_of(sdk, dt, SS, SE, k0, nk), gv = rows_of(sdv, dt, SS, SEV, k0, nk);
        CHECK_OK(attn_sdpa_backward(&tdo, &tq, &sk, &sv, &to, &tl, &sp, &gq, &gk, &gv, NULL));
        for (int64_t x = 0; x < SH * SL * SE; x++) dq_sum[x] += sdq[x];
    }
    for (int64_t x = 0; x < SH * SL * SE; x++)
        worst_dq = fmax(worst_dq, fabs(dq_sum[x] - dq[x]) / (1 + fabs(dq[x])));
    for (int64_t x = 0; x < SH * SS * SE; x++)
        worst_dkv = fmax(worst_dkv, fabs(sdk[x] - dk[x]) / (1 + fabs(dk[x])));
    for (int64_t x = 0; x < SH * SS * SEV; x++)
        worst_dkv = fmax(worst_dkv, fabs(sdv[x] - dv[x]) / (1 + fabs(dv[x])));
    CHECK(worst_dq < 2e-5 && worst_dkv < 2e-5,
          "%s causal %d p %g: backward over key slices differs: dq %g, dk/dv %g",
          attn_isa_name(isa), (int)causal, dropout_p, worst_dq, worst_dkv);
    free(q), free(k), free(v), free(out), free(dout), free(part), free(lse), free(plse);
    free(acc), free(alse), free(dq), free(dk), free(dv), free(sdq), free(sdk), free(sdv);
    free(dq_sum);
}

static void test_public_slices_merge_to_the_whole(void) {
    const attn_causal causals[3] = {ATTN_CAUSAL_NONE, ATTN_CAUSAL_TOP_LEFT,
                                    ATTN_CAUSAL_BOTTOM_RIGHT};
    for (size_t i = 0; i < sizeof ALL / sizeof ALL[0]; i++) {
        if (!attn_isa_supported(ALL[i])) continue;
        for (int c = 0; c < 3; c++) {
            slices_case(ALL[i], causals[c], 0.0);
            slices_case(ALL[i], causals[c], 0.3);
        }
    }
    attn_set_isa(ATTN_ISA_AUTO);
}

/* Slice fields out of range, and merge operands that do not fit. */
static void test_slice_and_merge_errors(void) {
    float q[2 * 4] = {0}, k[3 * 4] = {0}, v[3 * 4] = {0}, o[2 * 4] = {0};
    double l[2] = {0}, po[2 * 4] = {0}, pl[3] = {0};
    attn_tensor tq = view(q, ATTN_DTYPE_F32, 2, (int64_t[]){2, 4});
    attn_tensor tk = view(k, ATTN_DTYPE_F32, 2, (int64_t[]){3, 4});
    attn_tensor tv = view(v, ATTN_DTYPE_F32, 2, (int64_t[]){3, 4});
    attn_tensor to = view(o, ATTN_DTYPE_F32, 2, (int64_t[]){2, 4});
    attn_sdpa_params p;
    const struct { int64_t qo, ko, qt, kt; const char *arg; } bad[] = {
        {-1, 0, 4, 0, "params.q_offset"}, {0, -2, 0, 5, "params.k_offset"},
        {3, 0, 4, 0, "params.q_total"},   {0, 1, 0, 3, "params.k_total"},
        {1, 0, 0, 0, "params.q_total"},   {0, 0, 0, -1, "params.k_total"},
        /* offsets near 2^63: the message's slice end once overflowed (UBSan) */
        {0, INT64_MAX, 0, 0, "params.k_total"}, {INT64_MAX - 1, 0, 0, 0, "params.q_total"},
        {0, INT64_MAX - 1, 0, INT64_MAX, "params.k_total"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        attn_sdpa_params_init(&p);
        p.q_offset = bad[i].qo, p.k_offset = bad[i].ko, p.q_total = bad[i].qt, p.k_total = bad[i].kt;
        CHECK_STATUS(attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL), ATTN_ERR_INVALID);
        CHECK(strcmp(attn_last_error_arg(), bad[i].arg) == 0, "case %zu names %s, not %s", i,
              attn_last_error_arg(), bad[i].arg);
    }
    attn_sdpa_params_init(&p);
    p.q_offset = 2, p.q_total = 4, p.k_offset = 1, p.k_total = 4; /* exactly fits */
    CHECK_OK(attn_sdpa(&tq, &tk, &tv, &p, &to, NULL, NULL));

    attn_tensor tl = view(l, ATTN_DTYPE_F64, 1, (int64_t[]){2});
    attn_tensor tpo = view(po, ATTN_DTYPE_F64, 2, (int64_t[]){2, 4});
    attn_tensor tpl = view(pl, ATTN_DTYPE_F64, 1, (int64_t[]){3}); /* one row too many */
    CHECK_STATUS(attn_sdpa_merge(&to, &tl, &tpo, &tpl), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "part_lse") == 0, "names %s", attn_last_error_arg());
    tpl.shape[0] = 2;
    CHECK_STATUS(attn_sdpa_merge(&to, &tl, &to, &tpl), ATTN_ERR_OVERLAP);
    attn_tensor tb = tq;
    tb.dtype = ATTN_DTYPE_BOOL;
    CHECK_STATUS(attn_sdpa_merge(&to, &tl, &tb, &tpl), ATTN_ERR_DTYPE);
    CHECK_STATUS(attn_sdpa_merge(NULL, &tl, &tpo, &tpl), ATTN_ERR_NULL);
    /* lse = -inf so far: the part is taken as it is, NaN in the old out ignored */
    for (int i = 0; i < 8; i++) o[i] = NAN, po[i] = i;
    l[0] = l[1] = -INFINITY;
    pl[0] = 0.5, pl[1] = -INFINITY;
    CHECK_OK(attn_sdpa_merge(&to, &tl, &tpo, &tpl));
    CHECK(o[0] == 0 && o[3] == 3 && l[0] == 0.5, "first part: out %g %g lse %g", o[0], o[3], l[0]);
    CHECK(o[4] == 0 && isinf(l[1]) && l[1] < 0, "no keys: out %g lse %g", o[4], l[1]);
}

HARNESS_MAIN(T(test_dropout_chunks_merge_bitwise), T(test_lse_merge_rules),
             T(test_public_slices_merge_to_the_whole), T(test_slice_and_merge_errors),
             T(test_ragged_batches), T(test_binding_names_in_messages))
