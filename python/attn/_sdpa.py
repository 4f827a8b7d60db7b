"""attn.scaled_dot_product_attention: torch.nn.functional's signature over
libattn's attn_sdpa(); torch tensors go through attn/_torch.py."""

import sys

import numpy as np

from . import _attn
from ._arrays import (
    results,
    TENSOR,
    _is_torch_tensor,
    MASK,
    as_array,
    as_bfloat16,
    dtype_name,
    empty,
    check_bool,
    check_probability,
    check_scale,
    check_seed,
    check_softcap,
    check_window,
    library_error,
    random_seed,
)

_CAUSAL = {"top-left": 1, "bottom-right": 2}
# native byte order; float16 too (bfloat16 takes the checked path: NumPy's
# is ml_dtypes', passed as its bits)
_NATIVE_FLOAT = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16))
_NO_WINDOW = (-1, -1)  # the default window_size, recognised by identity
_torch_route = None  # attn._torch, once a call has brought torch tensors


def _torch_module():
    """attn._torch (torch is loaded: a torch tensor exists), imported once:
    `from . import _torch` on every call cost 5,500 instructions, 6% of a
    16-token call on torch tensors (callgrind)."""
    global _torch_route
    if _torch_route is None:
        from . import _torch
        _torch_route = _torch
    return _torch_route


def _causal_bias(mask):
    """(alignment, L, S) of a torch CausalBias, or None. Its storage is an
    uninitialised placeholder: what it means is only in these fields."""
    # By its class, not by looking torch up: under torch.compile a lookup
    # in sys.modules becomes a guard on a module the trace itself may import.
    cls = type(mask)
    if cls.__name__ != "CausalBias" or cls.__module__ != "torch.nn.attention.bias":
        return None
    bias = sys.modules[cls.__module__]
    upper = mask.variant == bias.CausalVariant.UPPER_LEFT
    return "top-left" if upper else "bottom-right", mask.seq_len_q, mask.seq_len_kv


def _check_causal_bias(found, causal, q, k):
    alignment, lq, skv = found
    if causal:  # torch: "CausalBias should not be used with causal=True"
        raise ValueError("attn_mask is a CausalBias, which already is a causal mask; torch "
                         "refuses it with is_causal=True, and so does attn")
    if q.ndim >= 2 and k.ndim >= 2 and (q.shape[-2], k.shape[-2]) != (lq, skv):
        raise ValueError(
            f"attn_mask is a CausalBias for {lq} queries and {skv} keys, but query has "
            f"L = {q.shape[-2]} and key S = {k.shape[-2]}"
        )
    return alignment


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    causal_alignment="top-left",
    seed=None,
    return_weights=False,
    return_lse=False,
    window_size=_NO_WINDOW,
    alibi_slopes=None,
    softcap=0.0,
    sinks=None,
):
    """Scaled dot-product attention with the semantics of PyTorch 2.13's
    ``torch.nn.functional.scaled_dot_product_attention``::

        out = dropout(softmax(scale * query @ key.T + mask)) @ value

    query (..., Hq, L, E), key (..., H, S, E), value (..., H, S, Ev): float32
    or float64 NumPy arrays, torch CPU tensors or anything ``np.asarray``
    takes, with any strides (read in place). Batch dimensions broadcast.

    attn_mask: broadcastable to (..., Hq, L, S); bool (True = the key takes
    part) or float (added to the scores; -inf removes the key); or torch's
    ``causal_upper_left(L, S)`` / ``causal_lower_right(L, S)`` (a CausalBias),
    taken as is_causal with the top-left / bottom-right alignment.
    is_causal: query i sees key j iff j <= i (``causal_alignment="top-left"``,
    PyTorch's) or j <= i + S - L (``"bottom-right"``, for KV caches). Unlike
    PyTorch, a mask and is_causal may be combined: a key takes part only if
    both allow it.
    scale: default 1/sqrt(E); any finite value. enable_gqa: Hq may be a
    multiple of H (grouped-query attention, no copies).
    dropout_p: drops each weight with probability p and scales the kept ones
    by 1/(1-p). The mask is a pure function of ``seed`` (a fresh random seed
    per call when None), so a given seed always gives the same result.

    A row whose keys are all masked out gives 0 (PyTorch >= 2.5 does too).

    Score modifiers (keyword-only; FlashAttention's names and meanings, the
    positions aligned bottom-right: query i sits at i + S - L):
    ``window_size=(left, right)``: query i sees key j only when
    i + S - L - left <= j <= i + S - L + right; -1 leaves a side unbounded
    (the default, (-1, -1), is no window). Combines with is_causal and masks.
    ``alibi_slopes``: float32/float64, shape (Hq,) or (B, Hq) (broadcastable
    to out's batch dimensions): -slope * |i + S - L - j| is added to the
    scaled score. ``softcap``: when > 0, each scaled score s becomes
    softcap * tanh(s / softcap), before ALiBi and masks (Gemma 2).
    ``sinks``: one logit per query head, shape (Hq,): exp(sink) joins each
    row's softmax denominator and carries no value (gpt-oss), so a row's
    weights sum to less than 1; a row that sees no key gives out = 0 and
    lse = sink.

    Torch tensors in (any of query, key, value, attn_mask) give torch tensors
    out, through the custom operator ``attn::sdpa``: when one that requires
    grad takes part in grad mode (a float attn_mask included), the result
    has a grad_fn and gradients flow back to it (attn_sdpa_backward); the
    call also traces under torch.compile. Without an explicit ``seed``, the
    dropout seed of a torch call is drawn from torch's default generator,
    so ``torch.manual_seed`` repeats it. weights and lse carry no gradient.
    ``sinks`` that require grad get their gradient too
    (attn_sdpa_sinks_backward); ``alibi_slopes`` get none, as in
    FlashAttention (they are fixed per head; a slopes tensor that requires
    grad is read, and its .grad stays None).

    Returns ``out`` (..., Hq, L, Ev) as a NumPy array, or a tuple
    ``(out, weights, lse)`` holding whichever extras were asked for:
    ``return_weights`` gives the attention weights (..., Hq, L, S) after
    dropout (so out == weights @ value), ``return_lse`` the natural-log
    log-sum-exp of each row's scores (..., Hq, L), before dropout (-inf for a
    fully masked row).
    """
    if (type(query) is np.ndarray and type(key) is np.ndarray and type(value) is np.ndarray
            and attn_mask is None and scale is None and seed is None and alibi_slopes is None
            and sinks is None and return_weights is False and return_lse is False
            and type(is_causal) is bool and type(enable_gqa) is bool
            and type(dropout_p) is float and dropout_p == 0.0
            and type(softcap) is float and softcap == 0.0
            and window_size is _NO_WINDOW
            and type(causal_alignment) is str and causal_alignment in _CAUSAL
            and query.dtype in _NATIVE_FLOAT and key.dtype == query.dtype
            and value.dtype == query.dtype):
        # The plain call on NumPy arrays, whose arguments need no checking
        # here (the library checks the arrays): _arguments costs 12 us, more
        # than a 16-token attention (make bench, short sequences).
        try:
            out, _, _ = _attn.sdpa(query, key, value, empty=empty, enable_gqa=enable_gqa,
                                   causal=_CAUSAL[causal_alignment] if is_causal else 0)
        except (ValueError, TypeError, MemoryError, RuntimeError) as e:
            raise library_error(e) from None
        return out
    if (_is_torch_tensor(query) and seed is None and alibi_slopes is None and sinks is None
            and return_weights is False and return_lse is False and window_size is _NO_WINDOW
            and type(softcap) is float and softcap == 0.0 and type(dropout_p) is float
            and type(is_causal) is bool and type(enable_gqa) is bool
            and type(causal_alignment) is str and causal_alignment in _CAUSAL):
        # torch's own arguments on plain tensors (a model's layers,
        # patch_torch): checked as the library reads them (_torch.plain)
        _torch = _torch_route or _torch_module()
        if not _torch.compiling():  # FakeTensors take the traced route below
            out = _torch.plain(query, key, value, attn_mask, dropout_p,
                               _CAUSAL[causal_alignment] if is_causal else 0, scale, enable_gqa)
            if out is not None:
                return out
    # A CausalBias stands for an option, not for data: it alone does not make
    # the call a torch call.
    mask_data = attn_mask if _causal_bias(attn_mask) is None else None
    modifiers = dict(window_size=window_size, alibi_slopes=alibi_slopes, softcap=softcap,
                     sinks=sinks)
    if any(_is_torch_tensor(x) for x in (query, key, value, mask_data, alibi_slopes, sinks)):
        _torch = _torch_route or _torch_module()
        if _torch.compiling():  # FakeTensors: nothing to read or check yet
            return _torch.traced(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                 enable_gqa, causal_alignment, seed, return_weights, return_lse,
                                 **modifiers)
        if (seed is None and window_size is _NO_WINDOW and alibi_slopes is None and sinks is None
                and not return_weights and not return_lse and softcap == 0.0
                and causal_alignment == "top-left"):  # torch's own arguments only
            out = _torch.empty_call(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                    enable_gqa)
            if out is not None:
                return out
        a = _arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       causal_alignment, seed, return_weights, return_lse, grad_ok=True,
                       **modifiers)
        return _torch.run(a, query, key, value, attn_mask, alibi_slopes, sinks)
    a = _arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                   causal_alignment, seed, return_weights, return_lse, **modifiers)
    if a.seed is None:
        a.seed = random_seed() if a.dropout_p > 0.0 else 0
    try:
        out, weights, lse = _attn.sdpa(
            a.q, a.k, a.v, empty=empty, attn_mask=a.mask, causal=a.causal, scale=a.scale,
            enable_gqa=a.gqa, dropout_p=a.dropout_p, seed=a.seed, want_weights=a.want_w,
            want_lse=a.want_lse, **modifier_options(a),
        )
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise library_error(e) from None
    return results(a, as_bfloat16(out, query), as_bfloat16(weights, query), lse)


def modifier_options(a):
    """The score modifiers of checked arguments `a` as _attn's keywords."""
    return dict(window_left=a.window[0], window_right=a.window[1], softcap=a.softcap,
                alibi_slopes=a.alibi, sinks=a.sinks)


def check_modifiers(a, window_size, alibi_slopes, softcap, sinks, grad_ok=False):
    """Checks the score modifiers into `a` (window, softcap, alibi, sinks);
    slopes and sinks become NumPy views. Shared with attn.varlen_attention
    and attn.attention_with_kvcache."""
    a.window = check_window(window_size)
    a.softcap = check_softcap(softcap)
    # any float dtype, as attn.h takes them (a bfloat16 model's sinks are bfloat16)
    a.alibi = None if alibi_slopes is None else as_array(alibi_slopes, "alibi_slopes", TENSOR,
                                                         grad_ok)
    a.sinks = None if sinks is None else as_array(sinks, "sinks", TENSOR, grad_ok)


def check_dtypes(q, k, v, names=("query", "key", "value")):
    """attn.h's rule: key and value share one dtype, and query has it too,
    or is float32 over float16/bfloat16 keys and values (a low-precision KV
    cache). Output dtypes follow the query's."""
    qd, kd, vd = dtype_name(q), dtype_name(k), dtype_name(v)
    if kd != vd or (qd != kd and not (qd == "float32" and kd in ("float16", "bfloat16"))):
        e = TypeError(
            f"{names[0]}, {names[1]} and {names[2]} must share one dtype (a float32 {names[0]} "
            f"may also read float16 or bfloat16 {names[1]} and {names[2]}); got {qd}, {kd} "
            f"and {vd}"
        )
        e.arg = names[2] if kd != vd and kd == qd else names[1]  # the odd one out, as attn.h
        raise e


class _Args:
    """The checked arguments of one call."""

    __slots__ = ("q", "k", "v", "mask", "causal", "scale", "gqa", "dropout_p", "seed",
                 "want_w", "want_lse", "window", "softcap", "alibi", "sinks")


def _arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
               causal_alignment, seed, return_weights, return_lse, grad_ok=False,
               window_size=(-1, -1), alibi_slopes=None, softcap=0.0, sinks=None):
    """Checks every argument; the arrays become NumPy views (no copies), the
    causal options attn_causal's code. `grad_ok`: tensors that require grad
    are fine (the caller records the call for autograd)."""
    a = _Args()
    q = as_array(query, "query", TENSOR, grad_ok)
    k = as_array(key, "key", TENSOR, grad_ok)
    v = as_array(value, "value", TENSOR, grad_ok)
    check_dtypes(q, k, v)
    causal = check_bool(is_causal, "is_causal")
    if not isinstance(causal_alignment, str) or causal_alignment not in _CAUSAL:
        raise ValueError(
            f"causal_alignment is {causal_alignment!r}; expected 'top-left' or 'bottom-right'"
        )
    mask = None
    bias = _causal_bias(attn_mask)
    if bias is not None:  # honoured as the causal option it stands for
        causal_alignment = _check_causal_bias(bias, causal, q, k)
        causal = True
    elif attn_mask is not None:
        mask = as_array(attn_mask, "attn_mask", MASK, grad_ok)
        if mask.ndim == 0:  # a scalar broadcasts like any size-1 array
            mask = mask.reshape(1)
    a.q, a.k, a.v, a.mask = q, k, v, mask
    a.causal = _CAUSAL[causal_alignment] if causal else 0
    a.dropout_p = check_probability(dropout_p, "dropout_p")
    a.scale = check_scale(scale)
    a.gqa = check_bool(enable_gqa, "enable_gqa")
    a.seed = check_seed(seed)
    a.want_w = check_bool(return_weights, "return_weights")
    a.want_lse = check_bool(return_lse, "return_lse")
    check_modifiers(a, window_size, alibi_slopes, softcap, sinks, grad_ok)
    return a
