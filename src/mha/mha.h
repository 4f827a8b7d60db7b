/*
 * mha.h — what the two halves of torch.nn.MultiheadAttention share:
 * module.c (configuration, create/destroy, parameters and their
 * initialisation) and forward.c (the forward steps).
 */
#ifndef ATTN_MHA_MHA_H
#define ATTN_MHA_MHA_H

#include "../core/internal.h"

enum { ATTN__MHA_MAX_PARAMS = 8 };

typedef struct attn__mha_param {
    const char *name;
    int rank;
    int64_t shape[3];
    int64_t offset; /* elements into storage */
} attn__mha_param;

struct attn_mha {
    attn_mha_config cfg; /* derived fields filled in */
    int64_t D;           /* num_heads * head_dim */
    bool packed;         /* one in_proj_weight (kdim == vdim == embed_dim) */
    int nparam;
    attn__mha_param param[ATTN__MHA_MAX_PARAMS];
    void *storage;       /* every parameter, contiguous, in cfg.dtype */
};

/* The storage of the parameter called `name` (contiguous, in the module's
 * dtype), or NULL when this module has none by that name. */
void *attn__mha_param_data(const attn_mha *m, const char *name);

/* Copies any strided tensor into a contiguous destination of the same shape,
 * converting float32 <-> float64. */
void attn__mha_copy_strided(const attn_tensor *src, void *dst, attn_dtype dst_dtype);

#endif /* ATTN_MHA_MHA_H */
