"""attn.distributed.ring_attention on torch tensors: a torch.autograd.Function
whose backward is attn_ring_sdpa_backward, so gradients of each rank's
shards come back over the ring (a collective: every rank runs backward).

Loaded only once ring_attention has been handed a torch tensor (torch is
then imported already), like attn/_torch.py.
"""

import torch

from ._arrays import torch_array, torch_result
from ._ring_calls import _backward, _forward
from ._torch import _tensor, first_order_only  # one rule for non-tensor inputs


class _Ring(torch.autograd.Function):
    """(out, lse) of the ring; gradients flow through out only."""

    @staticmethod
    def forward(ctx, query, key, value, opts):
        out, lse = _forward(torch_array(query), torch_array(key), torch_array(value), opts,
                                        want_lse=True, for_backward=True)
        out, lse = torch_result(out, query.dtype), torch.from_numpy(lse)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.opts = opts
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        query, key, value, out, lse = ctx.saved_tensors
        want = [bool(n) for n in ctx.needs_input_grad[:3]]
        grads = _backward(*(torch_array(t) for t in (dout, query, key, value, out, lse)),
                          ctx.opts, want)
        grads = tuple(None if g is None else torch_result(g, x.dtype)
                      for g, x in zip(grads, (query, key, value)))
        return first_order_only("attn.distributed.ring_attention", grads,
                                (query, key, value, dout)) + (None,)


def run(a, query, key, value, opts):
    """The call on checked arguments `a` (attn/_sdpa.py's _arguments):
    (out, lse) as torch tensors, recorded for autograd when an input
    requires grad. lse is float64 (the backward's), as in attn/_torch.py."""
    q, k, v = _tensor(query, a.q), _tensor(key, a.k), _tensor(value, a.v)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _Ring.apply(q, k, v, opts)
    out, lse = _forward(a.q, a.k, a.v, opts, want_lse=True, for_backward=True)
    return torch_result(out, q.dtype), torch.from_numpy(lse)
