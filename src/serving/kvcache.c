/*
 * kvcache.c — attn_sdpa_kvcache: decoding and chunked prefill against a KV
 * cache (FlashAttention's flash_attn_with_kvcache), contiguous or paged.
 *
 * Order of work: every argument is checked (shapes, dtypes, index values,
 * capacity, block ids, overlaps) and every buffer allocated before the
 * first write into the cache, so a refused call leaves the cache as it
 * was. Then the new rows are appended (rounded to the cache's dtype), and
 * q attends to the filled rows of each sequence as one problem with batch
 * dimensions (B, Hq): k and v have seq_len = cache_seqlens + Lnew and, when
 * paged, rows located through a copy of the block table.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../sdpa/sdpa.h"
#include "serving.h"

/* The caller's arguments, their names in messages, and what they say. */
typedef struct kv_args {
    const attn_tensor *q, *k, *v, *seqlens, *table;
    attn_tensor *k_cache, *v_cache, *out, *lse;
    const char *qn, *kn, *vn, *outn, *lsen;
    bool paged;   /* block_table given: caches are (num_blocks, block_size, Hkv, E) */
    bool writing; /* new rows k, v given */
    int64_t B, Lq, Hq, Hkv, Lnew;
    int64_t rows_per_block; /* block_size, or S_max when contiguous */
    int64_t capacity;       /* rows a sequence can hold */
} kv_args;

/* A dtype error naming what the argument should have been. */
static attn_status wrong_dtype(const char *name, attn_dtype got, const char *expected) {
    return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s is %s; expected %s", name,
                          attn_dtype_name(got), expected);
}

/* q (B, Lq, Hq, E), any float dtype; the kernels compute in float64 for a
 * float64 query, in float32 otherwise. */
static attn_status check_query(attn__problem *p, kv_args *a) {
    attn_status st = attn__check_tensor(a->q, a->qn, 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (a->q->rank != 4)
        return attn__fail_arg(ATTN_ERR_SHAPE, a->qn, "%s has rank %d; expected 4: (B, Lq, Hq, E)",
                              a->qn, a->q->rank);
    if (!attn__is_floating(a->q->dtype))
        return wrong_dtype(a->qn, a->q->dtype, "float32, float64, float16 or bfloat16");
    p->dtype = attn__compute_dtype(a->q->dtype);
    a->B = a->q->shape[0];
    a->Lq = a->q->shape[1];
    a->Hq = a->q->shape[2];
    p->E = a->q->shape[3];
    return ATTN_OK;
}

/* k_cache (B, S_max, Hkv, E) or, paged, (num_blocks, block_size, Hkv, E);
 * v_cache the same with Ev. One dtype: q's, or a 16-bit storage dtype. */
static attn_status check_caches(attn__problem *p, kv_args *a) {
    const attn__role role = a->writing ? ATTN__OUTPUT : ATTN__INPUT;
    attn_status st;
    if ((st = attn__check_tensor(a->k_cache, "k_cache", 1, role)) != ATTN_OK ||
        (st = attn__check_tensor(a->v_cache, "v_cache", 1, role)) != ATTN_OK)
        return st;
    const attn_tensor *kc = a->k_cache, *vc = a->v_cache;
    const char *layout = a->paged ? "(num_blocks, block_size, Hkv, E)" : "(B, S_max, Hkv, E)";
    if (kc->rank != 4 || vc->rank != 4)
        return attn__fail_arg(ATTN_ERR_SHAPE, kc->rank != 4 ? "k_cache" : "v_cache",
                              "%s has rank %d; expected 4: %s", kc->rank != 4 ? "k_cache" : "v_cache",
                              kc->rank != 4 ? kc->rank : vc->rank, layout);
    if (kc->dtype != a->q->dtype && !attn__is_half(kc->dtype)) {
        char want[96];
        snprintf(want, sizeof want, "%s like the query, float16 or bfloat16",
                 attn_dtype_name(a->q->dtype));
        return wrong_dtype("k_cache", kc->dtype, want);
    }
    if (vc->dtype != kc->dtype)
        return attn__fail_arg(ATTN_ERR_DTYPE, "v_cache", "v_cache is %s but k_cache is %s; the "
                              "caches must share one dtype",
                              attn_dtype_name(vc->dtype), attn_dtype_name(kc->dtype));
    if (!a->paged && kc->shape[0] != a->B)
        return attn__fail_arg(ATTN_ERR_SHAPE, "k_cache",
                              "k_cache.shape[0] is %lld but %s has %lld sequences: a contiguous "
                              "cache is %s (pass block_table for a paged one)",
                              (long long)kc->shape[0], a->qn, (long long)a->B, layout);
    if (kc->shape[3] != p->E)
        return attn__fail_arg(ATTN_ERR_SHAPE, "k_cache",
                              "k_cache.shape[3] is %lld but %s.shape[3] is %lld: queries and "
                              "keys must have the same feature size E",
                              (long long)kc->shape[3], a->qn, (long long)p->E);
    for (int d = 0; d < 3; d++)
        if (vc->shape[d] != kc->shape[d])
            return attn__fail_arg(ATTN_ERR_SHAPE, "v_cache",
                                  "v_cache.shape[%d] is %lld but k_cache.shape[%d] is %lld: both "
                                  "caches are %s",
                                  d, (long long)vc->shape[d], d, (long long)kc->shape[d], layout);
    a->Hkv = kc->shape[2];
    if (a->Hq % a->Hkv != 0)
        return attn__fail_arg(ATTN_ERR_SHAPE, "k_cache",
                              "%s has %lld heads and k_cache %lld; the query heads must be a "
                              "multiple of the key/value heads (GQA)",
                              a->qn, (long long)a->Hq, (long long)a->Hkv);
    a->rows_per_block = kc->shape[1];
    p->Ev = vc->shape[3];
    return ATTN_OK;
}

/* The new rows k (B, Lnew, Hkv, E) and v (B, Lnew, Hkv, Ev) in q's dtype:
 * both or neither, and only with cache_seqlens (where to write them). */
static attn_status check_new_rows(const attn__problem *p, kv_args *a) {
    if (a->k == NULL && a->v == NULL) return ATTN_OK;
    if (a->k == NULL || a->v == NULL) {
        const char *missing = a->k == NULL ? a->kn : a->vn;
        return attn__fail_arg(ATTN_ERR_NULL, missing,
                              "%s is NULL but %s is given: new rows come in pairs (both or "
                              "neither)",
                              missing, a->k == NULL ? a->vn : a->kn);
    }
    if (a->seqlens == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, "cache_seqlens",
                              "cache_seqlens is NULL but new rows %s and %s are given: it says "
                              "where in the cache to write them",
                              a->kn, a->vn);
    attn_status st = attn__check_tensor(a->k, a->kn, 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (a->k->rank != 4)
        return attn__fail_arg(ATTN_ERR_SHAPE, a->kn, "%s has rank %d; expected 4: (B, Lnew, Hkv, E)",
                              a->kn, a->k->rank);
    a->Lnew = a->k->shape[1];
    const int64_t kshape[4] = {a->B, a->Lnew, a->Hkv, p->E};
    const int64_t vshape[4] = {a->B, a->Lnew, a->Hkv, p->Ev};
    if ((st = attn__check_shape(a->k, a->kn, ATTN__INPUT, 4, kshape, "(B, Lnew, Hkv, E)")) != ATTN_OK ||
        (st = attn__check_shape(a->v, a->vn, ATTN__INPUT, 4, vshape, "(B, Lnew, Hkv, Ev)")) != ATTN_OK)
        return st;
    const attn_dtype qd = a->q->dtype;
    if (a->k->dtype != qd || a->v->dtype != qd)
        return attn__fail_arg(ATTN_ERR_DTYPE, a->k->dtype != qd ? a->kn : a->vn,
                              "%s is %s; expected %s like the query (the cache's dtype is where "
                              "they are rounded to)",
                              a->k->dtype != qd ? a->kn : a->vn,
                              attn_dtype_name(a->k->dtype != qd ? a->k->dtype : a->v->dtype),
                              attn_dtype_name(qd));
    a->writing = true;
    return ATTN_OK;
}

/* cache_seqlens (B,), block_table (B, max_blocks); each sequence's capacity. */
static attn_status check_indices(kv_args *a) {
    attn_status st;
    if (a->seqlens != NULL) {
        const int64_t shape[1] = {a->B};
        char want[96];
        snprintf(want, sizeof want, "(%lld,): one length per sequence of the query", (long long)a->B);
        if ((st = attn__check_index(a->seqlens, "cache_seqlens", 1, shape, want)) != ATTN_OK)
            return st;
    }
    a->capacity = a->rows_per_block;
    if (a->paged) {
        char want[96];
        snprintf(want, sizeof want, "(%lld, max_blocks): one row of block ids per sequence",
                 (long long)a->B);
        if ((st = attn__check_index(a->table, "block_table", 2, NULL, want)) != ATTN_OK) return st;
        if (a->table->shape[0] != a->B)
            return attn__fail_arg(ATTN_ERR_SHAPE, "block_table",
                                  "block_table.shape[0] is %lld; expected %lld, one row of block "
                                  "ids per sequence",
                                  (long long)a->table->shape[0], (long long)a->B);
        if (attn__mul_overflows(a->table->shape[1], a->rows_per_block, &a->capacity))
            return attn__fail_arg(ATTN_ERR_OVERFLOW, "block_table",
                                  "max_blocks x block_size overflows 64 bits");
    }
    return ATTN_OK;
}

/* out (B, Lq, Hq, Ev) in q's dtype, lse (B, Hq, Lq) in q's or float64; what
 * the call writes overlaps nothing it reads (the caches only while written). */
static attn_status check_outputs(const attn__problem *p, const kv_args *a,
                                 const attn_sdpa_params *params) {
    const int64_t oshape[4] = {a->B, a->Lq, a->Hq, p->Ev}, lshape[3] = {a->B, a->Hq, a->Lq};
    attn_status st;
    if ((st = attn__check_shape(a->out, a->outn, ATTN__OUTPUT, 4, oshape, "(B, Lq, Hq, Ev)")) != ATTN_OK)
        return st;
    if (a->out->dtype != a->q->dtype)
        return attn__fail_arg(ATTN_ERR_DTYPE, a->outn, "%s is %s; expected %s like the query",
                              a->outn, attn_dtype_name(a->out->dtype), attn_dtype_name(a->q->dtype));
    if (a->lse != NULL) {
        if ((st = attn__check_shape(a->lse, a->lsen, ATTN__OUTPUT, 3, lshape, "(B, Hq, Lq)")) != ATTN_OK ||
            (st = attn__check_lse_dtype(a->lse, a->lsen, p->dtype)) != ATTN_OK)
            return st;
    }
    /* Written caches come first, so that an output over a cache is named
     * as the output either way. */
    const attn__named_view caches[2] = {{a->k_cache, "k_cache"}, {a->v_cache, "v_cache"}};
    attn__named_view writes[4], reads[9] = {{a->q, a->qn},
                                            {a->k, a->kn},
                                            {a->v, a->vn},
                                            {a->seqlens, "cache_seqlens"},
                                            {a->table, "block_table"},
                                            {params->alibi_slopes, "params.alibi_slopes"},
                                            {params->sinks, "params.sinks"}};
    int nw = 0, nr = 7;
    for (int c = 0; c < 2; c++) {
        if (a->writing)
            writes[nw++] = caches[c];
        else
            reads[nr++] = caches[c];
    }
    writes[nw++] = (attn__named_view){a->out, a->outn};
    writes[nw++] = (attn__named_view){a->lse, a->lsen};
    return attn__serving_overlaps(writes, nw, reads, nr);
}

/* Rows per sequence after the append (cache_seqlens + Lnew), checked
 * against the capacity; *longest gets the largest. NULL cache_seqlens: every
 * row is filled (len stays unused). */
static attn_status read_lengths(const kv_args *a, int64_t *len, int64_t *longest) {
    *longest = a->seqlens == NULL ? a->capacity : 0;
    for (int64_t b = 0; a->seqlens != NULL && b < a->B; b++) {
        const int64_t filled = attn__index1(a->seqlens, b);
        if (filled < 0)
            return attn__fail_arg(ATTN_ERR_INVALID, "cache_seqlens",
                                  "cache_seqlens[%lld] is %lld; expected >= 0", (long long)b,
                                  (long long)filled);
        if (filled > a->capacity - a->Lnew)
            return attn__fail_arg(ATTN_ERR_SHAPE, "cache_seqlens",
                                  "cache_seqlens[%lld] is %lld: with %lld new rows sequence %lld "
                                  "would hold %lld rows, past the cache's %lld (nothing was "
                                  "written)",
                                  (long long)b, (long long)filled, (long long)a->Lnew,
                                  (long long)b, (long long)(filled + a->Lnew),
                                  (long long)a->capacity);
        len[b] = filled + a->Lnew;
        if (len[b] > *longest) *longest = len[b];
    }
    return ATTN_OK;
}

/* The block ids of the rows in use, checked to be blocks of the cache and
 * copied into pages (B, nblk); entries past a sequence's rows stay 0 and
 * are never read. */
static attn_status read_table(const kv_args *a, const int64_t *len, int64_t nblk, int32_t *pages) {
    const int64_t num_blocks = a->k_cache->shape[0], bs = a->rows_per_block;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t rows = len != NULL ? len[b] : a->capacity;
        const int64_t used = rows / bs + (rows % bs != 0);
        for (int64_t t = 0; t < used; t++) {
            const int64_t id = attn__index2(a->table, b, t);
            if (id < 0 || id >= num_blocks)
                return attn__fail_arg(ATTN_ERR_INVALID, "block_table",
                                      "block_table[%lld, %lld] is %lld; expected a block of "
                                      "k_cache in [0, %lld) (sequence %lld uses rows %lld..%lld "
                                      "there)",
                                      (long long)b, (long long)t, (long long)id,
                                      (long long)num_blocks, (long long)b, (long long)(t * bs),
                                      (long long)((t + 1) * bs < rows ? (t + 1) * bs : rows) - 1);
            pages[b * nblk + t] = (int32_t)id;
        }
    }
    return ATTN_OK;
}

/* A row the call writes: its place in the paged cache (block * block_size
 * + row in block) and its sequence. */
typedef struct written_row {
    int64_t at, seq;
} written_row;

static int by_place(const void *x, const void *y) {
    const written_row *a = x, *b = y;
    return a->at < b->at ? -1 : a->at > b->at ? 1 : a->seq < b->seq ? -1 : a->seq > b->seq;
}

/* How many of the sorted rows w[0..n) lie in places [lo, hi). */
static int64_t count_between(const written_row *w, int64_t n, int64_t lo, int64_t hi) {
    int64_t a = 0, b = n; /* first place >= lo */
    while (a < b) {
        const int64_t m = a + (b - a) / 2;
        if (w[m].at < lo) a = m + 1; else b = m;
    }
    int64_t c = a, d = n; /* first place >= hi */
    while (c < d) {
        const int64_t m = c + (d - c) / 2;
        if (w[m].at < hi) c = m + 1; else d = m;
    }
    return c - a;
}

/* In a paged cache, each written row must belong to one sequence's block
 * entry alone: not written twice, and in no other entry's rows in use
 * (a block shared by two sequences, or listed twice by one). Otherwise the
 * rows a sequence reads would depend on another's append. `w` has room for
 * B x Lnew rows. */
static attn_status check_written_rows(const kv_args *a, const int64_t *len, const int32_t *pages,
                                      int64_t nblk, written_row *w) {
    const int64_t bs = a->rows_per_block;
    int64_t n = 0;
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t r = len[b] - a->Lnew; r < len[b]; r++)
            w[n++] = (written_row){pages[b * nblk + r / bs] * bs + r % bs, b};
    qsort(w, (size_t)n, sizeof *w, by_place);
    for (int64_t i = 1; i < n; i++)
        if (w[i].at == w[i - 1].at)
            return attn__fail_arg(ATTN_ERR_OVERLAP, "block_table",
                                  "block_table gives sequences %lld and %lld the same row %lld "
                                  "of block %lld to write a new row to: written rows must not be "
                                  "shared",
                                  (long long)w[i - 1].seq, (long long)w[i].seq,
                                  (long long)(w[i].at % bs), (long long)(w[i].at / bs));
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t first_new = len[b] - a->Lnew;
        for (int64_t t = 0; t * bs < len[b]; t++) {
            const int64_t lo = t * bs, hi = lo + bs < len[b] ? lo + bs : len[b];
            const int64_t own_lo = lo > first_new ? lo : first_new; /* its own new rows */
            const int64_t own = hi > own_lo ? hi - own_lo : 0;
            const int64_t base = (int64_t)pages[b * nblk + t] * bs;
            if (count_between(w, n, base, base + hi - lo) > own)
                return attn__fail_arg(ATTN_ERR_OVERLAP, "block_table",
                                      "block %lld (block_table[%lld, %lld]) holds rows sequence "
                                      "%lld uses, and another sequence's new row (or another "
                                      "entry of this one's) would be written there: written "
                                      "rows must not be shared",
                                      (long long)pages[b * nblk + t], (long long)b, (long long)t,
                                      (long long)b);
        }
    }
    return ATTN_OK;
}

/* Element offset of row r of sequence b, head h, in a cache. */
static int64_t cache_row(const kv_args *a, const attn_tensor *c, const int32_t *pages,
                         int64_t nblk, int64_t b, int64_t r, int64_t h) {
    const int64_t head = h * c->strides[2];
    if (!a->paged) return b * c->strides[0] + r * c->strides[1] + head;
    const int64_t bs = a->rows_per_block;
    return (int64_t)pages[b * nblk + r / bs] * c->strides[0] + (r % bs) * c->strides[1] + head;
}

/* Writes the new rows src (B, Lnew, Hkv, width) into the cache at rows
 * len[b] - Lnew .. len[b] - 1 of each sequence b, rounded to its dtype. */
static void append_rows(const kv_args *a, const attn_tensor *src, attn_tensor *cache,
                        const int64_t *len, const int32_t *pages, int64_t nblk) {
    const int64_t width = src->shape[3];
    const size_t es = attn_dtype_size(cache->dtype);
    /* Same dtype, unit column strides: a row is one memcpy. */
    const bool copy = src->dtype == cache->dtype && src->strides[3] == 1 && cache->strides[3] == 1;
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t r = 0; r < a->Lnew; r++)
            for (int64_t h = 0; h < a->Hkv; h++) {
                const int64_t from = b * src->strides[0] + r * src->strides[1] + h * src->strides[2];
                const int64_t to = cache_row(a, cache, pages, nblk, b, len[b] - a->Lnew + r, h);
                if (copy) {
                    memcpy((char *)cache->data + to * (int64_t)es,
                           (const char *)src->data + from * (int64_t)es, (size_t)width * es);
                    continue;
                }
                for (int64_t e = 0; e < width; e++)
                    attn__store(cache->data, cache->dtype, to + e * cache->strides[3],
                                attn__load(src->data, src->dtype, from + e * src->strides[3]));
            }
}

/* q or out (B, L, H, width): sequences along batch dim 0, heads along 1. */
static void row_operand(attn__operand *op, const attn_tensor *t) {
    memset(op, 0, sizeof *op);
    op->data = t->data;
    op->dtype = t->dtype;
    op->bstride[0] = attn__stride(t, 0);
    op->bstride[1] = attn__stride(t, 2);
    op->bdiv[0] = op->bdiv[1] = 1;
    op->rs = attn__stride(t, 1);
    op->cs = attn__stride(t, 3);
}

/* A cache as the problem's k or v: sequence b's filled rows (len[b], or all
 * when len is NULL), head h / (Hq / Hkv); paged rows through `pages`. */
static void cache_operand(attn__operand *op, const kv_args *a, const attn_tensor *c,
                          const int64_t *len, const int32_t *pages, int64_t nblk) {
    memset(op, 0, sizeof *op);
    op->data = c->data;
    op->dtype = c->dtype;
    op->bdiv[0] = 1;
    op->bstride[1] = attn__stride(c, 2);
    op->bdiv[1] = a->Hq / a->Hkv;
    op->rs = attn__stride(c, 1);
    op->cs = attn__stride(c, 3);
    op->seq_len = len;
    if (a->paged) {
        op->bstride[0] = 0; /* the table locates the sequence */
        op->pages = pages;
        op->pages_rs = nblk;
        op->page_rows = a->rows_per_block;
        op->page_stride = attn__stride(c, 0);
    } else {
        op->bstride[0] = attn__stride(c, 0);
    }
}

/* lse (B, Hq, Lq). */
static void lse_operand(attn__operand *op, const attn_tensor *t) {
    memset(op, 0, sizeof *op);
    op->data = t->data;
    op->dtype = t->dtype;
    op->bstride[0] = attn__stride(t, 0);
    op->bstride[1] = attn__stride(t, 1);
    op->bdiv[0] = op->bdiv[1] = 1;
    op->rs = attn__stride(t, 2);
}

/* Every check that needs no index value: tensors, outputs, params. */
static attn_status check_args(attn__problem *p, kv_args *a, const attn_sdpa_params *params) {
    attn_status st;
    if ((st = check_query(p, a)) != ATTN_OK || (st = check_caches(p, a)) != ATTN_OK ||
        (st = check_new_rows(p, a)) != ATTN_OK || (st = check_indices(a)) != ATTN_OK ||
        (st = check_outputs(p, a, params)) != ATTN_OK)
        return st;
    p->nb = 2;
    p->bshape[0] = a->B;
    p->bshape[1] = a->Hq;
    return attn__serving_scalars(p, params);
}

/* The index values (lengths, block ids, written rows) into len and pages
 * (allocated here; freed by the caller), and the problem's sizes. */
static attn_status read_indices(attn__problem *p, const kv_args *a, int64_t **len,
                                int32_t **pages, int64_t *nblk) {
    if (a->seqlens != NULL && (*len = attn__alloc_array((size_t)a->B, sizeof **len)) == NULL)
        return ATTN_ERR_NOMEM;
    int64_t longest = 0;
    attn_status st = read_lengths(a, *len, &longest);
    if (st != ATTN_OK) return st;
    p->L = a->Lq;
    p->S = longest > 0 ? longest : 1; /* a row that sees no key still has an output */
    if ((st = attn__serving_sizes(p, a->qn)) != ATTN_OK || !a->paged) return st;
    *nblk = longest / a->rows_per_block + (longest % a->rows_per_block != 0);
    if (*nblk == 0) *nblk = 1;
    if ((*pages = attn__alloc_array((size_t)(a->B * *nblk), sizeof **pages)) == NULL)
        return ATTN_ERR_NOMEM;
    if ((st = read_table(a, *len, *nblk, *pages)) != ATTN_OK || !a->writing) return st;
    written_row *w = attn__alloc_array((size_t)(a->B * a->Lnew), sizeof *w);
    if (w == NULL) return ATTN_ERR_NOMEM;
    st = check_written_rows(a, *len, *pages, *nblk, w);
    attn__free(w);
    return st;
}

attn_status attn_sdpa_kvcache(const attn_tensor *q, attn_tensor *k_cache, attn_tensor *v_cache,
                              const attn_tensor *k, const attn_tensor *v,
                              const attn_tensor *cache_seqlens, const attn_tensor *block_table,
                              const attn_sdpa_params *params, attn_tensor *out, attn_tensor *lse) {
    attn__clear_error();
    attn_sdpa_params prm;
    attn_status st = attn__serving_params(&prm, params, "attn_sdpa_kvcache", false);
    if (st != ATTN_OK) return st;
    kv_args a;
    memset(&a, 0, sizeof a);
    a.q = q;
    a.k = k;
    a.v = v;
    a.seqlens = cache_seqlens;
    a.table = block_table;
    a.k_cache = k_cache;
    a.v_cache = v_cache;
    a.out = out;
    a.lse = lse;
    a.qn = attn__serving_name(&prm, ATTN__Q);
    a.kn = attn__serving_name(&prm, ATTN__K);
    a.vn = attn__serving_name(&prm, ATTN__V);
    a.outn = attn__serving_name(&prm, ATTN__OUT);
    a.lsen = attn__serving_name(&prm, ATTN__LSE);
    a.paged = block_table != NULL;
    a.writing = k != NULL || v != NULL; /* check_new_rows refuses one without the other */
    attn__problem p;
    memset(&p, 0, sizeof p);
    if ((st = check_args(&p, &a, &prm)) != ATTN_OK) return st;

    int64_t *len = NULL; /* (B,) rows per sequence after the append */
    int32_t *pages = NULL; /* (B, nblk) the block ids in use */
    int64_t nblk = 0;
    st = read_indices(&p, &a, &len, &pages, &nblk);
    /* Cancelled before it starts: nothing is written. */
    if (st == ATTN_OK && attn__cancelled(p.cancel)) st = attn__fail_cancelled();
    if (st == ATTN_OK) {
        /* Everything is checked: from here on the cache is written. */
        if (a.writing) {
            append_rows(&a, k, k_cache, len, pages, nblk);
            append_rows(&a, v, v_cache, len, pages, nblk);
        }
        row_operand(&p.q, q);
        row_operand(&p.out, out);
        cache_operand(&p.k, &a, k_cache, len, pages, nblk);
        cache_operand(&p.v, &a, v_cache, len, pages, nblk);
        if (lse != NULL) {
            lse_operand(&p.lse, lse);
            p.has_lse = true;
            p.lse_exact = true;
        }
        st = attn__sdpa_execute(&p);
    }
    attn__free(len);
    attn__free(pages);
    return st;
}
