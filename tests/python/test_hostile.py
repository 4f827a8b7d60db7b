"""Regressions for what hostile users broke in the Python package (issue 9),
one section per finding; docs/RELIABILITY.md lists them."""

import copy
import fractions
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attn
from attn import _attn

TOL = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-14)}


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def torch_sdpa(*args, **kw):
    with warnings.catch_warnings():  # causal_lower_right with L > S warns about NaN
        warnings.simplefilter("ignore")
        return F.scaled_dot_product_attention(*args, **kw).numpy()


# ---- 1. CausalBias and other tensor subclasses ----

BIASES = {"upper_left": causal_upper_left, "lower_right": causal_lower_right}


def make_bias(variant, L, S):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BIASES[variant](L, S)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [(), (2, 3)])
@pytest.mark.parametrize("L, S", [(5, 7), (7, 5), (6, 6), (1, 4), (4, 1)])
@pytest.mark.parametrize("variant", list(BIASES))
def test_causal_bias_is_honoured_like_torch(rng, variant, L, S, batch, dtype):
    """A CausalBias holds no mask in its storage (torch allocates an
    uninitialised placeholder); it used to be read as one."""
    q, k, v = (rng.standard_normal(batch + (n, e)).astype(dtype)
               for n, e in ((L, 8), (S, 8), (S, 4)))
    bias = make_bias(variant, L, S)
    ref = torch_sdpa(t(q), t(k), t(v), attn_mask=bias)
    ours = attn.scaled_dot_product_attention(q, k, v, bias)
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours, ref, **TOL[dtype])
    # The same tensors from torch, and the mask torch itself would build.
    ours_t = attn.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=bias)
    assert np.array_equal(ours_t, ours)
    dense = attn.scaled_dot_product_attention(q, k, v, bias._materialize().numpy())
    np.testing.assert_allclose(ours, dense, **TOL[dtype])


def test_causal_bias_with_is_causal_raises_like_torch(rng):
    q = rng.standard_normal((2, 5, 8))
    for variant in BIASES:
        bias = make_bias(variant, 5, 5)
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            F.scaled_dot_product_attention(t(q), t(q), t(q), attn_mask=bias, is_causal=True)
        with pytest.raises(ValueError, match="attn_mask is a CausalBias.*is_causal=True"):
            attn.scaled_dot_product_attention(q, q, q, bias, is_causal=True)


def test_causal_bias_of_other_sizes_is_refused(rng):
    q, k = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 7, 8))
    for variant in BIASES:
        with pytest.raises(ValueError, match=r"attn_mask is a CausalBias for 5 queries and 6 keys.*"
                                             r"query has L = 5 and key S = 7"):
            attn.scaled_dot_product_attention(q, k, k, make_bias(variant, 5, 6))


def test_causal_bias_in_mha_is_refused():
    m = attn.MultiheadAttention(8, 2)
    x = np.zeros((5, 8), np.float32)
    with pytest.raises(TypeError, match="attn_mask is a CausalBias.*is_causal=True"):
        m(x, x, x, attn_mask=causal_upper_left(5, 5))


class _Lying(torch.Tensor):
    """A subclass whose data are not its storage: torch functions see a
    different tensor than the bytes."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.randn(2, 5, 8)


HIDDEN = {
    "lying subclass": lambda: torch.randn(2, 5, 8).as_subclass(_Lying),
    "FakeTensor": _fake,
    "UninitializedParameter": lambda: torch.nn.UninitializedParameter(),
}


@pytest.mark.parametrize("name", list(HIDDEN))
def test_tensor_subclasses_with_their_own_semantics_are_refused(name):
    x = HIDDEN[name]()
    plain = np.zeros((2, 5, 8))
    with pytest.raises(TypeError, match=f"key is a {type(x).__name__} .*torch.Tensor subclass"):
        attn.scaled_dot_product_attention(plain, x, plain)
    m = attn.MultiheadAttention(8, 2, dtype=np.float64)
    with pytest.raises(TypeError, match=f"query is a {type(x).__name__}"):
        m(x, plain, plain)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused(rng, transform):
    q = torch.from_numpy(rng.standard_normal((2, 5, 8)))

    def f(x):
        return torch.from_numpy(attn.scaled_dot_product_attention(x, x, x)).sum()

    with pytest.raises(TypeError, match="query is wrapped by a torch.func transform"):
        getattr(torch.func, transform)(f)(q)


def test_tensors_torch_cannot_show_as_arrays_are_refused_for_what_they_are(rng):
    """A tensor of a fine dtype whose memory torch will not hand out (a
    plain tensor inside a torch.func transform that differentiates another
    input; a ZeroTensor) is refused with torch's reason, not blamed on its
    dtype."""
    q = torch.from_numpy(rng.standard_normal((1, 2, 4)))
    mask = torch.zeros(2, 2, dtype=torch.float64)

    def f(m):
        return attn.scaled_dot_product_attention(q, q, q, attn_mask=m).sum()

    with pytest.raises(TypeError, match="^query cannot be read as an array: torch says") as e:
        torch.func.grad(f)(mask)
    assert "dtype" not in str(e.value)
    for dtype in (torch.float32, torch.bfloat16):
        zero = torch._efficientzerotensor((1, 2, 4), dtype=dtype)
        with pytest.raises(TypeError, match="^query cannot be read as an array: torch says"):
            attn.scaled_dot_product_attention(zero, zero.clone(), zero.clone())
    q16 = q.to(torch.bfloat16)

    def f16(m):
        return attn.scaled_dot_product_attention(q16, q16, q16, attn_mask=m).float().sum()

    with pytest.raises(TypeError, match="^query cannot be read as an array: torch says"):
        torch.func.grad(f16)(mask.to(torch.bfloat16))


def test_plain_subclasses_and_parameters_are_read(rng):
    class Plain(torch.Tensor):
        pass

    q = torch.from_numpy(rng.standard_normal((2, 5, 8)))
    ref = attn.scaled_dot_product_attention(q, q, q)
    for x in (q.as_subclass(Plain), torch.nn.Parameter(q, requires_grad=False)):
        assert np.array_equal(attn.scaled_dot_product_attention(x, x, x), ref)


LAYOUTS = {
    "sparse_coo": lambda x: x.to_sparse(),
    "sparse_csr": lambda x: x[0].to_sparse_csr(),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_non_strided_layouts_are_refused(name):
    x = LAYOUTS[name](torch.ones(2, 5, 8))
    with pytest.raises(TypeError, match=f"value has layout {x.layout}.*to_dense"):
        attn.scaled_dot_product_attention(np.ones((2, 5, 8)), np.ones((2, 5, 8)), x)


# ---- 2. MultiheadAttention attributes torch reads at every forward ----

def mha_pair(**kw):
    m = attn.MultiheadAttention(8, 2, dtype=np.float64, seed=5, **kw)
    tm = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64, **kw)
    tm.load_state_dict({k: t(v) for k, v in m.state_dict().items()})
    return m, tm


def run_torch(tm, *args, **kw):
    with torch.no_grad():
        y, w = tm(*(t(a) for a in args), **kw)
    return y.numpy(), None if w is None else w.numpy()


@pytest.mark.parametrize("start", [False, True])
def test_mha_batch_first_set_after_construction(rng, start):
    m, tm = mha_pair(batch_first=start)
    m.eval(), tm.eval()
    for flag in (not start, start, not start):
        m.batch_first = tm.batch_first = flag
        x = rng.standard_normal((3, 4, 8))  # (N, L, E) or (L, N, E): both fit
        y = rng.standard_normal((3, 6, 8) if flag else (6, 4, 8))
        ours, w = m(x, y, y)
        ref, rw = run_torch(tm, x, y, y)
        np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(w, rw, rtol=1e-12, atol=1e-14)
        assert ours.flags.c_contiguous
    # Unbatched inputs ignore it, as in torch.
    x = rng.standard_normal((4, 8))
    np.testing.assert_allclose(m(x, x, x)[0], run_torch(tm, x, x, x)[0], rtol=1e-12, atol=1e-14)


def test_mha_batch_first_errors_speak_of_the_current_layout(rng):
    m = attn.MultiheadAttention(8, 2)
    m.batch_first = True
    x, y = np.zeros((2, 4, 8), np.float32), np.zeros((3, 5, 8), np.float32)
    with pytest.raises(ValueError, match=r"got 2 and 3 \(batch_first=True\)"):
        m(x, y, y)
    with pytest.raises(ValueError, match=r"query.shape\[1\] is 0"):
        m(x[:, :0], y[:2], y[:2])
    with pytest.raises(TypeError, match="batch_first must be a bool"):
        m.batch_first = 1


def test_mha_dropout_set_after_construction(rng):
    x = rng.standard_normal((4, 2, 8))
    # 0 -> 1: everything dropped, in both; the output is out_proj.bias.
    m, tm = mha_pair(dropout=0.0)
    m.dropout = tm.dropout = 1.0
    ours, w = m(x, x, x)
    ref, rw = run_torch(tm, x, x, x)
    np.testing.assert_array_equal(w, 0.0)
    np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ours, np.broadcast_to(m.out_proj.bias, ours.shape), rtol=1e-12)
    # 0.5 -> 0: nothing dropped, in training mode too.
    m, tm = mha_pair(dropout=0.5)
    m.dropout = tm.dropout = 0.0
    ours, w = m(x, x, x)
    ref, rw = run_torch(tm, x, x, x)
    np.testing.assert_allclose(ours, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(w, rw, rtol=1e-12, atol=1e-14)
    # 0 -> 0.9: about 90% of the weights are dropped.
    m = attn.MultiheadAttention(8, 2, seed=1)
    m.dropout = 0.9
    y = rng.standard_normal((64, 4, 8)).astype(np.float32)
    w = m(y, y, y, average_attn_weights=False)[1]
    assert 0.87 < (w == 0).mean() < 0.93
    with pytest.raises(ValueError, match="dropout is 1.5"):
        m.dropout = 1.5
    with pytest.raises(ValueError, match="dropout is .* too large for a float"):
        m.dropout = 10**400
    assert m.dropout == 0.9


@pytest.mark.parametrize("bias", [True, False])
def test_mha_out_proj_replaced(rng, bias):
    m, tm = mha_pair(bias=bias)
    m.eval(), tm.eval()
    lin = torch.nn.Linear(8, 8, bias=bias, dtype=torch.float64).requires_grad_(False)
    m.out_proj = lin
    tm.out_proj = lin
    x = rng.standard_normal((4, 2, 8))
    np.testing.assert_allclose(m(x, x, x)[0], run_torch(tm, x, x, x)[0], rtol=1e-12, atol=1e-14)
    assert np.array_equal(m.state_dict()["out_proj.weight"], lin.weight.numpy())
    # Another attn module's out_proj.
    other = attn.MultiheadAttention(8, 2, bias=bias, dtype=np.float64, seed=9)
    m.out_proj = other.out_proj
    assert np.array_equal(m.out_proj.weight, other.out_proj.weight)
    with pytest.raises(ValueError, match="out_proj.weight has shape"):
        m.out_proj = torch.nn.Linear(8, 4, bias=bias)
    with pytest.raises(ValueError, match="out_proj.bias"):
        m.out_proj = torch.nn.Linear(8, 8, bias=not bias).requires_grad_(False)
    with pytest.raises(TypeError, match="out_proj must have a weight"):
        m.out_proj = None


def test_mha_changed_attributes_survive_copy_and_pickle(rng):
    m = attn.MultiheadAttention(8, 2, seed=3)
    m.batch_first, m.dropout = True, 1.0
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert clone.batch_first is True and clone.dropout == 1.0
        assert np.array_equal(clone(x, x, x)[0], m(x, x, x)[0])


# ---- 3. tensors that require grad ----

def test_sdpa_records_tensors_requiring_grad(rng):
    """SDPA used to refuse tensors requiring grad (no backward); it now records
    the call for autograd (test_sdpa_autograd.py), and only then."""
    q = torch.from_numpy(rng.standard_normal((2, 5, 8))).requires_grad_()
    k = torch.from_numpy(rng.standard_normal((2, 5, 8)))
    mask = torch.zeros(5, 5, dtype=torch.float64, requires_grad=True)
    ref = attn.scaled_dot_product_attention(q.detach(), k, k, mask.detach())
    assert ref.grad_fn is None and not ref.requires_grad
    for args in ((q, k, k), (k, k, k, mask)):
        out = attn.scaled_dot_product_attention(*args)
        assert out.requires_grad and out.grad_fn.name() == "AttnSdpaBackward"
    assert torch.equal(attn.scaled_dot_product_attention(q, k, k, mask).detach(), ref)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            out = attn.scaled_dot_product_attention(q, k, k, mask)
        assert out.grad_fn is None and not out.requires_grad and torch.equal(out, ref)


def test_mha_refuses_inputs_requiring_grad(rng):
    m = attn.MultiheadAttention(8, 2, dtype=np.float64)
    x = torch.from_numpy(rng.standard_normal((4, 8))).requires_grad_()
    with pytest.raises(RuntimeError, match="key requires grad.*no backward"):
        m(x.detach(), x, x.detach())
    with torch.no_grad():
        m(x, x, x)


def test_mha_parameters_from_tensors_requiring_grad(rng):
    """attn's parameters are copies. Copied from tensors that require grad,
    they stand for parameters torch would train, so a forward on torch
    inputs in grad mode is refused; NumPy inputs and no_grad are fine."""
    tm = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64)
    x = torch.from_numpy(rng.standard_normal((4, 8)))
    for load in (lambda m: m.load_state_dict(dict(tm.named_parameters())),
                 lambda m: setattr(m, "in_proj_weight", tm.in_proj_weight),
                 lambda m: setattr(m, "out_proj", tm.out_proj)):
        m = attn.MultiheadAttention(8, 2, dtype=np.float64)
        load(m)
        with pytest.raises(RuntimeError, match="was copied from a tensor that requires grad.*"
                                               "no backward"):
            m(x, x, x)
        m(x.numpy(), x.numpy(), x.numpy())
        with torch.no_grad():
            m(x, x, x)
        # Detached values (what state_dict() gives) clear the mark.
        m.load_state_dict(tm.state_dict())
        m(x, x, x)


# ---- 4. messages ----

def test_meta_tensors_are_said_to_have_no_data():
    q = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(ValueError) as info:
        attn.scaled_dot_product_attention(q, torch.empty(2, 3, 4, device="meta"), q)
    assert "key is a meta tensor" in str(info.value)
    assert "no data" in str(info.value) and ".cpu()" not in str(info.value)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_are_said_to_be_unsupported(layout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nt = torch.nested.nested_tensor([torch.zeros(2, 4), torch.zeros(3, 4)], layout=layout)
    q = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(TypeError) as info:
        attn.scaled_dot_product_attention(nt, q, q)
    assert "query is a nested tensor" in str(info.value)
    assert "not supported" in str(info.value) and "strided" not in str(info.value)


@pytest.mark.parametrize("name, value", [("scale", 10**400), ("scale", fractions.Fraction(10**400)),
                                         ("dropout_p", 10**400), ("dropout_p", -(10**400))],
                         ids=["scale", "scale-fraction", "dropout_p", "dropout_p-negative"])
def test_sdpa_numbers_too_large_for_a_float_name_the_argument(name, value):
    q = np.zeros((2, 3, 4))
    with pytest.raises(ValueError, match=f"{name} is .* too large for a float"):
        attn.scaled_dot_product_attention(q, q, q, **{name: value})


def test_mha_numbers_too_large_name_the_argument():
    with pytest.raises(ValueError, match="dropout is .* too large for a float"):
        attn.MultiheadAttention(8, 2, dropout=10**400)
    with pytest.raises(ValueError, match=r"kdim is an int of 401 digits; expected an int < 2\*\*63"):
        attn.MultiheadAttention(8, 2, kdim=10**400)


@pytest.mark.parametrize("device", ["cpu:0", "cpu:3", torch.device("cpu", 0),
                                    torch.device("cpu:1"), torch.device("cpu")])
def test_mha_accepts_any_cpu_device(device):
    m = attn.MultiheadAttention(8, 2, device=device)
    assert m(np.zeros((3, 8), np.float32), np.zeros((3, 8), np.float32),
             np.zeros((3, 8), np.float32))[0].shape == (3, 8)
    assert pickle.loads(pickle.dumps(m)).embed_dim == 8


@pytest.mark.parametrize("device", ["cuda:0", "cpu:x", "cpu:-1", "meta", 0])
def test_mha_refuses_other_devices(device):
    with pytest.raises(ValueError, match="device is .*CPU"):
        attn.MultiheadAttention(8, 2, device=device)


# ---- 5. the thread bound ----

def test_max_threads_bounds_set_num_threads():
    top = attn.max_threads()
    assert isinstance(top, int) and top == _attn.max_threads() >= 1
    try:
        attn.set_num_threads(top)
        assert attn.get_num_threads() == top
        attn.set_num_threads(1)
        for bad in (top + 1, 10**6, 2**63):
            with pytest.raises(ValueError, match=f"num_threads is {bad}; expected .*<= {top}.*"
                                                 r"attn.max_threads\(\)"):
                attn.set_num_threads(bad)
            assert attn.get_num_threads() == 1
        with pytest.raises(ValueError, match="num_threads is -1"):
            attn.set_num_threads(-1)
    finally:
        attn.set_num_threads(0)


# ---- found by a hostile tester, 2026-11-27 ----


@pytest.mark.parametrize("name, shape", [("in_proj_weight", (10, 8)), ("in_proj_weight", (24, 9)),
                                         ("in_proj_bias", (5,)), ("out_proj.weight", (8, 4))])
def test_mha_parameter_of_the_wrong_shape_is_refused(name, shape):
    """A parameter replaced by one of another shape was copied into the C
    module element by element: a result from the wrong (or a previous
    call's) values, where torch's module raises."""
    x = torch.randn(2, 3, 8)
    ours = attn.nn.MultiheadAttention(8, 2, batch_first=True)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    for m in (ours, theirs):
        owner, attr = (m.out_proj, "weight") if name == "out_proj.weight" else (m, name)
        setattr(owner, attr, torch.nn.Parameter(torch.randn(shape)))
    with pytest.raises(RuntimeError, match=rf"{name} has shape \(.*expected"):
        ours(x, x, x)
    with pytest.raises(RuntimeError):  # torch's own error
        theirs(x, x, x)
    with attn.patch_torch(), pytest.raises(RuntimeError):  # falls back to torch's forward
        theirs(x, x, x)


def test_kvcache_append_moves_the_torch_version_counter():
    """The append wrote through NumPy views: a graph that saved the cache
    computed its gradient from the new rows instead of raising."""
    B, S, H, E = 1, 4, 1, 2
    k_cache, v_cache = torch.zeros(B, S, H, E), torch.zeros(B, S, H, E)
    w = torch.ones(B, S, H, E, requires_grad=True)
    y = (w * k_cache).sum()  # saves k_cache
    q, k, v = torch.randn(B, 1, H, E), torch.ones(B, 1, H, E), torch.ones(B, 1, H, E)
    attn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=0)
    assert k_cache._version == 1 and v_cache._version == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    attn.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=1)  # no append: no write
    assert k_cache._version == 1


def test_kvcache_inference_tensors_are_written_only_in_inference_mode():
    B, S, H, E = 1, 4, 1, 2
    with torch.inference_mode():
        kc, vc = torch.zeros(B, S, H, E), torch.zeros(B, S, H, E)
    q, k, v = torch.randn(B, 1, H, E), torch.ones(B, 1, H, E), torch.ones(B, 1, H, E)
    with pytest.raises(RuntimeError, match="inference tensor"):
        attn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=0)
    assert not kc.any()
    with torch.inference_mode():
        attn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=0)
    assert torch.equal(kc[0, 0], k[0, 0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_infinite_sinks_and_slopes_are_refused(dtype):
    """+inf sinks gave NaN in float32 (out 0, lse +inf in float64); an
    infinite ALiBi slope gave NaN (inf times the distance 0)."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 3, 4)).astype(dtype) for _ in range(3))
    with pytest.raises(ValueError, match=r"sinks holds \+inf"):
        attn.scaled_dot_product_attention(q, k, v, sinks=np.array([np.inf, 0.0]))
    with pytest.raises(ValueError, match="infinite slope"):
        attn.scaled_dot_product_attention(q, k, v, alibi_slopes=np.array([0.5, -np.inf]))
    plain = attn.scaled_dot_product_attention(q, k, v)
    no_sink = attn.scaled_dot_product_attention(q, k, v, sinks=np.array([-np.inf, -np.inf]))
    np.testing.assert_array_equal(plain, no_sink)


# ---- found by a hostile tester, 2026-11-28 ----


def test_a_mask_that_requires_grad_is_never_silently_left_without_one():
    """attn.nn.MultiheadAttention (and torch's module patched, and the encoder
    layer's training path) took a float mask requiring grad as a constant: no
    gradient, no error. attn's module now refuses it by name; patched torch
    falls back to torch's forward, which gives the mask its gradient."""
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    ours = attn.nn.MultiheadAttention(16, 2, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 16)
    for kw in (dict(attn_mask=torch.zeros(5, 5, requires_grad=True)),
               dict(key_padding_mask=torch.zeros(2, 5, requires_grad=True))):
        name = next(iter(kw))
        with pytest.raises(TypeError, match=f"{name} requires grad"):
            ours(x, x, x, need_weights=False, **kw)
        with torch.no_grad():  # nothing to give a gradient to: runs
            ours(x, x, x, need_weights=False, **kw)
    want = torch.zeros(5, 5, requires_grad=True)
    ref(x, x, x, attn_mask=want, need_weights=False)[0].sum().backward()
    got = torch.zeros(5, 5, requires_grad=True)
    with attn.patch_torch() as p:
        ref(x, x, x, attn_mask=got, need_weights=False)[0].sum().backward()
    assert p.fell_back == 1 and got.grad is not None
    torch.testing.assert_close(got.grad, want.grad)
    layer = attn.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    with pytest.raises(TypeError, match="src_mask|attn_mask requires grad"):
        layer(x.requires_grad_(), src_mask=torch.zeros(5, 5, requires_grad=True))


def test_encoder_layer_reads_its_submodules_not_the_state_dict_order():
    """The inference path loaded the C layer from state_dict() in order: a
    parametrized norm1.weight put its bias where the weight goes (off by
    3.8), pruning added a key (ValueError naming nothing), and a dropout
    replaced by Identity raised AttributeError."""
    import torch.nn.utils.parametrize as parametrize
    import torch.nn.utils.prune as prune

    kw = dict(d_model=16, nhead=4, dim_feedforward=24, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16)

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoderLayer(**kw).eval()
    with torch.no_grad():
        for prm in ref.parameters():
            prm.add_(torch.randn_like(prm) * 0.1)
    ours = attn.nn.TransformerEncoderLayer(**kw).eval()
    ours.load_state_dict(ref.state_dict())
    for m in (ref, ours):
        parametrize.register_parametrization(m.norm1, "weight", Double())
    pruned = [attn.nn.TransformerEncoderLayer(**kw).eval(), torch.nn.TransformerEncoderLayer(**kw)]
    pruned[1].load_state_dict(pruned[0].state_dict())
    for m in pruned:
        prune.l1_unstructured(m.linear1, "weight", amount=0.5)
    identity = attn.nn.TransformerEncoderLayer(**kw).eval()
    identity.dropout = torch.nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pruned[0](x), pruned[1].eval()(x), rtol=1e-5, atol=1e-5)
        plain = torch.nn.TransformerEncoderLayer(**kw).eval()  # eval: dropout is the identity
        plain.load_state_dict(identity.state_dict())
        torch.testing.assert_close(identity(x), plain(x), rtol=1e-5, atol=1e-5)


def test_forward_mode_tangents_are_refused_not_dropped():
    """Dual tensors do not require grad, so the untracked shortcut ran and
    the tangent was dropped (None) where torch's math path gives one."""
    import torch.autograd.forward_ad as fwAD

    q, k = (torch.randn(1, 2, 3, 4, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 3, 5, dtype=torch.float64)
    layer = attn.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True,
                                            dtype=torch.float64).eval()
    with fwAD.dual_level():
        dq = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="jvp"):
            attn.scaled_dot_product_attention(dq, k, v)
        want = fwAD.unpack_dual(F.scaled_dot_product_attention(dq, k, v)).tangent
        with attn.patch_torch() as p:  # patched torch hands it to torch's own, tangent and all
            got = fwAD.unpack_dual(F.scaled_dot_product_attention(dq, k, v)).tangent
        assert p.fell_back == 1 and got is not None
        torch.testing.assert_close(got, want)
        with torch.no_grad(), pytest.raises(NotImplementedError, match="jvp"):
            layer(fwAD.make_dual(q[0], torch.randn_like(q[0])))


def test_patches_undone_out_of_order_restore_torch():
    """p1 = patch; p2 = patch; p1(); p2() left torch patched with p1's
    functions and no _attn_original_forward: every MHA fallback then called
    itself (RecursionError)."""
    mha_forward = torch.nn.MultiheadAttention.forward
    p1 = attn.patch_torch()
    p2 = attn.patch_torch()
    p1()  # not the newest: comes off with p2
    p2()
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"
    assert torch.nn.MultiheadAttention.forward is mha_forward
    assert "_attn_original_forward" not in vars(torch.nn.MultiheadAttention)
    x = torch.randn(3, 2, 8)
    torch.nn.MultiheadAttention(8, 2)(x, x, x)  # torch's own forward, once
    p1()  # an undo done twice does nothing
    assert torch.nn.MultiheadAttention.forward is mha_forward


def test_a_traced_encoder_layer_records_torch_operations():
    """torch.jit.trace under no_grad recorded the C path's output as a
    constant: the traced layer answered every input with the traced one's
    output."""
    torch.manual_seed(0)
    layer = attn.nn.TransformerEncoderLayer(16, 4, 24, dropout=0.0, batch_first=True).eval()
    x1, x2 = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(layer, (x1,))
        torch.testing.assert_close(traced(x2), layer(x2), rtol=1e-5, atol=1e-5)


def test_patched_torch_leaves_to_torch_what_torch_decides():
    """Patched torch answered where torch's own gives another answer: it
    took a 1-d SDPA mask and an MHA float mask of another dtype (torch
    raises), ignored autocast (float32 out where torch gives bfloat16), and
    refused inference tensors that torch's MHA trains on."""
    q = torch.randn(1, 2, 4, 8)
    mask_1d = torch.tensor([True, False, True, True])
    with pytest.raises(IndexError):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask_1d)
    with attn.patch_torch(), pytest.raises(IndexError):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask_1d)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    kpm = torch.zeros(2, 5, dtype=torch.float64)
    with attn.patch_torch(), pytest.raises(RuntimeError):
        mha(x, x, x, key_padding_mask=kpm, need_weights=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.scaled_dot_product_attention(q, q, q)
        with attn.patch_torch() as p:
            got = F.scaled_dot_product_attention(q, q, q)
    assert got.dtype == want.dtype == torch.bfloat16 and p.fell_back == 1
    with torch.inference_mode():
        xi = torch.randn(2, 5, 8)
    with attn.patch_torch():
        mha(xi, xi, xi)[0].sum().backward()
    assert mha.in_proj_weight.grad is not None


def test_kvcache_halves_of_one_paged_buffer_are_not_an_overlap():
    """K and V caches as the two halves of one (pages, 2, page, H, E) buffer
    (FlashInfer's paged layout) interleave without sharing an element; the
    overlap check compared address ranges and refused the append ("k_cache
    and v_cache overlap in memory")."""
    kv = torch.zeros(8, 2, 4, 2, 8)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    q, k, v = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    attn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table)
    assert torch.equal(k_cache[0, 3], k[0, 0]) and torch.equal(v_cache[0, 3], v[0, 0])
    assert torch.equal(k_cache[3, 1], k[1, 0]) and torch.equal(v_cache[3, 1], v[1, 0])
    with pytest.raises(ValueError, match="overlap"):  # a real overlap is still refused
        attn.attention_with_kvcache(q, k_cache, k_cache, k, v, cache_seqlens=lens,
                                    block_table=table)
