/* fuzz_util.c — see fuzz_util.h. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include "fuzz_util.h"

#include <sys/mman.h>

void *fz_forbidden_page(void) {
    static void *page;
    if (page == NULL) {
        page = mmap(NULL, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (page == MAP_FAILED) abort();
    }
    return page;
}

void fz_layout(fz *f, fz_tensor *x, bool output) {
    attn_tensor *t = &x->t;
    const int rank = t->rank < 0 ? 0 : t->rank > ATTN_MAX_RANK ? ATTN_MAX_RANK : t->rank;
    int kind = fz_u8(f) % FZ_NLAYOUTS;
    int order[ATTN_MAX_RANK];
    int64_t step[ATTN_MAX_RANK];
    for (int d = 0; d < rank; d++) {
        order[d] = d;
        step[d] = 1;
    }
    if (kind == FZ_PERMUTED) {
        for (int d = rank - 1; d > 0; d--) { /* Fisher-Yates */
            int j = (int)fz_range(f, 0, d), tmp = order[d];
            order[d] = order[j];
            order[j] = tmp;
        }
        for (int d = 0; d < rank; d++) step[d] = fz_range(f, 1, 3);
    }
    /* Strides from the innermost dimension outwards; saturate on overflow
     * (the library must then reject or the span check refuses to back it). */
    int64_t span = 1;
    for (int i = rank - 1; i >= 0; i--) {
        int d = order[i];
        int64_t s;
        if (__builtin_mul_overflow(span, step[d], &s)) s = INT64_MAX;
        t->strides[d] = s;
        if (__builtin_mul_overflow(s, t->shape[d] > 0 ? t->shape[d] : 1, &span)) span = INT64_MAX;
    }
    for (int d = 0; d < rank; d++) {
        switch (kind) {
        case FZ_REVERSED:
            if (fz_bool(f)) t->strides[d] = -t->strides[d];
            break;
        case FZ_BROADCAST:
            if (fz_bool(f) && (!output || t->shape[d] == 1)) t->strides[d] = 0;
            break;
        case FZ_RAW:
            t->strides[d] = fz_one_in(f, 8) ? fz_wild(f) : fz_range(f, -4, 4);
            break;
        default: break;
        }
        /* Any stride is legal on a dimension of size 1. */
        if (t->shape[d] == 1 && fz_one_in(f, 4))
            t->strides[d] = fz_one_in(f, 4) ? fz_wild(f) : fz_range(f, -9, 9);
    }
}

/* binary16 bits of x: exact for the values fz_value draws (multiples of
 * 1/16 below 8 in magnitude), infinity past the format's range. */
static uint16_t f16_bits(double x) {
    const uint16_t sign = signbit(x) ? 0x8000 : 0;
    if (isnan(x)) return sign | 0x7e00;
    x = fabs(x);
    if (x > 65504) return sign | 0x7c00;
    int ex;
    const double fr = frexp(x, &ex); /* x = fr * 2^ex, fr in [0.5, 1) */
    if (x == 0 || ex - 1 + 15 <= 0) return sign; /* zero; nothing drawn is that small */
    return sign | (uint16_t)((ex - 1 + 15) << 10) | (uint16_t)((fr * 2 - 1) * 1024);
}

/* bfloat16 bits of x: the top half of the float (exact for drawn values). */
static uint16_t bf16_bits(double x) {
    const float v = (float)x;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (uint16_t)(u >> 16);
}

static double from_f16(uint16_t h) {
    const int e = h >> 10 & 0x1f, m = h & 0x3ff;
    const double mag = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY)
                                                        : ldexp(1024 + m, e - 25);
    return h & 0x8000 ? -mag : mag;
}

static double from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Stores one drawn value at element `off` of base. */
static void put(fz *f, attn_dtype dt, void *base, int64_t off, fz_values *vals, bool allow_wild) {
    if (dt == ATTN_DTYPE_BOOL) {
        uint8_t b = fz_u8(f);
        ((unsigned char *)base)[off] = b < 224 ? (b & 1) : b;
    } else if (dt == ATTN_DTYPE_F32) {
        ((float *)base)[off] = (float)fz_value(f, vals, allow_wild);
    } else if (dt == ATTN_DTYPE_F16) {
        ((uint16_t *)base)[off] = f16_bits(fz_value(f, vals, allow_wild));
    } else if (dt == ATTN_DTYPE_BF16) {
        ((uint16_t *)base)[off] = bf16_bits(fz_value(f, vals, allow_wild));
    } else if (dt == ATTN_DTYPE_I32) {
        ((int32_t *)base)[off] = (int32_t)fz_u8(f) - 8;
    } else { /* float64, and unknown codes backed as 8-byte elements */
        ((double *)base)[off] = fz_value(f, vals, allow_wild);
    }
}

void fz_back(fz *f, fz_tensor *x, int64_t limit, fz_values *vals, bool allow_wild) {
    attn_tensor *t = &x->t;
    x->alloc = NULL;
    x->backed = false;
    int64_t lo, hi;
    size_t es = attn_dtype_size(t->dtype);
    if (es == 0) es = 8; /* unknown dtype codes: back them as 8-byte elements */
    if (!fz_span(t->rank, t->shape, t->strides, limit, &lo, &hi)) {
        t->data = fz_forbidden_page();
        return;
    }
    x->lo = lo;
    x->count = hi - lo + 1;
    unsigned char *buf = malloc((size_t)x->count * es);
    if (buf == NULL) abort();
    x->alloc = buf;
    x->backed = true;
    t->data = buf - lo * (int64_t)es;
    int64_t n = 1;
    for (int d = 0; d < t->rank && n <= limit; d++)
        if (__builtin_mul_overflow(n, t->shape[d], &n)) n = INT64_MAX;
    if (n > limit) {
        /* Broadcast views can have far more elements than buffer slots:
         * draw the slots themselves. */
        for (int64_t i = 0; i < x->count; i++) put(f, t->dtype, buf, i, vals, allow_wild);
        return;
    }
    /* Gaps between the elements hold NaN (or 0xA5 bytes): never read. */
    for (int64_t i = 0; i < x->count; i++) {
        if (t->dtype == ATTN_DTYPE_F32)
            ((float *)buf)[i] = NAN;
        else if (t->dtype == ATTN_DTYPE_F64 || attn_dtype_size(t->dtype) == 0)
            ((double *)buf)[i] = NAN;
        else
            buf[i] = 0xA5;
    }
    int64_t idx[ATTN_MAX_RANK] = {0};
    for (int64_t i = 0; i < n; i++) {
        int64_t off = 0;
        for (int d = 0; d < t->rank; d++) off += idx[d] * t->strides[d];
        put(f, t->dtype, t->data, off, vals, allow_wild);
        for (int d = t->rank - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d]) break;
            idx[d] = 0;
        }
    }
}

void fz_sprinkle_neg_inf(fz *f, fz_tensor *m) {
    if (!m->backed) return;
    for (int64_t i = 0; i < m->count; i++) {
        if (!fz_one_in(f, 3)) continue;
        if (m->t.dtype == ATTN_DTYPE_F32)
            ((float *)m->alloc)[i] = -INFINITY;
        else if (m->t.dtype == ATTN_DTYPE_F64)
            ((double *)m->alloc)[i] = -INFINITY;
        else if (m->t.dtype == ATTN_DTYPE_F16)
            ((uint16_t *)m->alloc)[i] = 0xfc00;
        else if (m->t.dtype == ATTN_DTYPE_BF16)
            ((uint16_t *)m->alloc)[i] = 0xff80;
    }
}

void fz_tensor_free(fz_tensor *x) {
    free(x->alloc);
    memset(x, 0, sizeof *x);
}

void fz_tensor_make(fz *f, fz_tensor *x, attn_dtype dtype, int rank, const int64_t *shape,
                    bool output, int64_t limit, fz_values *vals, bool allow_wild) {
    memset(x, 0, sizeof *x);
    x->t.dtype = dtype;
    x->t.rank = rank;
    int r = rank < 0 ? 0 : rank > ATTN_MAX_RANK ? ATTN_MAX_RANK : rank;
    memcpy(x->t.shape, shape, sizeof(int64_t) * (size_t)r);
    fz_layout(f, x, output);
    fz_back(f, x, limit, vals, allow_wild);
}

double fz_get(const attn_tensor *t, const int64_t *idx) {
    int64_t off = 0;
    for (int d = 0; d < t->rank; d++) off += idx[d] * t->strides[d];
    switch (t->dtype) {
    case ATTN_DTYPE_F32: return ((const float *)t->data)[off];
    case ATTN_DTYPE_F64: return ((const double *)t->data)[off];
    case ATTN_DTYPE_F16: return from_f16(((const uint16_t *)t->data)[off]);
    case ATTN_DTYPE_BF16: return from_bf16(((const uint16_t *)t->data)[off]);
    case ATTN_DTYPE_I32: return ((const int32_t *)t->data)[off];
    default: return ((const unsigned char *)t->data)[off] != 0;
    }
}

bool fz_all_finite(const attn_tensor *t, bool neg_inf_ok) {
    int64_t idx[ATTN_MAX_RANK] = {0}, n = 1;
    for (int d = 0; d < t->rank; d++) n *= t->shape[d];
    for (int64_t i = 0; i < n; i++) {
        double x = fz_get(t, idx);
        if (!isfinite(x) && !(neg_inf_ok && x == -INFINITY)) return false;
        for (int d = t->rank - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d]) break;
            idx[d] = 0;
        }
    }
    return true;
}

/* ---- bounded allocator ---- */

static size_t alloc_limit;
static long live;

static void *bounded_alloc(void *ctx, size_t size) {
    (void)ctx;
    if (size > alloc_limit) return NULL;
    void *p = malloc(size);
    if (p == NULL) return NULL;
    live++;
    /* Fresh blocks hold NaN (all-ones bytes), so a read of workspace the
     * library never wrote shows up as a non-finite output. */
    memset(p, 0xFF, size);
    return p;
}
static void bounded_release(void *ctx, void *p) {
    (void)ctx;
    live--;
    free(p);
}

void fz_install_allocator(size_t max_bytes) {
    alloc_limit = max_bytes;
    attn_allocator a = {bounded_alloc, bounded_release, NULL};
    attn_set_allocator(&a);
}

long fz_live_blocks(void) {
    attn_release_workspace(); /* the workspace attn keeps between calls is not a leak */
    return live;
}

void fz_begin_attention(fz *f) {
    static bool ready;
    if (!ready) {
        fz_install_allocator((size_t)1 << 22);
        attn_set_num_threads(1);
        ready = true;
    }
    const attn_isa isa = (attn_isa)fz_range(f, ATTN_ISA_AUTO, ATTN_ISA_LAST);
    if (attn_isa_supported(isa)) fz_check_status(attn_set_isa(isa), "attn_set_isa");
}

size_t fz_set_alloc_limit(size_t max_bytes) {
    size_t old = alloc_limit;
    alloc_limit = max_bytes;
    return old;
}

void fz_hostile_begin(fz *f, fz_hostile *h, fz_tensor *output, const fz_tensor *input) {
    memset((void *)h, 0, sizeof *h);
    if (!fz_one_in(f, 12)) return;
    if (fz_bool(f) && output != NULL && input != NULL && output->t.data != NULL &&
        input->t.data != NULL) {
        h->kind = 1;
        h->output = output;
        h->saved_data = output->t.data;
        output->t.data = input->t.data; /* both views hold the element there */
    } else {
        h->kind = 2;
        h->flag = 1;
        attn_set_cancel_flag(&h->flag);
    }
}

void fz_hostile_end(fz_hostile *h, attn_status st) {
    if (h->kind == 1) {
        h->output->t.data = h->saved_data;
        FZ_ASSERT(st != ATTN_OK, "an output aliasing an input was accepted");
    } else if (h->kind == 2) {
        attn_set_cancel_flag(NULL);
        FZ_ASSERT(st != ATTN_OK, "a call with its cancel flag set succeeded");
    }
}
