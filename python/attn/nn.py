"""attn.nn — torch.nn modules that run on attn, forward and backward.

    import attn.nn
    mha = attn.nn.MultiheadAttention(512, 8, dropout=0.1, batch_first=True)
    mha.load_state_dict(torch_mha.state_dict())      # the same keys as torch's
    out, w = mha(x, x, x, key_padding_mask=pad)
    out.sum().backward()                             # gradients from attn's C backward

MultiheadAttention is a drop-in for torch.nn.MultiheadAttention (same
constructor, parameters, state_dict keys and forward signature) whose forward
and backward run in libattn (attn_mha_forward_train / attn_mha_backward)
through one torch.autograd.Function. _patched_mha_forward runs a *torch*
nn.MultiheadAttention on attn, for attn.patch_torch().

This module needs PyTorch; `import attn` does not.
"""

import inspect
import math
import threading

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - exercised without torch only
    raise ImportError(
        "attn.nn needs PyTorch (pip install torch); the rest of attn (attn.MultiheadAttention, "
        "attn.scaled_dot_product_attention) works without it"
    ) from e

from . import _attn
from ._arrays import empty, library_error, torch_array, torch_result

__all__ = ["MultiheadAttention", "TransformerEncoder", "TransformerEncoderLayer"]

_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
           torch.bfloat16: "bfloat16"}
# How NumPy holds each: bfloat16 as 16-bit integers with its bits (NumPy has
# no bfloat16; _attn reads a 16-bit integer buffer as bfloat16).
_NUMPY = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
          "bfloat16": np.int16}


# ---- the C modules behind a torch module ----


class _CModules:
    """The attn_mha a torch module's calls run on (`run`, into which the torch
    parameters are copied at every call: a version counter would miss writes
    through .data, which torch code does) and one receiving gradients
    (`grads`), for one configuration. One lock: a copy never races a call
    reading the parameters, and the grads module is read out before the
    next backward writes it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.key = None
        self.run = self.grads = None

    def __reduce__(self):
        # deepcopy / pickle of a module: the copy starts with a cache of its own
        return (_CModules, ())

    def get(self, spec, params):
        """The run module for `spec` holding `params` (torch tensors in
        attn_mha_param_at order). Caller holds the lock."""
        if self.key != spec:
            self.run = _attn.MHA(**spec)
            self.grads, self.key = None, spec
            self.layout = self.run.param_layout()
        flat = np.frombuffer(self.run, dtype=_NUMPY[spec["dtype"]])
        for (name, shape, offset), p in zip(self.layout, params):
            flat[offset:offset + p.numel()] = torch_array(p.reshape(-1), name)
        return self.run

    def grad_module(self):
        if self.grads is None:
            self.grads = _attn.MHA(**self.key)
        return self.grads


def _cmodules(module):
    c = module.__dict__.get("_attn_c_modules")
    if c is None:
        c = _CModules()
        object.__setattr__(module, "_attn_c_modules", c)  # not a torch attribute
    return c


def _spec(m, dtype):
    """The _attn.MHA configuration of a torch-like MHA module."""
    return dict(
        embed_dim=m.embed_dim, num_heads=m.num_heads, kdim=m.kdim, vdim=m.vdim,
        bias=m.in_proj_bias is not None, add_bias_kv=m.bias_k is not None,
        add_zero_attn=bool(m.add_zero_attn), dtype=_DTYPES[dtype],
    )


def _param_names(m):
    """attn_mha_param_at order (torch's state_dict order)."""
    names = ["in_proj_weight"] if m._qkv_same_embed_dim else [
        "q_proj_weight", "k_proj_weight", "v_proj_weight"]
    if m.in_proj_bias is not None:
        names.append("in_proj_bias")
    if m.bias_k is not None:
        names += ["bias_k", "bias_v"]
    names.append("out_proj.weight")
    if m.out_proj.bias is not None:
        names.append("out_proj.bias")
    return names


def _param(m, name):
    return m.out_proj.weight if name == "out_proj.weight" else (
        m.out_proj.bias if name == "out_proj.bias" else getattr(m, name))


# ---- the autograd Function ----


class _MHAFunction(torch.autograd.Function):
    """out, weights = attn_mha_forward_train(...); backward: attn_mha_backward,
    which flows through out; a backward that needs the weights' gradient
    takes torch's composition (backward_in_torch)."""

    @staticmethod
    def forward(ctx, call, query, key, value, *params):
        cm, spec, kw = call["cmodules"], call["spec"], call["kwargs"]
        with cm.lock:
            run = cm.get(spec, params)
            try:
                out, w, saved = run.forward_train(
                    torch_array(query, "query"), torch_array(key, "key"),
                    torch_array(value, "value"), empty=empty, **kw)
            except (ValueError, TypeError, MemoryError, RuntimeError) as e:
                raise library_error(e) from None
        ctx.call, ctx.saved = call, saved
        ctx.save_for_backward(query, key, value, *params)
        ctx.set_materialize_grads(False)
        out_t = torch_result(out, query.dtype)
        if w is None:
            return out_t, None
        return out_t, torch_result(w, query.dtype)

    @staticmethod
    def backward(ctx, dout, dweights):
        if dweights is not None and bool(torch.any(dweights != 0)):
            return _MHAFunction.backward_in_torch(ctx, dout, dweights)
        query, key, value, *params = ctx.saved_tensors
        need = ctx.needs_input_grad
        want_params = any(need[4:])
        if dout is None or not (any(need[1:4]) or want_params):
            return (None,) * len(need)
        cm = ctx.call["cmodules"]
        with cm.lock:
            # the parameters as they are now, as torch's backward reads its
            # saved parameters (another call may have copied others since)
            run = cm.get(ctx.call["spec"], params)
            grads = cm.grad_module() if want_params else None
            try:
                dq, dk, dv = run.backward(
                    ctx.saved, *(torch_array(t) for t in (query, key, value, dout)), empty=empty,
                    need_dquery=need[1], need_dkey=need[2], need_dvalue=need[3], grads=grads)
            except (ValueError, TypeError, MemoryError, RuntimeError) as e:
                raise library_error(e) from None
            dparams = [None] * len(params)
            if want_params:
                flat = np.frombuffer(grads, dtype=_NUMPY[ctx.call["spec"]["dtype"]])
                for i, ((name, shape, offset), p) in enumerate(zip(cm.layout, params)):
                    if need[4 + i]:
                        n = int(np.prod(shape))
                        dparams[i] = torch_result(flat[offset:offset + n].copy(), p.dtype).view(
                            p.shape)
        t = [None if x is None else torch_result(x, query.dtype) for x in (dq, dk, dv)]
        from ._torch import first_order_only
        return (None, *first_order_only("attn.nn.MultiheadAttention", (*t, *dparams),
                                        (query, key, value, dout, *params)))


    @staticmethod
    def backward_in_torch(ctx, dout, dweights):
        """A loss that reads the returned weights: attn's backward flows
        through the output only, so this call's gradients come from torch's
        composition, its forward recomputed on the saved inputs (the same
        values to rounding; not with dropout, whose keep mask torch would
        draw anew)."""
        query, key, value, *params = ctx.saved_tensors
        if ctx.call["kwargs"]["training"]:
            raise NotImplementedError(
                "attn.nn.MultiheadAttention does not differentiate the attention weights it "
                "returns while dropout is active (a recomputation would draw another keep "
                "mask); use the output, need_weights=False, or torch.nn.MultiheadAttention")
        if any(a is not b for a, b in zip(ctx.call["in_torch"].params_now(), params)):
            raise RuntimeError(
                "attn.nn.MultiheadAttention: the module's parameters were replaced between the "
                "forward and a backward through its weights")
        need, create_graph = ctx.needs_input_grad, torch.is_grad_enabled()
        with torch.enable_grad():
            qkv = [x.detach().requires_grad_(n) for x, n in zip((query, key, value), need[1:4])]
            out, w = ctx.call["in_torch"](*qkv)
            inputs = [x for x, n in zip((*qkv, *params), need[1:]) if n]
            outputs, grads = [w], [dweights]
            if dout is not None:
                outputs, grads = [out, w], [dout, dweights]
            got = iter(torch.autograd.grad(outputs, inputs, grads, allow_unused=True,
                                           create_graph=create_graph))
        return (None, *(next(got) if n else None for n in need[1:]))


class _InTorch:
    """A call of module m again, in torch's composition on m's parameters
    (backward_in_torch). Its repr is fixed: torch.jit.trace records the
    call's arguments in its graph, which must not differ from one trace to
    the next."""

    def __init__(self, m, names, key_padding_mask, attn_mask, average_attn_weights, is_causal):
        self.m, self.names = m, names
        self.args = (key_padding_mask, attn_mask, average_attn_weights, is_causal)

    def __call__(self, q, k, v):
        kpm, mask, average, causal = self.args
        return _functional_mha(self.m, q, k, v, kpm, True, mask, average, causal)

    def params_now(self):
        return [_param(self.m, n) for n in self.names]

    def __repr__(self):
        return "<the call in torch>"


# ---- the forward, for any torch-like MHA module ----


def _shape_problem(m):
    """A parameter whose shape is not its module's (torch's module refuses
    the call; the copy into the C module would take the wrong values), as a
    message naming it, or None."""
    E = m.embed_dim
    want = {"in_proj_weight": (3 * E, E), "q_proj_weight": (E, E), "k_proj_weight": (E, m.kdim),
            "v_proj_weight": (E, m.vdim), "in_proj_bias": (3 * E,), "bias_k": (1, 1, E),
            "bias_v": (1, 1, E), "out_proj.weight": (E, E), "out_proj.bias": (E,)}
    for name in _param_names(m):
        p = _param(m, name)
        if isinstance(p, torch.Tensor) and tuple(p.shape) != want[name]:
            return (f"{name} has shape {tuple(p.shape)}; expected {want[name]} for embed_dim "
                    f"{E}, kdim {m.kdim}, vdim {m.vdim}")
    return None


def _unsupported(m, query, key, value, key_padding_mask, attn_mask):
    """Why attn cannot run this call (None when it can)."""
    tensors = [query, key, value] + [p for p in (key_padding_mask, attn_mask) if p is not None]
    params = [_param(m, n) for n in _param_names(m)]
    for x in tensors + params:
        if not isinstance(x, torch.Tensor) or x.is_nested or x.device.type != "cpu":
            return "a CPU tensor"
    dtype = query.dtype
    if dtype not in _DTYPES:
        return f"float32, float64, float16 or bfloat16 (not {dtype})"
    if any(x.dtype != dtype for x in [key, value] + params):
        return "inputs and parameters of one dtype"
    if any(x.is_sparse or x.layout != torch.strided for x in tensors + params):
        return "dense tensors"
    if m.embed_dim != m.num_heads * m.head_dim:
        return "num_heads dividing embed_dim"
    if (m.in_proj_bias is None) != (m.out_proj.bias is None):
        return "in_proj_bias and out_proj.bias both present or both absent"
    if _shape_problem(m) is not None:
        return "parameters of the module's shapes"
    if torch.is_grad_enabled():
        for x, name in ((key_padding_mask, "key_padding_mask"), (attn_mask, "attn_mask")):
            if x is not None and x.requires_grad:
                return (f"masks that need no gradient ({name} requires grad, and attn gives "
                        f"a mask none: pass {name}.detach(), or use torch's module)")
    return None


def _mha_call(m, query, key, value, key_padding_mask, need_weights, attn_mask,
              average_attn_weights, is_causal):
    """Runs torch-like MHA module m on attn: (out, weights or None)."""
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
            "module method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        # torch's SDPA path: the hint replaces the mask. (With add_bias_kv /
        # add_zero_attn torch then hides the appended keys from early
        # queries, unlike its mask path; attn keeps them visible on both.)
        attn_mask, causal = None, True
    else:
        causal = False  # torch uses attn_mask, which the hint says is causal
    for x, name in ((key_padding_mask, "key_padding_mask"), (attn_mask, "attn_mask")):
        if x is not None and x.dtype != torch.bool and not x.is_floating_point():
            raise AssertionError(f"only bool and floating types of {name} are supported")
    training = bool(m.training) and float(m.dropout) > 0.0
    seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item()) if training else 0
    names = _param_names(m)
    params = [_param(m, n) for n in names]
    # (before the hint may replace the mask)
    in_torch = _InTorch(m, names, key_padding_mask, attn_mask, average_attn_weights, is_causal)
    call = {
        "in_torch": in_torch,
        "cmodules": _cmodules(m),
        "spec": _spec(m, query.dtype),
        "kwargs": dict(
            key_padding_mask=torch_array(key_padding_mask, "key_padding_mask"),
            attn_mask=torch_array(attn_mask, "attn_mask"),
            need_weights=bool(need_weights), average_attn_weights=bool(average_attn_weights),
            is_causal=causal, training=training, dropout=float(m.dropout), seed=seed,
            rng_offset=0, batch_first=int(bool(m.batch_first))),
    }
    out, w = _MHAFunction.apply(call, query, key, value, *params)
    return out, w


# ---- the module ----


class MultiheadAttention(torch.nn.Module):
    """torch.nn.MultiheadAttention on attn: the same constructor, parameters,
    state_dict keys and forward; forward and backward run in libattn.

    forward(query, key, value, key_padding_mask=None, need_weights=True,
    attn_mask=None, average_attn_weights=True, is_causal=False) returns
    (attn_output, attn_output_weights or None) as torch tensors, reading
    self.batch_first, self.dropout and self.training at every call. Inputs
    are CPU float32/float64/float16/bfloat16 tensors of the parameters' dtype
    (16-bit: computed as torch's module computes in that dtype, gradients
    too). Gradients flow
    to query, key, value and every parameter; a loss that reads the returned
    weights takes torch's composition for that call's backward (not under
    dropout). Dropout draws its seed from torch's default generator, so
    torch.manual_seed makes a run reproducible. Rows whose keys are all
    masked give 0 where torch gives NaN.
    """

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} "
                f"and num_heads={num_heads} instead")
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != embed_dim:
            raise AssertionError("embed_dim must be divisible by num_heads")
        P = torch.nn.Parameter
        if self._qkv_same_embed_dim:
            self.in_proj_weight = P(torch.empty((3 * embed_dim, embed_dim), **factory))
            for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(n, None)
        else:
            self.q_proj_weight = P(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = P(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = P(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = P(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = torch.nn.modules.linear.NonDynamicallyQuantizableLinear(
            embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = P(torch.empty((1, 1, embed_dim), **factory))
            self.bias_v = P(torch.empty((1, 1, embed_dim), **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self):
        """torch's initialisation: Xavier-uniform projections, zero biases,
        Xavier-normal bias_k/bias_v."""
        init = torch.nn.init
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            init.constant_(self.in_proj_bias, 0.0)
            init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            init.xavier_normal_(self.bias_k)
            init.xavier_normal_(self.bias_v)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        why = _unsupported(self, query, key, value, key_padding_mask, attn_mask)
        if why is not None:
            shapes = _shape_problem(self)
            if shapes is not None:  # torch's module raises RuntimeError here too
                raise RuntimeError(f"attn.nn.MultiheadAttention: {shapes}")
            raise TypeError(f"attn.nn.MultiheadAttention runs on {why}")
        if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
            # 0 sequences or 0 tokens: libattn takes no empty tensor; torch's
            # forward on these parameters gives torch's empty (or zero) result
            return _functional_mha(self, query, key, value, key_padding_mask, need_weights,
                                   attn_mask, average_attn_weights, is_causal)
        return _mha_call(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                         average_attn_weights, is_causal)


def _torch_decides(m, query, key, value, key_padding_mask, attn_mask):
    """Calls a patched torch leaves to torch's own forward although attn could
    run them, so that torch's answer (its result, or its error) stands:
    autocast (torch computes in the autocast dtype), a float mask of another
    dtype than the query (torch refuses it), inference tensors in grad mode
    (torch trains on them; attn cannot save them for its backward), empty
    inputs (a batch of 0 sequences or of 0 tokens: torch returns its empty
    result, attn takes no empty tensor)."""
    if torch.is_autocast_enabled("cpu"):
        return True
    if any(x.numel() == 0 for x in (query, key, value)):
        return True
    for x in (key_padding_mask, attn_mask):
        if x is not None and x.is_floating_point() and x.dtype != query.dtype:
            return True
    if torch.is_grad_enabled():
        tensors = [query, key, value] + [_param(m, n) for n in _param_names(m)]
        return any(x.is_inference() for x in tensors) and any(x.requires_grad for x in tensors)
    return False


def _traced(*inputs):
    """Whether torch.compile, torch.export or a tensor subclass (FakeTensor,
    DTensor, ...) holds the call: torch's own forward traces or dispatches
    it, as the patched SDPA leaves such calls to torch's."""
    if torch.compiler.is_compiling():
        return True
    return any(x is not None and type(x) not in (torch.Tensor, torch.nn.Parameter)
               for x in inputs)


def _patched_mha_forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                         attn_mask=None, average_attn_weights=True, is_causal=False):
    """torch.nn.MultiheadAttention.forward's signature, for patching torch: runs
    the torch module `self` on attn (its parameters used directly, gradients
    flowing to them) for CPU float32/float64/float16/bfloat16 inputs; anything else goes to
    torch.nn.MultiheadAttention._attn_original_forward when present, else to
    torch's own forward."""
    if (not _traced(query, key, value, key_padding_mask, attn_mask)
            and _unsupported(self, query, key, value, key_padding_mask, attn_mask) is None
            and not _torch_decides(self, query, key, value, key_padding_mask, attn_mask)):
        return _mha_call(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                         average_attn_weights, is_causal)
    return _torch_mha_forward(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                              average_attn_weights, is_causal)


def _functional_mha(m, query, key, value, key_padding_mask, need_weights, attn_mask,
                    average_attn_weights, is_causal):
    """What torch's MultiheadAttention.forward computes off its fast path
    (whose result is the same), on module m's parameters: for calls libattn
    cannot take, such as empty inputs."""
    if m.batch_first and query.dim() == 3:
        query, key, value = (x.transpose(1, 0) for x in (query, key, value))
    separate = not m._qkv_same_embed_dim
    out, weights = _F.multi_head_attention_forward(
        query, key, value, m.embed_dim, m.num_heads, m.in_proj_weight, m.in_proj_bias,
        m.bias_k, m.bias_v, m.add_zero_attn, m.dropout, m.out_proj.weight, m.out_proj.bias,
        training=m.training, key_padding_mask=key_padding_mask, need_weights=need_weights,
        attn_mask=attn_mask, use_separate_proj_weight=separate,
        q_proj_weight=m.q_proj_weight if separate else None,
        k_proj_weight=m.k_proj_weight if separate else None,
        v_proj_weight=m.v_proj_weight if separate else None,
        average_attn_weights=average_attn_weights, is_causal=is_causal)
    if m.batch_first and query.dim() == 3:
        out = out.transpose(1, 0)
    return out, weights


def _torch_mha_forward(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                       average_attn_weights, is_causal):
    """torch's own MultiheadAttention.forward on a torch module (not the
    patch in its place)."""
    cls = torch.nn.MultiheadAttention
    original = getattr(cls, "_attn_original_forward", None)
    if original is None:
        original = cls.forward
    if inspect.unwrap(original) is _patched_mha_forward:  # (through the patch's wrappers)
        raise RuntimeError(
            "torch.nn.MultiheadAttention.forward is attn's patch and "
            "_attn_original_forward is missing: no torch forward to fall back to")
    return original(self, query, key, value, key_padding_mask=key_padding_mask,
                    need_weights=need_weights, attn_mask=attn_mask,
                    average_attn_weights=average_attn_weights, is_causal=is_causal)


# ---- the encoder layer ----

_F = torch.nn.functional


def _activation_name(act):
    """The C layer's name for a torch activation ("relu", "gelu", "gelu_tanh"),
    or None when the layer must run it through torch."""
    if act is _F.relu or type(act) is torch.nn.ReLU:  # a subclass may compute otherwise
        return "relu"
    if act is _F.gelu:
        return "gelu"
    if type(act) is torch.nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    return None


def _activation_fn(activation):
    """torch's rule for TransformerEncoderLayer(activation=...), plus
    "gelu_tanh" (F.gelu(approximate="tanh"))."""
    if not isinstance(activation, str):
        return activation
    if activation == "relu":
        return _F.relu
    if activation == "gelu":
        return _F.gelu
    if activation == "gelu_tanh":
        return torch.nn.GELU(approximate="tanh")
    raise RuntimeError(f"activation should be relu/gelu, not {activation}")


class _CEncoder:
    """The _attn.EncoderLayer an inference call runs on, rebuilt when the
    configuration changes; the torch parameters are copied in at every call
    (as _CModules does for MHA)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.key = self.layer = None

    def __reduce__(self):
        return (_CEncoder, ())

    def get(self, spec, params):
        if self.key != spec:
            self.layer, self.key = _attn.EncoderLayer(**spec), spec
        self.layer.load([torch_array(p.contiguous()) for p in params])
        return self.layer


class TransformerEncoderLayer(torch.nn.Module):
    """torch.nn.TransformerEncoderLayer with its attention on attn: the same
    constructor, submodules (self_attn, linear1, dropout, linear2, norm1,
    norm2, dropout1, dropout2), state_dict keys and forward(src, src_mask=None,
    src_key_padding_mask=None, is_causal=False).

    When no gradient is needed (torch.no_grad(), inference_mode(), or nothing
    requires grad) the whole layer runs in libattn (attn_encoder_layer_forward);
    otherwise it is torch's composition with attn.nn.MultiheadAttention, so it
    trains like torch's. Both read norm_first, batch_first, the dropout
    probabilities and training at every call. Rows whose keys are all masked
    give 0 where torch gives NaN.
    """

    __constants__ = ["norm_first"]

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation=_F.relu,
                 layer_norm_eps=1e-5, batch_first=False, norm_first=False, bias=True,
                 device=None, dtype=None) -> None:
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, **f)
        self.linear1 = torch.nn.Linear(d_model, dim_feedforward, bias=bias, **f)
        self.dropout = torch.nn.Dropout(dropout)
        self.linear2 = torch.nn.Linear(dim_feedforward, d_model, bias=bias, **f)
        self.norm_first = norm_first
        self.norm1 = torch.nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **f)
        self.norm2 = torch.nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **f)
        self.dropout1 = torch.nn.Dropout(dropout)
        self.dropout2 = torch.nn.Dropout(dropout)
        self.activation = _activation_fn(activation)

    def _c_params(self, bias):
        """The parameters the C layer loads, in its order, read from the
        submodules (so parametrizations and pruning apply), or None when one
        is missing or of another shape than torch's layer has."""
        a, E, F = self.self_attn, self.linear1.in_features, self.linear1.out_features
        want = [(a, "in_proj_weight", (3 * E, E)), (a, "in_proj_bias", (3 * E,)),
                (a.out_proj, "weight", (E, E)), (a.out_proj, "bias", (E,)),
                (self.linear1, "weight", (F, E)), (self.linear1, "bias", (F,)),
                (self.linear2, "weight", (E, F)), (self.linear2, "bias", (E,)),
                (self.norm1, "weight", (E,)), (self.norm1, "bias", (E,)),
                (self.norm2, "weight", (E,)), (self.norm2, "bias", (E,))]
        params = []
        for mod, name, shape in want:
            if name.endswith("bias") and not bias:
                continue
            p = getattr(mod, name, None)
            if not isinstance(p, torch.Tensor) or tuple(p.shape) != shape:
                return None
            params.append(p)
        return params

    def _c_computes_submodules(self):
        """Whether the C layer computes what the submodules' own forwards
        would: each is of torch's class (or attn's MHA), not a subclass with
        a forward of its own (a LoRA Linear, a custom norm), no forward hook
        or pre-hook would run (the module's own or global ones), and
        self_attn has neither bias_k/bias_v nor add_zero_attn (the C layer
        has no such keys)."""
        a, nn = self.self_attn, torch.nn
        kinds = ((a, (MultiheadAttention, nn.MultiheadAttention)), (self.linear1, (nn.Linear,)),
                 (self.linear2, (nn.Linear,)), (self.norm1, (nn.LayerNorm,)),
                 (self.norm2, (nn.LayerNorm,)), (self.dropout, (nn.Dropout,)),
                 (self.dropout1, (nn.Dropout,)), (self.dropout2, (nn.Dropout,)))
        if any(type(m) not in types for m, types in kinds):
            return False
        if a.bias_k is not None or a.bias_v is not None or a.add_zero_attn:
            return False
        hooked = [m for m, _ in kinds]
        if isinstance(self.activation, nn.Module):
            hooked.append(self.activation)
        g = nn.modules.module
        if (g._global_forward_hooks or g._global_forward_pre_hooks or
                any(m._forward_hooks or m._forward_pre_hooks for m in hooked)):
            return False
        return True

    def _c_spec(self, src):
        """The _attn.EncoderLayer configuration for this call, or None when
        the call must go through torch."""
        params = list(self.parameters())
        if (torch.is_grad_enabled() and (src.requires_grad or any(p.requires_grad for p in params))):
            return None
        if torch.jit.is_tracing():  # a trace must record torch's operations, not one result
            return None
        if src.numel() == 0:  # 0 sequences or 0 tokens: torch's empty result (attn takes none)
            return None
        from ._torch import has_tangent
        if has_tangent(src):  # forward-mode AD: torch's path, whose MHA raises
            return None
        act = _activation_name(self.activation)
        if not self._c_computes_submodules():
            return None
        ps = {self.dropout.p, self.dropout1.p, self.dropout2.p, float(self.self_attn.dropout)}
        if act is None or len(ps) != 1 or self.norm1.eps != self.norm2.eps:
            return None
        eps = float(self.norm1.eps)  # the C layer refuses what torch still computes:
        if self.linear1.out_features < 1 or not (math.isfinite(eps) and eps >= 0):
            return None  # no feed-forward, or an eps of torch's own meaning
        if _unsupported(self.self_attn, src, src, src, None, None) is not None:
            return None
        if any(p.dtype != src.dtype or p.device.type != "cpu" for p in params):
            return None
        if self.linear1.bias is None or self.norm1.bias is None:
            bias = False
            if any(x is not None for x in (self.linear1.bias, self.linear2.bias, self.norm1.bias,
                                          self.norm2.bias, self.self_attn.in_proj_bias)):
                return None
        else:
            bias = True
        if self._c_params(bias) is None:
            return None
        return dict(d_model=self.linear1.in_features, nhead=self.self_attn.num_heads,
                    dim_feedforward=self.linear1.out_features, dropout=ps.pop(),
                    activation=act, layer_norm_eps=eps,
                    norm_first=bool(self.norm_first), bias=bias, dtype=_DTYPES[src.dtype])

    def _c_forward(self, spec, src, src_mask, src_key_padding_mask, is_causal):
        if is_causal and src_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                "module method `generate_square_subsequent_mask` to create this mask.")
        causal = bool(is_causal) and src_key_padding_mask is None
        mask = None if causal else src_mask  # torch: the hint replaces the mask there
        training = bool(self.training) and spec["dropout"] > 0.0
        seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item()) if training else 0
        c = self.__dict__.get("_attn_c_encoder")
        if c is None:
            c = _CEncoder()
            object.__setattr__(self, "_attn_c_encoder", c)  # not a torch attribute
        with c.lock:
            layer = c.get(spec, self._c_params(spec["bias"]))
            out = layer.forward(
                torch_array(src, "src"), empty=empty, src_mask=torch_array(mask, "src_mask"),
                src_key_padding_mask=torch_array(src_key_padding_mask, "src_key_padding_mask"),
                is_causal=causal,
                training=training, seed=seed, batch_first=int(bool(self.self_attn.batch_first)))
        return torch_result(out, src.dtype)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        for x, name in ((src_key_padding_mask, "src_key_padding_mask"), (src_mask, "src_mask")):
            if x is not None and x.dtype != torch.bool and not x.is_floating_point():
                raise AssertionError(f"only bool and floating types of {name} are supported")
        spec = self._c_spec(src) if isinstance(src, torch.Tensor) else None
        if spec is not None:
            return self._c_forward(spec, src, src_mask, src_key_padding_mask, is_causal)
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                           need_weights=False, is_causal=is_causal)[0]
        return self.dropout1(x)

    def _ff_block(self, x):
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class TransformerEncoder(torch.nn.Module):
    """torch.nn.TransformerEncoder over attn's layers: num_layers deep copies
    of encoder_layer (an attn.nn.TransformerEncoderLayer, or any layer with
    its forward signature) and an optional final norm; the same state_dict
    keys (layers.0.self_attn.in_proj_weight, ..., norm.weight).

    forward(src, mask=None, src_key_padding_mask=None, is_causal=None) detects
    a causal mask as torch does. torch's nested-tensor fast path (eval,
    src_key_padding_mask given) returns 0 at padded positions; attn computes
    those rows like any other (their values are not used by a model that
    pools over real tokens only).
    """

    def __init__(self, encoder_layer, num_layers, norm=None, enable_nested_tensor=True,
                 mask_check=True) -> None:
        super().__init__()
        import copy
        self.layers = torch.nn.ModuleList(
            [copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor
        self.mask_check = mask_check

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        seq_len = None
        if src.dim() >= 2:
            first = self.layers[0].self_attn.batch_first if self.layers else False
            seq_len = src.shape[1 if (first and src.dim() == 3) else 0]
        is_causal = torch.nn.modules.transformer._detect_is_causal_mask(mask, is_causal, seq_len)
        out = src
        for mod in self.layers:
            out = mod(out, src_mask=mask, is_causal=is_causal,
                      src_key_padding_mask=src_key_padding_mask)
        return self.norm(out) if self.norm is not None else out
