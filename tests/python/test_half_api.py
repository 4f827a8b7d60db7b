"""float16 and bfloat16 beyond the forward conformance suite (issue 13):
the backward against PyTorch's in the same dtype, autograd, varlen and KV
cache calls, the .npy files of the attn tool, and the dtype rules' errors."""

import os
import subprocess

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attn

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CLI = os.environ.get("ATTN_CLI", os.path.join(ROOT, "build", "tools", "attn"))
HALVES = (torch.float16, torch.bfloat16)


def _err(x, exact):
    return float((x.double() - exact).abs().max())


# ---- the backward ----


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_backward_within_twice_torch(dtype, rng):
    """Gradients of 100 random cases (masks, causal, GQA, scale) against the
    float64 gradients of the same rounded inputs: attn's error within 2x
    PyTorch's own backward in the same dtype (+ a slack of 2 ulps of the
    gradient's size, where torch happens to be exact)."""
    worst = 0.0
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    for case in range(100):
        H, Hkv = (4, 2) if case % 3 == 0 else (2, 2)
        L, S, E = (int(x) for x in rng.integers(1, 40, 3))
        gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
        q = torch.randn(2, H, L, E, generator=gen).to(dtype)
        k = torch.randn(2, Hkv, S, E, generator=gen).to(dtype)
        v = torch.randn(2, Hkv, S, E, generator=gen).to(dtype)
        dout = torch.randn(2, H, L, E, generator=gen).to(dtype)
        kw = dict(enable_gqa=H != Hkv, scale=float(rng.choice([0.3, 1.0 / np.sqrt(E), -0.5])))
        mask = None
        if case % 4 == 1:
            mask = torch.randn(L, S, generator=gen).to(dtype)
        elif case % 4 == 2 and L <= S:
            kw["is_causal"] = True
            kw["scale"] = abs(kw["scale"])  # torch's CPU kernel: NaN for causal scale <= 0

        def grads(fn, cast):
            leaves = [x.detach().to(cast).requires_grad_() for x in (q, k, v)]
            m = None if mask is None else mask.to(cast)
            out = fn(*leaves, attn_mask=m, **kw)
            out.backward(dout.to(cast))
            return [x.grad for x in leaves]

        exact = grads(F.scaled_dot_product_attention, torch.float64)
        ours = grads(attn.scaled_dot_product_attention, dtype)
        theirs = grads(F.scaled_dot_product_attention, dtype)
        for name, o, t, x in zip("qkv", ours, theirs, exact):
            assert o.dtype == dtype
            assert not torch.isnan(o).any(), f"case {case}: d{name} has NaN"
            slack = 2 * ulp * float(x.abs().max())
            e_ours, e_torch = _err(o, x), _err(t, x)
            bar = 2 * e_torch + slack  # 0 only where the exact gradient is 0 and torch's too
            worst = max(worst, e_ours / bar if bar > 0 else float(e_ours > 0))
            assert e_ours <= bar, (
                f"case {case} (L {L} S {S} E {E} {kw} mask {mask is not None}): d{name} error "
                f"{e_ours:.3g}, torch's {e_torch:.3g}")
    print(f"{dtype}: worst gradient error / bar {worst:.3f}")


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_backward_d_comes_from_the_unrounded_output(dtype):
    """D = rowsum(dout · out) taken from the 16-bit out carried the output's
    rounding into every dS of its row: with Ev much wider than E (where
    PyTorch's math path runs, forming D from unrounded weights) dk was 5x
    and dq 2x PyTorch's error in bfloat16. attn now forms D from the output
    computed again in float32: within 1.25x PyTorch's error, no slack, for
    attn_sdpa_backward and attn_sdpa_varlen_backward alike."""
    for seed, (L, S, E, Ev, mag, causal) in enumerate(
            [(64, 8, 16, 256, 3.0, False), (33, 65, 64, 32, 1.0, True), (40, 40, 8, 128, 2.0, True)]):
        gen = torch.Generator().manual_seed(seed)
        q = (torch.randn(1, 2, L, E, generator=gen) * mag).to(dtype)
        k = (torch.randn(1, 2, S, E, generator=gen) * mag).to(dtype)
        v, dout = (torch.randn(1, 2, n, Ev, generator=gen).to(dtype) for n in (S, L))

        def grads(fn, cast, **kw):
            leaves = [x.detach().to(cast).requires_grad_() for x in (q, k, v)]
            fn(*leaves, is_causal=causal, **kw).backward(dout.to(cast))
            return [x.grad for x in leaves]

        def varlen(q, k, v, is_causal):  # the same heads as packed sequences
            cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (L, S))
            out = attn.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                        v[0].transpose(0, 1), cu_q, cu_k, L, S, causal=is_causal)
            return out.transpose(0, 1)[None]

        exact = grads(F.scaled_dot_product_attention, torch.float64)
        theirs = grads(F.scaled_dot_product_attention, dtype)
        # (varlen's causal mask is aligned bottom-right, torch's top-left)
        for fn in (attn.scaled_dot_product_attention,) + ((varlen,) if L == S or not causal else ()):
            for name, o, t, x in zip("qkv", grads(fn, dtype), theirs, exact):
                e_ours, e_torch = _err(o, x), _err(t, x)
                assert e_ours <= 2 * e_torch, (
                    f"{fn.__name__} (L {L} S {S} E {E} Ev {Ev}): d{name} error {e_ours:.3g}, "
                    f"torch's {e_torch:.3g}")


def test_gradcheck_style_bfloat16_matches_float32_copies():
    """attn's bfloat16 gradient is its float32 gradient of the same values,
    rounded once (the C tests hold this on every kernel path)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen).bfloat16() for _ in range(3))
    dout = torch.randn(1, 2, 9, 16, generator=gen).bfloat16()
    half = [x.clone().requires_grad_() for x in (q, k, v)]
    attn.scaled_dot_product_attention(*half, is_causal=True).backward(dout)
    wide = [x.float().requires_grad_() for x in (q, k, v)]
    attn.scaled_dot_product_attention(*wide, is_causal=True).backward(dout.float())
    for h, w in zip(half, wide):
        assert torch.equal(h.grad, w.grad.bfloat16())


# ---- NumPy: float16 and ml_dtypes' bfloat16 in, the same out ----


def test_numpy_half_dtypes_round_trip(rng):
    q, k, v = (rng.standard_normal((2, 3, 6, 8)) for _ in range(3))
    for dt in (np.float16, ml_dtypes.bfloat16):
        qh, kh, vh = (x.astype(dt) for x in (q, k, v))
        out, w, lse = attn.scaled_dot_product_attention(qh, kh, vh, return_weights=True,
                                                        return_lse=True)
        assert out.dtype == dt and w.dtype == dt and lse.dtype == np.float32
        # the float32 computation on the same values, rounded once
        wide = attn.scaled_dot_product_attention(*(x.astype(np.float32) for x in (qh, kh, vh)))
        assert np.array_equal(out, wide.astype(dt))
        # torch tensors of the same dtype give the same bits
        td = torch.float16 if dt == np.float16 else torch.bfloat16
        tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(td) for x in (qh, kh, vh))
        tout = attn.scaled_dot_product_attention(tq, tk, tv)
        assert tout.dtype == td
        assert np.array_equal(tout.float().numpy(), out.astype(np.float32))


def test_byteswapped_bfloat16_is_read_by_value(rng):
    """An ml_dtypes bfloat16 array in the other byte order holds the same
    values: they are swapped into this machine's order before use, and the
    result comes back in native order."""
    x = rng.standard_normal((2, 5, 8)).astype(ml_dtypes.bfloat16)
    swapped = x.astype(x.dtype.newbyteorder("S"))
    assert not swapped.dtype.isnative and np.array_equal(swapped.astype(np.float32),
                                                         x.astype(np.float32))
    out = attn.scaled_dot_product_attention(swapped, x, swapped)
    assert out.dtype == np.dtype(ml_dtypes.bfloat16) and out.dtype.isnative
    assert np.array_equal(out, attn.scaled_dot_product_attention(x, x, x))


def test_float32_query_over_half_kv(rng):
    q = rng.standard_normal((1, 4, 3, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 50, 8)).astype(ml_dtypes.bfloat16) for _ in range(2))
    out = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert out.dtype == np.float32
    ref = attn.scaled_dot_product_attention(q, k.astype(np.float32), v.astype(np.float32),
                                            enable_gqa=True)
    assert np.array_equal(out, ref)


def test_dtype_rules_name_what_breaks_them(rng):
    x32 = rng.standard_normal((2, 4, 8)).astype(np.float32)
    x16 = x32.astype(np.float16)
    xb = x32.astype(ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match="must share one dtype.*got float16, float32 and float32"):
        attn.scaled_dot_product_attention(x16, x32, x32)
    with pytest.raises(TypeError, match="got float32, float16 and bfloat16"):
        attn.scaled_dot_product_attention(x32, x16, xb)
    with pytest.raises(TypeError, match="got float64, bfloat16 and bfloat16"):
        attn.scaled_dot_product_attention(x32.astype(np.float64), xb, xb)
    with pytest.raises(TypeError, match="query has dtype int16"):
        attn.scaled_dot_product_attention(x32.astype(np.int16), x32, x32)


# ---- varlen and the KV cache ----


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_varlen_and_kvcache_in_half(dtype, rng):
    gen = torch.Generator().manual_seed(11)
    lens = [5, 1, 9]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    q, k, v = (torch.randn(sum(lens), 4, 16, generator=gen).to(dtype) for _ in range(3))
    out = attn.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert out.dtype == dtype
    for n in range(len(lens)):  # each sequence alone, through the same float32 computation
        a, b = int(cu[n]), int(cu[n + 1])
        one = attn.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True,
            causal_alignment="bottom-right")
        assert torch.equal(out[a:b], one.transpose(0, 1))

    cache_k = torch.zeros(2, 32, 2, 16, dtype=dtype)
    cache_v = torch.zeros(2, 32, 2, 16, dtype=dtype)
    qd = torch.randn(2, 1, 4, 16, generator=gen).to(dtype)
    kn, vn = (torch.randn(2, 1, 2, 16, generator=gen).to(dtype) for _ in range(2))
    out = attn.attention_with_kvcache(qd, cache_k, cache_v, k=kn, v=vn, cache_seqlens=0)
    assert out.dtype == dtype and torch.equal(cache_k[:, 0], kn[:, 0])
    # one key: the output is its value, exactly (GQA: 2 query heads per KV head)
    assert torch.equal(out[:, 0], vn[:, 0].repeat_interleave(2, dim=1))
    # a byte-swapped bfloat16 cache is read by value (and refused where it would be written)
    npk = cache_k.float().numpy().astype(ml_dtypes.bfloat16)
    npv = cache_v.float().numpy().astype(ml_dtypes.bfloat16)
    swap = [c.astype(c.dtype.newbyteorder("S")) for c in (npk, npv)]
    qn = qd.float().numpy()
    assert np.array_equal(attn.attention_with_kvcache(qn, *swap, cache_seqlens=1),
                          attn.attention_with_kvcache(qn, npk, npv, cache_seqlens=1))
    with pytest.raises(ValueError, match="foreign byte order"):
        attn.attention_with_kvcache(qn, *swap, k=kn.float().numpy(), v=vn.float().numpy(),
                                    cache_seqlens=1)
    with pytest.raises(TypeError, match="new rows come in q's dtype"):
        attn.attention_with_kvcache(qd, cache_k, cache_v, k=kn.float(), v=vn.float(),
                                    cache_seqlens=1)


# ---- the attn tool: .npy float16 ----


@pytest.mark.skipif(not os.access(CLI, os.X_OK), reason=f"the attn tool is not built at {CLI}")
def test_cli_float16_npy(tmp_path, rng):
    arrays = {n: rng.standard_normal(s).astype(np.float16)
              for n, s in (("q", (2, 5, 8)), ("k", (2, 7, 8)), ("v", (2, 7, 4)))}
    for n, a in arrays.items():
        np.save(tmp_path / f"{n}.npy", a)
    out, w, png = tmp_path / "out.npy", tmp_path / "w.npy", tmp_path / "w.png"
    r = subprocess.run([CLI, "sdpa", "-q", tmp_path / "q.npy", "-k", tmp_path / "k.npy", "-v",
                        tmp_path / "v.npy", "-o", out, "--weights", w, "--causal"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "float16" in r.stdout
    got, weights = np.load(out), np.load(w)
    assert got.dtype == np.float16 and weights.dtype == np.float16
    ref = attn.scaled_dot_product_attention(*arrays.values(), is_causal=True)
    assert np.array_equal(got, ref)
    r = subprocess.run([CLI, "heatmap", "-w", w, "-o", png, "--grid"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_float32_query_over_empty_half_kv_gives_an_empty_float32_result(dt):
    """attn's own dtype rule (a float32 query over 16-bit K/V) holds for
    empty batches too: torch's answer for the same values in float32, with
    gradients in K/V's dtype; torch's builtin refuses mixed dtypes."""
    for B, L, S in ((0, 3, 5), (1, 0, 5), (1, 3, 0)):
        q = torch.randn(B, 2, L, 8, requires_grad=True)
        k, v = (torch.randn(B, 2, S, 8).to(dt).requires_grad_() for _ in range(2))
        out = attn.scaled_dot_product_attention(q, k, v)
        want = F.scaled_dot_product_attention(q, k.float(), v.float())
        assert out.dtype == torch.float32 and torch.equal(out, want)
        gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
        assert gk.dtype == dt and gv.dtype == dt and gq.shape == q.shape
