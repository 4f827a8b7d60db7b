/*
 * registry.c — one context per fused path (see ukernel.h), built once.
 *
 * Each ISA context starts as a copy of the generic one and then takes the
 * ISA's overrides, so every slot the ISA leaves alone holds the portable
 * kernel. An ISA whose file was not compiled (no ATTN_HAVE_*) keeps the
 * generic context under its index, so a caller always gets a full table.
 */
#include <pthread.h>

#include "ukernel.h"

enum { CTX_GENERIC, CTX_AVX2, CTX_AVX512, CTX_AVX512_BF16, CTX_AMX, CTX_COUNT };

static attn__ukernel contexts[CTX_COUNT];
/* Built under pthread_once: the first caller builds, every other waits for
 * it, and after that the contexts are only read (no thread ever writes one
 * that another may be reading). */
static pthread_once_t built = PTHREAD_ONCE_INIT;

/* Each ISA's init runs only where the CPU runs that ISA: it is compiled
 * with the ISA's flags like its kernels, and the compiler may use them even
 * there (GCC stored the AVX-512 context's function pointers with a zmm
 * move, a SIGILL on an AVX2-only CPU; valgrind, whose CPU has no AVX-512,
 * caught it). A context the CPU cannot run stays the generic one, never
 * chosen (attn_isa_supported). */
static void build_contexts(void) {
    attn__ukernel_init_generic(&contexts[CTX_GENERIC]);
    contexts[CTX_AVX2] = contexts[CTX_GENERIC];
    contexts[CTX_AVX512] = contexts[CTX_GENERIC];
#ifdef ATTN_HAVE_AVX2
    if (attn_isa_supported(ATTN_ISA_AVX2)) attn__ukernel_init_avx2(&contexts[CTX_AVX2]);
#endif
#ifdef ATTN_HAVE_AVX512
    if (attn_isa_supported(ATTN_ISA_AVX512)) attn__ukernel_init_avx512(&contexts[CTX_AVX512]);
#endif
    /* AVX512-BF16: the AVX-512 context plus its bfloat16 slots */
    contexts[CTX_AVX512_BF16] = contexts[CTX_AVX512];
#ifdef ATTN_HAVE_AVX512_BF16
    if (attn_isa_supported(ATTN_ISA_AVX512_BF16))
        attn__ukernel_init_avx512_bf16(&contexts[CTX_AVX512_BF16]);
#endif
    /* AMX: the AVX512-BF16 context with its products on tiles */
    contexts[CTX_AMX] = contexts[CTX_AVX512_BF16];
#ifdef ATTN_HAVE_AMX
    if (attn_isa_supported(ATTN_ISA_AMX)) attn__ukernel_init_amx(&contexts[CTX_AMX]);
#endif
}

const attn__ukernel *attn__ukernel_for(attn_isa isa) {
    pthread_once(&built, build_contexts);
    switch (isa) {
    case ATTN_ISA_AMX: return &contexts[CTX_AMX];
    case ATTN_ISA_AVX512_BF16: return &contexts[CTX_AVX512_BF16];
    case ATTN_ISA_AVX512: return &contexts[CTX_AVX512];
    case ATTN_ISA_AVX2: return &contexts[CTX_AVX2];
    case ATTN_ISA_AUTO:
    case ATTN_ISA_REF:
    case ATTN_ISA_GENERIC: break;
    }
    return &contexts[CTX_GENERIC];
}
