"""attn — exact scaled dot-product and multi-head attention for the CPU, with
PyTorch 2.13's semantics and names.

    import attn
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    mha = attn.MultiheadAttention(embed_dim=64, num_heads=8, batch_first=True)
    mha.load_state_dict(torch_mha.state_dict())
    y, w = mha(x, x, x)

Inputs are NumPy arrays, torch CPU tensors or anything NumPy can view, float32
or float64, with any strides (read in place, not copied); SDPA gives NumPy
arrays for NumPy inputs and torch tensors (with autograd, and under
torch.compile) for torch inputs; attn.varlen_attention and
attn.attention_with_kvcache are FlashAttention's flash_attn_varlen_func and
flash_attn_with_kvcache (packed variable-length batches; decoding against a
KV cache, paged or not, appended in place); attn.patch_torch() routes torch's own
scaled_dot_product_attention through attn. The GIL is released while the
kernels run. attn.load_safetensors / attn.save_safetensors read and write
checkpoints (safetensors files) as dicts of NumPy arrays; attn.plot_attention
draws attention weights (needs matplotlib). attn.distributed.ring_attention
splits one attention's sequence over MPI ranks (needs mpi4py and an attn built
with MPI). See docs/python.md.
"""

from . import _attn  # libattn picks OpenBLAS's kernels for this CPU as it loads
from ._mha import MultiheadAttention
from ._sdpa import scaled_dot_product_attention
from ._serving import attention_with_kvcache, varlen_attention
from ._patch import patch_torch
from ._safetensors import load_safetensors, load_safetensors_metadata, save_safetensors
from ._plot import plot_attention
from ._arrays import check_int as _check_int

__version__ = _attn.version()

__all__ = [
    "scaled_dot_product_attention",
    "varlen_attention",
    "attention_with_kvcache",
    "MultiheadAttention",
    "patch_torch",
    "load_safetensors",
    "load_safetensors_metadata",
    "save_safetensors",
    "plot_attention",
    "set_num_threads",
    "get_num_threads",
    "max_threads",
    "release_workspace",
    "kernel_info",
    "__version__",
]


def __getattr__(name):
    # attn.nn needs torch, attn.distributed mpi4py: imported on first use, so
    # `import attn` works without them.
    if name in ("nn", "distributed"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'attn' has no attribute {name!r}")


def set_num_threads(num_threads):
    """Threads each call uses, 1 to max_threads(); 0 restores the default: the
    environment variable ATTN_NUM_THREADS if set, else the number of
    processors. Results do not depend on it. Outside [0, max_threads()] is a
    ValueError."""
    top = _attn.max_threads()
    n = _check_int(num_threads, "num_threads", minimum=0, maximum=top,
                   bound=" (the bound attn.max_threads() reports), or 0 for the default")
    _attn.set_num_threads(n)


def max_threads():
    """The largest thread count set_num_threads() takes: 4 per processor, at
    most 1024 (1 in a build without OpenMP)."""
    return _attn.max_threads()


def get_num_threads():
    """Threads each call uses."""
    return _attn.get_num_threads()


def release_workspace():
    """Frees the memory attn keeps between calls so that a call in a loop
    does not fault it in again each time: the library's workspace (blocks of
    64 KiB and more, at most 64 MiB in all) and the memory of freed outputs
    (arrays of 256 KiB to 32 MiB, at most 16 blocks and 64 MiB in all,
    handed out again for outputs of the same size). Safe at any time; the
    next call allocates afresh."""
    _attn.release_workspace()


def kernel_info():
    """Which kernel path calls take, which paths this CPU and OS support, the
    thread count, the library version and the BLAS behind MHA's projections,
    as a dict."""
    return {
        "isa": _attn.isa(),
        "supported_isas": _attn.supported_isas(),
        "num_threads": _attn.get_num_threads(),
        "version": _attn.version(),
        "blas": _attn.blas_info(),
    }
