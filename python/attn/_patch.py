"""attn.patch_torch(): torch's own attention entry points routed through attn
for the calls attn computes, torch's functions for everything else."""

import functools
import importlib
import threading

# float16 and bfloat16 too: attn computes them in float32, rounded once
# (faster than torch's own bfloat16 kernel on the CPUs measured; README).
_FLOATS = ("torch.float32", "torch.float64", "torch.float16", "torch.bfloat16")


# The patches in place, oldest first. Each saved what the one before it had
# installed, so they come off newest first: an undo out of that order only
# marks its patch, which comes off when every newer one has (restoring it at
# once would leave the newer patch's saved functions, this one's wrappers,
# to be put back by the newer undo: torch patched for good, and MHA's
# fallback calling itself).
_ACTIVE = []
_LOCK = threading.Lock()


class TorchPatch:
    """What patch_torch() returns: a context manager, and a callable that
    undoes the patch (once; later calls do nothing). ``routed`` and
    ``fell_back`` count the calls the patched functions sent to attn and to
    torch's own."""

    def __init__(self):
        self.routed = 0
        self.fell_back = 0
        self._undo = []  # (object, attribute, had it, old value), newest last
        self._undone = False

    def _set(self, obj, name, value):
        had = name in vars(obj)
        self._undo.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def _restore(self):
        while self._undo:
            obj, name, had, old = self._undo.pop()
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

    def __call__(self):
        """Undoes this patch: at once when it is the newest in place, else
        once every newer one is undone too; after the last undo torch's own
        functions are back, whatever the order of the undos."""
        with _LOCK:
            if self._undone:
                return
            self._undone = True
            if self not in _ACTIVE:  # never registered: restore what it set
                self._restore()
                return
            while _ACTIVE and _ACTIVE[-1]._undone:
                _ACTIVE.pop()._restore()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self()
        return False


def _attn_computes(torch, query, key, value, attn_mask, is_causal):
    """Whether a call is one attn computes as torch would: CPU float32,
    float64, float16 or bfloat16 strided tensors of one dtype, and a mask
    torch would accept too
    (torch refuses a mask with is_causal, and a float mask of another dtype
    than the query; attn's own extensions are left to torch to refuse)."""
    from torch.nn.attention.bias import CausalBias

    qkv = (query, key, value)
    if not all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in qkv):
        return False  # subclasses (FakeTensor, DTensor, nested, ...) are torch's
    if torch.is_autocast_enabled("cpu"):
        return False  # torch casts to the autocast dtype and returns it
    if any(x.device.type != "cpu" or x.layout != torch.strided or x.is_nested for x in qkv):
        return False
    if str(query.dtype) not in _FLOATS or not query.dtype == key.dtype == value.dtype:
        return False
    if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
        return False  # empty: torch's own result (attn would hand it to torch anyway)
    if attn_mask is None or isinstance(attn_mask, CausalBias):
        return attn_mask is None or not is_causal
    if is_causal or type(attn_mask) is not torch.Tensor or attn_mask.device.type != "cpu":
        return False
    if attn_mask.dim() < 2:  # torch refuses a 0-d or 1-d mask; attn would broadcast it
        return False
    return attn_mask.dtype == torch.bool or attn_mask.dtype == query.dtype


def _routed_sdpa(patch, torch_sdpa):
    import torch
    from torch.nn.attention.bias import CausalBias

    from ._sdpa import scaled_dot_product_attention

    def scaled_dot_product_attention_via_attn(query, key, value, attn_mask=None, dropout_p=0.0,
                                              is_causal=False, scale=None, enable_gqa=False):
        if _attn_computes(torch, query, key, value, attn_mask, is_causal):
            try:
                out = scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                                   is_causal, scale, enable_gqa)
            except (TypeError, ValueError, RuntimeError):
                pass  # attn refuses it: torch's answer (a result or torch's own error)
            else:
                patch.routed += 1
                return out
        patch.fell_back += 1
        if isinstance(attn_mask, CausalBias):
            # A CausalBias takes over torch's function only when it is called
            # as F.scaled_dot_product_attention (its __torch_function__
            # compares), which is this function now: hand it over directly.
            return CausalBias._dispatch(query, key, value, attn_mask, dropout_p, is_causal,
                                        scale, enable_gqa)
        return torch_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                          enable_gqa=enable_gqa)

    scaled_dot_product_attention_via_attn.__doc__ = (
        "torch.nn.functional.scaled_dot_product_attention, routed through attn by "
        "attn.patch_torch() for CPU float32/float64/float16/bfloat16 tensors.\n\n" +
        (torch_sdpa.__doc__ or ""))
    return scaled_dot_product_attention_via_attn


def _patch_mha(patch, torch):
    """torch.nn.MultiheadAttention.forward -> attn.nn._patched_mha_forward,
    when attn.nn provides it; it falls back through
    MultiheadAttention._attn_original_forward, which holds torch's own
    forward while any patch is in place."""
    try:
        nn = importlib.import_module("attn.nn")
    except ImportError:
        return
    forward = getattr(nn, "_patched_mha_forward", None)
    if forward is None:
        return
    mha = torch.nn.MultiheadAttention
    if "_attn_original_forward" not in vars(mha):  # an outer patch keeps torch's own there
        patch._set(mha, "_attn_original_forward", _counted_fallback(patch, vars(mha)["forward"]))
    patch._set(mha, "forward", _counted_mha(patch, forward))


# This thread's MHA fallbacks: how many, and the patch that counted the
# last (the one whose _counted_fallback stands, the outermost), so that a
# newer patch's routed_forward sees its call fall back too.
_FALLBACKS = threading.local()


def _counted_fallback(patch, original):
    """torch's own forward, counted in patch.fell_back (by the patch that
    stored it, the outermost; routed_forward counts it in newer ones)."""

    @functools.wraps(original)
    def fallback(self, *args, **kwargs):
        patch.fell_back += 1
        _FALLBACKS.count = getattr(_FALLBACKS, "count", 0) + 1
        _FALLBACKS.counted_by = patch
        return original(self, *args, **kwargs)

    return fallback


def _counted_mha(patch, forward):
    """attn's forward, counted in patch.routed, or in patch.fell_back when
    it fell back to torch's."""

    @functools.wraps(forward)
    def routed_forward(self, *args, **kwargs):
        before = getattr(_FALLBACKS, "count", 0)
        result = forward(self, *args, **kwargs)
        if getattr(_FALLBACKS, "count", 0) == before:
            patch.routed += 1
        elif _FALLBACKS.counted_by is not patch:
            patch.fell_back += 1
        return result

    return routed_forward


def patch_torch():
    """Routes ``torch.nn.functional.scaled_dot_product_attention`` through
    attn for CPU float32/float64/float16/bfloat16 tensors (any mask torch takes, CausalBias
    included, and every keyword: attn_mask, dropout_p, is_causal, scale,
    enable_gqa), with autograd; every other call (other devices or dtypes,
    nested tensors, tensor subclasses, anything attn refuses) goes to torch's
    own function. Also routes ``torch.nn.MultiheadAttention.forward`` when
    ``attn.nn`` provides a routed forward.

    Use it as a context manager (``with attn.patch_torch(): ...``), or call
    it and keep what it returns: calling that undoes the patch. Patches nest;
    each undo restores exactly what was there before it.
    """
    import torch
    import torch.nn.functional as F

    from . import _torch  # noqa: F401  the operators, before any call

    patch = TorchPatch()
    with _LOCK:
        patch._set(F, "scaled_dot_product_attention",
                   _routed_sdpa(patch, F.scaled_dot_product_attention))
        _patch_mha(patch, torch)
        _ACTIVE.append(patch)
    return patch
