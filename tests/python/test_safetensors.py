"""safetensors files between attn and the reference implementation (the
`safetensors` package): files attn writes read with safetensors.numpy /
safetensors.torch, files they write read with attn, every dtype, 0-d and
empty tensors, strided sources, metadata, and the errors of both functions.
"""

import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file as np_load, save_file as np_save
from safetensors.torch import load_file as torch_load, save_file as torch_save

import attn

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "data", "safetensors")


def _arrays(rng):
    """Every NumPy dtype attn saves, ranks 0 to 8, strided and empty ones."""
    out = {}
    for dt in (np.float32, np.float64, np.float16, np.bool_):
        for rank in range(9):
            shape = tuple(int(s) for s in rng.integers(1, 4 if rank < 6 else 3, size=rank))
            if dt == np.bool_:
                a = rng.random(shape) < 0.5
            else:
                a = rng.standard_normal(shape).astype(dt)
            out[f"{np.dtype(dt).name}.r{rank}"] = a
            if rank >= 2:  # transposed and reversed views, read where they lie
                out[f"{np.dtype(dt).name}.r{rank}.T"] = a.T
                out[f"{np.dtype(dt).name}.r{rank}.rev"] = a[::-1, ..., ::2]
        out[f"{np.dtype(dt).name}.empty"] = np.zeros((2, 0, 3), dtype=dt)
    return out


def test_attn_writes_reference_reads(tmp_path):
    tensors = _arrays(np.random.default_rng(0))
    path = tmp_path / "attn.safetensors"
    attn.save_safetensors(path, tensors, metadata={"format": "np", "é": "ü\n\"\\"})
    back = np_load(str(path))
    assert set(back) == set(tensors)
    for name, a in tensors.items():
        assert back[name].dtype == a.dtype, name
        assert back[name].shape == a.shape, name
        np.testing.assert_array_equal(back[name], a, err_msg=name)
    with safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "np", "é": "ü\n\"\\"}
    # attn reads its own file the same.
    mine = attn.load_safetensors(path)
    for name, a in tensors.items():
        np.testing.assert_array_equal(mine[name], a, err_msg=name)
        assert mine[name].dtype == a.dtype and mine[name].flags.writeable


def test_reference_writes_attn_reads(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {k: np.ascontiguousarray(v) for k, v in _arrays(rng).items()}
    tensors["i64"] = np.array([[1, -2], [3, 2**62]], dtype=np.int64)
    tensors["u8"] = np.arange(7, dtype=np.uint8)
    tensors["i32"] = np.array(-5, dtype=np.int32)
    path = tmp_path / "ref.safetensors"
    np_save(tensors, str(path), metadata={"k": "v"})
    back = attn.load_safetensors(path)
    assert list(back) == list(np_load(str(path)))  # the header's order
    for name, a in tensors.items():
        assert back[name].dtype == a.dtype, name
        np.testing.assert_array_equal(back[name], a, err_msg=name)
    assert attn.load_safetensors_metadata(path) == {"k": "v"}
    # Only some names; converted to float64 (bool and integers keep theirs).
    some = attn.load_safetensors(path, names=["float16.r3", "bool.r2", "i64"], dtype="float64")
    assert list(some) == ["float16.r3", "bool.r2", "i64"]
    assert some["float16.r3"].dtype == np.float64
    np.testing.assert_array_equal(some["float16.r3"], tensors["float16.r3"].astype(np.float64))
    assert some["bool.r2"].dtype == np.bool_ and some["i64"].dtype == np.int64
    as32 = attn.load_safetensors(path, names=["float64.r2"], dtype=np.float32)["float64.r2"]
    np.testing.assert_array_equal(as32, tensors["float64.r2"].astype(np.float32))


def test_bfloat16_with_torch(tmp_path):
    g = torch.Generator().manual_seed(2)
    t = {
        "w": torch.randn(4, 5, generator=g).to(torch.bfloat16),
        "special": torch.tensor([0.0, -0.0, 1e-40, float("inf"), float("-inf"), float("nan"),
                                 3e38], dtype=torch.bfloat16),
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "f": torch.randn(3, generator=g),
    }
    path = tmp_path / "bf16.safetensors"
    torch_save(t, str(path))
    back = attn.load_safetensors(path)
    assert back["w"].dtype == np.float32 and back["scalar"].shape == ()
    for name in ("w", "special", "scalar"):  # bfloat16 widens exactly
        want = t[name].float().numpy()
        np.testing.assert_array_equal(back[name], want, err_msg=name)
        assert np.array_equal(np.signbit(back[name]), np.signbit(want))
        assert torch.equal(torch.from_numpy(back[name]).to(torch.bfloat16).view(torch.int16),
                           t[name].view(torch.int16)) or name == "special"
    # attn saves torch tensors, bfloat16 as BF16 (also transposed, requiring grad).
    p = torch.nn.Parameter(torch.randn(3, 4, generator=g))
    out = {"w": t["w"].t(), "special": t["special"], "param": p, "half": p.detach().half()}
    path2 = tmp_path / "attn_bf16.safetensors"
    attn.save_safetensors(path2, out)
    ref = torch_load(str(path2))
    assert ref["w"].dtype == torch.bfloat16 and torch.equal(ref["w"], out["w"])
    assert torch.equal(ref["special"].view(torch.int16), t["special"].view(torch.int16))
    assert ref["param"].dtype == torch.float32 and torch.equal(ref["param"], p.detach())
    assert ref["half"].dtype == torch.float16 and torch.equal(ref["half"], out["half"])


def test_committed_fixtures_match_reference():
    for name in ("numpy.safetensors", "torch_bf16.safetensors"):
        path = os.path.join(FIXTURES, name)
        mine = attn.load_safetensors(path)
        ref = torch_load(path)
        assert list(mine) == list(ref)
        for k, v in ref.items():
            want = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
            np.testing.assert_array_equal(mine[k], want, err_msg=k)


def test_save_is_atomic_and_errors_leave_the_file(tmp_path):
    path = tmp_path / "m.safetensors"
    attn.save_safetensors(path, {"a": np.ones(3, np.float32)})
    before = path.read_bytes()
    with pytest.raises(TypeError, match="int64"):
        attn.save_safetensors(path, {"a": np.ones(3, np.int64)})
    with pytest.raises(ValueError, match="__metadata__"):
        attn.save_safetensors(path, {"__metadata__": np.ones(3)})
    with pytest.raises(TypeError, match="names are str"):
        attn.save_safetensors(path, {1: np.ones(3)})
    with pytest.raises(TypeError, match="metadata"):
        attn.save_safetensors(path, {"a": np.ones(3)}, metadata={"k": 1})
    with pytest.raises(ValueError, match="NUL"):
        attn.save_safetensors(path, {"a\0b": np.ones(3)})
    with pytest.raises(TypeError, match="dict"):
        attn.save_safetensors(path, [np.ones(3)])
    with pytest.raises(ValueError, match="9 dimensions"):
        attn.save_safetensors(path, {"a": np.ones((1,) * 9)})
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]  # no temporary left
    with pytest.raises(ValueError) as e:
        attn.save_safetensors(tmp_path / "missing" / "x.safetensors", {"a": np.ones(3)})
    assert e.value.status_name == "ATTN_ERR_IO" and "missing" in str(e.value)


def test_load_errors(tmp_path):
    with pytest.raises(ValueError) as e:
        attn.load_safetensors(tmp_path / "absent.safetensors")
    assert e.value.status_name == "ATTN_ERR_IO"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":{\"dtype\":")
    with pytest.raises(ValueError, match="truncated") as e:
        attn.load_safetensors(bad)
    assert e.value.status_name == "ATTN_ERR_FORMAT" and str(bad) in str(e.value)
    header = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}}'
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(ValueError, match="take 8"):
        attn.load_safetensors(bad)
    good = tmp_path / "good.safetensors"
    np_save({"a": np.ones(2, np.float32)}, str(good))
    with pytest.raises(KeyError, match="'b'"):
        attn.load_safetensors(good, names=["b"])
    with pytest.raises(TypeError, match="single str"):
        attn.load_safetensors(good, names="a")
    with pytest.raises(ValueError, match="float32 or float64"):
        attn.load_safetensors(good, dtype="int32")
    assert attn.load_safetensors(good, names=[]) == {}
    f8 = tmp_path / "f8.safetensors"
    torch_save({"x": torch.zeros(2, dtype=torch.float8_e4m3fn), "y": torch.ones(1)}, str(f8))
    with pytest.raises(TypeError, match="F8_E4M3"):
        attn.load_safetensors(f8)
    assert attn.load_safetensors(f8, names=["y"])["y"].tolist() == [1.0]
    r9 = tmp_path / "r9.safetensors"
    np_save({"x": np.ones((1,) * 9, np.float32)}, str(r9))
    with pytest.raises(ValueError, match="more than 8 dimensions"):
        attn.load_safetensors(r9)
    # the tensors must tile the data buffer, as the reference reader says
    for offsets, match in ((([0, 96], [0, 16]), "begin before byte 16"),
                           (([0, 16], [32, 48]), "begin past byte 16")):
        header = json.dumps({n: {"dtype": "F32", "shape": [(e - b) // 4], "data_offsets": [b, e]}
                             for n, (b, e) in zip("xy", offsets)}).encode()
        bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(max(max(offsets))))
        with pytest.raises(Exception, match="invalid offset"):
            np_load(str(bad))
        with pytest.raises(ValueError, match=match):
            attn.load_safetensors(bad)
    # an empty tensor of a shape NumPy cannot make: named, not NumPy's bare error
    header = b'{"x":{"dtype":"F32","shape":[2305843009213693952,0],"data_offsets":[0,0]}}'
    bad.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match="tensor 'x' of shape"):
        attn.load_safetensors(bad)


def test_docs_example_runs(tmp_path, monkeypatch):
    """The example of docs/python.md's safetensors section runs and means
    what it says."""
    import re

    doc = open(os.path.join(HERE, "..", "..", "docs", "python.md")).read()
    section = doc[doc.index("### Checkpoints: `attn.load_safetensors`"):]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:1]
    monkeypatch.chdir(tmp_path)
    ns = {}
    exec(code, ns)
    state = ns["state"]
    assert torch.equal(ns["bf16"].view(torch.int16),
                       state["attn.in_proj_weight"].view(torch.int16))
    assert ns["w"].dtype == np.float32 and set(ns["weights"]) == set(state)
    assert ns["some"]["attn.out_proj.bias"].dtype == np.float64
    assert ns["meta"] == {"format": "pt"}
