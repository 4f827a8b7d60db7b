"""attn for torch tensors: the custom operators ``attn::sdpa`` and
``attn::sdpa_backward``, with their autograd formula and fake (shape-only)
functions, so that calls are recorded for a backward pass and traced by
torch.compile like any torch operator.

This module imports torch. attn/_sdpa.py loads it only once it has been
handed a torch tensor (so torch is already imported), and patch_torch()
loads it on purpose: ``import attn`` never imports torch.
"""

import math
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.attention.bias  # noqa: F401  loaded before torch.compile traces a call
from torch.autograd import forward_ad

from . import _attn
from ._arrays import (TENSOR, _torch_dtypes, empty, is_bfloat16, library_error, results,
                      storage_short, torch_array, torch_result)

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


def _options(attn_mask, dropout_p, causal, scale, enable_gqa, seed, window_left, window_right,
             alibi_slopes, softcap, sinks=None):
    """_attn's keywords for the operators' options (sinks: only where given)."""
    opts = dict(
        attn_mask=torch_array(attn_mask), causal=causal, scale=scale,
        enable_gqa=enable_gqa, dropout_p=dropout_p, seed=_seed(seed), window_left=window_left,
        window_right=window_right, softcap=softcap, alibi_slopes=torch_array(alibi_slopes),
    )
    if sinks is not None:
        opts["sinks"] = torch_array(sinks)
    return opts


# The score modifiers (window_left, window_right, alibi_slopes, softcap,
# sinks) come last in both schemas, with defaults that leave them off, so
# calls written before them still fit: FlashAttention's window_size, ALiBi,
# softcap and gpt-oss's sinks (attn_sdpa_params's fields).
def _sdpa(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
    causal: int, scale: Optional[float], enable_gqa: bool, seed: Tensor, want_weights: bool,
    window_left: int = -1, window_right: int = -1, alibi_slopes: Optional[Tensor] = None,
    softcap: float = 0.0, sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """attn_sdpa: (out, weights, lse); weights is empty unless asked for.
    causal: 0 none, 1 top-left, 2 bottom-right."""
    try:
        out, w, lse = _attn.sdpa(
            torch_array(query), torch_array(key), torch_array(value), empty=empty,
            want_weights=want_weights,
            want_lse=True, lse_for_backward=True,  # weights recomputed from it sum to 1
            **_options(attn_mask, dropout_p, causal, scale, enable_gqa, seed, window_left,
                       window_right, alibi_slopes, softcap, sinks),
        )
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise library_error(e) from None
    w = torch_result(w, query.dtype) if want_weights else query.new_empty(0)
    return torch_result(out, query.dtype), w, torch.from_numpy(lse)


sdpa_op = torch.library.custom_op("attn::sdpa", mutates_args=())(_sdpa)


def _arrays_sdpa(q, k, v, dtype, want_weights=False, want_lse=False, **options):
    """_attn.sdpa on NumPy views, its errors as Python's (library_error);
    out and weights as torch tensors of `dtype`, lse (when asked for) the
    float64 lse of the kernels' own scores (lse_for_backward), as _sdpa's."""
    try:
        out, w, lse = _attn.sdpa(q, k, v, empty=empty, want_weights=want_weights,
                                 want_lse=want_lse, lse_for_backward=want_lse, **options)
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise library_error(e) from None
    return (torch_result(out, dtype), torch_result(w, dtype) if want_weights else None,
            torch.from_numpy(lse) if want_lse else None)


def _untracked(query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa, seed,
               want_weights, want_lse, window_left=-1, window_right=-1, alibi_slopes=None,
               softcap=0.0, sinks=None):
    """attn_sdpa for a call autograd does not record, as a NumPy call makes
    it: the layout the shape asks for, not the one a backward's lse needs
    (keys in columns for decoding: (1,32,1,32768,128) with 8 KV heads took
    2.3x the NumPy call's time through _sdpa), so torch and NumPy inputs
    give the same bits. A call that asks for lse gets _sdpa's (float64, of
    the kernels' own scores), and so _sdpa's layout and bits."""
    return _arrays_sdpa(
        torch_array(query), torch_array(key), torch_array(value), query.dtype, want_weights,
        want_lse, **_options(attn_mask, dropout_p, causal, scale, enable_gqa, seed, window_left,
                             window_right, alibi_slopes, softcap, sinks))


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
               want_weights, window_left=-1, window_right=-1, alibi_slopes=None, softcap=0.0,
               sinks=None):
    b = out_batch_shape(query, key, value, enable_gqa)
    L, S, Ev = query.shape[-2], key.shape[-2], value.shape[-1]
    w = query.new_empty(b + (L, S)) if want_weights else query.new_empty(0)
    return query.new_empty(b + (L, Ev)), w, query.new_empty(b + (L,), dtype=torch.float64)


def _sdpa_backward(
    dout: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
    attn_mask: Optional[Tensor], dropout_p: float, causal: int, scale: Optional[float],
    enable_gqa: bool, seed: Tensor, want_dq: bool, want_dk: bool, want_dv: bool,
    want_dmask: bool, window_left: int = -1, window_right: int = -1,
    alibi_slopes: Optional[Tensor] = None, softcap: float = 0.0, sinks: Optional[Tensor] = None,
    want_dsinks: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """attn_sdpa_backward and attn_sdpa_sinks_backward: (dq, dk, dv, dmask,
    dsinks), each shaped like its input, or empty when not wanted."""
    opts = _options(attn_mask, dropout_p, causal, scale, enable_gqa, seed, window_left,
                    window_right, alibi_slopes, softcap, sinks)
    arrays = [torch_array(x) for x in (dout, query, key, value, out, lse)]
    grads = [None] * 5
    try:
        if want_dq or want_dk or want_dv or want_dmask:
            grads[:4] = _attn.sdpa_backward(
                *arrays, empty=empty, want_dq=want_dq, want_dk=want_dk, want_dv=want_dv,
                want_dmask=want_dmask, **opts,
            )
        if want_dsinks:  # the same dout, out and lse: the sinks' share of the loss
            del opts["attn_mask"]
            sinks_array = opts.pop("sinks")
            grads[4] = _attn.sdpa_sinks_backward(arrays[0], arrays[4], arrays[5], sinks_array,
                                                 empty=empty, **opts)
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise library_error(e) from None
    likes = (query, key, value, attn_mask, sinks)
    return tuple(query.new_empty(0) if g is None else torch_result(g, like.dtype)
                 for g, like in zip(grads, likes))


sdpa_backward_op = torch.library.custom_op("attn::sdpa_backward", mutates_args=())(_sdpa_backward)


@sdpa_backward_op.register_fake
def _sdpa_backward_fake(dout, query, key, value, out, lse, attn_mask, dropout_p, causal, scale,
                        enable_gqa, seed, want_dq, want_dk, want_dv, want_dmask, window_left=-1,
                        window_right=-1, alibi_slopes=None, softcap=0.0, sinks=None,
                        want_dsinks=False):
    def like(x, wanted):
        return x.new_empty(x.shape) if wanted and x is not None else query.new_empty(0)

    return (like(query, want_dq), like(key, want_dk), like(value, want_dv),
            like(attn_mask, want_dmask), like(sinks, want_dsinks))


# sdpa_op's inputs by position (the schema's order), and the defaults of
# the trailing ones: torch leaves out trailing arguments equal to their
# defaults, so ctx sees 10 to 15 inputs.
_N_INPUTS = 15
_SINKS = 14
_MODIFIER_DEFAULTS = (-1, -1, None, 0.0, None)


def _setup_context(ctx, inputs, output):
    first_default = _N_INPUTS - len(_MODIFIER_DEFAULTS)
    inputs = tuple(inputs) + _MODIFIER_DEFAULTS[len(inputs) - first_default:]
    (query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa, seed, _,
     window_left, window_right, alibi_slopes, softcap, sinks) = inputs
    out, weights, lse = output
    # The weights and the log-sum-exp are outputs to look at, not to train
    # through: gradients flow through out only (docs/python.md).
    ctx.mark_non_differentiable(weights, lse)
    ctx.save_for_backward(query, key, value, attn_mask, out, lse, seed, alibi_slopes, sinks)
    ctx.options = (dropout_p, causal, scale, enable_gqa)
    ctx.modifiers = (window_left, window_right, softcap)


def _backward(ctx, dout, dweights, dlse, gradients=sdpa_backward_op):
    query, key, value, attn_mask, out, lse, seed, alibi_slopes, sinks = ctx.saved_tensors
    n_inputs = len(ctx.needs_input_grad)  # as many gradients as torch passed inputs
    need = tuple(ctx.needs_input_grad) + (False,) * (_N_INPUTS - n_inputs)
    want_dmask = bool(need[3]) and attn_mask is not None and attn_mask.is_floating_point()
    want_dsinks = bool(need[_SINKS]) and sinks is not None
    window_left, window_right, softcap = ctx.modifiers
    dq, dk, dv, dmask, dsinks = gradients(
        dout, query, key, value, out, lse, attn_mask, *ctx.options, seed,
        bool(need[0]), bool(need[1]), bool(need[2]), want_dmask,
        window_left, window_right, alibi_slopes, softcap, sinks, want_dsinks,
    )
    grads = [None] * _N_INPUTS
    # ALiBi slopes get no gradient, as in FlashAttention: they are fixed.
    grads[0] = dq if need[0] else None
    grads[1] = dk if need[1] else None
    grads[2] = dv if need[2] else None
    grads[3] = dmask if want_dmask else None
    grads[_SINKS] = dsinks if want_dsinks else None
    return tuple(grads[:n_inputs])


sdpa_op.register_autograd(_backward, setup_context=_setup_context)


class AttnSdpa(torch.autograd.Function):
    """attn::sdpa's computation and autograd formula without torch's
    dispatcher, for eager calls on plain tensors (run() below). Going
    through the operator costs about 300 us per forward and backward pair
    in Python (torch fills the defaults of a 15-argument schema on every
    call, twice through its dispatcher), 8 times torch's own SDPA at small
    shapes; this route costs what a torch.autograd.Function does. Same
    functions, same results to the bit (tests/python/test_sdpa_autograd.py)."""

    @staticmethod
    def forward(ctx, *inputs):  # attn::sdpa's inputs, in its schema's order
        # ctx in forward, not a setup_context: with one, every apply() binds
        # its arguments through inspect.signature (25 us)
        output = _sdpa(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dweights, dlse):
        # create_graph=True, or a dout batched by vmap (is_grads_batched,
        # jacobian(vectorize=True)): through the operator
        # attn::sdpa_backward, which vmap handles and whose missing autograd
        # formula raises torch's own error where a second derivative is
        # asked for. (once_differentiable would hang its error on detached
        # stand-ins only: a gradient penalty came out silently first-order.)
        functorch = torch._C._functorch
        by_operator = (torch.is_grad_enabled() or functorch.is_legacy_batchedtensor(dout)
                       or functorch.is_functorch_wrapped_tensor(dout))
        gradients = sdpa_backward_op if by_operator else _sdpa_backward
        return _backward(ctx, dout, dweights, dlse, gradients=gradients)


_function_modes = torch._C._is_torch_function_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack


def _operator_needed():
    """Whether the call must go through the operator attn::sdpa: a torch
    function or dispatch mode is active (torch.device(...) as a context,
    FakeTensorMode, a mode that logs or counts operators), or torch.jit is
    tracing; each should see it as the one operator it is."""
    return _function_modes() or _dispatch_modes() > 0 or torch.jit.is_tracing()


# ---------------------------------------------------------------------------
# attn.scaled_dot_product_attention on torch tensors
# ---------------------------------------------------------------------------


# compiling(): whether torch.compile is tracing (the inputs are FakeTensors);
# torch's own function, not a wrapper (asked on every torch call)
compiling = torch.compiler.is_compiling


class _FirstOrder(torch.autograd.Function):
    """Gradients that libattn computed, outside autograd, made part of the
    graph create_graph=True builds, through a node that raises when it is
    differentiated: they have no derivative of their own."""

    @staticmethod
    def forward(ctx, what, count, *tensors):  # tensors: count gradients, then anchors
        ctx.what = what
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.what}'s backward runs in libattn and has no derivative of its own: a second "
            f"derivative (create_graph=True, as a gradient penalty asks) needs torch's own "
            f"module or function")


def first_order_only(what, grads, anchors):
    """An autograd.Function backward's `grads` (tensors or None) as they
    are, or, when the backward builds a graph (create_graph=True) and one of
    `anchors` (the inputs, parameters and dout) requires grad, the same
    values through _FirstOrder: differentiating them again then raises,
    naming `what`. Without it they would be constants in that graph, and a
    gradient penalty would silently lose its second-order terms (torch's
    once_differentiable marks them only when dout requires grad)."""
    if not torch.is_grad_enabled():
        return grads
    anchors = [a for a in anchors if isinstance(a, torch.Tensor) and a.requires_grad]
    present = [g for g in grads if g is not None]
    if not anchors or not present:
        return grads
    marked = iter(_FirstOrder.apply(what, len(present), *present, *anchors))
    return tuple(None if g is None else next(marked) for g in grads)


def _tensor(x, checked, saved=False):
    """The operator's argument for one input: the tensor itself (autograd
    needs it), or a tensor holding the checked array of a non-tensor; a copy
    of it when the backward saves it (`saved`): a NumPy array has no version
    counter, and a caller refilling it before the backward would change the
    gradients silently."""
    if isinstance(x, torch.Tensor):
        return x
    if saved:
        checked = np.array(checked, copy=True, order="C")
    try:
        t = torch.from_numpy(checked)
    except ValueError:  # negative strides: torch has none
        t = torch.from_numpy(np.ascontiguousarray(checked))
    return t.view(torch.bfloat16) if is_bfloat16(checked) else t


def _seed_for(seed, dropout_p):
    if seed is None:
        return drawn_seed() if dropout_p > 0.0 else seed_tensor(0)
    return seed_tensor(seed)


def _recorded(*inputs):
    """Whether autograd records a call on these inputs."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)


def has_tangent(*inputs):
    """Whether an input carries a forward-mode AD tangent (a dual tensor, which
    does not require grad): such a call goes through AttnSdpa, whose missing
    jvp makes torch raise, instead of dropping the tangent."""
    if forward_ad._current_level < 0:  # no dual level entered: no tangent anywhere
        return False
    return any(isinstance(x, torch.Tensor) and forward_ad.unpack_dual(x).tangent is not None
               for x in inputs)


def run(a, query, key, value, attn_mask, alibi_slopes=None, sinks=None):
    """The call on checked arguments `a` (attn/_sdpa.py): through attn::sdpa
    when a mode or tracer should see the operator, through AttnSdpa when
    autograd records it (an input requires grad), else as a NumPy call
    (_untracked). The first two run the same code."""
    saved = torch.is_grad_enabled() and any(  # autograd will record the call
        isinstance(x, torch.Tensor) and x.requires_grad
        for x in (query, key, value, attn_mask, alibi_slopes, sinks))
    mask = None
    if a.mask is not None:
        mask = _tensor(attn_mask, a.mask, saved)
        if mask.dim() == 0:  # a scalar broadcasts like any size-1 tensor
            mask = mask.reshape(1)
    slopes = None if a.alibi is None else _tensor(alibi_slopes, a.alibi, saved)
    sink_logits = None if a.sinks is None else _tensor(sinks, a.sinks, saved)
    inputs = (_tensor(query, a.q, saved), _tensor(key, a.k, saved), _tensor(value, a.v, saved),
              mask, a.dropout_p, a.causal, a.scale, a.gqa, _seed_for(a.seed, a.dropout_p),
              a.want_w)
    modifiers = (a.window[0], a.window[1], slopes, a.softcap, sink_logits)
    if _operator_needed():
        out, w, lse = sdpa_op(*inputs, *modifiers)
    elif _recorded(query, key, value, mask, slopes, sink_logits) or has_tangent(
            query, key, value, mask, slopes, sink_logits):
        out, w, lse = AttnSdpa.apply(*inputs, *modifiers)
    else:  # nothing to record
        out, w, lse = _untracked(*inputs, a.want_lse, *modifiers)
    return results(a, out, w, lse)


_FAST_DTYPES = _torch_dtypes(TENSOR)
_NO_SEED = []  # [the seed tensor of calls without dropout], made by _no_seed


def _no_seed():
    """The int64 seed 0 of every short-route call without dropout, made on
    the first such call: plain() asks for it with no torch function or
    dispatch mode active (a torch.device("meta") context, a FakeTensorMode
    at import time would have made it a meta or fake tensor for good), and
    outside inference mode (autograd saves it)."""
    if not _NO_SEED:
        with torch.inference_mode(False):
            _NO_SEED.append(seed_tensor(0))
    return _NO_SEED[0]


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _view(x):
    """A NumPy view of a plain tensor (bfloat16 as its int16 bits), or None
    where .numpy() refuses it (another device, a meta, nested, sparse or
    negated view): the checked route then says what is wrong. torch_array
    without its resolve_conj/resolve_neg, which cost 0.6 us a tensor (1.8 of
    a 12 us call) for views this route leaves to the checked one anyway."""
    try:
        if storage_short(x) is not None:
            return None
        t = x.detach() if x.requires_grad else x
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    except (TypeError, RuntimeError):
        return None


def _views(query, key, value, attn_mask):
    """(q, k, v, mask) as _view's NumPy views (mask None stays None), or
    None when torch will not hand one of them out."""
    q, k, v = _view(query), _view(key), _view(value)
    mask = None if attn_mask is None else _view(attn_mask)
    if q is None or k is None or v is None or attn_mask is not None and mask is None:
        return None
    return q, k, v, mask


_tracing = torch._C._is_tracing
_from_numpy = torch.from_numpy
_grad_enabled = torch.is_grad_enabled
# plain CPU tensors of these dtypes are read in place by _attn (plain below),
# unless torch.Tensor's accessors are not torch's own (a patched class)
_IN_PLACE = _attn._torch_intake(torch.Tensor, torch.UntypedStorage, torch.strided,
                                torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                torch.bool)


def plain(query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa):
    """attn.scaled_dot_product_attention on plain tensors with torch's own
    arguments only (causal: attn_causal's code), or None when the call needs
    the checked route (run): it skips _arguments and the conversions twice
    over, which cost 30-45 us a call, 4-5x torch's own SDPA at 16 tokens
    (a model's every attention layer pays it, patch_torch's too). What it
    reads is what run() would: the same functions, the same bits. Counted
    in tenths of a microsecond (a 16-token call's budget is torch's 7 us, of
    which reading the tensors, _attn.sdpa and from_numpy take 5): dtypes compared by
    identity, bound functions, only the keywords that differ from
    _attn.sdpa's defaults."""
    T = torch.Tensor
    if type(query) is not T or type(key) is not T or type(value) is not T:
        return None
    dt = query.dtype
    if key.dtype is not dt or value.dtype is not dt or dt not in _FAST_DTYPES:
        return None
    if attn_mask is not None and (type(attn_mask) is not T or attn_mask.dim() == 0 or not (
            attn_mask.dtype is torch.bool or attn_mask.dtype is dt)):
        return None
    if dropout_p != 0.0 and not 0.0 < dropout_p < 1.0 or not (scale is None or (
            type(scale) is float and math.isfinite(scale))):
        return None  # the checked route says what is wrong
    # a torch function or dispatch mode, torch.jit tracing or a forward-mode
    # tangent: the operator's routes (see _operator_needed, has_tangent)
    if _function_modes() or _dispatch_modes() or _tracing() or (
            forward_ad._current_level >= 0 and has_tangent(query, key, value, attn_mask)):
        return None
    if _wrapped(query) or _wrapped(key) or _wrapped(value) or (
            attn_mask is not None and _wrapped(attn_mask)):
        return None
    recorded = _grad_enabled() and (query.requires_grad or key.requires_grad or
                                    value.requires_grad or attn_mask is not None and
                                    attn_mask.requires_grad)
    if recorded:
        if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
            return None  # empty tensors: the checked route gives torch's answer
        if _views(query, key, value, attn_mask) is None:
            return None  # the checked route says what is wrong
        seed = drawn_seed() if dropout_p > 0.0 else _no_seed()
        return AttnSdpa.apply(query, key, value, attn_mask, dropout_p, causal, scale,
                              enable_gqa, seed, False)[0]
    # _attn reads the tensors themselves (python/src/_attn_tensors.c, through
    # torch's accessors: cheaper than .numpy()); what .numpy() would refuse
    # it refuses too, and the checked route explains it. A dropout
    # call draws its seed before _attn reads anything, and a refusal after
    # the draw would draw again on the checked route: it takes NumPy views
    # first, as the checked route does.
    views = (query, key, value, attn_mask)
    if (dropout_p > 0.0 or not _IN_PLACE) and (
            views := _views(query, key, value, attn_mask)) is None:
        return None
    q, k, v, mask = views
    try:
        if mask is None and not causal and scale is None and not enable_gqa and not dropout_p:
            out = _attn.sdpa(q, k, v, empty=empty)[0]
        else:  # only the keywords that differ from the defaults: each costs its parse
            options = {}
            if mask is not None:
                options["attn_mask"] = mask
            if causal:
                options["causal"] = causal
            if scale is not None:
                options["scale"] = scale
            if enable_gqa:
                options["enable_gqa"] = True
            if dropout_p > 0.0:
                options["dropout_p"] = dropout_p
                options["seed"] = _seed(drawn_seed())  # the same draw as run()'s
            out = _attn.sdpa(q, k, v, empty=empty, **options)[0]
    except _attn.NotReadInPlace:
        return None
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
            return None  # empty tensors: the checked route gives torch's answer
        raise library_error(e) from None
    out = _from_numpy(out)
    return out.view(torch.bfloat16) if dt is torch.bfloat16 else out


def empty_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """torch's own answer (an empty tensor, or zeros where there are no keys,
    with its gradients) for a call on torch tensors of which one is empty:
    libattn takes no empty tensor, and a model's batch of 0 sequences or 0
    tokens must not fail where torch's would not. None when the call is not
    such a call (then the library names the empty dimension)."""
    if not all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in (query, key, value)):
        return None
    if query.numel() != 0 and key.numel() != 0 and value.numel() != 0:
        return None
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        return None
    if key.dtype != query.dtype:  # attn's rule only: a float32 query over 16-bit K/V
        if not (query.dtype == torch.float32 and key.dtype == value.dtype and
                key.dtype in (torch.float16, torch.bfloat16)):
            return None  # the library names the dtypes
        key, value = key.float(), value.float()  # (gradients come back in K/V's dtype)
    # torch's builtin, not torch.nn.functional's name, which patch_torch replaces
    return torch._C._nn.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                                     is_causal, scale=scale,
                                                     enable_gqa=enable_gqa)


def _traced_tensor(x):
    return x if x is None or isinstance(x, torch.Tensor) else torch.as_tensor(x)


def traced(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
           causal_alignment, seed, return_weights, return_lse, window_size=(-1, -1),
           alibi_slopes=None, softcap=0.0, sinks=None):
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
                          bool(enable_gqa), _seed_for(seed, dropout_p), bool(return_weights),
                          int(window_size[0]), int(window_size[1]),
                          _traced_tensor(alibi_slopes), float(softcap), _traced_tensor(sinks))
    if not (return_weights or return_lse):
        return out
    return (out,) + ((w,) if return_weights else ()) + ((lse,) if return_lse else ())
