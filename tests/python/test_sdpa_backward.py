"""attn's SDPA gradients (attn_sdpa_backward through the autograd of
attn.scaled_dot_product_attention) against torch's autograd, on random
cases covering every option.

The cases are the forward conformance suite's (test_sdpa_conformance.py:
dtypes, ranks, broadcast batch dims, GQA, bool/float masks of every rank
with broadcasting, -inf entries and fully masked rows, both causal
alignments, scales of every sign, large logits), plus, drawn from a second
generator per case: dropout (with a seed), moderate logits (|q.k| ~ 1e2:
float32 on the fused path, where the rounding of the lse the weights are
recomputed from would show), which inputs require grad, and
the memory layout of each torch input (transposed, permuted, strided,
expanded with zero strides). Gradients are taken with respect to the very
tensors attn was given (torch.autograd.grad on the views), so they are
attn's own dq/dk/dv/dmask, summed over whatever their input was broadcast
to.

Error model, per gradient tensor, with m the largest magnitude of the terms
its elements sum (the gradient formula over absolute values: a gradient can
be 0 by cancellation, e.g. dq when a row sees a single key, while every
evaluation rounds terms of size m):
  float32: max |attn - torch float64| <= 2 x torch float32's own max error
           against torch float64 + 1e-6 m
  float64: max |attn - exact| <= 2 x torch float64's own max error against
           exact + 1e-12 m
where "exact" is the formula's gradient in long double (conformance.py's
reasoning: a 64-bit significand, 2^11 times finer than float64). Dropout
cases compare against the same formula evaluated with attn's own keep mask
(read from the weights of the same call with q = 0, which are nonzero
exactly where a key is kept; see keep_mask): torch cannot replay attn's
Philox stream.
"""

import collections
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attn
import conformance as C
from test_sdpa_conformance import _gen_sdpa_case

N_BACKWARD = 500
F32_REL_FLOOR = 1e-6
F64_REL_FLOOR = 1e-12
TORCH_LAYOUTS = ("contiguous", "transposed", "permuted", "strided", "expanded")
TORCH_LAYOUT_P = (0.4, 0.2, 0.15, 0.15, 0.1)
GRAD_STATS = {"checks": 0, "worst_usage": 0.0}


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


def _expand_values(a, rng):
    """`a` with its values repeated along one dimension of size > 1, and
    that dimension: what an expanded (zero-stride) view holds."""
    dims = [d for d in range(a.ndim) if a.shape[d] > 1]
    if not dims:
        return a, None
    d = int(rng.choice(dims))
    return np.broadcast_to(a.take([0], axis=d), a.shape).copy(), d


def torch_view(a, layout, dim, dtype, rng):
    """A tensor holding array `a` in `layout`, in `dtype`, requiring grad
    unless it is bool. Returns the view attn is given (not a leaf for the
    non-contiguous layouts: gradients are taken with respect to it)."""
    base = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
    grad = dtype != torch.bool
    if layout == "expanded" and dim is not None:
        leaf = base.narrow(dim, 0, 1).clone().requires_grad_(grad)
        return leaf.expand(base.shape)
    if layout == "transposed" and base.dim() >= 2:
        leaf = base.transpose(-1, -2).contiguous().requires_grad_(grad)
        return leaf.transpose(-1, -2)
    if layout == "permuted" and base.dim() >= 2:
        perm = [int(x) for x in rng.permutation(base.dim())]
        inv = [int(x) for x in np.argsort(perm)]
        leaf = base.permute(perm).contiguous().requires_grad_(grad)
        return leaf.permute(inv)
    if layout == "strided":
        big = torch.zeros(*base.shape[:-1], 2 * base.shape[-1], dtype=dtype)
        big[..., ::2] = base
        return big.requires_grad_(grad)[..., ::2]
    return base.clone().requires_grad_(grad)


def _gen_backward_case(index):
    c = _gen_sdpa_case(index)
    rng = np.random.default_rng([C.SEED, 7, index])
    f = set(c["features"]) - {f for f in c["features"] if f.startswith("layout_")}
    f -= {"torch_inputs", "return_weights", "return_lse"}
    c["features"] = f
    c["dropout_p"] = float(rng.uniform(0.1, 0.7)) if rng.random() < 0.25 else 0.0
    c["seed"] = int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2))  # any uint64
    if c["dropout_p"]:
        f.add("dropout")
    if "large_logits" not in f and rng.random() < 0.1:  # |q . k| ~ 1e2: float32 on the fused path
        amp = float(np.sqrt(1e2 / np.sqrt(c["q"].shape[-1])))
        c["q"], c["k"] = (c[n] * c["dtype"].type(amp) for n in ("q", "k"))
        f.add("moderate_logits")
    names = ["q", "k", "v"] + (["mask"] if c["mask"] is not None else [])
    c["needs"] = {n: bool(rng.random() < 0.85) for n in ("q", "k", "v")}
    if not any(c["needs"].values()):
        c["needs"]["v"] = True
    if not all(c["needs"].values()):
        f.add("some_inputs_without_grad")
    c["mask_grad"] = c["mask"] is not None and c["mask"].dtype != np.bool_ and rng.random() < 0.85
    if c["mask_grad"]:
        f.add("mask_grad")
    c["torch_layouts"] = {}
    for n in names:
        layout = str(rng.choice(TORCH_LAYOUTS, p=TORCH_LAYOUT_P))
        c["torch_layouts"][n] = layout
        f.add(f"tlayout_{layout}")
        dim = None
        if layout == "expanded":
            c[n], dim = _expand_values(c[n], rng)
        c[n + "_dim"] = dim
    c["rng"] = rng
    return c


@functools.lru_cache(maxsize=None)
def backward_case(index):
    c = _gen_backward_case(index)
    out_shape = _out_shape(c)
    c["dout"] = c["rng"].standard_normal(out_shape).astype(c["dtype"])
    return c


def _out_shape(c):
    bq, bk, bv = (list(c[n].shape[:-2]) for n in ("q", "k", "v"))
    nbo = max(len(bq), len(bk), len(bv))
    pad = lambda b: [1] * (nbo - len(b)) + b  # noqa: E731
    if c["gqa"]:
        bk, bv = bk[:-1] + [1], bv[:-1] + [1]
    out_b = [max(x) for x in zip(pad(bq), pad(bk), pad(bv))]
    return tuple(out_b) + (c["q"].shape[-2], c["v"].shape[-1])


def case_context(c):
    args = {k: c[k] for k in ("q", "k", "v", "mask")}
    args.update({k: c[k] for k in ("causal", "scale", "gqa", "dropout_p", "needs", "mask_grad",
                                   "torch_layouts")})
    return f"backward case {c['index']}, seed {C.SEED}: {C.describe(args)}"


# ---------------------------------------------------------------------------
# attn's gradients
# ---------------------------------------------------------------------------

TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}


def attn_inputs(c):
    """The torch views attn is given, and which of them gradients are taken
    for (name -> tensor)."""
    dt = TORCH_DTYPE[c["dtype"].type]
    rng = np.random.default_rng([C.SEED, 8, c["index"]])  # permutations
    views = {n: torch_view(c[n], c["torch_layouts"][n], c[n + "_dim"], dt, rng)
             for n in ("q", "k", "v")}
    for n in ("q", "k", "v"):
        views[n] = views[n] if c["needs"][n] else views[n].detach()
    if c["mask"] is not None:
        m = c["mask"]
        mdt = torch.bool if m.dtype == np.bool_ else TORCH_DTYPE[m.dtype.type]
        views["mask"] = torch_view(m, c["torch_layouts"]["mask"], c["mask_dim"], mdt, rng)
        if not c["mask_grad"]:
            views["mask"] = views["mask"].detach()
    return views


def wanted(c):
    return [n for n in ("q", "k", "v") if c["needs"][n]] + (["mask"] if c["mask_grad"] else [])


def run_attn(c, views):
    kw = dict(causal_alignment=c["causal"]) if c["causal"] else {}
    out, w = attn.scaled_dot_product_attention(
        views["q"], views["k"], views["v"], attn_mask=views.get("mask"),
        dropout_p=c["dropout_p"], is_causal=c["causal"] is not None, scale=c["scale"],
        enable_gqa=c["gqa"], seed=c["seed"], return_weights=True, **kw,
    )
    names = wanted(c)
    g = torch.autograd.grad(out, [views[n] for n in names], torch.from_numpy(c["dout"]))
    return out, w, dict(zip(names, g))


def keep_mask(c, views):
    """attn's dropout keep mask for the case: the same call (seed, shapes,
    mask broadcasting) with q = 0 and a mask that hides nothing, so that
    every weight is 1/S before dropout and nonzero exactly where kept. (The
    case's own weights will not do: with large logits a kept weight can
    underflow to 0.)"""
    m = views.get("mask")
    if m is not None:
        m = torch.ones_like(m) if m.dtype == torch.bool else torch.zeros_like(m)
    with torch.no_grad():
        _, w = attn.scaled_dot_product_attention(
            torch.zeros_like(views["q"]), views["k"], views["v"], attn_mask=m,
            dropout_p=c["dropout_p"], scale=c["scale"], enable_gqa=c["gqa"], seed=c["seed"],
            return_weights=True)
    return w.numpy() != 0


# ---------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------


def _keep(c, L, S):
    """(.., L, S) bool: what the causal option and a bool mask allow."""
    keep = C.causal_keep(L, S, c["causal"]) if c["causal"] else np.ones((L, S), bool)
    if c["mask"] is not None and c["mask"].dtype == np.bool_:
        keep = keep & c["mask"]
    return keep


def torch_grads(c, dtype, drop):
    """torch's autograd gradients in `dtype` (float32 or float64): its own
    scaled_dot_product_attention without dropout, the explicit formula with
    `drop` (attn's keep mask, scaled) with it."""
    tdt = TORCH_DTYPE[np.dtype(dtype).type]
    x = {n: torch.from_numpy(np.ascontiguousarray(c[n])).to(tdt).requires_grad_()
         for n in ("q", "k", "v")}
    q, k, v = x["q"], x["k"], x["v"]
    mask_leaf = None
    if c["mask"] is not None and c["mask"].dtype != np.bool_:
        mask_leaf = torch.from_numpy(np.ascontiguousarray(c["mask"])).requires_grad_()
    # As the forward suite does: query expanded to the output's batch shape
    # (torch fails on value or mask with more batch dims than q @ k^T).
    out_shape = c["dout"].shape
    nbo = len(out_shape) - 2
    qq = q.reshape((1,) * (nbo - (q.dim() - 2)) + tuple(q.shape))
    bq = list(out_shape[:-2])
    qq = qq.expand(bq + list(q.shape[-2:]))
    L, S = q.shape[-2], k.shape[-2]
    keep = torch.from_numpy(_keep(c, L, S))
    scores_mask = torch.zeros((), dtype=tdt)
    if mask_leaf is not None:
        m = mask_leaf.to(tdt)
        scores_mask = m.reshape((1,) * (2 - m.dim()) + tuple(m.shape)) if m.dim() < 2 else m
    allowed = keep & torch.isfinite(scores_mask) if mask_leaf is not None else keep
    tmask = torch.where(allowed, scores_mask, torch.tensor(-torch.inf, dtype=tdt))
    empty_rows = bool((~allowed).all(-1).any())
    if drop is None and not empty_rows:
        out = F.scaled_dot_product_attention(qq, k, v, attn_mask=tmask, scale=c["scale"],
                                             enable_gqa=c["gqa"])
    else:  # torch's backward gives NaN for a fully masked row; the formula gives 0
        kk, vv = k, v
        if c["gqa"]:
            kk = k.repeat_interleave(qq.shape[-3] // k.shape[-3], dim=-3)
            vv = v.repeat_interleave(qq.shape[-3] // v.shape[-3], dim=-3)
        scale = c["scale"] if c["scale"] is not None else 1.0 / np.sqrt(q.shape[-1])
        s = (qq @ kk.transpose(-1, -2)) * scale + tmask
        empty = (~allowed).all(-1, keepdim=True)
        w = torch.softmax(torch.where(empty, 0.0, s), -1) * ~empty
        z = 1.0 if drop is None else torch.from_numpy(drop).to(tdt)
        out = (w * z) @ vv
    names = wanted(c)
    leaves = {"q": q, "k": k, "v": v, "mask": mask_leaf}
    dout = torch.from_numpy(c["dout"]).to(tdt)
    g = torch.autograd.grad(out, [leaves[n] for n in names], dout)
    return {n: t.detach().numpy() for n, t in zip(names, g)}


def _reduce_to(g, shape, group_axis=None, groups=1):
    """Sums a full-shape gradient over what an input of `shape` was
    broadcast (or GQA-grouped) to."""
    if group_axis is not None and groups > 1:
        a = g.ndim + group_axis
        g = g.reshape(g.shape[:a] + (g.shape[a] // groups, groups) + g.shape[a + 1:]).sum(a + 1)
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(d for d, n in enumerate(shape) if n == 1 and g.shape[d] > 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def exact_grads(c, drop):
    """The formula's gradients in long double: the float64 reference."""
    ld = np.longdouble
    out_shape = c["dout"].shape
    bshape, L, S = out_shape[:-2], c["q"].shape[-2], c["k"].shape[-2]
    Hq = bshape[-1] if bshape else 1
    full = {}
    for n in ("q", "k", "v"):
        a = np.asarray(c[n], dtype=ld)
        if c["gqa"] and n != "q":
            a = np.repeat(a, Hq // a.shape[-3], axis=-3)
        full[n] = np.broadcast_to(a, bshape + a.shape[-2:])
    q, k, v = full["q"], full["k"], full["v"]
    E = q.shape[-1]
    scale = ld(1) / np.sqrt(ld(E)) if c["scale"] is None else ld(c["scale"])
    s = scale * (q @ np.swapaxes(k, -1, -2))
    keep = np.broadcast_to(_keep(c, L, S), bshape + (L, S))
    if c["mask"] is not None and c["mask"].dtype != np.bool_:
        m = np.asarray(c["mask"], dtype=ld)
        keep = keep & np.isfinite(m)
        s = s + np.where(np.isfinite(m), m, 0)
    s = np.where(keep, s, -np.inf)
    empty = ~keep.any(-1, keepdims=True)
    mx = np.where(empty, 0, s.max(-1, keepdims=True))
    e = np.where(keep, np.exp(s - mx), 0)
    w = e / np.where(empty, 1, e.sum(-1, keepdims=True))
    z = np.ones_like(w) if drop is None else drop.astype(ld)
    dout = np.asarray(c["dout"], dtype=ld)
    dv = np.swapaxes(w * z, -1, -2) @ dout
    dw = (dout @ np.swapaxes(v, -1, -2)) * z
    ds = w * (dw - (w * dw).sum(-1, keepdims=True))
    g = {"q": scale * (ds @ k), "k": scale * (np.swapaxes(ds, -1, -2) @ q), "v": dv,
         "mask": ds}
    # The same sums over the terms' magnitudes: how large the numbers are
    # that each gradient element is summed from, which bounds the rounding
    # of any evaluation even where the terms cancel (a gradient that is 0
    # because the softmax is invariant to it, as dq with a single key).
    a = {n: np.abs(x) for n, x in (("q", q), ("k", k), ("v", v), ("dout", dout))}
    dp = (a["dout"] @ np.swapaxes(a["v"], -1, -2)) * z
    ds_mag = w * (dp + (w * dp).sum(-1, keepdims=True))
    mag = {"q": abs(scale) * (ds_mag @ a["k"]),
           "k": abs(scale) * (np.swapaxes(ds_mag, -1, -2) @ a["q"]),
           "v": np.swapaxes(w * z, -1, -2) @ a["dout"], "mask": ds_mag}
    res, size = {}, {}
    for n in wanted(c):
        shape = c[n].shape
        grouped = c["gqa"] and n in ("k", "v")
        reduce = functools.partial(_reduce_to, shape=shape, group_axis=-3 if grouped else None,
                                   groups=Hq // shape[-3] if grouped else 1)
        res[n], size[n] = reduce(g[n]), float(np.max(reduce(mag[n]), initial=0.0))
    return res, size


# ---------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------


def check_grad(name, ours, ref, torch_own, size, rel_floor, ctx):
    """attn's gradient `ours` against `ref`: within 2 x torch's own error
    (`torch_own` against `ref`) + rel_floor x `size`, the magnitude of the
    terms the gradient sums."""
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.longdouble)
    assert ours.shape == ref.shape, f"d{name}: shape {ours.shape}, expected {ref.shape} ({ctx})"
    assert np.isfinite(ours).all(), f"d{name}: attn's gradient is not finite ({ctx})"
    assert np.isfinite(np.asarray(torch_own)).all(), f"d{name}: torch's is not finite (test bug)"
    err = float(np.max(np.abs(ours - ref), initial=0.0))
    terr = float(np.max(np.abs(np.asarray(torch_own, dtype=np.longdouble) - ref), initial=0.0))
    bar = 2 * terr + rel_floor * size
    assert err <= bar, (
        f"d{name}: error {err:.3g} (terms up to {size:.3g}); torch's own error {terr:.3g}, so "
        f"the bar is 2 x that + {rel_floor:g} x {size:.3g} = {bar:.3g} ({ctx})"
    )
    GRAD_STATS["checks"] += 1
    if bar > 0:
        GRAD_STATS["worst_usage"] = max(GRAD_STATS["worst_usage"], err / bar)


@pytest.mark.parametrize("index", range(N_BACKWARD), ids=lambda i: f"case{i:03d}")
def test_sdpa_gradients_match_torch(index):
    c = backward_case(index)
    ctx = case_context(c)
    views = attn_inputs(c)
    out, w, ours = run_attn(c, views)
    assert out.dtype == TORCH_DTYPE[c["dtype"].type], ctx
    drop = None
    if c["dropout_p"]:
        keep = keep_mask(c, views)
        assert not (w.detach().numpy() != 0)[~keep].any(), f"a dropped weight is nonzero ({ctx})"
        drop = keep / (1.0 - c["dropout_p"])
    exact, size = exact_grads(c, drop)
    if c["dtype"] == np.float64:
        ref, own, floor = exact, torch_grads(c, np.float64, drop), F64_REL_FLOOR
    else:
        ref, own = torch_grads(c, np.float64, drop), torch_grads(c, np.float32, drop)
        floor = F32_REL_FLOOR
    for n in wanted(c):
        check_grad(n, ours[n].numpy(), ref[n], own[n], size[n], floor, ctx)


THREAD_CASES = 24


def test_gradients_do_not_depend_on_the_thread_count():
    """Bitwise the same gradients for 1-4 threads."""
    before = attn.get_num_threads()
    try:
        for index in range(THREAD_CASES):
            c = backward_case(index)
            runs = []
            for n in range(1, 5):
                attn.set_num_threads(n)
                runs.append(run_attn(c, attn_inputs(c))[2])
            for r in runs[1:]:
                for name in r:
                    assert torch.equal(r[name], runs[0][name]), (name, case_context(c))
    finally:
        attn.set_num_threads(0 if before == attn.get_num_threads() else before)


REQUIRED_BACKWARD = {
    "float32": 150, "float64": 80, "dropout": 80, "mask_grad": 50, "mask_broadcast": 20,
    "bool_mask_rank2": 5, "float_mask_rank4": 3, "fully_masked_rows": 20,
    "causal_top-left": 60, "causal_bottom-right": 40, "causal+mask": 40,
    "negative_scale": 40, "zero_scale": 5, "gqa": 40, "broadcast_batch": 40,
    "large_logits": 15, "moderate_logits": 15, "L=1": 15, "S=1": 15, "some_inputs_without_grad": 80,
    **{f"tlayout_{name}": 40 for name in TORCH_LAYOUTS},
}


def test_backward_cases_cover_every_option():
    counts = collections.Counter()
    for i in range(N_BACKWARD):
        counts.update(_gen_backward_case(i)["features"])
    short = {k: (counts[k], n) for k, n in REQUIRED_BACKWARD.items() if counts[k] < n}
    assert not short, f"features drawn too rarely (count, required): {short}"


@pytest.mark.parametrize("S", [8192, 65536])
def test_nearly_uniform_long_rows_keep_torchs_gradient_accuracy(S):
    """Small logits (as at initialization) make a row's weights nearly
    equal, and dq a sum of S terms of one size. Summed onto dq a key at a
    time it rounded alike at every key: 2.3x torch's error at S = 8,192,
    6.2x at 65,536 (each key block is now summed apart and then added, as
    torch's GEMM per block does). Every kernel path, against float64; bar:
    2x torch's own float32 error, as the conformance cases."""
    from test_serving_conformance import PATHS, on_path

    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, 2, 64, 64, generator=g) * 0.01
    k = torch.randn(1, 2, S, 64, generator=g)
    v = torch.randn(1, 2, S, 64, generator=g) + 0.5
    dout = torch.randn(1, 2, 64, 64, generator=g)

    def grads(fn, dtype):
        x = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        fn(*x).backward(dout.to(dtype))
        return [t.grad.double() for t in x]

    ref = grads(F.scaled_dot_product_attention, torch.float64)
    theirs = grads(F.scaled_dot_product_attention, torch.float32)
    for isa in PATHS:
        if isa == "ref":
            continue
        with on_path(isa):
            ours = grads(attn.scaled_dot_product_attention, torch.float32)
        for name, r, t, o in zip(("dq", "dk", "dv"), ref, theirs, ours):
            err, bar = (o - r).abs().max().item(), 2 * (t - r).abs().max().item()
            assert err <= bar, f"{isa} S={S}: {name} error {err:.3g} > 2x torch's {bar / 2:.3g}"
