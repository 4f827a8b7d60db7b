"""The package's surface: version, threads, kernel info, input handling
(torch tensors, strides read in place, copies only where unavoidable), the
GIL, return values, and MultiheadAttention's parameters and state_dict."""

import importlib.metadata
import os
import re
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attn
from attn import _attn

HEADER = os.path.join(os.path.dirname(__file__), "..", "..", "include", "attn.h")


def test_version_is_the_library_version():
    header = open(HEADER).read()
    want = re.search(r'#define ATTN_VERSION_STRING "([^"]+)"', header).group(1)
    assert attn.__version__ == want == "0.3.0"
    assert importlib.metadata.version("attn") == want


def test_kernel_info():
    info = attn.kernel_info()
    assert set(info) == {"isa", "supported_isas", "num_threads", "version", "blas"}
    assert info["isa"] in info["supported_isas"]
    assert "ref" in info["supported_isas"]
    assert info["num_threads"] == attn.get_num_threads() >= 1
    assert info["version"] == attn.__version__


def _cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


AVX512_CORES = ("SkylakeX", "Cooperlake", "SapphireRapids")


def test_openblas_core_follows_the_cpu_features():
    """libattn asks an OpenBLAS older than the CPU for the kernels the CPU
    runs (issue 9: AVX2 kernels on an AVX-512 Zen 5), keeps a core the user
    forced, and leaves the environment as it found it."""
    code = ("import os, attn; print(attn.kernel_info()['blas']); "
            "print(os.environ.get('OPENBLAS_CORETYPE'))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    blas, leaked = out.stdout.splitlines()
    assert leaked == "None", out.stderr
    if not blas.startswith("OpenBLAS") or not os.path.exists("/proc/cpuinfo"):
        pytest.skip(f"not an OpenBLAS on Linux: {blas}")
    core = blas.rsplit("core ", 1)[1]
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        assert core in AVX512_CORES, blas
    elif {"avx2", "fma"} <= flags:
        assert core in ("Haswell", "Zen") + AVX512_CORES, blas
    # A user's own choice is kept, even a weaker one.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(env, OPENBLAS_CORETYPE="Prescott"))
    blas, kept = out.stdout.splitlines()
    assert kept == "Prescott", out.stderr
    assert blas.endswith("core Prescott"), blas


# Shapes that take each way through the projection GEMMs: row tiles only,
# column tiles (few rows), cross-attention with kdim/vdim, and one row.
THREAD_CASES = [
    dict(E=200, H=5, N=4, L=300, S=300),
    dict(E=64, H=4, N=2, L=20, S=20),
    dict(E=96, H=3, N=3, L=50, S=70, kdim=40, vdim=24),
    dict(E=512, H=8, N=1, L=1, S=9),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", THREAD_CASES, ids=lambda c: "E{E}_L{L}_S{S}".format(**c))
def test_mha_results_do_not_depend_on_the_thread_count(case, dtype):
    """Bitwise the same output and weights for 1-4 threads, whatever the BLAS
    core (make test-determinism runs this under each one the CPU can run)."""
    kdim, vdim = case.get("kdim"), case.get("vdim")
    m = attn.MultiheadAttention(case["E"], case["H"], batch_first=True, kdim=kdim, vdim=vdim,
                                dtype=dtype, seed=3)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((case["N"], case["L"], case["E"])).astype(dtype)
    k = rng.standard_normal((case["N"], case["S"], kdim or case["E"])).astype(dtype)
    v = rng.standard_normal((case["N"], case["S"], vdim or case["E"])).astype(dtype)
    outs = []
    try:
        for threads in (1, 2, 3, 4):
            attn.set_num_threads(threads)
            outs.append(m(q, k, v))
    finally:
        attn.set_num_threads(0)
    blas = attn.kernel_info()["blas"]
    for threads, (y, w) in zip((2, 3, 4), outs[1:]):
        assert np.array_equal(y, outs[0][0]), f"{threads} threads differ from 1 ({blas})"
        assert np.array_equal(w, outs[0][1]), f"{threads} threads: weights differ ({blas})"


def test_threads_roundtrip_and_default():
    before = attn.get_num_threads()
    try:
        attn.set_num_threads(3)
        assert attn.get_num_threads() == 3
        attn.set_num_threads(0)  # back to the default
        assert attn.get_num_threads() == before
    finally:
        attn.set_num_threads(0)
    code = "import attn; print(attn.get_num_threads(), attn.kernel_info()['num_threads'])"
    env = dict(os.environ, ATTN_NUM_THREADS="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["3", "3"], out.stderr


def test_release_workspace_between_calls(rng):
    # The workspace kept between calls (reused, dirty) and a fresh one after
    # release_workspace() give the same bits; the release is idempotent.
    q = rng.standard_normal((1, 2, 256, 256)).astype(np.float32)
    first = attn.scaled_dot_product_attention(q, q, q)
    again = attn.scaled_dot_product_attention(q, q, q)
    attn.release_workspace()
    attn.release_workspace()
    fresh = attn.scaled_dot_product_attention(q, q, q)
    assert np.array_equal(first, again) and np.array_equal(first, fresh)
    assert "release_workspace" in attn.__all__


def _address(a):
    return a.__array_interface__["data"][0]


def test_output_memory_is_recycled_and_released(rng):
    """Outputs of 256 KiB and more come from blocks that return to a pool
    when their last view dies (python/src/_attn_blocks.c): the next output
    of that size gets the same memory, still warm. Views keep a block alive;
    the pool is bounded; release_workspace() empties it."""
    from attn import _attn

    attn.release_workspace()
    assert _attn.output_blocks_kept() == (0, 0)
    q = rng.standard_normal((1, 4, 256, 64)).astype(np.float32)  # out: 256 KiB
    out = attn.scaled_dot_product_attention(q, q, q)
    ref = out.copy()
    address, view = _address(out), out[0, 1]
    del out
    assert _attn.output_blocks_kept() == (0, 0)  # a view still holds the block
    assert np.array_equal(view, ref[0, 1])
    del view
    assert _attn.output_blocks_kept() == (1, 256 << 10)
    again = attn.scaled_dot_product_attention(q, q, q)
    assert _address(again) == address and np.array_equal(again, ref)
    assert again.flags.writeable and again.flags.c_contiguous
    small = attn.scaled_dot_product_attention(q[:, :, :8], q, q)  # 8 KiB: NumPy's own
    assert small.base is None and small.shape == (1, 4, 8, 64)
    _, w = attn.scaled_dot_product_attention(q, q, q, return_weights=True)  # 1 MiB: a block
    assert w.base is not None
    big_q = np.zeros((1, 4, 2048, 64), np.float32)  # weights: 64 MiB, NumPy's own again
    _, w = attn.scaled_dot_product_attention(big_q, big_q, big_q, return_weights=True)
    assert w.base is None and np.allclose(w, 1 / 2048)
    del w
    del again
    blocks = [_attn.output_block((1 << 20) + i) for i in range(40)]  # 40 MiB of sizes
    del blocks
    kept, nbytes = _attn.output_blocks_kept()
    assert kept <= 15 and nbytes <= 64 << 20
    attn.release_workspace()
    assert _attn.output_blocks_kept() == (0, 0)
    for bad in (0, -1):
        with pytest.raises(ValueError):
            _attn.output_block(bad)


def test_every_kernel_path_gives_the_same_result(rng):
    q = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    k = rng.standard_normal((2, 3, 11, 8)).astype(np.float32)
    v = rng.standard_normal((2, 3, 11, 5)).astype(np.float32)
    mask = rng.random((9, 11)) < 0.7
    results = {}
    try:
        for isa in _attn.supported_isas():
            _attn.set_isa(isa)
            assert attn.kernel_info()["isa"] == isa
            results[isa] = attn.scaled_dot_product_attention(
                q, k, v, mask, is_causal=True, return_weights=True, return_lse=True)
    finally:
        _attn.set_isa("auto")
    ref = results["ref"]
    for isa, r in results.items():
        for a, b in zip(r, ref):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-7, err_msg=isa)


def test_returns(rng):
    q = rng.standard_normal((3, 4, 8))
    k = rng.standard_normal((3, 6, 8))
    v = rng.standard_normal((3, 6, 2))
    out = attn.scaled_dot_product_attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.shape == (3, 4, 2) and out.dtype == np.float64
    assert out.flags.c_contiguous
    o, w = attn.scaled_dot_product_attention(q, k, v, return_weights=True)
    o2, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True)
    o3, w3, lse3 = attn.scaled_dot_product_attention(q, k, v, return_weights=True,
                                                     return_lse=True)
    assert w.shape == (3, 4, 6) and lse.shape == (3, 4)
    for a in (o, o2, o3):
        assert np.array_equal(a, out)
    assert np.array_equal(w, w3) and np.array_equal(lse, lse3)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(out, w @ v, rtol=1e-13, atol=1e-14)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(8)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-13, atol=1e-14)


def test_torch_tensors_in_torch_tensors_out(rng):
    q = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 4, 7, dtype=torch.float64).transpose(-1, -2)  # non-contiguous
    v = torch.randn(3, 7, 1, dtype=torch.float64).expand(3, 7, 6)  # zero stride
    mask = torch.rand(5, 7) < 0.8
    mask[:, 0] = True
    with torch.no_grad():  # not recorded for autograd (test_sdpa_autograd.py)
        out, w, lse = attn.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                        return_weights=True, return_lse=True)
    for x, shape in ((out, (2, 3, 5, 6)), (w, (2, 3, 5, 7)), (lse, (2, 3, 5))):
        assert type(x) is torch.Tensor and x.shape == shape and x.dtype == torch.float64
        assert x.is_contiguous() and x.grad_fn is None and not x.requires_grad
    ref = F.scaled_dot_product_attention(q.detach(), k, v.contiguous(), attn_mask=mask)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-12, atol=1e-14)
    # One torch tensor among NumPy arrays is enough; NumPy alone gives NumPy.
    mixed = attn.scaled_dot_product_attention(q.detach().numpy(), k.numpy(), v.numpy(), mask)
    np_only = attn.scaled_dot_product_attention(q.detach().numpy(), k.numpy(), v.numpy(),
                                                mask.numpy())
    assert type(mixed) is torch.Tensor and type(np_only) is np.ndarray
    assert np.array_equal(mixed.numpy(), out.numpy()) and np.array_equal(np_only, out.numpy())
    m = attn.MultiheadAttention(6, 2, dtype=torch.float64)
    y, w = m(torch.randn(4, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64),
             torch.randn(5, 6, dtype=torch.float64))
    assert isinstance(y, np.ndarray) and y.shape == (4, 6) and w.shape == (4, 5)


def test_plain_call_shortcut_matches_the_checked_path(rng):
    """NumPy arrays with no extras skip the argument checks (a 16-token call
    costs less than they do): the same bits and the same errors as a call
    that takes the checked path (a list window_size sends it there)."""
    for dtype in (np.float32, np.float64):
        q = rng.standard_normal((2, 4, 9, 16)).astype(dtype)
        k = rng.standard_normal((2, 2, 13, 16)).astype(dtype)
        v = rng.standard_normal((2, 2, 13, 8)).astype(dtype)
        for causal in (False, True):
            for align in ("top-left", "bottom-right"):
                fast = attn.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=True, causal_alignment=align)
                checked = attn.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=True, causal_alignment=align,
                    window_size=[-1, -1])
                assert fast.dtype == dtype and fast.shape == (2, 4, 9, 8)
                assert np.array_equal(fast, checked)
    q32 = q.astype(np.float32)
    errors = []
    for extra in ({}, {"window_size": [-1, -1]}):
        with pytest.raises(ValueError) as e:  # GQA heads without enable_gqa
            attn.scaled_dot_product_attention(q32, k.astype(np.float32),
                                              v.astype(np.float32), **extra)
        errors.append((str(e.value), e.value.arg))
    assert errors[0] == errors[1] and errors[0][1] == "key"
    with pytest.raises(TypeError, match="must share one dtype"):  # mixed dtypes: checked
        attn.scaled_dot_product_attention(q32, k, v, enable_gqa=True)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        attn.scaled_dot_product_attention(q, k, v, is_causal=1, enable_gqa=True)
    with pytest.raises(TypeError, match="must be an int, not float"):  # equal to (-1, -1)
        attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, window_size=(-1.0, -1.0))
    with pytest.raises(TypeError, match="dropout_p must be a float"):  # == 0.0, but a bool
        attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, dropout_p=False)


def test_plain_tensors_are_read_in_place_without_numpy(rng):
    """Plain CPU tensors on the short route (torch's own arguments, nothing
    recorded) are read by the extension itself, not through .numpy()
    (python/src/_attn_tensors.c): the same bits as the NumPy call, strides,
    storage offsets and broadcasts included, each tensor counted; what
    .numpy() refuses goes to the checked route, which still answers."""
    def numpy_of(x):
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()

    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        base = torch.from_numpy(rng.standard_normal((3, 2, 4, 11, 16))).to(dtype)
        q = base[1].transpose(0, 1)[:, :, 2:9]  # (4, 2, 7, 16), permuted, offset
        k = base[2, :, ::2]  # (2, 2, 11, 16), every other head
        v = torch.from_numpy(rng.standard_normal((1, 11, 8))).to(dtype).expand(2, 2, 11, 8)
        mask = torch.from_numpy(rng.random((7, 11)) < 0.7)
        fmask = torch.from_numpy(rng.standard_normal((2, 1, 7, 11))).to(dtype)
        q = q.transpose(0, 1)  # (2, 4, 7, 16): 4 query heads on 2 KV heads
        for kw in ({}, dict(attn_mask=mask, is_causal=False), dict(attn_mask=fmask),
                   dict(is_causal=True, scale=0.3)):
            before = _attn._tensors_read()
            with torch.no_grad():
                out = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
            assert _attn._tensors_read() == before + 3 + ("attn_mask" in kw), (dtype, kw)
            ref = attn.scaled_dot_product_attention(
                numpy_of(q), numpy_of(k), numpy_of(v), enable_gqa=True,
                **{n: numpy_of(x) if isinstance(x, torch.Tensor) else x for n, x in kw.items()})
            assert type(out) is torch.Tensor and out.dtype == dtype and out.shape == (2, 4, 7, 8)
            assert np.array_equal(numpy_of(out), ref), (dtype, kw)
    q = torch.from_numpy(rng.standard_normal((2, 5, 8)).astype(np.float32))
    ref = attn.scaled_dot_product_attention(q.numpy(), q.numpy(), q.numpy())
    # refused in place, answered by the checked route
    raw = torch.zeros(q.numel() * 4 + 2, dtype=torch.uint8)
    odd = torch.from_numpy(raw.numpy()[2:].view(np.float32).reshape(q.shape))
    odd.copy_(q)  # misaligned: the checked route copies it
    negated = torch._neg_view(-q)  # memory holds -q, the values are q
    for x in (odd, negated):
        before = _attn._tensors_read()
        out = attn.scaled_dot_product_attention(x, q, q)
        assert np.array_equal(out.numpy(), ref)
        assert _attn._tensors_read() == before  # refused first: all read through NumPy
    # with dropout the seed is drawn once either way: the same values give
    # the same output under the same torch.manual_seed
    for x in (q, odd, negated):
        torch.manual_seed(5)
        with torch.no_grad():
            out = attn.scaled_dot_product_attention(x, q, q, dropout_p=0.5)
        if x is q:
            dropped = out
        assert torch.equal(out, dropped) and not np.array_equal(out.numpy(), ref)
    with pytest.raises(TypeError, match="query is a nested tensor"):  # no sizes to read
        attn.scaled_dot_product_attention(torch.nested.as_nested_tensor([q[0], q[1, :3]]), q, q)
    with pytest.raises(TypeError, match="key has layout torch.sparse_coo"):
        attn.scaled_dot_product_attention(q, q.to_sparse(), q)
    with pytest.raises(ValueError, match="query is a meta tensor"):
        attn.scaled_dot_product_attention(q.to("meta"), q, q)
    # empty: torch's own answer (test_sdpa_autograd.py), except where attn's
    # own options leave torch none; then the library names it
    assert torch.equal(attn.scaled_dot_product_attention(q[:, :0], q, q),
                       torch.nn.functional.scaled_dot_product_attention(q[:, :0], q, q))
    with pytest.raises(ValueError, match="query"):
        attn.scaled_dot_product_attention(q[:, :0], q, q, return_lse=True)
    with pytest.raises(ValueError, match="at most 8"):
        attn.scaled_dot_product_attention(q.reshape((1,) * 7 + q.shape), q, q)
    with pytest.raises(_attn.NotReadInPlace, match="query: it is a negated view"):
        _attn.sdpa(negated, q, q, empty=np.empty)
    assert issubclass(_attn.NotReadInPlace, TypeError)
    # a tensor that requires grad, outside grad mode: read in place too
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        assert np.array_equal(attn.scaled_dot_product_attention(qg, q, q).numpy(), ref)
    # the tensor's own attributes are never consulted: by name, a shadowed
    # data_ptr crashed the process and a shadowed stride read wrong elements
    for name, fake in (("data_ptr", lambda: 4096), ("stride", lambda: (0, 0, 0)),
                       ("is_neg", lambda: False)):
        x = q.clone()
        setattr(x, name, fake)
        before = _attn._tensors_read()
        assert np.array_equal(attn.scaled_dot_product_attention(x, q, q).numpy(), ref), name
        assert _attn._tensors_read() == before + 3, name
    shadowed = torch._neg_view(-q)
    shadowed.is_neg = lambda: False  # still refused in place: its memory holds -q
    assert np.array_equal(attn.scaled_dot_product_attention(shadowed, q, q).numpy(), ref)


@pytest.mark.parametrize("nbytes", [0, 64])
def test_tensor_past_its_storage(rng, nbytes):
    """A storage resized behind its tensor (FSDP frees parameters so) is
    refused, as torch's own SDPA refuses it, on every route: attn read
    past the allocation."""
    from attn import _attn
    q = torch.from_numpy(rng.standard_normal((1, 2, 64, 32)).astype(np.float32))
    for name in ("query", "key", "value"):
        args = dict(query=q, key=q, value=q)
        x = args[name] = q.clone()
        x.untyped_storage().resize_(nbytes)
        with pytest.raises(RuntimeError, match="out of bound"):
            torch.nn.functional.scaled_dot_product_attention(**args)
        for grad in (False, True):
            if grad:
                args = {n: t.detach().requires_grad_() if n != name else t
                        for n, t in args.items()}
            with pytest.raises(ValueError, match=f"{name}'s sizes, strides and storage "
                               f"offset reach 16384 bytes of its storage, which holds {nbytes}"):
                attn.scaled_dot_product_attention(**args, is_causal=grad)
    m = torch.zeros(64, 64, dtype=torch.bool)
    m.untyped_storage().resize_(nbytes)
    with pytest.raises(ValueError, match="attn_mask's sizes"):
        attn.scaled_dot_product_attention(q, q, q, attn_mask=m)
    with pytest.raises(_attn.NotReadInPlace, match="its sizes and strides reach past its storage"):
        _attn.sdpa(x, q, q, empty=np.empty)
    mha = attn.nn.MultiheadAttention(32, 4, batch_first=True)
    z = torch.from_numpy(rng.standard_normal((2, 16, 32)).astype(np.float32))
    y = z.clone()
    y.untyped_storage().resize_(nbytes)
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="query's sizes"):
            mha(y, z, z)


def test_torch_intake_of_a_patched_class(rng):
    """A torch.Tensor whose accessor is not torch's C descriptor (patched)
    reads no tensor in place: the short route takes NumPy views instead."""
    from attn import _attn, _torch as route
    q = torch.from_numpy(rng.standard_normal((2, 5, 8)).astype(np.float32))
    ref = attn.scaled_dot_product_attention(q.numpy(), q.numpy(), q.numpy())
    types = (torch.Tensor, torch.UntypedStorage, torch.strided, torch.float32, torch.float64,
             torch.float16, torch.bfloat16, torch.bool)
    original = torch.Tensor.stride
    try:
        torch.Tensor.stride = lambda self, *a: original(self, *a)
        assert _attn._torch_intake(*types) is False
        route._IN_PLACE = False
        before = _attn._tensors_read()
        assert np.array_equal(attn.scaled_dot_product_attention(q, q, q).numpy(), ref)
        assert _attn._tensors_read() == before
    finally:
        torch.Tensor.stride = original
        route._IN_PLACE = _attn._torch_intake(*types)
    assert route._IN_PLACE is True
    before = _attn._tensors_read()
    assert np.array_equal(attn.scaled_dot_product_attention(q, q, q).numpy(), ref)
    assert _attn._tensors_read() == before + 3


def test_scalar_and_list_masks(rng):
    q = rng.standard_normal((2, 4, 8))
    ref = attn.scaled_dot_product_attention(q, q, q)
    assert np.array_equal(attn.scaled_dot_product_attention(q, q, q, np.bool_(True)), ref)
    assert np.array_equal(attn.scaled_dot_product_attention(q, q, q, 0.0), ref)
    assert np.array_equal(attn.scaled_dot_product_attention(q, q, q, [True] * 4), ref)
    zero = attn.scaled_dot_product_attention(q, q, q, False)  # every key masked: 0
    assert not zero.any()


def test_foreign_byte_order_is_converted(rng):
    q = rng.standard_normal((2, 4, 8)).astype(">f8")
    ref = attn.scaled_dot_product_attention(q.astype("<f8"), q.astype("<f8"), q.astype("<f8"))
    out = attn.scaled_dot_product_attention(q, q, q, attn_mask=np.zeros(4, ">f4"))
    assert out.dtype == np.float64 and out.dtype.isnative
    assert np.array_equal(out, ref)


def _strided_inputs(rng):
    base = rng.standard_normal((8, 2, 64, 32)).astype(np.float32)
    q = np.swapaxes(base, 0, 1)  # (2, 8, 64, 32), permuted
    k = base[:, :, ::-1, :].swapaxes(0, 1)  # negative stride
    v = np.broadcast_to(rng.standard_normal((1, 8, 64, 16)).astype(np.float32), (2, 8, 64, 16))
    mask = np.broadcast_to(rng.random((64, 1)) < 2, (64, 64))
    return q, k, v, mask


def test_strided_inputs_are_read_in_place(rng):
    """Permuted, reversed and broadcast (zero-stride) inputs are not copied:
    the extension's copy counter stays put, and the Python heap grows by the
    output only."""
    q, k, v, mask = _strided_inputs(rng)
    before = _attn._copies()
    ref = attn.scaled_dot_product_attention(*(np.ascontiguousarray(a) for a in (q, k, v, mask)))
    tracemalloc.start()
    out = attn.scaled_dot_product_attention(q, k, v, mask)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert _attn._copies() == before
    assert peak < out.nbytes + 64 * 1024, f"peak {peak} bytes for a {out.nbytes}-byte output"
    assert np.array_equal(out, ref)


def test_misaligned_input_is_copied(rng):
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    raw = np.zeros(q.nbytes + 1, np.uint8)
    odd = raw[1:].view(np.float32).reshape(q.shape)
    odd[...] = q
    assert not odd.flags.aligned
    before = _attn._copies()
    out = attn.scaled_dot_product_attention(odd, q, q)
    assert _attn._copies() == before + 1
    assert np.array_equal(out, attn.scaled_dot_product_attention(q, q, q))


def test_any_buffer_exporter(rng):
    """The extension reads any strided buffer, e.g. a memoryview."""
    q = rng.standard_normal((2, 4, 8))
    out = attn.scaled_dot_product_attention(memoryview(q), q, q)
    assert np.array_equal(out, attn.scaled_dot_product_attention(q, q, q))


def test_gil_is_released(rng):
    """While one thread runs a long attention call, another keeps running
    Python code."""
    q = rng.standard_normal((1, 2, 512, 64))
    k = rng.standard_normal((1, 2, 4096, 64))
    t0 = time.perf_counter()
    attn.scaled_dot_product_attention(q, k, k)
    duration = time.perf_counter() - t0
    ticks = []
    worker = threading.Thread(target=attn.scaled_dot_product_attention, args=(q, k, k))
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    gaps = np.diff(ticks) if len(ticks) > 1 else np.array([duration])
    # With the GIL held for the whole call, this loop could not tick at all.
    assert len(ticks) > 5 and gaps.max() < 0.5 * duration + 0.05, (len(ticks), gaps.max(), duration)


def test_concurrent_calls_agree(rng):
    q = rng.standard_normal((4, 2, 32, 16)).astype(np.float32)
    m = attn.MultiheadAttention(16, 4, dropout=0.2, seed=1).eval()
    x = rng.standard_normal((10, 3, 16)).astype(np.float32)
    want_sdpa = attn.scaled_dot_product_attention(q, q, q, dropout_p=0.2, seed=9)
    want_mha = m(x, x, x)
    results = []

    def work():
        for _ in range(5):
            results.append((attn.scaled_dot_product_attention(q, q, q, dropout_p=0.2, seed=9),
                            m(x, x, x)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 20
    for s, (o, w) in results:
        assert np.array_equal(s, want_sdpa)
        assert np.array_equal(o, want_mha[0]) and np.array_equal(w, want_mha[1])


# ---------------------------------------------------------------------------
# MultiheadAttention: parameters, state_dict, modes
# ---------------------------------------------------------------------------

CONFIGS = [
    dict(embed_dim=8, num_heads=2),
    dict(embed_dim=8, num_heads=2, bias=False),
    dict(embed_dim=8, num_heads=4, add_bias_kv=True),
    dict(embed_dim=6, num_heads=3, kdim=4, vdim=5),
    dict(embed_dim=6, num_heads=1, kdim=6, vdim=2, add_bias_kv=True, bias=False),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_parameters_mirror_torch(cfg):
    tm = torch.nn.MultiheadAttention(**cfg)
    m = attn.MultiheadAttention(**cfg)
    assert list(m.state_dict()) == list(tm.state_dict())
    assert [n for n, _ in m.named_parameters()] == list(tm.state_dict())
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                 "in_proj_bias", "bias_k", "bias_v"):
        t, a = getattr(tm, name), getattr(m, name)
        assert (t is None) == (a is None), name
        if t is not None:
            assert a.shape == tuple(t.shape) and a.dtype == np.float32
    assert m.out_proj.weight.shape == tuple(tm.out_proj.weight.shape)
    assert (m.out_proj.bias is None) == (tm.out_proj.bias is None)
    for name in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "batch_first",
                 "_qkv_same_embed_dim", "dropout", "training"):
        assert getattr(m, name) == getattr(tm, name), name
    # Our state_dict loads into torch, and torch's into ours.
    tm.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    m2 = attn.MultiheadAttention(**cfg)
    m2.load_state_dict(tm.state_dict())
    for k, v in m.state_dict().items():
        assert np.array_equal(m2.state_dict()[k], v)


def test_parameters_are_live_views_and_state_dict_copies(rng):
    m = attn.MultiheadAttention(8, 2, dtype=np.float64, seed=0).eval()
    x = rng.standard_normal((3, 8))
    y0, _ = m(x, x, x)
    sd = m.state_dict()
    sd["out_proj.bias"][:] = 5.0  # a copy: the module is unchanged
    assert np.array_equal(m(x, x, x)[0], y0)
    assert not m.out_proj.bias.any()  # torch's initialisation: zero biases
    m.out_proj.bias[:] = 1.0  # a view: the module changes
    y1, _ = m(x, x, x)
    np.testing.assert_allclose(y1 - y0, 1.0, atol=1e-12)
    m.in_proj_weight = np.zeros((24, 8))  # assignment copies into the module
    assert not m.in_proj_weight.any()
    y2, w2 = m(x, x, x)
    np.testing.assert_allclose(w2, 1 / 3)  # all scores 0: uniform weights
    assert m.out_proj.weight.base is not None  # still a view of the module's storage


def test_load_state_dict_strict_false_and_conversion():
    m = attn.MultiheadAttention(4, 2)
    tm = torch.nn.MultiheadAttention(4, 2, dtype=torch.float64)
    sd = tm.state_dict()
    del sd["in_proj_bias"]
    sd["extra"] = torch.zeros(1)
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert missing == ["in_proj_bias"] and unexpected == ["extra"]
    np.testing.assert_array_equal(m.in_proj_weight, tm.in_proj_weight.detach().numpy()
                                  .astype(np.float32))
    m.load_state_dict({k: v.tolist() for k, v in m.state_dict().items()})  # nested lists too


def test_modes_and_init():
    m = attn.MultiheadAttention(16, 4, seed=5)
    assert m.training is True
    assert m.eval() is m and m.training is False
    assert m.train() is m and m.training is True
    assert m.train(False) is m and not m.training
    same = attn.MultiheadAttention(16, 4, seed=5)
    for (n, a), (_, b) in zip(m.named_parameters(), same.named_parameters()):
        assert np.array_equal(a, b), n
    # torch's schemes: xavier_uniform in_proj, zero biases, Linear out_proj.
    bound = np.sqrt(6 / (48 + 16))
    assert np.abs(m.in_proj_weight).max() <= bound and np.abs(m.in_proj_weight).max() > bound / 2
    assert not m.in_proj_bias.any() and not m.out_proj.bias.any()
    assert np.abs(m.out_proj.weight).max() <= 1 / np.sqrt(16)
    for dtype in (np.float64, "float64", torch.float64, torch.double, "double"):
        assert attn.MultiheadAttention(4, 2, dtype=dtype).in_proj_weight.dtype == np.float64
    assert attn.MultiheadAttention(4, 2, dtype=torch.float32).dtype == np.float32
    assert attn.MultiheadAttention(4, 2, device="cpu").dtype == np.float32
    assert "MultiheadAttention(embed_dim=16, num_heads=4" in repr(m)


def test_explicit_head_dim_matches_torch_composition(rng):
    """Beyond torch: num_heads * head_dim != embed_dim. Checked against the
    same computation written with torch operations in float64."""
    E, H, hd, kdim = 10, 3, 4, 7
    m = attn.MultiheadAttention(E, H, kdim=kdim, head_dim=hd, dtype=np.float64, seed=3,
                                batch_first=True, add_bias_kv=True).eval()
    for p in m.parameters():
        p[...] = rng.standard_normal(p.shape) * 0.5
    N, L, S = 2, 5, 6
    x = rng.standard_normal((N, L, E))
    y = rng.standard_normal((N, S, kdim))
    z = rng.standard_normal((N, S, E))
    kpm = rng.random((N, S)) < 0.3
    out, w = m(x, y, z, key_padding_mask=kpm, average_attn_weights=False)
    t = {k: torch.from_numpy(v) for k, v in m.state_dict().items()}
    D = H * hd
    Q = F.linear(torch.from_numpy(x), t["q_proj_weight"], t["in_proj_bias"][:D])
    K = F.linear(torch.from_numpy(y), t["k_proj_weight"], t["in_proj_bias"][D:2 * D])
    V = F.linear(torch.from_numpy(z), t["v_proj_weight"], t["in_proj_bias"][2 * D:])
    K = torch.cat([K, t["bias_k"].expand(N, 1, D)], 1)
    V = torch.cat([V, t["bias_v"].expand(N, 1, D)], 1)
    keep = torch.cat([~torch.from_numpy(kpm), torch.ones(N, 1, dtype=torch.bool)], 1)
    heads = lambda a: a.view(N, -1, H, hd).transpose(1, 2)  # noqa: E731
    O, W = torch.ops.aten._scaled_dot_product_attention_math(
        heads(Q), heads(K), heads(V),
        torch.zeros(N, 1, 1, S + 1, dtype=torch.float64).masked_fill(~keep[:, None, None], -np.inf))
    ref = F.linear(O.transpose(1, 2).reshape(N, L, D), t["out_proj.weight"], t["out_proj.bias"])
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(w, W.numpy(), rtol=1e-12, atol=1e-14)
    assert m.in_proj_weight is None and m.q_proj_weight.shape == (D, E)
    assert m.out_proj.weight.shape == (E, D) and m.head_dim == hd


def test_copy_and_pickle(rng):
    import copy
    import pickle

    m = attn.MultiheadAttention(8, 2, dropout=0.25, kdim=3, vdim=3, dtype=torch.float64, seed=4)
    x, y = rng.standard_normal((5, 8)), rng.standard_normal((6, 3))
    m(x, y, y)  # one dropout call: the next uses rng_offset 1
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert clone.dtype == np.float64 and clone.kdim == 3 and clone.training
        for (n, a), (_, b) in zip(m.named_parameters(), clone.named_parameters()):
            assert np.array_equal(a, b) and not np.shares_memory(a, b), n
        assert np.array_equal(clone(x, y, y)[0], copy.deepcopy(m)(x, y, y)[0])
    clone.out_proj.bias[:] = 1
    assert not m.out_proj.bias.any()
