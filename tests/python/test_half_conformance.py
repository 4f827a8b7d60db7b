"""float16 and bfloat16 (issue 13): attn.scaled_dot_product_attention against
PyTorch 2.13 computing the same thing in the same dtype on the CPU.

The cases are test_sdpa_conformance.py's (every mask kind, causal alignment,
scale, GQA, broadcast and layout), their inputs rounded to the 16-bit dtype.
Each output is judged against the float64 result of those rounded inputs:
attn's error must stay within 2x PyTorch's own error in the same dtype (plus
conformance.py's slack), and never NaN where PyTorch is finite. Modes:
  - "float16", "bfloat16": query, key, value (and float masks) 16-bit, out
    and weights 16-bit, lse float32;
  - "float32/float16", "float32/bfloat16": a float32 query over 16-bit keys
    and values (a low-precision KV cache), judged against PyTorch computing
    in float32 from the same rounded keys and values.
Inputs go in as torch tensors (strided views) or as NumPy arrays (float16,
ml_dtypes' bfloat16) in the suite's layouts; outputs come back the same kind.
"""

import collections
import functools

import ml_dtypes
import numpy as np
import pytest
import torch

import attn
import conformance as C
from test_sdpa_conformance import _gen_sdpa_case, case_context, torch_reference

MODES = {  # mode: (query's dtype, key's and value's), cases per run
    "float16": ((torch.float16, torch.float16), 500),
    "bfloat16": ((torch.bfloat16, torch.bfloat16), 500),
    "float32/float16": ((torch.float32, torch.float16), 250),
    "float32/bfloat16": ((torch.float32, torch.bfloat16), 250),
}
_NUMPY = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
          torch.float32: np.dtype(np.float32)}
# Case indices past the float32/float64 suite's, one range per mode.
_BASE = {mode: 100_000 * (i + 1) for i, mode in enumerate(MODES)}


def _rounded(a, dtype):
    """The values of array `a` rounded to torch dtype `dtype`, as float64."""
    return torch.from_numpy(np.ascontiguousarray(a, np.float64)).to(dtype).double().numpy()


@functools.lru_cache(maxsize=None)
def half_case(mode, index):
    (qd, kvd), _ = MODES[mode]
    c = dict(_gen_sdpa_case(_BASE[mode] + index))
    rng = c["rng"]
    c["mode"], c["qd"], c["kvd"] = mode, qd, kvd
    c["q"] = _rounded(c["q"], qd)
    c["k"], c["v"] = _rounded(c["k"], kvd), _rounded(c["v"], kvd)
    if c["mask"] is not None and c["mask"].dtype != np.bool_:  # a float mask in q's dtype
        c["mask"] = _rounded(c["mask"], qd)
    c["features"] = set(c["features"]) | {mode}
    c["torch_in"] = c["use_torch"] or rng.random() < 0.4
    for name in ("q", "k", "v", "mask"):
        x = c[name]
        if x is None:
            continue
        dt = torch.bool if x.dtype == np.bool_ else qd if name in ("q", "mask") else kvd
        if c["torch_in"]:
            t = C.as_torch(x) if dt == torch.bool else torch.from_numpy(x).to(dt)
            if rng.random() < 0.35 and t.dim() >= 2:  # transposed storage
                t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
            c[name + "_in"] = t
        else:
            layout = c["layouts"].get(name, "contiguous")
            if layout == "byteswapped" and dt == torch.bfloat16:
                layout = "reversed"  # ml_dtypes has no byte-swapped bfloat16
            arr = x if dt == torch.bool else x.astype(_NUMPY[dt])
            c[name + "_in"] = C.relayout(arr, layout, rng)
            c[name] = np.asarray(c[name + "_in"], np.float64) if dt != torch.bool else \
                np.array(c[name + "_in"], copy=True)  # "broadcast" repeats values
    return c


def _run(c):
    kw = {"causal_alignment": c["causal"]} if c["causal"] else {}
    res = attn.scaled_dot_product_attention(
        c["q_in"], c["k_in"], c["v_in"], attn_mask=c.get("mask_in"),
        is_causal=c["causal"] is not None, scale=c["scale"], enable_gqa=c["gqa"],
        return_weights=c["want_w"], return_lse=c["want_lse"], **kw,
    )
    res = res if isinstance(res, tuple) else (res,)
    kind = torch.Tensor if c["torch_in"] else np.ndarray
    assert all(type(x) is kind for x in res), [type(x) for x in res]
    want = c["qd"] if c["torch_in"] else _NUMPY[c["qd"]]
    assert res[0].dtype == want, (res[0].dtype, want)
    if c["want_w"]:
        assert res[1].dtype == want, (res[1].dtype, want)
    if c["want_lse"]:  # as for float32 queries: float64 from torch calls (kept for autograd)
        assert res[-1].dtype == (torch.float64 if c["torch_in"] else np.float32)
    as64 = (lambda t: t.double().numpy()) if c["torch_in"] else (lambda a: a.astype(np.float64))
    res = [as64(x) for x in res]
    out = res.pop(0)
    weights = res.pop(0) if c["want_w"] else None
    lse = res.pop(0) if c["want_lse"] else None
    return out, weights, lse


@pytest.mark.parametrize("mode,index", [(m, i) for m, (_, n) in MODES.items() for i in range(n)],
                         ids=lambda x: str(x).replace("/", "_"))
def test_half_matches_torch(mode, index):
    c = half_case(mode, index)
    ctx = f"{mode}, " + case_context(c)
    out, weights, lse = _run(c)
    exact = torch_reference(c, np.dtype(np.float64))  # the rounded inputs, in float64
    # PyTorch in the same dtype; over 16-bit K/V, PyTorch in float32 from them
    same = torch_reference(c, c["qd"] if c["qd"] != torch.float32 else np.dtype(np.float32))
    C.check_close("half", "out", out, exact[0], same[0], context=ctx)
    if c["want_w"]:
        C.check_close("half", "weights", weights, exact[1], same[1], context=ctx)
    if c["want_lse"]:  # float32 in attn: judged by PyTorch's float32 on the same inputs
        t32 = torch_reference(c, np.dtype(np.float32))
        C.check_close("half", "lse", lse, exact[2], t32[2], context=ctx)
    C.STATS["half"]["cases"] += 1


def test_half_cases_cover_every_argument():
    counts = collections.Counter()
    for mode, (_, n) in MODES.items():
        for i in range(n):
            c = half_case(mode, i)
            counts.update(c["features"])
            counts["torch_in" if c["torch_in"] else "numpy_in"] += 1
    required = {"float16": 500, "bfloat16": 500, "float32/float16": 250,
                "float32/bfloat16": 250, "gqa": 100, "causal_top-left": 150,
                "causal_bottom-right": 100, "bool_mask_rank2": 5, "float_mask_rank2": 5,
                "fully_masked_rows": 40, "negative_scale": 80, "return_weights": 200,
                "return_lse": 200, "torch_in": 300, "numpy_in": 300, "large_logits": 30}
    short = {k: (counts[k], n) for k, n in required.items() if counts[k] < n}
    assert not short, f"features drawn too rarely (count, required): {short}"
