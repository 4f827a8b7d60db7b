"""attn.MultiheadAttention against torch.nn.MultiheadAttention (PyTorch 2.13)
on randomized modules and calls covering every option.

Each case builds a real torch module, gives every parameter random values
(torch initialises biases to 0, which would leave them untested) and loads
its state_dict() into attn. The float32 reference is the same module in
float64 (parameters and inputs upcast exactly).

Where attn differs from torch by design, the reference is torch given the
equivalent explicit input:
- is_causal: attn applies the causal mask and combines it with attn_mask;
  torch takes is_causal as a hint that attn_mask *is* the causal mask (and
  requires one). Torch gets the combined mask explicitly — with is_causal=True
  when that mask is exactly causal and nothing is appended to the keys,
  is_causal=False otherwise (with add_bias_kv/add_zero_attn, torch's SDPA path
  would apply the causal triangle to the appended keys too, unlike its own
  mask path).
- Rows whose keys are all masked: torch returns NaN on its need_weights path
  and its eval fast path, 0 on its SDPA path; attn returns 0 (so the output
  row is out_proj.bias). Where torch gives NaN, the reference output is torch's
  SDPA path (train mode, dropout 0, need_weights=False) and the reference
  weights are torch's per-head weights with the NaN rows set to 0, averaged
  as torch averages. test_fully_masked_rows_* below show the NaN explicitly.
"""

import collections
import copy
import functools

import numpy as np
import pytest
import torch

import attn
import conformance as C


def _gen_mha_case(index):
    rng = np.random.default_rng([C.SEED, 2, index])
    f = set()
    dt = np.dtype(np.float32 if rng.random() < 0.65 else np.float64)
    f.add(dt.name)
    H = int(rng.integers(1, 5))
    hd = int(rng.integers(1, 7))
    E = H * hd
    if hd == 1:
        f.add("head_dim=1")
    kdim = int(rng.integers(1, 11)) if rng.random() < 0.3 else None
    vdim = int(rng.integers(1, 11)) if rng.random() < 0.3 else None
    if kdim is not None or vdim is not None:
        f.add("kdim/vdim")
    bias = bool(rng.random() < 0.75)
    add_bias_kv = bool(rng.random() < 0.25)
    add_zero_attn = bool(rng.random() < 0.25)
    batch_first = bool(rng.random() < 0.5)
    batched = bool(rng.random() < 0.8)
    f.add("bias" if bias else "no_bias")
    if add_bias_kv:
        f.add("add_bias_kv")
    if add_zero_attn:
        f.add("add_zero_attn")
    f.add("batch_first" if batch_first else "seq_first")
    f.add("batched" if batched else "unbatched")
    N = int(rng.integers(1, 4)) if batched else 1
    L = C.pick_len(rng, cap=9)
    S = C.pick_len(rng, cap=9)
    self_attn = kdim is None and vdim is None and rng.random() < 0.3
    if self_attn:
        S = L
        f.add("self_attention")
    Sx = S + add_bias_kv + add_zero_attn

    def seq(T, F):
        if not batched:
            return rng.standard_normal((T, F)).astype(dt)
        return rng.standard_normal((N, T, F) if batch_first else (T, N, F)).astype(dt)

    query = seq(L, E)
    key = query if self_attn else seq(S, kdim or E)
    value = query if self_attn else seq(S, vdim or E)

    kpm = None
    r = rng.random()
    kpm_kind = "none" if r < 0.5 else "bool" if r < 0.8 else "float"
    if kpm_kind != "none":
        shape = (N, S) if batched else (S,)
        if kpm_kind == "bool":
            kpm = rng.random(shape) < 0.25  # True = ignore
        else:
            kpm = rng.standard_normal(shape).astype(dt)
            kpm[rng.random(shape) < 0.2] = -np.inf
        f.add(f"key_padding_mask_{kpm_kind}")

    mask = None
    r = rng.random()
    mask_rank = 0 if r < 0.45 else 2 if r < 0.75 else 3
    if mask_rank:
        shape = (L, S) if mask_rank == 2 else ((N * H if batched else H), L, S)
        if rng.random() < 0.5:
            mask = rng.random(shape) < 0.25  # True = not allowed
            f.add(f"attn_mask_{mask_rank}d_bool")
        else:
            mask = rng.standard_normal(shape).astype(dt)
            mask[rng.random(shape) < 0.15] = -np.inf
            f.add(f"attn_mask_{mask_rank}d_float")

    if rng.random() < 0.15:  # a fully masked row
        if mask is not None:
            i = int(rng.integers(0, L))
            mask[..., i, :] = True if mask.dtype == np.bool_ else -np.inf
        elif kpm is not None:
            kpm[..., :] = True if kpm.dtype == np.bool_ else -np.inf
        else:
            kpm = np.ones((N, S) if batched else (S,), dtype=bool)
            f.add("key_padding_mask_bool")
        f.add("fully_masked")

    need_weights = bool(rng.random() < 0.6)
    average = bool(rng.random() < 0.6)
    is_causal = bool(rng.random() < 0.3)
    if need_weights:
        f.add("need_weights_avg" if average else "need_weights_per_head")
    else:
        f.add("no_weights")
    if is_causal:
        f.add("is_causal+mask" if mask is not None else "is_causal")
    torch_eval = bool(rng.random() < 0.5)
    f.add("torch_eval" if torch_eval else "torch_train")

    r = rng.random()
    inputs = "numpy" if r < 0.6 else "relayout" if r < 0.85 else "torch"
    f.add(f"inputs_{inputs}")
    sd_as_numpy = bool(rng.random() < 0.3)
    return dict(
        index=index, rng=rng, features=f, dtype=dt, E=E, H=H, kdim=kdim, vdim=vdim, bias=bias,
        add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, batch_first=batch_first,
        batched=batched, N=N, L=L, S=S, Sx=Sx, query=query, key=key, value=value, kpm=kpm,
        mask=mask, need_weights=need_weights, average=average, is_causal=is_causal,
        torch_eval=torch_eval, inputs=inputs, self_attn=self_attn, sd_as_numpy=sd_as_numpy,
    )


def torch_module(c):
    """The float64 torch module of case c, with random parameters that are
    exact in c's dtype."""
    g = torch.Generator().manual_seed(int(c["rng"].integers(2**62)))
    m = torch.nn.MultiheadAttention(
        c["E"], c["H"], dropout=0.0, bias=c["bias"], add_bias_kv=c["add_bias_kv"],
        add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
        batch_first=c["batch_first"], dtype=torch.float64,
    )
    with torch.no_grad():
        for name, p in m.named_parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 4
            std = 1.0 / np.sqrt(fan_in) if "weight" in name else 0.5
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
            p.copy_(p.to(torch.float32 if c["dtype"] == np.float32 else torch.float64))
    return m.train(not c["torch_eval"])


def _torch_masks(c):
    """(key_padding_mask, attn_mask, is_causal) as torch gets them."""
    mask, causal = c["mask"], c["is_causal"]
    torch_causal = False
    if causal:
        hidden = ~C.causal_keep(c["L"], c["S"], "top-left")  # True = not allowed
        appended = c["Sx"] > c["S"]
        if mask is None:
            mask = hidden
            torch_causal = not appended
        elif mask.dtype == np.bool_:
            mask = mask | hidden
        else:
            mask = np.where(hidden, -np.inf, mask)
    t = lambda a: None if a is None else C.as_torch(a)  # noqa: E731
    return t(c["kpm"]), t(mask), torch_causal


def _squeeze_unbatched(c, w):
    return w if c["batched"] else w[0]


def torch_reference(c, module):
    """PyTorch's (out, weights) for case c on `module` (its dtype), with the
    fully-masked-row substitution described in the module docstring."""
    dtype = next(module.parameters()).dtype
    q, k, v = (C.as_torch(c[n]).to(dtype) for n in ("query", "key", "value"))
    if c["self_attn"]:
        k = v = q
    kpm, mask, causal = _torch_masks(c)
    cast = lambda m: None if m is None or m.dtype == torch.bool else m.to(dtype)  # noqa: E731
    kpm = kpm if kpm is None or kpm.dtype == torch.bool else cast(kpm)
    mask = mask if mask is None or mask.dtype == torch.bool else cast(mask)
    kw = dict(key_padding_mask=kpm, attn_mask=mask, is_causal=causal)
    with torch.no_grad():
        out, w = module(q, k, v, need_weights=c["need_weights"],
                        average_attn_weights=c["average"], **kw)
        nan = bool(out.isnan().any()) or (w is not None and bool(w.isnan().any()))
        if nan:
            was = module.training
            module.train(True)
            out, _ = module(q, k, v, need_weights=False, **kw)
            if c["need_weights"]:
                _, w = module(q, k, v, need_weights=True, average_attn_weights=False, **kw)
                w = torch.nan_to_num(w, nan=0.0)
                if c["average"]:
                    w = w.mean(dim=-3)
            module.train(was)
    assert not out.isnan().any(), "torch's SDPA path gave NaN too (test bug)"
    as_np = lambda t: t.double().numpy() if t.dtype == torch.bfloat16 else t.numpy()  # noqa: E731
    return as_np(out), (None if w is None else as_np(w)), nan


@functools.lru_cache(maxsize=None)
def mha_case(index):
    c = _gen_mha_case(index)
    rng = c["rng"]
    c["torch64"] = torch_module(c)
    if c["dtype"] == np.float32:
        c["torch32"] = copy.deepcopy(c["torch64"]).float()
    for n in ("query", "key", "value", "kpm", "mask"):
        a = c[n]
        if a is None:
            c[n + "_in"] = None
        elif c["inputs"] == "torch":
            c[n + "_in"] = C.torch_input(a, rng) if n in ("query", "key", "value") else C.as_torch(a)
        elif c["inputs"] == "relayout" and n in ("query", "key", "value"):
            layout = str(rng.choice(["transposed", "permuted", "strided", "reversed", "fortran"]))
            c[n + "_in"] = C.relayout(a, layout, rng)
        else:
            c[n + "_in"] = a
    if c["self_attn"] and c["inputs"] != "torch":
        c["key_in"] = c["value_in"] = c["query_in"]
    return c


def attn_module(c):
    src = c["torch32"] if c["dtype"] == np.float32 else c["torch64"]
    m = attn.MultiheadAttention(
        c["E"], c["H"], bias=c["bias"], add_bias_kv=c["add_bias_kv"],
        add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
        batch_first=c["batch_first"], dtype=c["dtype"], seed=c["index"],
    )
    sd = src.state_dict()
    if c["sd_as_numpy"]:
        sd = {k: v.numpy() for k, v in sd.items()}
    assert m.load_state_dict(sd) == ([], [])
    if c["torch_eval"]:
        m.eval()
    return m


def case_context(c):
    keys = ("E", "H", "kdim", "vdim", "bias", "add_bias_kv", "add_zero_attn", "batch_first",
            "batched", "query", "key", "value", "kpm", "mask", "need_weights", "average",
            "is_causal", "torch_eval", "inputs")
    return f"mha case {c['index']}, seed {C.SEED}: {C.describe({k: c[k] for k in keys})}"


@pytest.mark.parametrize("index", range(C.N_MHA), ids=lambda i: f"case{i:03d}")
def test_mha_matches_torch(index):
    c = mha_case(index)
    ctx = case_context(c)
    m = attn_module(c)
    out, w = m(
        c["query_in"], c["key_in"], c["value_in"], key_padding_mask=c["kpm_in"],
        need_weights=c["need_weights"], attn_mask=c["mask_in"],
        average_attn_weights=c["average"], is_causal=c["is_causal"],
    )
    assert isinstance(out, np.ndarray) and out.dtype == c["dtype"], ctx
    assert (w is None) == (not c["need_weights"]), ctx
    ref_out, ref_w, nan = torch_reference(c, c["torch64"])
    t32 = (None, None)
    if c["dtype"] == np.float32:
        t32 = torch_reference(c, c["torch32"])[:2]
    C.check_close("mha", "attn_output", out, ref_out, t32[0], context=ctx)
    if c["need_weights"]:
        C.check_close("mha", "attn_output_weights", w, ref_w, t32[1], context=ctx)
    C.STATS["mha"]["cases"] += 1


# Each floor is below the expected count by more than 5 standard deviations.
REQUIRED_MHA = {
    "float32": 150, "float64": 80, "kdim/vdim": 120, "no_bias": 45, "bias": 220,
    "add_bias_kv": 50, "add_zero_attn": 45, "batch_first": 120, "seq_first": 120,
    "batched": 250, "unbatched": 35, "key_padding_mask_bool": 70, "key_padding_mask_float": 30,
    "attn_mask_2d_bool": 25, "attn_mask_2d_float": 25, "attn_mask_3d_bool": 12,
    "attn_mask_3d_float": 12, "need_weights_avg": 100, "need_weights_per_head": 45,
    "no_weights": 90, "is_causal": 12, "is_causal+mask": 15, "fully_masked": 18,
    "self_attention": 15, "torch_eval": 125, "torch_train": 125, "inputs_relayout": 40,
    "inputs_torch": 20, "head_dim=1": 25,
}


def test_mha_cases_cover_every_option():
    counts = collections.Counter()
    for i in range(C.N_MHA):
        counts.update(_gen_mha_case(i)["features"])
    short = {k: (counts[k], n) for k, n in REQUIRED_MHA.items() if counts[k] < n}
    assert not short, f"options drawn too rarely (count, required): {short}"


# ---------------------------------------------------------------------------
# Fully masked rows: torch's NaN, attn's 0, said explicitly
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_fully_masked_rows_torch_nan_attn_zero(need_weights, training):
    """A batch element whose keys are all padded. torch gives NaN on its
    need_weights path and on its eval fast path (and 0 on its SDPA path);
    attn always gives attention 0, so the output row is out_proj.bias and its
    weights are 0."""
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        tm.in_proj_bias.normal_()
        tm.out_proj.bias.normal_()
    tm.train(training)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    kpm = torch.zeros(2, 3, dtype=torch.bool)
    kpm[1] = True  # batch element 1 sees no key
    m = attn.MultiheadAttention(8, 2, batch_first=True, dtype="float64")
    m.load_state_dict(tm.state_dict())
    m.train(training)
    with torch.no_grad():
        t_out, t_w = tm(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
    out, w = m(x, x, x, key_padding_mask=kpm, need_weights=need_weights)
    torch_nan = need_weights or not training  # what torch 2.13 does
    assert bool(t_out[1].isnan().all()) == torch_nan
    if not torch_nan:
        bias = tm.out_proj.bias.detach().numpy()
        np.testing.assert_allclose(t_out[1].numpy(), np.broadcast_to(bias, (3, 8)))
    # attn: the attention is 0, so each row is exactly out_proj.bias ...
    assert np.array_equal(out[1], np.broadcast_to(m.out_proj.bias, out[1].shape))
    # ... the weights of the masked rows are 0, and the other element agrees.
    if need_weights:
        assert np.array_equal(w[1], np.zeros_like(w[1]))
        np.testing.assert_allclose(w[0], t_w[0].numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(out[0], t_out[0].numpy(), rtol=1e-12, atol=1e-14)


def test_fully_masked_row_by_attn_mask_per_head():
    """attn_mask (3-D) masks one query row in one head only: torch's averaged
    weights and the whole output row are NaN; attn's head contributes 0 and
    the other heads are unchanged."""
    torch.manual_seed(1)
    tm = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64).eval()
    m = attn.MultiheadAttention(8, 2, dtype=np.float64).eval()
    m.load_state_dict(tm.state_dict())
    x = torch.randn(4, 1, 8, dtype=torch.float64)
    mask = torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[1, 2, :] = True  # head 1, query 2: every key masked out
    with torch.no_grad():
        t_out, t_w = tm(x, x, x, attn_mask=mask, average_attn_weights=False)
    out, w = m(x, x, x, attn_mask=mask, average_attn_weights=False)
    assert t_out[2].isnan().all() and t_w[0, 1, 2].isnan().all()
    assert np.array_equal(w[0, 1, 2], np.zeros(4))
    ok = ~np.isnan(t_w.numpy())
    np.testing.assert_allclose(w[ok], t_w.numpy()[ok], rtol=1e-12, atol=1e-15)
