"""safetensors files: attn.load_safetensors and attn.save_safetensors.

The C library reads and writes the files (header parsed by attn's own strict
parser, the file mapped, written atomically); this layer turns them into
dicts of NumPy arrays and back.
"""

import os
from collections.abc import Mapping

import numpy as np

from . import _attn

# The stored bytes of the dtypes attn does not convert, as NumPy reads them.
_RAW = {
    "I8": "<i1", "U8": "<u1", "I16": "<i2", "U16": "<u2", "I32": "<i4", "U32": "<u4",
    "I64": "<i8", "U64": "<u8", "C64": "<c8",
}
# What save_safetensors stores each NumPy dtype as.
_CODES = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.bool_): "BOOL",
          np.dtype(np.float16): "F16"}


def _is_torch_tensor(x):
    return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in type(x).__mro__)


def _float_dtype(dtype):
    if dtype is None:
        return None
    if _is_torch_dtype(dtype):
        dtype = str(dtype).replace("torch.", "")
    try:
        d = np.dtype(dtype)
    except TypeError:
        d = None
    if d not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype is {dtype!r}; expected None (each tensor's own), float32 or "
                         f"float64")
    return d.name


def _is_torch_dtype(x):
    return type(x).__module__ == "torch" and type(x).__name__ == "dtype"


def load_safetensors(path, names=None, dtype=None):
    """Reads a safetensors file into a dict name -> NumPy array (new, writable
    arrays; the file is not kept open).

    names: None for every tensor (in the file's order), or an iterable of
    names (a KeyError names one the file lacks). dtype: None keeps each
    tensor's dtype, except bfloat16, which NumPy lacks: it is read as float32
    (exactly; torch.from_numpy(a).to(torch.bfloat16) gives the bits back);
    float16 stays float16. 'float32' or 'float64' (or the NumPy / torch
    dtype) converts every floating tensor to it; bool and integer tensors
    keep their dtype either way. Float8 and sub-byte tensors (F8_*, F4, F6_*)
    have no NumPy dtype: a TypeError names them (pass names= to skip them).
    A malformed file is a ValueError saying what is wrong; I/O failures are
    ValueErrors with the system's reason (status_name 'ATTN_ERR_IO').
    """
    path = os.fspath(path)
    if names is not None:
        if isinstance(names, (str, bytes)):
            raise TypeError("names must be an iterable of tensor names, not a single "
                            f"{type(names).__name__} (write names=[{names!r}])")
        names = list(names)
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"names holds {n!r}; names are str")
    entries, _ = _attn.safetensors_load(path, names, _float_dtype(dtype), empty=np.empty)
    out = {}
    for name, file_dtype, shape, value in entries:
        if isinstance(value, bytes):
            if shape is None:
                raise ValueError(f"tensor {name!r} has more than 8 dimensions; attn reads at "
                                 f"most 8 (pass names= without it)")
            if file_dtype not in _RAW:
                raise TypeError(f"tensor {name!r} is {file_dtype}, which NumPy has no dtype for; "
                                f"pass names= without it")
            value = np.frombuffer(value, dtype=_RAW[file_dtype]).astype(
                _RAW[file_dtype][1:]).reshape(shape)
        out[name] = value
    return out


def load_safetensors_metadata(path):
    """The "__metadata__" of a safetensors file as a dict of str (no tensor
    data is read)."""
    _, meta = _attn.safetensors_load(os.fspath(path), [], None, empty=np.empty)
    return meta


def _as_savable(name, x):
    """(array, code) for one value: a NumPy array or anything np.asarray
    takes, or a torch tensor (bfloat16 kept as bfloat16)."""
    if _is_torch_tensor(x):
        import torch

        if x.layout != torch.strided:
            raise TypeError(f"tensor {name!r} is {x.layout}; only dense tensors can be saved")
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy(), "BF16"
        x = x.numpy()
    a = np.asarray(x)
    if a.dtype.byteorder not in ("=", "|") and a.dtype.newbyteorder("=") in _CODES:
        a = a.astype(a.dtype.newbyteorder("="))
    code = _CODES.get(a.dtype)
    if code is None:
        raise TypeError(f"tensor {name!r} is {a.dtype}; attn saves float32, float64, float16, "
                        f"bool and (torch) bfloat16")
    if a.ndim > 8:
        raise ValueError(f"tensor {name!r} has {a.ndim} dimensions; attn saves at most 8")
    if any(s % a.itemsize for s in a.strides):
        a = np.ascontiguousarray(a)
    return a, code


def save_safetensors(path, tensors, metadata=None):
    """Writes a dict name -> array as a safetensors file, atomically (a
    temporary file beside path, flushed, then renamed: a failure leaves path
    as it was).

    Values: NumPy arrays (float32, float64, float16, bool; any strides, 0-d
    and empty arrays included) or torch CPU tensors of those dtypes or
    bfloat16 (stored as BF16). metadata: None or a dict str -> str, stored
    as "__metadata__". Names are any str but "__metadata__". The file reads
    with the `safetensors` package (safe_open, load_file) and with
    load_safetensors.
    """
    path = os.fspath(path)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict name -> array, not {type(tensors).__name__}")
    items = []
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names are str; got {name!r}")
        a, code = _as_savable(name, value)
        items.append((name, a, code))
    pairs = []
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a dict str -> str, not {type(metadata).__name__}")
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"metadata holds {k!r}: {v!r}; keys and values are str")
            pairs.append((k, v))
    _attn.safetensors_save(path, items, pairs)
