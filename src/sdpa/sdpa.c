/* sdpa.c — the public entry point: validate into a problem, run a kernel. */
#include "flash.h"
#include "sdpa.h"

attn_status attn__sdpa_execute(const attn__problem *p) {
    const attn_isa isa = attn_get_isa();
    if (isa == ATTN_ISA_REF) return attn__sdpa_reference(p);
    /* attn_get_isa only names a path the CPU runs and whose kernels were
     * compiled in; the registry holds its context. */
    return attn__sdpa_flash(p, attn__ukernel_for(isa));
}

attn_status attn_sdpa(const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                      const attn_sdpa_params *params, attn_tensor *out, attn_tensor *weights,
                      attn_tensor *lse) {
    attn__clear_error();
    attn__problem p;
    attn_status st = attn__problem_from_sdpa(&p, q, k, v, params, out, weights, lse);
    if (st != ATTN_OK) return st;
    return attn__sdpa_execute(&p);
}

attn_status attn__sdpa_backward_execute(const attn__problem *p) {
    const attn_isa isa = attn_get_isa();
    if (isa == ATTN_ISA_REF) return attn__sdpa_backward_reference(p);
    return attn__sdpa_flash_backward(p, attn__ukernel_for(isa));
}

/* D = rowsum(dout · out) from a 16-bit out carries the output's rounding
 * into every dS = P·(dP - D) of its row: dq and dk came out up to 5x less
 * accurate than PyTorch's math path, which forms D from unrounded weights.
 * So a 16-bit call's out is computed again in float32 (the forward of the
 * float32 call on the same values: masks, dropout, sinks, float32
 * products), and D reads that: the gradients are then the float32 call's,
 * each rounded once. It costs one more forward (+40% on a bfloat16
 * backward on Zen 5; +20% with bfloat16 products, whose rounded weights
 * left dk at 1.3x PyTorch's error where float32's give 1.0x) and
 * nbatch x L x Ev floats. */
attn_status attn__sdpa_backward_run(attn__problem *p) {
    if (!attn__is_half(p->out.dtype)) return attn__sdpa_backward_execute(p);
    int64_t n;
    if (attn__mul_overflows(p->nbatch, p->L, &n) || attn__mul_overflows(n, p->Ev, &n) ||
        (uint64_t)n > SIZE_MAX / sizeof(float))
        return attn__fail(ATTN_ERR_OVERFLOW, "the float32 copy of out (%lld x %lld rows of "
                          "%lld) does not fit in memory", (long long)p->nbatch, (long long)p->L,
                          (long long)p->Ev);
    float *out32 = attn__alloc((size_t)n * sizeof(float)); /* (B..., Hq, L, Ev) */
    if (out32 == NULL) return ATTN_ERR_NOMEM;
    attn__problem f = *p; /* the forward of the same call, into out32 */
    f.has_dq = f.has_dk = f.has_dv = f.has_dmask = false;
    f.has_lse = f.has_weights = f.lse_exact = false;
    f.lse_for_backward = f.f32_products = true; /* the backward's layout and products */
    attn__operand_dense(&f, &f.out, out32, ATTN_DTYPE_F32, p->Ev);
    attn_status st = attn__sdpa_execute(&f);
    if (st == ATTN_OK) {
        const attn__operand rounded = p->out;
        p->out = f.out;
        st = attn__sdpa_backward_execute(p);
        p->out = rounded;
    }
    attn__free(out32);
    return st;
}

attn_status attn_sdpa_backward(const attn_tensor *dout, const attn_tensor *q, const attn_tensor *k,
                               const attn_tensor *v, const attn_tensor *out, const attn_tensor *lse,
                               const attn_sdpa_params *params, attn_tensor *dq, attn_tensor *dk,
                               attn_tensor *dv, attn_tensor *dmask) {
    attn__clear_error();
    attn__problem p;
    attn_status st = attn__problem_from_sdpa_backward(&p, dout, q, k, v, out, lse, params, dq, dk,
                                                      dv, dmask);
    if (st != ATTN_OK) return st;
    return attn__sdpa_backward_run(&p);
}
