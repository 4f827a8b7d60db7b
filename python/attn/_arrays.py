"""Argument normalisation shared by attn's public functions.

Arrays come in as NumPy arrays, torch CPU tensors or anything ``np.asarray``
accepts, and leave as NumPy arrays *viewing the same memory*: strides are kept,
nothing is copied, except an array in a foreign byte order (converted to
native order). Scalars are checked here so that errors name the Python
argument and say what was expected; failures of the C library are given
Python's argument names here too (library_error).
"""

import functools
import math
import numbers
import os
import re
import sys

import numpy as np

from . import _attn

FLOAT = "float"  # float32 or float64
TENSOR = "tensor"  # attention's operands: float16, bfloat16, float32 or float64
MASK = "mask"  # bool, float16, bfloat16, float32 or float64
PARAM = "param"  # any real number type; converted to the module's dtype
INDEX = "index"  # any integer type; converted to int32 (index_array)
CACHE = "cache"  # a KV cache: float16, bfloat16, float32 or float64


_TORCH_CLASS = {}  # type -> whether it is torch.Tensor or a subclass (asked on every call)


def _is_torch_tensor(x):
    cls = type(x)
    found = _TORCH_CLASS.get(cls)
    if found is None:
        found = any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in cls.__mro__)
        _TORCH_CLASS[cls] = found
    return found


def _expected(kind):
    if kind == FLOAT:
        return "float32 or float64"
    if kind == MASK:
        return "bool, float16, bfloat16, float32 or float64"
    if kind in (CACHE, TENSOR):
        return "float16, bfloat16, float32 or float64"
    if kind == INDEX:
        return "an integer type (int32, as FlashAttention takes it)"
    return "a real number type"


def _torch():
    return sys.modules["torch"]  # loaded: a torch tensor exists


@functools.lru_cache(maxsize=None)
def _plain_class(cls):
    """Whether a torch.Tensor subclass adds no semantics of its own, so that
    its storage holds its values (torch.nn.Parameter, `as_subclass` to a bare
    subclass). Subclasses with their own __torch_function__ or
    __torch_dispatch__ (CausalBias, FakeTensor, DTensor, NestedTensor) may
    keep a placeholder or nothing there."""
    torch = _torch()
    tf = getattr(cls.__torch_function__, "__func__", cls.__torch_function__)
    plain_tf = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)
    return tf in plain_tf and cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__


def tracks_grad(x):
    """Whether torch would record `x` in an autograd graph right now."""
    return _is_torch_tensor(x) and x.requires_grad and _torch().is_grad_enabled()


def no_backward(what, remedy="pass detached tensors (tensor.detach())"):
    return RuntimeError(
        f"{what}, and torch's grad mode is on, but attn has no backward yet: its result would "
        f"carry no gradient. Call it under torch.no_grad() or torch.inference_mode(), or "
        f"{remedy}"
    )


def storage_short(x):
    """(need, held) bytes when x's sizes, strides and storage offset reach
    past its storage, else None. A storage resized behind the tensor's back
    (untyped_storage().resize_(), as FSDP frees parameters) leaves such
    sizes: torch's own ops refuse the tensor, and .numpy() would hand attn
    memory past the allocation."""
    torch = _torch()
    T = torch.Tensor  # from the class: a tensor's own attributes may shadow them
    if T.numel(x) == 0:
        return None
    reach = T.storage_offset(x) + sum((n - 1) * s for n, s in zip(x.shape, T.stride(x))) + 1
    need, held = reach * T.element_size(x), torch.UntypedStorage.nbytes(T.untyped_storage(x))
    return (need, held) if need > held else None


def storage_error(name, short):
    need, held = short
    return ValueError(
        f"{name}'s sizes, strides and storage offset reach {need} bytes of its storage, which "
        f"holds {held} (was the storage resized behind the tensor, e.g. by "
        f"untyped_storage().resize_()?)"
    )


def _torch_numpy(x, name, kind, copying, bfloat16_bits=False):
    """A NumPy view of a torch tensor, refusing every tensor whose storage
    does not hold its values. `copying`: the values are copied (parameters),
    so a tensor requiring grad is fine. `bfloat16_bits`: a bfloat16 tensor
    comes back as an int16 view of its bits (NumPy has no bfloat16)."""
    torch = _torch()
    if x.is_nested:
        raise TypeError(f"{name} is a nested tensor; nested tensors are not supported "
                        f"(pad them to one shape, e.g. {name}.to_padded_tensor(0.0))")
    if x.is_meta:
        raise ValueError(f"{name} is a meta tensor: meta tensors have a shape and dtype but no "
                         f"data, so there is nothing to compute on")
    if x.device.type != "cpu":
        raise ValueError(
            f"{name} is on device '{x.device}'; attn computes on the CPU, so pass {name}.cpu()"
        )
    cls = type(x)
    if not _plain_class(cls):
        hint = ", or is_causal=True for a causal mask" if cls.__name__ == "CausalBias" else ""
        raise TypeError(
            f"{name} is a {cls.__name__} ({cls.__module__}), a torch.Tensor subclass with "
            f"semantics of its own: its storage need not hold its values, so attn cannot "
            f"read it; pass a plain tensor{hint}"
        )
    if torch._C._functorch.is_functorch_wrapped_tensor(x):
        raise TypeError(f"{name} is wrapped by a torch.func transform (grad, vmap, ...); attn "
                        f"reads raw memory and cannot take part in one")
    if x.layout != torch.strided:
        raise TypeError(f"{name} has layout {x.layout}; attn reads strided tensors only: pass "
                        f"{name}.to_dense()")
    if not copying and tracks_grad(x):
        raise no_backward(f"{name} requires grad")
    if (short := storage_short(x)) is not None:
        raise storage_error(name, short)
    t = x.detach().resolve_conj().resolve_neg()
    if bfloat16_bits and t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # the same memory, reinterpreted
    elif kind == PARAM and t.dtype == torch.bfloat16:
        t = t.float()  # exact: values to copy into a module of any dtype
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as e:
        if x.dtype in _torch_dtypes(kind):  # the dtype is fine: say what torch said
            raise TypeError(f"{name} cannot be read as an array: torch says {e!s}") from e
        raise TypeError(f"{name} is a torch tensor of dtype {x.dtype}; expected "
                        f"{_expected(kind)}") from e


def _torch_dtypes(kind):
    """The torch dtypes a `kind` takes (their NumPy views are checked after)."""
    torch = _torch()
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    return {TENSOR: floats, CACHE: floats, MASK: floats + (torch.bool,),
            FLOAT: floats[2:]}.get(kind, ())


def torch_array(t, name="a tensor"):
    """A NumPy view of a plain CPU torch tensor its caller checked (or torch
    made), detached; bfloat16 as an int16 view of its bits, which _attn reads
    as bfloat16. None stays None."""
    if t is None:
        return None
    torch = _torch()
    T = torch.Tensor  # its methods from the class: a tensor's own attributes may shadow them
    if (short := storage_short(t)) is not None:
        raise storage_error(name, short)
    # each step only where it changes something: a training step converts a
    # dozen tensors, and detach, resolve_conj and resolve_neg make a new
    # tensor object each time (1.2 against 0.9 us a tensor, measured)
    if t.requires_grad:
        t = T.detach(t)
    if T.is_conj(t):
        t = T.resolve_conj(t)
    if T.is_neg(t):
        t = T.resolve_neg(t)
    return T.numpy(T.view(t, torch.int16) if t.dtype is torch.bfloat16 else t)


def torch_result(a, dtype):
    """An _attn output (NumPy) as a torch tensor of `dtype`, the same memory
    (bfloat16 arrives as its int16 bits)."""
    torch = _torch()
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def is_bfloat16(a):
    """Whether NumPy array `a` holds bfloat16: ml_dtypes' dtype, or the
    16-bit integer view of one (as_array's, for TENSOR and MASK kinds)."""
    dt = a.dtype  # (dtype.name is slow: a Python property, asked on every call)
    return dt.itemsize == 2 and (dt.kind in "iu" or dt.name == "bfloat16")


_NAMES = {np.dtype(t): np.dtype(t).name for t in (np.float16, np.float32, np.float64)}


def dtype_name(a):
    """The dtype of an as_array view as torch and attn.h name it."""
    name = _NAMES.get(a.dtype)
    return name if name is not None else "bfloat16" if is_bfloat16(a) else a.dtype.name


# attn_dtype_name's names as NumPy dtypes: bfloat16 as 16-bit integers
# holding its bits (NumPy has no bfloat16; _attn reads them as bfloat16).
_OUTPUT_DTYPES = {name: np.dtype(np.int16 if name == "bfloat16" else name)
                  for name in ("float16", "bfloat16", "float32", "float64", "bool", "int32")}


_BLOCK_MIN, _BLOCK_MAX = _attn.OUTPUT_BLOCK_MIN, _attn.OUTPUT_BLOCK_MAX
_np_empty = np.empty


def empty(shape, dtype_name):
    """The output allocator of every _attn call. Outputs of 256 KiB to 32 MiB
    live in blocks attn recycles (python/src/_attn_blocks.c: a loop that
    frees last step's outputs gets their warm pages back instead of faulting
    fresh ones in); smaller and larger ones are NumPy's own. (Called once
    per output of every call: module constants, not attribute lookups.)"""
    dt = _OUTPUT_DTYPES[dtype_name]
    nbytes = dt.itemsize * math.prod(shape)
    if nbytes < _BLOCK_MIN or nbytes > _BLOCK_MAX:  # not kept: NumPy's
        return _np_empty(shape, dt)
    return np.frombuffer(_attn.output_block(nbytes), dt).reshape(shape)


def as_bfloat16(out, like):
    """An output of _attn in bfloat16 bits as the caller's kind of bfloat16:
    ml_dtypes' when `like` (an input) is one, else the bits unchanged."""
    if out is None or out.dtype != np.int16:
        return out
    if like.dtype.name == "bfloat16":
        return out.view(like.dtype.newbyteorder("="))
    return out


def as_array(x, name, kind, grad_ok=False):
    """A NumPy view of `x` (no copy), with its dtype checked for `kind`.
    `grad_ok`: the caller records the call for autograd itself, so a tensor
    that requires grad is fine. For TENSOR and MASK, bfloat16 (torch's, or
    ml_dtypes' in NumPy) comes back as an int16 view of its bits."""
    halves = kind in (TENSOR, MASK)
    if isinstance(x, np.ndarray):
        a = x
        if halves and a.dtype.name == "bfloat16":  # ml_dtypes
            if not a.dtype.isnative:  # its bits in this machine's byte order first
                a = a.astype(a.dtype.newbyteorder("="))
            return a.view(np.int16)
    elif _is_torch_tensor(x):
        a = _torch_numpy(x, name, kind, copying=grad_ok or kind == PARAM, bfloat16_bits=halves)
        if halves and a.dtype == np.int16 and x.dtype != _torch().int16:
            return a  # bfloat16's bits
    else:
        if x is None:
            raise TypeError(f"{name} must be an array, not None")
        try:
            a = np.asarray(x)
        except Exception as e:  # ragged lists and the like
            raise TypeError(f"{name} must be an array; np.asarray failed: {e}") from e
    dt = a.dtype
    ok = {
        FLOAT: dt.kind == "f" and dt.itemsize in (4, 8),
        TENSOR: dt.kind == "f" and dt.itemsize in (2, 4, 8),
        MASK: dt.kind == "b" or (dt.kind == "f" and dt.itemsize in (2, 4, 8)),
        PARAM: dt.kind in "fiu",
        INDEX: dt.kind in "iu",
        CACHE: dt.kind == "f" and dt.itemsize in (2, 4, 8),
    }[kind]
    if not ok:
        raise TypeError(f"{name} has dtype {dt}; expected {_expected(kind)}")
    if not dt.isnative:
        a = a.astype(dt.newbyteorder("="))
    return a


# attn_last_error_arg() names an argument as attn.h does. Fields of the C
# parameter structs ("params.dropout_p", "config.num_heads") are Python's
# arguments without the prefix; these are the other names that differ.
# The window's two fields are one Python argument, as in FlashAttention.
_PYTHON_ARG = {"params.causal": "is_causal", "params.window_left": "window_size",
               "params.window_right": "window_size"}  # operands come with Python names


def library_error(e, rename=None):
    """`e`, raised by attn._attn for a failed library call (with ``status``,
    ``status_name`` and ``arg``), with ``arg`` in Python's terms; other
    exceptions pass through unchanged. `rename`: the caller's own names for
    C names (attn.varlen_attention's "softmax_scale" for "params.scale")."""
    arg = getattr(e, "arg", None)
    if isinstance(arg, str) and hasattr(e, "status"):
        names = dict(_PYTHON_ARG, **(rename or {}))
        prefix, dot, field = arg.partition(".")
        in_struct = dot and prefix in ("params", "config")
        e.arg = names.get(arg, field if in_struct else arg)
    return e


def check_bool(x, name):
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise TypeError(f"{name} must be a bool, not {type(x).__name__}")


def _show(n):
    """An int for a message: a 400-digit number would bury the message."""
    digits = len(str(abs(n)))
    if digits <= 30:
        return str(n)
    return f"{'a negative' if n < 0 else 'an'} int of {digits} digits"


def _as_float(x, name):
    """float(x), with an overflow named after the argument."""
    try:
        return float(x)
    except OverflowError:
        shown = _show(x) if isinstance(x, numbers.Integral) else "a number"
        raise ValueError(f"{name} is {shown}, too large for a float") from None


def check_probability(x, name):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], not {type(x).__name__}")
    p = _as_float(x, name)
    if not 0.0 <= p <= 1.0:  # NaN fails too
        raise ValueError(f"{name} is {p}; expected a probability in [0, 1]")
    return p


def check_scale(x, name="scale"):
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be None or a float, not {type(x).__name__}")
    s = _as_float(x, name)
    if not np.isfinite(s):
        raise ValueError(f"{name} is {s}; expected a finite number (or None for 1/sqrt(E))")
    return s


def index_array(x, name):
    """An integer array (NumPy, torch or a list) as a C-contiguous int32 NumPy
    array: FlashAttention's index tensors (cu_seqlens, cache_seqlens,
    block_table) are int32, and other integer types are converted when
    every value fits. Index arrays are small: the copy costs nothing. (An
    index tensor cannot require grad; a float one is refused for its dtype,
    not for its grad.)"""
    a = as_array(x, name, INDEX, grad_ok=True)
    if a.dtype != np.int32 and a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < -2**31 or hi >= 2**31:
            bad = lo if lo < -2**31 else hi
            raise ValueError(f"{name} holds {_show(bad)}, which does not fit in int32")
    # (np.ascontiguousarray would make a 0-d array 1-d: taken as (1,), it
    # passed for one sequence's offsets or lengths; its rank is the C
    # layer's to refuse, naming the argument)
    return np.require(a, dtype=np.int32, requirements="C")


def check_window(x, name="window_size"):
    """FlashAttention's window_size: a pair (left, right) of ints, each -1
    (unbounded) or >= 0."""
    try:
        left, right = x
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a pair (left, right) of ints, -1 for unbounded; "
                        f"got {x!r}") from None
    out = []
    for side, w in (("left", left), ("right", right)):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
            raise TypeError(f"{name}[{side == 'right':d}] ({side}) must be an int, not "
                            f"{type(w).__name__}")
        w = int(w)
        if w < -1 or w >= 2**63:
            raise ValueError(f"{name} is {tuple(x)!r}: the {side} size is {_show(w)}; expected "
                             f"-1 (unbounded) or an int >= 0 (and < 2**63)")
        out.append(w)
    return tuple(out)


def check_softcap(x, name="softcap"):
    """FlashAttention's softcap: 0 (none) or a finite number > 0."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a float, not {type(x).__name__}")
    c = _as_float(x, name)
    if not (np.isfinite(c) and c >= 0.0):
        raise ValueError(f"{name} is {c}; expected 0 (no capping) or a finite number > 0")
    return c


def check_int(x, name, minimum=1, optional=False, maximum=2**63 - 1, bound=None):
    """An int in [minimum, maximum]; `bound` says where the maximum comes from."""
    if x is None and optional:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        what = "None or an int" if optional else "an int"
        raise TypeError(f"{name} must be {what}, not {type(x).__name__}")
    n = int(x)
    if n < minimum:
        raise ValueError(f"{name} is {_show(n)}; expected an int >= {minimum}")
    if n > maximum:
        limit = "< 2**63" if maximum == 2**63 - 1 else f"<= {maximum}"
        raise ValueError(f"{name} is {_show(n)}; expected an int {limit}{bound or ''}")
    return n


def check_seed(x, name="seed"):
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be None or an int in [0, 2**64), not {type(x).__name__}")
    s = int(x)
    if not 0 <= s < 2**64:
        raise ValueError(f"{name} is {_show(s)}; expected None or an int in [0, 2**64)")
    return s


def check_device(device):
    """torch's device argument: only the CPU, with any index."""
    if device is None or re.fullmatch(r"cpu(:\d+)?", str(device)):
        return
    raise ValueError(
        f"device is {device!r}; attn runs on the CPU (device=None, 'cpu' or 'cpu:N')"
    )


def random_seed():
    """A fresh 64-bit seed from the operating system."""
    return int.from_bytes(os.urandom(8), "little")


def check_dtype(dtype, halves=False):
    """The NumPy dtype for a module's `dtype=`: a NumPy dtype, its name, or a
    torch dtype (torch.float32, torch.float64). `halves`: float16 and
    bfloat16 too (bfloat16 as ml_dtypes', which must then be installed)."""
    if dtype is None:
        return np.dtype(np.float32)
    if not isinstance(dtype, str) and str(dtype).startswith("torch."):
        dtype = str(dtype)[len("torch."):]
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if halves and (dtype == "bfloat16" or (dt is not None and dt.name == "bfloat16")):
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError("dtype bfloat16 needs ml_dtypes (pip install ml_dtypes): NumPy has "
                            "no bfloat16 of its own") from None
        return np.dtype(ml_dtypes.bfloat16)
    allowed = (np.float32, np.float64, np.float16) if halves else (np.float32, np.float64)
    if dt is None or dt.type not in allowed:
        expected = "float32, float64, float16 or bfloat16" if halves else "float32 or float64"
        raise TypeError(f"dtype is {dtype}; expected {expected}")
    return dt.newbyteorder("=")


def results(a, out, weights, lse):
    """What scaled_dot_product_attention returns (attn/_sdpa.py, and
    attn/_torch.py for tensors): out, or a tuple with the extras asked for."""
    if not (a.want_w or a.want_lse):
        return out
    return (out,) + ((weights,) if a.want_w else ()) + ((lse,) if a.want_lse else ())
