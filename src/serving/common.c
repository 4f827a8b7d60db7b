/* common.c — see serving.h. */
#include <string.h>

#include "serving.h"

/* attn_sdpa_params as 0.2.0 had it: the smallest struct_size accepted (the
 * same rule as attn_sdpa's). */
#define SDPA_PARAMS_FIRST_SIZE ATTN__SIZE_THROUGH(attn_sdpa_params, arg_names)

attn_status attn__serving_params(attn_sdpa_params *params, const attn_sdpa_params *user,
                                 const char *call, bool has_backward) {
    attn_sdpa_params_init(params);
    if (user == NULL) return ATTN_OK;
    attn_status st = attn__read_params(params, sizeof *params, SDPA_PARAMS_FIRST_SIZE, user,
                                       "params", "attn_sdpa_params_init");
    if (st != ATTN_OK) return st;
    if (params->attn_mask != NULL)
        return attn__fail_arg(ATTN_ERR_INVALID, "params.attn_mask",
                              "%s takes no attn_mask: each sequence sees its own keys (restrict "
                              "them with causal and the window)",
                              call);
    /* A serving call is always a whole attention per sequence: its
     * positions come from the sequences' own lengths. */
    const struct { int64_t value; const char *name; } slice[4] = {
        {params->q_offset, "params.q_offset"}, {params->k_offset, "params.k_offset"},
        {params->q_total, "params.q_total"},   {params->k_total, "params.k_total"}};
    for (int i = 0; i < 4; i++)
        if (slice[i].value != 0)
            return attn__fail_arg(ATTN_ERR_INVALID, slice[i].name,
                                  "%s is %lld; %s computes whole sequences (positions come from "
                                  "each sequence's own lengths): leave it 0",
                                  slice[i].name, (long long)slice[i].value, call);
    if (params->lse_for_backward != 0 && !has_backward)
        return attn__fail_arg(ATTN_ERR_INVALID, "params.lse_for_backward",
                              "params.lse_for_backward is set, but %s has no backward pass; its "
                              "lse is always exact",
                              call);
    return ATTN_OK;
}

const char *attn__serving_name(const attn_sdpa_params *params, attn__role_id role) {
    if (role < ATTN__NAMED_ROLES && params->arg_names != NULL && params->arg_names[role] != NULL)
        return params->arg_names[role];
    return attn__role_name(role);
}

attn_status attn__serving_scalars(attn__problem *p, const attn_sdpa_params *params) {
    attn_status st = attn__problem_scalars(p, params->causal, params->has_scale, params->scale,
                                           params->dropout_p, params->seed, params->rng_offset);
    if (st != ATTN_OK) return st;
    p->cancel = attn__cancel_flag();
    return attn__problem_modifiers(p, params);
}

attn_status attn__check_index(const attn_tensor *t, const char *name, int rank,
                              const int64_t *shape, const char *expected) {
    attn_status st = attn__check_tensor(t, name, 1, ATTN__INPUT);
    if (st != ATTN_OK) return st;
    if (t->dtype != ATTN_DTYPE_I32)
        return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s is %s; expected int32 (ATTN_DTYPE_I32)",
                              name, attn_dtype_name(t->dtype));
    char got[160];
    if (t->rank != rank)
        return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s has shape %s; expected %s", name,
                              attn__shape_str(got, sizeof got, t->rank, t->shape), expected);
    for (int d = 0; shape != NULL && d < rank; d++)
        if (t->shape[d] != shape[d])
            return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s has shape %s; expected %s", name,
                                  attn__shape_str(got, sizeof got, t->rank, t->shape), expected);
    return ATTN_OK;
}

attn_status attn__serving_overlaps(const attn__named_view *writes, int nwrites,
                                   const attn__named_view *reads, int nreads) {
    for (int w = 0; w < nwrites; w++) {
        if (writes[w].t == NULL) continue;
        attn_status st = attn__check_output_layout(writes[w].t, writes[w].name);
        if (st != ATTN_OK) return st;
        for (int r = 0; r < nreads; r++)
            if (attn__views_overlap(writes[w].t, reads[r].t))
                return attn__fail_arg(ATTN_ERR_OVERLAP, writes[w].name,
                                      "%s overlaps %s in memory: attention is not computed in "
                                      "place; give %s a buffer of its own",
                                      writes[w].name, reads[r].name, writes[w].name);
        for (int w2 = w + 1; w2 < nwrites; w2++)
            if (attn__views_overlap(writes[w].t, writes[w2].t))
                return attn__fail_arg(ATTN_ERR_OVERLAP, writes[w2].name,
                                      "%s and %s overlap in memory", writes[w].name,
                                      writes[w2].name);
    }
    return ATTN_OK;
}

attn_status attn__serving_sizes(attn__problem *p, const char *qname) {
    p->nbatch = 1;
    for (int d = 0; d < p->nb; d++)
        if (attn__mul_overflows(p->nbatch, p->bshape[d], &p->nbatch))
            return attn__fail_arg(ATTN_ERR_OVERFLOW, qname, "the batch size overflows 64 bits");
    int64_t rows, cells, outs;
    if (attn__mul_overflows(p->nbatch, p->L, &rows) || attn__mul_overflows(rows, p->S, &cells) ||
        attn__mul_overflows(rows, p->Ev, &outs))
        return attn__fail_arg(ATTN_ERR_OVERFLOW, qname,
                              "batch x L x S = %lld x %lld x %lld overflows 64 bits",
                              (long long)p->nbatch, (long long)p->L, (long long)p->S);
    p->q_pos0 = p->k_pos0 = 0; /* a whole attention per sequence */
    p->L_total = p->L;
    p->S_total = p->S;
    return ATTN_OK;
}
