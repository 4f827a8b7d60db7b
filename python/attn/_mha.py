"""attn.MultiheadAttention: torch.nn.MultiheadAttention's names and behaviour
over libattn's attn_mha."""

import collections
import collections.abc
import math
import sys

import numpy as np

from . import _attn
from ._arrays import (
    MASK,
    PARAM,
    TENSOR,
    as_array,
    empty,
    _is_torch_tensor,
    check_bool,
    check_device,
    check_dtype,
    check_int,
    check_probability,
    check_seed,
    library_error,
    no_backward,
    random_seed,
)

_IncompatibleKeys = collections.namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])

def _param_property(name, doc):
    def get(self):
        return self._params.get(name)

    def set(self, value):
        self._set_param(name, value)

    return property(get, set, doc=doc)


class _OutProj:
    """``m.out_proj``: the output projection's ``weight`` (embed_dim, D) and
    ``bias`` (embed_dim), as on torch's ``out_proj`` Linear."""

    def __init__(self, owner):
        self._owner = owner

    weight = property(
        lambda self: self._owner._params["out_proj.weight"],
        lambda self, value: self._owner._set_param("out_proj.weight", value),
    )
    bias = property(
        lambda self: self._owner._params.get("out_proj.bias"),
        lambda self, value: self._owner._set_param("out_proj.bias", value),
    )

    @property
    def in_features(self):
        return self.weight.shape[1]

    @property
    def out_features(self):
        return self.weight.shape[0]

    def __repr__(self):
        return (
            f"Linear(in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None})"
        )


class MultiheadAttention:
    """Multi-head attention with the parameters, options and results of
    ``torch.nn.MultiheadAttention`` (PyTorch 2.13), computed by libattn.

    The arguments are torch's. ``dtype`` (float32 by default; NumPy or torch
    dtypes) sets the dtype of the parameters, inputs and outputs: float32,
    float64, float16 or bfloat16 (ml_dtypes' in NumPy; torch bfloat16
    tensors are inputs too). A 16-bit module computes as torch's does in that
    dtype: each projection summed in float32 and rounded once to the dtype,
    attention as scaled_dot_product_attention computes in it; ``device``
    may only be None or the CPU ("cpu", "cpu:N", a torch CPU device). Beyond
    torch:

    - ``head_dim``: project to num_heads * head_dim features, so that
      num_heads need not divide embed_dim.
    - ``seed``: parameters start as torch's initialisation schemes would draw
      them, from this seed, and the n-th successful call that applies dropout
      (training mode, dropout > 0; counting from 0 since construction) draws its mask
      from (seed, rng_offset=n), so modules built with the same seed and
      called the same way give the same results. With ``seed=None`` both are
      fresh random draws.

    Parameters are NumPy arrays under torch's names that view the module's own
    storage (``m.in_proj_weight[...] = x`` changes the module):
    ``in_proj_weight`` (3D, E) when kdim == vdim == embed_dim, else
    ``q_proj_weight`` (D, E), ``k_proj_weight`` (D, kdim), ``v_proj_weight``
    (D, vdim); ``in_proj_bias`` (3D) when bias; ``bias_k``, ``bias_v``
    (1, 1, D) when add_bias_kv; ``out_proj.weight`` (E, D) and
    ``out_proj.bias`` (E); D = num_heads * head_dim. Absent ones are None.

    Like a new torch module, a new attn module is in training mode: dropout
    applies until ``eval()``. Like torch, every forward reads ``batch_first``
    and ``dropout`` as they are then; assigning ``out_proj`` (a torch Linear,
    another module's out_proj) copies its weight and bias in.

    attn has no backward yet: a forward refuses (RuntimeError) an input that
    requires grad in torch's grad mode, and torch inputs in grad mode when a
    parameter was last copied from a tensor that requires grad.
    """

    in_proj_weight = _param_property("in_proj_weight", "(3D, embed_dim), or None")
    q_proj_weight = _param_property("q_proj_weight", "(D, embed_dim), or None")
    k_proj_weight = _param_property("k_proj_weight", "(D, kdim), or None")
    v_proj_weight = _param_property("v_proj_weight", "(D, vdim), or None")
    in_proj_bias = _param_property("in_proj_bias", "(3D,), or None")
    bias_k = _param_property("bias_k", "(1, 1, D), or None")
    bias_v = _param_property("bias_v", "(1, 1, D), or None")

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
        *,
        head_dim=None,
        seed=None,
    ):
        self._init_args = dict(
            embed_dim=embed_dim, num_heads=num_heads, dropout=dropout, bias=bias,
            add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim,
            batch_first=batch_first, device=device, dtype=dtype, head_dim=head_dim, seed=seed,
        )
        embed_dim = check_int(embed_dim, "embed_dim")
        num_heads = check_int(num_heads, "num_heads")
        dropout = check_probability(dropout, "dropout")
        bias = check_bool(bias, "bias")
        add_bias_kv = check_bool(add_bias_kv, "add_bias_kv")
        add_zero_attn = check_bool(add_zero_attn, "add_zero_attn")
        kdim = check_int(kdim, "kdim", optional=True)
        vdim = check_int(vdim, "vdim", optional=True)
        batch_first = check_bool(batch_first, "batch_first")
        check_device(device)
        dt = check_dtype(dtype, halves=True)
        head_dim = check_int(head_dim, "head_dim", optional=True)
        seed = check_seed(seed)

        # batch_first and dropout are read at every forward, like torch, so
        # the handle gets both per call (attn_mha_forward_params).
        try:
            self._handle = _attn.MHA(
                embed_dim,
                num_heads,
                head_dim=head_dim or 0,
                kdim=kdim or 0,
                vdim=vdim or 0,
                bias=bias,
                add_bias_kv=add_bias_kv,
                add_zero_attn=add_zero_attn,
                batch_first=batch_first,
                dropout=dropout,
                dtype=dt.name,
                init_seed=random_seed() if seed is None else seed,
            )
        except (ValueError, TypeError, MemoryError, RuntimeError) as e:
            raise library_error(e) from None
        cfg = self._handle.config()
        storage = np.asarray(memoryview(self._handle))
        if dt.name == "bfloat16":  # the storage's bits, as ml_dtypes' bfloat16
            storage = storage.view(dt)
        self._params = {}
        for name, shape, offset in self._handle.param_layout():
            n = math.prod(shape)
            self._params[name] = storage[offset : offset + n].reshape(shape)
        self._seed = seed
        self._calls = 0  # training-mode calls so far: the dropout rng_offset
        self._grad_sources = set()  # parameters last copied from a tensor requiring grad

        self.embed_dim = embed_dim
        self.kdim = cfg["kdim"]
        self.vdim = cfg["vdim"]
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.head_dim = cfg["head_dim"]
        self.dropout = dropout
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        self.dtype = dt
        self.training = True
        self._out_proj = _OutProj(self)
        self._init_args["dtype"] = dt.name  # a picklable form of the dtype
        self._init_args["device"] = None

    # ---- attributes torch reads at every forward ----

    @property
    def batch_first(self):
        """(N, L, E) inputs and outputs when True, (L, N, E) when False; read
        at every forward, so it may be changed at any time."""
        return self._batch_first

    @batch_first.setter
    def batch_first(self, value):
        self._batch_first = check_bool(value, "batch_first")

    @property
    def dropout(self):
        """The dropout probability of training-mode calls; read at every
        forward."""
        return self._dropout

    @dropout.setter
    def dropout(self, value):
        self._dropout = check_probability(value, "dropout")

    @property
    def out_proj(self):
        """The output projection: ``weight`` (E, D) and ``bias`` (E) viewing
        the module's storage. Assigning an object with ``weight`` and
        ``bias`` (a torch Linear, another module's out_proj) copies them in."""
        return self._out_proj

    @out_proj.setter
    def out_proj(self, value):
        if not hasattr(value, "weight") or not hasattr(value, "bias"):
            raise TypeError(f"out_proj must have a weight and a bias (like a torch Linear), "
                            f"not {type(value).__name__}")
        has_bias = "out_proj.bias" in self._params
        if (value.bias is not None) != has_bias:
            raise ValueError(
                f"out_proj.bias is {'missing' if has_bias else 'present'} in the new out_proj, "
                f"but this module was built with bias={has_bias}"
            )
        staged = [self._staged("out_proj.weight", value.weight)]
        if has_bias:
            staged.append(self._staged("out_proj.bias", value.bias))
        self._commit(staged)

    # ---- copy and pickle: the configuration, the parameters, the mode ----

    def __getstate__(self):
        args = dict(self._init_args, batch_first=self.batch_first, dropout=self.dropout)
        return {"args": args, "state": self.state_dict(), "training": self.training,
                "calls": self._calls, "grad_sources": sorted(self._grad_sources)}

    def __setstate__(self, st):
        self.__init__(**st["args"])
        self.load_state_dict(st["state"])
        self.training = st["training"]
        self._calls = st["calls"]
        self._grad_sources = set(st.get("grad_sources", ()))

    # ---- parameters ----

    def _staged(self, name, value, loading=False):
        """(name, array, requires_grad) for a checked copy into `name`."""
        a = as_array(value, name, PARAM)
        got, want = tuple(a.shape), tuple(self._params[name].shape)
        if got != want and loading:
            raise ValueError(f"load_state_dict: {name} has shape {got} in the state dict, "
                             f"but this module's {name} has shape {want}")
        if got != want:
            raise ValueError(f"{name} has shape {got}; this module expects {want}")
        return name, a, _is_torch_tensor(value) and value.requires_grad

    def _commit(self, staged):
        # A copy of a tensor torch would train stands for a trainable
        # parameter: forward then refuses to run where torch would track it.
        for name, a, grad in staged:
            self._params[name][...] = a
            (self._grad_sources.add if grad else self._grad_sources.discard)(name)

    def _set_param(self, name, value):
        if name not in self._params:
            raise ValueError(
                f"this module has no parameter '{name}'; it has: {', '.join(self._params)}"
            )
        self._commit([self._staged(name, value)])

    def named_parameters(self):
        """(name, array) pairs in state_dict() order; the arrays are live views."""
        return iter(self._params.items())

    def parameters(self):
        return iter(self._params.values())

    def state_dict(self):
        """A dict of copies of the parameters, keyed and ordered exactly like
        ``torch.nn.MultiheadAttention.state_dict()``."""
        return {name: p.copy() for name, p in self._params.items()}

    def load_state_dict(self, state_dict, strict=True):
        """Copies parameters from a mapping of arrays or tensors keyed like
        ``torch.nn.MultiheadAttention.state_dict()`` (values are converted to
        this module's dtype). With ``strict`` (the default), a missing or
        unexpected key is a ValueError naming it; a wrong shape is always a
        ValueError naming the key. Nothing is copied unless every entry fits.
        Returns ``(missing_keys, unexpected_keys)`` like torch."""
        if not isinstance(state_dict, collections.abc.Mapping):
            raise TypeError(
                f"state_dict must be a mapping of names to arrays, not {type(state_dict).__name__}"
            )
        missing = [k for k in self._params if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._params]
        if strict and (missing or unexpected):
            parts = []
            if missing:
                parts.append("missing key(s) " + ", ".join(repr(k) for k in missing))
            if unexpected:
                parts.append("unexpected key(s) " + ", ".join(repr(k) for k in unexpected))
            raise ValueError(
                "load_state_dict: "
                + "; ".join(parts)
                + f". This module's keys are: {', '.join(self._params)}"
            )
        staged = [self._staged(name, state_dict[name], loading=True)
                  for name in self._params if name in state_dict]
        self._commit(staged)
        return _IncompatibleKeys(missing, unexpected)

    # ---- mode ----

    def train(self, mode=True):
        self.training = check_bool(mode, "mode")
        return self

    def eval(self):
        return self.train(False)

    # ---- forward ----

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        """Returns ``(attn_output, attn_output_weights or None)`` like torch.

        query (L, N, E) / (N, L, E) with batch_first / (L, E) unbatched; key
        and value (S, N, kdim|vdim) likewise. key_padding_mask (N, S) or (S):
        bool True = ignore the key, or float (added). attn_mask (L, S) or
        (N * num_heads, L, S): bool True = not allowed to attend, or float
        (added). The weights, after dropout, are averaged over heads unless
        ``average_attn_weights=False``. ``is_causal`` applies a causal mask
        (combined with any attn_mask; torch takes it only as a hint about
        attn_mask). Rows whose keys are all masked give an attention output
        of 0 and weights 0, where torch gives NaN.
        """
        q = as_array(query, "query", TENSOR)
        k = as_array(key, "key", TENSOR)
        v = as_array(value, "value", TENSOR)
        kpm = None if key_padding_mask is None else as_array(key_padding_mask, "key_padding_mask", MASK)
        mask = None if attn_mask is None else as_array(attn_mask, "attn_mask", MASK)
        need_w = check_bool(need_weights, "need_weights")
        average = check_bool(average_attn_weights, "average_attn_weights")
        causal = check_bool(is_causal, "is_causal")
        self._check_grad((query, key, value, key_padding_mask, attn_mask))
        dropping = self.training and self.dropout > 0.0
        seed, offset = 0, 0
        if dropping:
            if self._seed is None:
                seed = random_seed()
            else:
                seed, offset = self._seed, self._calls
        try:
            out, w = self._handle.forward(
                q, k, v, empty=empty, key_padding_mask=kpm, attn_mask=mask,
                need_weights=need_w, average_attn_weights=average, is_causal=causal,
                training=dropping, dropout=self.dropout, seed=seed, rng_offset=offset,
                batch_first=self.batch_first,
            )
        except (ValueError, TypeError, MemoryError, RuntimeError) as e:
            raise library_error(e) from None
        if dropping:
            self._calls += 1  # only calls that ran count
        if self.dtype.name == "bfloat16":  # bfloat16's bits, as ml_dtypes' bfloat16
            out, w = out.view(self.dtype), None if w is None else w.view(self.dtype)
        return out, w

    def _check_grad(self, inputs):
        """attn has no backward: refuse a call torch would record for one
        because of a parameter it would train (as_array refuses inputs that
        require grad)."""
        torch_inputs = any(_is_torch_tensor(x) for x in inputs)
        if self._grad_sources and torch_inputs and sys.modules["torch"].is_grad_enabled():
            name = next(n for n in self._params if n in self._grad_sources)
            raise no_backward(
                f"this module's {name} was copied from a tensor that requires grad (a parameter "
                f"torch would train) and the inputs are torch tensors",
                "load detached values (torch_module.state_dict() gives them)",
            )

    __call__ = forward

    def __repr__(self):
        extra = ""
        if self.head_dim * self.num_heads != self.embed_dim:
            extra = f", head_dim={self.head_dim}"
        return (
            f"MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}"
            f"{extra}, dtype={self.dtype.name}, training={self.training}\n"
            f"  (out_proj): {self.out_proj!r}\n)"
        )
