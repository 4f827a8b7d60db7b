/*
 * encoder.h — what the parts of torch.nn.TransformerEncoderLayer share:
 * module.c (configuration, create/destroy, parameters by torch's names) and
 * forward.c (the forward pass on attn_mha, the BLAS GEMM and the row steps
 * of rows.inc).
 */
#ifndef ATTN_ENCODER_ENCODER_H
#define ATTN_ENCODER_ENCODER_H

#include "../core/internal.h"

/* The layer's own parameters (the attention's live in self_attn). */
enum { ATTN__ENC_OWN_PARAMS = 8 };

typedef struct attn__enc_param {
    const char *name;
    int rank;
    int64_t shape[2];
    int64_t offset; /* elements into storage */
} attn__enc_param;

struct attn_encoder_layer {
    attn_encoder_layer_config cfg;
    attn_mha *self_attn; /* embed_dim d_model, nhead heads, self-attention */
    int nown;            /* linear1/2, norm1/2 weights (and biases) */
    attn__enc_param own[ATTN__ENC_OWN_PARAMS];
    void *storage;       /* the own parameters, contiguous, in cfg.dtype */
    int64_t storage_count; /* ... this many elements */
};

/* The storage of own parameter `name`, or NULL when the layer has none by
 * that name (the biases when cfg.bias is 0). */
void *attn__enc_param_data(const attn_encoder_layer *layer, const char *name);

#endif
