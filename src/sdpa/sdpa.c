/* sdpa.c — the public entry point: validate into a plan, run a kernel. */
#include "flash.h"
#include "sdpa.h"

/* The kernel set for a path: every slot starts as the portable kernel and
 * an ISA set replaces it only where it was compiled in. */
static const attn__flash_kernels *kernels_for(attn_isa isa) {
    switch (isa) {
#ifdef ATTN_HAVE_AVX512
    case ATTN_ISA_AVX512: return &attn__flash_avx512;
#endif
#ifdef ATTN_HAVE_AVX2
    case ATTN_ISA_AVX2: return &attn__flash_avx2;
#endif
    default: return &attn__flash_generic;
    }
}

attn_status attn__sdpa_execute(const attn__problem *plan) {
    const attn_isa isa = attn_get_isa();
    if (isa == ATTN_ISA_REF) return attn__sdpa_reference(plan);
    return attn__sdpa_flash(plan, kernels_for(isa));
}

attn_status attn_sdpa(const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                      const attn_sdpa_params *params, attn_tensor *out, attn_tensor *weights,
                      attn_tensor *lse) {
    attn__clear_error();
    attn__problem plan;
    attn_status st = attn__problem_from_sdpa(&plan, q, k, v, params, out, weights, lse);
    if (st != ATTN_OK) return st;
    return attn__sdpa_execute(&plan);
}
