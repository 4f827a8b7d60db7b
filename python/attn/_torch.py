"""attn for torch tensors: the custom operators ``attn::sdpa`` and
``attn::sdpa_backward``, with their autograd formula and fake (shape-only)
functions, so that calls are recorded for a backward pass and traced by
torch.compile like any torch operator.

This module imports torch. attn/_sdpa.py loads it only once it has been
handed a torch tensor (so torch is already imported), and patch_torch()
loads it on purpose: ``import attn`` never imports torch.
"""

from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.attention.bias  # noqa: F401  loaded before torch.compile traces a call

from . import _attn
from ._arrays import library_error

Tensor = torch.Tensor

# Seeds are uint64 in attn and int64 in a torch schema: the same 64 bits.
_U64 = 2**64


def seed_tensor(seed):
    """A uint64 seed as the int64 scalar tensor the operators take."""
    return torch.tensor(seed - _U64 if seed >= 2**63 else seed, dtype=torch.int64)


def drawn_seed():
    """A seed from torch's default generator, so that torch.manual_seed
    repeats a run's dropout. A tensor: under torch.compile the draw is part
    of the graph instead of a constant baked into it."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64)


def _seed(seed):
    return int(seed.item()) % _U64


def _array(t):
    """A NumPy view of a plain CPU tensor (an operator's inputs are plain:
    the public function checked them, or torch made them)."""
    return t.detach().resolve_conj().resolve_neg().numpy()


def _options(attn_mask, dropout_p, causal, scale, enable_gqa, seed):
    return dict(
        attn_mask=None if attn_mask is None else _array(attn_mask), causal=causal,
        scale=scale, enable_gqa=enable_gqa, dropout_p=dropout_p, seed=_seed(seed),
    )


@torch.library.custom_op("attn::sdpa", mutates_args=())
def sdpa_op(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
    causal: int, scale: Optional[float], enable_gqa: bool, seed: Tensor, want_weights: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    """attn_sdpa: (out, weights, lse); weights is empty unless asked for.
    causal: 0 none, 1 top-left, 2 bottom-right."""
    try:
        out, w, lse = _attn.sdpa(
            _array(query), _array(key), _array(value), empty=np.empty, want_weights=want_weights,
            want_lse=True, lse_for_backward=True,  # weights recomputed from it sum to 1
            **_options(attn_mask, dropout_p, causal, scale, enable_gqa, seed),
        )
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise library_error(e) from None
    w = torch.from_numpy(w) if want_weights else query.new_empty(0)
    return torch.from_numpy(out), w, torch.from_numpy(lse)


def out_batch_shape(query, key, value, enable_gqa):
    """B... (with Hq last): the broadcast of the three batch shapes; with
    GQA the head dimension is the query's (keys and values are shared by a
    group of query heads, not broadcast)."""
    shapes = [tuple(x.shape[:-2]) for x in (query, key, value)]
    if enable_gqa and shapes[0]:
        shapes = [shapes[0]] + [s[:-1] + (1,) if s else s for s in shapes[1:]]
    return tuple(torch.broadcast_shapes(*shapes))


@sdpa_op.register_fake
def _sdpa_fake(query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa, seed,
               want_weights):
    b = out_batch_shape(query, key, value, enable_gqa)
    L, S, Ev = query.shape[-2], key.shape[-2], value.shape[-1]
    w = query.new_empty(b + (L, S)) if want_weights else query.new_empty(0)
    return query.new_empty(b + (L, Ev)), w, query.new_empty(b + (L,), dtype=torch.float64)


@torch.library.custom_op("attn::sdpa_backward", mutates_args=())
def sdpa_backward_op(
    dout: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
    attn_mask: Optional[Tensor], dropout_p: float, causal: int, scale: Optional[float],
    enable_gqa: bool, seed: Tensor, want_dq: bool, want_dk: bool, want_dv: bool,
    want_dmask: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """attn_sdpa_backward: (dq, dk, dv, dmask), each shaped like its input,
    or empty when not wanted."""
    try:
        grads = _attn.sdpa_backward(
            _array(dout), _array(query), _array(key), _array(value), _array(out), _array(lse),
            empty=np.empty, want_dq=want_dq, want_dk=want_dk, want_dv=want_dv,
            want_dmask=want_dmask,
            **_options(attn_mask, dropout_p, causal, scale, enable_gqa, seed),
        )
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise library_error(e) from None
    return tuple(query.new_empty(0) if g is None else torch.from_numpy(g) for g in grads)


@sdpa_backward_op.register_fake
def _sdpa_backward_fake(dout, query, key, value, out, lse, attn_mask, dropout_p, causal, scale,
                        enable_gqa, seed, want_dq, want_dk, want_dv, want_dmask):
    def like(x, wanted):
        return x.new_empty(x.shape) if wanted else query.new_empty(0)

    return (like(query, want_dq), like(key, want_dk), like(value, want_dv),
            like(attn_mask, want_dmask) if attn_mask is not None else query.new_empty(0))


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa, seed, _ = inputs
    out, weights, lse = output
    # The weights and the log-sum-exp are outputs to look at, not to train
    # through: gradients flow through out only (docs/python.md).
    ctx.mark_non_differentiable(weights, lse)
    ctx.save_for_backward(query, key, value, attn_mask, out, lse, seed)
    ctx.options = (dropout_p, causal, scale, enable_gqa)


def _backward(ctx, dout, dweights, dlse):
    query, key, value, attn_mask, out, lse, seed = ctx.saved_tensors
    need = ctx.needs_input_grad
    want_dmask = bool(need[3]) and attn_mask is not None and attn_mask.is_floating_point()
    dq, dk, dv, dmask = sdpa_backward_op(
        dout, query, key, value, out, lse, attn_mask, *ctx.options, seed,
        bool(need[0]), bool(need[1]), bool(need[2]), want_dmask,
    )
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            dmask if want_dmask else None, None, None, None, None, None, None)


sdpa_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------
# attn.scaled_dot_product_attention on torch tensors
# ---------------------------------------------------------------------------


def compiling():
    """Whether torch.compile is tracing (the inputs are FakeTensors)."""
    return torch.compiler.is_compiling()


def _tensor(x, checked):
    """The operator's argument for one input: the tensor itself (autograd
    needs it), or a tensor holding the checked array of a non-tensor."""
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.from_numpy(checked)
    except ValueError:  # negative strides: torch has none
        return torch.from_numpy(np.ascontiguousarray(checked))


def _seed_for(seed, dropout_p):
    if seed is None:
        return drawn_seed() if dropout_p > 0.0 else seed_tensor(0)
    return seed_tensor(seed)


def run(a, query, key, value, attn_mask):
    """The call on checked arguments `a` (attn/_sdpa.py) through attn::sdpa,
    so autograd records it when an input requires grad."""
    from ._sdpa import results

    mask = None
    if a.mask is not None:
        mask = _tensor(attn_mask, a.mask)
        if mask.dim() == 0:  # a scalar broadcasts like any size-1 tensor
            mask = mask.reshape(1)
    out, w, lse = sdpa_op(
        _tensor(query, a.q), _tensor(key, a.k), _tensor(value, a.v), mask, a.dropout_p,
        a.causal, a.scale, a.gqa, _seed_for(a.seed, a.dropout_p), a.want_w,
    )
    return results(a, out, w, lse)


def traced(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
           causal_alignment, seed, return_weights, return_lse):
    """The call while torch.compile traces: only what shapes and graph need.
    The checks of the eager call run when the compiled graph calls the
    operator (the library's own) or were made by torch while tracing."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    causal = {"top-left": 1, "bottom-right": 2}[causal_alignment] if is_causal else 0
    if isinstance(attn_mask, CausalBias):
        causal = 1 if attn_mask.variant == CausalVariant.UPPER_LEFT else 2
        attn_mask = None
    if attn_mask is not None and attn_mask.dim() == 0:
        attn_mask = attn_mask.reshape(1)
    out, w, lse = sdpa_op(query, key, value, attn_mask, float(dropout_p), causal, scale,
                          bool(enable_gqa), _seed_for(seed, dropout_p), bool(return_weights))
    if not (return_weights or return_lse):
        return out
    return (out,) + ((w,) if return_weights else ()) + ((lse,) if return_lse else ())
