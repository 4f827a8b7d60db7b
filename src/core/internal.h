/*
 * internal.h — what the layers of libattn share and callers never see.
 * Names carry the attn__ prefix (two underscores) so that nothing private
 * collides with a caller's symbols when the static library is linked in.
 */
#ifndef ATTN_INTERNAL_H
#define ATTN_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attn.h"

/* ---- errors (status.c) ---- */

/* Records a detailed message for the calling thread and returns `status`, so
 * that failure paths read `return attn__fail(ATTN_ERR_SHAPE, "...", ...);`. */
attn_status attn__fail(attn_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* The same, naming the argument the failure is about (attn_last_error_arg):
 * "q", "out", "params.dropout_p", "config.num_heads". */
attn_status attn__fail_arg(attn_status status, const char *arg, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* Clears the thread's message at the start of a public call. */
void attn__clear_error(void);
/* Puts `prefix` in front of the thread's message (which it may quote). */
attn_status attn__prefix_error(attn_status status, const char *prefix);
/* When the thread's failure names argument `from`, names `to` instead and
 * says so in the message: a layer that passes its argument on to another
 * call under that call's name ("src_mask" as "attn_mask"). */
attn_status attn__rename_arg(attn_status status, const char *from, const char *to);

enum {
    /* Bytes a message holds, its NUL included. */
    ATTN__MESSAGE_SIZE = 8192,
    /* Bytes a path may take in a message: any path the system accepts
     * (PATH_MAX is 4096 on Linux) shows whole, and the reason after it
     * always fits. */
    ATTN__MESSAGE_PATH = 4200
};
/* `path` for a message: itself when it fits in ATTN__MESSAGE_PATH bytes,
 * else its start and end around "...", written to buf. */
const char *attn__message_path(const char *path, char buf[ATTN__MESSAGE_PATH]);

/* Reads a caller's versioned parameter struct (its first field is
 * struct_size) into dst, which the caller has filled with the defaults and
 * whose size is this library's sizeof: a shorter struct (an older header)
 * keeps dst's defaults for the fields it lacks, a longer one (a newer header)
 * is accepted only if its extra bytes are zero. first_size is the struct's
 * size in its first version (0.2.0): nothing smaller was ever valid.
 * `name` ("params") and `init_name` ("attn_sdpa_params_init") go into the
 * messages. */
attn_status attn__read_params(void *dst, size_t dst_size, size_t first_size, const void *src,
                              const char *name, const char *init_name);
/* A struct's int flags, values[i] named names[i] ("config.bias"): each must
 * be 0 or 1 (as a call's batch_first, where 2 is a mistake, not "true"). */
attn_status attn__check_flags(const int *values, const char *const *names, int n);
/* No version of a parameter struct will be larger: a bigger struct_size is
 * taken for an uninitialised one. */
#define ATTN__MAX_STRUCT_SIZE ((size_t)4096)
/* The end of a struct's last field: the size a version of it had. */
#define ATTN__SIZE_THROUGH(type, field) (offsetof(type, field) + sizeof(((type *)0)->field))

/* ---- memory (alloc.c) ---- */

/* 64-byte aligned blocks through the caller's allocator hook. NULL on
 * failure (the message is set: callers just return ATTN_ERR_NOMEM). */
void *attn__alloc(size_t size);
void *attn__alloc_array(size_t count, size_t elem_size); /* zeroed, overflow-checked */
void attn__free(void *ptr);
/* Workspace of one call: `count` elements of elem_size bytes, zeroed or
 * not (then filled with 0x3f bytes in builds with ATTN_POISON_WORKSPACE),
 * overflow-checked; freed with attn__work_free, which keeps large blocks
 * for the next call (alloc.c). */
void *attn__work_alloc(size_t count, size_t elem_size, bool zeroed);
void attn__work_free(void *ptr);

/* ---- checked 64-bit arithmetic ---- */

static inline bool attn__mul_overflows(int64_t a, int64_t b, int64_t *out) {
    return __builtin_mul_overflow(a, b, out);
}
static inline bool attn__add_overflows(int64_t a, int64_t b, int64_t *out) {
    return __builtin_add_overflow(a, b, out);
}

/* ---- tensors (tensor.c) ---- */

typedef enum attn__role { ATTN__INPUT, ATTN__OUTPUT } attn__role;

/* Checks that `t` is a usable view: not NULL, data not NULL, rank within
 * [min_rank, ATTN_MAX_RANK], every dimension >= 1, a known dtype, and an
 * address span whose byte count fits in 64 bits. Outputs must also not map
 * two elements to one address through a zero stride. `name` appears in the
 * message ("q", "attn_mask", ...). */
attn_status attn__check_tensor(const attn_tensor *t, const char *name, int min_rank,
                               attn__role role);

/* Whether some byte belongs to an element of both checked views (views
 * that interleave without sharing an element, such as the K and V halves
 * of one paged buffer, do not overlap; past a bounded search, views built to
 * defeat it count as overlapping). NULL overlaps nothing. Outputs are
 * tested against every other operand: a kernel that writes `out` while it
 * still reads `q` would see its own results. */
bool attn__views_overlap(const attn_tensor *a, const attn_tensor *b);
/* ATTN_ERR_OVERLAP when an output view (already checked) maps two elements
 * to one address; NULL passes. */
attn_status attn__check_output_layout(const attn_tensor *t, const char *name);
/* Offset, in elements, of element i of a view counted in C order over its
 * first nd dimensions. */
int64_t attn__linear_offset(const attn_tensor *t, int nd, int64_t i);

/* A request for the cache line at p into L2, for reads ahead of a walk.
 * On x86 an asm statement: GCC treats __builtin_prefetch as free of side
 * effects, and drops a call to a static function made only of them. */
static inline void attn__prefetch_l2(const void *p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)p));
#else
    __builtin_prefetch(p, 0, 2);
#endif
}

/* The same into L1 (prefetcht0), for lines read next. */
static inline void attn__prefetch_l1(const void *p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)p));
#else
    __builtin_prefetch(p, 0, 3);
#endif
}

/* Whether dtype is float32 or float64. */
static inline bool attn__is_float(attn_dtype d) {
    return d == ATTN_DTYPE_F32 || d == ATTN_DTYPE_F64;
}

/* Whether dtype is one of the 16-bit storage dtypes (float16, bfloat16). */
static inline bool attn__is_half(attn_dtype d) {
    return d == ATTN_DTYPE_F16 || d == ATTN_DTYPE_BF16;
}

/* The type a computation over operands of query dtype d runs in: float64
 * for float64, float32 for everything else (16-bit included); also the
 * dtype of its lse (besides float64, which every call may ask for). */
static inline attn_dtype attn__compute_dtype(attn_dtype d) {
    return d == ATTN_DTYPE_F64 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
}

/* Whether dtype is any of the four floating dtypes a computation reads. */
static inline bool attn__is_floating(attn_dtype d) {
    return attn__is_float(d) || attn__is_half(d);
}

/* The 16-bit floats, widened exactly to float (every value, the signed
 * zeros, infinities and NaN payloads have one). bfloat16 is the top half of
 * a float32. binary16's subnormals are mantissa * 2^-24, exact in float;
 * its normals rebias the exponent (15 -> 127); exponent 31 is inf/NaN. */
static inline float attn__bits_to_float(uint32_t bits) {
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}
static inline float attn__bf16_to_float(uint16_t h) {
    return attn__bits_to_float((uint32_t)h << 16);
}
static inline float attn__f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) { /* zero or subnormal */
        const float mag = (float)mant * 0x1p-24f;
        return sign ? -mag : mag;
    }
    if (exp == 31) return attn__bits_to_float(sign | 0x7f800000u | mant << 13);
    return attn__bits_to_float(sign | (exp + 112) << 23 | mant << 13);
}

/* float -> binary16 / bfloat16 bits, rounded to nearest even (NaN stays a
 * quiet NaN of the same sign; overflow gives infinity): what a KV cache of a
 * storage dtype holds of the rows written into it. */
static inline uint16_t attn__float_to_bf16(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(u >> 16 | 0x40u);
    u += 0x7fffu + (u >> 16 & 1u);
    return (uint16_t)(u >> 16);
}
static inline uint16_t attn__float_to_f16(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, sizeof u);
    const uint32_t sign = u >> 16 & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | (a >> 13 & 0x3ffu));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504 */
    if (a < 0x38800000u) { /* below 2^-14: a subnormal (or zero) of binary16 */
        const uint32_t e = a >> 23;        /* in units of 2^-24 the value is full >> shift */
        if (e < 102) return (uint16_t)sign; /* below 2^-25: rounds to zero */
        const uint32_t full = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;
        uint32_t q = full >> shift;
        const uint32_t rem = full & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    const uint32_t r = a + 0xfffu + (a >> 13 & 1u);
    return (uint16_t)(sign | (r - 0x38000000u) >> 13);
}

/* x rounded to float "to odd" (truncated, the last bit set when inexact):
 * rounding that float to a format at least two bits narrower (binary16,
 * bfloat16) to nearest even then gives x's own correct rounding, where
 * going through (float)x would round twice (2.7099609374975 became
 * -2.7109375 in binary16, not -2.708984375). */
static inline float attn__float_round_to_odd(double x) {
    float f = (float)x;
    if ((double)f == x || f != f || __builtin_isinf(f)) return f; /* exact, NaN, overflow */
    uint32_t u;
    __builtin_memcpy(&u, &f, sizeof u);
    if (__builtin_fabs((double)f) > __builtin_fabs(x)) u -= 1; /* toward zero */
    u |= 1;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

/* Reads element `offset` (in elements) of a float32/float64/bool buffer as a
 * double. For the reference paths, which favour clarity over speed. Every
 * dtype has its case and there is no default: a new attn_dtype is a compile
 * error here (-Wswitch) until it is handled, never a silent misread.
 * Validation never lets an unknown code through; NaN marks one anyway. */
static inline double attn__load(const void *base, attn_dtype dtype, int64_t offset) {
    switch (dtype) {
    case ATTN_DTYPE_F32: return (double)((const float *)base)[offset];
    case ATTN_DTYPE_F64: return ((const double *)base)[offset];
    case ATTN_DTYPE_BOOL: return ((const unsigned char *)base)[offset] != 0 ? 1.0 : 0.0;
    case ATTN_DTYPE_F16: return (double)attn__f16_to_float(((const uint16_t *)base)[offset]);
    case ATTN_DTYPE_BF16: return (double)attn__bf16_to_float(((const uint16_t *)base)[offset]);
    case ATTN_DTYPE_I32: return (double)((const int32_t *)base)[offset];
    }
    return __builtin_nan("");
}
/* Writes x rounded to an output's dtype (outputs are float32 or float64; a
 * KV cache may also be float16 or bfloat16: x rounded once, to nearest
 * even). Index tensors are never written (validation keeps them inputs). */
static inline void attn__store(void *base, attn_dtype dtype, int64_t offset, double x) {
    switch (dtype) {
    case ATTN_DTYPE_F32: ((float *)base)[offset] = (float)x; return;
    case ATTN_DTYPE_F64: ((double *)base)[offset] = x; return;
    case ATTN_DTYPE_BOOL: ((unsigned char *)base)[offset] = x != 0; return;
    case ATTN_DTYPE_F16:
        ((uint16_t *)base)[offset] = attn__float_to_f16(attn__float_round_to_odd(x));
        return;
    case ATTN_DTYPE_BF16:
        ((uint16_t *)base)[offset] = attn__float_to_bf16(attn__float_round_to_odd(x));
        return;
    case ATTN_DTYPE_I32: return;
    }
}
/* A row's log-sum-exp stored in an lse output: -inf says the row saw no key,
 * so a finite lse beyond float32's range is stored there as -FLT_MAX or
 * FLT_MAX (3.4028235e38), not as an infinity; a float64 lse holds it. */
static inline void attn__store_lse(void *base, attn_dtype dtype, int64_t offset, double lse) {
    const double top = 3.4028234663852886e38; /* FLT_MAX */
    if (dtype == ATTN_DTYPE_F32 && lse < -top && lse > -__builtin_inf()) lse = -top;
    if (dtype == ATTN_DTYPE_F32 && lse > top && lse < __builtin_inf()) lse = top;
    attn__store(base, dtype, offset, lse);
}

/* dst = src element by element in C order, each value read as a double and
 * stored rounded once to dst's dtype (attn__store); same rank and shape,
 * checked by the caller (attn_tensor_convert is the checked door). */
void attn__tensor_copy(const attn_tensor *src, const attn_tensor *dst);

/* Formats a shape as "(2, 3, 4)" into buf (always terminated). */
const char *attn__shape_str(char *buf, size_t size, int rank, const int64_t *shape);

/* ---- threads (threads.c) ---- */

/* The count for the current call, >= 1: attn_get_num_threads(), or 1 in a
 * child forked after attn had started OpenMP threads (GNU OpenMP's pool does
 * not survive fork: the child's first parallel region would wait forever). */
int attn__threads(void);
/* The calling thread's number in its OpenMP team (0 outside one). */
int attn__thread_num(void);
/* Whether `team` threads' work may run on the calling thread with no
 * parallel region of its own: a team of one called from outside any
 * OpenMP region. Inside a caller's region, orphaned worksharing loops
 * would bind to the caller's team (split across its threads, or wait at
 * its barriers), so a call there opens its own team, even of one. */
bool attn__run_inline(int team);

/* ---- cancellation (threads.c) ---- */

/* The calling thread's cancel flag (attn_set_cancel_flag), or NULL. A call
 * reads it once at its start and hands the pointer to its workers. */
const volatile int *attn__cancel_flag(void);
static inline bool attn__cancelled(const volatile int *flag) {
    return flag != NULL && __atomic_load_n(flag, __ATOMIC_RELAXED) != 0;
}
/* In a parallel loop: whether to skip this iteration because the call was
 * cancelled, seen now or earlier on any thread (*seen: shared, starts 0), so
 * that the iterations after a cancel are skipped on every thread. */
static inline bool attn__loop_cancelled(int *seen, const volatile int *flag) {
    if (__atomic_load_n(seen, __ATOMIC_RELAXED) != 0 || attn__cancelled(flag)) {
        __atomic_store_n(seen, 1, __ATOMIC_RELAXED);
        return true;
    }
    return false;
}
/* The status and message of a cancelled call. */
attn_status attn__fail_cancelled(void);

/* Below this many multiply-adds a call stays on the calling thread: waking a
 * thread pool costs more than the work (and with two OpenMP runtimes in one
 * process, as with PyTorch loaded, their idle spinning costs milliseconds). */
#define ATTN_PARALLEL_MIN_WORK (1 << 18)

/* ---- CPU features and kernel choice (cpu.c) ---- */

typedef struct attn__cpu_features {
    bool avx2_fma;    /* AVX2 and FMA, and the OS saves YMM state          */
    bool avx512f;     /* AVX-512F, and the OS saves ZMM and opmask state   */
    bool avx512_core; /* avx512f + BW, DQ and VL: what OpenBLAS's SkylakeX
                         kernels need (gemm.c picks its core from this)     */
    bool avx512_bf16; /* avx512_core + AVX512-BF16 (vdpbf16ps, vcvtne2ps2bf16) */
    bool amx;         /* avx512_bf16 + AMX-TILE and AMX-BF16, the OS saves the
                         tile state (XCR0 bits 17, 18) and grants it (Linux's
                         arch_prctl ARCH_REQ_XCOMP_PERM)                     */
} attn__cpu_features;

/* Detected once (CPUID + xgetbv), then cached. */
const attn__cpu_features *attn__cpu(void);
/* L2 cache bytes per core (CPUID; 512 KiB when unknown), read once. */
int64_t attn__l2_bytes(void);
/* Whether decoding's kernels request the K and V rows they stream from
 * memory ahead of their loads (ukernel.h, attn__rows_ahead), on a walk one
 * head at a time (attn__stream_prefetch) and on ganged decoding's walk of
 * every head of a token-major cache (attn__gang_prefetch): on the CPUs
 * where that was measured faster. Read once. */
bool attn__stream_prefetch(void);
bool attn__gang_prefetch(void);
/* Whether ganged decoding requests its whole rows of `row_bytes` (every
 * head's slice of one token) GANG_AHEAD rows ahead into L2 (gang_request):
 * everywhere but rows of a 4 KiB page or more on Zen 3. */
bool attn__gang_rows_ahead(size_t row_bytes);
/* Whether the requests go four times the kernels' distance ahead
 * (ATTN__K_AHEAD, ATTN__V_AHEAD): where that was measured faster. */
bool attn__stream_far(void);
/* Whether the walk one head at a time requests a block's V rows whole into
 * L2 before the block's scores (where that was measured faster). */
bool attn__stream_v_block(void);
/* The rule itself, on CPUID's vendor, family and model (a test reaches
 * it): the walks that request ahead, how far, and which rows the ganged
 * walk requests whole (ROWS: all, SHORT_ROWS: rows under 4 KiB). */
enum {
    ATTN__AHEAD_HEADS = 1,
    ATTN__AHEAD_GANG = 2,
    ATTN__AHEAD_FAR = 4,
    ATTN__AHEAD_ROWS = 8,
    ATTN__AHEAD_SHORT_ROWS = 16,
    ATTN__AHEAD_V_BLOCK = 32
};
unsigned attn__stream_prefetch_for(bool amd, unsigned family, unsigned model);
/* attn__gang_rows_ahead under the rule's bits `walks` (a test reaches it). */
bool attn__gang_rows_ahead_for(unsigned walks, size_t row_bytes);
/* Tests: requests on (1) or off (0) on every walk whatever the CPU, or the
 * rule again (-1). */
void attn__stream_prefetch_force(int on);
/* Pure decoding of CPUID/XCR0 words, exposed so the detector can be tested
 * on feature sets this machine does not have. */
attn__cpu_features attn__cpu_decode(uint32_t leaf1_ecx, uint32_t leaf7_ebx,
                                    uint32_t leaf7_1_eax, uint64_t xcr0, bool osxsave_usable);
/* Whether CPUID leaf 7 EDX (AMX-TILE bit 24, AMX-BF16 bit 22) and XCR0
 * (XTILECFG bit 17, XTILEDATA bit 18) allow AMX tiles; the caller adds the
 * avx512_bf16 set and the kernel's permission (cpu.c). */
bool attn__amx_decode(uint32_t leaf7_edx, uint64_t xcr0);

/* ---- Philox-4x32-10 (philox.c) ---- */

/* Four random words for (counter, key), per Salmon et al., SC'11. */
void attn__philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* The dropout keep threshold: a 32-bit word w keeps its weight iff
 * w >= threshold. p = 0 gives 0 (keep all), p = 1 gives 2^32 (keep none). */
uint64_t attn__dropout_threshold(double p);

/* The random word for weight number `index` of a call: word index % 4 of
 * Philox(counter = (index / 4, rng_offset), key = seed). */
uint32_t attn__dropout_word(uint64_t seed, uint64_t rng_offset, uint64_t index);

#endif /* ATTN_INTERNAL_H */
