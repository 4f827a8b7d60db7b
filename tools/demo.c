/*
 * demo.c — `attn` with no arguments: the project's seed examples, computed by
 * the library.
 *   1. seed 004's worked example in both layouts: row vectors
 *      softmax(Q·Kᵀ/√d)·V and column vectors V·softmax(Kᵀ·Q/√d), the second
 *      read from column-major memory through strides, then shown transposed
 *      back as the seed does;
 *   2. seed 000's shapes: SDPA with n_Q != n_K = n_V and d_K != d_V, and
 *      self-attention MHA with 5 heads;
 *   3. why 200 features cannot make 6 heads (seed 001), and head_dim.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* ---- 1. seed 004 ---- */

enum { N_TOK = 4, P_IN = 4, D_K = 3 };

static const float X[N_TOK][P_IN] = {{1, 1, 1, 0}, {1, 2, 1, 0}, {0, 1, 0, 1}, {0, 1, 1, 0}};
static const float WQ[P_IN][D_K] = {{1, 0, 1}, {1, 1, 1}, {0, 0, 1}, {1, 0, 0}};
static const float WK[P_IN][D_K] = {{1, 0, 0}, {1, 1, 1}, {1, 0, 1}, {0, 1, 0}};
static const float WV[P_IN][D_K] = {{1, 2, 0}, {1, 3, 1}, {1, 0, 2}, {1, 1, 0}};

/* Row layout: M[n][d] = (X·W)[n][d]. */
static void project_rows(const float w[P_IN][D_K], float m[N_TOK][D_K]) {
    for (int n = 0; n < N_TOK; n++)
        for (int d = 0; d < D_K; d++) {
            m[n][d] = 0;
            for (int p = 0; p < P_IN; p++) m[n][d] += X[n][p] * w[p][d];
        }
}

/* Column layout: M[d][n] = (Wᵀ·Xᵀ)[d][n], one column per token. */
static void project_cols(const float w[P_IN][D_K], float m[D_K][N_TOK]) {
    for (int d = 0; d < D_K; d++)
        for (int n = 0; n < N_TOK; n++) {
            m[d][n] = 0;
            for (int p = 0; p < P_IN; p++) m[d][n] += w[p][d] * X[n][p];
        }
}

static void print_matrix(const char *indent, const float *m, int64_t rows, int64_t cols,
                         int64_t rs, int64_t cs) {
    for (int64_t i = 0; i < rows; i++) {
        printf("%s%s", indent, i == 0 ? "[[" : " [");
        for (int64_t j = 0; j < cols; j++)
            printf(j ? ", %.4f" : "%.4f", (double)m[i * rs + j * cs]);
        printf(i + 1 == rows ? "]]\n" : "],\n");
    }
}

static int seed_004(void) {
    attn_status st;
    /* Row vectors: tokens are rows, softmax over each row of Q·Kᵀ. */
    float Q[N_TOK][D_K], K[N_TOK][D_K], V[N_TOK][D_K], out[N_TOK][D_K];
    project_rows(WQ, Q);
    project_rows(WK, K);
    project_rows(WV, V);
    int64_t shape[2] = {N_TOK, D_K};
    attn_tensor q, k, v, o;
    attn_tensor_init(&q, Q, ATTN_DTYPE_F32, 2, shape);
    attn_tensor_init(&k, K, ATTN_DTYPE_F32, 2, shape);
    attn_tensor_init(&v, V, ATTN_DTYPE_F32, 2, shape);
    attn_tensor_init(&o, out, ATTN_DTYPE_F32, 2, shape);
    if ((st = attn_sdpa(&q, &k, &v, NULL, &o, NULL, NULL)) != ATTN_OK)
        return cli_fail("seed 004, row layout", st);

    /* Column vectors: tokens are columns, Q2 = Wqᵀ·Xᵀ is (d_k, n). The same
     * call reads Q2 as its transpose through strides; no copy is made. The
     * result R2 = V2·softmax(K2ᵀ·Q2/√d) is (d_v, n), written column-major. */
    float Q2[D_K][N_TOK], K2[D_K][N_TOK], V2[D_K][N_TOK], R2[D_K][N_TOK];
    project_cols(WQ, Q2);
    project_cols(WK, K2);
    project_cols(WV, V2);
    int64_t col_shape[2] = {D_K, N_TOK};
    attn_tensor q2, k2, v2, r2;
    attn_tensor_init(&q2, Q2, ATTN_DTYPE_F32, 2, col_shape);
    attn_tensor_init(&k2, K2, ATTN_DTYPE_F32, 2, col_shape);
    attn_tensor_init(&v2, V2, ATTN_DTYPE_F32, 2, col_shape);
    attn_tensor_init(&r2, R2, ATTN_DTYPE_F32, 2, col_shape);
    attn_tensor *views[4] = {&q2, &k2, &v2, &r2};
    for (int i = 0; i < 4; i++) attn_tensor_transpose(views[i], 0, 1);
    if ((st = attn_sdpa(&q2, &k2, &v2, NULL, &r2, NULL, NULL)) != ATTN_OK)
        return cli_fail("seed 004, column layout", st);

    double diff = 0;
    for (int n = 0; n < N_TOK; n++)
        for (int d = 0; d < D_K; d++) diff = fmax(diff, fabs((double)out[n][d] - R2[d][n]));

    printf("1. Seed 004's worked example: X (4x4) and Wq, Wk, Wv (4x3), so d_k = 3\n\n");
    printf("   row layout, softmax(Q·Kᵀ/√d_k)·V with Q = X·Wq:\n");
    print_matrix("   ", &out[0][0], N_TOK, D_K, D_K, 1);
    printf("\n   column layout, V2·softmax(K2ᵀ·Q2/√d_k) with Q2 = Wqᵀ·Xᵀ, shown transposed:\n");
    print_matrix("   ", &R2[0][0], N_TOK, D_K, 1, N_TOK); /* R2ᵀ */
    printf("\n   the layouts differ by at most %.1e: one call, two sets of strides\n\n", diff);
    return CLI_OK;
}

/* ---- 2. seed 000 ---- */

/* Fills a buffer with uniform [0, 1) numbers (like torch.rand), reproducibly. */
static void fill_rand(float *x, int64_t n, uint64_t *state) {
    for (int64_t i = 0; i < n; i++) {
        *state = *state * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((*state >> 40) * (1.0 / 16777216.0));
    }
}

static float *alloc_tensor(attn_tensor *t, int rank, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < rank; d++) n *= shape[d];
    float *data = calloc((size_t)n, sizeof(float));
    if (data) attn_tensor_init(t, data, ATTN_DTYPE_F32, rank, shape);
    return data;
}

static int seed_000_sdpa(uint64_t *rng) {
    int64_t qs[3] = {3, 30, 128}, ks[3] = {3, 50, 128}, vs[3] = {3, 50, 256},
            os[3] = {3, 30, 256}, ws[3] = {3, 30, 50};
    attn_tensor q, k, v, o, w;
    float *bufs[5] = {alloc_tensor(&q, 3, qs), alloc_tensor(&k, 3, ks), alloc_tensor(&v, 3, vs),
                      alloc_tensor(&o, 3, os), alloc_tensor(&w, 3, ws)};
    int rc = CLI_OK;
    if (!bufs[0] || !bufs[1] || !bufs[2] || !bufs[3] || !bufs[4]) {
        fprintf(stderr, "attn: demo: out of memory\n");
        rc = CLI_RUNTIME;
    } else {
        fill_rand(bufs[0], 3 * 30 * 128, rng);
        fill_rand(bufs[1], 3 * 50 * 128, rng);
        fill_rand(bufs[2], 3 * 50 * 256, rng);
        attn_status st = attn_sdpa(&q, &k, &v, NULL, &o, &w, NULL);
        if (st != ATTN_OK) {
            rc = cli_fail("seed 000, SDPA", st);
        } else {
            char a[64], b[64], c[64], d[64], e[64];
            printf("2. Seed 000's shapes (n_Q != n_K = n_V, d_K != d_V)\n\n");
            printf("   SDPA: Q%s K%s V%s => out%s attention%s\n", cli_shape(&q, a, 64),
                   cli_shape(&k, b, 64), cli_shape(&v, c, 64), cli_shape(&o, d, 64),
                   cli_shape(&w, e, 64));
            double row = 0;
            for (int j = 0; j < 50; j++) row += bufs[4][j];
            printf("   each attention row sums to 1 (row 0: %.6f)\n", row);
        }
    }
    for (int i = 0; i < 5; i++) free(bufs[i]);
    return rc;
}

/* Runs self-attention on src (n_batch, n_src, d_feat), batch first, and
 * prints the shapes; head_dim 0 means d_feat / n_head. */
static int run_mha(const char *label, int64_t head_dim, int64_t n_head, attn_tensor *src,
                   bool show_error) {
    const int64_t n_batch = src->shape[0], n_src = src->shape[1], d_feat = src->shape[2];
    attn_mha_config cfg;
    attn_mha_config_init(&cfg, d_feat, n_head);
    cfg.batch_first = 1;
    cfg.head_dim = head_dim;
    attn_mha *mha = NULL;
    attn_status st = attn_mha_create(&cfg, &mha);
    if (st != ATTN_OK) {
        if (!show_error) return cli_fail(label, st);
        printf("   %s\n   -> %s: %s\n", label, attn_strerror(st), attn_last_error());
        return CLI_OK;
    }
    attn_mha_get_config(mha, &cfg);
    int64_t os[3] = {n_batch, n_src, d_feat}, ws[4] = {n_batch, n_head, n_src, n_src};
    attn_tensor out, w;
    float *ob = alloc_tensor(&out, 3, os), *wb = alloc_tensor(&w, 4, ws);
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    fp.average_attn_weights = 0;
    int rc = CLI_OK;
    if (!ob || !wb) {
        fprintf(stderr, "attn: demo: out of memory\n");
        rc = CLI_RUNTIME;
    } else if ((st = attn_mha_forward(mha, src, src, src, &fp, &out, &w)) != ATTN_OK) {
        rc = cli_fail(label, st);
    } else {
        char a[64], b[64], c[64];
        printf("   %s\n   %lld heads x %lld features = %lld projected features:\n"
               "   src%s => out%s attention%s\n",
               label, (long long)n_head, (long long)cfg.head_dim,
               (long long)(n_head * cfg.head_dim), cli_shape(src, a, 64),
               cli_shape(&out, b, 64), cli_shape(&w, c, 64));
    }
    free(ob);
    free(wb);
    attn_mha_destroy(mha);
    return rc;
}

int cli_demo(void) {
    printf("attn %s demo: exact attention on the CPU (%s path, %d threads)\n\n", attn_version(),
           attn_isa_name(attn_get_isa()), attn_get_num_threads());
    int rc = seed_004();
    uint64_t rng = 0x5eed;
    if (rc == CLI_OK) rc = seed_000_sdpa(&rng);
    int64_t ss[3] = {128, 32, 200};
    attn_tensor src;
    float *sb = alloc_tensor(&src, 3, ss);
    if (sb == NULL) return CLI_RUNTIME;
    fill_rand(sb, 128 * 32 * 200, &rng);
    if (rc == CLI_OK) rc = run_mha("MHA self-attention, d_feat = 200, n_head = 5:", 0, 5, &src, false);
    if (rc == CLI_OK) {
        printf("\n3. 200 features and 6 heads (seed 001)\n\n");
        rc = run_mha("attn_mha_create(embed_dim = 200, num_heads = 6):", 0, 6, &src, true);
    }
    if (rc == CLI_OK) {
        printf("\n");
        rc = run_mha("with head_dim = 40 given explicitly (attn's extension):", 40, 6, &src,
                     false);
    }
    free(sb);
    return rc;
}
