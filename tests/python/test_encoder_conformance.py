"""attn.nn.TransformerEncoderLayer / TransformerEncoder against torch's
(PyTorch 2.13) on randomized layers and calls covering every option.

Each case builds a torch layer, gives every parameter random values (torch
starts biases at 0 and LayerNorm at 1, which would leave them untested) and
loads its state_dict() into attn's. Two attn paths are checked on every case:
the whole layer in libattn (no gradient needed: attn_encoder_layer_forward)
and the torch composition around attn.nn.MultiheadAttention (grad enabled).
The reference is torch's layer in float64 on the same values, run with grad
enabled so that torch takes its own composed path, not its fused fast path.
The libattn path: float32 error ≤ 2 × torch's own float32 error + 1e-6
(conformance.check_close), float64 1e-12 relative. The composed path is
torch's float32 ops but for the MHA (checked in test_mha_conformance), so it
is checked in float64 (1e-12 relative): its wiring, not torch's rounding.

No case has a query row whose keys are all masked (torch: NaN, attn: 0;
test_mha_conformance covers that difference).
"""

import copy
import functools

import numpy as np
import pytest
import torch

import attn.nn
import conformance as C

N_ENCODER = 240


def _gen_case(index):
    rng = np.random.default_rng([C.SEED, 3, index])
    nhead = int(rng.choice([1, 2, 3, 4]))
    d_model = nhead * int(rng.integers(1, 9))
    c = dict(
        index=index,
        dtype=np.float32 if rng.random() < 0.8 else np.float64,
        d_model=d_model, nhead=nhead,
        dim_feedforward=int(rng.integers(1, 49)),
        activation=str(rng.choice(["relu", "gelu", "gelu_tanh"])),
        layer_norm_eps=float(rng.choice([1e-5, 1e-12, 1e-3])),
        batch_first=bool(rng.random() < 0.5),
        norm_first=bool(rng.random() < 0.5),
        bias=bool(rng.random() < 0.85),
        unbatched=bool(rng.random() < 0.15),
        N=int(rng.integers(1, 4)),
        L=C.pick_len(rng, cap=24),
        scale=float(rng.choice([0.5, 1.0, 4.0])),
        causal=bool(rng.random() < 0.25),
        mask=str(rng.choice(["none", "bool", "float", "bool3d"], p=[0.45, 0.2, 0.2, 0.15])),
        kpm=str(rng.choice(["none", "bool", "float"], p=[0.5, 0.3, 0.2])),
    )
    c["seed"] = int(rng.integers(0, 2**31))
    return c


CASES = [_gen_case(i) for i in range(N_ENCODER)]


def _torch_activation(name):
    return torch.nn.GELU(approximate="tanh") if name == "gelu_tanh" else name


def _torch_layer(c, dtype):
    torch.manual_seed(c["seed"])
    layer = torch.nn.TransformerEncoderLayer(
        c["d_model"], c["nhead"], c["dim_feedforward"], dropout=0.0,
        activation=_torch_activation(c["activation"]), layer_norm_eps=c["layer_norm_eps"],
        batch_first=c["batch_first"], norm_first=c["norm_first"], bias=c["bias"], dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():  # random values everywhere, biases and norms included
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else 1.0 / np.sqrt(p.shape[-1])))
    return layer


def _inputs(c):
    """src (NumPy, the case's dtype, the case's layout) and masks (NumPy)."""
    rng = np.random.default_rng([C.SEED, 4, c["index"]])
    N, L, E = c["N"], c["L"], c["d_model"]
    shape = (L, E) if c["unbatched"] else ((N, L, E) if c["batch_first"] else (L, N, E))
    src = (rng.standard_normal(shape) * c["scale"]).astype(c["dtype"])
    masks = {}
    # trailing padding; key 0 always visible, so no row is fully masked
    if c["kpm"] != "none":
        n_batch = 1 if c["unbatched"] else N
        pad = np.zeros((n_batch, L), dtype=bool)
        for n in range(n_batch):
            keep = int(rng.integers(1, L + 1))
            pad[n, keep:] = True
        pad = pad[0] if c["unbatched"] else pad
        masks["kpm"] = pad if c["kpm"] == "bool" else np.where(pad, -np.inf, 0).astype(c["dtype"])
    if c["mask"] != "none":
        heads = 1 if c["mask"] != "bool3d" or c["unbatched"] else N * c["nhead"]
        m = rng.random((heads, L, L)) < 0.3
        m[:, :, 0] = False  # key 0 visible to every query
        if c["mask"] == "float":
            m = np.where(m, -np.inf, rng.standard_normal(m.shape)).astype(c["dtype"])
        masks["mask"] = m[0] if c["mask"] != "bool3d" or c["unbatched"] else m
    if c["causal"]:
        tri = np.triu(np.ones((L, L), dtype=bool), 1)
        if "mask" not in masks:
            masks["mask"] = tri
        elif masks["mask"].dtype == bool:
            masks["mask"] = masks["mask"] | tri
        else:
            masks["mask"] = np.where(tri, -np.inf, masks["mask"]).astype(c["dtype"])
    return src, masks


def _call(layer, src, masks, causal):
    t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    mask = masks.get("mask")
    dt = src.dtype if isinstance(src, np.ndarray) else src.numpy().dtype
    if mask is not None and mask.dtype != bool:
        mask = mask.astype(dt)
    kpm = masks.get("kpm")
    if kpm is not None and kpm.dtype != bool:
        kpm = kpm.astype(dt)
    return layer(torch.from_numpy(src) if isinstance(src, np.ndarray) else src,
                 src_mask=t(mask), src_key_padding_mask=t(kpm), is_causal=causal)


@functools.lru_cache(maxsize=None)
def _reference(index):
    c = CASES[index]
    src, masks = _inputs(c)
    t32 = _torch_layer(c, torch.float32 if c["dtype"] == np.float32 else torch.float64)
    t64 = copy.deepcopy(t32).double()
    src64 = np.ascontiguousarray(src, dtype=np.float64)
    m64 = {k: (v if v.dtype == bool else v.astype(np.float64)) for k, v in masks.items()}
    causal = c["causal"] and "mask" in masks
    ref = _call(t64, src64, m64, causal).detach().numpy()  # grad enabled: torch's composed path
    own = _call(t32, np.ascontiguousarray(src), masks, causal).detach().numpy()
    return t32, src, masks, causal, ref, own


def _context(c):
    keys = ("dtype", "d_model", "nhead", "dim_feedforward", "activation", "norm_first",
            "batch_first", "bias", "unbatched", "N", "L", "mask", "kpm", "causal")
    return f"encoder case {c['index']}: " + ", ".join(f"{k}={c[k]}" for k in keys)


def _check(c, ours, ref, own):
    if c["dtype"] == np.float32:
        C.check_close("encoder", "out", ours, ref, own, context=_context(c))
    else:
        C.check_close("encoder", "out", ours, ref, context=_context(c))


@pytest.mark.parametrize("index", range(N_ENCODER))
def test_encoder_layer_matches_torch(index):
    c = CASES[index]
    t32, src, masks, causal, ref, own = _reference(index)
    layer = attn.nn.TransformerEncoderLayer(
        c["d_model"], c["nhead"], c["dim_feedforward"], dropout=0.0, activation=c["activation"],
        layer_norm_eps=c["layer_norm_eps"], batch_first=c["batch_first"],
        norm_first=c["norm_first"], bias=c["bias"], dtype=t32.linear1.weight.dtype)
    layer.load_state_dict(t32.state_dict())
    C.STATS["encoder"]["cases"] += 1
    x = C.torch_input(src, np.random.default_rng([C.SEED, 5, index]))  # sometimes strided
    with torch.no_grad():  # the whole layer in libattn
        assert layer._c_spec(x) is not None
        fused = _call(layer, x, masks, causal)
    _check(c, fused.numpy(), ref, own)
    # grad enabled: torch's ops around attn's MHA, checked in float64 (in
    # float32 its error is torch's own LayerNorm's, which at d_model = 2 and
    # a near-zero variance moves by 1e-5 when its input moves by one ulp)
    layer64 = copy.deepcopy(layer).double()
    x64 = x.double() if x.dtype != torch.float64 else x
    m64 = {k: (v if v.dtype == bool else v.astype(np.float64)) for k, v in masks.items()}
    composed = _call(layer64, x64, m64, causal)
    assert composed.grad_fn is not None
    C.check_close("encoder", "out (composed)", composed.detach().numpy(), ref,
                  context=_context(c))


# ---- float16 / bfloat16 (issue 13): the whole layer in libattn ----

HALF = {"float16": (torch.float16, 2.0**-11), "bfloat16": (torch.bfloat16, 2.0**-8)}
N_HALF = 60  # per dtype: the float32 suite's first cases, in the 16-bit dtype
_TALLY = C.ErrorTally()


@pytest.mark.parametrize("name", list(HALF))
@pytest.mark.parametrize("index", range(N_HALF))
def test_half_encoder_layer_matches_torch(index, name):
    """attn_encoder_layer_forward in float16 / bfloat16 against torch's layer
    in the same dtype, both judged by torch's float64 layer on the same
    rounded parameters, input and masks: attn's largest error within 2x
    torch's plus one rounding of the largest output (as
    test_mha_half_conformance.py, for the same reason), and its RMS error
    over all cases within 1.15x torch's (test_half_encoder_overall; measured
    0.98-1.00 over five seeds: the layer rounds where torch's does)."""
    dt, u = HALF[name]
    c = CASES[index]
    src, masks = _inputs(c)
    t16 = _torch_layer(c, torch.float32).to(dt)
    t64 = copy.deepcopy(t16).double()
    src16 = torch.from_numpy(np.ascontiguousarray(src, np.float32)).to(dt)
    m = {k: (v if v.dtype == bool else v.astype(np.float32)) for k, v in masks.items()}
    causal = c["causal"] and "mask" in masks

    def run(layer, x, cast):
        mm = {k: (torch.from_numpy(v) if v.dtype == bool else cast(torch.from_numpy(v)))
              for k, v in m.items()}
        return layer(x, src_mask=mm.get("mask"), src_key_padding_mask=mm.get("kpm"),
                     is_causal=causal)

    ref = run(t64, src16.double(), lambda t: t.to(dt).double()).detach().double()
    own = run(t16, src16, lambda t: t.to(dt)).detach().double()
    layer = attn.nn.TransformerEncoderLayer(
        c["d_model"], c["nhead"], c["dim_feedforward"], dropout=0.0, activation=c["activation"],
        layer_norm_eps=c["layer_norm_eps"], batch_first=c["batch_first"],
        norm_first=c["norm_first"], bias=c["bias"], dtype=dt).eval()
    layer.load_state_dict(t16.state_dict())
    with torch.no_grad():
        assert layer._c_spec(src16) is not None  # the whole layer in libattn
        ours = run(layer, src16, lambda t: t.to(dt))
    assert ours.dtype == dt
    ours = ours.double()
    assert not ours.isnan().any(), _context(c)
    err, terr = (ours - ref).abs().max().item(), (own - ref).abs().max().item()
    bar = 2 * terr + u * ref.abs().max().item()
    assert err <= bar, f"{name}, {_context(c)}: error {err:.3g}, torch's {terr:.3g}"
    _TALLY.add(name, ours.numpy(), ref.numpy(), own.numpy())


@pytest.mark.parametrize("name", list(HALF))
def test_half_encoder_overall(name):
    """After the cases above (pytest keeps the file's order)."""
    ratio = _TALLY.ratio(name)
    if ratio is None:
        pytest.skip("no 16-bit case ran in this session")
    assert ratio <= 1.15, f"{name}: attn's RMS error over all cases is {ratio:.3f} of torch's"


def test_cases_cover_every_option():
    seen = {k: {str(c[k]) for c in CASES} for k in
            ("activation", "norm_first", "batch_first", "bias", "unbatched", "mask", "kpm",
             "causal", "dtype")}
    assert seen["activation"] == {"relu", "gelu", "gelu_tanh"}
    for k in ("norm_first", "batch_first", "bias", "unbatched", "causal"):
        assert seen[k] == {"True", "False"}, k
    assert seen["mask"] == {"none", "bool", "float", "bool3d"}
    assert seen["kpm"] == {"none", "bool", "float"}
    assert len(seen["dtype"]) == 2


def _stack(n_layers, final_norm, **kw):
    torch.manual_seed(7)
    tl = torch.nn.TransformerEncoderLayer(24, 4, 40, dropout=0.0, **kw)
    norm = torch.nn.LayerNorm(24) if final_norm else None
    t = torch.nn.TransformerEncoder(tl, n_layers, norm=norm, enable_nested_tensor=False)
    with torch.no_grad():
        for p in t.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    al = attn.nn.TransformerEncoderLayer(24, 4, 40, dropout=0.0, **kw)
    a = attn.nn.TransformerEncoder(al, n_layers, norm=copy.deepcopy(norm))
    a.load_state_dict(t.state_dict())
    return t, a


@pytest.mark.parametrize("final_norm", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_encoder_stack_matches_torch(final_norm, causal):
    t, a = _stack(3, final_norm, batch_first=True, activation="gelu")
    assert list(a.state_dict()) == list(t.state_dict())
    x = torch.randn(2, 9, 24)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(9) if causal else None
    t64 = copy.deepcopy(t).double()
    ref = t64(x.double(), mask=None if mask is None else mask.double(),
              is_causal=causal).detach().numpy()
    own = t(x, mask=mask, is_causal=causal).detach().numpy()
    with torch.no_grad():
        ours = a(x, mask=mask, is_causal=causal).numpy()
    C.check_close("encoder", "stack out", ours, ref, own, context=f"causal={causal}")


def test_encoder_trains_like_torch():
    """The composed path's gradients: attn's MHA backward inside torch's
    autograd, against torch's layer, float64 (1e-10 relative)."""
    torch.manual_seed(3)
    t = torch.nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, batch_first=True,
                                         dtype=torch.float64)
    a = attn.nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, batch_first=True,
                                        dtype=torch.float64)
    a.load_state_dict(t.state_dict())
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 7, 16, dtype=torch.float64)
    (t(x) * g).sum().backward()
    gx_t = x.grad.clone()
    x.grad = None
    (a(x) * g).sum().backward()
    scale = max(v.abs().max().item() for v in [gx_t])
    assert (x.grad - gx_t).abs().max().item() <= 1e-10 * scale
    for (name, pt), (_, pa) in zip(t.named_parameters(), a.named_parameters()):
        err = (pa.grad - pt.grad).abs().max().item()
        assert err <= 1e-10 * max(pt.grad.abs().max().item(), 1e-300), name


def test_dropout_in_training_is_seeded_and_scaled():
    """The fused layer in training mode: torch's generator seeds it (same
    seed, same output), and dropout p = 1 on the post-norm layer leaves
    norm2(norm1(src)) — both sublayers dropped entirely."""
    torch.manual_seed(0)
    layer = attn.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5).train()
    x = torch.randn(5, 2, 8)
    with torch.no_grad():
        torch.manual_seed(11)
        a = layer(x)
        torch.manual_seed(11)
        b = layer(x)
        c = layer(x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    drop_all = attn.nn.TransformerEncoderLayer(8, 2, 16, dropout=1.0).train()
    with torch.no_grad():
        out = drop_all(x)
        expect = drop_all.norm2(drop_all.norm1(x))
    assert torch.allclose(out, expect, atol=1e-6)


class _LoRALinear(torch.nn.Linear):
    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.extra = torch.nn.Parameter(torch.randn(n_out, n_in) * 0.1)

    def forward(self, x):
        return super().forward(x) + x @ self.extra.t()


class _ShiftedNorm(torch.nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) + 0.5


class _LeakyReLU(torch.nn.ReLU):
    def forward(self, x):
        return torch.nn.functional.leaky_relu(x, 0.1)


def _swap(layer, name):
    """Replaces one submodule of `layer` by something the C layer does not
    compute, or adds a hook that changes an output."""
    d, f = layer.linear1.in_features, layer.linear1.out_features
    if name == "linear1":
        layer.linear1 = _LoRALinear(d, f)
    elif name == "norm2":
        layer.norm2 = _ShiftedNorm(d)
    elif name == "activation":
        layer.activation = _LeakyReLU()
    elif name == "add_bias_kv":
        layer.self_attn = torch.nn.MultiheadAttention(d, 4, add_bias_kv=True)
    elif name == "add_zero_attn":
        layer.self_attn = torch.nn.MultiheadAttention(d, 4, add_zero_attn=True)
    elif name == "hook":
        layer.linear2.register_forward_hook(lambda m, i, o: o * 2.0)
    elif name == "pre_hook":
        layer.linear1.register_forward_pre_hook(lambda m, i: (i[0] + 1.0,))


@pytest.mark.parametrize("name", ["linear1", "norm2", "activation", "add_bias_kv",
                                  "add_zero_attn", "hook", "pre_hook"])
def test_no_grad_path_runs_what_the_submodules_would(name):
    """Without gradients the layer runs in libattn only where that computes
    what the submodules' forwards would; a subclass with a forward of its
    own, a forward hook, or self_attn's bias_k / zero key send it to torch's
    composition (the C layer had silently skipped them: errors of 0.1-2.5)."""
    torch.manual_seed(5)
    t = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0).eval()
    a = attn.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0).eval()
    torch.manual_seed(6)
    _swap(t, name)
    torch.manual_seed(6)
    _swap(a, name)
    a.load_state_dict(t.state_dict())
    x = torch.randn(6, 3, 16)
    with torch.no_grad():
        want, got = t(x), a(x)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_c_layer_errors_name_the_argument():
    from attn import _attn
    layer = _attn.EncoderLayer(8, 2, 16)
    with pytest.raises(ValueError) as e:
        layer.forward(np.zeros((3, 2, 7), np.float32), empty=np.empty)
    assert e.value.arg == "src"
    with pytest.raises(ValueError) as e:
        layer.forward(np.zeros((3, 2, 8), np.float32), empty=np.empty,
                      src_key_padding_mask=np.zeros((2, 4), bool))
    assert e.value.arg == "src_key_padding_mask"
    with pytest.raises(ValueError) as e:
        layer.forward(np.zeros((3, 2, 8), np.float32), empty=np.empty,
                      src_mask=np.zeros((5, 5), bool))
    assert e.value.arg == "src_mask"
    with pytest.raises(ValueError) as e:
        _attn.EncoderLayer(8, 3)
    assert e.value.arg == "config.nhead"
    with pytest.raises(ValueError):
        _attn.EncoderLayer(8, 2, activation="swish")


@pytest.mark.parametrize("bad", [0, 5, 10, -1])
def test_c_layer_load_refuses_any_wrong_array(bad):
    """load() names a wrong array wherever it stands; the last one once
    released a buffer past the end of its list (a segfault)."""
    from attn import _attn
    layer = _attn.EncoderLayer(8, 2, 16)
    layout = layer.param_layout()
    arrays = [np.zeros(int(np.prod(shape)), np.float32) for _, shape in layout]
    for wrong in (np.zeros(arrays[bad].size + 1, np.float32), arrays[bad].astype(np.float64)):
        given = list(arrays)
        given[bad] = wrong
        with pytest.raises(ValueError, match=f"load\\(\\): {layout[bad][0]} must be"):
            layer.load(given)
    layer.load(arrays)


@pytest.mark.parametrize("kw", [dict(dim_feedforward=0), dict(layer_norm_eps=-1e-7),
                                dict(layer_norm_eps=0.0)])
def test_settings_the_c_layer_refuses_still_compute_as_torch(kw):
    """torch computes a layer with no feed-forward units or a negative eps;
    the C layer refuses both, so such a layer runs torch's composition in
    every grad mode (it raised under no_grad)."""
    torch.manual_seed(0)
    t = torch.nn.TransformerEncoderLayer(16, 4, dropout=0.0, **kw).eval()
    a = attn.nn.TransformerEncoderLayer(16, 4, dropout=0.0, **kw).eval()
    a.load_state_dict(t.state_dict())
    x = torch.randn(5, 2, 16)
    with torch.no_grad():
        want = t(x)
        torch.testing.assert_close(a(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a(x), want, rtol=1e-5, atol=1e-5)
