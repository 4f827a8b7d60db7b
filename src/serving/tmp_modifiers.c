/* TEMPORARY until the lead's attn__problem_modifiers lands in validate.c:
 * delete this file on that merge. */
#include <math.h>

#include "serving.h"

attn_status attn__problem_modifiers(attn__problem *p, const attn_sdpa_params *params) {
    if (params->window_left < -1)
        return attn__fail_arg(ATTN_ERR_INVALID, "params.window_left",
                              "window_left is %lld; expected -1 or >= 0",
                              (long long)params->window_left);
    if (params->window_right < -1)
        return attn__fail_arg(ATTN_ERR_INVALID, "params.window_right",
                              "window_right is %lld; expected -1 or >= 0",
                              (long long)params->window_right);
    if (!(params->softcap >= 0.0) || !isfinite(params->softcap))
        return attn__fail_arg(ATTN_ERR_INVALID, "params.softcap", "softcap is %g",
                              params->softcap);
    if (params->alibi_slopes != NULL || params->sinks != NULL)
        return attn__fail_arg(ATTN_ERR_UNSUPPORTED, "params.alibi_slopes", "not yet");
    /* attn_sdpa_params_init does not set -1 yet: no window until then. */
    p->window_left = p->window_right = -1;
    p->softcap = params->softcap;
    return ATTN_OK;
}
