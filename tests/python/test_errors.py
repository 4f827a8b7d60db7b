"""Every invalid argument raises the right exception — ValueError for shapes
and values, TypeError for types and dtypes, MemoryError when memory runs
out — with a message that names the argument (by its Python name) and says
what was expected. Nothing crashes the interpreter.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import attn
import conformance

f32 = np.float32


def qkv(dtype=f32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((2, 3, 4, 8)).astype(dtype),
            rng.standard_normal((2, 3, 5, 8)).astype(dtype),
            rng.standard_normal((2, 3, 5, 6)).astype(dtype))


Q, K, V = qkv()


def sdpa(**kw):
    args = dict(query=Q, key=K, value=V)
    args.update(kw)
    return attn.scaled_dot_product_attention(**args)


# (arguments, exception, words the message must contain)
SDPA_ERRORS = {
    "query int": (dict(query=Q.astype(np.int64)), TypeError, ["query", "int64", "float32 or float64"]),
    "key float16 alone": (dict(key=K.astype(np.float16)), TypeError, ["key and value must share one dtype", "float16"]),
    "key int16": (dict(key=K.astype(np.int16)), TypeError, ["key", "int16", "float16, bfloat16, float32 or float64"]),
    "value bool": (dict(value=V > 0), TypeError, ["value", "bool", "float32 or float64"]),
    "query strings": (dict(query=[["a", "b"]]), TypeError, ["query", "<U1"]),
    "query None": (dict(query=None), TypeError, ["query", "None"]),
    "query ragged": (dict(query=[[1.0], [1.0, 2.0]]), TypeError, ["query", "array"]),
    "mixed dtypes": (dict(key=K.astype(np.float64)), TypeError, ["query, key and value", "float32", "float64"]),
    "mask int": (dict(attn_mask=np.ones((4, 5), np.int32)), TypeError, ["attn_mask", "int32", "bool, float16, bfloat16, float32 or float64"]),
    "mask complex": (dict(attn_mask=np.ones((4, 5), np.complex64)), TypeError, ["attn_mask", "complex64"]),
    "query 1-D": (dict(query=Q[0, 0, 0]), ValueError, ["query has rank 1", "expected 2"]),
    "query 9-D": (dict(query=Q.reshape((1,) * 5 + Q.shape)), ValueError, ["query", "9 dimensions", "at most 8"]),
    "E mismatch": (dict(key=K[..., :7]), ValueError, ["key.shape[-1] is 7", "query.shape[-1] is 8"]),
    "S mismatch": (dict(value=V[..., :4, :]), ValueError, ["value.shape[-2] is 4", "key.shape[-2] is 5"]),
    "batch mismatch": (dict(key=np.concatenate([K, K, K])[:3], value=np.concatenate([V, V, V])[:3]),
                       ValueError, ["batch dimension -4 does not broadcast", "query has 2", "key 3"]),
    "heads need gqa": (dict(query=np.concatenate([Q, Q], 1)), ValueError,
                       ["batch dimension -3 does not broadcast", "query has 6", "set enable_gqa"]),
    "gqa not a multiple": (dict(key=K[:, :2], value=V[:, :2], enable_gqa=True), ValueError,
                           ["enable_gqa", "query has 3 heads", "key 2", "multiple"]),
    "gqa without heads": (dict(query=Q[0, 0], key=K[0, 0], value=V[0, 0], enable_gqa=True),
                          ValueError, ["enable_gqa needs a head dimension"]),
    "empty dim": (dict(query=Q[:, :0]), ValueError, ["query.shape[1] is 0", "every dimension must be >= 1"]),
    "empty key": (dict(key=K[:, :, :0], value=V[:, :, :0]), ValueError, ["key", "is 0", ">= 1"]),
    "mask shape": (dict(attn_mask=np.ones((3, 5), bool)), ValueError,
                   ["attn_mask has shape (3, 5)", "does not broadcast", "(2, 3, 4, 5)"]),
    "mask rank": (dict(attn_mask=np.ones((1, 2, 3, 4, 5), bool)), ValueError,
                  ["attn_mask has rank 5", "more than"]),
    "dropout_p > 1": (dict(dropout_p=1.5), ValueError, ["dropout_p is 1.5", "[0, 1]"]),
    "dropout_p < 0": (dict(dropout_p=-0.1), ValueError, ["dropout_p", "[0, 1]"]),
    "dropout_p nan": (dict(dropout_p=float("nan")), ValueError, ["dropout_p is nan"]),
    "dropout_p str": (dict(dropout_p="0.1"), TypeError, ["dropout_p", "str"]),
    "dropout_p bool": (dict(dropout_p=True), TypeError, ["dropout_p", "bool"]),
    "is_causal int": (dict(is_causal=1), TypeError, ["is_causal must be a bool", "int"]),
    "is_causal None": (dict(is_causal=None), TypeError, ["is_causal", "NoneType"]),
    "scale nan": (dict(scale=float("nan")), ValueError, ["scale is nan", "finite"]),
    "scale inf": (dict(scale=float("-inf")), ValueError, ["scale is -inf", "finite"]),
    "scale str": (dict(scale="2"), TypeError, ["scale", "str"]),
    "enable_gqa str": (dict(enable_gqa="yes"), TypeError, ["enable_gqa must be a bool"]),
    "causal_alignment": (dict(is_causal=True, causal_alignment="bottom"), ValueError,
                         ["causal_alignment is 'bottom'", "'top-left' or 'bottom-right'"]),
    "causal_alignment type": (dict(causal_alignment=2), ValueError, ["causal_alignment is 2"]),
    "seed negative": (dict(dropout_p=0.1, seed=-1), ValueError, ["seed is -1", "[0, 2**64)"]),
    "seed too large": (dict(dropout_p=0.1, seed=2**64), ValueError, ["seed", "[0, 2**64)"]),
    "seed float": (dict(dropout_p=0.1, seed=1.0), TypeError, ["seed", "float"]),
    "return_weights int": (dict(return_weights=1), TypeError, ["return_weights must be a bool"]),
    "return_lse str": (dict(return_lse="no"), TypeError, ["return_lse must be a bool"]),
    "torch meta tensor": (dict(query=torch.empty(2, 3, 4, 8, device="meta")), ValueError,
                          ["query is a meta tensor", "no data"]),
    "torch bfloat16 alone": (dict(key=torch.zeros(2, 3, 5, 8, dtype=torch.bfloat16)), TypeError,
                             ["must share one dtype", "bfloat16", "float32"]),
    "torch int16": (dict(key=torch.zeros(2, 3, 5, 8, dtype=torch.int16)), TypeError,
                    ["key", "int16", "float16, bfloat16, float32 or float64"]),
    "torch int mask": (dict(attn_mask=torch.ones(4, 5, dtype=torch.int64)), TypeError,
                       ["attn_mask", "int64"]),
    "torch sparse": (dict(value=torch.zeros(2, 3, 5, 6).to_sparse()), TypeError,
                     ["value has layout torch.sparse_coo", "strided", "value.to_dense()"]),
}


@pytest.mark.parametrize("name", list(SDPA_ERRORS))
def test_sdpa_invalid_argument(name):
    kw, exc, words = SDPA_ERRORS[name]
    with pytest.raises(exc) as info:
        sdpa(**kw)
    msg = str(info.value)
    for w in words:
        assert w in msg, f"{name}: {w!r} not in {msg!r}"
    assert type(info.value) is exc or issubclass(type(info.value), exc)


def test_sdpa_messages_use_python_names():
    """The C library says q, k, v; Python callers see query, key, value."""
    import re

    for kw in (dict(key=K[..., :7]), dict(key=K.astype(np.float64)), dict(value=V[..., :2, :]),
               dict(key=K[:, :2], value=V[:, :2], enable_gqa=True)):
        with pytest.raises((ValueError, TypeError)) as info:
            sdpa(**kw)
        assert not re.search(r"\b[qkv]\b", str(info.value)), str(info.value)


def test_sdpa_size_overflow_is_a_value_error():
    """Broadcast views whose output would hold more than 2^63 elements."""
    q = np.broadcast_to(np.zeros((1, 1, 1, 8), f32), (2**31, 1, 1, 8))
    k = np.broadcast_to(np.zeros((1, 1, 1, 8), f32), (1, 2**31, 1, 8))
    with pytest.raises(ValueError, match="overflows 64 bits"):
        attn.scaled_dot_product_attention(q, k, k)


def test_sdpa_out_of_memory_is_a_memory_error():
    """A valid call whose 2^50-byte output cannot be allocated."""
    q = np.broadcast_to(np.zeros((1, 1, 8), f32), (2**24, 2**22, 8))
    with pytest.raises(MemoryError):
        attn.scaled_dot_product_attention(q, q[:1, :1], q[:1, :1])


# ---------------------------------------------------------------------------
# MultiheadAttention
# ---------------------------------------------------------------------------

MHA_CTOR_ERRORS = {
    "embed_dim 0": (dict(embed_dim=0), ValueError, ["embed_dim is 0", ">= 1"]),
    "embed_dim float": (dict(embed_dim=8.0), TypeError, ["embed_dim must be an int", "float"]),
    "num_heads 0": (dict(num_heads=0), ValueError, ["num_heads is 0"]),
    "num_heads negative": (dict(num_heads=-2), ValueError, ["num_heads is -2"]),
    "not divisible": (dict(embed_dim=200, num_heads=6), ValueError,
                      ["embed_dim 200 is not divisible by num_heads 6", "even split", "head_dim"]),
    "dropout": (dict(dropout=1.5), ValueError, ["dropout is 1.5", "[0, 1]"]),
    "dropout str": (dict(dropout="0"), TypeError, ["dropout", "str"]),
    "kdim 0": (dict(kdim=0), ValueError, ["kdim is 0"]),
    "vdim str": (dict(vdim="3"), TypeError, ["vdim must be None or an int"]),
    "head_dim 0": (dict(head_dim=0), ValueError, ["head_dim is 0"]),
    "bias int": (dict(bias=1), TypeError, ["bias must be a bool"]),
    "batch_first None": (dict(batch_first=None), TypeError, ["batch_first must be a bool"]),
    "add_bias_kv str": (dict(add_bias_kv="no"), TypeError, ["add_bias_kv must be a bool"]),
    "add_zero_attn int": (dict(add_zero_attn=0), TypeError, ["add_zero_attn must be a bool"]),
    "dtype complex": (dict(dtype=np.complex64), TypeError,
                      ["dtype is", "complex64", "float32, float64, float16 or bfloat16"]),
    "dtype torch int": (dict(dtype=torch.int16), TypeError, ["dtype is", "int16"]),
    "dtype int": (dict(dtype="int32"), TypeError, ["dtype is int32"]),
    "dtype nonsense": (dict(dtype="floaty"), TypeError, ["dtype is floaty"]),
    "device cuda": (dict(device="cuda"), ValueError, ["device is 'cuda'", "CPU"]),
    "seed negative": (dict(seed=-3), ValueError, ["seed is -3"]),
}


@pytest.mark.parametrize("name", list(MHA_CTOR_ERRORS))
def test_mha_constructor_invalid_argument(name):
    kw, exc, words = MHA_CTOR_ERRORS[name]
    args = dict(embed_dim=8, num_heads=2)
    args.update(kw)
    with pytest.raises(exc) as info:
        attn.MultiheadAttention(**args)
    for w in words:
        assert w in str(info.value), f"{name}: {w!r} not in {info.value}"


rng = np.random.default_rng(1)
X = rng.standard_normal((4, 2, 8)).astype(f32)  # (L, N, E)
Y = rng.standard_normal((5, 2, 8)).astype(f32)  # (S, N, E)

MHA_CALL_ERRORS = {
    "query rank 1": (dict(query=X[0, 0]), ValueError, ["query has rank 1", "expected 3 (batched) or 2"]),
    "query rank 4": (dict(query=X[None]), ValueError, ["query has rank 4"]),
    "query features": (dict(query=X[..., :5]), ValueError, ["query.shape[-1] is 5", "embed_dim = 8"]),
    "key rank": (dict(key=Y[:, 0]), ValueError, ["key has rank 2", "like the query"]),
    "key features": (dict(key=Y[..., :3], value=Y[..., :3]), ValueError, ["key.shape[-1] is 3", "kdim = 8"]),
    "value features": (dict(value=Y[..., :7]), ValueError, ["value.shape[-1] is 7", "vdim = 8"]),
    "value positions": (dict(value=Y[:4]), ValueError, ["key has 5 positions but value has 4"]),
    "key batch": (dict(key=Y[:, :1], value=Y[:, :1]), ValueError,
                  ["query and key must have the same batch size", "got 2 and 1", "batch_first=False"]),
    "value batch": (dict(value=Y[:, :1]), ValueError,
                    ["query, key and value must have the same batch size", "got 2, 2 and 1"]),
    "query dtype": (dict(query=X.astype(np.float64)), TypeError, ["query is float64", "module is float32"]),
    "query int": (dict(query=X.astype(np.int32)), TypeError, ["query has dtype int32"]),
    "value dtype": (dict(value=Y.astype(np.float64)), TypeError, ["value is float64", "module is float32"]),
    "kpm shape": (dict(key_padding_mask=np.zeros((2, 4), bool)), ValueError,
                  ["key_padding_mask has shape (2, 4)", "expected (2, 5)"]),
    "kpm dtype": (dict(key_padding_mask=np.zeros((2, 5), np.int8)), TypeError,
                  ["key_padding_mask has dtype int8"]),
    "mask shape": (dict(attn_mask=np.zeros((4, 4), bool)), ValueError,
                   ["attn_mask has shape (4, 4)", "expected (4, 5) or (4, 4, 5)"]),
    "mask 3-D shape": (dict(attn_mask=np.zeros((2, 4, 5), bool)), ValueError,
                       ["attn_mask has shape (2, 4, 5)", "(batch * num_heads, L, S)"]),
    "mask dtype": (dict(attn_mask=np.zeros((4, 5), np.uint8)), TypeError, ["attn_mask has dtype uint8"]),
    "need_weights int": (dict(need_weights=1), TypeError, ["need_weights must be a bool"]),
    "average str": (dict(average_attn_weights="yes"), TypeError, ["average_attn_weights must be a bool"]),
    "is_causal None": (dict(is_causal=None), TypeError, ["is_causal must be a bool"]),
    "empty sequence": (dict(key=Y[:0], value=Y[:0]), ValueError, ["key", "is 0", ">= 1"]),
}


@pytest.mark.parametrize("name", list(MHA_CALL_ERRORS))
def test_mha_call_invalid_argument(name):
    kw, exc, words = MHA_CALL_ERRORS[name]
    m = attn.MultiheadAttention(8, 2)
    args = dict(query=X, key=Y, value=Y)
    args.update(kw)
    with pytest.raises(exc) as info:
        m(**args)
    for w in words:
        assert w in str(info.value), f"{name}: {w!r} not in {info.value}"


# (call, exception, status_name, arg): failures the C library reports carry
# its structured fields, the argument in Python's terms.
LIBRARY_ERRORS = {
    "sdpa E mismatch": (lambda: sdpa(key=K[..., :7]), ValueError, "ATTN_ERR_SHAPE", "key"),
    "sdpa S mismatch": (lambda: sdpa(value=V[..., :4, :]), ValueError, "ATTN_ERR_SHAPE", "value"),
    "sdpa mask shape": (lambda: sdpa(attn_mask=np.ones((3, 5), bool)), ValueError,
                        "ATTN_ERR_SHAPE", "attn_mask"),
    "sdpa empty query": (lambda: sdpa(query=Q[:, :0]), ValueError, "ATTN_ERR_SHAPE", "query"),
    "mha key batch": (lambda: attn.MultiheadAttention(8, 2)(X, Y[:, :1], Y[:, :1]), ValueError,
                      "ATTN_ERR_SHAPE", "key"),
    "mha value dtype": (lambda: attn.MultiheadAttention(8, 2)(X, Y, Y.astype(np.float64)),
                        TypeError, "ATTN_ERR_DTYPE", "value"),
    "mha kpm shape": (lambda: attn.MultiheadAttention(8, 2)(X, Y, Y, np.zeros((2, 4), bool)),
                      ValueError, "ATTN_ERR_SHAPE", "key_padding_mask"),
    "mha not divisible": (lambda: attn.MultiheadAttention(200, 6), ValueError, "ATTN_ERR_SHAPE",
                          "num_heads"),
}


@pytest.mark.parametrize("name", list(LIBRARY_ERRORS))
def test_library_errors_carry_status_and_python_arg(name):
    call, exc, status_name, arg = LIBRARY_ERRORS[name]
    with pytest.raises(exc) as info:
        call()
    e = info.value
    assert (e.status_name, e.arg) == (status_name, arg), (e.status_name, e.arg, str(e))
    assert isinstance(e.status, int) and e.status > 0


def test_python_side_errors_carry_no_status():
    """Checks made before the library is called say so by having no status."""
    with pytest.raises(ValueError) as info:
        sdpa(dropout_p=1.5)
    assert not hasattr(info.value, "status")


def test_load_state_dict_errors_name_the_key():
    m = attn.MultiheadAttention(8, 2, add_bias_kv=True)
    good = m.state_dict()
    missing = {k: v for k, v in good.items() if k != "bias_k"}
    with pytest.raises(ValueError, match="missing key\\(s\\) 'bias_k'"):
        m.load_state_dict(missing)
    extra = dict(good, **{"in_proj_weight.extra": np.zeros(1)})
    with pytest.raises(ValueError, match="unexpected key\\(s\\) 'in_proj_weight.extra'"):
        m.load_state_dict(extra)
    wrong = dict(good, **{"out_proj.weight": np.zeros((8, 7))})
    with pytest.raises(ValueError) as info:
        m.load_state_dict(wrong)
    assert "out_proj.weight has shape (8, 7)" in str(info.value)
    assert "(8, 8)" in str(info.value)
    with pytest.raises(TypeError, match="in_proj_bias has dtype <U1"):
        m.load_state_dict(dict(good, in_proj_bias=np.array(["x"] * 24)))
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        m.load_state_dict([("in_proj_weight", good["in_proj_weight"])])
    # Nothing was half-loaded by the failed calls.
    for k, v in m.state_dict().items():
        assert np.array_equal(v, good[k])
    # A torch module of another configuration: the keys tell.
    other = torch.nn.MultiheadAttention(8, 2, kdim=3).state_dict()
    with pytest.raises(ValueError) as info:
        m.load_state_dict(other)
    for key in ("in_proj_weight", "bias_k", "q_proj_weight", "k_proj_weight"):
        assert key in str(info.value)


def test_parameter_assignment_errors():
    m = attn.MultiheadAttention(8, 2, bias=False)
    with pytest.raises(ValueError, match="in_proj_weight has shape \\(8, 8\\); this module expects \\(24, 8\\)"):
        m.in_proj_weight = np.zeros((8, 8))
    with pytest.raises(ValueError, match="no parameter 'in_proj_bias'"):
        m.in_proj_bias = np.zeros(24)
    with pytest.raises(ValueError, match="no parameter 'out_proj.bias'"):
        m.out_proj.bias = np.zeros(8)
    with pytest.raises(TypeError, match="out_proj.weight has dtype bool"):
        m.out_proj.weight = np.zeros((8, 8), bool)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), ("2", TypeError), (2.0, TypeError),
                                      (True, TypeError), (10**6, ValueError)])
def test_set_num_threads_errors(bad, exc):
    before = attn.get_num_threads()
    with pytest.raises(exc, match="num_threads"):
        attn.set_num_threads(bad)
    assert attn.get_num_threads() == before


def test_nothing_crashes_the_interpreter():
    """Hundreds of random malformed calls in a child process: each must raise
    TypeError, ValueError or MemoryError (or succeed); the process must exit
    normally."""
    script = textwrap.dedent(
        """
        import numpy as np, attn
        rng = np.random.default_rng(%d)
        dtypes = [np.float32, np.float64, np.float16, np.int32, np.bool_, np.complex64, object]
        def arr():
            r = rng.random()
            if r < 0.05: return None
            if r < 0.1: return "text"
            nd = int(rng.integers(0, 10))
            shape = tuple(int(rng.choice([0, 1, 2, 3, 5])) for _ in range(nd))
            a = np.ones(shape, dtype=dtypes[int(rng.integers(0, len(dtypes)))])
            if a.ndim and rng.random() < 0.3: a = np.flip(a, -1)
            if a.ndim > 1 and rng.random() < 0.3: a = np.swapaxes(a, 0, -1)
            return a
        def scalar():
            return [None, True, 0, -1, 0.5, 2.0, float("nan"), "x", 2**70, [1]][int(rng.integers(0, 10))]
        ok = bad = 0
        for i in range(600):
            try:
                if i %% 2:
                    attn.scaled_dot_product_attention(arr(), arr(), arr(), arr() if rng.random() < 0.5 else None,
                        dropout_p=scalar() if rng.random() < 0.3 else 0.0,
                        is_causal=bool(rng.random() < 0.5), scale=scalar() if rng.random() < 0.3 else None,
                        enable_gqa=bool(rng.random() < 0.3), return_weights=True, return_lse=True,
                        causal_alignment="bottom-right")
                else:
                    m = attn.MultiheadAttention(4, 2, kdim=int(rng.integers(1, 4)) if rng.random() < 0.3 else None,
                        add_bias_kv=bool(rng.random() < 0.5), add_zero_attn=bool(rng.random() < 0.5),
                        batch_first=bool(rng.random() < 0.5))
                    m(arr(), arr(), arr(), key_padding_mask=arr() if rng.random() < 0.5 else None,
                      attn_mask=arr() if rng.random() < 0.5 else None,
                      need_weights=bool(rng.random() < 0.5), is_causal=bool(rng.random() < 0.5))
                ok += 1
            except (TypeError, ValueError, MemoryError):
                bad += 1
        print(ok, bad)
        """
    ) % conformance.SEED
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    ok, bad = map(int, r.stdout.split())
    assert ok + bad == 600 and bad > 300
