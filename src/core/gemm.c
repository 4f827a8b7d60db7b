/* gemm.c — the one place libattn calls CBLAS (the projection GEMMs). */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE, setenv */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "internal.h"
#include "gemm.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* OpenBLAS's own entry points, when the linked CBLAS is OpenBLAS; absent
 * otherwise (a weak reference resolves to NULL). The dynamic_* pair exists
 * in DYNAMIC_ARCH builds (Debian's), which choose a kernel set at load. */
extern char *openblas_get_config(void) __attribute__((weak));
extern char *openblas_get_corename(void) __attribute__((weak));
extern void gotoblas_dynamic_init(void) __attribute__((weak));
extern void gotoblas_dynamic_quit(void) __attribute__((weak));

const char *attn_blas_info(void) {
    if (openblas_get_config == NULL || openblas_get_corename == NULL) return "CBLAS";
    /* Per thread, like the error messages: no locking, no race. */
    static _Thread_local char info[256];
    snprintf(info, sizeof info, "%s; core %s", openblas_get_config(), openblas_get_corename());
    return info;
}

/* ---- which OpenBLAS kernels run ---- */

/* A DYNAMIC_ARCH OpenBLAS picks its kernels from a table of CPU models at
 * load, so one older than the CPU falls back: 0.3.21 runs its SSE3
 * "Prescott" kernels on recent Intel models (3-4x slower) and its AVX2
 * "Haswell" kernels on AVX-512 Zen 5. When the user has not chosen
 * (OPENBLAS_CORETYPE unset) and the CPU and OS can run a better set, attn
 * asks OpenBLAS to choose again with that set forced — OpenBLAS's own
 * mechanism, run once while the library loads. */
/* 2 for OpenBLAS's AVX-512 kernel sets, 1 for its AVX2 ones, 0 otherwise. */
static int core_level(const char *core) {
    static const struct {
        const char *name;
        int level;
    } known[] = {{"Haswell", 1}, {"Zen", 1}, {"SkylakeX", 2}, {"Cooperlake", 2},
                 {"SapphireRapids", 2}};
    for (size_t i = 0; i < sizeof known / sizeof *known; i++)
        if (strcmp(core, known[i].name) == 0) return known[i].level;
    return 0;
}

const char *attn__blas_core_upgrade(const char *current, const attn__cpu_features *f) {
    if (current == NULL) return NULL;
    const int cpu = f->avx512_core ? 2 : f->avx2_fma ? 1 : 0;
    if (core_level(current) >= cpu) return NULL;
    return cpu == 2 ? "SkylakeX" : "Haswell";
}

bool attn__blas_switch_core(const char *core) {
    if (openblas_get_corename == NULL || gotoblas_dynamic_init == NULL ||
        gotoblas_dynamic_quit == NULL)
        return false;
    const char *user = getenv("OPENBLAS_CORETYPE");
    char saved[64] = "";
    if (user != NULL) snprintf(saved, sizeof saved, "%s", user);
    setenv("OPENBLAS_CORETYPE", core, 1);
    gotoblas_dynamic_quit();
    gotoblas_dynamic_init();
    if (user != NULL)
        setenv("OPENBLAS_CORETYPE", saved, 1);
    else
        unsetenv("OPENBLAS_CORETYPE");
    return true;
}

__attribute__((constructor)) static void choose_blas_core(void) {
    if (openblas_get_corename == NULL || getenv("OPENBLAS_CORETYPE") != NULL) return;
    const char *better = attn__blas_core_upgrade(openblas_get_corename(), attn__cpu());
    if (better != NULL) attn__blas_switch_core(better);
}

/* ---- tiles ---- */

/* Tiles of C, from its shape only. Rows come in blocks of 1/8 of m (a
 * multiple of 16 rows, 32 to 512), so up to 8 threads share a large
 * product evenly; when that leaves fewer than 8 row blocks (short m), the
 * columns are split too, into blocks of at least 256. Measured on the MHA
 * shapes of `make bench` (docs/design.md): 512-row tiles, one
 * single-threaded call each, ran as fast as one threaded OpenBLAS call. */
typedef struct gemm_tiles {
    int64_t rows, cols; /* tile size */
    int64_t nrow, ncol; /* tile counts */
} gemm_tiles;

enum { TILE_TARGET = 8, TILE_ROWS_MIN = 32, TILE_ROWS_MAX = 512, TILE_COLS_MIN = 256 };

static int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

static gemm_tiles plan_tiles(int64_t m, int64_t n, int64_t k) {
    gemm_tiles t = {m, n, 1, 1};
    if ((double)m * (double)n * (double)k < ATTN_PARALLEL_MIN_WORK) return t; /* one call */
    t.rows = round_up((m + TILE_TARGET - 1) / TILE_TARGET, 16);
    if (t.rows < TILE_ROWS_MIN) t.rows = TILE_ROWS_MIN;
    if (t.rows > TILE_ROWS_MAX) t.rows = TILE_ROWS_MAX;
    if (t.rows > m) t.rows = m;
    t.nrow = (m + t.rows - 1) / t.rows;
    if (t.nrow < TILE_TARGET) {
        int64_t want = (TILE_TARGET + t.nrow - 1) / t.nrow, most = n / TILE_COLS_MIN;
        int64_t ncol = want < most ? want : most;
        if (ncol > 1) {
            t.cols = round_up((n + ncol - 1) / ncol, 16);
            t.ncol = (n + t.cols - 1) / t.cols;
        }
    }
    return t;
}

/* OpenBLAS maps a 128 MiB buffer the first time a thread calls it, and
 * 0.3.21 retries that mapping forever when it fails (an address-space limit,
 * ulimit -v). A thread therefore first checks that the mapping would
 * succeed, once: a failure becomes ATTN_ERR_NOMEM instead of a hang. */
enum { OPENBLAS_BUFFER_BYTES = (128 << 20) + (8 << 20) };
static _Thread_local bool blas_buffer_mapped;

static bool blas_buffer_possible(void) {
    if (blas_buffer_mapped || openblas_get_config == NULL) return true;
    void *p = mmap(NULL, OPENBLAS_BUFFER_BYTES, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    munmap(p, OPENBLAS_BUFFER_BYTES);
    return true;
}

typedef struct gemm_call {
    attn_dtype dtype;      /* what the BLAS computes in: F32 or F64            */
    attn_dtype stored;     /* C's dtype: dtype, or F16/BF16 (see run_half)     */
    bool trans_a, trans_b; /* A stored k x m / B stored n x k */
    int64_t m, n, k, lda, ldb, ldc;
    const char *a, *b;
    char *c;
    const char *bias; /* n values, or NULL */
    double beta;      /* C = op(A)·op(B) + beta·C (with a bias: onto the bias) */
    const attn__gemm_bf16 *bf; /* bfloat16 products (run_bf16), else NULL   */
    const uint32_t *bp;        /* B packed for them: k/2 x ldbp pairs       */
    int64_t ldbp;
} gemm_call;

/* ---- 16-bit operands ----
 * float16 / bfloat16 A, B, bias and C compute as torch's CPU linear layers
 * do in those dtypes: the operands widened exactly to float32, products
 * summed in float32 by the same BLAS calls as a float32 GEMM, and each
 * element of C rounded once (to nearest even). */

static void widen_row(const uint16_t *src, attn_dtype dt, int64_t n, float *dst) {
    if (dt == ATTN_DTYPE_BF16)
        for (int64_t i = 0; i < n; i++) dst[i] = attn__bf16_to_float(src[i]);
    else
        for (int64_t i = 0; i < n; i++) dst[i] = attn__f16_to_float(src[i]);
}

static void narrow_row(const float *src, int64_t n, attn_dtype dt, uint16_t *dst) {
    if (dt == ATTN_DTYPE_BF16)
        for (int64_t i = 0; i < n; i++) dst[i] = attn__float_to_bf16(src[i]);
    else
        for (int64_t i = 0; i < n; i++) dst[i] = attn__float_to_f16(src[i]);
}

/* A float32 copy (rows x cols, row stride cols) of a 16-bit matrix with row
 * stride ld, on attn's threads (exact, so any split gives the same bits). */
static float *widen_matrix(const void *src, attn_dtype dt, int64_t rows, int64_t cols,
                           int64_t ld) {
    float *dst = attn__alloc_array((size_t)rows, (size_t)cols * sizeof(float));
    if (dst == NULL) return NULL;
    const int threads = (double)rows * (double)cols >= ATTN_PARALLEL_MIN_WORK ? attn__threads() : 1;
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        widen_row((const uint16_t *)src + r * ld, dt, cols, dst + r * cols);
    return dst;
}

/* Columns of C a bfloat16 tile call covers: B's pairs for them (k/2 x
 * lanes) within a quarter of L2, so that the row blocks after the first
 * read them from there (all 2,304 columns of BERT-base's in-projection at
 * once were 3.5 MiB, read from memory again for every 32 rows); a multiple
 * of 96 lanes, which the kernels' 32- and 48-lane groups divide. Each
 * element's sum is the same whatever the columns beside it, so the split
 * sets no bits. */
static int64_t bf16_panel(int64_t k) {
    const int64_t pair_row = (k + 1) / 2 * (int64_t)sizeof(uint32_t);
    const int64_t lanes = pair_row > 0 ? attn__l2_bytes() / 4 / pair_row : 0;
    return lanes < 96 ? 96 : lanes / 96 * 96;
}

enum { BF16_ROWS = 128 }; /* rows a tile call covers: A's block and C's stay in L2 */

/* src + bias (bias may be NULL) rounded to bfloat16: the portable form of
 * the context's round_bf16_f, for contexts without one. */
static void round_bf16_rows(const float *src, const float *bias, int64_t n, uint16_t *dst) {
    for (int64_t j = 0; j < n; j++)
        dst[j] = attn__float_to_bf16(bias != NULL ? src[j] + bias[j] : src[j]);
}

/* A tile in bfloat16 dot products, a panel of columns at a time (rows
 * inside, so the panel's B stays in cache): float32 sums into the scratch
 * (lanes rounded up to 16), the float32 bias added, each element rounded
 * once into C. Row blocks start at multiples of 16, where the kernels'
 * tile rows do. */
static attn_status bf16_tile(const gemm_call *g, int64_t r0, int64_t mr, int64_t c0, int64_t nc,
                             float *t) {
    const int64_t panel = bf16_panel(g->k);
    const float *bias = (const float *)g->bias;
    void (*round)(const float *, const float *, int64_t, uint16_t *) =
        g->bf->round != NULL ? g->bf->round : round_bf16_rows;
    for (int64_t p0 = c0; p0 < c0 + nc; p0 += panel) {
        const int64_t np = c0 + nc - p0 < panel ? c0 + nc - p0 : panel, ldt = round_up(np, 16);
        for (int64_t q0 = r0; q0 < r0 + mr; q0 += BF16_ROWS) {
            const int64_t nq = r0 + mr - q0 < BF16_ROWS ? r0 + mr - q0 : BF16_ROWS;
            g->bf->tile(g->bp + p0, g->ldbp, (const uint16_t *)g->a + q0 * g->lda, g->lda, g->k,
                        nq, ldt, t, ldt, NULL); /* t: nq x ldt */
            for (int64_t r = 0; r < nq; r++)
                round(t + r * ldt, bias != NULL ? bias + p0 : NULL, np,
                      (uint16_t *)g->c + (q0 + r) * g->ldc + p0);
        }
    }
    return ATTN_OK;
}

/* One tile: a single-threaded BLAS call on rows [r0, r0+mr), columns
 * [c0, c0+nc) of C. The caller's OpenMP thread count is 1 here, which is
 * what an OpenMP OpenBLAS reads as "do not start threads". A call in
 * bfloat16 products (g->bf) takes bf16_tile instead. */
static attn_status run_tile(const gemm_call *g, int64_t r0, int64_t mr, int64_t c0, int64_t nc,
                           float *scratch) {
    if (g->bf != NULL) return bf16_tile(g, r0, mr, c0, nc, scratch);
    if (!blas_buffer_possible()) return ATTN_ERR_NOMEM;
    const size_t es = attn_dtype_size(g->dtype), cs = attn_dtype_size(g->stored);
    const bool half = g->stored != g->dtype;
    /* Row r0 of op(A) is column r0 of a transposed A; column c0 of op(B) is
     * row c0 of a transposed B. */
    const void *a = g->a + (size_t)(g->trans_a ? r0 : r0 * g->lda) * es;
    const void *b = g->b + (size_t)(g->trans_b ? c0 * g->ldb : c0) * es;
    char *c = g->c + (size_t)(r0 * g->ldc + c0) * cs;
    /* What the BLAS writes: the tile of C, or for a 16-bit C a float32
     * scratch tile (mr x nc) rounded into C afterwards. */
    char *t = half ? (char *)scratch : c;
    const int64_t ldt = half ? nc : g->ldc;
    /* BLAS checks lda >= k and ldc >= n even for one row, whose stride is
     * never used (and may not even fit an int). */
    const bool one_row = mr == 1 && !g->trans_a;
    const int lda = (int)(one_row ? g->k : g->lda), ldc = (int)(mr == 1 ? nc : ldt);
    /* The bias is written into the tile, then the product accumulated onto
     * it: first touch of C happens here, in parallel and between cancel
     * checks, rather than in one long serial pass before the GEMM. */
    if (g->bias != NULL)
        for (int64_t r = 0; r < mr; r++)
            memcpy(t + (size_t)(r * ldt) * es, g->bias + (size_t)c0 * es, (size_t)nc * es);
    else if (half && g->beta != 0.0)
        for (int64_t r = 0; r < mr; r++)
            widen_row((const uint16_t *)(c + (size_t)(r * g->ldc) * cs), g->stored, nc,
                      (float *)t + r * ldt);
    const double beta = g->bias != NULL ? 1.0 : g->beta;
    const enum CBLAS_TRANSPOSE ta = g->trans_a ? CblasTrans : CblasNoTrans,
                               tb = g->trans_b ? CblasTrans : CblasNoTrans;
    if (g->dtype == ATTN_DTYPE_F32)
        cblas_sgemm(CblasRowMajor, ta, tb, (int)mr, (int)nc, (int)g->k, 1.0f, a, lda, b,
                    (int)g->ldb, (float)beta, (float *)t, ldc);
    else
        cblas_dgemm(CblasRowMajor, ta, tb, (int)mr, (int)nc, (int)g->k, 1.0, a, lda, b,
                    (int)g->ldb, beta, (double *)t, ldc);
    blas_buffer_mapped = true;
    if (half)
        for (int64_t r = 0; r < mr; r++)
            narrow_row((const float *)t + r * ldt, nc, g->stored,
                       (uint16_t *)(c + (size_t)(r * g->ldc) * cs));
    return ATTN_OK;
}

static attn_status run_tiles(const gemm_call *g, const volatile int *cancel);
static attn_status run_half(const gemm_call *g, const volatile int *cancel);

attn_status attn__gemm_abt(attn_dtype dtype, int64_t m, int64_t n, int64_t k, const void *a,
                           int64_t lda, const void *b, int64_t ldb, const void *bias, void *c,
                           int64_t ldc, const volatile int *cancel) {
    const gemm_call g = {dtype, dtype, false, true, m, n, k, lda, ldb, ldc, a, b, c, bias, 0.0,
                         NULL, NULL, 0};
    return attn__is_half(dtype) ? run_half(&g, cancel) : run_tiles(&g, cancel);
}

attn_status attn__gemm(attn_dtype dtype, bool trans_a, bool trans_b, int64_t m, int64_t n,
                       int64_t k, const void *a, int64_t lda, const void *b, int64_t ldb,
                       double beta, void *c, int64_t ldc, const volatile int *cancel) {
    const gemm_call g = {dtype, dtype, trans_a, trans_b, m, n, k, lda, ldb, ldc, a, b, c, NULL,
                         beta, NULL, NULL, 0};
    return attn__is_half(dtype) ? run_half(&g, cancel) : run_tiles(&g, cancel);
}

attn_status attn__gemm_abt_bf16(const attn__gemm_bf16 *kern, int64_t m, int64_t n, int64_t k,
                                const void *a, int64_t lda, const void *b, int64_t ldb,
                                const void *bias, void *c, int64_t ldc,
                                const volatile int *cancel) {
    if (kern == NULL || kern->tile == NULL || kern->pack == NULL)
        return attn__gemm_abt(ATTN_DTYPE_BF16, m, n, k, a, lda, b, ldb, bias, c, ldc, cancel);
    /* B's rows as pairs along k, for every column of C at once (ldbp lanes,
     * zero past n), packed in slices of rows on attn's threads */
    const int64_t ldbp = round_up(n, 16), pairs = (k + 1) / 2;
    uint32_t *bp = attn__alloc_array((size_t)pairs, (size_t)ldbp * sizeof(uint32_t));
    float *b32 = bp != NULL && bias != NULL ? widen_matrix(bias, ATTN_DTYPE_BF16, 1, n, n) : NULL;
    if (bp == NULL || (bias != NULL && b32 == NULL)) {
        attn__free(bp);
        return ATTN_ERR_NOMEM;
    }
    enum { SLICE = 256 };
    const int64_t slices = (n + SLICE - 1) / SLICE;
    const int threads = (double)n * (double)k >= ATTN_PARALLEL_MIN_WORK ? attn__threads() : 1;
    (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t s = 0; s < slices; s++) {
        const int64_t r0 = s * SLICE, nr = n - r0 < SLICE ? n - r0 : SLICE;
        kern->pack((const uint16_t *)b + r0 * ldb, ldb, 1, nr, k, bp + r0, ldbp);
    }
    const gemm_call g = {ATTN_DTYPE_F32, ATTN_DTYPE_BF16, false, true, m, n, k, lda, ldb, ldc,
                         a, b, c, (const char *)b32, 0.0, kern, bp, ldbp};
    attn_status st = run_tiles(&g, cancel);
    attn__free(b32);
    attn__free(bp);
    return st;
}

/* A 16-bit GEMM: A, B and the bias widened to float32 once (dense copies),
 * then float32 tiles as any other call, each rounded into C. */
static attn_status run_half(const gemm_call *g, const volatile int *cancel) {
    const attn_dtype dt = g->stored;
    gemm_call f = *g;
    f.dtype = ATTN_DTYPE_F32;
    /* stored shapes: A is m x k (k x m transposed), B is n x k (k x n) */
    const int64_t a_rows = g->trans_a ? g->k : g->m, a_cols = g->trans_a ? g->m : g->k;
    const int64_t b_rows = g->trans_b ? g->n : g->k, b_cols = g->trans_b ? g->k : g->n;
    float *a = widen_matrix(g->a, dt, a_rows, a_cols, g->lda);
    float *b = a != NULL ? widen_matrix(g->b, dt, b_rows, b_cols, g->ldb) : NULL;
    float *bias = b != NULL && g->bias != NULL ? widen_matrix(g->bias, dt, 1, g->n, g->n) : NULL;
    attn_status st = ATTN_ERR_NOMEM;
    if (b != NULL && (g->bias == NULL || bias != NULL)) {
        f.a = (const char *)a;
        f.b = (const char *)b;
        f.bias = (const char *)bias;
        f.lda = a_cols;
        f.ldb = b_cols;
        st = run_tiles(&f, cancel);
    }
    attn__free(bias);
    attn__free(b);
    attn__free(a);
    return st;
}

/* Every tile of C on attn's threads, one single-threaded BLAS call each. */
static attn_status run_tiles(const gemm_call *gp, const volatile int *cancel) {
    const gemm_call g = *gp;
    const int64_t m = g.m, n = g.n;
    const gemm_tiles t = plan_tiles(m, n, g.k);
    const int64_t ntiles = t.nrow * t.ncol;
    const int threads = ntiles > 1 ? attn__threads() : 1;
    /* a 16-bit C: one float32 tile per thread (rows x cols) */
    const bool half = g.stored != g.dtype;
    const int64_t tile_floats = t.rows * round_up(t.cols, 16);
    float *scratch = half ? attn__alloc_array((size_t)threads, (size_t)tile_floats * sizeof(float))
                          : NULL;
    if (half && scratch == NULL) return ATTN_ERR_NOMEM;
    int status = ATTN_OK; /* the first failure of any tile */
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *mine = scratch;
#ifdef _OPENMP
        if (half) mine += (size_t)omp_get_thread_num() * (size_t)tile_floats;
        const int saved = omp_get_max_threads();
        omp_set_num_threads(1); /* this thread's BLAS calls stay single-threaded */
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < ntiles; i++) {
            int seen;
#pragma omp atomic read
            seen = status;
            if (seen != ATTN_OK) continue;
            const int64_t r0 = i / t.ncol * t.rows, c0 = i % t.ncol * t.cols;
            const int64_t mr = m - r0 < t.rows ? m - r0 : t.rows;
            const int64_t nc = n - c0 < t.cols ? n - c0 : t.cols;
            attn_status st = attn__cancelled(cancel) ? ATTN_ERR_CANCELLED
                                                     : run_tile(&g, r0, mr, c0, nc, mine);
            if (st != ATTN_OK) {
#pragma omp atomic write
                status = (int)st;
            }
        }
#ifdef _OPENMP
        omp_set_num_threads(saved);
#endif
    }
    attn__free(scratch);
    if (status == ATTN_ERR_CANCELLED) return attn__fail_cancelled();
    if (status == ATTN_ERR_NOMEM)
        return attn__fail(ATTN_ERR_NOMEM,
                          "out of memory: the BLAS could not map its %d MiB work buffer for a "
                          "thread (address-space limit?)",
                          OPENBLAS_BUFFER_BYTES >> 20);
    return (attn_status)status;
}
