"""The ring's two library calls on NumPy views, shared by
attn.distributed (NumPy) and attn/_ring_torch.py (torch autograd): their
failures re-raised with ``arg`` in ring_attention's names. bfloat16 travels
as its bits in int16 arrays, both ways (attn/_arrays.py's `empty`)."""

from . import _attn
from ._arrays import empty, library_error


def _ring_error(e):
    """A library failure with ``arg`` in this module's names."""
    e = library_error(e)
    arg = getattr(e, "arg", None)
    if isinstance(arg, str) and hasattr(e, "status"):
        arg = arg[len("sdpa."):] if arg.startswith("sdpa.") else arg
        e.arg = {"key_mask": "key_padding_mask", "causal": "is_causal"}.get(arg, arg)
    return e


def _forward(q, k, v, opts, want_lse, for_backward):
    """attn_ring_sdpa on NumPy views: (out, lse or None)."""
    try:
        return _attn.ring_sdpa(q, k, v, empty=empty, want_lse=want_lse,
                               lse_for_backward=for_backward, **opts)
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise _ring_error(e) from None


def _backward(dout, q, k, v, out, lse, opts, want):
    """attn_ring_sdpa_backward on NumPy views: (dq, dk, dv), None where not
    wanted."""
    try:
        return _attn.ring_sdpa_backward(dout, q, k, v, out, lse, empty=empty,
                                        want_dq=want[0], want_dk=want[1], want_dv=want[2],
                                        **opts)
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        raise _ring_error(e) from None
