/* sdpa.c — the public entry point: validate into a plan, run a kernel. */
#include "plan.h"

attn_status attn__sdpa_execute(const attn__sdpa_plan *plan) {
    return attn__sdpa_reference(plan);
}

attn_status attn_sdpa(const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
                      const attn_sdpa_params *params, attn_tensor *out, attn_tensor *weights,
                      attn_tensor *lse) {
    attn__clear_error();
    attn__sdpa_plan plan;
    attn_status st = attn__sdpa_plan_build(&plan, q, k, v, params, out, weights, lse);
    if (st != ATTN_OK) return st;
    return attn__sdpa_execute(&plan);
}
