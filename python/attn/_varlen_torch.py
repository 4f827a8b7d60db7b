"""attn.varlen_attention for torch tensors that autograd records: the custom
operators ``attn::varlen`` and ``attn::varlen_backward`` (libattn's
attn_sdpa_varlen with lse_for_backward, and attn_sdpa_varlen_backward) with
their autograd formula and fake (shape-only) functions, as attn/_torch.py
does for scaled_dot_product_attention.

Loaded by attn/_serving.py only once a torch tensor has been handed to
varlen_attention (so torch is already imported).
"""

from typing import Optional, Tuple

import numpy as np
import torch

from . import _attn
from ._arrays import empty, library_error, torch_array, torch_result
from ._torch import _seed, compiling, drawn_seed, has_tangent, seed_tensor  # noqa: F401

Tensor = torch.Tensor


def _zeros(shape, dtype_name):
    """Zero-filled outputs (bfloat16: its int16 bits): rows no sequence
    holds are left as allocated by the forward."""
    return np.zeros(shape, np.int16 if dtype_name == "bfloat16" else dtype_name)


def _options(dropout_p, scale, causal, seed, window_left, window_right, softcap, alibi_slopes,
             sinks):
    return dict(causal=causal, scale=scale, dropout_p=dropout_p, seed=_seed(seed),
                window_left=window_left, window_right=window_right, softcap=softcap,
                alibi_slopes=torch_array(alibi_slopes), sinks=torch_array(sinks))


def _varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, scale: Optional[float], causal: int,
    seed: Tensor, window_left: int, window_right: int, softcap: float,
    alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
) -> Tuple[Tensor, Tensor]:
    """attn_sdpa_varlen: (out, lse), lse (Hq, total_q) in float64, the
    log-sum-exp of the scores the backward recomputes; -inf on rows no
    sequence holds."""
    try:
        out, lse = _attn.sdpa_varlen(
            torch_array(q), torch_array(k), torch_array(v), torch_array(cu_seqlens_q),
            torch_array(cu_seqlens_k), max_seqlen_q, max_seqlen_k, empty=_zeros, want_lse=True,
            lse_for_backward=True,
            **_options(dropout_p, scale, causal, seed, window_left, window_right, softcap,
                       alibi_slopes, sinks),
        )
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise library_error(e) from None
    lse[:, int(cu_seqlens_q[-1]):] = -np.inf
    return torch_result(out, q.dtype), torch.from_numpy(lse)


varlen_op = torch.library.custom_op("attn::varlen", mutates_args=())(_varlen)


@varlen_op.register_fake
def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                 scale, causal, seed, window_left, window_right, softcap, alibi_slopes, sinks):
    out = q.new_empty(q.shape[:2] + (v.shape[2],))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float64)


def _varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float, scale: Optional[float], causal: int, seed: Tensor, window_left: int,
    window_right: int, softcap: float, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
    want_dq: bool, want_dk: bool, want_dv: bool, want_dsinks: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """attn_sdpa_varlen_backward: (dq, dk, dv, dsinks), each like its input
    or empty when not wanted."""
    grads = [None] * 3
    if want_dq or want_dk or want_dv:
        try:
            grads = _attn.sdpa_varlen_backward(
                torch_array(dout), torch_array(q), torch_array(k), torch_array(v),
                torch_array(out), torch_array(lse), torch_array(cu_seqlens_q),
                torch_array(cu_seqlens_k), max_seqlen_q, max_seqlen_k, empty=empty,
                want_dq=want_dq, want_dk=want_dk, want_dv=want_dv,
                **_options(dropout_p, scale, causal, seed, window_left, window_right, softcap,
                           alibi_slopes, sinks),
            )
        except (ValueError, TypeError, MemoryError, RuntimeError) as e:
            raise library_error(e) from None
    result = [q.new_empty(0) if g is None else torch_result(g, like.dtype)
              for g, like in zip(grads, (q, k, v))]
    dsinks = q.new_empty(0)
    if want_dsinks:
        dsinks = _sinks_gradient(dout, out, lse, sinks, cu_seqlens_q)
    return tuple(result) + (dsinks,)


def _sinks_gradient(dout, out, lse, sinks, cu_seqlens_q):
    """attn_sdpa_varlen_sinks_backward: for sequence n and head h, -sum over
    its rows of exp(sink_nh - lse_row) * (dout_row . out_row), in float64
    (rows with lse = -inf, which saw no key or no sequence holds, take no
    part), summed over what the sinks were broadcast over ((Hq,), (1, Hq),
    (B, Hq), (B, 1) ... against the batch (B, Hq)); in the sinks' dtype."""
    try:
        dsinks = _attn.sdpa_varlen_sinks_backward(
            torch_array(dout), torch_array(out), torch_array(lse), torch_array(cu_seqlens_q),
            torch_array(sinks), empty=empty)
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise library_error(e) from None
    return torch_result(dsinks, sinks.dtype)


varlen_backward_op = torch.library.custom_op(
    "attn::varlen_backward", mutates_args=())(_varlen_backward)


@varlen_backward_op.register_fake
def _varlen_backward_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, scale, causal, seed, window_left, window_right,
                          softcap, alibi_slopes, sinks, want_dq, want_dk, want_dv, want_dsinks):
    def like(x, wanted):
        return x.new_empty(x.shape) if wanted and x is not None else q.new_empty(0)

    return like(q, want_dq), like(k, want_dk), like(v, want_dv), like(sinks, want_dsinks)


_N_INPUTS = 16  # varlen_op's inputs, in its schema's order
_SINKS = 15


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, seed, window_left,
     window_right, softcap, alibi_slopes, sinks) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # an output to look at, as scaled_dot_product_attention's
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, alibi_slopes, sinks)
    ctx.options = (max_q, max_k, dropout_p, scale, causal)
    ctx.modifiers = (window_left, window_right, softcap)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, seed, alibi_slopes, sinks = ctx.saved_tensors
    need = ctx.needs_input_grad
    max_q, max_k, dropout_p, scale, causal = ctx.options
    want_dsinks = bool(need[_SINKS]) and sinks is not None
    dq, dk, dv, dsinks = varlen_backward_op(
        dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, scale,
        causal, seed, *ctx.modifiers, alibi_slopes, sinks, bool(need[0]), bool(need[1]),
        bool(need[2]), want_dsinks)
    grads = [None] * _N_INPUTS
    grads[0] = dq if need[0] else None
    grads[1] = dk if need[1] else None
    grads[2] = dv if need[2] else None
    # ALiBi slopes get no gradient, as in FlashAttention (and in
    # scaled_dot_product_attention): they are fixed
    grads[_SINKS] = dsinks if want_dsinks else None
    return tuple(grads)


varlen_op.register_autograd(_backward, setup_context=_setup_context)


def recorded(*inputs):
    """Whether autograd records a call on these inputs: one requires grad
    in grad mode, or carries a forward-mode tangent."""
    grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
    return grad or has_tangent(*inputs)


def _tensor(x, checked):
    """The operator's argument: the caller's tensor itself (autograd needs
    it, and its version counter guards what the backward saves), or a
    tensor over a copy of the checked NumPy array of a non-tensor (a NumPy
    array has no version counter: the caller may refill it before the
    backward, which would then see other values)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x
    t = torch.from_numpy(np.array(checked, copy=True, order="C"))
    return t.view(torch.bfloat16) if checked.dtype == np.int16 else t


def run(q, k, v, checked, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, seed,
        alibi_slopes, sinks):
    """The recorded call on arguments attn/_serving.py checked: `checked`
    holds the NumPy views of q, k, v, the slopes and the sinks; cu_q, cu_k
    are its int32 offsets. Returns (out, lse) with lse in float64."""
    if has_tangent(q, k, v, alibi_slopes, sinks):  # the operator would drop it silently
        raise NotImplementedError(
            "attn.varlen_attention has no forward-mode AD (jvp) formula: an input carries a "
            "tangent (torch.autograd.forward_ad), which the result could not carry; use "
            "reverse mode (backward, torch.autograd.grad)")
    # the offsets copied: index_array may return the caller's own int32
    # memory, which a refill before the backward would change under it
    return varlen_op(
        _tensor(q, checked.q), _tensor(k, checked.k), _tensor(v, checked.v),
        torch.from_numpy(cu_q.copy()), torch.from_numpy(cu_k.copy()), max_q, max_k, dropout_p,
        scale, causal,
        seed_tensor(seed), checked.window[0], checked.window[1], checked.softcap,
        _tensor(alibi_slopes, checked.alibi), _tensor(sinks, checked.sinks))


def _traced_tensor(x):
    return x if x is None or isinstance(x, torch.Tensor) else torch.as_tensor(x)


def traced(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
           softmax_scale, causal, window_size, softcap, alibi_slopes, sinks, return_lse, seed):
    """The call while torch.compile traces: only what shapes and the graph
    need (as attn/_torch.py's traced). The checks of the eager call run
    when the compiled graph calls the operator."""
    cu_q, cu_k = (_traced_tensor(x).to(torch.int32) for x in (cu_seqlens_q, cu_seqlens_k))
    p = float(dropout_p)
    seed_t = (drawn_seed() if p > 0.0 else seed_tensor(0)) if seed is None else seed_tensor(seed)
    out, lse = varlen_op(_traced_tensor(q), _traced_tensor(k), _traced_tensor(v), cu_q, cu_k,
                         int(max_seqlen_q), int(max_seqlen_k), p, softmax_scale,
                         2 if causal else 0, seed_t, int(window_size[0]),
                         int(window_size[1]), float(softcap), _traced_tensor(alibi_slopes),
                         _traced_tensor(sinks))
    return (out, lse) if return_lse else out
