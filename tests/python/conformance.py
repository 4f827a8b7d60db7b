"""Random cases, PyTorch references and the error model of attn's conformance
suite.

Every case is drawn from its own generator, seeded with (SEED, kind, index),
so one case can be rerun alone and a run is repeated exactly by its seed.

Error model
-----------
float32: attn's max abs error against PyTorch in float64 (on the same float32
inputs, upcast exactly) must be at most 2 x PyTorch's own float32 error
against that reference, plus 1e-6.
float64: attn's max abs error against PyTorch in float64 must be at most
1e-12 x the largest magnitude of the reference (norm-wise relative error).
Where an exact result is available (SDPA: `sdpa_exact`, the formula in
long double, 64-bit significand), attn must be within 1e-12 relative of it,
and within 1e-12 relative plus PyTorch's own measured deviation from it of
PyTorch's result. That allowance matters only for ill-conditioned cases: with
|q.k| ~ 1e4 every float64 implementation rounds the scores by ~|s| x 1e-16,
which moves the output by up to ~1e-12 relative, and PyTorch's float64 error
alone has been seen at 7e-13; attn is not blamed for PyTorch's rounding, and
the summary reports how often the allowance was used.
Infinities (a fully masked row's log-sum-exp is -inf) must match exactly,
and NaN is always a failure.
"""

import os
import statistics

import numpy as np

SEED = int(os.environ.get("ATTN_TEST_SEED", "20260613"))
N_SDPA = 1200
N_MHA = 360

F32_FACTOR = 2.0
F32_SLACK = 1e-6
F64_REL = 1e-12

STATS = {
    kind: {
        "cases": 0,
        "ratios": [],
        "worst_ratio": 0.0,
        "worst_usage": 0.0,  # float32: largest error / bar
        "worst_rel64": 0.0,  # against PyTorch float64
        "worst_exact64": 0.0,  # against the exact (long double) result
        "allowance_used": 0,  # float64 checks that needed PyTorch's own error
    }
    for kind in ("sdpa", "mha")
}


def torch_version():
    import torch

    return torch.__version__


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------
# The error model
# ---------------------------------------------------------------------------


def _max_abs(x):
    return float(np.max(np.abs(x), initial=0.0))


def check_close(kind, what, ours, ref64, torch32=None, *, exact=None, context=""):
    """Asserts the error model for one output. `ref64` is PyTorch's float64
    result; `torch32` is PyTorch's float32 result for float32 cases (None for
    float64 cases); `exact` an optional long-double result for float64 cases.
    Returns the error ratio (float32) or relative error (float64)."""
    ours = np.asarray(ours)
    ref = np.asarray(ref64, dtype=np.float64)
    where = f"{what} ({context})"
    assert ours.shape == ref.shape, f"{where}: shape {ours.shape}, torch {ref.shape}"
    o = ours.astype(np.float64)
    assert not np.isnan(o).any(), f"{where}: attn returned NaN"
    assert not np.isnan(ref).any(), f"{where}: the torch reference has NaN (test bug)"
    inf = np.isinf(ref)
    assert np.array_equal(np.isinf(o), inf) and np.array_equal(o[inf], ref[inf]), (
        f"{where}: infinities differ from torch's"
    )
    fin = ~inf
    err = float(np.max(np.abs(o[fin] - ref[fin]), initial=0.0))
    stats = STATS[kind]
    if torch32 is None:  # float64
        size = _max_abs(ref[fin])
        rel = err / size if size > 0 else err
        stats["worst_rel64"] = max(stats["worst_rel64"], rel)
        allowance = 0.0
        if exact is not None:
            x = np.asarray(exact, dtype=np.longdouble)
            assert x.shape == ref.shape and np.array_equal(np.isinf(x), inf)
            xsize = _max_abs(x[fin])
            xerr = _max_abs(o[fin] - x[fin])
            stats["worst_exact64"] = max(stats["worst_exact64"], xerr / xsize if xsize else xerr)
            assert xerr <= F64_REL * xsize, (
                f"{where}: float64 error {xerr:.3g} against the exact result, "
                f"{xerr / xsize if xsize else xerr:.3g} relative; the bar is {F64_REL:g}"
            )
            allowance = _max_abs(ref[fin] - x[fin])  # PyTorch's own error
        if err > F64_REL * size:
            stats["allowance_used"] += 1
        assert err <= F64_REL * size + allowance, (
            f"{where}: float64 error {err:.3g} is {rel:.3g} relative to max |torch| "
            f"{size:.3g}; the bar is {F64_REL:g} relative + torch's own error {allowance:.3g}"
        )
        return rel
    t = np.asarray(torch32, dtype=np.float64)
    assert t.shape == ref.shape
    tfin = fin & np.isfinite(t)
    terr = float(np.max(np.abs(t[tfin] - ref[tfin]), initial=0.0))
    bar = F32_FACTOR * terr + F32_SLACK
    ratio = err / terr if terr > 0 else (0.0 if err == 0 else float("inf"))
    if terr > 0:
        stats["ratios"].append(ratio)
    if np.isfinite(ratio):
        stats["worst_ratio"] = max(stats["worst_ratio"], ratio)
    stats["worst_usage"] = max(stats["worst_usage"], err / bar)
    assert err <= bar, (
        f"{where}: float32 error {err:.3g} vs torch float64; torch's own float32 error "
        f"is {terr:.3g}, so the bar is {bar:.3g}"
    )
    return ratio


# ---------------------------------------------------------------------------
# Sizes and memory layouts
# ---------------------------------------------------------------------------


def pick_len(rng, cap=64):
    r = rng.random()
    if r < 0.12:
        n = 1
    elif r < 0.85:
        n = int(rng.integers(2, 9))
    elif r < 0.97:
        n = int(rng.integers(9, 24))
    else:
        n = int(rng.integers(24, 65))
    return min(n, cap)


def pick_feat(rng, cap=64):
    r = rng.random()
    if r < 0.1:
        n = 1
    elif r < 0.9:
        n = int(rng.integers(2, 17))
    else:
        n = int(rng.integers(17, 65))
    return min(n, cap)


LAYOUTS = (
    "contiguous",
    "transposed",  # the last two dimensions swapped in memory
    "permuted",  # every dimension in a random memory order
    "strided",  # gaps between elements (every other one)
    "reversed",  # negative strides
    "fortran",
    "broadcast",  # zero strides (np.broadcast_to); makes values repeat
    "misaligned",  # a base address off by one byte: attn copies these
    "byteswapped",  # foreign byte order: converted to native
)
LAYOUT_P = (0.27, 0.15, 0.1, 0.15, 0.1, 0.06, 0.1, 0.04, 0.03)


def pick_layout(rng):
    return str(rng.choice(LAYOUTS, p=LAYOUT_P))


def relayout(a, layout, rng):
    """The same values as `a` (except "broadcast", which makes them repeat
    along one dimension) in another memory layout."""
    a = np.asarray(a)
    if a.ndim == 0 or layout == "contiguous":
        return a
    if layout == "transposed":
        if a.ndim < 2:
            return a
        return np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)
    if layout == "permuted":
        perm = rng.permutation(a.ndim)
        inv = np.argsort(perm)
        return np.ascontiguousarray(a.transpose(perm)).transpose(inv)
    if layout == "strided":
        big = np.zeros([2 * n for n in a.shape], dtype=a.dtype)
        sl = tuple(slice(None, None, 2) for _ in a.shape)
        big[sl] = a
        return big[sl]
    if layout == "reversed":
        axes = tuple(d for d in range(a.ndim) if rng.random() < 0.6) or (a.ndim - 1,)
        return np.flip(np.ascontiguousarray(np.flip(a, axes)), axes)
    if layout == "fortran":
        return np.asfortranarray(a)
    if layout == "broadcast":
        dims = [d for d in range(a.ndim) if a.shape[d] > 1]
        if not dims:
            return a
        d = int(rng.choice(dims))
        return np.broadcast_to(a.take([0], axis=d), a.shape)
    if layout == "misaligned":
        raw = np.zeros(a.nbytes + 1, dtype=np.uint8)
        m = raw[1:].view(a.dtype).reshape(a.shape)
        m[...] = a
        return m
    if layout == "byteswapped":
        return a.astype(a.dtype.newbyteorder("S"))
    raise AssertionError(layout)


def as_torch(a, dtype=None):
    """A contiguous torch tensor holding the values of array `a`."""
    import torch

    a = np.ascontiguousarray(a, dtype=dtype or np.asarray(a).dtype.newbyteorder("="))
    return torch.from_numpy(a.copy())


def torch_input(a, rng):
    """`a` as a torch CPU tensor, sometimes a non-contiguous view."""
    import torch

    t = as_torch(a)
    r = rng.random()
    if r < 0.35 and t.dim() >= 2:  # transposed storage
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if r < 0.55 and t.dim() >= 1:  # a strided slice
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    return t


def describe(d):
    """A one-line description of a case's arguments."""
    parts = []
    for k, v in d.items():
        if isinstance(v, np.ndarray):
            parts.append(f"{k}={v.dtype}{tuple(v.shape)}")
        else:
            parts.append(f"{k}={v!r}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------
# The exact result, for float64 cases
# ---------------------------------------------------------------------------


def causal_keep(L, S, causal):
    """(L, S) bool: key j visible to query i (top-left: j <= i; bottom-right:
    j <= i + S - L)."""
    i = np.arange(L)[:, None]
    j = np.arange(S)[None, :]
    return j <= i + (S - L if causal == "bottom-right" else 0)


def sdpa_exact(q, k, v, mask, causal, scale, gqa, out_shape):
    """SDPA from its formula in long double (a 64-bit significand on x86-64,
    2^11 times finer than float64): (out, weights, lse) broadcast to the
    output shapes. Fully masked rows give 0, 0 and -inf."""
    ld = np.longdouble
    q, k, v = (np.asarray(x, dtype=ld) for x in (q, k, v))
    L, E = q.shape[-2:]
    S = k.shape[-2]
    if gqa:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
        v = np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    sc = 1 / np.sqrt(ld(E)) if scale is None else ld(scale)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * sc
    keep = np.ones(s.shape, dtype=bool)
    if mask is not None:
        if mask.dtype == np.bool_:
            keep = keep & mask
        else:
            s = s + np.asarray(mask, dtype=ld)
            keep = keep & (mask != -np.inf)
    if causal:
        keep = keep & causal_keep(L, S, causal)
    s = np.where(keep, s, -np.inf)
    empty = ~keep.any(axis=-1, keepdims=True)
    mx = np.where(empty, 0, s.max(axis=-1, keepdims=True))
    e = np.where(keep, np.exp(s - mx), 0)
    total = e.sum(axis=-1, keepdims=True)
    w = np.where(empty, 0, e / np.where(empty, 1, total))
    out = np.matmul(w, v)
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, mx + np.log(np.where(empty, 1, total)))[..., 0]
    out_shape = tuple(out_shape)
    return (
        np.broadcast_to(out, out_shape),
        np.broadcast_to(w, out_shape[:-1] + (S,)),
        np.broadcast_to(lse, out_shape[:-1]),
    )
