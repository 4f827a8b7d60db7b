"""attn.distributed — ring attention over MPI: one attention whose sequence is
split over the ranks of an mpi4py communicator (libattn_ring, attn_ring.h).

    from mpi4py import MPI
    import attn.distributed as ad

    comm = MPI.COMM_WORLD
    q = ad.shard(q_whole, comm.rank, comm.size)   # this rank's queries (dim -2)
    k = ad.shard(k_whole, comm.rank, comm.size)   # ... keys and values
    v = ad.shard(v_whole, comm.rank, comm.size)
    out = ad.ring_attention(q, k, v, comm, is_causal=True)   # this rank's rows
    whole = ad.gather(out, comm)                  # the whole output, every rank

Run under mpirun (``mpirun -np 4 python3 script.py``). Needs mpi4py (an
optional dependency) and an attn built where CMake found MPI
(``is_available()``). Every function here but shard and unshard is
collective: every rank of the communicator calls it. See docs/python.md.
"""

import math
import numbers
import sys
import time

import numpy as np

from . import _attn
from ._arrays import (MASK, _is_torch_tensor, as_array, as_bfloat16, check_int, library_error,
                      random_seed)
from ._arrays import tracks_grad
from ._ring_calls import _forward
from ._sdpa import _arguments

__all__ = ["ring_attention", "shard", "unshard", "gather", "is_available"]

_LAYOUTS = {"zigzag": 0, "contiguous": 1}

_library_checked = False  # mpi4py's MPI library was found to be attn's


def is_available():
    """Whether this attn was built with ring attention (CMake found MPI).
    mpi4py is needed on top of it, and imported on first use."""
    return bool(_attn.has_ring)


def _require_ring():
    if not _attn.has_ring:
        raise RuntimeError(
            "attn was built without MPI, so it has no ring attention: install Open MPI "
            "(scripts/bootstrap.sh mpi, or apt-get install openmpi-bin libopenmpi-dev) and "
            "reinstall attn (pip install .), whose build then finds MPI"
        )


def _version(s):
    """An MPI library version string without the NUL Open MPI counts in."""
    return s.rstrip("\0").strip()


def _first_line(s):
    return _version(s).splitlines()[0] if _version(s) else "(empty)"


def _mpi():
    """mpi4py's MPI module, checked (once) to run the MPI library attn was
    built with: a communicator handle means nothing to another one."""
    global _library_checked
    _require_ring()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            "attn.distributed needs mpi4py, an optional dependency: pip install mpi4py "
            "(scripts/bootstrap.sh mpi installs it with Open MPI)"
        ) from e
    if not _library_checked:
        ours, theirs = _attn.mpi_library_version(), MPI.Get_library_version()
        if _version(ours) != _version(theirs):
            raise RuntimeError(
                f"mpi4py runs the MPI library '{_first_line(theirs)}', but attn was built with "
                f"'{_first_line(ours)}': both must use the same one (reinstall mpi4py for the "
                f"system's MPI, or rebuild attn where CMake finds mpi4py's)"
            )
        _library_checked = True
    return MPI


def _communicator(comm, MPI):
    """(comm, its C handle as an int); None is MPI.COMM_WORLD."""
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator (MPI.Comm), not "
                        f"{type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL")
    if comm.Is_inter():
        raise ValueError("comm is an intercommunicator; the ring runs over an "
                         "intracommunicator (MPI.COMM_WORLD or one split from it)")
    return comm, MPI._handleof(comm)


def _layout(layout):
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout is {layout!r}; expected 'zigzag' or 'contiguous'")
    return _LAYOUTS[layout]


def _timeout(timeout):
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
    try:
        t = float(timeout)
    except OverflowError:  # an int past a double's range
        raise ValueError(f"timeout is an int of {len(str(abs(timeout)))} digits, too large "
                         f"for a float; expected a finite number of seconds > 0") from None
    if not (t > 0.0 and math.isfinite(t)):
        raise ValueError(f"timeout is {t}; expected a finite number of seconds > 0")
    return t


def _dropout_seed(comm, seed, dropout_p, torch_call, timeout):
    """The seed every rank uses. seed=None with dropout draws one on every
    rank (a torch call from torch's generator, so torch.manual_seed repeats
    it) and takes rank 0's: the ring needs the same seed everywhere. The
    broadcast waits at most `timeout`, like the ring's own messages."""
    if seed is not None or dropout_p == 0.0:
        return 0 if seed is None else seed
    if torch_call:
        from ._torch import drawn_seed

        drawn = int(drawn_seed())
    else:
        drawn = random_seed()
    if comm.Get_size() == 1:
        return drawn
    buf = np.array([drawn], dtype=np.uint64)
    request = comm.Ibcast(buf, root=0)
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {comm.Get_rank()}: rank 0's dropout seed did not come within {timeout} s "
                f"(with seed=None and dropout_p > 0, every rank takes rank 0's seed: call "
                f"ring_attention alike on every rank). The job is broken: call comm.Abort()"
            )
        time.sleep(1e-4)
    return int(buf[0])


def _key_mask(mask, q):
    """key_padding_mask as attn_ring_params.key_mask: (..., 1, S_shard),
    bool true = the key takes part."""
    if mask is None:
        return None
    if tracks_grad(mask):
        raise RuntimeError("key_padding_mask requires grad, but ring attention gives no "
                           "gradient for a mask: pass key_padding_mask.detach()")
    m = as_array(mask, "key_padding_mask", MASK, grad_ok=True)
    if m.dtype == np.bool_:
        m = np.logical_not(m)  # True = padding here, as in torch's MHA
    if m.ndim == 1:
        return m.reshape(1, m.shape[0])
    if m.ndim == q.ndim - 2:  # (B..., S_shard) with q's batch dims, as torch MHA's (N, S)
        return m.reshape(m.shape[:-1] + (1, 1, m.shape[-1]))
    if m.ndim == q.ndim:  # already (B..., Hq or 1, 1, S_shard)
        return m
    raise ValueError(
        f"key_padding_mask has shape {m.shape}; for query of shape {q.shape} expected "
        f"(S_shard,), (B..., S_shard) with query's batch dims B... = {q.shape[:-3]}, or "
        f"(B..., Hq or 1, 1, S_shard)"
    )


def ring_attention(query, key, value, comm=None, *, key_padding_mask=None, dropout_p=0.0,
                   is_causal=False, scale=None, enable_gqa=False, causal_alignment="top-left",
                   seed=None, rng_offset=0, layout="zigzag", timeout=60.0, return_lse=False):
    """Scaled dot-product attention over a sequence split across the ranks of
    ``comm`` (an mpi4py communicator; None is MPI.COMM_WORLD). Collective:
    every rank calls it with its shards and the same options.

    query (..., Hq, L_shard, E), key (..., H, S_shard, E), value (..., H,
    S_shard, Ev): this rank's shards along dim -2, as ``shard`` cuts them
    under ``layout`` ("zigzag", the default, balances causal work; or
    "contiguous"). The result is this rank's shard of
    ``attn.scaled_dot_product_attention`` on the whole tensors, within
    float32 rounding, and bitwise the same from run to run for a fixed
    number of ranks. Types as scaled_dot_product_attention: NumPy in, NumPy
    out; torch tensors in, torch tensors out, with autograd (the backward is
    collective too: every rank runs it).

    key_padding_mask: this rank's keys' mask, (S_shard,), (B..., S_shard)
    with query's batch dims (torch MHA's (N, S)), or (B..., Hq or 1, 1,
    S_shard); bool **True = padding, the key is ignored** (torch's
    key_padding_mask, the opposite of an SDPA bool attn_mask), or float
    (added to the scores). It carries no gradient.
    is_causal, causal_alignment, scale, enable_gqa, dropout_p: as
    scaled_dot_product_attention, over the whole sequence (global
    positions). Dropout draws the mask of the single-process call with the
    same ``seed`` and ``rng_offset``; seed=None draws a seed (from torch's
    generator for torch inputs) and every rank takes rank 0's.
    timeout: seconds any rank waits for a peer; a peer that does not answer
    (killed, hung) gives RuntimeError with status_name 'ATTN_ERR_COMM',
    after which the job is broken: call comm.Abort().

    Returns out (..., Hq, L_shard, Ev), or (out, lse) with return_lse (the
    rows' log-sum-exp over the whole sequence; float64 for torch inputs, as
    scaled_dot_product_attention's).
    """
    MPI = _mpi()
    comm, handle = _communicator(comm, MPI)
    torch_call = any(_is_torch_tensor(x) for x in (query, key, value, key_padding_mask))
    a = _arguments(query, key, value, None, dropout_p, is_causal, scale, enable_gqa,
                   causal_alignment, seed, False, return_lse, grad_ok=True)
    opts = dict(
        comm=handle, key_mask=_key_mask(key_padding_mask, a.q), causal=a.causal, scale=a.scale,
        enable_gqa=a.gqa, dropout_p=a.dropout_p,
        rng_offset=check_int(rng_offset, "rng_offset", minimum=0, maximum=2**64 - 1),
        layout=_layout(layout), timeout=_timeout(timeout),
    )
    opts["seed"] = _dropout_seed(comm, a.seed, a.dropout_p, torch_call, opts["timeout"])
    if torch_call:
        from . import _ring_torch

        out, lse = _ring_torch.run(a, query, key, value, opts)
    else:
        out, lse = _forward(a.q, a.k, a.v, opts, a.want_lse, for_backward=False)
        out = as_bfloat16(out, query if isinstance(query, np.ndarray) else a.q)
    return (out, lse) if a.want_lse else out


# ---------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------


def _runs(layout_code, total, nranks, rank):
    try:
        return _attn.ring_shard_runs(layout_code, total, nranks, rank)
    except (ValueError, TypeError) as e:
        raise library_error(e) from None


def _dim(dim, ndim):
    d = check_int(dim, "dim", minimum=-ndim, maximum=ndim - 1) if ndim > 0 else None
    if d is None:
        raise ValueError("a 0-dimensional array has no sequence to shard")
    return d % ndim


def _narrow(x, d, start, length):
    if _is_torch_tensor(x):
        return x.narrow(d, start, length)
    return x[(slice(None),) * d + (slice(start, start + length),)]


def _cat(pieces, d):
    if _is_torch_tensor(pieces[0]):
        import torch

        return torch.cat(pieces, dim=d)
    return np.concatenate(pieces, axis=d)


def _array_like(x, name):
    if _is_torch_tensor(x) or isinstance(x, np.ndarray):
        return x
    if x is None:
        raise TypeError(f"{name} must be an array, not None")
    return np.asarray(x)


def shard(x, rank, nranks, dim=-2, layout="zigzag"):
    """Rank ``rank``'s shard of ``x`` along ``dim`` (the sequence is dim -2
    of query, key and value) under ``layout``, as attn_ring_shard cuts it:
    "zigzag" cuts the T positions into 2·nranks chunks and gives rank r
    chunks r and 2·nranks - 1 - r; "contiguous" gives rank r positions
    [r·T/nranks, (r + 1)·T/nranks). A copy, of x's type: NumPy (any dtype)
    or torch (differentiable: gradients flow back into x)."""
    code = _layout(layout)
    _require_ring()
    x = _array_like(x, "x")
    nranks = check_int(nranks, "nranks", minimum=1, maximum=2**31 - 1)
    rank = check_int(rank, "rank", minimum=0, maximum=nranks - 1,
                     bound=f" (nranks is {nranks})")
    d = _dim(dim, x.ndim)
    return _cat([_narrow(x, d, s, n) for s, n in _runs(code, x.shape[d], nranks, rank)], d)


def unshard(shards, dim=-2, layout="zigzag"):
    """The whole tensor from every rank's shard (a sequence, in rank order):
    the inverse of ``[shard(x, r, N, dim, layout) for r in range(N)]``.
    NumPy or torch, as the shards (torch: differentiable)."""
    code = _layout(layout)
    _require_ring()
    shards = [_array_like(s, f"shards[{r}]") for r, s in enumerate(shards)]
    if not shards:
        raise ValueError("shards is empty; expected one shard per rank")
    d = _dim(dim, shards[0].ndim)
    first = tuple(shards[0].shape)
    for r, s in enumerate(shards):  # before their lengths along d are summed
        if _is_torch_tensor(s) != _is_torch_tensor(shards[0]):
            raise TypeError(f"shards[{r}] is a {type(s).__name__} but shards[0] a "
                            f"{type(shards[0]).__name__}; give all NumPy arrays or all tensors")
        shape = tuple(s.shape)
        if len(shape) != len(first) or shape[:d] + shape[d + 1:] != first[:d] + first[d + 1:]:
            raise ValueError(f"shards[{r}] has shape {shape} and shards[0] {first}: shards "
                             f"may differ along dim {dim} only")
    total = sum(s.shape[d] for s in shards)
    placed = []
    for r, s in enumerate(shards):
        runs = _runs(code, total, len(shards), r)
        want = sum(n for _, n in runs)
        if s.shape[d] != want:
            raise ValueError(
                f"shards[{r}] has shape {tuple(s.shape)}; under the {layout} layout rank {r} of "
                f"{len(shards)} holds {want} of the {total} positions along dim {dim}"
            )
        offset = 0
        for start, n in runs:
            placed.append((start, _narrow(s, d, offset, n)))
            offset += n
    placed.sort(key=lambda p: p[0])
    return _cat([p for _, p in placed], d)


def gather(x, comm=None, *, dim=-2, layout="zigzag", root=None):
    """The whole tensor from every rank's shard ``x`` (collective): on every
    rank, or with ``root`` only there (None elsewhere). For results and
    checks, not for speed: the shards travel pickled (mpi4py's allgather).
    NumPy in, NumPy out; torch in, torch out (no gradient)."""
    MPI = _mpi()
    comm, _ = _communicator(comm, MPI)
    torch_in = _is_torch_tensor(x)
    bf16 = torch_in and str(x.dtype) == "torch.bfloat16"  # travels as its bits
    if torch_in:
        t = x.detach().cpu()
        a = (t.view(sys.modules["torch"].int16) if bf16 else t).numpy()
    else:
        a = np.asarray(_array_like(x, "x"))
    if root is None:
        shards = comm.allgather(a)
    else:
        root = check_int(root, "root", minimum=0, maximum=comm.Get_size() - 1)
        shards = comm.gather(a, root=root)
        if comm.Get_rank() != root:
            return None
    whole = unshard(shards, dim=dim, layout=layout)
    if torch_in:
        import torch

        whole = torch.from_numpy(whole)
        return whole.view(torch.bfloat16) if bf16 else whole
    return whole
