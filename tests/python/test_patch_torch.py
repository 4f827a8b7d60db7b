"""attn.patch_torch(): torch.nn.functional.scaled_dot_product_attention (and,
when attn.nn provides one, torch.nn.MultiheadAttention.forward) routed
through attn, with torch's own function for everything attn does not
compute; undo, nesting, training a TransformerEncoder, and the call
patterns of Hugging Face models (simulated: transformers is not a test
dependency)."""

import sys
import types
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attn

TORCH_SDPA = F.scaled_dot_product_attention


def test_patch_routes_and_undoes():
    undo = attn.patch_torch()
    try:
        assert F.scaled_dot_product_attention is not TORCH_SDPA
        q = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
        out = F.scaled_dot_product_attention(q, q, q)
        assert undo.routed == 1 and undo.fell_back == 0
        assert torch.equal(out, attn.scaled_dot_product_attention(q, q, q))
        assert out.grad_fn.name() == "AttnSdpaBackward"
    finally:
        undo()
    assert F.scaled_dot_product_attention is TORCH_SDPA
    undo()  # twice: nothing more to undo
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_context_manager_restores_on_error():
    with pytest.raises(KeyError):
        with attn.patch_torch() as p:
            assert F.scaled_dot_product_attention is not TORCH_SDPA
            raise KeyError
    assert F.scaled_dot_product_attention is TORCH_SDPA and p.routed == 0


def test_nested_patches_restore_exactly_what_was_there():
    outer = attn.patch_torch()
    patched_once = F.scaled_dot_product_attention
    with attn.patch_torch() as inner:
        q = torch.randn(2, 4, 8)
        F.scaled_dot_product_attention(q, q, q)
        assert inner.routed == 1 and outer.routed == 0  # the innermost answers
    assert F.scaled_dot_product_attention is patched_once
    outer()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_nested_patches_count_a_fallen_back_mha_call_in_each():
    """An MHA call that attn leaves to torch (a mask that requires grad)
    counts as fallen back in the inner patch as well as in the outer one,
    as it does under a single patch."""
    pytest.importorskip("attn.nn")
    m = torch.nn.MultiheadAttention(8, 2)
    x, mask = torch.randn(3, 2, 8), torch.zeros(3, 3, requires_grad=True)
    with attn.patch_torch() as outer:
        with attn.patch_torch() as inner:
            m(x, x, x, attn_mask=mask)
            m(x, x, x)
    assert (inner.routed, inner.fell_back) == (1, 1)
    assert (outer.routed, outer.fell_back) == (0, 1)
    with attn.patch_torch() as single:
        m(x, x, x, attn_mask=mask)
    assert (single.routed, single.fell_back) == (0, 1)


def test_export_and_fullgraph_compile_of_a_patched_mha():
    """torch.export and torch.compile(fullgraph=True) trace torch's own MHA
    forward under the patch (FakeTensors and dynamo are torch's), as they do
    without it."""
    pytest.importorskip("attn.nn")
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    want = m(x, x, x, need_weights=False)[0]
    with attn.patch_torch():
        exported = torch.export.export(m, (x, x, x))
        compiled = torch.compile(m, fullgraph=True)
        got = compiled(x, x, x, need_weights=False)[0]
    assert torch.allclose(exported.module()(x, x, x)[0], want, atol=1e-6)
    assert torch.allclose(got, want, atol=1e-6)


def _every_kwarg_case(rng, dtype):
    q = torch.from_numpy(rng.standard_normal((2, 4, 5, 8))).to(dtype)
    k = torch.from_numpy(rng.standard_normal((2, 2, 7, 8))).to(dtype)
    v = torch.from_numpy(rng.standard_normal((2, 2, 7, 3))).to(dtype)
    bool_mask = torch.from_numpy(rng.random((5, 7)) < 0.8)
    bool_mask[:, 0] = True
    float_mask = torch.from_numpy(rng.standard_normal((2, 1, 5, 7))).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        biases = [causal_upper_left(5, 7), causal_lower_right(5, 7)]
    return q, k, v, [None, bool_mask, float_mask] + biases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_kwarg_matches_torch(rng, dtype):
    q, k, v, masks = _every_kwarg_case(rng, dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    calls = [dict(attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
             for mask in masks for is_causal in ([False, True] if mask is None else [False])
             for scale in (None, -0.7)]
    refs = [TORCH_SDPA(q, k, v, **kw) for kw in calls]  # unpatched (a CausalBias needs it)
    with attn.patch_torch() as p:
        for n, (kw, ref) in enumerate(zip(calls, refs), 1):
            ours = F.scaled_dot_product_attention(q, k, v, **kw)
            assert p.routed == n, kw
            torch.testing.assert_close(ours, ref, **tol, msg=str(kw))
        # positional, as torch's own MultiheadAttention calls it
        ours = F.scaled_dot_product_attention(q, k, v, masks[1], 0.0, False, None, True)
        torch.testing.assert_close(ours, TORCH_SDPA(q, k, v, masks[1], enable_gqa=True), **tol)
        # dropout: attn's stream, seeded from torch's generator
        torch.manual_seed(3)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        torch.manual_seed(3)
        assert torch.equal(a, F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))
        # ... and it drops: not the call without dropout, nor another seed's
        assert not torch.allclose(a, F.scaled_dot_product_attention(q, q, q))
        torch.manual_seed(4)
        assert not torch.equal(a, F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))
        assert p.fell_back == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_calls_are_routed(rng, dtype):
    """16-bit calls go to attn, every keyword too: each result within 2x
    torch's own error in that dtype (both against float64) plus an ulp of
    the output's size, where torch happens to be exact."""
    q, k, v, masks = _every_kwarg_case(rng, dtype)
    calls = [dict(attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
             for mask in masks for is_causal in ([False, True] if mask is None else [False])
             for scale in (None, 0.7)]
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    with attn.patch_torch() as p:
        for n, kw in enumerate(calls, 1):
            ours = F.scaled_dot_product_attention(q, k, v, **kw)
            assert p.routed == n and ours.dtype == dtype, kw
            m = kw["attn_mask"]
            if type(m) is not torch.Tensor and m is not None:  # a CausalBias: its bool mask
                m = m._materialize()
            theirs = TORCH_SDPA(q, k, v, **dict(kw, attn_mask=m))
            if m is not None and m.is_floating_point():
                m = m.double()
            exact = TORCH_SDPA(q.double(), k.double(), v.double(), **dict(kw, attn_mask=m))
            e_ours = float((ours.double() - exact).abs().max())
            e_torch = float((theirs.double() - exact).abs().max())
            assert e_ours <= 2 * e_torch + ulp * float(exact.abs().max()), (kw, e_ours, e_torch)
        assert p.fell_back == 0


def test_everything_else_goes_to_torch(rng):
    q = torch.randn(2, 3, 5, 8)
    mask = torch.rand(5, 5) < 0.8
    with attn.patch_torch() as p:
        # mixed dtypes: torch's own error (attn would take a float32 query
        # over 16-bit keys, torch does not)
        for a, b in ((q.half(), q), (q, q.bfloat16())):
            with pytest.raises(RuntimeError, match="same dtype"):
                F.scaled_dot_product_attention(a, b, b)
        assert p.fell_back == 2 and p.routed == 0
        p.fell_back = 0
        cases = [
            lambda: F.scaled_dot_product_attention(q.to("meta"), q.to("meta"), q.to("meta")),
            # L = 0: attn refuses empty tensors, torch returns an empty result
            lambda: F.scaled_dot_product_attention(q[:, :, :0], q, q),
        ]
        for i, call in enumerate(cases, 1):
            call()
            assert p.fell_back == i and p.routed == 0
        # torch's own error for what torch refuses and attn would take: a mask
        # with is_causal, a float mask of another dtype than the query
        n = p.fell_back
        with pytest.raises(RuntimeError, match="Expected attn_mask dtype"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask.double())
        # (torch takes that pair for some shapes and refuses it for others)
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
        assert torch.equal(out, TORCH_SDPA(q, q, q, attn_mask=mask, is_causal=True))
        q3 = q[0].double()
        with pytest.raises(RuntimeError, match="attn_mask should not be set"):
            F.scaled_dot_product_attention(q3, q3, q3, attn_mask=mask, is_causal=True)
        assert p.fell_back == n + 3 and p.routed == 0
        # A CausalBias with a call attn does not take (mixed dtypes): torch's answer, right
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bias = causal_lower_right(5, 5)
        h = q.half()
        with pytest.raises(RuntimeError):  # torch refuses mixed dtypes too
            F.scaled_dot_product_attention(h, q, q, attn_mask=bias)
        assert p.routed == 0
        nt = torch.nested.nested_tensor([torch.randn(2, 4, 8), torch.randn(2, 6, 8)],
                                        layout=torch.jagged).transpose(1, 2)
        n = p.fell_back
        out = F.scaled_dot_product_attention(nt, nt, nt)
        assert p.fell_back == n + 1
    # (torch's nested implementation may itself call F.scaled_dot_product_attention
    # on plain tensors, which attn then computes: the result is torch's all the same)
    ref = TORCH_SDPA(nt, nt, nt)
    for a, b in zip(out.transpose(1, 2).unbind(), ref.transpose(1, 2).unbind()):
        torch.testing.assert_close(a, b)


def test_empty_mha_inputs_go_to_torch():
    """A batch of no sequences, or of sequences of no tokens, through a
    patched nn.MultiheadAttention: torch's own empty result (attn takes no
    empty tensor), as without the patch."""
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    for shape in ((0, 3, 8), (2, 0, 8)):
        x = torch.randn(*shape, requires_grad=True)
        ref, ref_w = m(x, x, x)
        with attn.patch_torch() as p:
            out, w = m(x, x, x)
        assert p.fell_back == 1 and p.routed == 0
        assert out.shape == ref.shape and w.shape == ref_w.shape
        out.sum().backward()  # a graph torch's own forward built
        assert x.grad.shape == x.shape


# ---- a TransformerEncoder trains the same with the patch on or off ----

def _train(batch_first, patched, steps=4):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                             batch_first=batch_first)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    N, L = 3, 6
    x = torch.randn(N, L, 16)
    pad = torch.zeros(N, L, dtype=torch.bool)
    pad[0, 4:] = True  # padding at the end: no row loses every key
    pad[2, 5:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L)
    src = x if batch_first else x.transpose(0, 1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        y = model(src, mask=causal, src_key_padding_mask=pad, is_causal=True)
        loss = (y ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_trains_the_same(batch_first):
    ref_losses, ref_params = _train(batch_first, patched=False)
    with attn.patch_torch() as p:
        losses, params = _train(batch_first, patched=True)
    assert p.routed == 2 * 4 and p.fell_back == 0  # every layer, every step through attn
    torch.testing.assert_close(losses, ref_losses)  # float32's default tolerance
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b)
    assert not torch.equal(losses[0], losses[-1])  # it did train


# ---- Hugging Face's call patterns (simulated) ----

def hf_sdpa_attention(query, key, value, attention_mask, is_causal, dropout=0.0):
    """What transformers' sdpa_attention_forward boils down to: a 4-D float
    additive mask of 0 / finfo.min, or is_causal without a mask, through the
    module attribute torch.nn.functional.scaled_dot_product_attention."""
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
        scale=query.shape[-1] ** -0.5)


def test_hugging_face_call_patterns(rng):
    B, H, L, D = 2, 4, 6, 8
    q, k, v = (torch.from_numpy(rng.standard_normal((B, H, L, D))).float().requires_grad_()
               for _ in range(3))
    padding = torch.ones(B, L, dtype=torch.bool)
    padding[1, :2] = False  # left padding, as generation uses
    allowed = padding[:, None, None, :] & torch.ones(L, L, dtype=torch.bool).tril()
    allowed[1, :, :2, :] = True  # HF unmasks fully masked (padding) rows
    mask4d = torch.zeros(B, 1, L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for kw in (dict(attention_mask=mask4d, is_causal=False),
               dict(attention_mask=None, is_causal=True)):
        ref = hf_sdpa_attention(q, k, v, **kw)
        ref_g = torch.autograd.grad(ref.sum(), (q, k, v))
        with attn.patch_torch() as p:
            out = hf_sdpa_attention(q, k, v, **kw)
            g = torch.autograd.grad(out.sum(), (q, k, v))
        assert p.routed == 1 and p.fell_back == 0
        torch.testing.assert_close(out, ref)
        for a, b in zip(g, ref_g):
            torch.testing.assert_close(a, b)


# ---- MultiheadAttention.forward, when attn.nn provides a routed forward ----

@pytest.fixture
def fake_attn_nn(monkeypatch):
    """attn.nn with a _patched_mha_forward that counts its calls and falls
    back as the real one does, through _attn_original_forward."""
    calls = []

    def _patched_mha_forward(self, *args, **kw):
        calls.append(self)
        return torch.nn.MultiheadAttention._attn_original_forward(self, *args, **kw)

    real = sys.modules.get("attn.nn")
    if real is not None and hasattr(real, "_patched_mha_forward"):
        monkeypatch.setattr(real, "_patched_mha_forward", _patched_mha_forward)
    else:
        module = types.ModuleType("attn.nn")
        module._patched_mha_forward = _patched_mha_forward
        monkeypatch.setitem(sys.modules, "attn.nn", module)
    return calls


def test_mha_forward_is_patched_and_restored(fake_attn_nn):
    MHA = torch.nn.MultiheadAttention
    original = MHA.__dict__["forward"]
    assert "_attn_original_forward" not in MHA.__dict__
    m = MHA(8, 2)
    x = torch.randn(4, 2, 8)
    with attn.patch_torch():
        assert MHA._attn_original_forward.__wrapped__ is original  # counted in fell_back
        with attn.patch_torch():  # nested: torch's own stays the fallback
            assert MHA._attn_original_forward.__wrapped__ is original  # counted in fell_back
            y, _ = m(x, x, x)
        assert len(fake_attn_nn) == 1 and MHA.__dict__["forward"] is not original
    assert MHA.__dict__["forward"] is original
    assert "_attn_original_forward" not in MHA.__dict__
    torch.testing.assert_close(y, m(x, x, x)[0])


def test_without_attn_nn_mha_is_left_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "attn.nn", None)  # import attn.nn fails
    MHA = torch.nn.MultiheadAttention
    original = MHA.__dict__["forward"]
    with attn.patch_torch():
        assert MHA.__dict__["forward"] is original
        assert "_attn_original_forward" not in MHA.__dict__
