/* cpu.c — which vector instructions this CPU *and* its OS support, and which
 * kernel path calls take. A feature counts only if CPUID reports it and XCR0
 * (read with xgetbv) shows the OS saves the registers it needs. */
#define _DEFAULT_SOURCE /* syscall (AMX's arch_prctl) */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define ATTN_X86 1
#endif

attn__cpu_features attn__cpu_decode(uint32_t leaf1_ecx, uint32_t leaf7_ebx, uint32_t leaf7_1_eax,
                                    uint64_t xcr0, bool osxsave_usable) {
    attn__cpu_features f = {false, false, false, false, false};
    bool fma = (leaf1_ecx >> 12) & 1, avx = (leaf1_ecx >> 28) & 1, f16c = (leaf1_ecx >> 29) & 1;
    bool avx2 = (leaf7_ebx >> 5) & 1, avx512f = (leaf7_ebx >> 16) & 1;
    bool avx512dq = (leaf7_ebx >> 17) & 1, avx512bw = (leaf7_ebx >> 30) & 1,
         avx512vl = (leaf7_ebx >> 31) & 1;
    bool avx512bf16 = (leaf7_1_eax >> 5) & 1;
    bool ymm_saved = osxsave_usable && (xcr0 & 0x6) == 0x6;            /* XMM, YMM */
    bool zmm_saved = osxsave_usable && (xcr0 & 0xE6) == 0xE6;          /* + opmask, ZMM */
    f.avx2_fma = avx && avx2 && fma && f16c && ymm_saved; /* f16c: float16 loads */
    f.avx512f = f.avx2_fma && avx512f && zmm_saved;
    f.avx512_core = f.avx512f && avx512dq && avx512bw && avx512vl;
    f.avx512_bf16 = f.avx512_core && avx512bf16;
    return f;
}

bool attn__amx_decode(uint32_t leaf7_edx, uint64_t xcr0) {
    const bool tile = (leaf7_edx >> 24) & 1, bf16 = (leaf7_edx >> 22) & 1;
    return tile && bf16 && (xcr0 & 0x60000) == 0x60000;
}

/* Linux hands a process the 8 KiB of tile state only when asked
 * (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, kernel 5.16 on); a tile
 * instruction before that is a SIGILL. The grant is for the whole process,
 * threads made before or after it alike. Elsewhere: no tiles. */
static bool amx_granted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
}

static attn__cpu_features detect(void) {
    const attn__cpu_features none = {false, false, false, false, false};
#ifdef ATTN_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return none;
    uint32_t leaf1_ecx = c;
    bool osxsave = (leaf1_ecx >> 27) & 1;
    uint32_t leaf7_ebx = 0, leaf7_edx = 0, leaf7_1_eax = 0;
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        leaf7_ebx = b;
        leaf7_edx = d;
        if (a >= 1) { /* subleaf 1 exists: AVX512-BF16 is its EAX bit 5 */
            __cpuid_count(7, 1, a, b, c, d);
            leaf7_1_eax = a;
        }
    }
    uint64_t xcr0 = 0;
    if (osxsave) {
        uint32_t lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = ((uint64_t)hi << 32) | lo;
    }
    attn__cpu_features f = attn__cpu_decode(leaf1_ecx, leaf7_ebx, leaf7_1_eax, xcr0, osxsave);
    f.amx = f.avx512_bf16 && attn__amx_decode(leaf7_edx, xcr0) && amx_granted();
    return f;
#else
    return none;
#endif
}

const attn__cpu_features *attn__cpu(void) {
    /* Detection is idempotent, so first callers may race to do it; what they
     * publish is one atomic index into constant data, so no thread ever
     * writes memory another may be reading. Each level implies the ones
     * before it (attn__cpu_decode). */
    static const attn__cpu_features table[6] = {{false, false, false, false, false},
                                                {true, false, false, false, false},
                                                {true, true, false, false, false},
                                                {true, true, true, false, false},
                                                {true, true, true, true, false},
                                                {true, true, true, true, true}};
    static atomic_int index = -1;
    int i = atomic_load_explicit(&index, memory_order_acquire);
    if (i < 0) {
        attn__cpu_features f = detect();
        i = f.amx ? 5 : f.avx512_bf16 ? 4 : f.avx512_core ? 3 : f.avx512f ? 2 : f.avx2_fma ? 1 : 0;
        atomic_store_explicit(&index, i, memory_order_release);
    }
    return &table[i];
}

/* L2 cache bytes per core: CPUID 0x80000006 ECX[31:16] in KiB, which AMD and
 * Intel both report; 512 KiB (the smallest of the x86-64 cores we run on)
 * when it is not there. Read once: CPUID traps to the hypervisor in a VM. */
int64_t attn__l2_bytes(void) {
    static atomic_llong cached = 0;
    long long bytes = atomic_load_explicit(&cached, memory_order_relaxed);
    if (bytes == 0) {
        bytes = 512 << 10;
#ifdef ATTN_X86
        unsigned a, b, c, d;
        if ((unsigned)__get_cpuid_max(0x80000000u, NULL) >= 0x80000006u &&
            __get_cpuid(0x80000006u, &a, &b, &c, &d) && (c >> 16) != 0)
            bytes = (long long)(c >> 16) << 10;
#endif
        atomic_store_explicit(&cached, bytes, memory_order_relaxed);
    }
    return bytes;
}

/* Requests ahead of a streamed K/V walk pay on AMD Zen 5 (family 0x1A):
 * a head-major decode, (1,32,1,32768,128) with 8 KV heads, 12.8 -> 5.4 ms
 * on two cores; its scores had waited on every K load, 65% of the time
 * (docs/design.md). On Zen 3 (family 0x19, models 0x00-0x0F, 0x20-0x2F,
 * 0x40-0x5F) they pay on the walk one head at a time (the same decode,
 * medians 20.9-24.5 -> 17.5-19.3 ms, six alternating pairs) but cost the
 * ganged walk of a token-major cache a third (66-77 -> 89-101 ms, `attn_bench
 * decode`): there each head requests its 512-byte slice of 4 KiB rows the
 * hardware prefetchers were already fetching whole. On Zen 4 (0x19, other
 * models), K rows requested 8-32 rows ahead inside qk_rows were 4-20%
 * slower when tried. Other CPUs were not measured: they keep their own
 * prefetchers until they are. How far: Zen 3 waits longer on its memory
 * than Zen 5 (the same decode, 16 and 32 KiB of K and V rows ahead against
 * the 4 and 8 KiB tuned on Zen 5: medians of ten alternating rounds 18.7
 * -> 16.2 ms at S = 32,768, 2.38 -> 2.18 at 4,096, 10.0 -> 9.0 at
 * 16,384; twice the distance fell between). The ganged walk's own
 * requests of whole rows into L2 (gang_request, tuned on Zen 4) stay on
 * everywhere but for rows of a 4 KiB page or more on Zen 3: there each row
 * is a page of its own, and the hardware prefetchers alone stream it faster
 * (a decode's 4-16 KiB rows: 0.74-0.91x the time), while shorter rows,
 * several to a page, need the requests (512 B-2 KiB: 1.1-1.5x the time
 * without; docs/design.md). On Zen 3 the walk one head at a time also
 * requests each block's V rows whole into L2 before the block's scores
 * (V_BLOCK): the P·V after them had waited on V's loads, and the same
 * decode took 0.93-0.98x the time (float32; bfloat16 0.995x). On Intel
 * Xeon family 6 model 0xCF (Emerald Rapids, 2026-11-30; 2 threads,
 * (1,32,1,S,128) with 8 KV heads, one process alternating the rules,
 * medians of 15 rounds of 5 calls) the walk one head at a time gains from
 * requests as Zen 3's (S = 32,768: 0.72x the time in float32 and bfloat16;
 * S = 4,096 0.86x float32), at the kernels' distance (four times as far,
 * or V rows whole, were no better), and the ganged walk of a float32
 * cache's 4 KiB rows from dropping its whole-row requests (0.69x at
 * S = 32,768, 0.75x at 4,096), while a bfloat16 cache's 2 KiB rows keep
 * them (0.97-1.00x); per-head requests inside the ganged kernels cost it
 * 1.2-1.4x. Sapphire Rapids (0x8F), the same core, was not measured. */
unsigned attn__stream_prefetch_for(bool amd, unsigned family, unsigned model) {
    if (!amd) /* Intel: Emerald Rapids (family 6 model 0xCF) measured, the rest not */
        return family == 6 && model == 0xCF ? ATTN__AHEAD_HEADS | ATTN__AHEAD_SHORT_ROWS
                                            : ATTN__AHEAD_ROWS;
    if (family >= 0x1A) return ATTN__AHEAD_HEADS | ATTN__AHEAD_GANG | ATTN__AHEAD_ROWS;
    const bool zen3 = family == 0x19 && (model <= 0x0F || (model >= 0x20 && model <= 0x2F) ||
                                         (model >= 0x40 && model <= 0x5F));
    return zen3 ? ATTN__AHEAD_HEADS | ATTN__AHEAD_FAR | ATTN__AHEAD_SHORT_ROWS | ATTN__AHEAD_V_BLOCK
                : ATTN__AHEAD_ROWS;
}

static atomic_int forced = -1; /* attn__stream_prefetch_force: -1 the rule */

void attn__stream_prefetch_force(int on) { atomic_store(&forced, on < 0 ? -1 : on != 0); }

/* CPUID's vendor string is "AuthenticAMD". */
static bool cpu_is_amd(void) {
#ifdef ATTN_X86
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d))
        return b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;
#endif
    return false;
}

/* The rule's walks for this CPU, or every walk / none when forced. */
static unsigned stream_prefetch_walks(void) {
    static atomic_int cached = -1; /* idempotent: racing first callers agree */
    const int f = atomic_load_explicit(&forced, memory_order_relaxed);
    if (f >= 0) /* the kernels' distance */
        return f ? ATTN__AHEAD_HEADS | ATTN__AHEAD_GANG | ATTN__AHEAD_ROWS | ATTN__AHEAD_V_BLOCK
                 : 0;
    int walks = atomic_load_explicit(&cached, memory_order_relaxed);
    if (walks < 0) {
        const bool amd = cpu_is_amd();
        unsigned family = 0, model = 0;
#ifdef ATTN_X86
        unsigned a, b, c, d;
        if (__get_cpuid(1, &a, &b, &c, &d)) {
            family = (a >> 8) & 0xf;
            model = (a >> 4) & 0xf;
            if (family == 0xf) {
                family += (a >> 20) & 0xff;
                model |= ((a >> 16) & 0xf) << 4;
            }
        }
#endif
        walks = (int)attn__stream_prefetch_for(amd, family, model);
        atomic_store_explicit(&cached, walks, memory_order_relaxed);
    }
    return (unsigned)walks;
}

bool attn__stream_prefetch(void) { return (stream_prefetch_walks() & ATTN__AHEAD_HEADS) != 0; }

bool attn__gang_prefetch(void) { return (stream_prefetch_walks() & ATTN__AHEAD_GANG) != 0; }

bool attn__gang_rows_ahead_for(unsigned walks, size_t row_bytes) {
    return (walks & ATTN__AHEAD_ROWS) || ((walks & ATTN__AHEAD_SHORT_ROWS) && row_bytes < 4096);
}

bool attn__gang_rows_ahead(size_t row_bytes) {
    return attn__gang_rows_ahead_for(stream_prefetch_walks(), row_bytes);
}

bool attn__stream_far(void) { return (stream_prefetch_walks() & ATTN__AHEAD_FAR) != 0; }

bool attn__stream_v_block(void) { return (stream_prefetch_walks() & ATTN__AHEAD_V_BLOCK) != 0; }

/* A path is supported when its kernels were compiled in (ATTN_HAVE_*) and
 * the CPU and OS can run them. */
int attn_isa_supported(attn_isa isa) {
    const attn__cpu_features *f = attn__cpu();
    (void)f;
    switch (isa) {
    case ATTN_ISA_AUTO:
    case ATTN_ISA_REF:
    case ATTN_ISA_GENERIC: return 1;
#ifdef ATTN_HAVE_AVX2
    case ATTN_ISA_AVX2: return f->avx2_fma;
#endif
#ifdef ATTN_HAVE_AVX512
    case ATTN_ISA_AVX512: return f->avx512f;
#endif
#if defined(ATTN_HAVE_AVX512) && defined(ATTN_HAVE_AVX512_BF16)
    case ATTN_ISA_AVX512_BF16: return f->avx512_bf16;
#endif
#if defined(ATTN_HAVE_AVX512) && defined(ATTN_HAVE_AVX512_BF16) && defined(ATTN_HAVE_AMX)
    case ATTN_ISA_AMX: return f->amx;
#endif
    default: break;
    }
    return 0;
}

const char *attn_isa_name(attn_isa isa) {
    switch (isa) {
    case ATTN_ISA_AUTO: return "auto";
    case ATTN_ISA_REF: return "ref";
    case ATTN_ISA_GENERIC: return "generic";
    case ATTN_ISA_AVX2: return "avx2";
    case ATTN_ISA_AVX512: return "avx512";
    case ATTN_ISA_AVX512_BF16: return "avx512_bf16";
    case ATTN_ISA_AMX: return "amx";
    }
    return "unknown";
}

/* vdpbf16ps pays where it does twice a float32 FMA's work a cycle, as on
 * AMD Zen 4 and Zen 5 (docs/design.md, "bfloat16 products"). On Intel it
 * did not: Xeon family 6 model 207, 2 threads, `attn_bench peak --bf16` 160
 * against 288 GFLOP/s of float32 FMAs, and a bfloat16 prefill on it took
 * 1.4-1.6x the time of the same call widened to float32 on the avx512 path
 * (2026-11-30). So without AMX tiles an Intel CPU's automatic path is
 * avx512; ATTN_ISA=avx512_bf16 still runs the kernels. */
static attn_isa best_isa(void) {
    if (attn_isa_supported(ATTN_ISA_AMX)) return ATTN_ISA_AMX;
    if (attn_isa_supported(ATTN_ISA_AVX512_BF16) && cpu_is_amd()) return ATTN_ISA_AVX512_BF16;
    if (attn_isa_supported(ATTN_ISA_AVX512)) return ATTN_ISA_AVX512;
    if (attn_isa_supported(ATTN_ISA_AVX2)) return ATTN_ISA_AVX2;
    return ATTN_ISA_GENERIC;
}

/* ASCII lower case (names hold letters, digits and '_'; no locale). */
static char lower(char c) { return c >= 'A' && c <= 'Z' ? (char)(c - 'A' + 'a') : c; }

/* -1 until first use; then the forced or detected path. */
static atomic_int chosen = -1;

/* ATTN_ISA, read once: a path name in any case ("avx2", "AVX2"). A value
 * that is unknown, or names a path this CPU cannot run, must not crash a
 * host process: it is reported once on stderr and the best path used. */
static attn_isa isa_from_env(void) {
    const char *env = getenv("ATTN_ISA");
    if (env == NULL || *env == '\0') return best_isa();
    for (int i = ATTN_ISA_AUTO; i <= ATTN_ISA_LAST; i++) {
        const char *name = attn_isa_name((attn_isa)i);
        size_t n = 0;
        while (name[n] != '\0' && env[n] != '\0' && lower(env[n]) == name[n]) n++;
        if (name[n] != '\0' || env[n] != '\0') continue;
        if (i == ATTN_ISA_AUTO) return best_isa();
        if (attn_isa_supported((attn_isa)i)) return (attn_isa)i;
        fprintf(stderr, "attn: ATTN_ISA=%.32s: this CPU or OS cannot run that path; using %s\n",
                env, attn_isa_name(best_isa()));
        return best_isa();
    }
    fprintf(stderr,
            "attn: ignoring ATTN_ISA=%.32s: expected ref, generic, avx2, avx512, avx512_bf16, amx or auto; "
            "using %s\n",
            env, attn_isa_name(best_isa()));
    return best_isa();
}

attn_isa attn_get_isa(void) {
    int isa = atomic_load(&chosen);
    if (isa < 0) {
        isa = (int)isa_from_env();
        int expected = -1;
        if (!atomic_compare_exchange_strong(&chosen, &expected, isa)) isa = expected;
        if (getenv("ATTN_DEBUG") != NULL)
            fprintf(stderr, "attn: kernel path %s\n", attn_isa_name((attn_isa)isa));
    }
    return (attn_isa)isa;
}

attn_status attn_set_isa(attn_isa isa) {
    attn__clear_error();
    if (isa < ATTN_ISA_AUTO || isa > ATTN_ISA_LAST)
        return attn__fail(ATTN_ERR_INVALID, "attn_set_isa: unknown ISA code %d", (int)isa);
    if (!attn_isa_supported(isa))
        return attn__fail(ATTN_ERR_UNSUPPORTED,
                          "attn_set_isa: this CPU or OS cannot run the %s path",
                          attn_isa_name(isa));
    atomic_store(&chosen, (int)(isa == ATTN_ISA_AUTO ? best_isa() : isa));
    return ATTN_OK;
}
