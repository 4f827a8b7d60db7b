/*
 * mha.h — what the parts of torch.nn.MultiheadAttention share:
 * module.c (configuration, create/destroy, parameters and their
 * initialisation), forward.c (the forward steps) and backward.c (the
 * backward steps, which reuse the forward's shapes, buffers and heads).
 */
#ifndef ATTN_MHA_MHA_H
#define ATTN_MHA_MHA_H

#include "../core/internal.h"
#include "../problem/problem.h"

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
/* Every parameter of m as one 1-D view (the last one's end): what an
 * output must not overlap. */
attn_tensor attn__mha_storage_view(const attn_mha *m);

/* The draws of the parameters' initialisation: Philox-4x32-10 keyed by
 * init_seed, one counter per draw, on a stream of its own per module kind
 * (so an encoder layer's linear layers never repeat its attention's
 * draws). attn__init_uniform01 gives a value in (0, 1) with 53 bits. */
typedef struct attn__init_rng {
    uint64_t seed, counter;
    uint32_t stream;
} attn__init_rng;
double attn__init_uniform01(attn__init_rng *r);

/* Copies any strided tensor into a contiguous destination of the same shape,
 * converting float32 <-> float64 and widening float16/bfloat16 (bool stays
 * bool). */
void attn__mha_copy_strided(const attn_tensor *src, void *dst, attn_dtype dst_dtype);
/* attn__mha_copy_strided into a parameter's storage: a src that shares memory
 * with it (a transposed view of the parameter itself) is staged through a
 * buffer first, so the copy reads it whole before writing. */
attn_status attn__mha_set_from(const attn_tensor *src, void *dst, attn_dtype dst_dtype);
/* The reverse: a contiguous buffer of dst's shape and dtype into the view dst. */
void attn__mha_copy_dense(const void *src, const attn_tensor *dst);

/* ---- one forward call: shapes, workspace, heads (forward.c) ---- */

/* The shapes of one call, all in (batch, time, features) order. */
typedef struct attn__mha_shapes {
    bool batched;
    bool batch_first;       /* this call's: params.batch_first, else the config's */
    int64_t N, L, S, S_ext; /* S_ext = S + add_bias_kv + add_zero_attn */
    attn_tensor query, key, value; /* rank-3 (N, T, F) views */
} attn__mha_shapes;

/*
 * Projected Q (N, L, D), K and V (N, S_ext, D), the attention output
 * O (N, L, D), its lse (N, H, L) when the call saves for a backward and,
 * for averaged weights, all heads' weights (N, H, L, S_ext). The layout
 * follows the query: sequence-major inputs keep sequence-major buffers, so
 * a (L, N, E) input is one GEMM. For self-attention (one tensor as query,
 * key and value) Q, K and V are the three column blocks of one (rows, 3D)
 * product with in_proj_weight, as in torch.
 */
typedef struct attn__mha_work {
    bool seq_major;         /* rows ordered (t, n), else (n, t)               */
    bool fused_qkv;         /* Q, K, V interleaved: rows of width 3D          */
    int64_t qsN, qsT;       /* Q: element strides of n and t (columns: 1)     */
    int64_t ksN, ksT;       /* K and V alike                                  */
    int64_t osN, osT;       /* O alike                                        */
    char *qkv;              /* the block holding Q, K and V                   */
    char *Q, *K, *V;        /* (N, L, D), (N, S_ext, D), (N, S_ext, D) in qkv */
    void *O;                /* (N, L, D)                                      */
    void *lse;              /* (N, H, L) when saving, else NULL               */
    void *W_all;            /* (N, H, L, S_ext) when averaging, else NULL     */
    attn_tensor am, kpm;    /* the masks over (N, H, L, S) (mask_views)       */
    attn_tensor am_pad, kpm_pad;        /* ... padded to S_ext, or owned copies */
    const attn_tensor *am_use, *kpm_use; /* what attend reads, or NULL        */
    void *am_pad_data, *kpm_pad_data;   /* owned by the workspace             */
    bool causal_in_mask;    /* the causal triangle is folded into am_pad      */
} attn__mha_work;

/* Every head of Q, K, V, O as a strided view, and where the weights go. */
typedef struct attn__mha_heads {
    attn_tensor q, k, v, o; /* (N, H, L, hd), (N, H, S_ext, hd) x 2, (N, H, L, hd) */
    attn_tensor w;          /* (N, H, L, S_ext)                                    */
    attn_tensor *weights;   /* &w, or NULL for need_weights=False                  */
    attn_tensor lse;        /* (N, H, L), when the work has an lse buffer          */
} attn__mha_heads;

/* Checks query, key and value (value may be NULL) against the module and
 * params and fills in the call's shapes. */
attn_status attn__mha_resolve_shapes(const attn_mha *m, const attn_mha_forward_params *p,
                                     const attn_tensor *query, const attn_tensor *key,
                                     const attn_tensor *value, attn__mha_shapes *s);
/* A rank-3 (N, T, F) view of a batched (T, N, F)/(N, T, F) or unbatched
 * (T, F) tensor (unbatched: a broadcast batch of 1). */
attn_tensor attn__mha_to_ntf(const attn_tensor *t, bool batched, bool batch_first);
/* The heads of the work's buffers as (N, H, T, hd) views. */
void attn__mha_split_heads(const attn_mha *m, const attn__mha_shapes *s,
                           const attn__mha_work *w, const attn_tensor *weights,
                           attn__mha_heads *h);
/* The attention of every head as an SDPA problem request, exactly as the
 * forward runs it (masks, causality, scale, dropout). */
void attn__mha_attend_request(const attn_mha *m, const attn_mha_forward_params *p,
                              const attn__mha_work *w, attn__mha_heads *h,
                              attn__problem_request *r);
/* Frees what the workspace owns. */
void attn__mha_work_free(attn__mha_work *w);

/* ---- what a training forward keeps for the backward ---- */

struct attn_mha_saved {
    attn_mha_config cfg;        /* the module's, to check mha and grads against   */
    attn_mha_forward_params p;  /* the call's options (mask pointers cleared)     */
    attn__mha_shapes s;         /* the call's shapes (tensor views cleared)       */
    int rank;                   /* of query, key and value                        */
    int64_t shape[3][3];        /* their shapes, as the caller gave them          */
    bool has_am, has_kpm;       /* masks kept in work.am_pad / work.kpm_pad       */
    attn__mha_work work;        /* Q, K, V, O, lse, the masks: all owned          */
};

/* Y (m x n, row stride ldy) = A (m x k, lda) · Wᵀ + bias for a contiguous W
 * (n x k) in dtype dt: attn__gemm_abt, with a bfloat16 module's products in
 * bfloat16 dot products where the kernel path has them (avx512_bf16). The
 * projections of MHA and of the encoder layer's feed-forward. */
attn_status attn__mha_gemm_abt(attn_dtype dt, int64_t m, int64_t n, int64_t k, const void *a,
                               int64_t lda, const void *w, const void *bias, void *y,
                               int64_t ldy, const volatile int *cancel);

/* Whether two configurations describe modules with the same parameters. */
bool attn__mha_same_shape(const attn_mha_config *a, const attn_mha_config *b);

#endif /* ATTN_MHA_MHA_H */
