"""attn.varlen_attention and attn.attention_with_kvcache: FlashAttention's
flash_attn_varlen_func and flash_attn_with_kvcache (their argument names and
meanings) over libattn's attn_sdpa_varlen and attn_sdpa_kvcache.

NumPy arrays in give NumPy arrays out; torch CPU tensors in (any array
argument) give torch tensors out. varlen_attention has a backward pass
(attn_sdpa_varlen_backward, through the torch operator of
attn/_varlen_torch.py); attention_with_kvcache has none, so a torch input
that requires grad in grad mode is refused there rather than silently cut
from the graph.
"""

import numbers
import sys
from types import SimpleNamespace

import numpy as np

from . import _attn
from ._arrays import (
    CACHE,
    TENSOR,
    _is_torch_tensor,
    _torch_numpy,
    as_array,
    as_bfloat16,
    dtype_name,
    empty,
    check_bool,
    check_int,
    check_probability,
    check_scale,
    check_seed,
    index_array,
    library_error,
    random_seed,
    tracks_grad,
)
from ._sdpa import check_dtypes, check_modifiers, modifier_options

# attn.h's names for what these functions call otherwise (the operands and
# index tensors have the same names in both).
_RENAME = {"params.scale": "softmax_scale", "params.causal": "causal"}

# FlashAttention's causal=True: aligned to the last key (attn_causal's code).
_BOTTOM_RIGHT = 2


def _refuse_grad(fn, **tensors):
    """A torch input that autograd would track: the result could not carry
    its gradient, so say so instead of returning a detached result."""
    for name, x in tensors.items():
        if tracks_grad(x):
            raise RuntimeError(
                f"{name} requires grad and torch's grad mode is on, but attn.{fn} has no "
                f"backward pass (libattn has none for this layout), so the result could not "
                f"carry a gradient. Call it under torch.no_grad() or torch.inference_mode(), or "
                f"pass {name}.detach(); to train, use attn.scaled_dot_product_attention, which "
                f"has a backward."
            )


def _refuse_inference_write(**caches):
    """torch refuses an in-place write to an inference tensor outside
    inference mode; the append is one, so it is refused the same way."""
    for name, x in caches.items():
        if _is_torch_tensor(x) and x.is_inference():
            torch = sys.modules["torch"]
            if not torch.is_inference_mode_enabled():
                raise RuntimeError(
                    f"{name} is an inference tensor (made under torch.inference_mode()) and "
                    f"attention_with_kvcache writes the new rows into it in place, which torch "
                    f"allows only inside inference mode: call it under torch.inference_mode(), "
                    f"or pass a cache made outside it")


def _bump_versions(*caches):
    """The append wrote into torch caches through NumPy views: their
    version counters move as a torch in-place write's would, so autograd
    refuses a graph that saved the old values instead of using the new."""
    for x in caches:
        if _is_torch_tensor(x):
            sys.modules["torch"].autograd.graph.increment_version(x)


def _require_rank(a, name, rank, layout):
    if a.ndim != rank:
        raise ValueError(f"{name} has {a.ndim} dimensions, shape {a.shape}; expected {rank}: "
                         f"{layout}")


def _fresh_seed(torch_call):
    """A dropout seed: torch's generator for torch calls (torch.manual_seed
    repeats it), the operating system's otherwise."""
    if torch_call:
        torch = sys.modules["torch"]
        return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())
    return random_seed()


def _to_torch(torch_call, *arrays):
    if not torch_call:
        return arrays
    torch = sys.modules["torch"]
    return tuple(None if a is None else torch.from_numpy(a) for a in arrays)


def _finish(torch_call, out, lse, want_lse, q):
    """The result as the caller's kind: torch tensors for a torch call; a
    bfloat16 out (its int16 bits from _attn) as torch's bfloat16, or as
    ml_dtypes' like the NumPy query `q`."""
    if torch_call:
        bf16 = out.dtype == np.int16
        out, lse = _to_torch(True, out, lse)
        if bf16:
            out = out.view(sys.modules["torch"].bfloat16)
    else:
        out = as_bfloat16(out, np.asarray(q))
    return (out, lse) if want_lse else out


def _zeros(shape, dtype_name):
    """_arrays.empty's allocator, zero-filled (bfloat16: its int16 bits)."""
    return np.zeros(shape, np.int16 if dtype_name == "bfloat16" else dtype_name)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                     softcap=0.0, alibi_slopes=None, sinks=None, return_softmax_lse=False,
                     seed=None):
    """Attention over a batch of sequences of different lengths, packed
    without padding (FlashAttention's ``flash_attn_varlen_func``).

    q (total_q, Hq, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev): float32,
    float64, float16 or bfloat16 under attn.scaled_dot_product_attention's
    dtype rule; Hq a multiple of Hkv (grouped-query attention is implicit).
    cu_seqlens_q, cu_seqlens_k: (B + 1,) cumulative offsets, 0 first,
    non-decreasing, int32 (other integer types are converted): sequence n
    is rows cu_seqlens_q[n] .. cu_seqlens_q[n+1]-1 of q and attends only to
    rows cu_seqlens_k[n] .. cu_seqlens_k[n+1]-1 of k and v. max_seqlen_q,
    max_seqlen_k: at least every sequence's length (checked). An empty
    sequence computes nothing; rows of q past cu_seqlens_q[-1] get out = 0
    and lse = -inf.

    dropout_p, seed: reproducible dropout (a fresh seed per call when None;
    from torch's generator for torch inputs). softmax_scale: default
    1/sqrt(E). causal: query i of a sequence sees key j <= i + S_n - L_n
    (aligned bottom-right, as in FlashAttention). window_size,
    alibi_slopes ((Hq,) or (B, Hq)), softcap, sinks ((Hq,)): as in
    attn.scaled_dot_product_attention, per sequence.

    Returns out (total_q, Hq, Ev) in q's dtype, or (out, lse) with
    ``return_softmax_lse``, lse (Hq, total_q) as FlashAttention shapes it.
    NumPy in, NumPy out; torch in, torch out. Autograd: when q, k, v or
    sinks are torch tensors that require grad (in grad mode), the result
    carries a grad_fn and gradients flow to them (FlashAttention's varlen
    backward, attn_sdpa_varlen_backward, dropout replayed); ALiBi slopes get
    none, as in FlashAttention. The lse is then float64 (the log-sum-exp the
    backward recomputes the weights from).
    """
    torch_call = any(_is_torch_tensor(x) for x in (q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                     alibi_slopes, sinks))
    if torch_call:
        from . import _varlen_torch  # torch is loaded: a torch tensor exists

        if _varlen_torch.compiling():  # FakeTensors: nothing to read or check yet
            return _varlen_torch.traced(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, dropout_p, softmax_scale, causal,
                                        window_size, softcap, alibi_slopes, sinks,
                                        return_softmax_lse, seed)
    # recorded for autograd: an input requires grad (ALiBi slopes too, which
    # get none, as scaled_dot_product_attention's), or carries a forward-mode
    # tangent (the operators have no forward-mode formula: torch says so)
    grad = torch_call and _varlen_torch.recorded(q, k, v, sinks, alibi_slopes)
    a = SimpleNamespace()
    qa, ka, va = (as_array(x, n, TENSOR, grad) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    check_dtypes(qa, ka, va, ("q", "k", "v"))
    _require_rank(qa, "q", 3, "(total_q, Hq, E)")
    _require_rank(ka, "k", 3, "(total_k, Hkv, E)")
    _require_rank(va, "v", 3, "(total_k, Hkv, Ev)")
    cu_q = index_array(cu_seqlens_q, "cu_seqlens_q")
    cu_k = index_array(cu_seqlens_k, "cu_seqlens_k")
    max_q = check_int(max_seqlen_q, "max_seqlen_q", minimum=0)
    max_k = check_int(max_seqlen_k, "max_seqlen_k", minimum=0)
    p = check_probability(dropout_p, "dropout_p")
    scale = check_scale(softmax_scale, "softmax_scale")
    is_causal = check_bool(causal, "causal")
    check_modifiers(a, window_size, alibi_slopes, softcap, sinks, grad_ok=grad)
    want_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    s = check_seed(seed)
    if s is None:
        s = _fresh_seed(torch_call) if p > 0.0 else 0
    if grad:
        a.q, a.k, a.v = qa, ka, va
        out, lse = _varlen_torch.run(q, k, v, a, cu_q, cu_k, max_q, max_k, p, scale,
                                     _BOTTOM_RIGHT if is_causal else 0, s, alibi_slopes, sinks)
        return (out, lse) if want_lse else out
    try:
        # np.zeros: rows no sequence holds are left as allocated.
        out, lse = _attn.sdpa_varlen(
            qa, ka, va, cu_q, cu_k, max_q, max_k, empty=_zeros,
            causal=_BOTTOM_RIGHT if is_causal else 0, scale=scale, dropout_p=p, seed=s,
            want_lse=want_lse, **modifier_options(a),
        )
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise library_error(e, _RENAME) from None
    if want_lse:
        lse[:, int(cu_q[-1]):] = -np.inf  # rows that saw no key, as attn_sdpa marks them
    return _finish(torch_call, out, lse, want_lse, q)


# ---------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------


def _numpy_cache(x, name, writable):
    """A NumPy cache as (array, holds bfloat16): ml_dtypes' bfloat16 is
    passed as its uint16 bits."""
    a = x
    bf16 = a.dtype.name == "bfloat16"
    if not (bf16 or (a.dtype.kind == "f" and a.dtype.itemsize in (2, 4, 8))):
        raise TypeError(f"{name} has dtype {a.dtype}; expected float16, bfloat16, float32 or "
                        f"float64")
    if not a.dtype.isnative:  # before bfloat16's bits are viewed: they would be swapped
        if writable:
            raise ValueError(f"{name} is in a foreign byte order ({a.dtype}); the new rows "
                             f"would go into a converted copy, not into {name}: pass an array "
                             f"in this machine's byte order")
        a = a.astype(a.dtype.newbyteorder("="))
    if bf16:
        a = a.view(np.uint16)
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} is read-only (writeable=False); attention_with_kvcache "
                         f"appends k and v into the cache in place, so it must be writeable")
    return a, bf16


def _cache(x, name, writable):
    """A view of k_cache or v_cache and whether it holds bfloat16. When new
    rows are appended (`writable`) it must be the caller's own memory: a
    NumPy array or a torch CPU tensor, never a copy."""
    if isinstance(x, np.ndarray):
        return _numpy_cache(x, name, writable)
    if _is_torch_tensor(x):
        torch = sys.modules["torch"]
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"{name} has dtype {x.dtype}; expected float16, bfloat16, float32 "
                            f"or float64")
        if writable and torch.Tensor.is_neg(x):  # its view would be resolve_neg()'s copy
            raise TypeError(
                f"{name} is a negated view (its memory holds -x, e.g. from .conj().imag); "
                f"attention_with_kvcache writes the new rows k and v into the cache in place, "
                f"which would land in a copy and be lost: keep {name}.resolve_neg() as the cache"
            )
        bf16 = x.dtype == torch.bfloat16
        return _torch_numpy(x, name, CACHE, copying=False, bfloat16_bits=True), bf16
    if writable:
        raise TypeError(
            f"{name} is a {type(x).__name__}; with new rows k and v it must be a NumPy array or "
            f"a torch CPU tensor, which attention_with_kvcache writes into in place (anything "
            f"else would be copied and the new rows lost)"
        )
    return as_array(x, name, CACHE), False


def _is_half(x):
    """Whether x holds 16-bit floats (float16, or bfloat16 in torch or in
    ml_dtypes' NumPy dtype)."""
    if _is_torch_tensor(x):
        torch = sys.modules["torch"]
        return x.dtype in (torch.float16, torch.bfloat16)
    return isinstance(x, np.ndarray) and (x.dtype == np.float16 or x.dtype.name == "bfloat16")


def _new_rows(x, name, qa):
    """New k or v rows in q's dtype: 16-bit rows under a float32/float64
    query are widened (exactly); the cache rounds them back to its own
    dtype as it stores them."""
    if x is None:
        return None
    wide = qa.dtype in (np.float32, np.float64)
    if _is_half(x) and wide:
        if _is_torch_tensor(x):
            torch = sys.modules["torch"]
            x = x.detach().to(torch.float64 if qa.dtype == np.float64 else torch.float32)
        else:
            x = x.astype(qa.dtype)
    a = as_array(x, name, TENSOR)
    if dtype_name(a) != dtype_name(qa):
        raise TypeError(f"{name} is {dtype_name(a)} but q is {dtype_name(qa)}; new rows come in "
                        f"q's dtype (or 16-bit under a float32/float64 q)")
    return a


def _cache_seqlens(x, batch):
    """An int (every sequence) or an integer array (B,), as int32."""
    if x is None:
        return None
    if isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)):
        n = check_int(x, "cache_seqlens", minimum=0, maximum=2**31 - 1)
        return np.full((batch,), n, dtype=np.int32)
    return index_array(x, "cache_seqlens")


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                           block_table=None, softmax_scale=None, causal=True,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                           return_softmax_lse=False):
    """Decoding (and chunked prefill) against a KV cache, FlashAttention's
    ``flash_attn_with_kvcache``.

    q (B, Lq, Hq, E): float32, float64, float16 or bfloat16. k_cache,
    v_cache: (B, S_max, Hkv,
    E / Ev), or paged, (num_blocks, block_size, Hkv, E / Ev) with
    ``block_table`` (B, max_blocks) int32: row r of sequence b lives in
    block block_table[b, r // block_size]. Caches may be float32, float64,
    float16 or bfloat16 (torch.bfloat16, or ml_dtypes' bfloat16 in NumPy);
    both the same dtype.

    k, v (B, Lnew, Hkv, E / Ev), optional (both or neither, and they need
    cache_seqlens): new rows, written INTO k_cache and v_cache in place at
    rows cache_seqlens[b] .. cache_seqlens[b] + Lnew - 1 (rounded to the
    cache's dtype), before q attends to rows 0 .. cache_seqlens[b] + Lnew -
    1. The caches must then be writeable NumPy arrays or torch CPU tensors:
    the write lands in their memory, never in a copy (anything else is
    refused). As in FlashAttention, cache_seqlens is not advanced: the
    caller adds Lnew. Writing past a cache's capacity is refused before
    anything is written.

    cache_seqlens: an int (the same for every sequence) or an integer array
    (B,) of rows already filled; None: every row of the cache is. causal
    (default True): query i sees key j <= i + S_b - Lq, S_b the sequence's
    length after the append. softmax_scale, window_size, softcap,
    alibi_slopes ((Hq,) or (B, Hq)), sinks ((Hq,)): as in
    attn.scaled_dot_product_attention.

    Returns out (B, Lq, Hq, Ev) in q's dtype, or (out, lse) with
    ``return_softmax_lse``, lse (B, Hq, Lq). NumPy in, NumPy out; torch in,
    torch out. No autograd: inputs that require grad (in grad mode) raise
    RuntimeError.
    """
    torch_call = any(_is_torch_tensor(x) for x in (q, k_cache, v_cache, k, v, cache_seqlens,
                                                     block_table, alibi_slopes, sinks))
    _refuse_grad("attention_with_kvcache", q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                 alibi_slopes=alibi_slopes, sinks=sinks)
    qa = as_array(q, "q", TENSOR)
    _require_rank(qa, "q", 4, "(B, Lq, Hq, E)")
    if (k is None) != (v is None):
        raise ValueError(f"{'k' if v is None else 'v'} is given without "
                         f"{'v' if v is None else 'k'}: new rows come as both k and v, or neither")
    appending = k is not None
    if appending:
        _refuse_inference_write(k_cache=k_cache, v_cache=v_cache)
    kc, kc_bf16 = _cache(k_cache, "k_cache", appending)
    vc, vc_bf16 = _cache(v_cache, "v_cache", appending)
    if kc_bf16 != vc_bf16:
        raise TypeError(f"k_cache and v_cache must share one dtype; got "
                        f"{'bfloat16' if kc_bf16 else kc.dtype} and "
                        f"{'bfloat16' if vc_bf16 else vc.dtype}")
    a = SimpleNamespace()
    ka, va = _new_rows(k, "k", qa), _new_rows(v, "v", qa)
    seqlens = _cache_seqlens(cache_seqlens, qa.shape[0])
    table = None if block_table is None else index_array(block_table, "block_table")
    scale = check_scale(softmax_scale, "softmax_scale")
    is_causal = check_bool(causal, "causal")
    check_modifiers(a, window_size, alibi_slopes, softcap, sinks)
    want_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    try:
        out, lse = _attn.sdpa_kvcache(
            qa, kc, vc, empty=empty, k=ka, v=va, cache_seqlens=seqlens, block_table=table,
            cache_bf16=kc_bf16, causal=_BOTTOM_RIGHT if is_causal else 0, scale=scale,
            want_lse=want_lse, **modifier_options(a),
        )
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise library_error(e, _RENAME) from None
    if appending:
        _bump_versions(k_cache, v_cache)
    return _finish(torch_call, out, lse, want_lse, q)
