"""attn.nn.MultiheadAttention against torch.nn.MultiheadAttention, forward and
backward, and attn.nn._patched_mha_forward on torch's own module.

- 160 random configurations per run (seeded from ATTN_TEST_SEED through
  conformance.SEED), every option: float64 output and gradients (query, key,
  value, every parameter) within 1e-10 of the magnitude of torch's; float32
  within 2x torch's own float32 error against torch in float64, plus 8
  float32 ulps of the gradient's magnitude: a gradient passes through about
  five float32 roundings (projections, the lse and O the forward stores,
  dO, dQ/dK/dV), and on a one-element gradient torch's own error can be a
  lucky fraction of an ulp.
- dropout: attn's keep mask is read from the weights it returns
  (need_weights=True, average_attn_weights=False gives each head's weights
  after dropout, so weight != 0 <=> kept); the same formula with that mask,
  written in torch float64 and differentiated by autograd, gives the
  reference output and gradients.
- gradcheck on small float64 shapes, state_dict round trips, train/eval.
"""

import inspect
import os
import subprocess
import sys

import copy

import numpy as np
import pytest
import torch

import attn
import attn.nn
import conformance

F = torch.nn.functional
N_RANDOM = 160
EPS32 = 2.0**-23


def _rng(i):
    return np.random.default_rng([conformance.SEED, 0xBAC0, i])


def draw_config(rng):
    """A module configuration and one call's arguments."""
    H = int(rng.integers(1, 5))
    E = H * int(rng.integers(1, 7))
    c = dict(
        E=E, H=H, bias=bool(rng.random() < 0.8), add_bias_kv=bool(rng.random() < 0.3),
        add_zero_attn=bool(rng.random() < 0.3), batch_first=bool(rng.random() < 0.5),
        unbatched=bool(rng.random() < 0.2), self_attn=bool(rng.random() < 0.2),
        N=int(rng.integers(1, 4)), L=int(rng.integers(1, 7)), S=int(rng.integers(1, 7)),
        kpm=int(rng.integers(0, 3)), mask=int(rng.integers(0, 5)),
        is_causal=bool(rng.random() < 0.2), need_weights=bool(rng.random() < 0.5),
        average=bool(rng.random() < 0.5),
    )
    same = c["self_attn"] or rng.random() < 0.5
    c["kdim"] = E if same else int(rng.integers(1, 9))
    c["vdim"] = E if same else int(rng.integers(1, 9))
    if c["self_attn"]:
        c["S"] = c["L"]
    if c["is_causal"]:
        c["S"], c["mask"] = c["L"], 1 + int(rng.integers(0, 2)) * 2  # a causal mask, bool/float
    return c


def make_inputs(c, dtype, rng):
    """query, key, value (the same tensor for self-attention) and the masks;
    key 0 stays visible to every query, so no row is fully masked."""
    N, L, S, E, H = c["N"], c["L"], c["S"], c["E"], c["H"]

    def seq(T, Fd):
        if c["unbatched"]:
            return (T, Fd)
        return (N, T, Fd) if c["batch_first"] else (T, N, Fd)

    q = torch.tensor(rng.standard_normal(seq(L, E)), dtype=dtype)
    if c["self_attn"]:
        k = v = q
    else:
        k = torch.tensor(rng.standard_normal(seq(S, c["kdim"])), dtype=dtype)
        v = torch.tensor(rng.standard_normal(seq(S, c["vdim"])), dtype=dtype)
    kpm = mask = None
    nb = 1 if c["unbatched"] else N
    if c["kpm"]:
        hide = rng.random((nb, S)) < 0.3
        hide[:, 0] = False
        kpm = torch.tensor(hide) if c["kpm"] == 1 else torch.tensor(
            np.where(hide, -np.inf, rng.standard_normal((nb, S))), dtype=dtype)
        if c["unbatched"]:
            kpm = kpm[0]
    if c["mask"]:
        shape = (L, S) if c["mask"] <= 2 else (nb * H, L, S)
        hide = rng.random(shape) < 0.3
        if c["is_causal"]:
            hide = np.broadcast_to(np.triu(np.ones((L, S), bool), 1), shape).copy()
        hide[..., 0] = False
        boolean = c["mask"] % 2 == 1
        mask = torch.tensor(hide) if boolean else torch.tensor(
            np.where(hide, -np.inf, rng.standard_normal(shape)), dtype=dtype)
    return q, k, v, kpm, mask


def modules(c, dtype, seed):
    kw = dict(bias=c["bias"], add_bias_kv=c["add_bias_kv"], add_zero_attn=c["add_zero_attn"],
              kdim=c["kdim"], vdim=c["vdim"], batch_first=c["batch_first"])
    torch.manual_seed(seed)
    t = torch.nn.MultiheadAttention(c["E"], c["H"], dtype=torch.float64, **kw)
    with torch.no_grad():  # biases away from 0, so their gradients carry weight
        for name, p in t.named_parameters():
            if "bias" in name:
                p.normal_()
    t32 = torch.nn.MultiheadAttention(c["E"], c["H"], dtype=torch.float32, **kw)
    t32.load_state_dict(t.state_dict())
    a = attn.nn.MultiheadAttention(c["E"], c["H"], dtype=dtype, **kw)
    a.load_state_dict(t.state_dict())
    return t, t32, a


def run(module, c, q, k, v, kpm, mask, dout, torch_ref=False):
    """(out, weights, grads of query/key/value and every parameter). For
    torch with appended keys the causal hint goes as its mask alone: torch's
    SDPA path (no kpm, no weights) would hide the appended keys from early
    queries, unlike its mask path, which attn follows on every path."""
    appended = c["add_bias_kv"] or c["add_zero_attn"]
    causal = c["is_causal"] and not (torch_ref and appended)
    leaves = [x.detach().clone().requires_grad_() for x in ((q,) if c["self_attn"] else (q, k, v))]
    qq, kk, vv = (leaves * 3) if c["self_attn"] else leaves
    out, w = module(qq, kk, vv, key_padding_mask=kpm, need_weights=c["need_weights"],
                    attn_mask=mask, average_attn_weights=c["average"], is_causal=causal)
    params = list(module.parameters())
    grads = torch.autograd.grad(out, leaves + params, dout.to(out.dtype))
    return out.detach(), None if w is None else w.detach(), [g.detach() for g in grads]


def check(ours, ref64, torch32=None, what=""):
    """Max error against the float64 reference, relative to the largest
    reference value — at least 1e-3, as inputs and parameters are O(1): a
    gradient that cancels to 0 is judged on the terms that cancelled."""
    ours, ref64 = ours.double(), ref64.double()
    scale = max(ref64.abs().max().item() if ref64.numel() else 0.0, 1e-3)
    err = (ours - ref64).abs().max().item() if ref64.numel() else 0.0
    if torch32 is None:
        assert err <= 1e-10 * scale, f"{what}: float64 error {err:.3g}, scale {scale:.3g}"
    else:
        terr = (torch32.double() - ref64).abs().max().item() if ref64.numel() else 0.0
        bound = 2 * terr + 8 * EPS32 * scale
        assert err <= bound, f"{what}: float32 error {err:.3g} > 2 x torch's {terr:.3g} + 8 ulp"


@pytest.mark.parametrize("i", range(N_RANDOM))
def test_random_configuration_matches_torch(i):
    rng = _rng(i)
    c = draw_config(rng)
    dtype = torch.float64 if rng.random() < 0.5 else torch.float32
    t, t32, a = modules(c, dtype, int(rng.integers(2**31)))
    q, k, v, kpm, mask = make_inputs(c, torch.float64, rng)
    with torch.no_grad():
        probe, _ = t(q, k, v, key_padding_mask=kpm, attn_mask=mask, is_causal=c["is_causal"])
    dout = torch.tensor(rng.standard_normal(probe.shape))
    ref = run(t, c, q, k, v, kpm, mask, dout, torch_ref=True)
    cast = lambda x: None if x is None or x.dtype == torch.bool else x.to(dtype)  # noqa: E731
    args = (q.to(dtype), k.to(dtype), v.to(dtype), cast(kpm) if kpm is None or kpm.dtype != torch.bool else kpm,
            cast(mask) if mask is None or mask.dtype != torch.bool else mask, dout)
    ours = run(a, c, *args)
    mine32 = run(t32, c, *args, torch_ref=True) if dtype == torch.float32 else None
    names = ["query", "key", "value"][: 1 if c["self_attn"] else 3] + [
        n for n, _ in t.named_parameters()]
    check(ours[0], ref[0], mine32 and mine32[0], f"case {i} {c} out")
    if c["need_weights"]:
        check(ours[1], ref[1], mine32 and mine32[1], f"case {i} weights")
    for n, g_ours, g_ref, j in zip(names, ours[2], ref[2], range(len(names))):
        check(g_ours, g_ref, mine32 and mine32[2][j], f"case {i} {c} d{n}")


# ---- float16 and bfloat16 (issue 13) ----

N_HALF = 60  # per dtype
U_HALF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
_TALLY = conformance.ErrorTally()


def check_half(dt, ours, ref64, t16, what):
    """attn's largest error within 2x torch's in the same dtype plus four
    roundings of the largest reference value to the dtype. A case's largest
    error is a noisy statistic (test_mha_half_conformance.py), more so for a
    gradient that sums rounded terms (dbias_k adds N rows of a rounded dK),
    where torch's own may happen to cancel: over five seeds attn needed at
    most 1.83 such roundings beyond 2x torch's. The squared errors are summed
    for test_half_gradients_overall, which holds attn to torch's own error
    over all cases (0.82-0.91 of it over those seeds)."""
    o, r, t = ours.double(), ref64.double(), t16.double()
    if r.numel() == 0:
        return
    assert not o.isnan().any(), f"{what}: NaN"
    scale = max(r.abs().max().item(), 1e-3)
    err, terr = (o - r).abs().max().item(), (t - r).abs().max().item()
    assert err <= 2 * terr + 4 * U_HALF[dt] * scale, (
        f"{what}: {dt} error {err:.3g} > 2 x torch's {terr:.3g} + 4u x {scale:.3g}")
    _TALLY.add(str(dt), o.numpy(), r.numpy(), t.numpy())


@pytest.mark.parametrize("dt", list(U_HALF), ids=str)
@pytest.mark.parametrize("i", range(N_HALF))
def test_random_half_configuration_matches_torch(i, dt):
    """attn.nn.MultiheadAttention in float16/bfloat16 against torch's module
    in the same dtype, both judged by torch's float64 module on the same
    rounded inputs, parameters, masks and dout: the output, the weights and
    the gradients of the inputs and of every parameter."""
    rng = np.random.default_rng([conformance.SEED, 0xBAC1, i, U_HALF[dt] == 2.0**-8])
    c = draw_config(rng)
    t, _, _ = modules(c, torch.float64, int(rng.integers(2**31)))
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(p.to(dt).double())
    t16 = copy.deepcopy(t).to(dt)
    a = attn.nn.MultiheadAttention(c["E"], c["H"], bias=c["bias"], add_bias_kv=c["add_bias_kv"],
                                   add_zero_attn=c["add_zero_attn"], kdim=c["kdim"],
                                   vdim=c["vdim"], batch_first=c["batch_first"], dtype=dt)
    a.load_state_dict(t16.state_dict())
    rounded = lambda x: None if x is None or x.dtype == torch.bool else x.to(dt).double()  # noqa
    q, k, v, kpm, mask = make_inputs(c, torch.float64, rng)
    q, k, v = rounded(q), rounded(k), rounded(v)
    kpm = kpm if kpm is None or kpm.dtype == torch.bool else rounded(kpm)
    mask = mask if mask is None or mask.dtype == torch.bool else rounded(mask)
    with torch.no_grad():
        probe, _ = t(q, k, v, key_padding_mask=kpm, attn_mask=mask, is_causal=c["is_causal"])
    dout = rounded(torch.tensor(rng.standard_normal(probe.shape)))
    ref = run(t, c, q, k, v, kpm, mask, dout, torch_ref=True)
    cast = lambda x: x if x is None or x.dtype == torch.bool else x.to(dt)  # noqa: E731
    args = (q.to(dt), k.to(dt), v.to(dt), cast(kpm), cast(mask), dout)
    ours = run(a, c, *args)
    mine16 = run(t16, c, *args, torch_ref=True)
    assert ours[0].dtype == dt and all(g.dtype == dt for g in ours[2])
    names = ["query", "key", "value"][: 1 if c["self_attn"] else 3] + [
        n for n, _ in t.named_parameters()]
    check_half(dt, ours[0], ref[0], mine16[0], f"case {i} {c} out")
    if c["need_weights"]:
        check_half(dt, ours[1], ref[1], mine16[1], f"case {i} weights")
    for j, n in enumerate(names):
        check_half(dt, ours[2][j], ref[2][j], mine16[2][j], f"case {i} {c} d{n}")


@pytest.mark.parametrize("dt", list(U_HALF), ids=str)
def test_half_gradients_overall(dt):
    """Over all cases above (pytest keeps the file's order): attn's RMS error
    at most torch's in the same dtype."""
    ratio = _TALLY.ratio(str(dt))
    if ratio is None:
        pytest.skip("no 16-bit case ran in this session")
    assert ratio <= 1.0, f"{dt}: attn's RMS error over all cases is {ratio:.3f} of torch's"


# ---- dropout ----


def reference_with_keep(t, c, q, k, v, kpm, mask, keep, p):
    """torch MHA's formula in float64 with a given keep mask (N, H, L, S')."""
    bf, E, H = c["batch_first"], c["E"], c["H"]
    hd = E // H
    to_ntf = (lambda x: x) if bf else (lambda x: x.transpose(0, 1))
    if t._qkv_same_embed_dim:
        Wq, Wk, Wv = t.in_proj_weight.chunk(3)
    else:
        Wq, Wk, Wv = t.q_proj_weight, t.k_proj_weight, t.v_proj_weight
    bq, bk, bv = t.in_proj_bias.chunk(3) if t.in_proj_bias is not None else (None,) * 3
    Q, K, V = F.linear(to_ntf(q), Wq, bq), F.linear(to_ntf(k), Wk, bk), F.linear(to_ntf(v), Wv, bv)
    N = Q.shape[0]
    if t.bias_k is not None:
        K = torch.cat([K, t.bias_k.expand(N, 1, E)], 1)
        V = torch.cat([V, t.bias_v.expand(N, 1, E)], 1)
    if t.add_zero_attn:
        K = torch.cat([K, K.new_zeros(N, 1, E)], 1)
        V = torch.cat([V, V.new_zeros(N, 1, E)], 1)
    heads = lambda X: X.view(N, X.shape[1], H, hd).transpose(1, 2)  # noqa: E731
    s = heads(Q) @ heads(K).transpose(-1, -2) / hd**0.5
    Sx, S = K.shape[1], c["S"]
    bias = torch.zeros(N, 1, 1, Sx, dtype=torch.float64)
    if kpm is not None:
        bias[..., :S] = (torch.where(kpm, -torch.inf, 0.0) if kpm.dtype == torch.bool else kpm).view(N, 1, 1, S)
    if mask is not None:
        m = torch.where(mask, -torch.inf, 0.0) if mask.dtype == torch.bool else mask
        m = m.view(N, H, c["L"], S) if m.dim() == 3 else m
        bias = bias + F.pad(m, (0, Sx - S))
    P = torch.softmax(s + bias, -1) * keep / (1 - p)
    O = (P @ heads(V)).transpose(1, 2).reshape(N, -1, E)
    out = F.linear(O, t.out_proj.weight, t.out_proj.bias)
    return out if bf else out.transpose(0, 1)


@pytest.mark.parametrize("i", range(8))
def test_dropout_gradients_with_attns_keep_mask(i):
    rng = _rng(1000 + i)
    c = draw_config(rng)
    c.update(unbatched=False, is_causal=False, self_attn=False, need_weights=True, average=False)
    c["mask"] = c["mask"] if c["mask"] != 0 else 1
    p = [0.1, 0.3, 0.5, 0.8][i % 4]
    t, _, a = modules(c, torch.float64, int(rng.integers(2**31)))
    a.dropout = p
    a.train()
    q, k, v, kpm, mask = make_inputs(c, torch.float64, rng)
    qa, ka, va = (x.clone().requires_grad_() for x in (q, k, v))
    out, w = a(qa, ka, va, key_padding_mask=kpm, attn_mask=mask, need_weights=True,
               average_attn_weights=False)
    keep = (w != 0).double()
    # Dropout ran: among the n weights the masks leave visible, keeping all
    # (or none) has probability (1-p)^n (or p^n); asserted only where that
    # is below 1e-9, so the check cannot fail by chance.
    with torch.no_grad():
        a.eval()
        n = int((a(q, k, v, key_padding_mask=kpm, attn_mask=mask, need_weights=True,
                   average_attn_weights=False)[1] != 0).sum())
        a.train()
    kept = int(keep.sum())
    assert kept < n or (1 - p) ** n >= 1e-9, f"dropout kept all {n} visible weights"
    assert kept > 0 or p ** n >= 1e-9, f"dropout kept none of {n} visible weights"
    dout = torch.tensor(rng.standard_normal(out.shape))
    ga = torch.autograd.grad(out, [qa, ka, va, *a.parameters()], dout)
    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    ref = reference_with_keep(t, c, qt, kt, vt, kpm, mask, keep, p)
    gt = torch.autograd.grad(ref, [qt, kt, vt, *t.parameters()], dout)
    check(out.detach(), ref.detach(), what=f"dropout case {i} out")
    for x, y, n in zip(ga, gt, ["query", "key", "value"] + [n for n, _ in t.named_parameters()]):
        check(x, y, what=f"dropout case {i} d{n}")


def test_dropout_seed_follows_torch_manual_seed():
    a = attn.nn.MultiheadAttention(8, 2, dropout=0.5, dtype=torch.float64)
    x = torch.randn(5, 2, 8, dtype=torch.float64)
    torch.manual_seed(3)
    o1, _ = a(x, x, x)
    o2, _ = a(x, x, x)
    torch.manual_seed(3)
    o3, _ = a(x, x, x)
    assert torch.equal(o1, o3) and not torch.equal(o1, o2)


# ---- gradcheck ----

GRADCHECK = [
    dict(),
    dict(kdim=3, vdim=5),
    dict(add_bias_kv=True, add_zero_attn=True),
    dict(bias=False, batch_first=True),
]


@pytest.mark.parametrize("kw", GRADCHECK, ids=lambda kw: ",".join(kw) or "defaults")
@pytest.mark.parametrize("masks", ["none", "bool", "float", "causal"])
def test_gradcheck(kw, masks):
    torch.manual_seed(0)
    a = attn.nn.MultiheadAttention(4, 2, dtype=torch.float64, **kw)
    bf = kw.get("batch_first", False)
    shape = lambda T, Fd: (2, T, Fd) if bf else (T, 2, Fd)  # noqa: E731
    q = torch.randn(shape(3, 4), dtype=torch.float64, requires_grad=True)
    k = torch.randn(shape(3, kw.get("kdim", 4)), dtype=torch.float64, requires_grad=True)
    v = torch.randn(shape(3, kw.get("vdim", 4)), dtype=torch.float64, requires_grad=True)
    kpm = mask = None
    causal = masks == "causal"
    if masks == "bool":
        kpm = torch.tensor([[False, True, False], [False, False, True]])
    elif masks == "float":
        mask = torch.randn(3, 3, dtype=torch.float64)
    elif causal:
        mask = torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)
    names = [n for n, _ in a.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in a.parameters()]

    def f(q, k, v, *ps):
        return torch.func.functional_call(
            a, dict(zip(names, ps)), (q, k, v),
            dict(key_padding_mask=kpm, attn_mask=mask, need_weights=False, is_causal=causal))[0]

    assert torch.autograd.gradcheck(f, (q, k, v, *params))


def test_unbatched_and_self_attention_gradcheck():
    torch.manual_seed(1)
    a = attn.nn.MultiheadAttention(6, 3, dtype=torch.float64, add_zero_attn=True)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    kpm = torch.tensor([False, False, True, False])
    assert torch.autograd.gradcheck(
        lambda x: a(x, x, x, key_padding_mask=kpm, need_weights=False)[0], (x,))


# ---- the module as a drop-in ----


def test_constructor_and_state_dict_are_torchs():
    assert inspect.signature(attn.nn.MultiheadAttention.__init__) == inspect.signature(
        torch.nn.MultiheadAttention.__init__)
    assert list(inspect.signature(attn.nn.MultiheadAttention.forward).parameters) == list(
        inspect.signature(torch.nn.MultiheadAttention.forward).parameters)
    for kw in [dict(), dict(kdim=3, vdim=5), dict(add_bias_kv=True), dict(bias=False)]:
        torch.manual_seed(0)
        t = torch.nn.MultiheadAttention(8, 2, **kw)
        a = attn.nn.MultiheadAttention(8, 2, **kw)
        assert list(a.state_dict()) == list(t.state_dict())
        assert [n for n, _ in a.named_parameters()] == [n for n, _ in t.named_parameters()]
        for (n, x), (_, y) in zip(a.state_dict().items(), t.state_dict().items()):
            assert x.shape == y.shape and x.dtype == y.dtype, n
        a.load_state_dict(t.state_dict())
        t2 = torch.nn.MultiheadAttention(8, 2, **kw)
        t2.load_state_dict(a.state_dict())
        for x, y in zip(t2.state_dict().values(), t.state_dict().values()):
            assert torch.equal(x, y)


def test_train_eval_switching_reads_dropout_and_batch_first_each_call():
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(8, 2, dropout=0.5, dtype=torch.float64)
    a = attn.nn.MultiheadAttention(8, 2, dropout=0.5, dtype=torch.float64)
    a.load_state_dict(t.state_dict())
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    t.eval(), a.eval()
    assert torch.allclose(a(x, x, x)[0], t(x, x, x)[0], rtol=0, atol=1e-12)
    a.train()
    assert not torch.allclose(a(x, x, x)[0], t(x, x, x)[0])
    a.dropout = 0.0
    assert torch.allclose(a(x, x, x)[0], t(x, x, x)[0], rtol=0, atol=1e-12)
    a.eval()
    a.batch_first = t.batch_first = True
    xb = x.transpose(0, 1).contiguous()
    assert torch.allclose(a(xb, xb, xb)[0], t(xb, xb, xb)[0], rtol=0, atol=1e-12)


def test_refuses_what_it_does_not_run():
    a = attn.nn.MultiheadAttention(8, 2)
    with pytest.raises(TypeError, match="float32, float64, float16 or bfloat16"):
        a(*(torch.ones(3, 2, 8, dtype=torch.int32),) * 3)
    with pytest.raises(TypeError, match="inputs and parameters of one dtype"):
        a(*(torch.randn(3, 2, 8, dtype=torch.float16),) * 3)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        x = torch.randn(3, 2, 8)
        a(x, x, x, is_causal=True)


@pytest.mark.parametrize("batch_first", [True, False])
def test_empty_batches_give_torchs_result(batch_first):
    """A batch of 0 sequences, of 0 queries or of 0 keys: libattn takes no
    empty tensor, and the module (and an encoder layer over it, in either
    grad mode) answers as torch's does, gradients included (with no keys,
    out is out_proj's bias)."""
    torch.manual_seed(0)
    for kw in (dict(), dict(kdim=6, vdim=5), dict(add_bias_kv=True), dict(bias=False)):
        a = attn.nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw)
        t = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw)
        t.load_state_dict(a.state_dict())
        kd, vd = kw.get("kdim", 8), kw.get("vdim", 8)
        for n, L, S in ((0, 4, 4), (3, 0, 5), (3, 4, 0)):
            def make(rows, width):
                x = torch.randn((n, rows, width) if batch_first else (rows, n, width))
                return x.requires_grad_()
            q, k, v = make(L, 8), make(S, kd), make(S, vd)
            for training in (True, False):
                a.train(training), t.train(training)
                out, w = a(q, k, v)
                ref, ref_w = t(q, k, v)
                assert torch.equal(out, ref) and torch.equal(w, ref_w), (kw, n, L, S)
                grads = torch.autograd.grad(out.sum(), (q, k, v, *a.parameters()),
                                            allow_unused=True)
                ref_grads = torch.autograd.grad(ref.sum(), (q, k, v, *t.parameters()),
                                                allow_unused=True)
                for g, r in zip(grads, ref_grads):
                    assert (g is None) == (r is None) and (g is None or torch.equal(g, r))
    layer = attn.nn.TransformerEncoderLayer(8, 2, 16, batch_first=batch_first)
    ref_layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=batch_first)
    ref_layer.load_state_dict(layer.state_dict())
    for shape in ((0, 4, 8), (4, 0, 8)):
        x = torch.randn(shape)
        for training, grad in ((True, True), (False, False)):
            layer.train(training), ref_layer.train(training)
            with torch.set_grad_enabled(grad):
                assert torch.equal(layer(x), ref_layer(x))


@pytest.mark.parametrize("kw", [dict(), dict(average_attn_weights=False),
                                dict(add_bias_kv=True, batch_first=True),
                                dict(kdim=5, vdim=6, mask=True), dict(add_zero_attn=True, kpm=True)])
def test_loss_on_the_weights_gets_torchs_gradients(kw):
    """A loss that reads the returned weights (attention-map distillation,
    a penalty on them): attn's backward flows through the output only, so
    such a call's gradients are torch's, its forward recomputed on the
    saved inputs; gradcheck holds, and so does agreement with torch's
    module on the same parameters. Under attn.patch_torch() a torch module
    trains the same way."""
    kw = dict(kw)
    mask, kpm, avg = kw.pop("mask", False), kw.pop("kpm", False), kw.pop(
        "average_attn_weights", True)
    torch.manual_seed(0)
    a = attn.nn.MultiheadAttention(8, 2, dtype=torch.float64, **kw)
    t = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64, **kw)
    t.load_state_dict(a.state_dict())
    bf = kw.get("batch_first", False)
    shape_q, shape_k = ((2, 3, 8), (2, 4, 8)) if bf else ((3, 2, 8), (4, 2, 8))
    q = torch.randn(shape_q, dtype=torch.float64, requires_grad=True)
    k = torch.randn(shape_k[:-1] + (kw.get("kdim", 8),), dtype=torch.float64, requires_grad=True)
    v = torch.randn(shape_k[:-1] + (kw.get("vdim", 8),), dtype=torch.float64, requires_grad=True)
    extra = dict(average_attn_weights=avg)
    if mask:
        extra["attn_mask"] = torch.randn(3, 4, dtype=torch.float64)
    if kpm:
        extra["key_padding_mask"] = torch.tensor([[False, False, True, False]] * 2)

    def loss(m):
        out, w = m(q, k, v, **extra)
        return out.sin().sum() + (w * torch.linspace(0, 1, w.shape[-1], dtype=w.dtype)).sum()

    params = [p for p in a.parameters()]
    got = torch.autograd.grad(loss(a), [q, k, v, *params])
    want = torch.autograd.grad(loss(t), [q, k, v, *t.parameters()])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    torch.autograd.gradcheck(lambda q, k, v: a(q, k, v, **extra)[1], (q, k, v))
    with attn.patch_torch() as patch:
        again = torch.autograd.grad(loss(t), [q, k, v, *t.parameters()])
    assert patch.routed >= 1
    for g, w in zip(again, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_loss_on_the_weights_under_dropout_raises():
    """With dropout active a recomputation in torch would draw another keep
    mask: the backward through the weights raises, naming the way out."""
    a = attn.nn.MultiheadAttention(8, 2, dropout=0.5, dtype=torch.float64)
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    out, w = a(x, x, x)
    with pytest.raises(NotImplementedError, match="weights.*dropout"):
        (out.sum() + w.square().sum()).backward()
    a.eval()  # no dropout: torch's gradients
    out, w = a(x, x, x)
    (out.sum() + w.square().sum()).backward()
    assert torch.isfinite(x.grad).all()


def test_second_derivative_raises_instead_of_dropping_terms():
    """A gradient penalty through attn's MHA: libattn's backward has no
    derivative of its own, so differentiating the gradient raises, naming
    the module, where it would otherwise lose its second-order terms
    silently (also when dout needs no gradient: out.sum())."""
    torch.manual_seed(0)
    a = attn.nn.MultiheadAttention(8, 2, dtype=torch.float64)
    for make_loss in (lambda out: out.pow(2).sum(), lambda out: out.sum()):
        x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
        out, _ = a(x, x, x)
        g, = torch.autograd.grad(make_loss(out), x, create_graph=True)
        assert g.requires_grad  # as torch's module: the gradient is part of the graph
        with pytest.raises(RuntimeError, match="MultiheadAttention.*second derivative"):
            (out.sum() + g.pow(2).sum()).backward()
    # first order under create_graph=True keeps its values
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    out, _ = a(x, x, x)
    g1, = torch.autograd.grad(out.sum(), x, create_graph=True)
    g2, = torch.autograd.grad(a(x, x, x)[0].sum(), x)
    assert torch.equal(g1.detach(), g2)


def test_import_attn_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import attn, numpy as np\n"
        "m = attn.MultiheadAttention(8, 2); x = np.ones((3, 2, 8), np.float32); m(x, x, x)\n"
        "try:\n    import attn.nn\nexcept ImportError as e:\n    print('ImportError:', e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "attn.nn needs PyTorch" in r.stdout


# ---- _patched_mha_forward on torch's own module ----


def test_patched_forward_runs_torch_module_on_attn():
    torch.manual_seed(0)
    t = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64, add_bias_kv=True, batch_first=True)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    kpm = torch.tensor([[False] * 4 + [True], [False] * 5])
    out, w = attn.nn._patched_mha_forward(t, x, x, x, key_padding_mask=kpm)
    ours = torch.autograd.grad(out.sum(), [x, *t.parameters()])
    ref, wr = t(x, x, x, key_padding_mask=kpm)
    theirs = torch.autograd.grad(ref.sum(), [x, *t.parameters()])
    check(out.detach(), ref.detach(), what="patched out")
    check(w, wr.detach(), what="patched weights")
    for g1, g2 in zip(ours, theirs):
        check(g1, g2, what="patched grads")


def test_patched_forward_falls_back_where_attn_does_not_run():
    t = torch.nn.MultiheadAttention(8, 2, dtype=torch.float32)
    t.out_proj.bias = None  # in_proj_bias without out_proj.bias: not a configuration of attn's
    x = torch.randn(3, 2, 8)
    cls = torch.nn.MultiheadAttention
    calls = []

    def spy(self, *args, **kw):
        calls.append(self)
        return cls.forward(self, *args, **kw)

    cls._attn_original_forward = spy
    try:
        out, _ = attn.nn._patched_mha_forward(t, x, x, x)
    finally:
        del cls._attn_original_forward
    assert calls == [t]
    out2, _ = attn.nn._patched_mha_forward(t, x, x, x)  # no attribute: torch's forward
    assert torch.equal(out, out2)


def test_deepcopy_and_pickle_after_calls():
    import copy
    import pickle

    torch.manual_seed(0)
    a = attn.nn.MultiheadAttention(8, 2, dtype=torch.float64)
    t = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    a(x, x, x)
    attn.nn._patched_mha_forward(t, x, x, x)  # leaves its C modules on t
    for m in (a, t):
        for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
            with torch.no_grad():
                twin.in_proj_weight.mul_(2)  # the copy's own parameters, own C module
            assert not torch.equal(attn.nn._patched_mha_forward(twin, x, x, x)[0],
                                   attn.nn._patched_mha_forward(m, x, x, x)[0])
