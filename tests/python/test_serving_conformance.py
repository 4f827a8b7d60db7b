"""Serving (issue 14) against the formula in torch float64: the score
modifiers of attn.scaled_dot_product_attention (window_size, alibi_slopes,
softcap, sinks), attn.varlen_attention (packed sequences) and
attn.attention_with_kvcache (contiguous and paged caches, appending), on
random seeded cases and on every kernel path this machine has.

The formula (`formula`, torch float64) is written out with explicit dense
tensors: for query i and key j of a sequence with L queries and S keys,
    x = scale · q_i·k_j
    s = softcap · tanh(x / softcap)             when softcap > 0
    s = s - slope_h · |i + S - L - j|           with ALiBi
    s = s + mask_ij                             float masks
key j takes part iff every bool mask, every float mask (not -inf), the causal
rule (j <= i top-left, j <= i + S - L bottom-right) and the window
(i + S - L - left <= j <= i + S - L + right; -1: unbounded, always aligned
bottom-right) allow it; lse = log(exp(sink_h) + sum_j exp(s_j)); weights
exp(s_j - lse); out = weights @ v. A row that sees no key gives 0 and
lse = sink_h (-inf without sinks). varlen cases are unpacked into their
sequences and kvcache cases gathered row by row through the block table
(after the new rows have been written into a copy of the cache, rounded to
the cache's dtype to nearest even by `round_to`, computed here directly
from the float64 bits, not through float32); each sequence is then one call
of the formula.

kvcache cases also check the caches after the call, bit for bit: the new
rows rounded into place, every other element untouched. Cache rows past
cache_seqlens + Lnew (and unused blocks) hold NaN, so reading one shows;
block-table entries past the rows in use are -1 or any block; sequences may
share full prefix blocks below both their cache_seqlens; caches may be
strided views. attn takes no empty tensors, so "no new rows" (Lnew = 0) is
k = v = None. A torch call of scaled_dot_product_attention returns lse in
float64 (the one its backward uses); a rank-2 call (no batch dims) takes
slopes and sinks of shape (1,) (attn refuses 0-d ones).

Every case runs on every kernel path (attn's _attn.set_isa; with ATTN_ISA in
the environment only on the path it forces, so that the Makefile's per-path
loop, if it lists this file, does not repeat the others). The cases are
drawn from ATTN_TEST_SEED (conformance.SEED), each from its own generator.

Error model
-----------
float32, where torch can compute the same thing (no softcap, no sinks: the
window, causality and masks become an explicit -inf mask and ALiBi a float
bias, which torch's own float32 scaled_dot_product_attention takes): the
conformance suite's rule, max |attn - formula| <= 2 x torch float32's own
max error against the formula + 1e-6 (conformance.py). Weights come from
torch's math kernel and lse from torch.logsumexp, as in
test_sdpa_conformance.py.

float32 with softcap or sinks: torch has no float32 kernel that applies
them, so there is no "torch's own error" to scale from. The bar is then a
first-order bound on the rounding of any float32 evaluation of the formula
(`rounding_floor`, unit roundoff u = 2^-24), element by element, + 1e-6:
each score carries at most
    ds = gamma(E + 3) |scale| sum_e |q_e k_e| (1 - tanh^2)    the dot product
                                                           and scaling, damped
                                                           by the cap's slope
       + K_OPS u (|x| + |bias| + |mask|)                   scaling to base 2,
                                                           the cap's division
                                                           and product, the
                                                           bias's product and
                                                           subtraction, the
                                                           mask's addition
       + C_TANH u softcap                                  tanh itself
       + 2 u |s - max| + C_EXP u                           the subtraction of
                                                           the row's (running)
                                                           maximum and exp
(the sink likewise, without the dot product; max is the row's largest
visible score or sink, so an evaluation that rounds relative to the keys'
maximum alone, far below a dominant sink, is not within it), which moves the output by at
most sum_j w_j ds_j |v_j - out| <= (w ds) @ |v| + |out| sum_j w_j ds_j; the
sums of S terms in the numerator and the denominator, at most one rescaling
per key of both (each a product and an exp) and the final division add
gamma((C_EXP + 3) S + 4) (w @ |v| + |out|). lse: sum_j w_j ds_j +
gamma((C_EXP + 3) S + 4) + K_OPS u |lse|. This is a worst-case bound (like
conformance.py's float64 floor): typical errors are 10-100 times smaller, so
the summary also reports attn's error against torch's float32 evaluation of
the explicit formula (information, not a bar).

float64: max |attn - formula| <= 1e-12 x max |formula| + 2 x the same
first-order floor with u = 2^-53, element by element (attn's rounding and
the formula's own in torch float64; the floor only matters with large
logits). NaN is always a failure, infinities (lse of a row that sees no key
and has no sink) must match exactly.

Gradients (torch autograd through attn.scaled_dot_product_attention with the
modifiers, including d sinks) are compared with the float64 autograd of the
same formula: float32 within 2 x torch's float32 autograd of the formula +
1e-6 m, float64 within 1e-12 m (m: the largest term the gradient sums, the
gradient formula over absolute values, as in test_sdpa_backward.py); and
torch.autograd.gradcheck runs on small float64 shapes.
"""

import collections
import contextlib
import functools
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attn
import conformance as C
from attn import _attn
from test_sdpa_conformance import _gen_sdpa_case

N_SDPA = 480
N_VARLEN = 240
N_KVCACHE = 320
N_GRAD = 36
SDPA_BASE = 500_000  # base cases: test_sdpa_conformance's generator, other indices

F32_FACTOR, F32_SLACK, F64_REL = C.F32_FACTOR, C.F32_SLACK, C.F64_REL
U32, U64 = 2.0**-24, 2.0**-53
K_OPS = 4  # elementwise roundings a score may take after its dot product
C_EXP = 4  # exp2 (attn's polynomial: relative error 1.9e-9 plus Horner's
#            roundings) and the rescale factors, in units of u
C_TANH = 4  # tanh, in units of u x softcap (absolute: an implementation
#             through exp is accurate to u relative to 1, not to tanh(x))
F64 = torch.float64

# ---------------------------------------------------------------------------
# Kernel paths and statistics
# ---------------------------------------------------------------------------


def kernel_paths():
    """Every path this machine runs, or only the one ATTN_ISA forces."""
    if os.environ.get("ATTN_ISA"):
        return [attn.kernel_info()["isa"]]
    return list(_attn.supported_isas())


PATHS = kernel_paths()


@contextlib.contextmanager
def on_path(isa):
    if os.environ.get("ATTN_ISA"):
        yield
        return
    _attn.set_isa(isa)
    try:
        yield
    finally:
        _attn.set_isa("auto")


def _new_stats():
    return {
        "cases": 0, "runs": 0, "checks": 0,
        "ratios": [], "worst_ratio": 0.0, "worst_usage": 0.0,  # float32, torch's rule
        "floor_checks": 0, "worst_floor_usage": 0.0,  # float32, the rounding bound
        "info_ratios": [],  # float32 with the bound: ours / torch's float32 formula
        "worst_rel64": 0.0, "worst_usage64": 0.0,
        "worst_by_path": collections.defaultdict(float),  # largest error / bar per path
    }


STATS = {kind: _new_stats() for kind in ("sdpa", "varlen", "kvcache")}
GRAD_STATS = {"cases": 0, "checks": 0, "worst_usage": 0.0, "gradchecks": 0}


# ---------------------------------------------------------------------------
# The formula, in torch
# ---------------------------------------------------------------------------


def positions(L, S):
    """(L, S) int64: i + S - L - j (the diagonal's offset from key j)."""
    i = torch.arange(L).view(L, 1)
    j = torch.arange(S).view(1, S)
    return i + (S - L) - j


def keep_rule(L, S, causal, window):
    """(L, S) bool: what causality and the window allow."""
    d = positions(L, S)  # i + S - L - j
    keep = torch.ones(L, S, dtype=torch.bool)
    if causal == "top-left":
        keep &= torch.arange(S).view(1, S) <= torch.arange(L).view(L, 1)
    elif causal == "bottom-right":
        keep &= d >= 0
    left, right = window
    if left >= 0:
        keep &= d <= left
    if right >= 0:
        keep &= d >= -right
    return keep


def formula(q, k, v, scale, *, mask=None, causal=None, window=(-1, -1), slopes=None,
            softcap=0.0, sinks=None):
    """The serving formula. q (..., L, E), k (..., S, E), v (..., S, Ev):
    torch tensors of one float dtype (the computation's), batch dimensions
    already expanded to the output's (heads repeated for GQA). mask: None or
    a bool / float tensor broadcastable to (..., L, S). slopes, sinks: None
    or tensors of the batch shape. Differentiable in q, k, v, a float mask
    and sinks. Returns a dict with out, w, lse, keep and what the rounding
    floor needs."""
    L, E = q.shape[-2:]
    S = k.shape[-2]
    bshape = q.shape[:-2]
    dt = q.dtype
    x = (q @ k.transpose(-1, -2)) * scale
    s, t = x, None
    if softcap > 0:
        t = torch.tanh(x / softcap)
        s = softcap * t
    bias = None
    if slopes is not None:
        bias = slopes.to(dt)[..., None, None] * positions(L, S).abs().to(dt)
        s = s - bias
    keep = keep_rule(L, S, causal, window).expand(bshape + (L, S))
    mfin = None
    if mask is not None:
        if mask.dtype == torch.bool:
            keep = keep & mask
        else:
            m = mask.to(dt)
            keep = keep & ~torch.isneginf(m)
            mfin = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=dt))
            s = s + mfin
    ninf = torch.tensor(-math.inf, dtype=dt)
    sm = torch.where(keep, s, ninf)
    empty = ~keep.any(-1)  # rows that see no key
    if sinks is not None:
        sk = sinks.to(dt)[..., None, None].expand(bshape + (L, 1))
        lse = torch.logsumexp(torch.cat([sm, sk], -1), -1)
        lse_safe = lse
    else:
        # A row with no key: logsumexp over zeros instead (finite, so that
        # neither the forward nor autograd meet -inf - -inf), then -inf.
        lse_safe = torch.logsumexp(torch.where(empty[..., None], torch.zeros((), dtype=dt), sm),
                                   -1)
        lse = torch.where(empty, ninf, lse_safe)
    w = torch.where(keep, torch.exp(sm - lse_safe[..., None]), torch.zeros((), dtype=dt))
    out = w @ v
    return dict(out=out, w=w, lse=lse, keep=keep, x=x, t=t, s=s, bias=bias, mfin=mfin,
                sinks=None if sinks is None else sinks.to(dt), q=q, k=k, v=v, scale=scale,
                softcap=softcap)


def _gamma(n, u):
    return n * u / (1 - n * u)


def rounding_floor(r, u):
    """First-order bounds (out, weights, lse) on how far any evaluation of
    the formula with unit roundoff u may land from it (module docstring)."""
    with torch.no_grad():
        q, k, v = (r[n].to(F64) for n in "qkv")
        E, S = q.shape[-1], k.shape[-2]
        keep, w, out, lse = r["keep"], r["w"].to(F64), r["out"].to(F64), r["lse"].to(F64)
        dot = q.abs() @ k.abs().transpose(-1, -2)
        dx = _gamma(E + 3, u) * abs(r["scale"]) * dot
        x, s = r["x"].to(F64), r["s"].to(F64)
        mag = x.abs()
        if r["t"] is not None:
            t = r["t"].to(F64)
            dx = dx * (1 - t * t) + C_TANH * u * r["softcap"]
            mag = mag + s.abs()
        if r["bias"] is not None:
            mag = mag + r["bias"].to(F64).abs()
        if r["mfin"] is not None:
            mag = mag + r["mfin"].to(F64).abs()
        ninf = torch.tensor(-math.inf, dtype=F64)
        if S > 0:
            rowmax = torch.where(keep, s, ninf).amax(-1)
        else:
            rowmax = torch.full(lse.shape, -math.inf, dtype=F64)
        if r["sinks"] is not None:
            sink = r["sinks"].to(F64)[..., None].expand(rowmax.shape)
            rowmax = torch.maximum(rowmax, sink)
        rowmax = torch.where(torch.isfinite(rowmax), rowmax, torch.zeros((), dtype=F64))
        ds = dx + K_OPS * u * mag + 2 * u * (s - rowmax[..., None]).abs() + C_EXP * u
        ds = torch.where(keep, ds, torch.zeros((), dtype=F64))
        wds = w * ds
        spread = wds.sum(-1)
        if r["sinks"] is not None:
            ws = torch.exp(sink - torch.where(torch.isfinite(lse), lse, sink))
            dsink = K_OPS * u * sink.abs() + 2 * u * (sink - rowmax).abs() + C_EXP * u
            spread = spread + ws * dsink
        gs = _gamma((C_EXP + 3) * S + 4, u)
        av = v.abs()
        wav = w @ av
        out_floor = wds @ av + out.abs() * spread[..., None] + gs * (wav + out.abs())
        finite_lse = torch.where(torch.isfinite(lse), lse, torch.zeros((), dtype=F64))
        lse_floor = spread + gs + K_OPS * u * finite_lse.abs()
        w_floor = w * (ds + lse_floor[..., None] + C_EXP * u)
        return out_floor, w_floor, lse_floor


def torch32_kernel(r32):
    """torch's own float32 evaluation where it has a kernel for it: its
    scaled_dot_product_attention with the window, causality, masks and ALiBi
    as one explicit float mask; weights from its math kernel, lse from
    torch.logsumexp (as test_sdpa_conformance.py). `r32`: the problem's
    float32 tensors (q, k, v, scale, keep, bias, mfin as float64)."""
    q, k, v = r32["q"], r32["k"], r32["v"]
    fm = torch.zeros(r32["keep"].shape, dtype=F64)
    if r32["bias"] is not None:
        fm = fm - r32["bias"]
    if r32["mfin"] is not None:
        fm = fm + r32["mfin"]
    fm = torch.where(r32["keep"], fm, torch.tensor(-math.inf, dtype=F64)).to(torch.float32)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=fm, scale=r32["scale"])
    _, w = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, fm, 0.0, False,
                                                             scale=r32["scale"])
    lse = torch.logsumexp((q @ k.transpose(-1, -2)) * r32["scale"] + fm, -1)
    return out, w, lse


def native(a):
    """A C-ordered copy of array `a` in native byte order (np.array: not
    np.ascontiguousarray, which makes 0-d arrays 1-d)."""
    a = np.asarray(a)
    return np.array(a, dtype=a.dtype.newbyteorder("="), order="C")


class Problem:
    """One attention problem (a whole SDPA call, or one sequence of a varlen
    or kvcache call) with its modifiers, as NumPy values in the call's dtype
    (batch dims expanded, GQA heads repeated)."""

    def __init__(self, q, k, v, scale, *, mask=None, causal=None, window=(-1, -1),
                 slopes=None, softcap=0.0, sinks=None):
        self.q, self.k, self.v = q, k, v
        self.scale = float(1.0 / np.sqrt(q.shape[-1])) if scale is None else float(scale)
        self.mask, self.causal, self.window = mask, causal, window
        self.slopes, self.softcap, self.sinks = slopes, float(softcap or 0.0), sinks
        self.expressible = self.softcap == 0.0 and sinks is None

    def _args(self, dtype):
        # np.array(copy): np.ascontiguousarray would make 0-d arrays 1-d
        t = lambda a: None if a is None else torch.from_numpy(native(a)).to(dtype)  # noqa: E731
        mask = self.mask
        if mask is not None:
            mask = torch.from_numpy(native(mask))
            if mask.dtype != torch.bool:
                mask = mask.to(dtype)
        return dict(q=t(self.q), k=t(self.k), v=t(self.v), mask=mask, slopes=t(self.slopes),
                    sinks=t(self.sinks))

    def reference(self, dt):
        """The formula in float64: (out, w, lse), the rounding floors for dt's
        unit roundoff, and the raw tensors."""
        a = self._args(F64)
        r = formula(a["q"], a["k"], a["v"], self.scale, mask=a["mask"], causal=self.causal,
                    window=self.window, slopes=a["slopes"], softcap=self.softcap,
                    sinks=a["sinks"])
        ref = tuple(r[n].numpy() for n in ("out", "w", "lse"))
        floor = tuple(f.numpy() for f in rounding_floor(r, U64 if dt == np.float64 else U32))
        return ref, floor, r

    def torch32(self, r64):
        """torch's float32 results: its kernel when it has one, else its
        float32 evaluation of the formula. Returns ((out, w, lse), kernel?)."""
        a = self._args(torch.float32)
        empty = self.q.shape[-2] == 0 or self.k.shape[-2] == 0
        if self.expressible and not empty:
            r32 = dict(q=a["q"], k=a["k"], v=a["v"], scale=self.scale, keep=r64["keep"],
                       bias=r64["bias"], mfin=r64["mfin"])
            return tuple(x.numpy() for x in torch32_kernel(r32)), True
        r = formula(a["q"], a["k"], a["v"], self.scale, mask=a["mask"], causal=self.causal,
                    window=self.window, slopes=a["slopes"], softcap=self.softcap,
                    sinks=a["sinks"])
        return tuple(r[n].numpy() for n in ("out", "w", "lse")), self.expressible


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


def check(kind, what, ours, ref, *, dtype, isa, ctx, t32=None, kernel=False, floor=None):
    """Asserts the error model (module docstring) for one output."""
    st = STATS[kind]
    where = f"{what} on the {isa} path ({ctx})"
    ours = np.asarray(ours)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"{where}: shape {ours.shape}, expected {ref.shape}"
    o = ours.astype(np.float64)
    assert not np.isnan(o).any(), f"{where}: attn returned NaN"
    assert not np.isnan(ref).any(), f"{where}: the formula has NaN (test bug)"
    inf = np.isinf(ref)
    bad = np.isinf(o) != inf
    bad[inf] |= o[inf] != ref[inf]
    assert not bad.any(), (
        f"{where}: infinities differ from the formula's at {np.argwhere(bad)[:4].tolist()}: "
        f"attn {o[bad][:4]}, formula {ref[bad][:4]}"
    )
    fin = ~inf
    diff = np.abs(o[fin] - ref[fin])
    err = float(np.max(diff, initial=0.0))
    st["checks"] += 1
    if dtype == np.float64:
        size = float(np.max(np.abs(ref[fin]), initial=0.0))
        fl = np.broadcast_to(floor, ref.shape)[fin]
        bar = F64_REL * size + 2 * fl
        usage = float(np.max(diff / np.where(bar > 0, bar, 1.0), initial=0.0))
        st["worst_rel64"] = max(st["worst_rel64"], err / size if size else err)
        st["worst_usage64"] = max(st["worst_usage64"], usage)
        st["worst_by_path"][isa] = max(st["worst_by_path"][isa], usage)
        over = diff - bar
        assert (over <= 0).all(), (
            f"{where}: float64 error {err:.3g} ({err / size if size else err:.3g} relative to "
            f"max |formula| {size:.3g}); the bar is {F64_REL:g} relative + 2 x the float64 "
            f"rounding floor ({fl[np.argmax(over)]:.3g} at the worst element)"
        )
        return
    t = np.asarray(t32, dtype=np.float64)
    assert t.shape == ref.shape
    tfin = fin & np.isfinite(t)
    terr = float(np.max(np.abs(t[tfin] - ref[tfin]), initial=0.0))
    if kernel:
        bar = F32_FACTOR * terr + F32_SLACK
        ratio = err / terr if terr > 0 else (0.0 if err == 0 else float("inf"))
        if terr > 0:
            st["ratios"].append(ratio)
        if np.isfinite(ratio):
            st["worst_ratio"] = max(st["worst_ratio"], ratio)
        st["worst_usage"] = max(st["worst_usage"], err / bar)
        st["worst_by_path"][isa] = max(st["worst_by_path"][isa], err / bar)
        assert err <= bar, (
            f"{where}: float32 error {err:.3g} vs the float64 formula; torch's own float32 "
            f"error is {terr:.3g}, so the bar is {bar:.3g}"
        )
        return
    fl = np.broadcast_to(floor, ref.shape)[fin]
    bar = fl + F32_SLACK
    usage = float(np.max(diff / bar, initial=0.0))
    st["floor_checks"] += 1
    st["worst_floor_usage"] = max(st["worst_floor_usage"], usage)
    st["worst_by_path"][isa] = max(st["worst_by_path"][isa], usage)
    if terr > 0:
        st["info_ratios"].append(err / terr)
    over = diff - bar
    assert (over <= 0).all(), (
        f"{where}: float32 error {err:.3g} vs the float64 formula exceeds the float32 rounding "
        f"bound + {F32_SLACK:g} ({fl[np.argmax(over)]:.3g} + {F32_SLACK:g} at the worst "
        f"element; torch's float32 evaluation of the formula errs by {terr:.3g})"
    )


class PathFailures:
    """Collects the failures of every kernel path, so that a failing case
    names each path it fails on (a path stops at its first failure)."""

    def __init__(self):
        self.messages = []

    @contextlib.contextmanager
    def path(self, isa):
        try:
            yield
        except AssertionError as e:
            self.messages.append(f"[{isa} path] {e}")

    def raise_any(self):
        if self.messages:
            ok = len(PATHS) - len(self.messages)
            raise AssertionError(f"{len(self.messages)} of {len(PATHS)} kernel paths fail "
                                 f"({ok} pass):\n" + "\n".join(self.messages))


# ---------------------------------------------------------------------------
# Drawing the modifiers
# ---------------------------------------------------------------------------

MODIFIERS = ("window", "alibi", "softcap", "sinks")


def draw_modifiers(rng, f, dt, S_hint, slope_shape, sink_shape, allow_none=True, only=None):
    """window, slopes, softcap, sinks for a case: one modifier alone (`only`
    if given), a random combination, or (rarely) none. slope_shape /
    sink_shape: functions drawing the shapes of the slopes and sinks."""
    r = rng.random()
    if only is not None:
        chosen = {only}
        f.add("one_modifier")
    elif r < 0.45:
        chosen = {MODIFIERS[int(rng.integers(0, 4))]}
        f.add("one_modifier")
    elif r < 0.93 or not allow_none:
        n = int(rng.integers(2, 5))
        chosen = set(rng.choice(MODIFIERS, size=n, replace=False).tolist())
        f.add("modifier_combination")
        if n == 4:
            f.add("all_modifiers")
    else:
        chosen = set()
        f.add("no_modifier")
    m = dict(window=None, slopes=None, softcap=None, sinks=None)
    if "window" in chosen:
        def side():
            x = rng.random()
            if x < 0.3:
                return -1
            if x < 0.45:
                return 0
            if x < 0.75:
                return int(rng.integers(1, 5))
            if x < 0.95:
                return int(rng.integers(1, max(S_hint, 1) + 1))
            return int(rng.integers(S_hint + 1, S_hint + 50))
        m["window"] = (side(), side())
        f.add("window")
        f.add("window_unbounded" if m["window"] == (-1, -1) else
              "window_one_sided" if -1 in m["window"] else "window_two_sided")
        if 0 in m["window"]:
            f.add("window_zero")
    if "alibi" in chosen:
        shape = slope_shape()
        H = shape[-1] if shape else 1
        x = rng.random()
        if x < 0.5:  # ALiBi's geometric slopes
            sl = 2.0 ** (-8.0 * (np.arange(H) + 1) / H) * np.ones(shape)
            f.add("alibi_geometric")
        elif x < 0.85:
            sl = rng.uniform(0, 1, shape)
        else:  # any sign, zeros
            sl = rng.uniform(-1, 1, shape) * (rng.random(shape) < 0.8)
            f.add("alibi_any_sign")
        sdt = dt if rng.random() < 0.85 else np.dtype(np.float64)
        if sdt != dt:
            f.add("alibi_float64_slopes")
        m["slopes"] = np.asarray(sl, dtype=sdt)
        f.add("alibi")
        if len(shape) >= 2:
            f.add("alibi_batch_slopes")
    if "softcap" in chosen:
        x = rng.random()
        if x < 0.1:
            m["softcap"] = 0.0  # explicitly off
            f.add("softcap_zero")
        else:
            m["softcap"] = float(rng.choice([rng.uniform(0.05, 0.5), rng.uniform(0.5, 5),
                                             rng.uniform(5, 50)]))
            f.add("softcap")
    if "sinks" in chosen:
        shape = sink_shape()
        x = rng.random()
        if x < 0.6:
            sk = rng.normal(0, 1.5, shape)
        elif x < 0.85:
            sk = rng.uniform(10, 40, shape) * rng.choice([-1, 1], shape)
            f.add("sinks_large")
        else:  # exp(sink) overflows float32 unless the sink joins the max
            sk = rng.uniform(90, 120, shape) * rng.choice([-1, 1], shape)
            f.add("sinks_huge")
        sdt = dt if rng.random() < 0.9 else np.dtype(np.float64)
        m["sinks"] = np.asarray(sk, dtype=sdt)
        f.add("sinks")
    return m


def modifier_kwargs(m, as_tensor=False):
    """The attn keyword arguments of modifiers `m`."""
    kw = {}
    conv = (lambda a: C.as_torch(a)) if as_tensor else (lambda a: a)  # noqa: E731
    if m["window"] is not None:
        kw["window_size"] = m["window"]
    if m["slopes"] is not None:
        kw["alibi_slopes"] = conv(m["slopes"])
    if m["softcap"] is not None:
        kw["softcap"] = m["softcap"]
    if m["sinks"] is not None:
        kw["sinks"] = conv(m["sinks"])
    return kw


def draw_scale(rng, f):
    r = rng.random()
    if r < 0.45:
        return None
    if r < 0.75:
        f.add("scale")
        return float(rng.uniform(0.05, 2.0))
    if r < 0.95:
        f.add("negative_scale")
        return -float(rng.uniform(0.05, 2.0))
    f.add("zero_scale")
    return 0.0


def sub_shape(rng, full, p_one=0.3, p_drop=0.2):
    """A shape broadcastable to `full`: some dims 1, maybe leading dims dropped."""
    shape = [n if rng.random() >= p_one else 1 for n in full]
    if len(shape) > 1 and rng.random() < p_drop:
        shape = shape[int(rng.integers(1, len(shape))):]
    return tuple(shape)


def _np(x):
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def mod_of(m, name, b=None):
    """A modifier's array for batch entry b of a varlen / kvcache call
    (slopes may be (B, H))."""
    a = m[name]
    if a is None:
        return None
    return a[b] if a.ndim == 2 else a


# ---------------------------------------------------------------------------
# attn.scaled_dot_product_attention with the modifiers
# ---------------------------------------------------------------------------


def _out_batch(c):
    bq, bk, bv = (list(c[n].shape[:-2]) for n in ("q", "k", "v"))
    nbo = max(len(bq), len(bk), len(bv))
    pad = lambda b: [1] * (nbo - len(b)) + b  # noqa: E731
    bq, bk, bv = pad(bq), pad(bk), pad(bv)
    if c["gqa"]:
        bk[-1] = bv[-1] = 1
    return tuple(max(x) for x in zip(bq, bk, bv))


def _gen_sdpa_serving(index):
    c = _gen_sdpa_case(SDPA_BASE + index)
    rng = np.random.default_rng([C.SEED, 1401, index])
    f = c["features"]
    c["index"] = index
    ob = _out_batch(c)
    c["out_batch"] = ob
    S = c["k"].shape[-2]

    def mod_shape():
        if not ob:  # no batch dims: one head (attn refuses 0-d slopes and sinks)
            return (1,)
        x = rng.random()
        if x < 0.5:
            return ob[-1:]
        if x < 0.75:
            return ob
        return sub_shape(rng, ob)

    c["mods"] = draw_modifiers(rng, f, c["dtype"], S, mod_shape, mod_shape, allow_none=False)
    return c


@functools.lru_cache(maxsize=None)
def sdpa_serving_case(index):
    c = _gen_sdpa_serving(index)
    rng = c["rng"]
    for name in ("q", "k", "v", "mask"):
        if c[name] is None:
            continue
        if c["use_torch"]:
            c[name + "_in"] = C.torch_input(c[name], rng) if name != "mask" else C.as_torch(
                c["mask"])
        else:
            c[name + "_in"] = C.relayout(c[name], c["layouts"][name], rng)
            c[name] = np.array(c[name + "_in"], copy=True)
    return c


def _expand(a, ob, gqa=False):
    """Array (..., n, m) with its batch dims broadcast to ob (GQA: heads repeated)."""
    b = list(a.shape[:-2])
    b = [1] * (len(ob) - len(b)) + b
    a = a.reshape(tuple(b) + a.shape[-2:])
    if gqa and ob and b[-1] != ob[-1]:
        a = np.repeat(a, ob[-1] // b[-1], axis=-3)
    return np.broadcast_to(a, tuple(ob) + a.shape[-2:])


def _expand_mod(a, ob):
    if a is None:
        return None
    return a.reshape(()) if not ob else np.broadcast_to(a, ob)


def sdpa_problem(c):
    ob, m = c["out_batch"], c["mods"]
    mask = c["mask"]
    if mask is not None:
        mask = np.broadcast_to(mask, tuple(ob) + (c["q"].shape[-2], c["k"].shape[-2]))
    return Problem(_expand(c["q"], ob), _expand(c["k"], ob, c["gqa"]),
                   _expand(c["v"], ob, c["gqa"]), c["scale"], mask=mask, causal=c["causal"],
                   window=m["window"] or (-1, -1), slopes=_expand_mod(m["slopes"], ob),
                   softcap=m["softcap"] or 0.0, sinks=_expand_mod(m["sinks"], ob))


def run_sdpa(c):
    kw = modifier_kwargs(c["mods"], as_tensor=c["use_torch"])
    if c["causal"]:
        kw["causal_alignment"] = c["causal"]
    res = attn.scaled_dot_product_attention(
        c["q_in"], c["k_in"], c["v_in"], attn_mask=c.get("mask_in"),
        is_causal=c["causal"] is not None, scale=c["scale"], enable_gqa=c["gqa"],
        return_weights=c["want_w"], return_lse=c["want_lse"], **kw,
    )
    if not isinstance(res, tuple):
        res = (res,)
    kind = torch.Tensor if c["use_torch"] else np.ndarray
    assert all(type(x) is kind for x in res), [type(x) for x in res]
    res = [_np(x) for x in res]
    out = res.pop(0)
    w = res.pop(0) if c["want_w"] else None
    lse = res.pop(0) if c["want_lse"] else None
    return out, w, lse


def mods_described(m):
    """A case's modifiers as a context line names them."""
    return dict(window=m["window"], alibi_slopes=m["slopes"], softcap=m["softcap"],
                sinks=m["sinks"])


def sdpa_context(c):
    args = {k: c[k] for k in ("q", "k", "v", "mask")}
    args.update({k: c[k] for k in ("causal", "scale", "gqa", "want_w", "want_lse",
                                   "use_torch", "layouts")})
    args.update(mods_described(c["mods"]))
    return f"serving sdpa case {c['index']}, seed {C.SEED}: {C.describe(args)}"


@pytest.mark.parametrize("index", range(N_SDPA), ids=lambda i: f"case{i:04d}")
def test_sdpa_modifiers_match_the_formula(index):
    c = sdpa_serving_case(index)
    ctx = sdpa_context(c)
    results = {}
    for isa in PATHS:
        with on_path(isa):
            results[isa] = run_sdpa(c)
    dt = c["dtype"]
    r = problem_refs(sdpa_problem(c), dt)
    fails = PathFailures()
    for isa, res in results.items():
        with fails.path(isa):
            for n, name in enumerate(("out", "weights", "lse")):
                if res[n] is None:
                    continue
                # (a torch call's lse is float64: the one its backward uses)
                if dt == np.float32 and name != "lse":
                    assert res[n].dtype == np.float32, f"{name}: dtype {res[n].dtype} ({ctx})"
                one = {k: (r[k][n] if r[k] is not None else None)
                       for k in ("ref", "floor", "t32")}
                one["kernel"] = r["kernel"]
                if name == "out":  # (a rank-2 call's out has no batch dims to expand)
                    one = {k: (v.reshape(res[0].shape) if isinstance(v, np.ndarray) else v)
                           for k, v in one.items()}
                check_output("sdpa", name, res[n], one, dt, isa, ctx)
            STATS["sdpa"]["runs"] += 1
    fails.raise_any()
    STATS["sdpa"]["cases"] += 1


# ---------------------------------------------------------------------------
# attn.varlen_attention
# ---------------------------------------------------------------------------


def _seq_len(rng, cap=48):
    r = rng.random()
    if r < 0.08:
        return 0
    if r < 0.2:
        return 1
    return C.pick_len(rng, cap)


def _gen_varlen_case(index):
    rng = np.random.default_rng([C.SEED, 1402, index])
    f = set()
    dt = np.dtype(np.float32 if rng.random() < 0.6 else np.float64)
    f.add(dt.name)
    B = int(rng.integers(1, 7))
    Hkv = int(rng.integers(1, 4))
    g = int(rng.choice([1, 1, 2, 3, 4]))
    Hq = Hkv * g
    if g > 1:
        f.add("gqa")
    E = C.pick_feat(rng, 32)
    Ev = E if rng.random() < 0.4 else C.pick_feat(rng, 32)
    same = rng.random() < 0.3
    lq = [_seq_len(rng) for _ in range(B)]
    lk = list(lq) if same else [_seq_len(rng) for _ in range(B)]
    for a, b in zip(lq, lk):
        if a == 0 or b == 0:
            f.add("empty_sequence")
        if a == 0 and b > 0:
            f.add("empty_q_sequence")
        if b == 0 and a > 0:
            f.add("no_keys_for_queries")
        if a == 1:
            f.add("length_1")
        f.add("L=S" if a == b else "L!=S")
    f.add(f"B={B}" if B <= 2 else "B>2")
    pad_q = int(rng.integers(1, 4)) if rng.random() < 0.15 else 0
    pad_k = int(rng.integers(1, 4)) if rng.random() < 0.15 else 0
    # attn takes no empty tensors: with every sequence empty, rows past them
    pad_q = max(pad_q, 1 - sum(lq))
    pad_k = max(pad_k, 1 - sum(lk))
    if pad_q or pad_k:
        f.add("rows_past_the_last_sequence")
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    max_q = max(lq) + (int(rng.integers(1, 4)) if rng.random() < 0.3 else 0)
    max_k = max(lk) + (int(rng.integers(1, 4)) if rng.random() < 0.3 else 0)
    amp = 1.0
    if rng.random() < 0.06:
        amp = float(np.sqrt(1e4 / np.sqrt(E)))
        f.add("large_logits")
    tq, tk = int(cu_q[-1]) + pad_q, int(cu_k[-1]) + pad_k
    q = (rng.standard_normal((tq, Hq, E)) * amp).astype(dt)
    k = (rng.standard_normal((tk, Hkv, E)) * amp).astype(dt)
    v = rng.standard_normal((tk, Hkv, Ev)).astype(dt)
    causal = bool(rng.random() < 0.5)
    if causal:
        f.add("causal")
    scale = draw_scale(rng, f)

    def slope_shape():
        if rng.random() < 0.3:
            return (B, Hq)
        return (Hq,)

    mods = draw_modifiers(rng, f, dt, max(lk), slope_shape, lambda: (Hq,))
    want_lse = bool(rng.random() < 0.6)
    if want_lse:
        f.add("return_lse")
    explicit_dropout = bool(rng.random() < 0.3)  # dropout_p=0.0 passed
    if explicit_dropout:
        f.add("dropout_p=0")
    use_torch = bool(rng.random() < 0.15)
    layouts = {}
    if use_torch:
        f.add("torch_inputs")
    else:
        for name in ("q", "k", "v"):
            layouts[name] = C.pick_layout(rng)
            f.add(f"layout_{layouts[name]}")
    # q, k, v as views of one (total, Hq + 2 Hkv, E) buffer (a fused QKV
    # projection's output), for self-attention
    packed = (same and not use_torch and E == Ev and pad_q == pad_k
              and rng.random() < 0.6)
    if packed:
        f.add("packed_qkv")
    return dict(index=index, rng=rng, features=f, dtype=dt, q=q, k=k, v=v, cu_q=cu_q,
                cu_k=cu_k, max_q=max_q, max_k=max_k, lq=lq, lk=lk, causal=causal, scale=scale,
                mods=mods, want_lse=want_lse, use_torch=use_torch, layouts=layouts,
                packed=packed, Hq=Hq, explicit_dropout=explicit_dropout)


@functools.lru_cache(maxsize=None)
def varlen_case(index):
    c = _gen_varlen_case(index)
    rng = c["rng"]
    if c["packed"]:
        Hq = c["Hq"]
        qkv = np.concatenate([c["q"], c["k"], c["v"]], axis=1)
        Hkv = c["k"].shape[1]
        c["q_in"], c["k_in"], c["v_in"] = (qkv[:, :Hq], qkv[:, Hq:Hq + Hkv],
                                           qkv[:, Hq + Hkv:])
    elif c["use_torch"]:
        for name in "qkv":
            c[name + "_in"] = C.torch_input(c[name], rng)
    else:
        for name in "qkv":
            c[name + "_in"] = C.relayout(c[name], c["layouts"][name], rng)
            c[name] = np.array(c[name + "_in"], copy=True)
    return c


def run_varlen(c):
    conv = C.as_torch if c["use_torch"] else (lambda a: a)
    kw = modifier_kwargs(c["mods"], as_tensor=c["use_torch"])
    if c["explicit_dropout"]:
        kw["dropout_p"] = 0.0
    res = attn.varlen_attention(
        c["q_in"], c["k_in"], c["v_in"], conv(c["cu_q"]), conv(c["cu_k"]), c["max_q"],
        c["max_k"], softmax_scale=c["scale"], causal=c["causal"],
        return_softmax_lse=c["want_lse"], **kw,
    )
    if not isinstance(res, tuple):
        res = (res,)
    kind = torch.Tensor if c["use_torch"] else np.ndarray
    assert all(type(x) is kind for x in res), [type(x) for x in res]
    res = [_np(x) for x in res]
    return res[0], None, (res[1] if c["want_lse"] else None)


def varlen_context(c):
    args = {k: c[k] for k in ("q", "k", "v")}
    args.update(cu_seqlens_q=c["cu_q"].tolist(), cu_seqlens_k=c["cu_k"].tolist(),
                max_seqlen_q=c["max_q"], max_seqlen_k=c["max_k"])
    args.update({k: c[k] for k in ("causal", "scale", "want_lse", "use_torch", "layouts",
                                   "packed")})
    args.update(mods_described(c["mods"]))
    return f"varlen case {c['index']}, seed {C.SEED}: {C.describe(args)}"


def sequence_problem(q, k, v, scale, causal, m, b, Hq):
    """One sequence: q (L, Hq, E), k (S, Hkv, E), v (S, Hkv, Ev) -> a Problem
    over (Hq, L, .) with heads repeated."""
    g = Hq // k.shape[1]
    qh = np.swapaxes(q, 0, 1)
    kh = np.repeat(np.swapaxes(k, 0, 1), g, axis=0)
    vh = np.repeat(np.swapaxes(v, 0, 1), g, axis=0)
    return Problem(qh, kh, vh, scale, causal="bottom-right" if causal else None,
                   window=m["window"] or (-1, -1), slopes=mod_of(m, "slopes", b),
                   softcap=m["softcap"] or 0.0, sinks=mod_of(m, "sinks", b))


def problem_refs(p, dt):
    """What problem p's outputs are checked against, as a dict of
    (out, weights, lse) triples: ref (the formula), floor (dt's rounding
    floor), t32 (torch float32, for float32 cases) and kernel
    (whether t32 is torch's kernel, so that torch's rule applies)."""
    ref, floor, r64 = p.reference(dt)
    t32, kernel = (None, None)
    if dt == np.float32:
        t32, kernel = p.torch32(r64)
    return dict(ref=ref, floor=floor, t32=t32, kernel=kernel)


def sequences_reference(problems, dt):
    return [problem_refs(p, dt) for p in problems]


def joined(refs, n, axis, stack=False):
    """Output n (0 out, 1 weights, 2 lse) of every part of the sequences'
    problem_refs, concatenated (or stacked) along `axis`: one dict."""
    res = {}
    for part in ("ref", "floor", "t32"):
        xs = [r[part] for r in refs]
        if any(x is None for x in xs):
            res[part] = None
            continue
        xs = [x[n] for x in xs]
        res[part] = np.stack(xs, axis) if stack else np.concatenate(xs, axis)
    res["kernel"] = refs[0]["kernel"]
    return res


def check_output(kind, name, ours, r, dt, isa, ctx):
    """One output of one path against its references r (a dict from
    problem_refs or joined): the error model."""
    check(kind, name, ours, r["ref"], dtype=dt, isa=isa, ctx=ctx, t32=r["t32"],
          kernel=r["kernel"], floor=r["floor"])


@pytest.mark.parametrize("index", range(N_VARLEN), ids=lambda i: f"case{i:04d}")
def test_varlen_matches_the_formula(index):
    c = varlen_case(index)
    ctx = varlen_context(c)
    results = {}
    for isa in PATHS:
        with on_path(isa):
            results[isa] = run_varlen(c)
    dt = c["dtype"]
    cu_q, cu_k, Hq = c["cu_q"], c["cu_k"], c["Hq"]
    B = len(c["lq"])
    problems = [sequence_problem(c["q"][cu_q[b]:cu_q[b + 1]], c["k"][cu_k[b]:cu_k[b + 1]],
                                 c["v"][cu_k[b]:cu_k[b + 1]], c["scale"], c["causal"],
                                 c["mods"], b, Hq) for b in range(B)]
    refs = sequences_reference(problems, dt)
    held = int(cu_q[-1])
    # The formula's (Hq, L, .) per sequence, joined along the rows: held rows
    # only (rows past the last sequence are not written).
    r_out, r_lse = joined(refs, 0, 1), joined(refs, 2, 1)
    fails = PathFailures()
    for isa, (out, _, lse) in results.items():
        with fails.path(isa):
            assert out.shape == (c["q"].shape[0], Hq, c["v"].shape[2]), (out.shape, ctx)
            if dt == np.float32:
                assert out.dtype == np.float32, ctx
            check_output("varlen", "out", np.swapaxes(out[:held], 0, 1), r_out, dt, isa, ctx)
            if c["want_lse"]:
                assert lse.shape == (Hq, c["q"].shape[0]), (lse.shape, ctx)
                check_output("varlen", "lse", lse[:, :held], r_lse, dt, isa, ctx)
            STATS["varlen"]["runs"] += 1
    fails.raise_any()
    STATS["varlen"]["cases"] += 1


# ---------------------------------------------------------------------------
# attn.attention_with_kvcache
# ---------------------------------------------------------------------------

BLOCK_SIZES = (1, 2, 3, 4, 5, 7, 8, 16, 17, 32, 64, 100, 128, 256)


def round_to(x, cache):
    """Float values x rounded to the cache dtype ('float16', 'bfloat16',
    'float32', 'float64') to nearest even, directly from their value (not
    through float32), as float64."""
    x = np.asarray(x)
    if cache in ("float32", "float64"):
        return x.astype(cache).astype(np.float64)
    if cache == "float16":  # NumPy converts float64 -> float16 in one rounding
        return x.astype(np.float16).astype(np.float64)
    bits = np.ascontiguousarray(x, dtype=np.float64).view(np.uint64)
    shift = np.uint64(52 - 7)  # bfloat16 keeps 7 of float64's 52 fraction bits
    lsb = (bits >> shift) & np.uint64(1)
    half = np.uint64((1 << 44) - 1)
    rounded = (bits + half + lsb) & ~np.uint64((1 << 45) - 1)
    return rounded.view(np.float64)


def _near_ties(rng, shape, cache, dt):
    """Values at, just above and just below the midpoint of two neighbours
    of the cache dtype, closer than float32 resolves: rounding through
    float32 first would round them differently."""
    base = rng.standard_normal(shape)
    frac = 10 if cache == "float16" else 7
    e = np.floor(np.log2(np.abs(base)))
    step = 2.0 ** (e - frac)
    lo = np.floor(base / step) * step
    mid = lo + step / 2
    off = rng.choice([-1.0, 0.0, 1.0], shape) * (np.abs(mid) * 2.0**-40 if dt == np.float64
                                                 else 0.0)
    return (mid + off).astype(dt)


def _gen_kvcache_case(index):
    rng = np.random.default_rng([C.SEED, 1403, index])
    f = set()
    dt = np.dtype(np.float32 if rng.random() < 0.6 else np.float64)
    f.add(dt.name)
    r = rng.random()
    cache = dt.name if r < 0.55 else "float16" if r < 0.8 else "bfloat16"
    f.add(f"cache_{cache}" if cache in ("float16", "bfloat16") else "cache_same_dtype")
    use_torch = cache == "bfloat16" or rng.random() < 0.15
    if use_torch:
        f.add("torch_inputs")
    B = int(rng.integers(1, 5))
    Hkv = int(rng.integers(1, 4))
    g = int(rng.choice([1, 1, 2, 4]))
    Hq = Hkv * g
    if g > 1:
        f.add("gqa")
    E = C.pick_feat(rng, 32)
    Ev = E if rng.random() < 0.5 else C.pick_feat(rng, 32)
    r = rng.random()
    Lq = 1 if r < 0.5 else int(rng.integers(2, 9)) if r < 0.85 else int(rng.integers(9, 21))
    f.add("decode" if Lq == 1 else "chunk")
    has_seqlens = rng.random() >= 0.08
    r = rng.random()
    # No new rows: k = v = None (attn takes no empty tensors, so Lnew = 0 is
    # spelled that way).
    if not has_seqlens or r < 0.35:
        mode = "none"
    elif r < 0.75:
        mode = "lq"
    else:
        mode = "random"
    Lnew = {"none": 0, "lq": Lq, "random": int(rng.integers(1, 7))}[mode]
    f.add(f"append_{mode}")

    def cached_len():
        x = rng.random()
        if x < 0.12:
            return 0
        if x < 0.5:
            return int(rng.integers(1, 17))
        if x < 0.92:
            return int(rng.integers(17, 101))
        return int(rng.integers(101, 701))

    cs = [cached_len() for _ in range(B)]
    if any(n == 0 for n in cs):
        f.add("empty_cache")
    if any(n > 100 for n in cs):
        f.add("long_cache")
    paged = rng.random() < 0.55
    f.add("paged" if paged else "contiguous")
    causal = bool(rng.random() < 0.7)
    if causal:
        f.add("causal")
    if any(Lq > n + Lnew for n in cs):
        f.add("L>S")
    scale = draw_scale(rng, f)
    amp = 1.0
    if rng.random() < 0.05:
        amp = float(np.sqrt(1e4 / np.sqrt(E)))
        f.add("large_logits")

    c = dict(index=index, rng=rng, features=f, dtype=dt, cache=cache, use_torch=use_torch,
             B=B, Hkv=Hkv, Hq=Hq, E=E, Ev=Ev, Lq=Lq, Lnew=Lnew, mode=mode,
             has_seqlens=has_seqlens, paged=paged, causal=causal, scale=scale)
    nan = np.nan
    if paged:
        bs = int(rng.choice(BLOCK_SIZES))
        f.add(f"block_size_{bs}" if bs in (1, 256) else "block_size_other")
        if has_seqlens:
            need = [-(-(n + Lnew) // bs) for n in cs]
            max_blocks = max(need + [1]) + int(rng.integers(0, 3))
        else:
            max_blocks = int(rng.integers(1, max(2, 300 // bs) + 1))
            need = [max_blocks] * B
        # Shared prefixes: sequence b reads the first full, unwritten blocks of
        # sequence b - 1 (never a block either writes into).
        share = [0] * B
        if has_seqlens:
            for b in range(1, B):
                common = min(cs[b] // bs, cs[b - 1] // bs)
                if common > 0 and rng.random() < 0.25:
                    share[b] = int(rng.integers(1, common + 1))
                    f.add("shared_prefix_blocks")
        own = sum(n - s for n, s in zip(need, share))
        num_blocks = max(own + int(rng.integers(0, 4)), 1)
        perm = rng.permutation(num_blocks)
        table = np.full((B, max_blocks), -1, dtype=np.int32)
        pad = rng.random()
        if not has_seqlens or pad < 0.5:  # entries past the rows in use: any block
            table[...] = rng.integers(0, num_blocks, (B, max_blocks))
        else:
            f.add("block_table_padding_-1")
        at = 0
        for b in range(B):
            if share[b]:
                table[b, :share[b]] = table[b - 1, :share[b]]
            for p in range(share[b], need[b]):
                table[b, p] = perm[at]
                at += 1
        kshape = (num_blocks, bs, Hkv, E)
        vshape = (num_blocks, bs, Hkv, Ev)
        rows = (lambda b, r: (table[b, r // bs], r % bs))  # noqa: E731
        c.update(block_size=bs, table=table, num_blocks=num_blocks, share=share)
        capacity = max_blocks * bs
    else:
        S_max = max(n + Lnew for n in cs) + int(rng.integers(0, 6))
        S_max = max(S_max, 1)
        kshape, vshape = (B, S_max, Hkv, E), (B, S_max, Hkv, Ev)
        rows = (lambda b, r: (b, r))  # noqa: E731
        capacity = S_max
    if not has_seqlens:
        cs = [capacity] * B
        f.add("no_cache_seqlens")
    kc = np.full(kshape, nan)
    vc = np.full(vshape, nan)
    for b in range(B):
        for r in range(cs[b]):
            blk, row = rows(b, r)
            if paged and share[b] and r < share[b] * c["block_size"]:
                continue  # written by the sequence it shares with
            kc[blk, row] = rng.standard_normal((Hkv, E)) * amp
            vc[blk, row] = rng.standard_normal((Hkv, Ev))
    # Stored in the cache's dtype (values rounded once, to nearest even).
    kc, vc = round_to(kc, cache), round_to(vc, cache)
    c.update(k_cache=kc, v_cache=vc, cs=cs, capacity=capacity)
    c["q"] = (rng.standard_normal((B, Lq, Hq, E)) * amp).astype(dt)
    if mode != "none":
        kn = (rng.standard_normal((B, Lnew, Hkv, E)) * amp).astype(dt)
        vn = rng.standard_normal((B, Lnew, Hkv, Ev)).astype(dt)
        if cache in ("float16", "bfloat16") and Lnew and rng.random() < 0.4:
            sel = rng.random(kn.shape) < 0.3
            kn[sel] = _near_ties(rng, kn.shape, cache, dt)[sel]
            sel = rng.random(vn.shape) < 0.3
            vn[sel] = _near_ties(rng, vn.shape, cache, dt)[sel]
            f.add("rounding_near_ties")
        c["k_new"], c["v_new"] = kn, vn
    else:
        c["k_new"] = c["v_new"] = None
    c["strided_cache"] = rng.random() < 0.2
    if c["strided_cache"]:
        f.add("strided_cache")
    c["new_layouts"] = {n: C.pick_layout(rng) for n in ("q", "k_new", "v_new")}

    def slope_shape():
        return (B, Hq) if rng.random() < 0.3 else (Hq,)

    S_hint = max(n + Lnew for n in cs)
    c["mods"] = draw_modifiers(rng, f, dt, S_hint, slope_shape, lambda: (Hq,))
    c["want_lse"] = bool(rng.random() < 0.6)
    if c["want_lse"]:
        f.add("return_lse")
    return c


TORCH_CACHE = {"float16": torch.float16, "bfloat16": torch.bfloat16,
               "float32": torch.float32, "float64": torch.float64}


def _cache_array(values, c):
    """The cache as attn is given it: the cache dtype, in place; sometimes a
    strided view (one of two interleaved caches)."""
    if c["use_torch"]:
        t = torch.from_numpy(values).to(TORCH_CACHE[c["cache"]])
        if c["strided_cache"]:
            big = torch.full((2,) + tuple(t.shape), float("nan"), dtype=t.dtype)
            big[1] = t
            t = big.movedim(0, -2)[..., 1, :]  # rows interleaved with another cache's
        return t
    a = values.astype(c["cache"])
    if c["strided_cache"]:
        big = np.full(a.shape[:-1] + (2, a.shape[-1]), np.nan, dtype=a.dtype)
        big[..., 1, :] = a
        a = big[..., 1, :]
    return a


def _cache_values(a):
    """A cache (NumPy or torch, any dtype) as a float64 array."""
    if isinstance(a, torch.Tensor):
        return a.to(F64).numpy()
    return np.asarray(a, dtype=np.float64)


def expected_cache(c):
    """The caches after the call: the new rows rounded into place."""
    kc, vc = c["k_cache"].copy(), c["v_cache"].copy()
    if c["k_new"] is None:
        return kc, vc
    kn, vn = round_to(c["k_new"], c["cache"]), round_to(c["v_new"], c["cache"])
    for b in range(c["B"]):
        for r in range(c["Lnew"]):
            pos = c["cs"][b] + r
            if c["paged"]:
                blk, row = c["table"][b, pos // c["block_size"]], pos % c["block_size"]
            else:
                blk, row = b, pos
            kc[blk, row], vc[blk, row] = kn[b, r], vn[b, r]
    return kc, vc


def gathered(c, kc, vc, b):
    """Sequence b's keys and values, rows 0 .. cache_seqlens + Lnew - 1,
    gathered through the block table."""
    S = c["cs"][b] + c["Lnew"]
    if c["paged"]:
        bs = c["block_size"]
        idx = np.arange(S)
        blk = c["table"][b, idx // bs]
        return kc[blk, idx % bs], vc[blk, idx % bs]
    return kc[b, :S], vc[b, :S]


@functools.lru_cache(maxsize=None)
def kvcache_case(index):
    """Case `index`, with q and the new rows in their layouts (the caches are
    made afresh for every call)."""
    c = _gen_kvcache_case(index)
    rng = np.random.default_rng([C.SEED, 1404, c["index"]])
    for name in ("q", "k_new", "v_new"):
        if c[name] is None:
            c[name + "_in"] = None
        elif c["use_torch"]:
            c[name + "_in"] = C.torch_input(c[name], rng)
        else:
            c[name + "_in"] = C.relayout(c[name], c["new_layouts"][name], rng)
            c[name] = native(c[name + "_in"])  # "broadcast" repeats values
    return c


def run_kvcache(c):
    """attn on fresh copies of the caches: (out, lse, k_cache, v_cache after)."""
    kc, vc = _cache_array(c["k_cache"], c), _cache_array(c["v_cache"], c)
    t = c["use_torch"]
    q, kn, vn = c["q_in"], c["k_new_in"], c["v_new_in"]
    kw = modifier_kwargs(c["mods"], as_tensor=t)
    conv = C.as_torch if t else (lambda a: a)
    seqlens = conv(np.asarray(c["cs"], dtype=np.int32)) if c["has_seqlens"] else None
    table = conv(c["table"]) if c["paged"] else None
    res = attn.attention_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=seqlens, block_table=table, softmax_scale=c["scale"],
        causal=c["causal"], return_softmax_lse=c["want_lse"], **kw,
    )
    if not isinstance(res, tuple):
        res = (res,)
    kind = torch.Tensor if t else np.ndarray
    assert all(type(x) is kind for x in res), [type(x) for x in res]
    res = [_np(x) for x in res]
    return res[0], (res[1] if c["want_lse"] else None), _cache_values(kc), _cache_values(vc)


def kvcache_context(c):
    args = {"q": c["q"], "k_cache": c["k_cache"], "v_cache": c["v_cache"],
            "k": c["k_new"], "v": c["v_new"]}
    args.update(cache_dtype=c["cache"], cache_seqlens=c["cs"] if c["has_seqlens"] else None)
    if c["paged"]:
        args.update(block_size=c["block_size"], block_table=c["table"].tolist())
    args.update({k: c[k] for k in ("causal", "scale", "want_lse", "use_torch",
                                   "strided_cache", "new_layouts")})
    args.update(mods_described(c["mods"]))
    return f"kvcache case {c['index']}, seed {C.SEED}: {C.describe(args)}"


@pytest.mark.parametrize("index", range(N_KVCACHE), ids=lambda i: f"case{i:04d}")
def test_kvcache_matches_the_formula(index):
    c = kvcache_case(index)
    ctx = kvcache_context(c)
    results = {}
    for isa in PATHS:
        with on_path(isa):
            results[isa] = run_kvcache(c)
    dt = c["dtype"]
    kc, vc = expected_cache(c)
    fails = PathFailures()
    for isa, (_, _, k_after, v_after) in results.items():
        with fails.path(isa):
            for name, got, want in (("k_cache", k_after, kc), ("v_cache", v_after, vc)):
                same = (got == want) | (np.isnan(got) & np.isnan(want))
                assert same.all(), (
                    f"{name} after the call on the {isa} path differs at "
                    f"{np.argwhere(~same)[:4].tolist()}: {got[~same][:4]} vs {want[~same][:4]} "
                    f"({ctx})"
                )
    fails.raise_any()
    B, Hq = c["B"], c["Hq"]
    problems = []
    for b in range(B):
        kb, vb = gathered(c, kc, vc, b)
        assert not np.isnan(kb).any() and not np.isnan(vb).any(), f"test bug: {ctx}"
        problems.append(sequence_problem(c["q"][b], kb.astype(dt), vb.astype(dt), c["scale"],
                                         c["causal"], c["mods"], b, Hq))
    refs = sequences_reference(problems, dt)
    r_out, r_lse = joined(refs, 0, 0, True), joined(refs, 2, 0, True)
    fails = PathFailures()
    for isa, (out, lse, _, _) in results.items():
        with fails.path(isa):
            assert out.shape == (B, c["Lq"], Hq, c["Ev"]), (out.shape, ctx)
            if dt == np.float32:
                assert out.dtype == np.float32, ctx
            check_output("kvcache", "out", np.swapaxes(out, 1, 2), r_out, dt, isa, ctx)
            if c["want_lse"]:
                assert lse.shape == (B, Hq, c["Lq"]), (lse.shape, ctx)
                check_output("kvcache", "lse", lse, r_lse, dt, isa, ctx)
            STATS["kvcache"]["runs"] += 1
    fails.raise_any()
    STATS["kvcache"]["cases"] += 1


# ---------------------------------------------------------------------------
# Gradients through attn.scaled_dot_product_attention with the modifiers
# ---------------------------------------------------------------------------

TORCH_DT = {np.float32: torch.float32, np.float64: torch.float64}


def _gen_grad_case(index):
    rng = np.random.default_rng([C.SEED, 1405, index])
    f = set()
    # Cases 0-7: each modifier alone, in float32 and in float64.
    dt = np.dtype(np.float32 if (index < 4 if index < 8 else rng.random() < 0.5)
                  else np.float64)
    f.add(dt.name)
    B, Hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    g = int(rng.choice([1, 1, 2, 3]))
    Hq = Hkv * g
    if g > 1:
        f.add("gqa")
    L, S = int(rng.integers(1, 11)), int(rng.integers(1, 13))
    E, Ev = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    r = rng.random()
    causal = None if r < 0.45 else "top-left" if r < 0.75 else "bottom-right"
    if causal:
        f.add(f"causal_{causal}")
    r = rng.random()
    mask = None
    mask_grad = False
    if r >= 0.5:
        shape = (L, S) if rng.random() < 0.5 else sub_shape(rng, (B, Hq, L, S), 0.3, 0.0)
        if r < 0.7:
            mask = rng.random(shape) < 0.8
            f.add("bool_mask")
        else:
            mask = (rng.standard_normal(shape)).astype(dt)
            mask[rng.random(shape) < 0.1] = -np.inf
            mask_grad = bool(rng.random() < 0.7)
            f.add("float_mask")
            if mask_grad:
                f.add("mask_grad")
    scale = draw_scale(rng, f)
    mods = draw_modifiers(rng, f, dt, S,
                          lambda: (B, Hq) if rng.random() < 0.3 else (Hq,), lambda: (Hq,),
                          allow_none=False, only=MODIFIERS[index % 4] if index < 8 else None)
    if index < 8 and mods["window"] == (-1, -1):
        mods["window"] = (1, 2)  # alone, it must window something

    if mods["softcap"] == 0.0:
        mods["softcap"] = 1.5  # a gradient case of its own, not an explicit "off"
        f.discard("softcap_zero")
        f.add("softcap")
    sinks_grad = mods["sinks"] is not None and (index < 8 or rng.random() < 0.85)
    if sinks_grad:
        f.add("sinks_grad")
    q = rng.standard_normal((B, Hq, L, E)).astype(dt)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dt)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dt)
    dout = rng.standard_normal((B, Hq, L, Ev)).astype(dt)
    return dict(index=index, features=f, dtype=dt, q=q, k=k, v=v, dout=dout, mask=mask,
                mask_grad=mask_grad, causal=causal, scale=scale, gqa=g > 1, mods=mods,
                sinks_grad=sinks_grad, B=B, Hq=Hq)


def _grad_names(c):
    return ["q", "k", "v"] + (["mask"] if c["mask_grad"] else []) + (
        ["sinks"] if c["sinks_grad"] else [])


def _leaves(c, dtype):
    """Fresh leaves in `dtype` (float masks and sinks in their own dtype for
    attn; the formula's copies in `dtype`)."""
    x = {n: torch.from_numpy(c[n].copy()).to(dtype).requires_grad_() for n in "qkv"}
    if c["mask"] is not None:
        m = torch.from_numpy(c["mask"].copy())
        if m.dtype != torch.bool:
            m = m.to(dtype).requires_grad_(c["mask_grad"])
        x["mask"] = m
    if c["mods"]["sinks"] is not None:
        x["sinks"] = torch.from_numpy(c["mods"]["sinks"].copy()).to(dtype).requires_grad_(
            c["sinks_grad"])
    return x


def attn_grads(c):
    dt = TORCH_DT[c["dtype"].type]
    x = _leaves(c, dt)
    kw = modifier_kwargs(dict(c["mods"], sinks=None), as_tensor=True)
    if "sinks" in x:
        kw["sinks"] = x["sinks"]
    if c["causal"]:
        kw["causal_alignment"] = c["causal"]
    out = attn.scaled_dot_product_attention(
        x["q"], x["k"], x["v"], attn_mask=x.get("mask"), is_causal=c["causal"] is not None,
        scale=c["scale"], enable_gqa=c["gqa"], **kw)
    names = _grad_names(c)
    g = torch.autograd.grad(out, [x[n] for n in names], torch.from_numpy(c["dout"]))
    return out.detach().numpy(), {n: t.numpy() for n, t in zip(names, g)}


def formula_grads(c, dtype):
    """Autograd of the formula in `dtype`, and the magnitudes m of the terms
    each gradient element sums (float64)."""
    x = _leaves(c, dtype)
    Hq, B = c["Hq"], c["B"]
    g = Hq // c["k"].shape[1]
    k = x["k"].repeat_interleave(g, dim=1)
    v = x["v"].repeat_interleave(g, dim=1)
    m = c["mods"]
    slopes = None if m["slopes"] is None else torch.from_numpy(
        np.broadcast_to(m["slopes"], (B, Hq)).copy()).to(dtype)
    sinks = None if "sinks" not in x else x["sinks"].expand(B, Hq)
    mask = x.get("mask")
    scale = float(1.0 / np.sqrt(c["q"].shape[-1])) if c["scale"] is None else c["scale"]
    r = formula(x["q"], k, v, scale, mask=mask, causal=c["causal"],
                window=m["window"] or (-1, -1), slopes=slopes, softcap=m["softcap"] or 0.0,
                sinks=sinks)
    names = _grad_names(c)
    dout = torch.from_numpy(c["dout"]).to(dtype)
    grads = torch.autograd.grad(r["out"], [x[n] for n in names], dout)
    res = {n: t.detach().to(F64).numpy() for n, t in zip(names, grads)}
    if dtype != F64:
        return res, None
    with torch.no_grad():  # the gradient formula over absolute values
        w = r["w"]
        ad, av, aq, ak = dout.abs(), v.abs(), x["q"].abs(), k.abs()
        dp = ad @ av.transpose(-1, -2)
        dsm = w * (dp + (w * dp).sum(-1, keepdim=True))
        dxm = dsm * (1 - r["t"] ** 2) if r["t"] is not None else dsm
        mags = {"q": abs(scale) * dxm @ ak, "k": abs(scale) * dxm.transpose(-1, -2) @ aq,
                "v": w.transpose(-1, -2) @ ad, "mask": dsm}
        if "sinks" in x:
            ws = torch.exp(r["sinks"][..., None] - r["lse"])  # (B, Hq, L)
            mags["sinks"] = (ws * (ad * (w @ av)).sum(-1)).sum((0, 2))
        size = {}
        for n in names:
            a = mags[n]
            if n in ("k", "v") and g > 1:
                a = a.reshape(B, Hq // g, g, *a.shape[2:]).sum(2)
            if n == "mask":
                shape = c["mask"].shape
                lead = a.dim() - len(shape)
                a = a.sum(tuple(range(lead))) if lead else a
                axes = tuple(d for d, s in enumerate(shape) if s == 1 and a.shape[d] > 1)
                a = a.sum(axes, keepdim=True) if axes else a
            size[n] = float(a.max()) if a.numel() else 0.0
    return res, size


def check_grad(name, ours, ref, own, size, dtype, isa, ctx, stats=None):
    """One gradient against the formula's (the error model above); counted
    in `stats` (default: this module's GRAD_STATS)."""
    stats = GRAD_STATS if stats is None else stats
    assert ours.shape == ref.shape, f"d{name}: shape {ours.shape}, expected {ref.shape} ({ctx})"
    assert np.isfinite(ours).all(), f"d{name} on the {isa} path is not finite ({ctx})"
    err = float(np.max(np.abs(ours - ref), initial=0.0))
    if dtype == np.float64:
        bar = F64_REL * size
        what = f"{F64_REL:g} x {size:.3g}"
    else:
        terr = float(np.max(np.abs(own - ref), initial=0.0))
        bar = F32_FACTOR * terr + 1e-6 * size
        what = f"2 x torch float32's own error {terr:.3g} + 1e-6 x {size:.3g}"
    stats["checks"] += 1
    if bar > 0:
        stats["worst_usage"] = max(stats["worst_usage"], err / bar)
    assert err <= bar, (
        f"d{name} on the {isa} path: error {err:.3g} against the float64 formula's autograd "
        f"(terms up to {size:.3g}); the bar is {what} = {bar:.3g} ({ctx})"
    )


def grad_context(c):
    args = {k: c[k] for k in ("q", "k", "v", "mask")}
    args.update({k: c[k] for k in ("causal", "scale", "gqa", "mask_grad", "sinks_grad")})
    args.update(mods_described(c["mods"]))
    return f"gradient case {c['index']}, seed {C.SEED}: {C.describe(args)}"


@pytest.mark.parametrize("index", range(N_GRAD), ids=lambda i: f"case{i:03d}")
def test_gradients_match_the_formula(index):
    c = _gen_grad_case(index)
    ctx = grad_context(c)
    ref, size = formula_grads(c, F64)
    own = formula_grads(c, torch.float32)[0] if c["dtype"] == np.float32 else None
    fails = PathFailures()
    for isa in PATHS:
        with on_path(isa):
            _, ours = attn_grads(c)
        with fails.path(isa):
            for n in _grad_names(c):
                check_grad(n, ours[n], ref[n], None if own is None else own[n], size[n],
                           c["dtype"], isa, ctx)
    fails.raise_any()
    GRAD_STATS["cases"] += 1


GRADCHECK = {
    "window": dict(window=(2, 1)),
    "window_causal_top_left": dict(window=(1, -1), causal="top-left"),
    "window_right_only": dict(window=(-1, 0)),
    "alibi_float_mask": dict(alibi=(None,), mask=True),
    "alibi_batch_gqa_bottom_right": dict(alibi=(2,), gqa=True, causal="bottom-right"),
    "softcap": dict(softcap=0.7),
    "softcap_negative_scale": dict(softcap=5.0, scale=-1.3),
    "sinks": dict(sinks=True),
    "sinks_rows_without_keys": dict(sinks=True, causal="bottom-right", L=6, S=3),
    "sinks_window_empty_rows": dict(sinks=True, window=(0, 0), L=6, S=2),
    "everything": dict(window=(3, 2), alibi=(None,), softcap=3.0, sinks=True, gqa=True,
                       mask=True, causal="bottom-right"),
}


@pytest.mark.parametrize("name", list(GRADCHECK))
def test_gradcheck(name):
    import zlib

    o = GRADCHECK[name]
    rng = np.random.default_rng([C.SEED, 1407, zlib.crc32(name.encode())])
    B, Hkv = 2, 2
    Hq = 4 if o.get("gqa") else 2
    L, S = o.get("L", 4), o.get("S", 5)
    leaf = lambda *shape: torch.from_numpy(rng.standard_normal(shape)).requires_grad_()  # noqa
    inputs = [leaf(B, Hq, L, 3), leaf(B, Hkv, S, 3), leaf(B, Hkv, S, 2)]
    kw = dict(scale=o.get("scale"), enable_gqa=bool(o.get("gqa")))
    if o.get("causal"):
        kw.update(is_causal=True, causal_alignment=o["causal"])
    if "window" in o:
        kw["window_size"] = o["window"]
    if "alibi" in o:
        shape = (B, Hq) if o["alibi"][0] else (Hq,)
        kw["alibi_slopes"] = torch.from_numpy(rng.uniform(0.1, 1.0, shape))
    if "softcap" in o:
        kw["softcap"] = o["softcap"]
    has_mask, has_sinks = bool(o.get("mask")), bool(o.get("sinks"))
    if has_mask:
        inputs.append(leaf(L, S))
    if has_sinks:
        inputs.append(leaf(Hq))

    def f(*xs):
        xs = list(xs)
        q, k, v = xs[:3]
        mask = xs[3] if has_mask else None
        sinks = xs[-1] if has_sinks else None
        return attn.scaled_dot_product_attention(q, k, v, mask, sinks=sinks, **kw)

    for isa in PATHS:
        with on_path(isa):
            assert torch.autograd.gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-8, rtol=1e-6), isa
    GRAD_STATS["gradchecks"] += 1


# ---------------------------------------------------------------------------
# Coverage: every modifier, layout and combination the suite promises
# ---------------------------------------------------------------------------

# Each floor is well below its expected count (by more than 5 standard
# deviations), so any seed meets them.
REQUIRED = {
    "sdpa": (_gen_sdpa_serving, N_SDPA, {
        "float32": 260, "float64": 115, "one_modifier": 159, "modifier_combination": 211,
        "all_modifiers": 45, "window": 199, "window_one_sided": 62, "window_two_sided": 77,
        "window_zero": 32, "alibi": 195, "alibi_geometric": 76, "alibi_batch_slopes": 26,
        "alibi_any_sign": 8, "softcap": 171, "softcap_zero": 1, "sinks": 200, "sinks_large": 26,
        "sinks_huge": 9, "causal_top-left": 95, "causal_bottom-right": 51, "causal+mask": 92,
        "causal_L>S": 62, "gqa": 40, "bool_mask_rank2": 7, "float_mask_rank4": 2,
        "mask_broadcast": 116, "fully_masked_rows": 40, "negative_scale": 53, "zero_scale": 1,
        "large_logits": 8, "rank2": 32, "rank5": 51, "broadcast_batch": 209,
        "return_weights": 159, "return_lse": 114, "torch_inputs": 23, "layout_transposed": 129,
        "layout_strided": 132, "layout_permuted": 84, "layout_reversed": 83,
        "layout_broadcast": 84, "layout_misaligned": 19, "layout_byteswapped": 13, "L<S": 163,
        "L>S": 163, "L=1": 21, "S=1": 21, "E=1": 14,
    }),
    "varlen": (_gen_varlen_case, N_VARLEN, {
        "float32": 106, "float64": 57, "one_modifier": 70, "modifier_combination": 75,
        "no_modifier": 1, "window": 72, "window_zero": 5, "alibi": 73, "alibi_batch_slopes": 6,
        "softcap": 62, "sinks": 74, "sinks_huge": 1, "causal": 80, "gqa": 105,
        "empty_sequence": 52, "empty_q_sequence": 10, "no_keys_for_queries": 9, "length_1": 89,
        "L=S": 85, "L!=S": 127, "B>2": 122, "rows_past_the_last_sequence": 37,
        "negative_scale": 17, "return_lse": 105, "torch_inputs": 9, "packed_qkv": 1,
        "layout_transposed": 41, "layout_strided": 41, "layout_permuted": 22, "large_logits": 1,
        "dropout_p=0": 36,
    }),
    "kvcache": (_gen_kvcache_case, N_KVCACHE, {
        "float32": 146, "float64": 86, "cache_same_dtype": 131, "cache_float16": 41,
        "cache_bfloat16": 28, "paged": 131, "contiguous": 99, "block_size_1": 1,
        "block_size_256": 1, "block_size_other": 107, "shared_prefix_blocks": 1,
        "block_table_padding_-1": 43, "decode": 114, "chunk": 116, "append_none": 82,
        "append_lq": 76, "append_random": 36, "no_cache_seqlens": 1, "empty_cache": 45,
        "long_cache": 24, "rounding_near_ties": 7, "strided_cache": 27, "gqa": 113,
        "causal": 184, "L>S": 25, "one_modifier": 98, "modifier_combination": 110,
        "window": 108, "alibi": 105, "alibi_batch_slopes": 13, "softcap": 95, "sinks": 106,
        "sinks_huge": 1, "negative_scale": 27, "return_lse": 148, "torch_inputs": 61,
        "large_logits": 1,
    }),
    "gradients": (_gen_grad_case, N_GRAD, {  # cases 0-7: each modifier alone, both dtypes
        "float32": 4, "float64": 4, "one_modifier": 8, "window": 2, "alibi": 2, "softcap": 2,
        "sinks": 2, "sinks_grad": 2, "modifier_combination": 1,
    }),
}


@pytest.mark.parametrize("kind", list(REQUIRED))
def test_cases_cover_every_modifier_and_layout(kind):
    gen, n, required = REQUIRED[kind]
    counts = collections.Counter()
    for i in range(n):
        counts.update(gen(i)["features"])
    short = {k: (counts[k], m) for k, m in required.items() if counts[k] < m}
    assert not short, f"{kind}: features drawn too rarely (count, required): {short}"


# ---------------------------------------------------------------------------
# The summary (conftest.py prints it)
# ---------------------------------------------------------------------------


def summary_lines():
    """Lines for the run's summary: cases, checks and the accuracy seen."""
    lines = []
    for kind in ("sdpa", "varlen", "kvcache"):
        s = STATS[kind]
        if not s["cases"]:
            continue
        paths = ", ".join(f"{isa} {100 * u:.0f}%" for isa, u in sorted(s["worst_by_path"].items()))
        lines.append(
            f"  serving {kind}: {s['cases']} cases x {len(PATHS)} kernel paths = {s['runs']} runs, "
            f"{s['checks']} outputs checked; most of a bar used per path: {paths}"
        )
        lines.append(
            f"    float32 with torch's kernel (bar: 2 x torch + 1e-6): ours/torch median "
            f"{C.median(s['ratios']):.3g}, worst {s['worst_ratio']:.3g}, at most "
            f"{100 * s['worst_usage']:.0f}% of the bar; float32 softcap/sinks (bar: the float32 "
            f"rounding bound + 1e-6): {s['floor_checks']} checks, at most "
            f"{100 * s['worst_floor_usage']:.0f}% of the bar, ours/torch's float32 formula "
            f"median {C.median(s['info_ratios']):.3g}, worst "
            f"{max(s['info_ratios'], default=float('nan')):.3g}; float64: worst relative error "
            f"{s['worst_rel64']:.3g}, at most {100 * s['worst_usage64']:.0f}% of the bar"
        )
    g = GRAD_STATS
    if g["cases"] or g["gradchecks"]:
        lines.append(
            f"  serving gradients: {g['cases']} cases, {g['checks']} gradients checked on "
            f"{len(PATHS)} kernel paths (at most {100 * g['worst_usage']:.0f}% of the bar used); "
            f"{g['gradchecks']} float64 gradchecks"
        )
    return lines
