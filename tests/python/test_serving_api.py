"""The serving API of the Python package: the score modifiers of
attn.scaled_dot_product_attention (window_size, alibi_slopes, softcap, sinks,
with autograd), attn.varlen_attention and attn.attention_with_kvcache.

Shapes, dtypes, NumPy in / NumPy out and torch in / torch out, errors that
name the Python argument, the in-place append into the caller's own cache
arrays, paged caches, hostile arguments (each a clear exception, never a
crash), and spot checks against a float64 formula written in torch below.
The large random conformance suite is tests/python/test_serving_conformance.py.
"""

import math

import numpy as np
import pytest
import torch

import attn

F64 = torch.float64


# ---------------------------------------------------------------------------
# The formula: float64, explicit masks and biases
# ---------------------------------------------------------------------------


def reference(q, k, v, scale=None, causal=False, window=(-1, -1), alibi=None, softcap=0.0,
              sinks=None):
    """(out, lse) of q (H, L, E) against k (Hkv, S, E), v (Hkv, S, Ev), in
    float64, positions aligned bottom-right as FlashAttention aligns them.
    alibi and sinks: (H,). Differentiable in every tensor."""
    q, k, v = (torch.as_tensor(x).to(F64) for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    s = (1 / math.sqrt(E) if scale is None else scale) * q @ k.transpose(-1, -2)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    dist = torch.arange(L).view(L, 1) + S - L - torch.arange(S).view(1, S)  # i + S - L - j
    if alibi is not None:
        s = s - torch.as_tensor(alibi).to(F64)[:, None, None] * dist.abs()
    keep = torch.ones(L, S, dtype=torch.bool)
    if causal:
        keep &= dist >= 0
    if window[0] >= 0:
        keep &= dist <= window[0]
    if window[1] >= 0:
        keep &= -dist <= window[1]
    s = s.masked_fill(~keep, -math.inf)
    if sinks is not None:
        sink = torch.as_tensor(sinks).to(F64)[:, None, None].expand(*s.shape[:-1], 1)
        s = torch.cat([s, sink], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # a row with no key: all 0
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


def close(ours, ref, dtype):
    tol = 1e-12 if dtype in (np.float64, F64) else 2e-5
    np.testing.assert_allclose(np.asarray(ours, dtype=np.float64), np.asarray(ref), rtol=tol,
                               atol=tol)


def randn(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------
# scaled_dot_product_attention's score modifiers
# ---------------------------------------------------------------------------

MODIFIERS = [
    dict(window_size=(2, 1)),
    dict(window_size=(0, -1), is_causal=True),
    dict(alibi_slopes=np.array([0.5, 0.25, 0.125])),
    dict(softcap=1.5),
    dict(sinks=np.array([0.3, -1.0, 2.0])),
    dict(window_size=(3, 0), softcap=2.0, alibi_slopes=np.array([0.1, 0.2, 0.4]),
         sinks=np.array([1.0, 0.0, -0.5]), is_causal=True),
]


def _ref_kwargs(kw):
    return dict(causal=kw.get("is_causal", False), window=kw.get("window_size", (-1, -1)),
                alibi=kw.get("alibi_slopes"), softcap=kw.get("softcap", 0.0),
                sinks=kw.get("sinks"))


@pytest.mark.parametrize("kw", MODIFIERS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sdpa_modifiers_match_the_formula(rng, kw, dtype):
    q, k, v = randn(rng, 2, 3, 5, 8, dtype=dtype), randn(rng, 2, 3, 7, 8, dtype=dtype), \
        randn(rng, 2, 3, 7, 4, dtype=dtype)
    kw = dict(kw)
    if kw.get("is_causal"):
        kw["causal_alignment"] = "bottom-right"  # FlashAttention's, as the window is
    out, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    assert isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == (2, 3, 5, 4)
    ref_out, ref_lse = reference(q, k, v, **_ref_kwargs(kw))
    close(out, ref_out, dtype)
    close(lse, ref_lse, dtype)


def test_sdpa_alibi_slopes_per_batch_and_torch_in_torch_out(rng):
    q, k, v = (torch.from_numpy(randn(rng, 2, 3, 4, 8)) for _ in range(3))
    slopes = torch.rand(2, 3, dtype=F64)
    out = attn.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3, 4, 8)
    for b in range(2):
        close(out[b], reference(q[b], k[b], v[b], alibi=slopes[b])[0], F64)


def test_sdpa_a_torch_sinks_tensor_makes_the_call_a_torch_call(rng):
    q = randn(rng, 2, 4, 8)
    out = attn.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(2, dtype=F64))
    assert isinstance(out, torch.Tensor)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sdpa_16_bit_slopes_and_sinks_act_as_their_float32_values(rng, dtype):
    # attn.h takes slopes and sinks of any float dtype; Python refused 16-bit
    # ones ("expected float32 or float64"), so a bfloat16 model's own sinks
    # parameter could not be passed. The call must equal the one with the
    # same values widened, and the sinks' gradient comes back in their dtype.
    tdt = getattr(torch, dtype)
    q, k, v = (torch.tensor(randn(rng, 1, 4, n, 8), dtype=torch.float32) for n in (5, 7, 7))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).to(tdt)
    sinks = torch.tensor([0.3, -1.0, 2.0, 0.0]).to(tdt).requires_grad_()
    wide = sinks.detach().float().requires_grad_()
    out = attn.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, sinks=sinks)
    want = attn.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes.float(), sinks=wide)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.sum().backward()
    want.sum().backward()
    assert sinks.grad.dtype == tdt
    torch.testing.assert_close(sinks.grad, wide.grad.to(tdt), rtol=0, atol=0)
    if dtype == "float16":  # NumPy float16 too, and through varlen
        got = attn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(),
                                                alibi_slopes=slopes.numpy(),
                                                sinks=sinks.detach().numpy())
        np.testing.assert_array_equal(got, want.detach().numpy())
        pack = [x[0].transpose(0, 1).contiguous().numpy() for x in (q, k, v)]
        cu_q, cu_k = np.array([0, 5], np.int32), np.array([0, 7], np.int32)
        got = attn.varlen_attention(*pack, cu_q, cu_k, 5, 7, alibi_slopes=slopes.numpy(),
                                    sinks=sinks.detach().numpy())
        np.testing.assert_array_equal(got, want.detach()[0].transpose(0, 1).numpy())


def test_sdpa_sink_row_without_keys_gives_zero_and_lse_sink(rng):
    q = randn(rng, 2, 3, 8)
    sinks = np.array([0.7, -2.0])
    out, lse = attn.scaled_dot_product_attention(
        q, q, q, attn_mask=np.zeros((3, 3), bool), sinks=sinks, return_lse=True)
    assert (out == 0).all()
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[:, None], (2, 3)))


def test_sdpa_gradcheck_with_every_modifier():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(2, 3, 7, 4, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(2, 3, 7, 2, generator=g, dtype=F64, requires_grad=True)
    sinks = torch.randn(3, generator=g, dtype=F64, requires_grad=True)
    slopes = torch.rand(3, generator=g, dtype=F64)

    def f(q, k, v, sinks):
        return attn.scaled_dot_product_attention(
            q, k, v, is_causal=True, causal_alignment="bottom-right", window_size=(3, 1),
            softcap=2.0, alibi_slopes=slopes, sinks=sinks)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_sdpa_gradients_match_the_formula_and_slopes_get_none(rng):
    def leaves():
        g = torch.Generator().manual_seed(2)
        return [torch.randn(*s, generator=g, dtype=F64, requires_grad=True)
                for s in ((3, 6, 8), (3, 9, 8), (3, 9, 5), (3,), (3,))]

    kw = dict(window_size=(4, 2), softcap=3.0)
    q, k, v, sinks, slopes = leaves()
    out = attn.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes, sinks=sinks, **kw)
    (out * out).sum().backward()
    assert slopes.grad is None  # no gradient for ALiBi slopes, as in FlashAttention
    rq, rk, rv, rsinks, rslopes = leaves()
    r, _ = reference(rq, rk, rv, window=(4, 2), softcap=3.0, alibi=rslopes.detach(),
                     sinks=rsinks)
    (r * r).sum().backward()
    for ours, ref in ((q, rq), (k, rk), (v, rv), (sinks, rsinks)):
        close(ours.grad, ref.grad, F64)


def test_sdpa_opcheck_with_modifiers():
    from attn import _torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=F64, requires_grad=True)
    kv = torch.randn(2, 3, 6, 8, generator=g, dtype=F64, requires_grad=True)
    sinks = torch.randn(3, generator=g, dtype=F64, requires_grad=True)
    slopes = torch.rand(3, generator=g, dtype=F64)
    seed = _torch.seed_tensor(5)
    args = (q, kv, kv, None, 0.0, 2, None, False, seed, False, 2, 1, slopes, 1.5, sinks)
    torch.library.opcheck(torch.ops.attn.sdpa.default, args)
    out, _, lse = torch.ops.attn.sdpa(*args)
    torch.library.opcheck(
        torch.ops.attn.sdpa_backward.default,
        (torch.ones_like(out), q.detach(), kv.detach(), kv.detach(), out.detach(), lse, None,
         0.0, 2, None, False, seed, True, True, True, False, 2, 1, slopes, 1.5, sinks.detach(),
         True),
    )


def test_sdpa_torch_compile_with_modifiers_matches_eager():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(*s, generator=g, dtype=F64) for s in ((2, 4, 6, 8), (2, 2, 9, 8),
                                                              (2, 2, 9, 5), (4,))]

    def f(q, k, v, sinks):
        out = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, window_size=(2, 2),
                                                softcap=5.0, sinks=sinks)
        return (out.sin() * 3).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    res = {}
    for name, fn in (("eager", f), ("compiled", compiled)):
        xs = [x.clone().requires_grad_() for x in base]
        loss = fn(*xs)
        loss.backward()
        res[name] = (loss.detach(), [x.grad for x in xs])
    torch.testing.assert_close(res["compiled"][0], res["eager"][0], rtol=0, atol=0)
    for a, b in zip(res["compiled"][1], res["eager"][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kw, exc, arg, match", [
    (dict(window_size=(-2, 0)), ValueError, None, "window_size .* -2"),
    (dict(window_size=(0, -5)), ValueError, None, "window_size .*right size is -5"),
    (dict(window_size=3), TypeError, None, "window_size must be a pair"),
    (dict(window_size=(1.0, 2)), TypeError, None, r"window_size\[0\] \(left\) must be an int"),
    (dict(window_size=(1, 2, 3)), TypeError, None, "window_size must be a pair"),
    (dict(softcap=-1.0), ValueError, None, "softcap is -1.0"),
    (dict(softcap=float("nan")), ValueError, None, "softcap is nan"),
    (dict(softcap=True), TypeError, None, "softcap must be a float"),
    (dict(alibi_slopes=np.ones(3, np.int32)), TypeError, None, "alibi_slopes has dtype int32"),
    (dict(alibi_slopes=np.ones(5)), ValueError, "alibi_slopes", "alibi_slopes"),
    (dict(sinks=np.ones((4, 4))), ValueError, "sinks", "sinks"),
    (dict(sinks="x"), TypeError, None, "sinks has dtype"),
])
def test_sdpa_modifier_errors_name_the_argument(rng, kw, exc, arg, match):
    q = randn(rng, 2, 3, 4, 8)
    with pytest.raises(exc, match=match) as e:
        attn.scaled_dot_product_attention(q, q, q, **kw)
    if arg is not None:
        assert e.value.arg == arg


# ---------------------------------------------------------------------------
# varlen_attention
# ---------------------------------------------------------------------------


def varlen_reference(q, k, v, cu_q, cu_k, causal=False, window=(-1, -1), alibi=None,
                     softcap=0.0, sinks=None, scale=None):
    """Each packed sequence unpacked, attended alone, packed back; rows no
    sequence holds stay 0 (lse -inf)."""
    q, k, v = (torch.as_tensor(x).to(F64) for x in (q, k, v))
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=F64)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=F64)
    for n in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        if qs.start == qs.stop:
            continue
        slopes = None if alibi is None else (alibi if np.ndim(alibi) == 1 else alibi[n])
        if ks.start == ks.stop:  # no key: out 0, lse -inf (or the sink)
            lse[:, qs] = -math.inf if sinks is None else torch.as_tensor(sinks)[:, None]
            continue
        o, l = reference(q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
                         scale, causal, window, slopes, softcap, sinks)
        out[qs] = o.transpose(0, 1)
        lse[:, qs] = l
    return out, lse


def varlen_case(rng, lens_q, lens_k, hq=4, hkv=2, e=8, ev=6, dtype=np.float64, extra_q=0):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = randn(rng, int(cu_q[-1]) + extra_q, hq, e, dtype=dtype)
    k = randn(rng, int(cu_k[-1]), hkv, e, dtype=dtype)
    v = randn(rng, int(cu_k[-1]), hkv, ev, dtype=dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True),
    dict(causal=True, window_size=(3, 0)),
    dict(window_size=(1, 2), softcap=2.5, softmax_scale=0.3),
    dict(alibi_slopes=np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8],
                                [0.9, 1.0, 1.1, 1.2]]), sinks=np.array([0.5, -1, 0, 2.0])),
])
def test_varlen_matches_each_sequence_alone(rng, dtype, kw):
    q, k, v, cu_q, cu_k = varlen_case(rng, [3, 1, 5], [4, 6, 2], dtype=dtype, extra_q=2)
    out, lse = attn.varlen_attention(q, k, v, cu_q, cu_k, 5, 6, return_softmax_lse=True, **kw)
    assert isinstance(out, np.ndarray) and out.shape == (q.shape[0], 4, 6) and out.dtype == dtype
    assert lse.shape == (4, q.shape[0]) and lse.dtype == dtype
    ref_out, ref_lse = varlen_reference(
        q, k, v, cu_q, cu_k, kw.get("causal", False), kw.get("window_size", (-1, -1)),
        kw.get("alibi_slopes"), kw.get("softcap", 0.0), kw.get("sinks"), kw.get("softmax_scale"))
    close(out, ref_out, dtype)
    close(lse, ref_lse, dtype)
    assert (out[cu_q[-1]:] == 0).all() and (lse[:, cu_q[-1]:] == -np.inf).all()


def test_varlen_empty_sequences_and_torch_in_torch_out(rng):
    q, k, v, cu_q, cu_k = varlen_case(rng, [2, 0, 3], [3, 4, 0])
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    out = attn.varlen_attention(tq, tk, tv, torch.from_numpy(cu_q), torch.from_numpy(cu_k), 3,
                                4, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == F64 and out.shape == (5, 4, 6)
    close(out, varlen_reference(q, k, v, cu_q, cu_k, causal=True)[0], F64)


def test_varlen_offsets_of_any_integer_type_and_lists(rng):
    q, k, v, cu_q, cu_k = varlen_case(rng, [2, 3], [3, 4])
    want = attn.varlen_attention(q, k, v, cu_q, cu_k, 3, 4)
    for cq, ck in ((cu_q.astype(np.int64), cu_k.astype(np.uint8)), (list(cu_q), list(cu_k)),
                   (torch.tensor(cu_q.tolist()), torch.tensor(cu_k.tolist()))):
        np.testing.assert_array_equal(attn.varlen_attention(q, k, v, cq, ck, 3, 4), want)


def test_varlen_dropout_is_reproducible(rng):
    q, k, v, cu_q, cu_k = varlen_case(rng, [4, 4], [6, 6])
    a = attn.varlen_attention(q, k, v, cu_q, cu_k, 4, 6, dropout_p=0.5, seed=11)
    b = attn.varlen_attention(q, k, v, cu_q, cu_k, 4, 6, dropout_p=0.5, seed=11)
    c = attn.varlen_attention(q, k, v, cu_q, cu_k, 4, 6)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def _varlen_error(rng, exc, match, arg=None, **changes):
    q, k, v, cu_q, cu_k = varlen_case(rng, [2, 3], [3, 4])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3,
                max_seqlen_k=4)
    args.update(changes)
    with pytest.raises(exc, match=match) as e:
        attn.varlen_attention(**args)
    if arg is not None:
        assert e.value.arg == arg
    return e.value


@pytest.mark.parametrize("changes, exc, match, arg", [
    (dict(cu_seqlens_q=np.array([0, 3, 2], np.int32)), ValueError, "cu_seqlens_q",
     "cu_seqlens_q"),
    (dict(cu_seqlens_q=np.array([1, 2, 5], np.int32)), ValueError, "cu_seqlens_q",
     "cu_seqlens_q"),
    (dict(cu_seqlens_k=np.array([0, 3, 99], np.int32)), ValueError, "cu_seqlens_k",
     "cu_seqlens_k"),
    (dict(cu_seqlens_k=np.array([0, -3, 7], np.int32)), ValueError, "cu_seqlens_k",
     "cu_seqlens_k"),
    (dict(cu_seqlens_k=np.array([0, 3], np.int32)), ValueError, "cu_seqlens",
     None),  # one sequence of keys for two of queries
    (dict(cu_seqlens_q=np.array([[0, 2, 5]], np.int32)), ValueError, "cu_seqlens_q",
     "cu_seqlens_q"),
    # 0-d: it passed as (1,), an empty batch, before
    (dict(cu_seqlens_q=np.array(0), cu_seqlens_k=np.array(0)), ValueError,
     "cu_seqlens_q has rank 0", "cu_seqlens_q"),
    # no sequence: the one offset must still be 0 (it passed, and lse came back 0, not -inf)
    (dict(cu_seqlens_q=np.array([5], np.int32), cu_seqlens_k=np.array([5], np.int32)),
     ValueError, r"cu_seqlens_q\[0\] is 5", "cu_seqlens_q"),
    (dict(cu_seqlens_q=np.array([0], np.int32), cu_seqlens_k=np.array([-3], np.int32)),
     ValueError, r"cu_seqlens_k\[0\] is -3", "cu_seqlens_k"),
    (dict(max_seqlen_q=2), ValueError, "max_seqlen_q", "max_seqlen_q"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k is -1", None),
    (dict(max_seqlen_k=3.0), TypeError, "max_seqlen_k must be an int", None),
    (dict(cu_seqlens_q=np.array([0.0, 2, 5])), TypeError, "cu_seqlens_q has dtype float64",
     None),
    (dict(cu_seqlens_q=np.array([0, 2, 2**40])), ValueError, "does not fit in int32", None),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale is inf", None),
    (dict(dropout_p=1.5), ValueError, "dropout_p is 1.5", None),
    (dict(causal=1), TypeError, "causal must be a bool", None),
    (dict(window_size=(-3, 0)), ValueError, "window_size", None),
    (dict(q=np.zeros((5, 4))), ValueError, "q has 2 dimensions", None),
    (dict(v=np.zeros((7, 2, 6), np.float32)), TypeError, "", "v"),
    (dict(k=np.zeros((7, 3, 8)), v=np.zeros((7, 3, 6))), ValueError, "", "k"),  # 4 % 3
])
def test_varlen_hostile_arguments_name_the_argument(rng, changes, exc, match, arg):
    _varlen_error(rng, exc, match, arg, **changes)


def test_varlen_records_gradients_for_inputs_that_require_grad(rng):
    """A torch q that requires grad beside NumPy k and v: the result is in
    the graph and q gets its gradient (test_varlen_backward.py checks the
    values); under no_grad nothing is recorded."""
    q, k, v, cu_q, cu_k = varlen_case(rng, [2, 3], [3, 4])
    tq = torch.from_numpy(q).requires_grad_()
    out = attn.varlen_attention(tq, k, v, cu_q, cu_k, 3, 4)
    assert isinstance(out, torch.Tensor) and out.grad_fn is not None
    out.sum().backward()
    assert tq.grad.shape == tq.shape and torch.isfinite(tq.grad).all()
    with torch.no_grad():  # no graph
        plain = attn.varlen_attention(tq, k, v, cu_q, cu_k, 3, 4)
    assert isinstance(plain, torch.Tensor) and plain.grad_fn is None
    torch.testing.assert_close(out.detach(), plain, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------
# attention_with_kvcache
# ---------------------------------------------------------------------------


def kvcache_reference(q, k_cache, v_cache, seqlens, causal=True, window=(-1, -1), alibi=None,
                      softcap=0.0, sinks=None, block_table=None, scale=None):
    """Each sequence's filled rows gathered (through the block table when
    paged) and attended alone; q (B, Lq, Hq, E)."""
    q = torch.as_tensor(q).to(F64)
    kc, vc = (torch.as_tensor(x).to(F64) for x in (k_cache, v_cache))
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(seqlens[b])
        if block_table is None:
            kb, vb = kc[b, :n], vc[b, :n]
        else:
            bs = kc.shape[1]
            rows = [(int(block_table[b][r // bs]), r % bs) for r in range(n)]
            kb = torch.stack([kc[i, j] for i, j in rows])
            vb = torch.stack([vc[i, j] for i, j in rows])
        slopes = None if alibi is None else (alibi if np.ndim(alibi) == 1 else alibi[b])
        o, l = reference(q[b].transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1), scale,
                         causal, window, slopes, softcap, sinks)
        outs.append(o.transpose(0, 1))
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def test_kvcache_appends_in_place_and_attends_to_every_row(rng):
    B, S_max, Hq, Hkv, E = 2, 10, 4, 2, 8
    k_cache, v_cache = randn(rng, B, S_max, Hkv, E), randn(rng, B, S_max, Hkv, E)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    q, k, v = randn(rng, B, 2, Hq, E), randn(rng, B, 2, Hkv, E), randn(rng, B, 2, Hkv, E)
    seqlens = np.array([3, 6], np.int32)
    out, lse = attn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                           return_softmax_lse=True)
    assert out.shape == (B, 2, Hq, E) and lse.shape == (B, Hq, 2)
    for b in range(B):  # the new rows are in the caller's arrays, nothing else moved
        n = seqlens[b]
        np.testing.assert_array_equal(k_cache[b, n:n + 2], k[b])
        np.testing.assert_array_equal(v_cache[b, n:n + 2], v[b])
        rest = np.ones(S_max, bool)
        rest[n:n + 2] = False
        np.testing.assert_array_equal(k_cache[b, rest], before_k[b, rest])
        np.testing.assert_array_equal(v_cache[b, rest], before_v[b, rest])
    ref_out, ref_lse = kvcache_reference(q, k_cache, v_cache, seqlens + 2)
    close(out, ref_out, np.float64)
    close(lse, ref_lse, np.float64)
    np.testing.assert_array_equal(seqlens, [3, 6])  # not advanced: the caller's job


def test_kvcache_torch_caches_in_place_and_torch_out(rng):
    k_cache = torch.zeros(2, 8, 1, 4)
    v_cache = torch.zeros(2, 8, 1, 4)
    q, k, v = (torch.randn(2, 1, 2, 4) for _ in range(3))
    k, v = k[:, :, :1], v[:, :, :1]
    out = attn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=5)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 1, 2, 4)
    assert torch.equal(k_cache[:, 5:6], k) and torch.equal(v_cache[:, 5:6], v)
    assert (k_cache[:, :5] == 0).all() and (k_cache[:, 6:] == 0).all()
    close(out, kvcache_reference(q, k_cache, v_cache, [6, 6])[0], np.float32)


@pytest.mark.parametrize("negated", ["k_cache", "v_cache"])
def test_kvcache_a_negated_view_cache_is_refused_when_written(negated):
    """A negated view's memory holds -x: its NumPy view is a copy, so rows
    appended to it were lost (and its version bumped) with no error. Read
    only (no new rows), it is read as its values."""
    caches = dict(k_cache=torch.zeros(1, 4, 1, 4), v_cache=torch.zeros(1, 4, 1, 4))
    caches[negated] = torch.zeros(1, 4, 1, 4, dtype=torch.complex64).conj().imag
    caches[negated][:, :2] = torch.randn(1, 2, 1, 4)  # through the view, as torch writes
    assert caches[negated].is_neg()
    q, k, v = (torch.randn(1, 1, 1, 4) for _ in range(3))
    with pytest.raises(TypeError, match=f"{negated} is a negated view"):
        attn.attention_with_kvcache(q, **caches, k=k, v=v, cache_seqlens=2)
    assert (caches[negated][:, 2:] == 0).all()
    out = attn.attention_with_kvcache(q, **caches, cache_seqlens=2)
    resolved = {n: c.resolve_neg() for n, c in caches.items()}
    assert torch.equal(out, attn.attention_with_kvcache(q, **resolved, cache_seqlens=2))


def test_kvcache_a_strided_view_of_a_cache_is_written_where_it_lies(rng):
    big_k, big_v = np.zeros((2, 12, 2, 8)), np.zeros((2, 12, 2, 8))
    k_cache, v_cache = big_k[:, ::2], big_v[:, ::2]  # every other row: strided, not a copy
    q, k, v = randn(rng, 2, 1, 2, 8), randn(rng, 2, 1, 2, 8), randn(rng, 2, 1, 2, 8)
    attn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=[1, 4])
    np.testing.assert_array_equal(big_k[0, 2], k[0, 0])
    np.testing.assert_array_equal(big_v[1, 8], v[1, 0])
    assert np.count_nonzero(big_k) == k.size


@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16"])
def test_kvcache_16_bit_caches_store_rounded_rows(rng, cache_dtype):
    tdt = getattr(torch, cache_dtype)
    k_cache = torch.from_numpy(randn(rng, 2, 9, 2, 8)).to(tdt)
    v_cache = torch.from_numpy(randn(rng, 2, 9, 2, 8)).to(tdt)
    q, k, v = (torch.from_numpy(randn(rng, 2, 3, 4, 8, dtype=np.float32)) for _ in range(3))
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()
    out = attn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=4)
    assert out.dtype == torch.float32
    assert torch.equal(k_cache[:, 4:7], k.to(tdt)) and torch.equal(v_cache[:, 4:7], v.to(tdt))
    close(out, kvcache_reference(q, k_cache.double(), v_cache.double(), [7, 7])[0], np.float32)


def test_kvcache_numpy_float16_cache(rng):
    k_cache = randn(rng, 1, 6, 1, 4, dtype=np.float16)
    v_cache = randn(rng, 1, 6, 1, 4, dtype=np.float16)
    q, k, v = randn(rng, 1, 1, 1, 4), randn(rng, 1, 1, 1, 4), randn(rng, 1, 1, 1, 4)
    out = attn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=2)
    np.testing.assert_array_equal(k_cache[0, 2], k[0, 0].astype(np.float16))
    close(out, kvcache_reference(q, k_cache, v_cache, [3])[0], np.float64)


def paged_case(rng, B=3, block_size=4, max_blocks=3, Hkv=2, E=8):
    """A paged cache whose blocks are shuffled among sequences, and the
    same cache laid out contiguously."""
    num_blocks = B * max_blocks + 2
    table = rng.permutation(num_blocks)[:B * max_blocks].reshape(B, max_blocks).astype(np.int32)
    k_pages, v_pages = randn(rng, num_blocks, block_size, Hkv, E), \
        randn(rng, num_blocks, block_size, Hkv, E)
    k_flat = k_pages[table].reshape(B, max_blocks * block_size, Hkv, E)
    v_flat = v_pages[table].reshape(B, max_blocks * block_size, Hkv, E)
    return table, k_pages, v_pages, k_flat.copy(), v_flat.copy()


@pytest.mark.parametrize("kw", [dict(), dict(causal=False, window_size=(3, -1)),
                                dict(softcap=1.5, sinks=np.array([0.2, 0.4, -1.0, 0.0]),
                                     alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05]))])
def test_kvcache_paged_equals_contiguous(rng, kw):
    table, k_pages, v_pages, k_flat, v_flat = paged_case(rng)
    q = randn(rng, 3, 2, 4, 8)
    k, v = randn(rng, 3, 2, 2, 8), randn(rng, 3, 2, 2, 8)
    seqlens = np.array([0, 5, 9], np.int32)
    paged = attn.attention_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=seqlens,
                                        block_table=table, **kw)
    flat = attn.attention_with_kvcache(q, k_flat, v_flat, k, v, cache_seqlens=seqlens, **kw)
    np.testing.assert_allclose(paged, flat, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(k_pages[table].reshape(k_flat.shape), k_flat)  # same appends
    ref = kvcache_reference(q, k_pages, v_pages, seqlens + 2, kw.get("causal", True),
                            kw.get("window_size", (-1, -1)), kw.get("alibi_slopes"),
                            kw.get("softcap", 0.0), kw.get("sinks"), block_table=table)[0]
    close(paged, ref, np.float64)


def test_kvcache_without_new_rows_reads_a_read_only_cache(rng):
    k_cache, v_cache = randn(rng, 2, 5, 1, 4), randn(rng, 2, 5, 1, 4)
    k_cache.flags.writeable = v_cache.flags.writeable = False  # nothing is written
    q = randn(rng, 2, 1, 2, 4)
    out = attn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=[2, 5])
    close(out, kvcache_reference(q, k_cache, v_cache, [2, 5])[0], np.float64)
    full = attn.attention_with_kvcache(q, k_cache.tolist(), v_cache, causal=False)
    close(full, kvcache_reference(q, k_cache, v_cache, [5, 5], causal=False)[0], np.float64)


def _kv_args(rng, **changes):
    args = dict(q=randn(rng, 2, 1, 2, 4), k_cache=randn(rng, 2, 6, 1, 4),
                v_cache=randn(rng, 2, 6, 1, 4), k=randn(rng, 2, 1, 1, 4),
                v=randn(rng, 2, 1, 1, 4), cache_seqlens=np.array([1, 2], np.int32))
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, exc, match, arg", [
    (dict(cache_seqlens=np.array([1, 6], np.int32)), ValueError, "cache_seqlens",
     "cache_seqlens"),  # 6 + 1 new row > S_max = 6
    (dict(cache_seqlens=np.array([1, -1], np.int32)), ValueError, "cache_seqlens",
     "cache_seqlens"),
    (dict(cache_seqlens=np.array([1, 2, 3], np.int32)), ValueError, "cache_seqlens",
     "cache_seqlens"),
    (dict(cache_seqlens=-1), ValueError, "cache_seqlens is -1", None),
    (dict(cache_seqlens=np.array(1)), ValueError, "cache_seqlens has rank 0",
     "cache_seqlens"),  # 0-d: it passed as (1,) for one sequence, misnamed for two
    (dict(cache_seqlens=1.0), TypeError, "cache_seqlens has dtype float64", None),
    (dict(cache_seqlens=None), ValueError, "cache_seqlens", None),  # new rows need it
    (dict(window_size=(-7, 1)), ValueError, "window_size", None),
    (dict(v=None), ValueError, "k is given without v", None),
    (dict(k=None), ValueError, "v is given without k", None),
    (dict(q=np.zeros((2, 2, 4))), ValueError, "q has 3 dimensions", None),
    (dict(q=np.zeros((2, 1, 2, 4), np.int16)), TypeError, "q has dtype int16", None),
    (dict(k=np.zeros((2, 1, 1, 5))), ValueError, "", "k"),
    (dict(v_cache=np.zeros((2, 6, 1, 4), np.float32)), TypeError, "", None),
    (dict(k_cache=[[[[0.0] * 4]] * 6] * 2), TypeError, "k_cache is a list", None),
    (dict(k_cache=np.zeros((2, 6, 1, 4), ">f8")), ValueError, "foreign byte order", None),
    (dict(k_cache=np.broadcast_to(np.zeros(4), (2, 6, 1, 4))), ValueError, "read-only", None),
    (dict(k_cache=np.zeros((2, 6, 1, 4), np.int16)), TypeError, "k_cache has dtype int16",
     None),
    (dict(softmax_scale="x"), TypeError, "softmax_scale must be None or a float", None),
    (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes", "alibi_slopes"),
])
def test_kvcache_hostile_arguments_name_the_argument(rng, changes, exc, match, arg):
    args = _kv_args(rng, **changes)
    before = [np.array(args[n], copy=True) for n in ("k_cache", "v_cache")]
    with pytest.raises(exc, match=match) as e:
        attn.attention_with_kvcache(**args)
    if arg is not None:
        assert e.value.arg == arg
    for n, b in zip(("k_cache", "v_cache"), before):  # a refused call writes nothing
        np.testing.assert_array_equal(np.asarray(args[n]), b)


@pytest.mark.parametrize("table, match", [
    (np.array([[0, 1], [2, 99]], np.int32), "block_table"),
    (np.array([[0, 1], [2, -1]], np.int32), "block_table"),
    (np.array([[0, 1], [2, 0]], np.int32), "block_table"),  # both write block 0's row 3
    (np.array([[0, 1, 2]], np.int32), "block_table"),
])
def test_kvcache_hostile_block_tables(rng, table, match):
    k_pages, v_pages = randn(rng, 4, 4, 1, 4), randn(rng, 4, 4, 1, 4)
    before = k_pages.copy()
    q, k, v = randn(rng, 2, 1, 2, 4), randn(rng, 2, 1, 1, 4), randn(rng, 2, 1, 1, 4)
    with pytest.raises(ValueError, match=match) as e:
        attn.attention_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=[3, 7],
                                    block_table=table)
    assert e.value.arg == "block_table"
    np.testing.assert_array_equal(k_pages, before)


def test_kvcache_refuses_inputs_that_require_grad(rng):
    args = _kv_args(rng)
    args["q"] = torch.from_numpy(args["q"]).requires_grad_()
    with pytest.raises(RuntimeError, match="q requires grad.*no backward"):
        attn.attention_with_kvcache(**args)
    args = _kv_args(rng)
    args["k"] = torch.from_numpy(args["k"]).requires_grad_()
    with pytest.raises(RuntimeError, match="k requires grad"):
        attn.attention_with_kvcache(**args)


def test_kvcache_cache_seqlens_int_broadcasts(rng):
    a, b = _kv_args(rng), None
    b = {n: (np.array(x, copy=True) if isinstance(x, np.ndarray) else x) for n, x in a.items()}
    b["cache_seqlens"] = 2
    a["cache_seqlens"] = np.array([2, 2], np.int32)
    np.testing.assert_array_equal(attn.attention_with_kvcache(**a),
                                  attn.attention_with_kvcache(**b))


def test_docs_serving_example_runs():
    """docs/python.md's Serving example runs and does what its comments say."""
    import os
    import re

    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")).read()
    section = doc[doc.index("### Serving:"):]
    code = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    ns = {}
    exec(code, ns)
    assert ns["out"].shape == (9, 8, 64) and ns["lse"].shape == (8, 9)
    assert ns["out1"].shape == (2, 1, 8, 64)
    np.testing.assert_array_equal(ns["k_cache"][7, 1], ns["k1"][0, 0])
    np.testing.assert_array_equal(ns["seqlens"], [6, 10])
