"""Dropout: statistics, reproducibility and the documented Philox stream.

attn cannot reproduce PyTorch's dropout masks bit for bit (PyTorch draws from
its own generator), so dropout is tested by what it must satisfy: each
weight kept with probability 1 - p and then scaled by 1 / (1 - p) (so the
output stays unbiased), out == weights @ value, the same seed giving the same
result and another seed another result, and — exactly — the keep decisions
that attn.h documents: weight (b, h, i, j) is kept iff word idx % 4 of
Philox-4x32-10(counter = (idx / 4, rng_offset), key = seed) is at least
ceil(p * 2^32), idx being its linear index in the weights shape.
"""

import numpy as np
import pytest
import torch

import attn

MASK32 = 0xFFFFFFFF


def philox4x32_10(ctr, key):
    """Philox-4x32-10 (Salmon et al., SC'11) on arrays of counters."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in ctr)
    k0, k1 = np.uint64(key[0] & MASK32), np.uint64(key[1] & MASK32)
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    mask, s32 = np.uint64(MASK32), np.uint64(32)
    for _ in range(10):
        p0 = m0 * c0
        p1 = m1 * c2
        c0, c1, c2, c3 = (p1 >> s32) ^ c1 ^ k0, p1 & mask, (p0 >> s32) ^ c3 ^ k1, p0 & mask
        k0 = (k0 + w0) & mask
        k1 = (k1 + w1) & mask
    return c0, c1, c2, c3


def expected_keep(shape, p, seed, rng_offset=0):
    """attn's documented keep decisions for a weights array of `shape`."""
    idx = np.arange(int(np.prod(shape)), dtype=np.uint64)
    block = idx >> np.uint64(2)
    words = philox4x32_10(
        (block & np.uint64(MASK32), block >> np.uint64(32),
         np.full_like(idx, rng_offset & MASK32), np.full_like(idx, rng_offset >> 32)),
        (seed & MASK32, seed >> 32),
    )
    word = np.choose((idx & np.uint64(3)).astype(np.int64), words)
    threshold = int(np.ceil(p * 2.0**32))
    return (word >= threshold).reshape(shape)


def test_philox_known_answers():
    # Random123's known-answer vectors for philox4x32_10.
    assert [int(w[0]) for w in philox4x32_10(([0], [0], [0], [0]), (0, 0))] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = [MASK32]
    assert [int(w[0]) for w in philox4x32_10((ones, ones, ones, ones), (MASK32, MASK32))] == [
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = ([0x243F6A88], [0x85A308D3], [0x13198A2E], [0x03707344])
    assert [int(w[0]) for w in philox4x32_10(pi, (0xA4093822, 0x299F31D0))] == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def _qkv(rng, shape_q, shape_k, ev, dtype=np.float64):
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k[:-1] + (ev,)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("p", [0.1, 0.37, 0.9])
def test_sdpa_keep_decisions_are_the_documented_philox_stream(rng, p):
    q, k, v = _qkv(rng, (2, 3, 5, 4), (2, 3, 7, 4), 6)
    seed = int(rng.integers(2**64, dtype=np.uint64))
    _, w0 = attn.scaled_dot_product_attention(q, k, v, return_weights=True)
    out, w = attn.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=seed,
                                               return_weights=True)
    keep = expected_keep(w.shape, p, seed)
    assert (w0 > 0).all()
    assert np.array_equal(w != 0, keep)
    np.testing.assert_allclose(w[keep], w0[keep] / (1 - p), rtol=1e-15)
    np.testing.assert_allclose(out, w @ v, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_sdpa_dropout_statistics(rng, dtype, p):
    """Kept fraction within 4 sigma of 1 - p; kept weights scaled by 1/(1-p)."""
    q, k, v = _qkv(rng, (4, 4, 64, 16), (4, 4, 64, 16), 8, dtype)
    _, w0 = attn.scaled_dot_product_attention(q, k, v, return_weights=True)
    out, w = attn.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=99,
                                               return_weights=True)
    n = w.size
    kept = w != 0
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(kept.mean() - (1 - p)) < 4 * sigma
    rtol = 1e-6 if dtype == np.float32 else 1e-15
    np.testing.assert_allclose(w[kept], w0[kept] / (1 - p), rtol=rtol)
    np.testing.assert_allclose(out, (w.astype(np.float64) @ v), rtol=1e-4 if dtype == np.float32
                               else 1e-12, atol=1e-5 if dtype == np.float32 else 1e-14)


def test_sdpa_dropout_is_unbiased(rng):
    """Averaged over many seeds, the output approaches the one without dropout
    (within 4 standard errors of the mean, element by element)."""
    q, k, v = _qkv(rng, (2, 4, 6), (2, 5, 6), 3)
    ref = attn.scaled_dot_product_attention(q, k, v)
    outs = np.stack([attn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=s)
                     for s in range(400)])
    sem = outs.std(axis=0, ddof=1) / np.sqrt(len(outs))
    assert (np.abs(outs.mean(axis=0) - ref) <= 4 * sem + 1e-12).all()


def test_sdpa_same_seed_same_result_other_seed_other_result(rng):
    q, k, v = _qkv(rng, (2, 2, 8, 4), (2, 2, 9, 4), 5, np.float32)
    a = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.4, seed=7, return_weights=True)
    b = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.4, seed=7, return_weights=True)
    c = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.4, seed=8, return_weights=True)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0]) and not np.array_equal(a[1] != 0, c[1] != 0)


def test_sdpa_seed_none_draws_a_fresh_seed(rng):
    q, k, v = _qkv(rng, (2, 8, 4), (2, 9, 4), 5)
    outs = [attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5) for _ in range(3)]
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[1], outs[2])


def test_sdpa_dropout_does_not_depend_on_thread_count(rng):
    q, k, v = _qkv(rng, (3, 2, 16, 8), (3, 2, 20, 8), 8, np.float32)
    before = attn.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            attn.set_num_threads(n)
            results.append(attn.scaled_dot_product_attention(
                q, k, v, dropout_p=0.25, seed=5, return_weights=True, return_lse=True))
    finally:
        attn.set_num_threads(before)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert np.array_equal(a, b)


def test_sdpa_dropout_edges(rng):
    q, k, v = _qkv(rng, (2, 6, 4), (2, 7, 4), 3)
    mask = rng.random((6, 7)) < 0.6
    ref = attn.scaled_dot_product_attention(q, k, v, mask, return_weights=True, return_lse=True)
    # p = 0: no dropout, whatever the seed.
    for seed in (None, 0, 12345):
        r = attn.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.0, seed=seed,
                                              return_weights=True, return_lse=True)
        for a, b in zip(ref, r):
            assert np.array_equal(a, b)
    # p = 1: everything dropped.
    out, w = attn.scaled_dot_product_attention(q, k, v, mask, dropout_p=1.0, seed=3,
                                               return_weights=True)
    assert not out.any() and not w.any()
    # lse is before dropout; masked keys stay 0 after it.
    out, w, lse = attn.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.5, seed=3,
                                                    return_weights=True, return_lse=True)
    assert np.array_equal(lse, ref[2])
    assert not w[np.broadcast_to(~mask, w.shape)].any()


def test_torch_dropout_has_the_same_statistics(rng):
    """PyTorch's SDPA dropout and attn's agree in distribution: both keep a
    fraction 1 - p (within 4 sigma) of the weights, scaled by 1 / (1 - p)."""
    p = 0.3
    q, k, v = _qkv(rng, (1, 1, 256, 8), (1, 1, 256, 8), 256)
    v = np.broadcast_to(np.eye(256), (1, 1, 256, 256)).copy()  # out == weights
    _, w0 = attn.scaled_dot_product_attention(q, k, v, return_weights=True)
    torch.manual_seed(0)
    tw = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), dropout_p=p).numpy()
    ours = attn.scaled_dot_product_attention(q, k, v, dropout_p=p, seed=1)
    sigma = np.sqrt(p * (1 - p) / w0.size)
    for w in (tw, ours):
        kept = w != 0
        assert abs(kept.mean() - (1 - p)) < 4 * sigma
        np.testing.assert_allclose(w[kept], w0[kept] / (1 - p), rtol=1e-12)


# ---------------------------------------------------------------------------
# MultiheadAttention
# ---------------------------------------------------------------------------


def _mha_inputs(rng, L=6, S=7, N=3, E=16):
    x = rng.standard_normal((L, N, E))
    y = rng.standard_normal((S, N, E))
    return x, y, y


def test_mha_dropout_only_in_train_mode(rng):
    m = attn.MultiheadAttention(16, 4, dropout=0.5, dtype=np.float64, seed=11)
    plain = attn.MultiheadAttention(16, 4, dtype=np.float64)
    plain.load_state_dict(m.state_dict())
    x, y, z = _mha_inputs(rng)
    assert m.training  # like a new torch module
    ref_out, ref_w = plain(x, y, z, average_attn_weights=False)
    m.eval()
    out, w = m(x, y, z, average_attn_weights=False)
    assert np.array_equal(out, ref_out) and np.array_equal(w, ref_w)
    m.train()
    out, w = m(x, y, z, average_attn_weights=False)
    assert not np.allclose(out, ref_out)
    kept = w != 0
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_allclose(w[kept], ref_w[kept] / 0.5, rtol=1e-15)
    # Without dropout, train mode changes nothing.
    plain.train()
    assert np.array_equal(plain(x, y, z)[0], ref_out)


def test_mha_dropout_reproducible_from_construction(rng):
    x, y, z = _mha_inputs(rng)
    runs = []
    for _ in range(2):
        m = attn.MultiheadAttention(16, 4, dropout=0.3, seed=2024)
        runs.append([m(x.astype(np.float32), y.astype(np.float32), z.astype(np.float32))
                     for _ in range(3)])
    for (a_out, a_w), (b_out, b_w) in zip(*runs):
        assert np.array_equal(a_out, b_out) and np.array_equal(a_w, b_w)
    first, second = runs[0][0][0], runs[0][1][0]
    assert not np.array_equal(first, second)  # each call its own stream
    other = attn.MultiheadAttention(16, 4, dropout=0.3, seed=2025)
    other.load_state_dict(m.state_dict())
    assert not np.array_equal(other(x.astype(np.float32), y.astype(np.float32),
                                    z.astype(np.float32))[0], first)


def test_mha_call_n_uses_rng_offset_n(rng):
    """The n-th dropout call of a module built with seed=s draws from
    (seed=s, rng_offset=n) over the (N, num_heads, L, S') weights."""
    seed = 987654321987
    m = attn.MultiheadAttention(12, 3, dropout=0.4, add_zero_attn=True, dtype=np.float64,
                                seed=seed)
    x, y, z = _mha_inputs(rng, L=5, S=6, N=2, E=12)
    m.eval()
    _, w0 = m(x, y, z, average_attn_weights=False)
    m.train()
    for n in range(3):
        with pytest.raises(ValueError):  # a failed call does not count
            m(x, y[:, :1], z, average_attn_weights=False)
        _, w = m(x, y, z, average_attn_weights=False)
        assert w.shape == (2, 3, 5, 7)
        assert np.array_equal(w != 0, expected_keep(w.shape, 0.4, seed, rng_offset=n) & (w0 > 0))


def test_mha_seed_none_is_fresh(rng):
    a = attn.MultiheadAttention(8, 2, dropout=0.5)
    b = attn.MultiheadAttention(8, 2, dropout=0.5)
    assert not np.array_equal(a.in_proj_weight, b.in_proj_weight)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    assert not np.array_equal(a(x, x, x)[0], a(x, x, x)[0])


def test_mha_dropout_statistics_match_torch(rng):
    """torch's MHA dropout and attn's: the same kept fraction (within 4 sigma
    of 1 - p) and the same 1/(1-p) scaling of the weights they return."""
    p = 0.25
    tm = torch.nn.MultiheadAttention(32, 4, dropout=p, dtype=torch.float64)
    m = attn.MultiheadAttention(32, 4, dropout=p, dtype=np.float64, seed=3)
    m.load_state_dict(tm.state_dict())
    x = rng.standard_normal((48, 4, 32))
    tm.eval()
    m.eval()
    with torch.no_grad():
        _, w0 = tm(*(torch.from_numpy(x),) * 3, average_attn_weights=False)
    w0 = w0.numpy()
    tm.train()
    m.train()
    with torch.no_grad():
        _, tw = tm(*(torch.from_numpy(x),) * 3, average_attn_weights=False)
    _, w = m(x, x, x, average_attn_weights=False)
    sigma = np.sqrt(p * (1 - p) / w.size)
    for weights in (tw.numpy(), w):
        kept = weights != 0
        assert abs(kept.mean() - (1 - p)) < 4 * sigma
        np.testing.assert_allclose(weights[kept], w0[kept] / (1 - p), rtol=1e-12)
