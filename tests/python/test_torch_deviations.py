"""Where attn and PyTorch 2.13 part ways, on purpose or because of a PyTorch
limitation, shown side by side. Each test pins down what torch does today and
what attn does instead, so a change on either side is noticed."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import attn


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.fixture
def qkv(rng):
    return (rng.standard_normal((2, 3, 5, 8)), rng.standard_normal((2, 3, 7, 8)),
            rng.standard_normal((2, 3, 7, 4)))


def test_causal_and_mask_combine(qkv, rng):
    """torch refuses is_causal=True with an attn_mask; attn applies both."""
    q, k, v = qkv
    mask = rng.random((5, 7)) < 0.7
    with pytest.raises(RuntimeError, match="attn_mask should not be set"):
        F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(mask), is_causal=True)
    ours = attn.scaled_dot_product_attention(q, k, v, mask, is_causal=True)
    tril = np.tril(np.ones((5, 7), bool))
    ref = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(mask & tril))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("L, S", [(5, 7), (7, 5)])
def test_bottom_right_matches_torch_causal_lower_right(rng, L, S):
    """attn's causal_alignment="bottom-right" is torch's causal_lower_right
    bias (rows with no visible key: 0 in both)."""
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (L, S, S))
    ours = attn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             causal_alignment="bottom-right")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=causal_lower_right(L, S))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-12, atol=1e-14)
    if L > S:
        assert not ours[..., : L - S, :].any()


@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_torch_causal_with_nonpositive_scale_gives_nan(rng, scale):
    """PyTorch 2.13's CPU flash kernel (chosen when E == Ev) returns NaN for
    is_causal=True with a scale <= 0; its math kernel and attn do not."""
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (5, 7, 7))
    torch_flag = F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, scale=scale)
    assert torch_flag.isnan().all()
    ours = attn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    tril = t(np.tril(np.ones((5, 7), bool)))
    ref = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=tril, scale=scale)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-12, atol=1e-14)


def test_one_dimensional_mask(qkv, rng):
    """torch fails on a 1-D mask with 4-D inputs; attn broadcasts it."""
    q, k, v = qkv
    mask = rng.random(7) < 0.7
    mask[0] = True
    with pytest.raises(IndexError):
        F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(mask))
    ours = attn.scaled_dot_product_attention(q, k, v, mask)
    ref = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(mask[None]))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-12, atol=1e-14)


def test_mha_is_causal_without_mask(rng):
    """torch's MHA needs an attn_mask with is_causal (it is only a hint);
    attn applies the causal mask itself."""
    tm = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64).eval()
    m = attn.MultiheadAttention(8, 2, dtype=np.float64).eval()
    m.load_state_dict(tm.state_dict())
    x = t(rng.standard_normal((5, 2, 8)))
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        tm(x, x, x, is_causal=True)
    ours, w = m(x, x, x, is_causal=True)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)  # True = not allowed
    with torch.no_grad():
        ref, tw = tm(x, x, x, attn_mask=causal, is_causal=True)
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(w, tw.numpy(), rtol=1e-12, atol=1e-15)


def test_mha_is_causal_hint_with_appended_keys(rng):
    """With add_bias_kv, torch's own paths disagree under the is_causal hint:
    its need_weights path pads the causal mask so every query sees bias_k,
    its SDPA path (need_weights=False) applies the causal triangle to the
    appended key as well. attn follows the mask path in both cases."""
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True, dtype=torch.float64).train()
    m = attn.MultiheadAttention(8, 2, add_bias_kv=True, dtype=np.float64).train()
    m.load_state_dict(tm.state_dict())
    x = t(rng.standard_normal((4, 1, 8)))
    causal = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)
    with torch.no_grad():
        with_weights, _ = tm(x, x, x, attn_mask=causal, is_causal=True, need_weights=True)
        sdpa_path, _ = tm(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
    assert not torch.allclose(with_weights, sdpa_path)
    for need_weights in (True, False):
        ours, _ = m(x, x, x, is_causal=True, need_weights=need_weights)
        np.testing.assert_allclose(ours, with_weights.numpy(), rtol=1e-12, atol=1e-14)


def test_sdpa_weights_broadcast_over_value_batch(rng):
    """attn's weights have the output's batch shape (value's batch dims
    broadcast in), like the output itself."""
    q = rng.standard_normal((3, 4, 8))
    k = rng.standard_normal((3, 6, 8))
    v = rng.standard_normal((2, 3, 6, 5))
    out, w = attn.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert out.shape == (2, 3, 4, 5) and w.shape == (2, 3, 4, 6)
    assert np.array_equal(w[0], w[1])
    np.testing.assert_allclose(out, w @ v, rtol=1e-13, atol=1e-14)
