/*
 * attn.h — exact scaled dot-product and multi-head attention for the CPU.
 *
 * This header is the documentation of libattn. Everything a caller may use is
 * declared here; everything else is private.
 *
 * Conventions
 * -----------
 *  - Every call that can fail returns an attn_status. ATTN_OK is 0.
 *    Results come back through out-parameters.
 *  - When a call fails, attn_last_error() returns a message for the calling
 *    thread naming the argument, the dimension and what was expected, e.g.
 *        "k.shape[-1] is 16 but q.shape[-1] is 8: queries and keys must have
 *         the same feature size E".
 *    attn_last_error_arg() names the argument the failure is about ("q",
 *    "attn_mask", "params.dropout_p", ...), so that bindings can map an error
 *    to their own names without reading the message. A successful call clears
 *    both to "".
 *  - Parameter structs (attn_sdpa_params, attn_mha_config,
 *    attn_mha_forward_params) begin with `struct_size`, which their _init
 *    function sets to the sizeof the caller was compiled with. Fields are only
 *    ever added at the end: the library reads the fields a caller's struct
 *    has and gives the rest their defaults, so a program built against an
 *    older attn.h keeps working with a newer library. A struct that was never
 *    initialised (struct_size 0, or above 4096) is refused with
 *    ATTN_ERR_INVALID before anything past its fields is read; one from a
 *    newer header that sets fields this library does not know, with
 *    ATTN_ERR_UNSUPPORTED.
 *  - Tensors are strided views (attn_tensor): a data pointer, a dtype, a rank,
 *    a shape and strides counted in ELEMENTS (not bytes). Input strides may be
 *    anything NumPy can produce: negative, zero (broadcast) or non-contiguous.
 *    Transposed and permuted inputs are read where they lie, never copied by
 *    the caller. Output strides may be negative or non-contiguous but must not
 *    make two elements share one address (no zero stride on a dimension > 1).
 *  - Dimensions are signed 64-bit. Every dimension must be >= 1: attn rejects
 *    empty tensors with ATTN_ERR_SHAPE rather than guess what an empty
 *    attention means. Sizes whose element or byte count does not fit in
 *    64 bits are rejected with ATTN_ERR_OVERFLOW.
 *  - Memory: attn never keeps a pointer to caller memory after a call returns,
 *    and never frees caller memory. Workspace is allocated during a call
 *    through the allocator set by attn_set_allocator(); blocks of 64 KiB and
 *    more are kept for the next call (at most 64 MiB in all, so that a call
 *    in a loop does not fault its workspace in again each time) until
 *    attn_release_workspace() or attn_set_allocator() hands them back.
 *    Objects created by attn_*_create() are freed by the matching
 *    attn_*_destroy(); destroy(NULL) is a no-op.
 *  - Outputs must not overlap inputs or each other: attn checks the address
 *    ranges and fails with ATTN_ERR_OVERLAP (in-place attention, out == q,
 *    is not supported). Nothing in the library aborts or exits.
 *  - Thread safety: every call may run concurrently with any other call on
 *    different outputs, including attn_mha_forward() on one shared attn_mha.
 *    The process-wide settings (thread count, allocator, ISA) should be set
 *    before concurrent use begins.
 *  - Stack: a call takes at most 64 KiB of the calling thread's stack (and
 *    of each worker's); its large buffers are workspace. So a thread with a
 *    small stack (musl's default is 128 KiB) can call it.
 */
#ifndef ATTN_H
#define ATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(ATTN_BUILD_SHARED)
#define ATTN_API __declspec(dllexport)
#elif defined(__GNUC__)
#define ATTN_API __attribute__((visibility("default")))
#else
#define ATTN_API
#endif

/* ------------------------------------------------------------------------ */
/* Version                                                                   */
/* ------------------------------------------------------------------------ */

#define ATTN_VERSION_MAJOR 0
#define ATTN_VERSION_MINOR 3
#define ATTN_VERSION_PATCH 0
#define ATTN_VERSION_STRING "0.3.0"
/* ATTN_VERSION_NUMBER == major * 10000 + minor * 100 + patch. */
#define ATTN_VERSION_NUMBER \
    (ATTN_VERSION_MAJOR * 10000 + ATTN_VERSION_MINOR * 100 + ATTN_VERSION_PATCH)

/* The version of the library actually linked, e.g. "0.3.0". */
ATTN_API const char *attn_version(void);
ATTN_API int attn_version_number(void);

/* ------------------------------------------------------------------------ */
/* Status                                                                    */
/* ------------------------------------------------------------------------ */

typedef enum attn_status {
    ATTN_OK = 0,
    ATTN_ERR_NULL = 1,        /* a required pointer is NULL                  */
    ATTN_ERR_INVALID = 2,     /* a value is out of range (NaN scale, p > 1)  */
    ATTN_ERR_SHAPE = 3,       /* ranks or dimensions do not fit together     */
    ATTN_ERR_DTYPE = 4,       /* element type not accepted or not matching   */
    ATTN_ERR_OVERFLOW = 5,    /* a size does not fit in 64 bits              */
    ATTN_ERR_NOMEM = 6,       /* an allocation failed                        */
    ATTN_ERR_IO = 7,          /* a file could not be opened, read, written   */
    ATTN_ERR_FORMAT = 8,      /* a file is malformed or truncated            */
    ATTN_ERR_UNSUPPORTED = 9, /* valid, but not available in this build/CPU  */
    ATTN_ERR_CANCELLED = 10,  /* stopped by the cancel flag (see below)      */
    ATTN_ERR_OVERLAP = 11,    /* an output shares memory with another operand */
    ATTN_ERR_COMM = 12        /* a peer or the communicator failed (attn_ring) */
} attn_status;

/* A fixed English sentence for a status; never NULL (unknown codes get one). */
ATTN_API const char *attn_strerror(attn_status status);

/* The detailed message of the last failed call on this thread, or "" after a
 * successful one. The pointer stays valid until the next attn call on this
 * thread. */
ATTN_API const char *attn_last_error(void);
/* The argument the last failure on this thread is about, as this header
 * names it: a parameter ("q", "out", "attn_mask"), a field of a parameter
 * struct ("params.dropout_p", "config.num_heads") or an MHA parameter
 * ("in_proj_weight"); "" when the failure is not about one argument (out of
 * memory, cancelled, I/O) or after a successful call. Valid like
 * attn_last_error(). */
ATTN_API const char *attn_last_error_arg(void);

/* ------------------------------------------------------------------------ */
/* Tensors                                                                   */
/* ------------------------------------------------------------------------ */

typedef enum attn_dtype {
    ATTN_DTYPE_F32 = 1,  /* float                                           */
    ATTN_DTYPE_F64 = 2,  /* double                                          */
    ATTN_DTYPE_BOOL = 3, /* one byte; 0 is false, anything else is true     */
    /* 16-bit floats (uint16_t bit patterns in native byte order). attn_sdpa,
     * attn_sdpa_backward, attn_sdpa_varlen and attn_sdpa_kvcache compute
     * with them (see "Dtypes" below); files carry them (safetensors, .npy
     * float16), and attn_mha_set_param and the safetensors reader convert
     * them exactly to float32/float64. MHA modules and encoder layers
     * compute in them when their config.dtype is float16 / bfloat16; each
     * takes inputs and outputs of its own config.dtype only. */
    ATTN_DTYPE_F16 = 4,  /* IEEE 754 binary16: 1 sign, 5 exponent, 10 bits  */
    ATTN_DTYPE_BF16 = 5, /* bfloat16: the top half of a float32             */
    /* Index tensors only (varlen's cu_seqlens, a KV cache's cache_seqlens and
     * block_table); every operand of a computation refuses it. */
    ATTN_DTYPE_I32 = 6   /* int32_t                                         */
} attn_dtype;

#define ATTN_MAX_RANK 8

typedef struct attn_tensor {
    void *data;                       /* element [0,...,0]                  */
    attn_dtype dtype;
    int rank;                         /* 1 .. ATTN_MAX_RANK                 */
    int64_t shape[ATTN_MAX_RANK];     /* each >= 1                          */
    int64_t strides[ATTN_MAX_RANK];   /* in elements; may be <= 0 (inputs)  */
} attn_tensor;

/* Bytes per element: 4, 8, 1, 2, 2, 4; 0 for an unknown dtype. */
ATTN_API size_t attn_dtype_size(attn_dtype dtype);
/* "float32", "float64", "bool", "float16", "bfloat16", "int32", or "unknown". */
ATTN_API const char *attn_dtype_name(attn_dtype dtype);

/* Fills *t as a C-contiguous (row-major) view of `data` with the given shape.
 * Fails with ATTN_ERR_SHAPE for a bad rank or a dimension < 1 and with
 * ATTN_ERR_OVERFLOW when the element count does not fit. */
ATTN_API attn_status attn_tensor_init(attn_tensor *t, void *data, attn_dtype dtype,
                                      int rank, const int64_t *shape);

/* Reorders the dimensions of a view in place: new dim i is old dim perm[i].
 * No data moves. (attn_tensor_transpose swaps two dimensions; negative
 * indices count from the end.) */
ATTN_API attn_status attn_tensor_permute(attn_tensor *t, const int *perm);
ATTN_API attn_status attn_tensor_transpose(attn_tensor *t, int dim0, int dim1);

/* Element count (product of the shape), or -1 if the view is invalid. */
ATTN_API int64_t attn_tensor_numel(const attn_tensor *t);

/* dst = src element by element, any strides, converted to dst's dtype: a
 * float dtype to any float dtype (float32, float64, float16, bfloat16;
 * each value rounded once, to nearest even: float16 overflows to infinity
 * past 65504), bool to bool. Same rank and shape, or ATTN_ERR_SHAPE;
 * ATTN_ERR_DTYPE between bool and a float (or for int32); dst is checked as
 * every output is (no two elements at one address), and ATTN_ERR_OVERLAP
 * when it shares memory with src. */
ATTN_API attn_status attn_tensor_convert(const attn_tensor *src, attn_tensor *dst);

/* ------------------------------------------------------------------------ */
/* Scaled dot-product attention                                              */
/* ------------------------------------------------------------------------ */
/*
 *   out = dropout(softmax(scale * q·kᵀ + mask)) · v
 *
 * with exactly the semantics of PyTorch 2.13's
 * torch.nn.functional.scaled_dot_product_attention, plus the extensions
 * marked [attn].
 *
 * Shapes (rank r >= 2; "..." are batch dimensions, the last of which is the
 * head dimension when r >= 3):
 *   q       (..., Hq, L, E)
 *   k       (..., H,  S, E)
 *   v       (..., H,  S, Ev)     E != Ev and L != S are fine
 *   out     (B..., Hq, L, Ev)    B... = broadcast of the batch dims of q, k, v
 *   weights (B..., Hq, L, S)     optional: softmax(...) after dropout, so that
 *                                out == weights · v (as torch MHA returns them)
 *   lse     (B..., Hq, L)        optional: log(sum_j exp(scale*q·k_j + mask_j)),
 *                                natural log, before dropout
 * The batch dimensions of q, k and v broadcast like NumPy (right-aligned,
 * size 1 stretches); ranks may differ. With enable_gqa, the head dimension is
 * instead grouped: Hq must be a multiple of H (and of v's head count), and
 * query head h reads key/value head h / (Hq / H) without copies.
 *
 * attn_mask: broadcastable to (B..., Hq, L, S) (rank <= 2 + batch rank).
 *   bool:  true = the key takes part, false = it is masked out.
 *   float (any float dtype): added to the scaled scores. -inf masks out.
 *
 * Causal masking (ATTN_CAUSAL_*): query i may see key j iff
 *   top-left     (PyTorch's is_causal=True):  j <= i
 *   bottom-right [attn] (KV-cache decoding):   j <= i + (S - L)
 * [attn] A mask and causal masking may be combined: a key takes part only if
 * both allow it. (PyTorch refuses the combination.)
 *
 * Masked-out keys are removed from the row before anything is computed with
 * them: a NaN or Inf in a masked-out key or value never reaches the output.
 * A row whose keys are all masked out gives out = 0, weights = 0, lse = -inf
 * (PyTorch >= 2.5 returns 0 too). NaN in a query, or in a key, value or float
 * mask entry that takes part, gives NaN in the affected rows, as in PyTorch.
 * Scores whose float32 sums would overflow (finite q·k beyond ±3.4e38) are
 * taken in float64 for their rows, so a row whose every score is below
 * -3.4e38 still attends to its largest; a float32 lse beyond float32's range
 * is stored as -FLT_MAX or FLT_MAX (-inf is kept for a row with no key).
 *
 * Dropout [attn: reproducible]: each weight is kept with probability 1 - p
 * and, if kept, scaled by 1 / (1 - p). The keep decision for weight
 * (b, h, i, j) is a pure function of (seed, rng_offset, its linear index in
 * the weights shape) through a Philox-4x32-10 counter-based generator, so the
 * same call always gives the same result on any thread count and ISA path,
 * and a backward pass can regenerate the mask. p = 1 gives out = 0.
 */

typedef enum attn_causal {
    ATTN_CAUSAL_NONE = 0,
    ATTN_CAUSAL_TOP_LEFT = 1,     /* PyTorch is_causal=True */
    ATTN_CAUSAL_BOTTOM_RIGHT = 2  /* aligned to the last key */
} attn_causal;

typedef struct attn_sdpa_params {
    size_t struct_size;           /* sizeof(attn_sdpa_params); set by _init */
    const attn_tensor *attn_mask; /* NULL for none                          */
    attn_causal causal;
    int has_scale;                /* 0: scale = 1/sqrt(E)                    */
    double scale;                 /* used when has_scale; any finite value   */
    int enable_gqa;
    double dropout_p;             /* in [0, 1]                               */
    uint64_t seed;                /* dropout stream                          */
    uint64_t rng_offset;          /* [attn] sub-stream, e.g. layer or step   */
    /* [attn] What messages and attn_last_error_arg() call q, k, v, out,
     * weights and lse: an array of six names in that order, any of which
     * may be NULL (keeps the C name), or NULL for all C names. A binding
     * passes its own (the Python package: "query", "key", "value", ...). */
    const char *const *arg_names;
    /* [attn] The lse output for a backward pass: 1 gives the log-sum-exp of
     * the scores as the fused kernels round them, so that the weights
     * attn_sdpa_backward recomputes from it sum to 1 (their gradients come
     * out about half as far from the exact ones as with the exact lse). 0,
     * the default: the row's largest score recomputed in float64, so lse
     * carries no error from the float32 scores' rounding, only the float32
     * sum of the weights' own (an absolute error of at most about S·2^-24,
     * typically far less; the reference path rounds an all-float64 value
     * once). Float32 only (float64 calls
     * always give the exact lse, which serves the backward there). */
    int lse_for_backward;
    /* [attn] This call is a slice of a larger attention: query row i is
     * position q_offset + i of q_total positions, key j position
     * k_offset + j of k_total. Causal alignment (bottom-right: to k_total -
     * q_total) and dropout (the keep mask of the whole (..., q_total,
     * k_total) weights) are then those of the whole attention, so slices
     * computed apart (by key ranges, query ranges, ranks of a ring) and
     * merged with attn_sdpa_merge give the whole call's result. q_total = 0
     * (the default) means L, k_total = 0 means S; otherwise offset + length
     * must not exceed the total, and offsets are >= 0. attn_mask,
     * weights and lse are the slice's own. */
    int64_t q_offset, k_offset, q_total, k_total;

    /* ---- [attn] score modifiers (serving; FlashAttention's meanings) ----
     * In the order they act on the score of query i and key j:
     *   s = scale · q_i·k_j
     *   s = softcap · tanh(s / softcap)           when softcap > 0
     *   s = s - slope · |i + S - L - j|           with alibi_slopes
     *   s = s + attn_mask_ij                      float masks
     * and key j takes part only where causality, every mask and the window
     * all allow it. Positions and lengths are the whole attention's
     * (q_offset + i of q_total; k_offset + j of k_total), and in
     * attn_sdpa_varlen / attn_sdpa_kvcache each sequence's own. */

    /* Sliding window (FlashAttention's window_size = (left, right)): key j
     * takes part only when i + S - L - window_left <= j <= i + S - L +
     * window_right. -1 leaves that side unbounded (the default for both,
     * set by attn_sdpa_params_init); other values must be >= 0. Key blocks
     * wholly outside every row's window are never visited, so the cost
     * follows the window, not S. */
    int64_t window_left, window_right;
    /* ALiBi (FlashAttention's alibi_slopes): slopes of any float dtype, one
     * per query head, broadcastable to the batch dimensions of out (shape
     * (Hq,) or (B, Hq) for out (B, Hq, L, Ev)); finite (an infinite slope is
     * ATTN_ERR_INVALID; NaN gives NaN rows). NULL: none. */
    const attn_tensor *alibi_slopes;
    /* Logit soft-capping (FlashAttention's softcap, Gemma 2's): > 0 caps,
     * 0 (the default) does not; finite, >= 0. */
    double softcap;
    /* Attention sinks (gpt-oss; ggml's and ONNX Runtime's head sink): one
     * logit per query head, any float dtype, broadcastable to the batch
     * dimensions of out (shape (Hq,)). Each row's softmax denominator gains
     * exp(sink), which carries no value: out = Σ_j exp(s_j - lse) v_j with
     * lse = log(exp(sink) + Σ_j exp(s_j)), and the weights are
     * exp(s_j - lse) (a row sums to less than 1). A row that sees no key
     * gives out = 0 and lse = sink. A sink is finite, or -inf (none there);
     * +inf is refused (ATTN_ERR_INVALID); NaN gives NaN rows. In a slice
     * (k_offset, k_total) the sink
     * belongs to the slice holding key 0 (k_offset = 0), as if it were one
     * more key there, so merged slices give the whole call's result. Its
     * gradient: attn_sdpa_sinks_backward. NULL: none. */
    const attn_tensor *sinks;
} attn_sdpa_params;

/* The defaults: no mask, not causal, default scale, no GQA, no dropout, no
 * window (-1, -1), no ALiBi, softcap or sinks. */
ATTN_API void attn_sdpa_params_init(attn_sdpa_params *params);

/* Dtypes (attn_sdpa, attn_sdpa_backward, attn_sdpa_varlen; attn_sdpa_kvcache
 * has its cache's rules):
 *   - q, k, v are float32, float64, float16 or bfloat16; k and v share one
 *     dtype; q has it too, or is float32 over float16/bfloat16 k and v (a
 *     low-precision KV cache).
 *   - out and weights have q's dtype; lse is float32 (float64 for float64
 *     queries) or float64.
 *   - float masks, ALiBi slopes and sinks: any float dtype.
 * Each broken rule is ATTN_ERR_DTYPE naming the argument. A call with
 * 16-bit operands computes as a float32 call would on their (exact) float32
 * values: scores, softmax and sums in float32 (float64 where the float32
 * call uses it), then each 16-bit output is the float32 result rounded
 * once, to nearest even (o / l formed in float64, so it is not rounded
 * twice). float16 overflows to infinity past 65504, as rounding does.
 * One exception, on the ATTN_ISA_AVX512_BF16 and ATTN_ISA_AMX paths (the
 * latter multiplies on AMX tiles, the same rules): a bfloat16 call (q, k
 * and v all bfloat16) multiplies in bfloat16 where it processes many query
 * rows at once (prefill): each product is exact and summed in float32 as
 * before, but the weights P are rounded to bfloat16 before P·V, as
 * PyTorch's bfloat16 attention does, and come from a shorter exp2 (within
 * 3e-6 of the float32 one's value, far under that rounding), which moves
 * each output by at most (2^-8 + 6e-6) · sum_j P_j·|v_j| / sum_j P_j
 * (<= that times max |v|) and the lse by at most 3e-6; bfloat16 inputs
 * below 2^-126 count as 0 there.
 * ATTN_ISA=avx512 (or attn_set_isa) keeps such calls on float32 products,
 * as the automatic choice does on an Intel CPU without AMX (cpu.c).
 *
 * Computes attention into caller-allocated outputs.
 *   q, k, v   inputs (see Dtypes)
 *   params    NULL for the defaults
 *   out       required, q's dtype, shape (B..., Hq, L, Ev)
 *   weights   optional (NULL), q's dtype, shape (B..., Hq, L, S)
 *   lse       optional (NULL), float32 (float64 queries: float64) or
 *             float64, shape (B..., Hq, L); a float32 call's lse in float64
 *             is not rounded to float32 (for attn_sdpa_backward, whose
 *             weights would inherit that rounding)
 * Asking for weights costs an L x S write; without them the fused kernels
 * keep no L x S buffer.
 * Accuracy: the reference path (ATTN_ISA_REF) accumulates in float64 and
 * rounds once. The fused paths compute float32 scores in float32 (summed in
 * float64 for tiny calls, up to 32K multiply-adds), and recompute in
 * float64 any row that came out non-finite or, in float32, whose largest
 * |score * scale| reaches 256, so huge logits stay exact to rounding.
 * Results do not depend on the thread count (bitwise). */
ATTN_API attn_status attn_sdpa(const attn_tensor *q, const attn_tensor *k,
                               const attn_tensor *v, const attn_sdpa_params *params,
                               attn_tensor *out, attn_tensor *weights, attn_tensor *lse);

/* [attn] Merges attention over a further set of keys into a result:
 *   out, lse        a result so far (out normalised over its keys, lse their
 *                   log-sum-exp; lse = -inf: no key yet, out is then ignored)
 *   part_out, part_lse  attention of the same queries over other keys
 * leave out, lse as attention over both key sets:
 *   lse' = log(exp(lse) + exp(part_lse)),
 *   out' = exp(lse - lse') · out + exp(part_lse - lse') · part_out
 * computed in float64 (the weights measured from the larger lse) and
 * rounded once per call. An lse of magnitude 1e16 and more (keys masked
 * with -FLT_MAX) no longer carries the log of its key count in float64:
 * two such parts merge as if they held equally many keys (attn_sdpa's own
 * key chunks recompute such rows whole instead). A part with lse = -inf
 * (no key) or whose weight is exactly 0 changes nothing, not even with a
 * NaN or Inf in its out; a NaN lse gives NaN. out and part_out are
 * (..., L, Ev), lse and part_lse (..., L) of the same shapes; out and
 * part_out of any float dtype, lse and part_lse float32 or float64, each
 * independently (accumulate in float64 for the fewest roundings);
 * out and lse are read and written in place and must not overlap the parts
 * or each other. Merging parts in a fixed order gives fixed bits. */
ATTN_API attn_status attn_sdpa_merge(attn_tensor *out, attn_tensor *lse,
                                     const attn_tensor *part_out, const attn_tensor *part_lse);

/* The shape `out` must have for these inputs (the weights shape is the same
 * with the last dimension replaced by S; lse drops the last dimension).
 * Validates everything attn_sdpa would, except the outputs. */
ATTN_API attn_status attn_sdpa_out_shape(const attn_tensor *q, const attn_tensor *k,
                                         const attn_tensor *v,
                                         const attn_sdpa_params *params, int *rank,
                                         int64_t shape[ATTN_MAX_RANK]);

/* The backward pass [attn]: gradients of attn_sdpa's output.
 *
 * Given dout = dLoss/dout and what the forward call took and gave (q, k, v,
 * the same params, its out and its lse), computes
 *   dq = dLoss/dq, dk = dLoss/dk, dv = dLoss/dv, dmask = dLoss/d attn_mask
 * FlashAttention-2's way: the weights are recomputed block by block from lse
 * (no L x S buffer), with D = rowsum(dout * out).
 *   dout    (B..., Hq, L, Ev)  like out
 *   out     (B..., Hq, L, Ev)  the forward's output
 *   lse     (B..., Hq, L)      the forward's log-sum-exp (attn_sdpa's lse,
 *                              best with params->lse_for_backward set and in
 *                              float64); as attn_sdpa's lse
 *   dq, dk, dv                 shaped like q, k, v, same dtype; each may be
 *                              NULL when that gradient is not wanted
 *   dmask                      optional: shaped like params->attn_mask, which
 *                              must then be a float mask; same dtype as it
 * dout and out have q's dtype (Dtypes above). With 16-bit operands the
 * gradients are the float32 computation's, each rounded once: a 16-bit out
 * is computed again in float32 for D (one more forward, float32 products,
 * and a float32 copy of out's size), since D from the rounded out (as
 * FlashAttention's) costs dq and dk up to 5x PyTorch's error where PyTorch
 * forms D from unrounded weights. A gradient sums over everything its
 * input was broadcast to: dk and dv over the query heads of a GQA group,
 * dmask over the dimensions where the mask has size 1, any of them over
 * batch dimensions where its input had size 1. Dropout is replayed from
 * params' seed and rng_offset: the same keep mask as the forward call.
 * Rows that saw no key (lse = -inf) contribute nothing and get dq = 0.
 * Terms whose weight is exactly 0 (masked, dropped) are skipped as in the
 * forward, so a NaN or Inf in a masked-out key or value reaches no
 * gradient; NaN in a term that takes part gives NaN where it flows.
 * Accumulation: the reference path (ATTN_ISA_REF) in float64; the fused
 * paths in the compute type, in an order fixed by the shape, so gradients
 * are bitwise identical for any thread count. As in the forward, float32
 * scores of magnitude >= 256 are too coarse: a float32 call where some
 * |lse| reaches 256 runs on the float64 reference, as does one whose fused
 * gradients come out non-finite. Extra memory: two vectors of
 * L per head and dq's size in the compute type (its partial sum), or, when
 * there are few heads to share among threads, one partial dq per key chunk,
 * as many as fit in 32 MiB; plus float64 sums where a gradient reduces
 * over a broadcast batch dimension. */
ATTN_API attn_status attn_sdpa_backward(const attn_tensor *dout, const attn_tensor *q,
                                        const attn_tensor *k, const attn_tensor *v,
                                        const attn_tensor *out, const attn_tensor *lse,
                                        const attn_sdpa_params *params, attn_tensor *dq,
                                        attn_tensor *dk, attn_tensor *dv, attn_tensor *dmask);

/* [attn] The gradient of the loss with respect to params->sinks:
 *   dsinks_h = - Σ_{rows of head h} exp(sink_h - lse_row) · (dout_row · out_row)
 * summed over every batch index that reads sink h (in a fixed order, in
 * float64, rounded once). dout, out and lse are those of attn_sdpa_backward
 * (its dq, dk, dv already account for the sinks through lse); dsinks is
 * shaped like params->sinks, same dtype. Rows with lse = -inf take no part.
 * It reads out as given: a float32 out where the call had one gives the
 * float32 computation's dsinks (attn_sdpa_backward forms its D so); a
 * 16-bit out carries its rounding into each row's term. */
ATTN_API attn_status attn_sdpa_sinks_backward(const attn_tensor *dout, const attn_tensor *out,
                                              const attn_tensor *lse,
                                              const attn_sdpa_params *params,
                                              attn_tensor *dsinks);

/* ------------------------------------------------------------------------ */
/* Serving: variable-length batches and KV caches [attn]                    */
/* ------------------------------------------------------------------------ */
/*
 * FlashAttention's flash_attn_varlen_func and flash_attn_with_kvcache, on the
 * same fused kernels as attn_sdpa and with every attn_sdpa_params field that
 * makes sense there (causal, scale, window, ALiBi, softcap, sinks, dropout;
 * no attn_mask, no slices). GQA is implicit, as in FlashAttention: Hq must be
 * a multiple of Hkv. In FlashAttention causal attention is always aligned
 * bottom-right; here params->causal says which, and the bindings pass
 * ATTN_CAUSAL_BOTTOM_RIGHT for causal=True. Index tensors are int32.
 */

/* Packed sequences, no padding: sequence n is rows cu_seqlens_q[n] ..
 * cu_seqlens_q[n+1]-1 of q and out, and rows cu_seqlens_k[n] ..
 * cu_seqlens_k[n+1]-1 of k and v; it attends only to its own keys, aligned
 * to its own lengths.
 *   q             (total_q, Hq, E)
 *   k             (total_k, Hkv, E)
 *   v             (total_k, Hkv, Ev)
 *   cu_seqlens_q  int32 (B + 1,): 0, then non-decreasing, last <= total_q
 *   cu_seqlens_k  int32 (B + 1,): the same for total_k
 *   max_seqlen_q, max_seqlen_k   >= every sequence's length (FlashAttention
 *                 sizes its grid by them; here they are checked)
 *   out           (total_q, Hq, Ev), q's dtype; rows no sequence holds are
 *                 left as they were
 *   lse           optional (Hq, total_q), as attn_sdpa's lse
 * Dtypes: attn_sdpa's.
 * An empty sequence (equal offsets) is allowed and computes nothing. */
ATTN_API attn_status attn_sdpa_varlen(const attn_tensor *q, const attn_tensor *k,
                                      const attn_tensor *v, const attn_tensor *cu_seqlens_q,
                                      const attn_tensor *cu_seqlens_k, int64_t max_seqlen_q,
                                      int64_t max_seqlen_k, const attn_sdpa_params *params,
                                      attn_tensor *out, attn_tensor *lse);

/* The backward pass of attn_sdpa_varlen (FlashAttention's varlen backward):
 * dq, dk, dv from dout and the forward's q, k, v, out and lse, with the same
 * offsets and params. As for attn_sdpa_backward, lse is best asked of the
 * forward with params->lse_for_backward set (the lse of the scores the
 * backward recomputes); dropout is replayed from params' seed and
 * rng_offset.
 *   dout          (total_q, Hq, Ev), q's dtype, like out
 *   out, lse      the forward's: (total_q, Hq, Ev) and (Hq, total_q)
 *   dq, dk, dv    each optional (NULL: not computed), shaped and typed like
 *                 q, k, v; dk and dv sum the Hq / Hkv query heads of a group
 * Rows no sequence holds (past cu_seqlens_q[B], cu_seqlens_k[B]) get 0, as
 * do keys no query row sees. Everything else is attn_sdpa_backward's:
 * accumulation, bitwise identical results for any thread count, NaN rules. */
ATTN_API attn_status attn_sdpa_varlen_backward(
    const attn_tensor *dout, const attn_tensor *q, const attn_tensor *k, const attn_tensor *v,
    const attn_tensor *out, const attn_tensor *lse, const attn_tensor *cu_seqlens_q,
    const attn_tensor *cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    const attn_sdpa_params *params, attn_tensor *dq, attn_tensor *dk, attn_tensor *dv);

/* [attn] The gradient of attn_sdpa_varlen's params->sinks, attn_sdpa_sinks_backward's
 * formula over packed sequences: for sequence n and query head h,
 *   - Σ_{rows r of n} exp(sink_nh - lse[h, r]) · (dout[r, h] · out[r, h])
 * summed over what params->sinks was broadcast over (any shape that
 * broadcasts to the batch (B sequences, Hq heads): (Hq,), (B, Hq), (B, 1),
 * (1, Hq), ...), in float64 in (sequence,
 * head, row) order, rounded once. attn_sdpa_varlen_backward's dq, dk, dv
 * already account for the sinks through lse; only params->sinks is read
 * of params.
 *   dout, out     (total_q, Hq, Ev), one float dtype: the forward's out and
 *                 the loss's gradient of it
 *   lse           (Hq, total_q), the forward's (float32, float64 for float64
 *                 out, or float64)
 *   cu_seqlens_q  the forward's: int32 (B + 1,)
 *   dsinks        shaped and typed like params->sinks
 * Rows no sequence holds and rows with lse = -inf take no part. */
ATTN_API attn_status attn_sdpa_varlen_sinks_backward(const attn_tensor *dout,
                                                     const attn_tensor *out,
                                                     const attn_tensor *lse,
                                                     const attn_tensor *cu_seqlens_q,
                                                     const attn_sdpa_params *params,
                                                     attn_tensor *dsinks);

/* Decoding (and chunked prefill) against a KV cache. First the new rows k, v
 * (when given) are written into the cache in place at rows cache_seqlens[b]
 * .. cache_seqlens[b] + Lnew - 1 of sequence b; then q attends to rows
 * 0 .. cache_seqlens[b] + Lnew - 1 of it. The caller owns the cache and
 * advances cache_seqlens itself; attn never reallocates it, and a write past
 * its capacity is refused before anything is written (ATTN_ERR_SHAPE naming
 * cache_seqlens). Rows past the filled length are never read. A decode
 * step streams every filled row once, and a cache on transparent huge pages
 * streams faster than one on 4 KiB pages (docs/design.md, "KV caches on
 * huge pages"): attn_alloc's blocks of 32 MiB or more are advised onto
 * them under the default allocator, as is memory a caller passes to
 * madvise(MADV_HUGEPAGE).
 *   q             (B, Lq, Hq, E)
 *   k_cache       contiguous: (B, S_max, Hkv, E);
 *                 paged (with block_table): (num_blocks, block_size, Hkv, E)
 *   v_cache       likewise with Ev
 *   k, v          optional new rows (B, Lnew, Hkv, E / Ev), both or neither;
 *                 they need cache_seqlens
 *   cache_seqlens optional int32 (B,): rows already filled; NULL: every row
 *                 of the cache (S_max, or max_blocks · block_size) is filled
 *   block_table   optional int32 (B, max_blocks): sequence b's row r lives in
 *                 block block_table[b, r / block_size], row r % block_size;
 *                 entries past the rows in use are not read
 *   out           (B, Lq, Hq, Ev), q's dtype
 *   lse           optional (B, Hq, Lq), as attn_sdpa's lse
 * q may be any float dtype (16-bit queries compute as attn_sdpa's do); new
 * rows k, v have q's dtype. The cache has q's dtype or a 16-bit one
 * (ATTN_DTYPE_F16, ATTN_DTYPE_BF16), converted exactly as it is read; new
 * rows are rounded to the cache's dtype (to nearest even) as they are
 * written, and attention reads them from the cache. Written rows must not
 * be shared by two sequences' blocks (ATTN_ERR_OVERLAP naming block_table).
 * If the attention itself then fails (out of memory, cancelled), the written
 * rows stay: they lie past cache_seqlens, which the caller has not advanced. */
ATTN_API attn_status attn_sdpa_kvcache(const attn_tensor *q, attn_tensor *k_cache,
                                       attn_tensor *v_cache, const attn_tensor *k,
                                       const attn_tensor *v, const attn_tensor *cache_seqlens,
                                       const attn_tensor *block_table,
                                       const attn_sdpa_params *params, attn_tensor *out,
                                       attn_tensor *lse);

/* ------------------------------------------------------------------------ */
/* Multi-head attention                                                      */
/* ------------------------------------------------------------------------ */
/*
 * torch.nn.MultiheadAttention, parameter for parameter:
 *
 *   Q = query · Wqᵀ + bq,  K = key · Wkᵀ + bk,  V = value · Wvᵀ + bv
 *   split into num_heads heads of head_dim features
 *   [add_bias_kv: append bias_k / bias_v as one more key/value row]
 *   [add_zero_attn: append a zero key/value row per head]
 *   O_h = attention(Q_h, K_h, V_h) with scale 1/sqrt(head_dim)
 *   out = concat_h(O_h) · Woᵀ + bo
 *
 * Parameters (PyTorch names; D = num_heads * head_dim, E = embed_dim):
 *   in_proj_weight  (3D, E)       when kdim == vdim == E
 *   q_proj_weight   (D, E)        otherwise, with
 *   k_proj_weight   (D, kdim)
 *   v_proj_weight   (D, vdim)
 *   in_proj_bias    (3D)          when bias
 *   bias_k, bias_v  (1, 1, D)     when add_bias_kv
 *   out_proj.weight (E, D)
 *   out_proj.bias   (E)           when bias
 * PyTorch requires num_heads to divide embed_dim (head_dim = E / num_heads,
 * D = E). [attn] An explicit head_dim lifts that: D = num_heads * head_dim.
 *
 * Layouts (N batch, L target length, S source length):
 *   query (L, N, E)    or (N, L, E) with batch_first, or (L, E) unbatched
 *   key   (S, N, kdim) or (N, S, kdim),                or (S, kdim)
 *   value (S, N, vdim) or (N, S, vdim),                or (S, vdim)
 *   out   shaped like query
 *   weights (N, L, S') averaged over heads, or (N, num_heads, L, S');
 *     unbatched (L, S') or (num_heads, L, S'); S' = S + add_bias_kv + add_zero_attn
 *   key_padding_mask (N, S), unbatched (S): bool true = ignore this key;
 *     float: added
 *   attn_mask (L, S) or (N * num_heads, L, S): bool true = NOT allowed to
 *     attend (the opposite of attn_sdpa's bool masks, as in PyTorch);
 *     float: added
 *
 * is_causal: keys after the query position are masked out (top-left). Unlike
 * PyTorch, where is_causal is only a hint about attn_mask, attn applies the
 * causal mask and combines it with any attn_mask. With a causal attn_mask the
 * two agree.
 *
 * Rows with every key masked give 0 (PyTorch gives NaN there). Dropout
 * (config.dropout, or params.dropout with params.has_dropout) applies only
 * when params.training is set.
 *
 * Dtypes: config.dtype is that of the parameters, query, key, value, out,
 * weights and (backward) dout and every gradient: float32, float64, or
 * float16 / bfloat16, which compute as PyTorch's module does in that dtype:
 * each projection (and each gradient GEMM) widens its 16-bit operands
 * exactly, sums in float32 and rounds each element once to the dtype; the
 * heads' attention is attn_sdpa's in that dtype (see "Dtypes" there), its
 * output rounded once; head-averaged weights are the mean of the rounded
 * per-head weights, rounded once. Float masks may be any float dtype.
 */

typedef struct attn_mha attn_mha;

typedef struct attn_mha_config {
    size_t struct_size;    /* sizeof(attn_mha_config); set by _init          */
    int64_t embed_dim;     /* E, >= 1                                        */
    int64_t num_heads;     /* >= 1                                           */
    int64_t head_dim;      /* 0: embed_dim / num_heads (must divide)         */
    int64_t kdim, vdim;    /* 0: embed_dim                                   */
    int bias;              /* in_proj_bias and out_proj.bias; flags: 0 or 1  */
    int add_bias_kv;
    int add_zero_attn;
    int batch_first;
    double dropout;        /* in [0, 1]                                      */
    attn_dtype dtype;      /* F32, F64, F16 or BF16: parameters, inputs and
                              outputs (see "Dtypes" above)                   */
    uint64_t init_seed;    /* parameters start as PyTorch's initialisation
                              schemes would draw them, from this seed        */
} attn_mha_config;

/* PyTorch's defaults: bias on, no bias_kv, no zero_attn, sequence-first,
 * dropout 0, float32, head_dim/kdim/vdim derived. */
ATTN_API void attn_mha_config_init(attn_mha_config *config, int64_t embed_dim,
                                   int64_t num_heads);

/* Creates a module with initialised parameters. *mha is set to NULL on
 * failure. When embed_dim % num_heads != 0 and no head_dim is given the error
 * explains why: heads are an even split of the features. */
ATTN_API attn_status attn_mha_create(const attn_mha_config *config, attn_mha **mha);
/* Frees the module; NULL is a no-op. Like free(), destroying a module twice
 * (or using it after destroy) is the caller's error and undefined. */
ATTN_API void attn_mha_destroy(attn_mha *mha);

/* The configuration with derived fields (head_dim, kdim, vdim) filled in.
 * config->struct_size must say how large the caller's struct is (set it, or
 * call attn_mha_config_init first): only that many bytes are written, and
 * struct_size itself is left as it is. A struct_size of 0 (never set) is
 * ATTN_ERR_INVALID. */
ATTN_API attn_status attn_mha_get_config(const attn_mha *mha, attn_mha_config *config);

/* Parameters, in torch's state_dict() order. attn_mha_param_at() gives the
 * name and a writable view into the module's own storage (valid until
 * destroy), for index 0 .. count-1. attn_mha_param() looks up by name;
 * attn_mha_set_param() copies from any strided float tensor (float32,
 * float64, or the storage dtypes float16 and bfloat16, converted exactly) of
 * the right shape, a view of the parameter itself too (a transposed view is
 * read whole before it is written). Writing a parameter while a forward runs
 * on another thread is a data race. */
ATTN_API int attn_mha_param_count(const attn_mha *mha);
ATTN_API attn_status attn_mha_param_at(attn_mha *mha, int index, const char **name,
                                       attn_tensor *view);
ATTN_API attn_status attn_mha_param(attn_mha *mha, const char *name, attn_tensor *view);
ATTN_API attn_status attn_mha_set_param(attn_mha *mha, const char *name,
                                        const attn_tensor *src);

typedef struct attn_mha_forward_params {
    size_t struct_size;                  /* sizeof(...); set by _init        */
    const attn_tensor *key_padding_mask; /* NULL for none                    */
    const attn_tensor *attn_mask;        /* NULL for none                    */
    int average_attn_weights;            /* default 1                        */
    int is_causal;
    int training;                        /* dropout only when set            */
    uint64_t seed, rng_offset;           /* dropout stream (see attn_sdpa)   */
    /* [attn] has_dropout: this call's training-mode dropout probability is
     * `dropout` (in [0, 1]) instead of config.dropout, as torch reads
     * module.dropout at every forward. 0 (the default) keeps the config's. */
    int has_dropout;
    double dropout;
    /* [attn] batch_first for this call: -1 (the default) keeps the
     * config's; 0 or 1 overrides it, as torch reads module.batch_first at
     * every forward. Any other value is ATTN_ERR_INVALID. */
    int batch_first;
} attn_mha_forward_params;

ATTN_API void attn_mha_forward_params_init(attn_mha_forward_params *params);

/* Runs the module. `out` is required; `weights` is NULL for
 * need_weights=False (the fused kernel then keeps no L x S buffer). */
ATTN_API attn_status attn_mha_forward(const attn_mha *mha, const attn_tensor *query,
                                      const attn_tensor *key, const attn_tensor *value,
                                      const attn_mha_forward_params *params,
                                      attn_tensor *out, attn_tensor *weights);

/* Training [attn]. attn_mha_forward_train runs attn_mha_forward and keeps,
 * in *saved, what attn_mha_backward needs (the projected Q, K, V, the
 * attention output before out_proj, its log-sum-exp, and the call's
 * options: masks are copied, dropout is replayed from the seed). *saved is
 * the caller's: free it with attn_mha_saved_destroy (NULL is a no-op); it
 * holds no pointer to caller memory. The backward reads mha's parameters,
 * which must still be those the forward used.
 *
 * attn_mha_backward computes, from dout (shaped like out):
 *   dquery, dkey, dvalue    shaped like query, key, value; each may be NULL
 *   grads                   NULL, or a module made with the same
 *                           configuration, whose parameters are overwritten
 *                           with the gradients of mha's (in_proj_weight,
 *                           in_proj_bias or q/k/v_proj_weight, bias_k,
 *                           bias_v, out_proj.weight, out_proj.bias)
 * query, key and value must be the tensors the forward was given (same
 * shapes; the backward reads them for the weight gradients). When the
 * forward was given one tensor as query, key and value (self-attention),
 * dquery, dkey and dvalue are still three separate gradients: the caller
 * sums them. The returned weights are not differentiated: gradients flow
 * through out only. Errors: ATTN_ERR_NULL for a NULL mha, saved, query,
 * key, value or dout; ATTN_ERR_INVALID naming "saved" when it was made on a
 * module of another configuration, "grads" when grads has another
 * configuration or is mha itself; ATTN_ERR_SHAPE / ATTN_ERR_DTYPE naming the
 * tensor that differs from what the forward saw; ATTN_ERR_OVERLAP when a
 * gradient shares memory with an input, dout, a module's parameters or
 * another gradient; ATTN_ERR_NOMEM (nothing leaked). Results are bitwise
 * identical for any thread count. */
typedef struct attn_mha_saved attn_mha_saved;

ATTN_API attn_status attn_mha_forward_train(const attn_mha *mha, const attn_tensor *query,
                                            const attn_tensor *key, const attn_tensor *value,
                                            const attn_mha_forward_params *params,
                                            attn_tensor *out, attn_tensor *weights,
                                            attn_mha_saved **saved);
ATTN_API void attn_mha_saved_destroy(attn_mha_saved *saved);
ATTN_API attn_status attn_mha_backward(const attn_mha *mha, const attn_mha_saved *saved,
                                       const attn_tensor *query, const attn_tensor *key,
                                       const attn_tensor *value, const attn_tensor *dout,
                                       attn_tensor *dquery, attn_tensor *dkey,
                                       attn_tensor *dvalue, attn_mha *grads);

/* The shapes out and weights must have for these inputs. */
ATTN_API attn_status attn_mha_out_shapes(const attn_mha *mha, const attn_tensor *query,
                                         const attn_tensor *key,
                                         const attn_mha_forward_params *params,
                                         int need_weights, int *out_rank,
                                         int64_t out_shape[ATTN_MAX_RANK],
                                         int *weights_rank,
                                         int64_t weights_shape[ATTN_MAX_RANK]);

/* ------------------------------------------------------------------------ */
/* Transformer encoder layer                                                 */
/* ------------------------------------------------------------------------ */
/*
 * torch.nn.TransformerEncoderLayer on attn_mha (self-attention), with
 * PyTorch's parameters and semantics:
 *
 *   norm_first = 0 (post-norm, the default; BERT's layout):
 *     x = norm1(x + dropout1(self_attn(x, x, x)))
 *     x = norm2(x + dropout2(linear2(dropout(activation(linear1(x))))))
 *   norm_first = 1 (pre-norm):
 *     x = x + dropout1(self_attn(norm1(x), ...))
 *     x = x + dropout2(linear2(dropout(activation(linear1(norm2(x))))))
 *
 * Parameters (torch's state_dict names and order; E = d_model, F =
 * dim_feedforward; the biases only when bias):
 *   self_attn.in_proj_weight (3E, E), self_attn.in_proj_bias (3E),
 *   self_attn.out_proj.weight (E, E), self_attn.out_proj.bias (E),
 *   linear1.weight (F, E), linear1.bias (F), linear2.weight (E, F),
 *   linear2.bias (E), norm1.weight (E), norm1.bias (E), norm2.weight (E),
 *   norm2.bias (E)
 * They start as torch draws them (MHA's schemes; Linear: U(±1/sqrt(fan_in))
 * for weight and bias; LayerNorm: weight 1, bias 0), from config.init_seed.
 *
 * src is (L, N, E), or (N, L, E) with batch_first, or (L, E) unbatched; out
 * has src's shape and may be src itself (the layer reads all of src first).
 * Masks as attn_mha's: src_mask is its attn_mask ((L, L) or (N * nhead, L,
 * L); bool true = not allowed), src_key_padding_mask its key_padding_mask
 * ((N, L) or (L); bool true = padding); is_causal applies the causal mask
 * (combined with src_mask, as attn_mha does). A query row whose keys are all
 * masked attends to nothing (0), where torch gives NaN.
 *
 * LayerNorm statistics are computed in float64 (torch: in the input type),
 * eps = layer_norm_eps; as in torch, eps = 0 gives NaN for a row whose
 * values are all equal (d_model = 1 makes every row so). activation: ReLU,
 * GELU with erf, or GELU's tanh
 * approximation (torch's F.gelu(approximate="tanh")).
 *
 * A float16 / bfloat16 layer rounds where torch's layer in that dtype does:
 * its attention is a 16-bit attn_mha, each Linear a 16-bit GEMM (float32
 * sums, each element rounded once), and each LayerNorm, residual sum,
 * activation and dropout reads 16-bit values, computes in float64 and
 * rounds once.
 *
 * Dropout (config.dropout; only with params.training): the attention
 * weights' dropout is attn_mha's, on the stream (seed, rng_offset); dropout1,
 * the feed-forward's dropout and dropout2 use (seed, rng_offset + 1), (+ 2)
 * and (+ 3), each element's word chosen by its index in the C order of the
 * tensor it applies to (src's shape for dropout1/2, src's shape with F
 * features for the feed-forward's). Give the layers of a stack offsets 4
 * apart.
 */
typedef enum attn_activation {
    ATTN_ACTIVATION_RELU = 0,
    ATTN_ACTIVATION_GELU = 1,     /* 0.5 x (1 + erf(x / sqrt 2))                  */
    ATTN_ACTIVATION_GELU_TANH = 2 /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³))) */
} attn_activation;

typedef struct attn_encoder_layer attn_encoder_layer;

typedef struct attn_encoder_layer_config {
    size_t struct_size;      /* sizeof(attn_encoder_layer_config); set by _init */
    int64_t d_model;         /* E, >= 1                                        */
    int64_t nhead;           /* >= 1, divides d_model                          */
    int64_t dim_feedforward; /* F, >= 1; default 2048                          */
    double dropout;          /* in [0, 1]; default 0.1                         */
    attn_activation activation; /* default ReLU                                */
    double layer_norm_eps;   /* finite, >= 0; default 1e-5                     */
    int batch_first;         /* 0 or 1 (as the flags below); default 0         */
    int norm_first;          /* default 0                                      */
    int bias;                /* Linear, LayerNorm and MHA biases; default 1    */
    attn_dtype dtype;        /* F32 (default), F64, F16 or BF16 (see above)   */
    uint64_t init_seed;
} attn_encoder_layer_config;

/* torch.nn.TransformerEncoderLayer(d_model, nhead)'s defaults. */
ATTN_API void attn_encoder_layer_config_init(attn_encoder_layer_config *config,
                                             int64_t d_model, int64_t nhead);
/* *layer is NULL on failure; errors name the config field at fault. */
ATTN_API attn_status attn_encoder_layer_create(const attn_encoder_layer_config *config,
                                               attn_encoder_layer **layer);
ATTN_API void attn_encoder_layer_destroy(attn_encoder_layer *layer); /* NULL: no-op */

/* Parameters as attn_mha's: by index in state_dict order, by name, or set
 * from any strided float32/float64/float16/bfloat16 tensor of the right shape. Views are
 * into the layer's storage, valid until destroy. */
ATTN_API int attn_encoder_layer_param_count(const attn_encoder_layer *layer);
ATTN_API attn_status attn_encoder_layer_param_at(attn_encoder_layer *layer, int index,
                                                 const char **name, attn_tensor *view);
ATTN_API attn_status attn_encoder_layer_param(attn_encoder_layer *layer, const char *name,
                                              attn_tensor *view);
ATTN_API attn_status attn_encoder_layer_set_param(attn_encoder_layer *layer, const char *name,
                                                  const attn_tensor *src);

typedef struct attn_encoder_forward_params {
    size_t struct_size;                      /* sizeof(...); set by _init     */
    const attn_tensor *src_mask;             /* NULL for none                 */
    const attn_tensor *src_key_padding_mask; /* NULL for none                 */
    int is_causal;
    int training;                            /* dropout only when set         */
    uint64_t seed, rng_offset;               /* dropout streams (above)       */
    int batch_first;                         /* -1 (default): the config's    */
} attn_encoder_forward_params;

ATTN_API void attn_encoder_forward_params_init(attn_encoder_forward_params *params);

/* Runs the layer. out may be src (in place); out over the layer's
 * parameters (its own or self_attn's) is ATTN_ERR_OVERLAP. Errors name the
 * argument: "layer", "src", "out", "src_mask", "src_key_padding_mask",
 * "params.batch_first". */
ATTN_API attn_status attn_encoder_layer_forward(const attn_encoder_layer *layer,
                                                const attn_tensor *src,
                                                const attn_encoder_forward_params *params,
                                                attn_tensor *out);

/* ------------------------------------------------------------------------ */
/* .npy files                                                                */
/* ------------------------------------------------------------------------ */
/*
 * Reads NumPy .npy files of format versions 1.0, 2.0 and 3.0 holding
 * float32, float64, float16 (either byte order) or bool arrays in C or
 * Fortran order (NumPy has no bfloat16 descr).
 * The result is a C-contiguous tensor in native byte order whose data the
 * caller frees with attn_npy_free(). A 0-d array is read as shape (1,).
 * A malformed, truncated or oversized file gives ATTN_ERR_FORMAT; the parser
 * never reads past the bytes it was given.
 */
ATTN_API attn_status attn_npy_load(const char *path, attn_tensor *out);
ATTN_API attn_status attn_npy_parse(const void *bytes, size_t size, attn_tensor *out);
ATTN_API void attn_npy_free(attn_tensor *t);
/* Only the header of a .npy file: its dtype, rank and shape as the file
 * states them (rank 0 for a 0-d array; shape gets `rank` entries). Reads no
 * more than the header, so a file whose data is cut short still answers. */
ATTN_API attn_status attn_npy_read_header(const char *path, attn_dtype *dtype, int *rank,
                                          int64_t shape[ATTN_MAX_RANK]);

/*
 * Writes any strided float32, float64, float16 or bool tensor (bfloat16,
 * which NumPy lacks, and int32 are refused with ATTN_ERR_DTYPE: save
 * bfloat16 with attn_safetensors_save) as a little-endian, C-order .npy
 * file, and
 * atomically: the bytes go to a temporary file in path's folder
 * (".NAME.XXXXXXXX.tmp"), are flushed to disk (fsync), and only then is it
 * renamed over path. On any failure (a full disk, a missing folder, ...)
 * the call returns ATTN_ERR_IO, path is left as it was and the temporary is
 * removed; a process killed during the write may leave the temporary.
 * The new file keeps the old one's permission bits, and its owner where
 * the caller may set it; other hard links to the old file keep the old
 * data. A symbolic link is followed: the file it points to is replaced
 * (or, for a dangling link, created, as open(2) would). An existing target
 * that is not a regular file (/dev/null, a FIFO) is written in place (a
 * FIFO that no process opens for reading within 5 s: ATTN_ERR_IO). A
 * folder is never replaced.
 */
ATTN_API attn_status attn_npy_save(const char *path, const attn_tensor *t);
/* The same bytes to an open file descriptor, from its current position:
 * for pipes, sockets, or a caller's own temporary file. Neither syncs nor
 * closes fd. ATTN_ERR_IO (with the system's reason) if a write fails. */
ATTN_API attn_status attn_npy_write_fd(int fd, const attn_tensor *t);

/* ------------------------------------------------------------------------ */
/* safetensors files                                                         */
/* ------------------------------------------------------------------------ */
/*
 * The format of Hugging Face checkpoints:
 *   8 bytes   N, the header's length, unsigned little-endian
 *   N bytes   UTF-8 JSON: {"NAME": {"dtype": "F32", "shape": [2, 3],
 *             "data_offsets": [BEGIN, END]}, ..., "__metadata__": {"k": "v"}}
 *   the rest  the data buffer; BEGIN and END are byte offsets into it, each
 *             tensor's elements little-endian in C order
 *
 * Reading. attn_safetensors_open maps the file read-only (mmap; where that
 * fails it reads the file into memory) and parses its header;
 * attn_safetensors_parse does the same on bytes in memory, which it
 * BORROWS: they must stay valid and unchanged until the handle is closed
 * (nothing is copied but the header's strings). Either checks everything
 * before it returns a handle: the header's length (at most 100,000,000
 * bytes, the reference implementation's limit), its JSON (a strict parser:
 * RFC 8259 syntax, strings valid UTF-8 with every escape including \uXXXX
 * surrogate pairs, at most 64 levels of nesting; fields a tensor entry does
 * not define are skipped, as the reference does), no name given twice, each
 * dtype known, each shape's entries non-negative integers whose product and
 * byte count fit in 64 bits, and 0 <= BEGIN <= END <= the buffer's size with
 * END - BEGIN the tensor's byte count, and the tensors' data tiling the
 * buffer as the reference reader requires (in order of BEGIN, each starts
 * where the one before ends and the last ends with the buffer: no byte
 * shared by two tensors, none owned by none). Names are any UTF-8 strings
 * but "__metadata__", which holds the metadata (string keys and values);
 * a name or string containing U+0000 is refused (C strings cannot hold
 * it). Failures: ATTN_ERR_FORMAT with what is wrong and where (the byte
 * of the header, or the tensor's name), ATTN_ERR_IO with the system's
 * reason (the file cannot be opened, or is not a regular file),
 * ATTN_ERR_NOMEM. *file is NULL after a failure.
 *
 * A handle is read-only once made: any number of threads may use one at
 * once. The file's contents must not change while it is open (a file
 * truncated under a mapping faults when its missing pages are touched, as
 * with any mmap).
 *
 * Dtypes. Every dtype the format names is listed (BOOL, U8, I8, I16, U16,
 * I32, U32, I64, U64, F16, BF16, F32, F64, C64, F8_E4M3, F8_E5M2,
 * F8_E4M3FNUZ, F8_E5M2FNUZ, F8_E8M0, F4, F6_E2M3, F6_E3M2; a dtype of fewer
 * than 8 bits needs a whole number of bytes per tensor); attn reads F32,
 * F64, BOOL, F16 and BF16 into tensors (ATTN_DTYPE_*), the others only as
 * raw bytes. An unknown dtype is ATTN_ERR_FORMAT.
 *
 * Scalars and empty tensors. safetensors files hold 0-d tensors (shape [])
 * and tensors with a dimension of 0. The calls of this section, and only
 * they, give and take such tensors: rank 0 (one element at data; shape and
 * strides unused), or a shape with zeros (no element; data may be anything,
 * NULL included). Every other call refuses them (ATTN_ERR_SHAPE).
 */
typedef struct attn_safetensors attn_safetensors;

ATTN_API attn_status attn_safetensors_open(const char *path, attn_safetensors **file);
ATTN_API attn_status attn_safetensors_parse(const void *bytes, size_t size,
                                            attn_safetensors **file);
/* Unmaps or frees everything; NULL is a no-op. Views from
 * attn_safetensors_get and attn_safetensors_raw die with the handle. */
ATTN_API void attn_safetensors_close(attn_safetensors *file);

/* The number of tensors (the metadata is not one); 0 for NULL. */
ATTN_API int64_t attn_safetensors_count(const attn_safetensors *file);
/* Tensor `index` (0 .. count-1) in the header's order. Each out-parameter
 * may be NULL. name: NUL-terminated UTF-8, valid until close. file_dtype:
 * the dtype as the file names it ("BF16", "I64"). dtype: its attn_dtype, or
 * 0 when attn has none (I64, ...). rank: the file's, 0 for a scalar, and
 * possibly above ATTN_MAX_RANK; shape gets min(rank, ATTN_MAX_RANK) entries.
 * ATTN_ERR_INVALID naming "index" when out of range. */
ATTN_API attn_status attn_safetensors_info(const attn_safetensors *file, int64_t index,
                                           const char **name, const char **file_dtype,
                                           attn_dtype *dtype, int *rank,
                                           int64_t shape[ATTN_MAX_RANK]);
/* The index of the tensor called `name`, or -1 (no such tensor, or a NULL
 * argument). O(log count). */
ATTN_API int64_t attn_safetensors_find(const attn_safetensors *file, const char *name);

/* A zero-copy view of a tensor's data where it lies: C-contiguous, in the
 * file's dtype. Read-only: the mapping is, so writing through it faults.
 * Valid until close. Needs a dtype attn has, data aligned to its element
 * size (files written by attn and by the reference are) and a
 * little-endian machine; otherwise ATTN_ERR_DTYPE (a dtype attn lacks) or
 * ATTN_ERR_UNSUPPORTED (misaligned, big-endian), each saying to use
 * attn_safetensors_read. Rank above ATTN_MAX_RANK: ATTN_ERR_SHAPE. An
 * unknown name: ATTN_ERR_INVALID naming "name". */
ATTN_API attn_status attn_safetensors_get(const attn_safetensors *file, const char *name,
                                          attn_tensor *view);
/* A converted copy the caller owns: C-contiguous, native byte order, freed
 * with attn_safetensors_free. `to`:
 *   0                 the file's dtype (F32, F64, BOOL, F16 or BF16)
 *   ATTN_DTYPE_F32    from any float dtype (F16 and BF16 widen exactly,
 *   ATTN_DTYPE_F64    F64 -> F32 rounds to nearest)
 *   the file's dtype  a copy (BOOL, F16, BF16 too; bool bytes become 0/1)
 * Anything else, and the dtypes attn lacks (I64, F8_*, ...), is
 * ATTN_ERR_DTYPE naming "to" or the tensor. A 0-d tensor comes back with
 * rank 0, an empty one with its zero dimensions (data is then a valid,
 * empty block). *out is zeroed on failure. */
ATTN_API attn_status attn_safetensors_read(const attn_safetensors *file, const char *name,
                                           attn_dtype to, attn_tensor *out);
/* The same conversion into the caller's memory: dst has the tensor's rank
 * and shape, any dtype `to` could be above, and any strides that do not map
 * two elements to one address (ATTN_ERR_OVERLAP otherwise). */
ATTN_API attn_status attn_safetensors_read_into(const attn_safetensors *file, const char *name,
                                                const attn_tensor *dst);
/* The stored bytes of any tensor, whatever its dtype (little-endian, C
 * order; END - BEGIN of them), valid until close. */
ATTN_API attn_status attn_safetensors_raw(const attn_safetensors *file, const char *name,
                                          const void **bytes, uint64_t *size);
/* Frees a tensor from attn_safetensors_read (as attn_npy_free does) and
 * zeroes it; NULL, or a zeroed tensor, is a no-op. */
ATTN_API void attn_safetensors_free(attn_tensor *t);

/* The "__metadata__" pairs: their number, pair `index` in the header's
 * order (key and value NUL-terminated UTF-8, valid until close; either
 * out-parameter may be NULL), and the value of `key` (NULL if absent). */
ATTN_API int64_t attn_safetensors_metadata_count(const attn_safetensors *file);
ATTN_API attn_status attn_safetensors_metadata_at(const attn_safetensors *file, int64_t index,
                                                  const char **key, const char **value);
ATTN_API const char *attn_safetensors_metadata(const attn_safetensors *file, const char *key);

/* Writes `count` tensors (any strides; float32, float64, bool, float16 or
 * bfloat16, each stored in its own dtype) under names[i], and the metadata:
 * NULL, or a NULL-terminated list of key, value, key, value, ... strings.
 * Names and metadata must be valid UTF-8, the names distinct and none
 * "__metadata__", the metadata keys distinct; rank 0 and zero dimensions
 * are allowed here (see above). The data are laid out without gaps, 8-byte
 * dtypes first, so that every tensor is aligned to its element size; the
 * header is padded with spaces to a multiple of 8 bytes, as the reference
 * pads it. Any file this writes, the reference reads. Argument errors
 * (ATTN_ERR_NULL, ATTN_ERR_INVALID, ATTN_ERR_SHAPE, ATTN_ERR_DTYPE,
 * ATTN_ERR_OVERFLOW) name the argument ("names[3]", "tensors[3]",
 * "metadata[2]") and come before any file is touched.
 * The file is replaced atomically, with attn_npy_save's rules: a temporary
 * beside it, fsync, rename; ATTN_ERR_IO leaves path as it was. */
ATTN_API attn_status attn_safetensors_save(const char *path, size_t count,
                                           const char *const *names, const attn_tensor *tensors,
                                           const char *const *metadata);
/* The same bytes to an open file descriptor (neither synced nor closed). */
ATTN_API attn_status attn_safetensors_write_fd(int fd, size_t count, const char *const *names,
                                               const attn_tensor *tensors,
                                               const char *const *metadata);

/* ------------------------------------------------------------------------ */
/* Threads, kernels, memory                                                  */
/* ------------------------------------------------------------------------ */

/* Threads used by each call. n <= 0 restores the default: the environment
 * variable ATTN_NUM_THREADS if set, else the number of processors. Results
 * do not depend on the thread count (bitwise, SDPA and MHA alike).
 * The count is bounded: n above attn_max_threads() is clamped to it, so
 * attn_get_num_threads() tells what calls will use. (OpenMP ends the whole
 * process when it cannot start a thread; a bound keeps a mistyped count from
 * doing that.) An ATTN_NUM_THREADS that is not a whole number >= 1, or is
 * above the bound, is reported once on stderr and the default or the bound
 * used instead. In a virtual machine, a call after ~20 ms of idle threads
 * can wait 5-10 ms for OpenMP's sleeping worker; OMP_PROC_BIND=true or
 * OMP_WAIT_POLICY=passive avoids it (docs/python.md, "Threads and
 * kernels"). */
ATTN_API void attn_set_num_threads(int n);
ATTN_API int attn_get_num_threads(void);
/* The largest thread count calls use: 4 per processor (at most 1024); 1 in
 * a build without OpenMP. */
ATTN_API int attn_max_threads(void);

typedef enum attn_isa {
    ATTN_ISA_AUTO = 0,    /* the best path the CPU and OS support           */
    ATTN_ISA_REF = 1,     /* the float64-accumulating reference (the oracle)*/
    ATTN_ISA_GENERIC = 2, /* the fused kernel in portable C                  */
    ATTN_ISA_AVX2 = 3,    /* the fused kernel with AVX2 + FMA                */
    ATTN_ISA_AVX512 = 4,  /* the fused kernel with AVX-512F                  */
    ATTN_ISA_AVX512_BF16 = 5, /* AVX-512 with AVX512-BF16 (+BW, DQ, VL): the
                                same kernels, and bfloat16 calls' prefill
                                products in vdpbf16ps (see "Dtypes")       */
    ATTN_ISA_AMX = 6         /* avx512_bf16 with AMX-BF16 tiles (Linux grants
                                the tile state): those prefill products in
                                tdpbf16ps, the same rules                  */
} attn_isa;
/* The last path: loops over every path run ATTN_ISA_REF .. ATTN_ISA_LAST. */
#define ATTN_ISA_LAST ATTN_ISA_AMX

/* Forces a kernel path. ATTN_ERR_UNSUPPORTED if this CPU/OS cannot run it.
 * The environment variable ATTN_ISA=ref|generic|avx2|avx512|avx512_bf16|amx|auto (any case)
 * does the same once, at the first call; a value that is unknown or names a
 * path this machine cannot run is reported once on stderr, and the best
 * path used. */
ATTN_API attn_status attn_set_isa(attn_isa isa);
/* The path calls take now (never ATTN_ISA_AUTO). */
ATTN_API attn_isa attn_get_isa(void);
/* Whether this CPU and OS can run a path. */
ATTN_API int attn_isa_supported(attn_isa isa);
ATTN_API const char *attn_isa_name(attn_isa isa);

/* The CBLAS the projection GEMMs (MHA) run on: for OpenBLAS its configuration
 * line and the core it chose when it was loaded, e.g. "OpenBLAS 0.3.21 ...;
 * core SkylakeX"; else "CBLAS". A DYNAMIC_ARCH OpenBLAS older than the CPU
 * may fall back to an SSE3 core ("Prescott") several times slower; setting
 * OPENBLAS_CORETYPE (e.g. SkylakeX, Haswell) before the process starts fixes
 * that, and the Python package does it by itself (docs/python.md). The
 * string is the calling thread's, valid until its next call. */
ATTN_API const char *attn_blas_info(void);

/* Cancellation [attn]. A long call (attn_sdpa, attn_mha_forward) can be
 * stopped from another thread or from a signal handler: the calling thread
 * names an int with attn_set_cancel_flag(&flag) before the call, and any
 * store of a nonzero value to it makes the call stop at its next check and
 * return ATTN_ERR_CANCELLED. Checks fall between blocks of work (a few
 * milliseconds apart), on every thread of the call, backward passes
 * included. The outputs (a backward's gradients too) then hold partial
 * results, to be discarded; nothing leaks and the library stays usable. The setting
 * belongs to the calling thread and stays until changed; NULL turns it off
 * (the default). The flag must outlive the calls that read it; the library
 * only reads it (plain loads are enough for a store from a signal handler or
 * an atomic store from another thread). */
ATTN_API void attn_set_cancel_flag(const volatile int *flag);

/* Forking: a child forked after attn has run a call on several threads runs
 * attn single-threaded (GNU OpenMP's thread pool does not survive fork());
 * its results are the same bits. Start workers with exec/spawn for threads. */

/* A custom allocator, for callers who own memory and for tests that fail the
 * n-th allocation. `alloc` returns memory aligned to at least 16 bytes or
 * NULL; `release` frees it (never called with NULL). Pass NULL to restore
 * malloc/free. Set it while no other attn call runs. Both functions may be
 * called from the library's worker threads (OpenMP), concurrently: they
 * must be thread-safe. */
typedef struct attn_allocator {
    void *(*alloc)(void *ctx, size_t size);
    void (*release)(void *ctx, void *ptr);
    void *ctx;
} attn_allocator;

ATTN_API void attn_set_allocator(const attn_allocator *allocator);

/* Hands the workspace blocks attn keeps between calls (at most 64 MiB; see
 * "Memory" above) back to the allocator. Safe at any time, also while
 * other calls run (they keep the blocks they hold). */
ATTN_API void attn_release_workspace(void);

/* For libraries built on attn (attn_ring) [attn]: memory through the
 * allocator above (attn_alloc: aligned to 64 bytes, NULL when it fails or
 * size is 0; attn_free(NULL) is a no-op), and errors through
 * attn_last_error(): attn_set_error records a printf-style message and the
 * argument it is about (NULL: none) for the calling thread and returns
 * `status`, so that `return attn_set_error(...)` reports and fails at once;
 * attn_clear_error() marks a call's success. */
ATTN_API void *attn_alloc(size_t size);
ATTN_API void attn_free(void *ptr);
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
ATTN_API attn_status attn_set_error(attn_status status, const char *arg, const char *fmt, ...);
ATTN_API void attn_clear_error(void);

#ifdef __cplusplus
}
#endif

#endif /* ATTN_H */
