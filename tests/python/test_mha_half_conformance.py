"""float16 and bfloat16 modules (issue 13): attn.MultiheadAttention against
torch.nn.MultiheadAttention (PyTorch 2.13) computing in the same dtype.

The cases are test_mha_conformance.py's (every option: kdim/vdim, biases,
add_bias_kv, add_zero_attn, both layouts, unbatched, both masks in bool and
float, is_causal, fully masked rows, per-head and averaged weights, eval and
train, self-attention), with the inputs, masks and parameters rounded to the
16-bit dtype. Each output is judged against torch's float64 module on those
same rounded values, never NaN where torch is finite, and:
  - per case, attn's largest error within 2x that of torch's module in the
    16-bit dtype plus one rounding of the largest output to the dtype
    (u·max|ref|, u = 2^-11 float16, 2^-8 bfloat16: what rounding the exact
    result once may cost). A case has 6 to 200 outputs, and the largest of so
    few errors, each a few roundings, is a noisy statistic: torch's alone
    was 3x smaller than attn's in 4 of 300 cases, while the typical error
    of each was the same;
  - over all cases, attn's root-mean-square error at most torch's (0.89-0.92
    of it, measured over four seeds). Inputs go in as NumPy arrays (float16, ml_dtypes'
bfloat16, in the suite's layouts) or as torch tensors; parameters are loaded
from the 16-bit torch module's state_dict.
"""

import collections
import copy
import functools

import ml_dtypes
import numpy as np
import pytest
import torch

import attn
import conformance as C
from test_mha_conformance import _gen_mha_case, case_context, torch_module, torch_reference

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
CASES = 150  # per dtype
_NUMPY = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16)}
_BASE = {"float16": 200_000, "bfloat16": 300_000}  # past the float32/float64 suite's indices


def _rounded(a, dtype):
    """The values of array `a` rounded to torch dtype `dtype`, as float64."""
    if a is None or a.dtype == np.bool_:
        return a
    return torch.from_numpy(np.ascontiguousarray(a, np.float64)).to(dtype).double().numpy()


@functools.lru_cache(maxsize=None)
def half_mha_case(name, index):
    dt = DTYPES[name]
    c = dict(_gen_mha_case(_BASE[name] + index))
    rng = c["rng"]
    c["features"] = set(c["features"]) | {name}
    c["dtype"] = np.dtype(np.float64)  # torch_module: parameters exact in float64 first
    for n in ("query", "key", "value", "kpm", "mask"):
        c[n] = _rounded(c[n], dt)
    if c["self_attn"]:
        c["key"] = c["value"] = c["query"]
    c["torch64"] = m64 = torch_module(c)
    with torch.no_grad():
        for p in m64.parameters():
            p.copy_(p.to(dt).double())
    c["torch16"] = copy.deepcopy(m64).to(dt)
    for n in ("query", "key", "value", "kpm", "mask"):
        a = c[n]
        if a is None:
            c[n + "_in"] = None
        elif c["inputs"] == "torch":
            t = C.as_torch(a) if a.dtype == np.bool_ else torch.from_numpy(a).to(dt)
            if n in ("query", "key", "value") and rng.random() < 0.4 and t.dim() >= 2:
                t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
            c[n + "_in"] = t
        else:
            arr = a if a.dtype == np.bool_ else a.astype(_NUMPY[dt])
            if c["inputs"] == "relayout" and n in ("query", "key", "value"):
                layout = str(rng.choice(["transposed", "permuted", "strided", "reversed",
                                         "fortran"]))
                arr = C.relayout(arr, layout, rng)
            c[n + "_in"] = arr
    if c["self_attn"]:
        c["key_in"] = c["value_in"] = c["query_in"]
    c["name"], c["dt"] = name, dt
    return c


def attn_module(c):
    m = attn.MultiheadAttention(
        c["E"], c["H"], bias=c["bias"], add_bias_kv=c["add_bias_kv"],
        add_zero_attn=c["add_zero_attn"], kdim=c["kdim"], vdim=c["vdim"],
        batch_first=c["batch_first"], dtype=c["dt"], seed=c["index"],
    )
    assert m.load_state_dict(c["torch16"].state_dict()) == ([], [])
    if c["torch_eval"]:
        m.eval()
    return m


@pytest.mark.parametrize("name,index", [(n, i) for n in DTYPES for i in range(CASES)])
def test_half_mha_matches_torch(name, index):
    c = half_mha_case(name, index)
    ctx = f"{name}, " + case_context(c)
    m = attn_module(c)
    for p in m.parameters():  # the module's parameters are its dtype, exactly torch's values
        assert p.dtype == _NUMPY[c["dt"]], ctx
    out, w = m(
        c["query_in"], c["key_in"], c["value_in"], key_padding_mask=c["kpm_in"],
        need_weights=c["need_weights"], attn_mask=c["mask_in"],
        average_attn_weights=c["average"], is_causal=c["is_causal"],
    )
    assert isinstance(out, np.ndarray) and out.dtype == _NUMPY[c["dt"]], (out.dtype, ctx)
    assert (w is None) == (not c["need_weights"]), ctx
    ref_out, ref_w, _ = torch_reference(c, c["torch64"])
    t16_out, t16_w, _ = torch_reference(c, c["torch16"])
    _check(name, "attn_output", out, ref_out, t16_out, ctx)
    if c["need_weights"]:
        assert w.dtype == _NUMPY[c["dt"]], ctx
        _check(name, "attn_output_weights", w, ref_w, t16_w, ctx)
    C.STATS["mha_half"]["cases"] += 1


U = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
_TALLY = C.ErrorTally()


def _check(name, what, ours, ref, t16, ctx):
    o, t = ours.astype(np.float64), np.asarray(t16, np.float64)
    where = f"{what} ({ctx})"
    assert not np.isnan(o).any(), f"{where}: attn returned NaN"
    inf = np.isinf(ref)
    assert np.array_equal(np.isinf(o), inf) and np.array_equal(o[inf], ref[inf]), where
    fin = ~inf & np.isfinite(t)
    err = float(np.max(np.abs(o[fin] - ref[fin]), initial=0.0))
    terr = float(np.max(np.abs(t[fin] - ref[fin]), initial=0.0))
    bar = 2 * terr + U[name] * float(np.max(np.abs(ref[fin]), initial=0.0))
    stats = C.STATS["mha_half"]
    stats["worst_usage"] = max(stats["worst_usage"], err / bar if bar > 0 else 0.0)
    if terr > 0:
        stats["ratios"].append(err / terr)
    assert err <= bar, (f"{where}: error {err:.3g} vs torch float64; torch's own {name} error "
                        f"is {terr:.3g}, so the bar is {bar:.3g}")
    _TALLY.add(name, o[fin], ref[fin], t[fin])


@pytest.mark.parametrize("name", list(DTYPES))
def test_half_mha_overall_error_at_most_torchs(name):
    """Runs after the cases above (pytest keeps the file's order)."""
    ratio = _TALLY.ratio(name)
    if ratio is None:
        pytest.skip("no case of this dtype ran in this session")
    C.STATS["mha_half"].setdefault("rms_ratio", {})[name] = ratio
    assert ratio <= 1.0, f"{name}: attn's RMS error over all cases is {ratio:.3f} of torch's"


REQUIRED = {  # per dtype; each floor well below its expected count
    "kdim/vdim": 45, "no_bias": 15, "add_bias_kv": 20, "add_zero_attn": 20,
    "batch_first": 50, "seq_first": 50, "unbatched": 12, "key_padding_mask_bool": 25,
    "key_padding_mask_float": 10, "attn_mask_2d_bool": 8, "attn_mask_2d_float": 8,
    "attn_mask_3d_bool": 3, "attn_mask_3d_float": 3, "need_weights_avg": 35,
    "need_weights_per_head": 15, "no_weights": 35, "is_causal": 3, "is_causal+mask": 4,
    "fully_masked": 6, "self_attention": 4, "torch_eval": 50, "torch_train": 50,
    "inputs_relayout": 15, "inputs_torch": 8,
}


@pytest.mark.parametrize("name", list(DTYPES))
def test_half_mha_cases_cover_every_option(name):
    counts = collections.Counter()
    for i in range(CASES):
        counts.update(_gen_mha_case(_BASE[name] + i)["features"])
    short = {k: (counts[k], n) for k, n in REQUIRED.items() if counts[k] < n}
    assert not short, f"{name}: options drawn too rarely (count, required): {short}"


def test_half_module_refuses_other_dtypes_by_name():
    m = attn.MultiheadAttention(8, 2, dtype="bfloat16")
    x = np.zeros((3, 8), np.float32)
    with pytest.raises(TypeError, match="query is float32; this module is bfloat16"):
        m(x, x, x)
    with pytest.raises(TypeError, match="expected float32, float64, float16 or bfloat16"):
        attn.MultiheadAttention(8, 2, dtype="int16")
