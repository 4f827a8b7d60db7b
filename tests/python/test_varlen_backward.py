"""Gradients of attn.varlen_attention (attn_sdpa_varlen_backward through the
torch operator attn::varlen) against torch's autograd of the serving formula
(test_serving_conformance.formula), sequence by sequence, on every kernel
path this machine has.

Cases are the forward suite's varlen cases (test_serving_conformance:
random packed batches with empty sequences, sequences without keys, rows
past the last sequence, GQA, bottom-right causality, scales of every sign,
large logits, and the score modifiers: window, ALiBi, softcap, sinks), with
q, k, v (and sinks, when given) requiring grad. The reference is the
formula's autograd in float64 on each sequence's unpacked rows (heads
repeated for GQA, so dk and dv sum each group), scattered back into the
packed layout; rows no sequence holds and keys no query sees have gradient
0. The error model is the modifier gradients' (check_grad there): float32
within 2x torch float32's own error on the same formula + 1e-6 m, float64
within F64_REL m, m the largest magnitude of the terms a gradient element
sums. Dropout is checked by gradcheck (a fixed seed makes the call a
deterministic function of its inputs) and, in C, against the reference
path (tests/c/test_varlen_backward.c).
"""

import numpy as np
import pytest
import torch

import attn
import conformance as C
from test_serving_conformance import (
    PATHS,
    check_grad,
    formula,
    mod_of,
    modifier_kwargs,
    on_path,
    _gen_varlen_case,
)

N_CASES = 160
F64 = torch.float64
STATS = {"cases": 0, "features": set(), "gradchecks": 0, "checks": 0, "worst_usage": 0.0}


def _names(c):
    return ["q", "k", "v"] + (["sinks"] if c["mods"]["sinks"] is not None else [])


def _dout(c):
    rng = np.random.default_rng([C.SEED, 1411, c["index"]])
    tq, Hq, Ev = c["q"].shape[0], c["q"].shape[1], c["v"].shape[2]
    return rng.standard_normal((tq, Hq, Ev))


def _scale(c):
    return float(1.0 / np.sqrt(c["q"].shape[-1])) if c["scale"] is None else c["scale"]


def attn_grads(c):
    """attn's gradients of sum(out * dout) with respect to q, k, v (and
    sinks), float64 NumPy."""
    dt = torch.float32 if c["dtype"] == np.float32 else F64
    x = {n: torch.from_numpy(c[n].copy()).requires_grad_() for n in "qkv"}
    kw = modifier_kwargs(dict(c["mods"], sinks=None), as_tensor=True)
    if c["mods"]["sinks"] is not None:
        x["sinks"] = torch.from_numpy(c["mods"]["sinks"].copy()).requires_grad_()
        kw["sinks"] = x["sinks"]
    out = attn.varlen_attention(
        x["q"], x["k"], x["v"], torch.from_numpy(c["cu_q"]), torch.from_numpy(c["cu_k"]),
        c["max_q"], c["max_k"], softmax_scale=c["scale"], causal=c["causal"], **kw)
    assert out.grad_fn is not None and out.dtype == dt
    names = _names(c)
    g = torch.autograd.grad(out, [x[n] for n in names], torch.from_numpy(_dout(c)).to(dt))
    return {n: t.to(F64).numpy() for n, t in zip(names, g)}


def formula_grads(c, dtype):
    """The formula's autograd in `dtype`, sequence by sequence, and (in
    float64) the magnitude m of the terms each gradient sums."""
    x = {n: torch.from_numpy(c[n].copy()).to(dtype).requires_grad_() for n in "qkv"}
    m = c["mods"]
    if m["sinks"] is not None:
        x["sinks"] = torch.from_numpy(m["sinks"].copy()).to(dtype).requires_grad_()
    Hq, Hkv = c["q"].shape[1], c["k"].shape[1]
    g, scale = Hq // Hkv, _scale(c)
    dout = torch.from_numpy(_dout(c)).to(dtype)
    pieces, size = [], {n: 0.0 for n in _names(c)}
    for b, (L, S) in enumerate(zip(c["lq"], c["lk"])):
        q0, k0 = int(c["cu_q"][b]), int(c["cu_k"][b])
        if L == 0:
            continue
        if S == 0:  # no key: out = 0, no gradient
            pieces.append((q0, torch.zeros(L, Hq, c["v"].shape[2], dtype=dtype)))
            continue
        qh = x["q"][q0:q0 + L].transpose(0, 1)
        kh = x["k"][k0:k0 + S].transpose(0, 1).repeat_interleave(g, 0)
        vh = x["v"][k0:k0 + S].transpose(0, 1).repeat_interleave(g, 0)
        slopes = mod_of(m, "slopes", b)
        r = formula(qh, kh, vh, scale, causal="bottom-right" if c["causal"] else None,
                    window=m["window"] or (-1, -1),
                    slopes=None if slopes is None else torch.from_numpy(slopes).to(dtype),
                    softcap=m["softcap"] or 0.0, sinks=x.get("sinks"))
        pieces.append((q0, r["out"].transpose(0, 1)))
        if dtype == F64:
            _add_sizes(size, r, dout[q0:q0 + L].transpose(0, 1), scale, g)
    out = torch.zeros(c["q"].shape[0], Hq, c["v"].shape[2], dtype=dtype)
    for q0, piece in pieces:  # out's rows, without writing in place into a leaf's graph
        idx = torch.arange(q0, q0 + piece.shape[0])
        out = out.index_copy(0, idx, piece)
    names = _names(c)
    grads = [None] * len(names)  # no sequence has both queries and keys: all 0
    if out.requires_grad:
        grads = torch.autograd.grad(out, [x[n] for n in names], dout, allow_unused=True)
    res = {n: (torch.zeros_like(x[n]) if t is None else t).detach().to(F64).numpy()
           for n, t in zip(names, grads)}
    return res, size


def _add_sizes(size, r, dout, scale, g):
    """The gradient formula over absolute values (the modifier suite's),
    for one sequence; the largest entry per gradient kept in `size`."""
    with torch.no_grad():
        w, v, q, k = r["w"], r["v"], r["q"], r["k"]
        ad, av, aq, ak = dout.abs(), v.abs(), q.abs(), k.abs()
        dp = ad @ av.transpose(-1, -2)
        dsm = w * (dp + (w * dp).sum(-1, keepdim=True))
        dxm = dsm * (1 - r["t"] ** 2) if r["t"] is not None else dsm
        mags = {"q": abs(scale) * dxm @ ak, "k": abs(scale) * dxm.transpose(-1, -2) @ aq,
                "v": w.transpose(-1, -2) @ ad}
        if r["sinks"] is not None:
            ws = torch.exp(r["sinks"][..., None] - r["lse"])  # (Hq, L)
            mags["sinks"] = (ws * (ad * (w @ av)).sum(-1)).sum(-1)
        for n in size:
            a = mags[n]
            if n in ("k", "v") and g > 1:  # a group's heads add into one K/V head
                a = a.reshape(a.shape[0] // g, g, *a.shape[1:]).sum(1)
            if a.numel():
                size[n] = max(size[n], float(a.max()))


def context(c):
    args = {k: c[k] for k in ("q", "k", "v")}
    args.update(cu_seqlens_q=c["cu_q"].tolist(), cu_seqlens_k=c["cu_k"].tolist(),
                causal=c["causal"], scale=c["scale"], window=c["mods"]["window"],
                softcap=c["mods"]["softcap"], alibi=c["mods"]["slopes"] is not None,
                sinks=c["mods"]["sinks"] is not None)
    return f"varlen gradient case {c['index']}, seed {C.SEED}: {C.describe(args)}"


@pytest.mark.parametrize("index", range(N_CASES), ids=lambda i: f"case{i:03d}")
def test_varlen_gradients_match_the_formula(index):
    c = _gen_varlen_case(index)
    ctx = context(c)
    ref, size = formula_grads(c, F64)
    own = formula_grads(c, torch.float32)[0] if c["dtype"] == np.float32 else None
    for isa in PATHS:
        with on_path(isa):
            ours = attn_grads(c)
        for n in _names(c):
            check_grad(n, ours[n], ref[n], None if own is None else own[n], size[n], c["dtype"],
                       isa, ctx, stats=STATS)
    STATS["cases"] += 1
    STATS["features"] |= c["features"]


# ---------------------------------------------------------------------------
# gradcheck: float64 finite differences, dropout included
# ---------------------------------------------------------------------------

GRADCHECK = {
    "plain": dict(),
    "causal_gqa": dict(causal=True, Hq=4, Hkv=2),
    "dropout": dict(dropout=0.3),
    "dropout_causal_gqa": dict(dropout=0.2, causal=True, Hq=2, Hkv=1),
    "window_softcap": dict(window=(2, 1), softcap=3.0),
    "alibi_negative_scale": dict(alibi=True, scale=-0.7),
    "sinks_causal": dict(sinks=True, causal=True),
    "sinks_per_sequence": dict(sinks=(3, 2), causal=True),  # (B, Hq)
    "sinks_per_sequence_shared_heads": dict(sinks=(3, 1)),  # (B, 1)
    "sinks_one_row": dict(sinks=(1, 2), window=(1, 0)),  # (1, Hq)
    "everything": dict(causal=True, Hq=4, Hkv=2, dropout=0.25, window=(3, 0), softcap=5.0,
                       alibi=True, sinks=True),
    "empty_sequences_and_tail_rows": dict(lq=(0, 3, 4, 2), lk=(2, 0, 5, 3), pad=2),
    "queries_past_their_keys": dict(lq=(6, 2), lk=(3, 5), causal=True),
}


@pytest.mark.parametrize("name", list(GRADCHECK))
def test_varlen_gradcheck(name):
    import zlib

    o = GRADCHECK[name]
    rng = np.random.default_rng([C.SEED, 1412, zlib.crc32(name.encode())])
    lq, lk = o.get("lq", (3, 5, 1)), o.get("lk", (4, 5, 2))
    pad = o.get("pad", 0)
    Hq, Hkv = o.get("Hq", 2), o.get("Hkv", 2)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32)
    leaf = lambda *shape: torch.from_numpy(rng.standard_normal(shape)).requires_grad_()  # noqa
    inputs = [leaf(sum(lq) + pad, Hq, 3), leaf(sum(lk) + pad, Hkv, 3), leaf(sum(lk) + pad, Hkv, 2)]
    kw = dict(causal=o.get("causal", False), softmax_scale=o.get("scale"),
              dropout_p=o.get("dropout", 0.0), seed=11)
    if "window" in o:
        kw["window_size"] = o["window"]
    if "softcap" in o:
        kw["softcap"] = o["softcap"]
    if o.get("alibi"):
        kw["alibi_slopes"] = torch.from_numpy(rng.uniform(0.1, 1.0, (Hq,)))
    if o.get("sinks"):
        inputs.append(leaf(*(o["sinks"] if isinstance(o["sinks"], tuple) else (Hq,))))

    def f(*xs):
        sinks = xs[3] if len(xs) > 3 else None
        return attn.varlen_attention(xs[0], xs[1], xs[2], cu_q, cu_k, max(lq), max(lk),
                                     sinks=sinks, **kw)

    for isa in PATHS:
        with on_path(isa):
            assert torch.autograd.gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-8, rtol=1e-6), isa
    STATS["gradchecks"] += 1


# ---------------------------------------------------------------------------
# Bits, the API around the gradient
# ---------------------------------------------------------------------------


def _long_batch(dtype=torch.float32):
    """Two sequences, one long enough that a head's keys split into chunks,
    GQA, dropout: every reduction of the backward."""
    g = torch.Generator().manual_seed(3)
    lens = [1100, 37]
    cu = torch.tensor([0, 1100, 1137], dtype=torch.int32)
    q = torch.randn(1140, 2, 16, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(1140, 1, 16, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(1140, 1, 16, generator=g, dtype=dtype, requires_grad=True)
    dout = torch.randn(1140, 2, 16, generator=g, dtype=dtype)
    return q, k, v, cu, max(lens), dout


def test_varlen_gradients_do_not_depend_on_the_thread_count():
    q, k, v, cu, n, dout = _long_batch()
    before = attn.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3, 4):
            attn.set_num_threads(threads)
            out = attn.varlen_attention(q, k, v, cu, cu, n, n, causal=True, dropout_p=0.1,
                                        seed=5)
            runs.append(torch.autograd.grad(out, (q, k, v), dout))
    finally:
        attn.set_num_threads(0 if before == attn.get_num_threads() else before)
    for r in runs[1:]:
        for a, b in zip(r, runs[0]):
            assert torch.equal(a, b)


def test_only_what_requires_grad_is_computed_and_lse_has_none():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(9, 2, 8, generator=g, requires_grad=True)
    k = torch.randn(7, 2, 8, generator=g)
    v = torch.randn(7, 2, 8, generator=g, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 3, 7],
                                                                         dtype=torch.int32)
    out, lse = attn.varlen_attention(q, k, v, cu_q, cu_k, 5, 4, return_softmax_lse=True)
    assert lse.dtype == F64 and lse.shape == (2, 9) and not lse.requires_grad
    gq, gv = torch.autograd.grad(out.sum(), (q, v))
    assert gq.shape == q.shape and gv.shape == v.shape
    # the same out as a call autograd does not record, and lse within float32 of it
    with torch.no_grad():
        plain, plain_lse = attn.varlen_attention(q, k, v, cu_q, cu_k, 5, 4,
                                                 return_softmax_lse=True)
    assert plain.grad_fn is None
    torch.testing.assert_close(out.detach(), plain, rtol=0, atol=2e-6)
    torch.testing.assert_close(lse.float(), plain_lse, rtol=1e-5, atol=1e-5)


def test_numpy_calls_are_unchanged():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((6, 2, 4)) for _ in range(3))
    cu = np.array([0, 2, 6], np.int32)
    out = attn.varlen_attention(q, k, v, cu, cu, 4, 4, causal=True)
    assert isinstance(out, np.ndarray)


def test_a_training_step_reduces_the_loss():
    """A packed batch trained through varlen_attention: gradients that
    point downhill (the loss falls over a few SGD steps)."""
    g = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    x = torch.randn(20, 16, generator=g)
    target = torch.randn(20, 2, 8, generator=g)
    w = torch.nn.Linear(16, 3 * 16)
    opt = torch.optim.SGD(w.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        q, k, v = w(x).reshape(20, 3, 2, 8).unbind(1)
        out = attn.varlen_attention(q, k, v, cu, cu, 8, 8, causal=True)
        loss = ((out - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses


def test_opcheck():
    from attn import _torch, _varlen_torch  # noqa: F401  (registers the operators)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(9, 2, 8, generator=g, dtype=F64, requires_grad=True)
    kv = torch.randn(7, 1, 8, generator=g, dtype=F64, requires_grad=True)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 7], dtype=torch.int32)
    seed = _torch.seed_tensor(5)
    args = (q, kv, kv, cu_q, cu_k, 5, 4, 0.2, None, 2, seed, -1, -1, 0.0, None, None)
    torch.library.opcheck(torch.ops.attn.varlen.default, args)
    out, lse = torch.ops.attn.varlen(*args)
    torch.library.opcheck(
        torch.ops.attn.varlen_backward.default,
        (torch.ones_like(out), q.detach(), kv.detach(), kv.detach(), out.detach(), lse, cu_q,
         cu_k, 5, 4, 0.2, None, 2, seed, -1, -1, 0.0, None, None, True, True, True, False))


REQUIRED = {"float32": 60, "float64": 40, "gqa": 30, "causal": 50, "window": 30, "alibi": 30,
            "softcap": 30, "sinks": 30, "empty_sequence": 20, "no_keys_for_queries": 5,
            "rows_past_the_last_sequence": 10, "negative_scale": 10, "large_logits": 3}


def test_varlen_gradient_cases_cover_every_option():
    if STATS["cases"] < N_CASES:
        pytest.skip("runs after the whole case list (pytest -k narrowed it)")
    counts = {}
    for i in range(N_CASES):
        for f in _gen_varlen_case(i)["features"]:
            counts[f] = counts.get(f, 0) + 1
    missing = {f: (counts.get(f, 0), n) for f, n in REQUIRED.items() if counts.get(f, 0) < n}
    assert not missing, f"features below their count (have, want): {missing}"


# ---------------------------------------------------------------------------
# What a caller may do between the forward and the backward
# ---------------------------------------------------------------------------


def _small(requires_grad=True):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(12, 4, 8, generator=g, dtype=F64, requires_grad=requires_grad)
    k = torch.randn(12, 2, 8, generator=g, dtype=F64, requires_grad=requires_grad)
    v = torch.randn(12, 2, 8, generator=g, dtype=F64, requires_grad=requires_grad)
    return q, k, v


def test_offsets_refilled_before_the_backward_do_not_change_it():
    """The backward uses the offsets of its forward: a caller refilling its
    int32 offsets buffer (torch or NumPy, which index_array would otherwise
    pass through uncopied) for the next micro-batch changes nothing."""
    q, k, v = _small()
    for kind in ("torch", "numpy"):
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        cu = cu if kind == "torch" else cu.numpy()
        ref = torch.autograd.grad(attn.varlen_attention(q, k, v, cu, cu, 7, 7).sum(), (q, k, v))
        out = attn.varlen_attention(q, k, v, cu, cu, 7, 7)
        cu[1] = 6  # in place, after the forward
        got = torch.autograd.grad(out.sum(), (q, k, v))
        for a, b in zip(got, ref):
            assert torch.equal(a, b), kind


def test_numpy_inputs_beside_tensors_that_require_grad_are_copied():
    q, k, v = _small()
    kn, slopes = k.detach().numpy().copy(), np.full(4, 0.3)
    ref = torch.autograd.grad(
        attn.varlen_attention(q, kn, v, [0, 5, 12], [0, 5, 12], 7, 7, alibi_slopes=slopes).sum(),
        (q, v))
    out = attn.varlen_attention(q, kn, v, [0, 5, 12], [0, 5, 12], 7, 7, alibi_slopes=slopes)
    kn += 1.0
    slopes *= 2
    for a, b in zip(torch.autograd.grad(out.sum(), (q, v)), ref):
        assert torch.equal(a, b)


def test_forward_mode_ad_is_refused_not_dropped():
    import torch.autograd.forward_ad as fwAD

    q, k, v = _small(requires_grad=False)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with fwAD.dual_level():
        qd = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="forward-mode"):
            attn.varlen_attention(qd, k, v, cu, cu, 7, 7)


def test_slopes_requiring_grad_alone_and_float_offsets():
    q, k, v = _small(requires_grad=False)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    slopes = torch.rand(4, dtype=F64, requires_grad=True)
    out = attn.varlen_attention(q, k, v, cu, cu, 7, 7, alibi_slopes=slopes)
    out.sum().backward()  # slopes get no gradient, as in FlashAttention
    assert slopes.grad is None
    with pytest.raises(TypeError, match="cu_seqlens_q has dtype float32"):
        attn.varlen_attention(q, k, v, torch.tensor([0.0, 5, 12], requires_grad=True), cu, 7, 7)


def test_torch_compile_fullgraph_matches_eager():
    q, k, v = _small()
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    sinks = torch.zeros(4, dtype=F64, requires_grad=True)

    def f(q, k, v, sinks):
        out, lse = attn.varlen_attention(q, k, v, cu, cu, 7, 7, causal=True, window_size=(3, 0),
                                         sinks=sinks, dropout_p=0.2, seed=3,
                                         return_softmax_lse=True)
        return (out * out).sum() + lse.sum().detach()

    eager = torch.autograd.grad(f(q, k, v, sinks), (q, k, v, sinks))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v, sinks), (q, k, v, sinks))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
