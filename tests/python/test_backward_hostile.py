"""Hostile arguments of the backward entry points: attn._attn.sdpa_backward
(the binding of attn_sdpa_backward) and the autograd path of
attn.scaled_dot_product_attention."""

import numpy as np
import pytest
import torch

import attn
from attn import _attn


@pytest.fixture
def fwd(rng):
    """A forward call's inputs and outputs (float64, float mask)."""
    q = rng.standard_normal((2, 3, 5, 8))
    k = rng.standard_normal((2, 3, 7, 8))
    v = rng.standard_normal((2, 3, 7, 4))
    mask = rng.standard_normal((5, 7))
    out, _, lse = _attn.sdpa(q, k, v, empty=np.empty, attn_mask=mask, want_lse=True)
    dout = rng.standard_normal(out.shape)
    return dict(dout=dout, query=q, key=k, value=v, out=out, lse=lse, attn_mask=mask)


def backward(f, **kw):
    args = [f[n] for n in ("dout", "query", "key", "value", "out", "lse")]
    kw.setdefault("attn_mask", f["attn_mask"])
    return _attn.sdpa_backward(*args, empty=np.empty, **kw)


def test_gradients_are_shaped_like_their_inputs(fwd):
    dq, dk, dv, dmask = backward(fwd, want_dmask=True)
    for g, n in ((dq, "query"), (dk, "key"), (dv, "value"), (dmask, "attn_mask")):
        assert g.shape == fwd[n].shape and g.dtype == fwd[n].dtype and g.flags.c_contiguous
    none = backward(fwd, want_dq=False, want_dk=False, want_dv=False)
    assert none == (None, None, None, None)


@pytest.mark.parametrize("name, bad, exc, status, match", [
    ("dout", lambda a: a[..., :3], ValueError, "ATTN_ERR_SHAPE",
     r"dout has shape \(2, 3, 5, 3\); expected \(2, 3, 5, 4\)"),
    ("dout", lambda a: a.astype(np.float32), TypeError, "ATTN_ERR_DTYPE", "dout is float32"),
    ("out", lambda a: a[:1], ValueError, "ATTN_ERR_SHAPE", "out has shape"),
    ("lse", lambda a: a[..., None], ValueError, "ATTN_ERR_SHAPE", "lse has shape"),
    ("lse", lambda a: a.astype(np.float32), TypeError, "ATTN_ERR_DTYPE", "lse is float32"),
    ("key", lambda a: a[..., :6], ValueError, "ATTN_ERR_SHAPE", "key.shape"),
])
def test_wrong_shapes_and_dtypes_are_refused(fwd, name, bad, exc, status, match):
    f = dict(fwd)
    f[name] = bad(f[name])
    with pytest.raises(exc, match=match) as e:
        backward(f)
    assert e.value.status_name == status and e.value.arg == name


def test_dmask_needs_a_float_mask(fwd):
    with pytest.raises(ValueError, match="dmask is the gradient of a float attn_mask, but it is "
                                         "bool") as e:
        backward(fwd, attn_mask=fwd["attn_mask"] > 0, want_dmask=True)
    assert e.value.arg == "dmask" and e.value.status_name == "ATTN_ERR_INVALID"
    with pytest.raises(ValueError, match="but it is not given"):
        backward(fwd, attn_mask=None, want_dmask=True)


def test_non_contiguous_and_broadcast_operands_are_read_in_place(fwd):
    ref = backward(fwd, want_dmask=True)
    f = {n: np.asfortranarray(a) if a.ndim > 1 else a for n, a in fwd.items()}
    f["dout"] = np.broadcast_to(fwd["dout"][:1], fwd["dout"].shape)  # zero strides
    f2 = dict(fwd, dout=np.ascontiguousarray(f["dout"]))
    got, want = backward(f, want_dmask=True), backward(f2, want_dmask=True)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)
    assert not np.allclose(ref[0], got[0])  # a different dout: a real check
    # Misaligned (copied first) and transposed-in-memory gradient inputs.
    raw = np.zeros(fwd["dout"].nbytes + 1, np.uint8)
    mis = raw[1:].view(np.float64).reshape(fwd["dout"].shape)
    mis[...] = fwd["dout"]
    copies = _attn._copies()
    for a, b in zip(backward(dict(fwd, dout=mis), want_dmask=True), ref):
        assert np.array_equal(a, b)
    assert _attn._copies() == copies + 1


def test_options_must_match_the_forward(fwd):
    """The backward trusts out and lse to be the forward's: with other
    options the gradients are of another function (documented), but values
    out of range are still refused."""
    with pytest.raises(ValueError, match="dropout_p") as e:
        backward(fwd, dropout_p=1.5)
    assert e.value.status_name == "ATTN_ERR_INVALID"
    with pytest.raises(ValueError, match="scale"):
        backward(fwd, scale=float("nan"))
    with pytest.raises(TypeError, match="missing required keyword-only argument: 'empty'"):
        _attn.sdpa_backward(*(fwd[n] for n in ("dout", "query", "key", "value", "out", "lse")))


def test_nan_follows_the_documented_rules(rng):
    """NaN in a masked-out key or value reaches no gradient; NaN in one that
    takes part gives NaN where it flows."""
    q = rng.standard_normal((1, 4, 8))
    k = rng.standard_normal((1, 6, 8))
    v = rng.standard_normal((1, 6, 4))
    mask = np.ones((4, 6), bool)
    mask[:, 5] = False
    k[0, 5, 0] = v[0, 5, 1] = np.nan
    out, _, lse = _attn.sdpa(q, k, v, empty=np.empty, attn_mask=mask, want_lse=True)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv, _ = _attn.sdpa_backward(dout, q, k, v, out, lse, empty=np.empty, attn_mask=mask)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert (dk[0, 5] == 0).all() and (dv[0, 5] == 0).all()
    # ... and the rest are the gradients of the same call on a finite key 5
    kf, vf = k.copy(), v.copy()
    kf[0, 5, 0] = vf[0, 5, 1] = 7.0
    outf, _, lsef = _attn.sdpa(q, kf, vf, empty=np.empty, attn_mask=mask, want_lse=True)
    want = _attn.sdpa_backward(dout, q, kf, vf, outf, lsef, empty=np.empty, attn_mask=mask)
    for got, ref in zip((dq, dk[:, :5], dv[:, :5]), (want[0], want[1][:, :5], want[2][:, :5])):
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    mask[:, 5] = True
    mask[1:, 5] = False  # key 5 takes part for query 0 only
    out, _, lse = _attn.sdpa(q, k, v, empty=np.empty, attn_mask=mask, want_lse=True)
    dq, dk, dv, _ = _attn.sdpa_backward(dout, q, k, v, out, lse, empty=np.empty, attn_mask=mask)
    assert np.isnan(dq[0, 0]).any() and np.isfinite(dq[0, 1:]).all()


def test_wrong_output_allocator_is_refused(fwd):
    with pytest.raises(RuntimeError, match="wrong dq buffer"):
        _attn.sdpa_backward(*(fwd[n] for n in ("dout", "query", "key", "value", "out", "lse")),
                            empty=lambda shape, dtype: np.empty(3))


def test_autograd_with_a_non_contiguous_and_expanded_upstream_gradient(rng):
    q = torch.from_numpy(rng.standard_normal((2, 5, 8))).requires_grad_()
    out = attn.scaled_dot_product_attention(q, q, q)
    g_exp = torch.ones(1, 1, 8, dtype=torch.float64).expand(2, 5, 8)  # zero strides
    g_t = torch.from_numpy(rng.standard_normal((2, 8, 5))).transpose(-1, -2)
    for g in (g_exp, g_t):
        (ours,) = torch.autograd.grad(out, q, g, retain_graph=True)
        qq = q.detach().requires_grad_()
        ref_out = torch.nn.functional.scaled_dot_product_attention(qq, qq, qq)
        (ref,) = torch.autograd.grad(ref_out, qq, g)
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-13)


def test_autograd_refuses_what_the_forward_refuses(rng):
    q = torch.from_numpy(rng.standard_normal((2, 5, 8))).requires_grad_()
    with pytest.raises(TypeError, match="query, key and value must share one dtype"):
        attn.scaled_dot_product_attention(q, q.float(), q)
    with pytest.raises(ValueError, match="key.shape") as e:
        attn.scaled_dot_product_attention(q, q[..., :4], q)
    assert e.value.arg == "key"
    with pytest.raises(TypeError,
                       match="query has dtype int64; expected float16, bfloat16, float32 or float64"):
        attn.scaled_dot_product_attention(torch.ones(2, 5, 8, dtype=torch.int64), q, q)
