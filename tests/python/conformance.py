"""Random cases, PyTorch references and the error model of attn's conformance
suite.

Every case is drawn from its own generator, seeded with (SEED, kind, index),
so one case can be rerun alone and a run is repeated exactly by its seed.

Error model
-----------
float32: attn's max abs error against PyTorch in float64 (on the same float32
inputs, upcast exactly) must be at most 2 x PyTorch's own float32 error
against that reference, plus 1e-6.
float64 (MHA): attn's max abs error against PyTorch in float64 must be at
most 1e-12 x the largest magnitude of the reference (norm-wise relative).
float64 (SDPA): there is also an exact result (`sdpa_exact`: the formula in long
double, whose 64-bit significand is 2^11 times finer than float64's), and
attn must be within 1e-12 relative of it. Large logits make that bar
unreachable for *any* float64 evaluation: a score of magnitude 1e4 cannot be
held closer than ~1e-12 in float64, and the softmax passes that on to the
output. So each element's bar also carries the first-order effect of the
rounding every float64 evaluation makes — the standard worst-case bound
for the dot products and sums (Higham, Accuracy and Stability of Numerical
Algorithms, 3.1), propagated through softmax with the exact weights
(`sdpa_exact` computes it per element). Without large logits it is about 1%
of 1e-12 x max |out| (at most about its size); with |q.k| ~ 1e4 it is
10-300 times larger, as a worst-case bound is. The summary reports how many
checks actually needed it (so far: none). Against
PyTorch's float64 result the bar adds PyTorch's own measured deviation from
the exact result (PyTorch rounds too), and the run counts those as well.
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
        "floor_used": 0,  # float64 checks that needed the rounding floor
        "allowance_used": 0,  # float64 checks that needed PyTorch's own error
    }
    for kind in ("sdpa", "mha", "encoder", "half", "mha_half")
}


class ErrorTally:
    """Sums of squared errors of attn's results and of torch's, against the
    same reference, per key (a dtype), over the cases a run checks: the RMS
    ratio the 16-bit suites hold attn to, where one case's largest error is
    too noisy a statistic on its own."""

    def __init__(self):
        self.sums = {}

    def add(self, key, ours, ref, theirs):
        o, r, t = (np.asarray(x, dtype=np.float64) for x in (ours, ref, theirs))
        fin = np.isfinite(r) & np.isfinite(t)
        s = self.sums.setdefault(key, [0.0, 0.0])
        s[0] += float(np.sum((o[fin] - r[fin]) ** 2))
        s[1] += float(np.sum((t[fin] - r[fin]) ** 2))

    def ratio(self, key):
        """attn's RMS error / torch's, or None when no case of `key` ran."""
        ours, theirs = self.sums.get(key, (0.0, 0.0))
        return (ours / theirs) ** 0.5 if theirs > 0 else None


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


def check_close(kind, what, ours, ref64, torch32=None, *, exact=None, floor=None, context=""):
    """Asserts the error model for one output. `ref64` is PyTorch's float64
    result; `torch32` is PyTorch's float32 result for float32 cases (None for
    float64 cases); `exact` an optional long-double result for float64 cases
    and `floor` its element-wise float64 rounding bound.
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
        if exact is None:
            assert err <= F64_REL * size, (
                f"{where}: float64 error {err:.3g} is {rel:.3g} relative to max |torch| "
                f"{size:.3g}; the bar is {F64_REL:g}"
            )
            return rel
        x = np.asarray(exact, dtype=np.longdouble)
        fl = np.broadcast_to(np.asarray(floor, dtype=np.float64), x.shape)[fin]
        assert x.shape == ref.shape and np.array_equal(np.isinf(x), inf)
        xsize = _max_abs(x[fin])
        xdiff = np.abs(o[fin] - x[fin]).astype(np.float64)
        xerr = float(np.max(xdiff, initial=0.0))
        stats["worst_exact64"] = max(stats["worst_exact64"], xerr / xsize if xsize else xerr)
        if xerr > F64_REL * xsize:
            stats["floor_used"] += 1
        over = xdiff - (F64_REL * xsize + fl)
        assert (over <= 0).all(), (
            f"{where}: float64 error {xerr:.3g} against the exact result, "
            f"{xerr / xsize if xsize else xerr:.3g} relative; the bar is {F64_REL:g} relative "
            f"plus the float64 rounding floor (at the worst element {fl[np.argmax(over)]:.3g})"
        )
        tdiff = np.abs(ref[fin] - x[fin]).astype(np.float64)  # PyTorch's own error
        if err > F64_REL * size:
            stats["allowance_used"] += 1
        over = np.abs(o[fin] - ref[fin]) - (F64_REL * size + fl + tdiff)
        assert (over <= 0).all(), (
            f"{where}: float64 error {err:.3g} is {rel:.3g} relative to max |torch| {size:.3g}; "
            f"the bar is {F64_REL:g} relative + the rounding floor + torch's own error"
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


U64 = 2.0**-53  # float64's unit roundoff


def _gamma(n):
    return n * U64 / (1 - n * U64)


def sdpa_exact(q, k, v, mask, causal, scale, gqa, out_shape):
    """SDPA from its formula in long double (a 64-bit significand on x86-64,
    2^11 times finer than float64), with fully masked rows giving 0, 0 and
    -inf. Returns ((out, weights, lse), (out_floor, weights_floor, lse_floor)),
    broadcast to the output shapes. The floors bound, to first order, how far
    any float64 evaluation of the formula may land from the exact result:
    each score s = scale * q.k (+ mask) carries at most
        ds = gamma(E + 3) |scale| sum_e |q_e k_e| + u (|s| + |mask|)
    (dot product in any summation order, the scaling, the mask add), which
    moves a weight by at most w_j (ds_j + sum_k w_k ds_k), the log-sum-exp by
    sum_j w_j ds_j, and an output by sum_j w_j ds_j |v_j - out| <=
    (w ds) @ |v| + |out| sum_j w_j ds_j, plus gamma(S + 2) (w @ |v|) for the
    normalisation and the weighted sum."""
    ld = np.longdouble
    q, k, v = (np.asarray(x, dtype=ld) for x in (q, k, v))
    L, E = q.shape[-2:]
    S = k.shape[-2]
    if gqa:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
        v = np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    sc = 1 / np.sqrt(ld(E)) if scale is None else ld(scale)
    dot = np.matmul(q, np.swapaxes(k, -1, -2))
    s = dot * sc
    ds = _gamma(E + 3) * abs(float(sc)) * np.matmul(np.abs(q), np.swapaxes(np.abs(k), -1, -2))
    ds = ds.astype(np.float64) + U64 * np.abs(s).astype(np.float64)
    keep = np.ones(s.shape, dtype=bool)
    if mask is not None:
        if mask.dtype == np.bool_:
            keep = keep & mask
        else:
            m = np.asarray(mask, dtype=ld)
            s = s + m
            keep = keep & (mask != -np.inf)
            ds = ds + U64 * np.where(np.isfinite(m), np.abs(m), 0).astype(np.float64)
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

    w64, av = w.astype(np.float64), np.abs(v).astype(np.float64)
    wds = w64 * np.where(keep, ds, 0)
    spread = wds.sum(axis=-1, keepdims=True)  # sum_j w_j ds_j
    out_floor = wds @ av + np.abs(out).astype(np.float64) * spread + _gamma(S + 2) * (w64 @ av)
    w_floor = wds + w64 * spread + 2 * U64 * w64
    lse_floor = spread[..., 0] + 2 * U64 * np.where(empty[..., 0], 0, np.abs(lse)).astype(np.float64)
    out_shape = tuple(out_shape)
    wshape, lshape = out_shape[:-1] + (S,), out_shape[:-1]
    return (
        (np.broadcast_to(out, out_shape), np.broadcast_to(w, wshape), np.broadcast_to(lse, lshape)),
        (np.broadcast_to(out_floor, out_shape), np.broadcast_to(w_floor, wshape),
         np.broadcast_to(lse_floor, lshape)),
    )
