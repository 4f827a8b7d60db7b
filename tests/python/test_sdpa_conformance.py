"""attn.scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention
(PyTorch 2.13) on randomized cases covering every argument and combination.

Where attn goes beyond PyTorch, the reference is PyTorch given the equivalent
explicit mask: causal + attn_mask (PyTorch refuses the pair) is compared with
attn_mask & tril; bottom-right causal with the mask j <= i + (S - L).
query is given to PyTorch expanded to the output's batch shape, and 1-D
masks as (1, S): the same values and semantics, in the forms PyTorch 2.13's
kernels accept (it fails on a value or mask with more batch dimensions than
query @ key^T, and on a 1-D mask with 4-D inputs).
Weights come from torch's math kernel (aten._scaled_dot_product_attention_math,
with bool masks turned into float masks first, as the public function does),
log-sum-exp from torch.logsumexp over the same scores.
PyTorch's is_causal=True is used for top-left causal cases without a mask,
except with a scale <= 0, where PyTorch 2.13's CPU flash kernel returns NaN
(test_torch_deviations.py shows it); those get the explicit mask.
float64 cases are also checked against the exact result (conformance.py).
"""

import collections
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attn
import conformance as C


def _gen_sdpa_case(index):
    rng = np.random.default_rng([C.SEED, 1, index])
    f = set()
    dt = np.dtype(np.float32 if rng.random() < 0.65 else np.float64)
    f.add(dt.name)
    rank = int(rng.choice([2, 3, 4, 5], p=[0.15, 0.3, 0.35, 0.2]))
    f.add(f"rank{rank}")
    nb = rank - 2
    L, S, E = C.pick_len(rng), C.pick_len(rng), C.pick_feat(rng)
    Ev = E if rng.random() < 0.35 else C.pick_feat(rng)
    B = [int(rng.integers(1, 4)) for _ in range(nb)]

    gqa = nb >= 1 and rng.random() < 0.2
    heads = {}
    if gqa:
        Hk = int(rng.integers(1, 3))
        Hq = Hk * int(rng.integers(2, 4))
        B[-1] = Hq
        divisors = [h for h in range(1, Hq + 1) if Hq % h == 0]
        Hv = Hk if rng.random() < 0.75 else int(rng.choice(divisors))
        heads = {"q": Hq, "k": Hk, "v": Hv}
        f.add("gqa")

    def batch_of(name):
        b = list(B)
        for d in range(nb):
            if gqa and d == nb - 1:
                b[d] = heads[name]
            elif rng.random() < 0.12:
                b[d] = 1
        drop = 0
        if nb > 0 and rng.random() < 0.12:  # fewer leading dims: broadcast too
            drop = int(rng.integers(1, nb + 1))
            if gqa:
                drop = min(drop, nb - 1)
        return b[drop:]

    bq, bk, bv = batch_of("q"), batch_of("k"), batch_of("v")
    if (bq, bk, bv) != (B, B, B):
        f.add("broadcast_batch")
    amp = 1.0
    if rng.random() < 0.08:  # |q . k| ~ 1e4
        amp = float(np.sqrt(1e4 / np.sqrt(E)))
        f.add("large_logits")
    q = (rng.standard_normal(bq + [L, E]) * amp).astype(dt)
    k = (rng.standard_normal(bk + [S, E]) * amp).astype(dt)
    v = rng.standard_normal(bv + [S, Ev]).astype(dt)
    for name, n in (("L", L), ("S", S), ("E", E), ("Ev", Ev)):
        if n == 1:
            f.add(f"{name}=1")
    if E != Ev:
        f.add("Ev!=E")
    f.add("L<S" if L < S else "L>S" if L > S else "L=S")

    # Output batch shape, as NumPy broadcasting (GQA: the query heads).
    nbo = max(len(bq), len(bk), len(bv))
    pad = lambda b: [1] * (nbo - len(b)) + b  # noqa: E731
    out_b = [max(x) for x in zip(pad(bq), pad(bk), pad(bv))]
    if gqa:
        out_b[-1] = heads["q"]
    full = out_b + [L, S]

    mask = None
    r = rng.random()
    mask_kind = "none" if r < 0.4 else "bool" if r < 0.75 else "float"
    if mask_kind != "none":
        m = len(full) if rng.random() < 0.5 else int(rng.integers(1, len(full) + 1))
        shape = [n if rng.random() >= 0.35 else 1 for n in full[len(full) - m :]]
        f.add(f"{mask_kind}_mask_rank{m}")
        if any(s == 1 and n > 1 for s, n in zip(shape, full[len(full) - m :])):
            f.add("mask_broadcast")
        if mask_kind == "bool":
            mask = rng.random(shape) < 0.75
        else:
            mdt = dt if rng.random() < 0.8 else np.dtype(np.float64)
            if mdt != dt:
                f.add("mask_mixed_dtype")
            mask = (rng.standard_normal(shape) * 1.5).astype(mdt)
            mask[rng.random(shape) < 0.15] = -np.inf
        if rng.random() < 0.15:  # a fully masked query row
            i = int(rng.integers(0, shape[-2])) if m >= 2 else None
            idx = (Ellipsis, i, slice(None)) if i is not None else (Ellipsis,)
            mask[idx] = False if mask_kind == "bool" else -np.inf
            f.add("fully_masked_rows")

    r = rng.random()
    causal = None if r < 0.5 else "top-left" if r < 0.8 else "bottom-right"
    if causal:
        f.add(f"causal_{causal}")
        if mask is not None:
            f.add("causal+mask")
        if causal == "bottom-right" and L > S:
            f.add("fully_masked_rows")
        f.add(f"causal_{'L<S' if L < S else 'L>S' if L > S else 'L=S'}")

    r = rng.random()
    if r < 0.45:
        scale = None
    elif r < 0.75:
        scale = float(rng.uniform(0.05, 2.0))
        f.add("scale")
    elif r < 0.95:
        scale = -float(rng.uniform(0.05, 2.0))
        f.add("negative_scale")
    else:
        scale = 0.0
        f.add("zero_scale")

    want_w = bool(rng.random() < 0.45)
    want_lse = bool(rng.random() < 0.35)
    if want_w:
        f.add("return_weights")
    if want_lse:
        f.add("return_lse")

    use_torch = rng.random() < 0.12
    layouts = {}
    if use_torch:
        f.add("torch_inputs")
    else:
        for name in ("q", "k", "v") + (("mask",) if mask is not None else ()):
            layouts[name] = C.pick_layout(rng)
            f.add(f"layout_{layouts[name]}")
    return dict(
        index=index, rng=rng, features=f, dtype=dt, q=q, k=k, v=v, mask=mask, causal=causal,
        scale=scale, gqa=gqa, want_w=want_w, want_lse=want_lse, use_torch=use_torch,
        layouts=layouts,
    )


@functools.lru_cache(maxsize=None)
def sdpa_case(index):
    """Case `index`: its arguments, with inputs already in their layouts."""
    c = _gen_sdpa_case(index)
    rng = c["rng"]
    for name in ("q", "k", "v", "mask"):
        if c[name] is None:
            continue
        if c["use_torch"]:
            if name != "mask":
                c[name + "_in"] = C.torch_input(c[name], rng)
            else:
                c["mask_in"] = C.as_torch(c["mask"])
        else:
            c[name + "_in"] = C.relayout(c[name], c["layouts"][name], rng)
            c[name] = np.array(c[name + "_in"], copy=True)  # "broadcast" repeats values
    return c


def _as_torch(a, dtype):
    """C.as_torch for a NumPy dtype, or through float32 for a torch dtype
    (float16, bfloat16: the rounding torch's own .to() does)."""
    if isinstance(dtype, torch.dtype):
        return C.as_torch(a, np.dtype(np.float32)).to(dtype)
    return C.as_torch(a, dtype)


def _torch_mask(mask, dtype, as_float=False):
    """Mask array -> torch tensor for a query of `dtype` (NumPy's, or torch's
    16-bit ones). PyTorch wants a float mask no wider than a float32 query
    (and a 16-bit query's own dtype); `as_float` turns bool masks (True =
    attend) into float masks (0 / -inf), which the math kernel needs."""
    if mask is None:
        return None
    if mask.ndim < 2:  # PyTorch 2.13 fails on 1-D masks with 4-D inputs; (1, S) is the same
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    if mask.dtype == np.bool_:
        if not as_float:
            return C.as_torch(mask)
        return _as_torch(np.where(mask, 0.0, -np.inf), dtype)
    if isinstance(dtype, torch.dtype):
        return _as_torch(mask, dtype)
    return C.as_torch(mask, np.dtype(np.float32) if dtype == np.float32 else None)


def torch_reference(c, dtype):
    """PyTorch's out, weights and lse for case c, computed in `dtype` (a
    NumPy dtype, or torch.float16/torch.bfloat16: then as float64 arrays)."""
    q = _as_torch(c["q"], dtype)
    k = _as_torch(c["k"], dtype)
    v = _as_torch(c["v"], dtype)
    # PyTorch 2.13 adds the mask to query @ key^T in place, which fails when
    # value or the mask has more batch dimensions than that product: give it
    # the query expanded to the output's batch shape (the same values).
    nbo = max(t.dim() for t in (q, k, v)) - 2
    bq = [1] * (nbo - (q.dim() - 2)) + list(q.shape[:-2])
    bk = [1] * (nbo - (k.dim() - 2)) + list(k.shape[:-2])
    bv = [1] * (nbo - (v.dim() - 2)) + list(v.shape[:-2])
    out_b = [max(x) for x in zip(bq, bk, bv)]
    if c["gqa"]:
        out_b[-1] = bq[-1]
    q = q.reshape(bq + list(q.shape[-2:])).expand(out_b + list(q.shape[-2:]))
    L, S = q.shape[-2], k.shape[-2]
    mask, causal = c["mask"], c["causal"]
    is_causal = False
    if causal == "top-left" and mask is None and not (c["scale"] is not None and c["scale"] <= 0):
        is_causal = True  # PyTorch's own flag (its CPU flash kernel gives NaN for scale <= 0)
    elif causal:
        keep = C.causal_keep(L, S, causal)
        if mask is None:
            mask = keep
        elif mask.dtype == np.bool_:
            mask = mask & keep
        else:
            mask = np.where(keep, mask, -np.inf)
    tmask = _torch_mask(mask, dtype)
    gqa = c["gqa"]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=tmask, is_causal=is_causal, scale=c["scale"], enable_gqa=gqa
    )
    weights = lse = None
    if c["want_w"] or c["want_lse"]:
        explicit = C.causal_keep(L, S, "top-left") if is_causal else mask
        tf = _torch_mask(explicit, dtype, as_float=True)
        if c["want_w"]:
            _, weights = torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, tf, 0.0, False, scale=c["scale"], enable_gqa=gqa
            )
            # attn broadcasts the weights over value's batch dims too, like out.
            weights = weights.expand(out.shape[:-1] + weights.shape[-1:])
        if c["want_lse"]:
            kk = k
            if gqa:
                kk = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            scale = c["scale"] if c["scale"] is not None else 1.0 / np.sqrt(q.shape[-1])
            s = (q @ kk.transpose(-2, -1)) * scale
            if tf is not None:
                s = s + tf
            lse = torch.logsumexp(s, dim=-1).expand(out.shape[:-1])
    half = isinstance(dtype, torch.dtype)
    np_ = lambda t: None if t is None else (t.double() if half else t).numpy()  # noqa: E731
    return np_(out), np_(weights), np_(lse)


def run_attn(c):
    kw = {}
    if c["causal"]:
        kw["causal_alignment"] = c["causal"]
    res = attn.scaled_dot_product_attention(
        c["q_in"], c["k_in"], c["v_in"], attn_mask=c.get("mask_in"),
        is_causal=c["causal"] is not None, scale=c["scale"], enable_gqa=c["gqa"],
        return_weights=c["want_w"], return_lse=c["want_lse"], **kw,
    )
    if not isinstance(res, tuple):
        res = (res,)
    # torch tensors in, torch tensors out; NumPy in, NumPy out
    kind = torch.Tensor if c["use_torch"] else np.ndarray
    assert all(type(x) is kind for x in res), [type(x) for x in res]
    if c["use_torch"]:
        res = tuple(x.numpy() for x in res)
    out = res[0]
    rest = list(res[1:])
    weights = rest.pop(0) if c["want_w"] else None
    lse = rest.pop(0) if c["want_lse"] else None
    return out, weights, lse


def case_context(c):
    args = {k: c[k] for k in ("q", "k", "v", "mask")}
    args.update({k: c[k] for k in ("causal", "scale", "gqa", "want_w", "want_lse", "use_torch")})
    args["layouts"] = c["layouts"]
    return f"sdpa case {c['index']}, seed {C.SEED}: {C.describe(args)}"


@pytest.mark.parametrize("index", range(C.N_SDPA), ids=lambda i: f"case{i:04d}")
def test_sdpa_matches_torch(index):
    c = sdpa_case(index)
    ctx = case_context(c)
    out, weights, lse = run_attn(c)
    assert isinstance(out, np.ndarray) and out.dtype == c["dtype"], ctx
    ref = torch_reference(c, np.dtype(np.float64))
    t32 = torch_reference(c, np.dtype(np.float32)) if c["dtype"] == np.float32 else (None,) * 3
    exact = floor = (None,) * 3
    if c["dtype"] == np.float64:
        exact, floor = C.sdpa_exact(
            c["q"], c["k"], c["v"], c["mask"], c["causal"], c["scale"], c["gqa"], out.shape
        )
    C.check_close("sdpa", "out", out, ref[0], t32[0], exact=exact[0], floor=floor[0],
                  context=ctx)
    if c["want_w"]:
        C.check_close("sdpa", "weights", weights, ref[1], t32[1], exact=exact[1],
                      floor=floor[1], context=ctx)
    if c["want_lse"]:
        C.check_close("sdpa", "lse", lse, ref[2], t32[2], exact=exact[2], floor=floor[2],
                      context=ctx)
    C.STATS["sdpa"]["cases"] += 1


# Every argument and combination the suite promises, and how many random
# cases must exercise each. Each floor is below the expected count by more
# than 5 standard deviations, so any seed meets them.
REQUIRED_SDPA = {
    "float32": 300, "float64": 150, "rank2": 60, "rank3": 150, "rank4": 200, "rank5": 100,
    "bool_mask_rank1": 5, "bool_mask_rank2": 10, "bool_mask_rank3": 5, "bool_mask_rank4": 5,
    "float_mask_rank1": 5, "float_mask_rank2": 10, "float_mask_rank3": 5, "float_mask_rank4": 5,
    "mask_broadcast": 50, "mask_mixed_dtype": 10, "fully_masked_rows": 50,
    "causal_top-left": 150, "causal_bottom-right": 100, "causal+mask": 100,
    "causal_L<S": 60, "causal_L>S": 60, "scale": 150, "negative_scale": 100, "zero_scale": 20,
    "gqa": 100, "Ev!=E": 400, "L=1": 50, "S=1": 50, "E=1": 50, "Ev=1": 30,
    "L<S": 200, "L>S": 200, "large_logits": 40, "broadcast_batch": 100,
    "return_weights": 200, "return_lse": 200, "torch_inputs": 60,
    **{f"layout_{name}": 20 for name in C.LAYOUTS},
}


def test_sdpa_cases_cover_every_argument():
    counts = collections.Counter()
    for i in range(C.N_SDPA):
        counts.update(_gen_sdpa_case(i)["features"])
    short = {k: (counts[k], n) for k, n in REQUIRED_SDPA.items() if counts[k] < n}
    assert not short, f"features drawn too rarely (count, required): {short}"
