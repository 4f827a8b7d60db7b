/* testutil.c — see testutil.h. */
#define _XOPEN_SOURCE 700 /* nftw, strdup */
#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>

#include "testutil.h"

static int64_t numel(int rank, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < rank; d++) n *= shape[d];
    return n;
}

static void layout(test_tensor *x, rng *r, attn_dtype dtype, int rank, const int64_t *shape,
                   int kind, bool output) {
    attn_tensor *t = &x->t;
    memset(x, 0, sizeof *x);
    t->dtype = dtype;
    t->rank = rank;
    memcpy(t->shape, shape, sizeof(int64_t) * (size_t)rank);
    int order[ATTN_MAX_RANK];
    int64_t step[ATTN_MAX_RANK];
    bool reversed[ATTN_MAX_RANK], broadcast[ATTN_MAX_RANK];
    for (int d = 0; d < rank; d++) {
        order[d] = d;
        step[d] = 1;
        reversed[d] = broadcast[d] = false;
    }
    if (kind == LAYOUT_RANDOM) {
        for (int d = rank - 1; d > 0; d--) { /* Fisher-Yates */
            int j = (int)rng_int(r, 0, d), tmp = order[d];
            order[d] = order[j];
            order[j] = tmp;
        }
        for (int d = 0; d < rank; d++) {
            step[d] = rng_int(r, 0, 3) == 0 ? 2 : 1;
            reversed[d] = rng_int(r, 0, 4) == 0;
            broadcast[d] = !output && shape[d] > 1 && rng_int(r, 0, 9) == 0;
        }
    }
    /* Strides from the innermost (order[rank-1]) outwards. */
    int64_t span = 1;
    int64_t stride[ATTN_MAX_RANK];
    for (int i = rank - 1; i >= 0; i--) {
        int d = order[i];
        if (broadcast[d]) {
            stride[d] = 0;
            continue;
        }
        stride[d] = span * step[d];
        span = stride[d] * shape[d];
    }
    size_t es = attn_dtype_size(dtype);
    x->storage = calloc((size_t)span + 1, es);
    int64_t base = 0;
    for (int d = 0; d < rank; d++) {
        if (shape[d] == 1 && kind == LAYOUT_RANDOM && rng_int(r, 0, 2) == 0)
            stride[d] = rng_int(r, -5, 5); /* any stride is legal on a size-1 dim */
        if (reversed[d] && stride[d] > 0) {
            base += stride[d] * (shape[d] - 1);
            stride[d] = -stride[d];
        }
        t->strides[d] = stride[d];
    }
    t->data = (char *)x->storage + (size_t)base * es;
}

void tt_make(test_tensor *x, rng *r, attn_dtype dtype, int rank, const int64_t *shape,
             int kind, double amplitude, double p_true) {
    layout(x, r, dtype, rank, shape, kind, false);
    int64_t n = numel(rank, shape), idx[ATTN_MAX_RANK] = {0};
    for (int64_t i = 0; i < n; i++) {
        double v = dtype == ATTN_DTYPE_BOOL ? (rng_uniform(r) < p_true) : rng_normal(r) * amplitude;
        tt_set(&x->t, idx, v);
        for (int d = rank - 1; d >= 0; d--) {
            if (++idx[d] < shape[d]) break;
            idx[d] = 0;
        }
    }
}

void tt_make_output(test_tensor *x, rng *r, attn_dtype dtype, int rank, const int64_t *shape,
                    int kind) {
    layout(x, r, dtype, rank, shape, kind, true);
}

void tt_free(test_tensor *x) {
    free(x->storage);
    memset(x, 0, sizeof *x);
}

static int64_t offset_of(const attn_tensor *t, const int64_t *idx) {
    int64_t off = 0;
    for (int d = 0; d < t->rank; d++) off += idx[d] * t->strides[d];
    return off;
}

/* 16-bit floats from their definitions (not the library's bit tricks):
 * binary16 is (-1)^s · 2^(e-15) · 1.m (e = 0: 2^-14 · 0.m), bfloat16 is the
 * top half of a float32. Finite values only: tests never store others. */
double tt_half_value(uint16_t h, attn_dtype dtype) {
    if (dtype == ATTN_DTYPE_BF16) {
        const uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    const int e = (h >> 10) & 31, m = h & 1023;
    const double mag = e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
    return h >> 15 ? -mag : mag;
}

/* The 16-bit value nearest x (ties to even), by search over the bit
 * patterns of x's sign: slow and plain. */
uint16_t tt_half_bits(double x, attn_dtype dtype) {
    const uint16_t sign = signbit(x) ? 0x8000 : 0, top = dtype == ATTN_DTYPE_BF16 ? 0x7f7f : 0x7bff;
    uint16_t lo = 0, hi = top; /* magnitudes: the largest pattern whose value <= |x| */
    const double a = fabs(x);
    if (a >= tt_half_value(top, dtype)) return sign | top;
    while (lo < hi) {
        const uint16_t mid = (uint16_t)((lo + hi + 1) / 2);
        if (tt_half_value(mid, dtype) <= a) lo = mid;
        else hi = (uint16_t)(mid - 1);
    }
    const double below = tt_half_value(lo, dtype), above = tt_half_value((uint16_t)(lo + 1), dtype);
    const bool up = a - below > above - a || (a - below == above - a && (lo & 1));
    return sign | (uint16_t)(up ? lo + 1 : lo);
}

double tt_get(const attn_tensor *t, const int64_t *idx) {
    int64_t off = offset_of(t, idx);
    switch (t->dtype) {
    case ATTN_DTYPE_F32: return ((const float *)t->data)[off];
    case ATTN_DTYPE_F64: return ((const double *)t->data)[off];
    case ATTN_DTYPE_F16:
    case ATTN_DTYPE_BF16: return tt_half_value(((const uint16_t *)t->data)[off], t->dtype);
    default: return ((const unsigned char *)t->data)[off] ? 1.0 : 0.0;
    }
}

void tt_set(const attn_tensor *t, const int64_t *idx, double value) {
    int64_t off = offset_of(t, idx);
    switch (t->dtype) {
    case ATTN_DTYPE_F32: ((float *)t->data)[off] = (float)value; break;
    case ATTN_DTYPE_F64: ((double *)t->data)[off] = value; break;
    case ATTN_DTYPE_F16:
    case ATTN_DTYPE_BF16: ((uint16_t *)t->data)[off] = tt_half_bits(value, t->dtype); break;
    default: ((unsigned char *)t->data)[off] = value != 0.0; break;
    }
}

void tt_convert(const attn_tensor *src, attn_dtype dtype, test_tensor *dst) {
    layout(dst, NULL, dtype, src->rank, src->shape, LAYOUT_CONTIGUOUS, false);
    int64_t n = numel(src->rank, src->shape), idx[ATTN_MAX_RANK] = {0};
    for (int64_t i = 0; i < n; i++) {
        tt_set(&dst->t, idx, tt_get(src, idx));
        for (int d = src->rank - 1; d >= 0; d--) {
            if (++idx[d] < src->shape[d]) break;
            idx[d] = 0;
        }
    }
}

double *tt_dense(const attn_tensor *t) {
    int64_t n = numel(t->rank, t->shape), idx[ATTN_MAX_RANK] = {0};
    double *out = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        out[i] = tt_get(t, idx);
        for (int d = t->rank - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d]) break;
            idx[d] = 0;
        }
    }
    return out;
}

void tt_fill(const attn_tensor *t, double x) {
    int64_t idx[ATTN_MAX_RANK] = {0};
    const int64_t n = attn_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) {
        tt_set(t, idx, x);
        for (int d = t->rank - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d]) break;
            idx[d] = 0;
        }
    }
}

bool tt_same_bits(const attn_tensor *a, const attn_tensor *b) {
    double *x = tt_dense(a), *y = tt_dense(b);
    const int64_t n = attn_tensor_numel(a);
    const bool same = memcmp(x, y, sizeof(double) * (size_t)n) == 0;
    free(x);
    free(y);
    return same;
}

void tt_compare(const attn_tensor *a, const attn_tensor *b, double *diff, double *mag) {
    double *x = tt_dense(a), *y = tt_dense(b);
    const int64_t n = attn_tensor_numel(a);
    *diff = max_abs_diff(x, y, n);
    *mag = 0;
    for (int64_t i = 0; i < n; i++) *mag = fabs(y[i]) > *mag ? fabs(y[i]) : *mag;
    free(x);
    free(y);
}

/* ---- Philox-4x32-10, written from the paper's description ---- */

void oracle_philox(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t x[4] = {ctr[0], ctr[1], ctr[2], ctr[3]}, k[2] = {key[0], key[1]};
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k[0] += 0x9E3779B9u;
            k[1] += 0xBB67AE85u;
        }
        uint64_t a = (uint64_t)0xD2511F53u * x[0], b = (uint64_t)0xCD9E8D57u * x[2];
        uint32_t y[4] = {(uint32_t)(b >> 32) ^ x[1] ^ k[0], (uint32_t)b,
                         (uint32_t)(a >> 32) ^ x[3] ^ k[1], (uint32_t)a};
        memcpy(x, y, sizeof x);
    }
    memcpy(out, x, sizeof x);
}

static bool oracle_keep(uint64_t seed, uint64_t off, uint64_t index, double p) {
    uint64_t block = index / 4;
    uint32_t ctr[4] = {(uint32_t)block, (uint32_t)(block >> 32), (uint32_t)off,
                       (uint32_t)(off >> 32)};
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)}, w[4];
    oracle_philox(ctr, key, w);
    /* keep iff word / 2^32 >= p */
    return (double)w[index % 4] >= p * 4294967296.0;
}

/* ---- the oracle ---- */

/* Size of dim d (of a full rank `full`) of tensor t, right-aligned. */
static int64_t dim_of(const attn_tensor *t, int full, int d) {
    int td = d - (full - t->rank);
    return td < 0 ? 1 : t->shape[td];
}

/* Dense index of an element of t given the full broadcast index. */
static int64_t dense_index(const attn_tensor *t, int full, const int64_t *bidx, int64_t head_div,
                           int head_dim) {
    int64_t idx = 0;
    for (int d = 0; d < full; d++) {
        int64_t size = dim_of(t, full, d);
        int td = d - (full - t->rank);
        if (td < 0) continue;
        int64_t i = bidx[d];
        if (d == head_dim && head_div > 1) i /= head_div;
        if (size == 1) i = 0;
        idx = idx * size + i;
    }
    return idx;
}

int oracle_sdpa(const oracle_sdpa_args *a, oracle_sdpa_result *res) {
    memset(res, 0, sizeof *res);
    const attn_tensor *q = a->q, *k = a->k, *v = a->v;
    int full = q->rank;
    if (k->rank > full) full = k->rank;
    if (v->rank > full) full = v->rank;
    const int nb = full - 2;
    const int64_t L = q->shape[q->rank - 2], E = q->shape[q->rank - 1], S = k->shape[k->rank - 2],
                  Ev = v->shape[v->rank - 1];
    if (k->shape[k->rank - 1] != E || v->shape[v->rank - 2] != S) return -1;
    int64_t bshape[ATTN_MAX_RANK], kdiv = 1, vdiv = 1;
    for (int d = 0; d < nb; d++) {
        int64_t sq = dim_of(q, full, d), sk = dim_of(k, full, d), sv = dim_of(v, full, d);
        if (a->gqa && d == nb - 1) {
            if (sq % sk || sq % sv) return -1;
            kdiv = sq / sk;
            vdiv = sq / sv;
            bshape[d] = sq;
            continue;
        }
        int64_t m = sq > sk ? sq : sk;
        m = m > sv ? m : sv;
        if ((sq != 1 && sq != m) || (sk != 1 && sk != m) || (sv != 1 && sv != m)) return -1;
        bshape[d] = m;
    }
    if (a->mask) { /* broadcast check against (B..., L, S) */
        if (a->mask->rank > full) return -1;
        for (int d = 0; d < full; d++) {
            int64_t want = d < nb ? bshape[d] : d == nb ? L : S, got = dim_of(a->mask, full, d);
            if (got != 1 && got != want) return -1;
        }
    }
    int64_t nbatch = 1;
    for (int d = 0; d < nb; d++) nbatch *= bshape[d];
    res->rank = full;
    memcpy(res->shape, bshape, sizeof(int64_t) * (size_t)nb);
    res->shape[nb] = L;
    res->shape[nb + 1] = Ev;
    res->nbatch = nbatch;
    res->L = L;
    res->S = S;
    res->Ev = Ev;
    res->out = calloc((size_t)(nbatch * L * Ev), sizeof(double));
    res->weights = calloc((size_t)(nbatch * L * S), sizeof(double));
    res->lse = calloc((size_t)(nbatch * L), sizeof(double));
    double *Q = tt_dense(q), *K = tt_dense(k), *V = tt_dense(v);
    double *M = a->mask ? tt_dense(a->mask) : NULL;
    double *s = malloc(sizeof(double) * (size_t)S);
    bool *vis = malloc(sizeof(bool) * (size_t)S);
    const double scale = a->has_scale ? a->scale : 1.0 / sqrt((double)E);
    const oracle_modifiers *mo = a->mods;
    int64_t bidx[ATTN_MAX_RANK];
    for (int64_t b = 0; b < nbatch; b++) {
        int64_t rem = b;
        for (int d = nb - 1; d >= 0; d--) {
            bidx[d] = rem % bshape[d];
            rem /= bshape[d];
        }
        for (int64_t i = 0; i < L; i++) {
            bidx[nb] = i;
            double mx = -INFINITY;
            bool nan = false;
            for (int64_t j = 0; j < S; j++) {
                bidx[nb + 1] = j;
                vis[j] = true;
                double add = 0;
                if (a->causal == 1 && j > i) vis[j] = false;
                if (a->causal == 2 && j > i + (S - L)) vis[j] = false;
                if (mo && mo->window_left >= 0 && j < i + (S - L) - mo->window_left)
                    vis[j] = false;
                if (mo && mo->window_right >= 0 && j > i + (S - L) + mo->window_right)
                    vis[j] = false;
                if (M) {
                    double m = M[dense_index(a->mask, full, bidx, 1, -1)];
                    if (a->mask->dtype == ATTN_DTYPE_BOOL)
                        vis[j] = vis[j] && ((m != 0) == (a->mask_true_keeps != 0));
                    else if (m == -INFINITY)
                        vis[j] = false;
                    else
                        add = m;
                }
                if (!vis[j]) continue;
                /* q index: (B..., i, e); k index: (B..., j, e). */
                double dot = 0;
                for (int64_t e = 0; e < E; e++) {
                    bidx[nb] = i;
                    bidx[nb + 1] = e;
                    double qe = Q[dense_index(q, full, bidx, 1, -1)];
                    bidx[nb] = j;
                    double ke = K[dense_index(k, full, bidx, kdiv, nb - 1)];
                    dot += qe * ke;
                }
                bidx[nb] = i;
                double x = scale * dot;
                if (mo && mo->softcap > 0) x = mo->softcap * tanh(x / mo->softcap);
                if (mo && mo->alibi) x -= mo->alibi[b] * fabs((double)(i + (S - L) - j));
                s[j] = x + add;
                if (isnan(s[j])) nan = true;
                if (s[j] > mx) mx = s[j];
            }
            const double sink = mo && mo->sinks ? mo->sinks[b] : -INFINITY;
            if (isnan(sink)) nan = true;
            if (sink > mx) mx = sink;
            if (nan) mx = NAN;
            double sum = mx != -INFINITY && sink != -INFINITY ? exp(sink - mx) : 0;
            for (int64_t j = 0; j < S; j++)
                if (vis[j] && mx != -INFINITY) sum += exp(s[j] - mx);
            int64_t row = b * L + i;
            res->lse[row] = mx == -INFINITY ? -INFINITY : mx + log(sum);
            for (int64_t j = 0; j < S; j++) {
                double w = (vis[j] && mx != -INFINITY) ? exp(s[j] - mx) / sum : 0.0;
                if (a->dropout_p > 0)
                    w = oracle_keep(a->seed, a->rng_offset, (uint64_t)(row * S + j), a->dropout_p)
                            ? w / (1.0 - a->dropout_p)
                            : 0.0;
                res->weights[row * S + j] = w;
            }
            for (int64_t e = 0; e < Ev; e++) {
                double acc = 0;
                for (int64_t j = 0; j < S; j++) {
                    double w = res->weights[row * S + j];
                    if (w == 0) continue;
                    bidx[nb] = j;
                    bidx[nb + 1] = e;
                    acc += w * V[dense_index(v, full, bidx, vdiv, nb - 1)];
                }
                res->out[row * Ev + e] = acc;
            }
        }
    }
    free(Q);
    free(K);
    free(V);
    free(M);
    free(s);
    free(vis);
    return 0;
}

void oracle_free(oracle_sdpa_result *res) {
    free(res->out);
    free(res->weights);
    free(res->lse);
    memset(res, 0, sizeof *res);
}

double max_abs_diff(const double *a, const double *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        if (a[i] == b[i] || (isnan(a[i]) && isnan(b[i]))) continue;
        double d = fabs(a[i] - b[i]);
        if (isnan(d)) return INFINITY;
        if (d > m) m = d;
    }
    return m;
}

/* ---- files ---- */

static int compare_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int tt_list_dir(const char *dir, char *buf, size_t size) {
    DIR *d = opendir(dir);
    if (d == NULL) return -1;
    char *names[256];
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (n < 256) names[n] = strdup(e->d_name);
        n++;
    }
    closedir(d);
    const int kept = n < 256 ? n : 256;
    qsort(names, (size_t)kept, sizeof names[0], compare_names);
    size_t used = 0;
    buf[0] = '\0';
    for (int i = 0; i < kept; i++) {
        if (used < size)
            used += (size_t)snprintf(buf + used, size - used, i ? " %s" : "%s", names[i]);
        free(names[i]);
    }
    return n;
}

unsigned char *tt_read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    size_t cap = 4096, n = 0;
    unsigned char *buf = malloc(cap);
    for (size_t got; buf != NULL && (got = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += got;
        if (n == cap) {
            unsigned char *bigger = realloc(buf, cap *= 2);
            if (bigger == NULL) free(buf);
            buf = bigger;
        }
    }
    fclose(f);
    *size = n;
    return buf;
}

int tt_write_file(const char *path, const void *bytes, size_t size) {
    FILE *f = fopen(path, "wb");
    if (f == NULL) return -1;
    const bool ok = fwrite(bytes, 1, size, f) == size;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

void tt_remove_tree(const char *path) { nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* ---- a failing allocator ---- */

static void *failer_alloc(void *ctx, size_t size) {
    test_failer *f = ctx;
    const long n = ++f->allocs;
    if (f->fail_at > 0 && (n == f->fail_at || (f->persistent && n > f->fail_at))) {
        f->failed++;
        return NULL;
    }
    void *p = malloc(size);
    if (p) f->live++;
    return p;
}

static void failer_release(void *ctx, void *p) {
    ((test_failer *)ctx)->live--;
    free(p);
}

void failer_install(test_failer *f, long fail_at, bool persistent) {
    memset(f, 0, sizeof *f);
    f->fail_at = fail_at;
    f->persistent = persistent;
    const attn_allocator a = {failer_alloc, failer_release, f};
    attn_set_allocator(&a);
}
