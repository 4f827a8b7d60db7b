/*
 * fuzz_util.h — what the libFuzzer targets share: a reader that turns the
 * fuzz input into small decisions (sizes, strides, flags, values), exactly
 * sized buffers for strided views, an allocator that refuses large requests,
 * and the invariants every call must keep.
 *
 * Buffers are allocated to exactly the span of elements a view can address,
 * so AddressSanitizer reports any read or write outside it. A view whose span
 * is too large to back (or overflows) gets a pointer into a PROT_NONE page:
 * such views are only passed to calls that must not touch data.
 */
#ifndef ATTN_FUZZ_UTIL_H
#define ATTN_FUZZ_UTIL_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"

/* ---- the input reader: past the end, every draw is 0 ---- */

typedef struct fz {
    const uint8_t *p;
    size_t n;
} fz;

static inline uint8_t fz_u8(fz *f) {
    if (f->n == 0) return 0;
    f->n--;
    return *f->p++;
}
static inline uint32_t fz_u32(fz *f) {
    uint32_t x = 0;
    for (int i = 0; i < 4; i++) x = x << 8 | fz_u8(f);
    return x;
}
static inline uint64_t fz_u64(fz *f) { return (uint64_t)fz_u32(f) << 32 | fz_u32(f); }
static inline bool fz_bool(fz *f) { return fz_u8(f) & 1; }
/* An integer in [lo, hi]. */
static inline int64_t fz_range(fz *f, int64_t lo, int64_t hi) {
    return lo + (int64_t)(fz_u8(f) % (uint64_t)(hi - lo + 1));
}
/* One in `n` (n >= 1): rare branches that the fuzzer can still reach. */
static inline bool fz_one_in(fz *f, int n) { return fz_u8(f) % n == 0; }

/* Dimensions and strides far outside what any buffer can hold. */
static const int64_t FZ_WILD[] = {0,          -1,         -7,           (int64_t)1 << 31,
                                  (int64_t)1 << 32, (int64_t)1 << 40, (int64_t)1 << 62,
                                  INT64_MAX,  INT64_MIN,  INT64_MAX / 2, 3037000500LL};
static inline int64_t fz_wild(fz *f) {
    return FZ_WILD[fz_u8(f) % (sizeof FZ_WILD / sizeof FZ_WILD[0])];
}

/* A dimension: mostly small; sometimes wild (when `wild` is allowed). */
static inline int64_t fz_dim(fz *f, int64_t max, bool wild) {
    if (wild && fz_one_in(f, 24)) return fz_wild(f);
    return fz_range(f, 1, max);
}

/* ---- values ---- */

/* Whether every value drawn so far was finite and small ("tame"), so that
 * finite outputs can be demanded. */
typedef struct fz_values {
    bool tame;
} fz_values;

static inline double fz_value(fz *f, fz_values *vals, bool allow_wild) {
    uint8_t b = fz_u8(f);
    if (allow_wild && b >= 250) {
        vals->tame = false;
        static const double wild[] = {NAN, INFINITY, -INFINITY, 1e30, -1e30, 1e300};
        return wild[b - 250];
    }
    return ((double)b - 125.0) / 16.0; /* [-7.8, 7.8] in steps of 1/16 */
}

/* ---- allocations ---- */

/* A page no one may touch: the data pointer of views too large to back. */
void *fz_forbidden_page(void);

/* Element span of a view: the offsets it reaches are [lo, hi]. Returns false
 * when the arithmetic overflows or the span exceeds `limit` elements. */
static inline bool fz_span(int rank, const int64_t *shape, const int64_t *strides, int64_t limit,
                           int64_t *lo, int64_t *hi) {
    *lo = *hi = 0;
    if (rank < 1 || rank > ATTN_MAX_RANK) return false;
    for (int d = 0; d < rank; d++) {
        int64_t n = shape[d], s = strides[d], reach;
        if (n < 1) return false;
        if (s == INT64_MIN || __builtin_mul_overflow(s, n - 1, &reach)) return false;
        if (reach < 0) {
            if (__builtin_add_overflow(*lo, reach, lo)) return false;
        } else if (__builtin_add_overflow(*hi, reach, hi)) {
            return false;
        }
    }
    int64_t span;
    if (__builtin_sub_overflow(*hi, *lo, &span) || span >= limit) return false;
    return true;
}

/* A view over its own buffer. `backed` is false when the view points into the
 * forbidden page instead. */
typedef struct fz_tensor {
    attn_tensor t;
    void *alloc;   /* what to free */
    int64_t lo;    /* element offset of the buffer start from t.data */
    int64_t count; /* elements in the buffer */
    bool backed;
} fz_tensor;

/* Layout kinds a fuzz input picks from. */
enum {
    FZ_CONTIGUOUS, /* row-major                                    */
    FZ_PERMUTED,   /* dims in a random memory order, with gaps      */
    FZ_REVERSED,   /* negative strides                              */
    FZ_BROADCAST,  /* zero strides on some dims (inputs only)       */
    FZ_RAW,        /* strides drawn directly: small or wild         */
    FZ_NLAYOUTS
};

/* Fills x->t.strides for x->t.shape per the layout drawn from f. */
void fz_layout(fz *f, fz_tensor *x, bool output);
/* Allocates the exact span (up to `limit` elements) and fills it with values
 * drawn from f (bool: 0/1, occasionally other non-zero bytes; float16 and
 * bfloat16 hold the drawn values exactly; int32: small integers). */
void fz_back(fz *f, fz_tensor *x, int64_t limit, fz_values *vals, bool allow_wild);
void fz_tensor_free(fz_tensor *x);
/* Float masks: sets about a third of the slots to -inf (masked out), which
 * keeps the inputs tame. No-op for other dtypes and unbacked views. */
void fz_sprinkle_neg_inf(fz *f, fz_tensor *m);
/* Draws shape, layout and data in one go. */
void fz_tensor_make(fz *f, fz_tensor *x, attn_dtype dtype, int rank, const int64_t *shape,
                    bool output, int64_t limit, fz_values *vals, bool allow_wild);

/* Reads element idx (through the strides) as a double. */
double fz_get(const attn_tensor *t, const int64_t *idx);
/* Whether every element of a backed float view is finite (NaN/Inf free),
 * treating -inf as allowed when `neg_inf_ok`. */
bool fz_all_finite(const attn_tensor *t, bool neg_inf_ok);

/* ---- the library's allocator, bounded ---- */

/* Installs an allocator that refuses any request above `max_bytes`, so that
 * a fuzz input asking for a huge workspace gets ATTN_ERR_NOMEM (and the
 * out-of-memory path is fuzzed too). Counts live blocks. */
void fz_install_allocator(size_t max_bytes);
long fz_live_blocks(void); /* after attn_release_workspace() */
/* Changes the bound (0 refuses everything); returns the previous one. */
size_t fz_set_alloc_limit(size_t max_bytes);
/* The start of an input of the attention targets: on the first, that
 * allocator (4 MiB per request) and one thread, so that live blocks count
 * exactly; then the kernel path the input picks, when this machine runs it
 * (every path the machine has is fuzzed). */
void fz_begin_attention(fz *f);

/* ---- invariants: a violated one aborts, so libFuzzer records a crash ---- */

#define FZ_ASSERT(cond, ...)                                                        \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "fuzz invariant failed at %s:%d: %s: ", __FILE__,       \
                    __LINE__, #cond);                                               \
            fprintf(stderr, __VA_ARGS__);                                           \
            fprintf(stderr, "\n");                                                  \
            abort();                                                                \
        }                                                                           \
    } while (0)

/* A status and the thread's message agree: ATTN_OK leaves "", any failure a
 * non-empty message; the status is one the API defines. */
static inline void fz_check_status(attn_status st, const char *call) {
    const char *msg = attn_last_error();
    FZ_ASSERT(msg != NULL, "%s: attn_last_error() is NULL", call);
    FZ_ASSERT(st >= ATTN_OK && st <= ATTN_ERR_OVERLAP, "%s: unknown status %d", call,
              (int)st);
    if (st == ATTN_OK)
        FZ_ASSERT(msg[0] == '\0', "%s succeeded but left the message '%s'", call, msg);
    else
        FZ_ASSERT(msg[0] != '\0', "%s failed with %s and no message", call, attn_strerror(st));
    FZ_ASSERT(strlen(msg) < 8192, "%s: message too long", call);
}

/* Hostile calls (issue 9), applied to one call at a time: an output
 * pointed at an input's first element (in-place attention) must be refused,
 * never computed; a call whose cancel flag is already set must not succeed.
 * fz_hostile_begin picks one of them, or none, from the input;
 * fz_hostile_end undoes it after the call and checks the status. */
typedef struct fz_hostile {
    int kind; /* 0 none, 1 alias, 2 cancel */
    fz_tensor *output;
    void *saved_data;
    volatile int flag;
} fz_hostile;
void fz_hostile_begin(fz *f, fz_hostile *h, fz_tensor *output, const fz_tensor *input);
void fz_hostile_end(fz_hostile *h, attn_status st);

#endif
