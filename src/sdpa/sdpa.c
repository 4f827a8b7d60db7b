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

attn_status attn_sdpa_backward(const attn_tensor *dout, const attn_tensor *q, const attn_tensor *k,
                               const attn_tensor *v, const attn_tensor *out, const attn_tensor *lse,
                               const attn_sdpa_params *params, attn_tensor *dq, attn_tensor *dk,
                               attn_tensor *dv, attn_tensor *dmask) {
    attn__clear_error();
    attn__problem p;
    attn_status st = attn__problem_from_sdpa_backward(&p, dout, q, k, v, out, lse, params, dq, dk,
                                                      dv, dmask);
    if (st != ATTN_OK) return st;
    return attn__sdpa_backward_execute(&p);
}
