"""attn.distributed.ring_attention under mpirun (issue 15): N = 1, 2, 3, 4
ranks against the single-process attn.scaled_dot_product_attention.

Every case's whole inputs are written once; each `mpirun -np N` runs
tests/python/ring_worker.py over all the cases (one launch per N: starting
Python and torch is most of the time), and the gathered results are compared
here: outputs, log-sum-exps and gradients within float32 (float64) rounding
scaled by the result's magnitude, dropout with the single-process call's
mask, and the same bits from a second launch. Skipped without mpirun,
mpi4py or an attn built with MPI."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import attn
import attn.distributed as ad

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ring_worker.py")
RANKS = (1, 2, 3, 4)


def _missing():
    if shutil.which("mpirun") is None:
        return "mpirun not found (scripts/bootstrap.sh mpi installs Open MPI)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (scripts/bootstrap.sh mpi)"
    if not ad.is_available():
        return "attn was built without MPI (no ring attention in attn._attn)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


# ---------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------


def case(name, **kw):
    c = dict(name=name, dtype="float32", B=2, Hq=2, H=None, L=24, S=None, E=16, Ev=None,
             causal=False, alignment="top-left", gqa=False, dropout_p=0.0, seed=None,
             rng_offset=0, scale=None, layout="zigzag", kpm=None, torch=False, cuts=None,
             mismatch=None, timeout=30.0, min_ranks=1)
    c.update(kw)
    c["H"] = c["H"] or c["Hq"]
    c["S"] = c["S"] or c["L"]
    c["Ev"] = c["Ev"] or c["E"]
    return c


CASES = [
    case("plain"),
    case("causal_zigzag", causal=True, L=32),
    case("causal_contiguous", causal=True, L=32, layout="contiguous"),
    case("gqa", Hq=4, H=2, gqa=True, causal=True),
    case("dropout", causal=True, dropout_p=0.25, seed=1234),
    case("dropout_offset", dropout_p=0.1, seed=7, rng_offset=3),
    case("uneven", causal=True, L=29, Ev=8),
    # Contiguous shards of any lengths, cut by hand.
    case("uneven_cuts", causal=True, L=23, layout="contiguous",
         cuts={"1": [23], "2": [9, 14], "3": [2, 13, 8], "4": [7, 1, 11, 4]}),
    case("kpm_bool", causal=True, kpm="bool"),
    case("kpm_float", kpm="float", L=20),
    case("cross", L=20, S=36, E=8, Ev=12),
    case("cross_causal", L=20, S=36, causal=True, alignment="bottom-right"),
    case("float64", dtype="float64", causal=True, L=26, scale=0.3),
    case("float16", dtype="float16", causal=True, L=26, kpm="bool"),
    # torch tensors, gradients through the ring's backward
    case("grad_causal", torch=True, causal=True, Hq=4, H=2, gqa=True, kpm="bool"),
    case("grad_dropout", torch=True, dropout_p=0.2, seed=99, layout="contiguous", L=20),
    case("grad_float64", torch=True, dtype="float64", L=16, S=28, causal=True,
         alignment="bottom-right"),
    case("grad_float16", torch=True, dtype="float16", L=22, causal=True, Hq=4, H=2, gqa=True),
    # refused: every rank fails, and soon (well inside the timeout)
    case("mismatch_E", mismatch="E", min_ranks=2),
    case("mismatch_local", mismatch="local"),
]
ERROR_CASES = {"mismatch_E", "mismatch_local"}
BY_NAME = {c["name"]: c for c in CASES}
REPEATED = ["causal_zigzag", "uneven", "dropout", "grad_causal"]  # run twice: same bits


def inputs(c, index):
    """The whole tensors of a case (q, k, v; kpm; dout for torch cases)."""
    rng = np.random.default_rng(1000 + index)
    dt = np.dtype(c["dtype"])
    B, Hq, H, L, S, E, Ev = (c[n] for n in ("B", "Hq", "H", "L", "S", "E", "Ev"))
    x = {"q": rng.standard_normal((B, Hq, L, E)), "k": rng.standard_normal((B, H, S, E)),
         "v": rng.standard_normal((B, H, S, Ev)), "dout": rng.standard_normal((B, Hq, L, Ev))}
    x = {n: a.astype(dt) for n, a in x.items()}
    if c["kpm"] == "bool":  # True = padding; batch 0 keeps every key
        kpm = np.zeros((B, S), dtype=bool)
        kpm[1, S - 5:] = True
        kpm[1, 3] = True
        x["kpm"] = kpm
    elif c["kpm"] == "float":
        x["kpm"] = rng.uniform(-2.0, 0.5, S).astype(dt)
    return x


def reference(c, x):
    """The single-process call: (out, lse, dq, dk, dv)."""
    mask = None
    if c["kpm"] == "bool":
        mask = ~x["kpm"][:, None, None, :]  # SDPA's bool mask: True = takes part
    elif c["kpm"] == "float":
        mask = x["kpm"]
    kw = dict(attn_mask=mask, dropout_p=c["dropout_p"], is_causal=c["causal"], scale=c["scale"],
              enable_gqa=c["gqa"], causal_alignment=c["alignment"], seed=c["seed"],
              return_lse=True)
    if c["rng_offset"]:  # not in the public SDPA: the extension's own call
        causal = {"top-left": 1, "bottom-right": 2}[c["alignment"]] if c["causal"] else 0
        out, _, lse = attn._attn.sdpa(
            x["q"], x["k"], x["v"], empty=np.empty, attn_mask=mask, causal=causal,
            scale=c["scale"], enable_gqa=c["gqa"], dropout_p=c["dropout_p"], seed=c["seed"],
            rng_offset=c["rng_offset"], want_lse=True)
        return out, lse, None, None, None
    if not c["torch"]:
        out, lse = attn.scaled_dot_product_attention(x["q"], x["k"], x["v"], **kw)
        return out, lse, None, None, None
    import torch

    q, k, v = (torch.from_numpy(x[n]).requires_grad_() for n in ("q", "k", "v"))
    if mask is not None:
        kw["attn_mask"] = torch.from_numpy(np.ascontiguousarray(mask))
    out, lse = attn.scaled_dot_product_attention(q, k, v, **kw)
    out.backward(torch.from_numpy(x["dout"]))
    return (out.detach().numpy(), lse.numpy(), q.grad.numpy(), k.grad.numpy(),
            v.grad.numpy())


# ---------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------


def mpirun(n, *argv, cwd=None, check=True):
    """`mpirun -np n python3 argv...`, oversubscribed (more ranks than cores
    is fine here), as root too when we are root; `check`: it must succeed."""
    env = dict(os.environ, OMPI_MCA_btl_vader_single_copy_mechanism="none")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n), sys.executable,
           *map(str, argv)]
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, f"{' '.join(cmd)}: {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def write_cases(d, cases):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "cases.json"), "w") as f:
        json.dump(cases, f)
    for i, c in enumerate(CASES):
        if c in cases:
            np.savez(os.path.join(d, c["name"] + ".in.npz"), **inputs(c, i))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Lazily, the results directory of each launch: N, or (N, 'again')."""
    done = {}

    def get(key):
        if key not in done:
            n = key if isinstance(key, int) else key[0]
            d = tmp_path_factory.mktemp(f"ring{n}{'b' if key != n else ''}")
            write_cases(d, CASES if key == n else [BY_NAME[m] for m in REPEATED])
            mpirun(n, WORKER, d)
            done[key] = d
        return done[key]

    return get


def results(d, name, n):
    """The gathered results of one case, failing with every rank's error."""
    errs = [os.path.join(d, f"{name}.{n}.err.{r}.json") for r in range(n)]
    found = [json.load(open(e)) for e in errs if os.path.exists(e)]
    assert not found, f"{name} on {n} ranks raised:\n" + "\n".join(e["trace"] for e in found)
    return dict(np.load(os.path.join(d, f"{name}.{n}.npz")))


ACCURACY = {}  # worst |ring - single| / (eps * magnitude), per quantity, for the summary


def close(name, what, got, want, dtype, bar):
    """|got - want| <= bar * eps * magnitude, magnitude the largest |want|."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    eps = np.finfo(dtype).eps
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got)), f"{name} {what}: non-finite entries differ"
    mag = max(float(np.max(np.abs(want[finite]), initial=0.0)), 1.0)
    err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0)) / (eps * mag)
    key = (np.dtype(dtype).name, what)
    ACCURACY[key] = max(ACCURACY.get(key, 0.0), err)
    assert err <= bar, f"{name} {what}: error {err:.3g} eps x magnitude (bar {bar})"


# Bars in eps x magnitude: the ring merges the parts in float64 and rounds
# once, so its results sit within a few roundings of the single call's
# (measured: at most 3 eps x magnitude for outputs and gradients alike).
OUT_BAR, GRAD_BAR = 16, 64


# ---------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("name", [c["name"] for c in CASES if c["name"] not in ERROR_CASES])
def test_ring_matches_single_process(runs, n, name):
    c = BY_NAME[name]
    d = runs(n)
    got = results(d, name, n)
    x = inputs(c, CASES.index(c))
    out, lse, dq, dk, dv = reference(c, x)
    dt = np.dtype(c["dtype"])
    assert got["out"].dtype == dt
    close(name, "out", got["out"], out, dt, OUT_BAR)
    close(name, "lse", got["lse"][..., 0], lse, dt, OUT_BAR)
    if c["torch"]:
        for what, want in (("dq", dq), ("dk", dk), ("dv", dv)):
            close(name, what, got[what], want, dt, GRAD_BAR)


@pytest.mark.parametrize("n", [2, 4])
def test_float64_matches_torch(runs, n):
    """The float64 case against torch's own SDPA, too (no attn in between)."""
    import torch
    import torch.nn.functional as F

    c = BY_NAME["float64"]
    x = inputs(c, CASES.index(c))
    want = F.scaled_dot_product_attention(*(torch.from_numpy(x[k]) for k in "qkv"),
                                          is_causal=True, scale=c["scale"]).numpy()
    close("float64", "out vs torch", results(runs(n), "float64", n)["out"], want,
          np.float64, OUT_BAR)


def test_same_bits_run_to_run(runs):
    """A second launch on 3 ranks gives the first one's bits."""
    first, again = runs(3), runs((3, "again"))
    for name in REPEATED:
        a, b = results(first, name, 3), results(again, name, 3)
        for key in a:
            assert a[key].tobytes() == b[key].tobytes(), f"{name} {key} differs between runs"


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("name", sorted(ERROR_CASES))
def test_refused_on_every_rank(runs, n, name):
    """Shards that do not fit together fail on every rank with a message
    naming the problem, at once (not after the 30 s timeout)."""
    c = BY_NAME[name]
    if n < c["min_ranks"]:
        pytest.skip(f"needs {c['min_ranks']} ranks")
    d = runs(n)
    errs = []
    for r in range(n):
        path = os.path.join(d, f"{name}.{n}.err.{r}.json")
        assert os.path.exists(path), f"rank {r} of {n} did not fail on {name}"
        errs.append(json.load(open(path)))
    for r, e in enumerate(errs):
        assert e["type"] == "ValueError", e["trace"]
        # attn_ring.h: a difference between ranks is ATTN_ERR_SHAPE or _INVALID
        assert e["status_name"] in ("ATTN_ERR_SHAPE", "ATTN_ERR_INVALID"), e
        assert e["seconds"] < 10, f"rank {r} took {e['seconds']:.1f} s to fail"
    if name == "mismatch_E":  # every rank names the rank that differs
        assert all(f"rank {n - 1}" in e["msg"] for e in errs), [e["msg"] for e in errs]


def test_report_accuracy(runs):
    """Not a check: prints the worst error of each quantity (pytest -s)."""
    for (dt, what), err in sorted(ACCURACY.items()):
        print(f"ring vs single process, {dt} {what}: worst {err:.3g} eps x magnitude")


def test_api_checks(tmp_path):
    """Arguments refused with messages that say what to pass, on 2 ranks;
    seed=None takes rank 0's seed (torch.manual_seed repeats it)."""
    mpirun(2, WORKER, tmp_path, "checks")
    for r in range(2):
        found = json.load(open(tmp_path / f"checks.{r}.json"))
        assert found["layout"].startswith("ValueError: layout is 'striped'"), found
        assert found["comm_type"].startswith("TypeError: comm must be an mpi4py"), found
        assert found["comm_null"] == "ValueError: comm is MPI.COMM_NULL", found
        assert found["timeout"].startswith("ValueError: timeout is 0.0"), found
        assert found["timeout_huge"].startswith("ValueError: timeout is an int of 401 digits")
        other = 1 - r
        assert (f"params.sdpa.scale is {0.1 + 0.1 * other:.15g} on rank {other} but "
                f"{0.1 + 0.1 * r:.15g} on rank {r}") in found["scale_differs"], found
        dts = ["float32", "float64"]
        assert (f"q.dtype is {dts[other]} on rank {other} but {dts[r]} on rank {r}"
                in found["dtype_differs"]), found
        lse = ["float32", "not given"]
        assert (f"lse.dtype is {lse[other]} on rank {other} but {lse[r]} on rank {r}"
                in found["lse_differs"]), found
        assert found["mask_ndim"].startswith("ValueError: key_padding_mask has shape"), found
        assert found["mask_grad"].startswith("RuntimeError: key_padding_mask requires grad"), found
        assert found["mask_wrong_length"].startswith("ValueError"), found
        assert "key_mask" in found["mask_wrong_length"], found
        assert found["seed_repeats"] is True
        assert found["root_gather"] == ("<class 'numpy.ndarray'>" if r == 1 else
                                        "<class 'NoneType'>")
        assert found["whole_gather"] is True
        assert found["other_mpi"].startswith(
            "RuntimeError: mpi4py runs the MPI library 'MPICH Version: 4.1.2', but attn was "
            "built with '"), found


def test_docs_example(tmp_path):
    """docs/python.md's attn.distributed example runs on 2 ranks, and its
    gathered output is the single-process call's."""
    text = open(os.path.join(HERE, "..", "..", "docs", "python.md")).read()
    section = text[text.index("### `attn.distributed`"):]
    code = section.split("```python\n")[1].split("```")[0]
    check = (
        "\nimport numpy as np\n"
        "ref = attn.scaled_dot_product_attention(q, k, v, is_causal=True,\n"
        "                                        attn_mask=~pad[:, None, None, :])\n"
        "assert whole.shape == (1, 8, 1024, 64) and qs.grad is not None\n"
        "assert ks.grad.shape == ks.shape and vs.grad.abs().sum() > 0\n"
        "assert np.abs(whole.numpy() - ref.numpy()).max() < 1e-5\n"
        "open(f'ok.{comm.rank}', 'w').close()\n"
    )
    (tmp_path / "ring.py").write_text(code + check)
    mpirun(2, "ring.py", cwd=tmp_path)
    assert (tmp_path / "ok.0").exists() and (tmp_path / "ok.1").exists()


BF16_SCRIPT = """
import ml_dtypes, numpy as np, torch
from mpi4py import MPI
import attn, attn.distributed as ad
comm = MPI.COMM_WORLD
g = torch.Generator().manual_seed(3)
q, k, v, dout = (torch.randn(1, 2, 37, 16, generator=g).to(torch.bfloat16) for _ in range(4))
# what the ring computes: float32 on the bfloat16 values (the backward's D
# from the rounded out, as stored), each result rounded once
q32, k32, v32, do32 = (x.float().numpy() for x in (q, k, v, dout))
out32, _, lse = attn._attn.sdpa(q32, k32, v32, empty=np.empty, causal=1, want_lse=True,
                                lse_for_backward=True)
out_r = torch.from_numpy(out32).to(torch.bfloat16).float().numpy()
grads = attn._attn.sdpa_backward(do32, q32, k32, v32, out_r, lse, empty=np.empty, causal=1)
qs, ks, vs = (ad.shard(x, comm.rank, comm.size).clone().requires_grad_() for x in (q, k, v))
out = ad.ring_attention(qs, ks, vs, comm, is_causal=True)
out.backward(ad.shard(dout, comm.rank, comm.size))
assert out.dtype == qs.grad.dtype == ks.grad.dtype == torch.bfloat16
got = [ad.gather(t, comm) for t in (out.detach(), qs.grad, ks.grad, vs.grad)]
want = [torch.from_numpy(x) for x in (out32, *grads[:3])]
for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    b16 = b.to(torch.bfloat16).float()  # the reference rounded once
    ulp = 2.0**-7 * b16.abs().clamp(min=2.0**-126)
    assert ((a.float() - b16).abs() <= ulp + 1e-6).all(), name
    assert (a.float() != b16).float().mean() <= 0.05, name  # neighbours, now and then
arr = lambda x: ad.shard(x.float().numpy().astype(ml_dtypes.bfloat16), comm.rank, comm.size)
o = ad.ring_attention(arr(q), arr(k), arr(v), comm, is_causal=True)  # NumPy: ml_dtypes
assert o.dtype == ml_dtypes.bfloat16
open(f"ok.{comm.rank}", "w").close()
"""


def test_bfloat16_torch_and_numpy(tmp_path):
    """bfloat16 over 2 ranks (the npz cases above cannot hold it): torch
    tensors with gradients and ml_dtypes arrays, each result within one
    bfloat16 ulp of the float32 computation's rounding, and rarely off it."""
    (tmp_path / "bf16.py").write_text(BF16_SCRIPT)
    mpirun(2, "bf16.py", cwd=tmp_path)
    assert (tmp_path / "ok.0").exists() and (tmp_path / "ok.1").exists()


@pytest.mark.parametrize("n", [2, 3])
def test_hung_rank_gives_up_after_timeout(tmp_path, n):
    """A rank that never joins: the others raise RuntimeError (ATTN_ERR_COMM)
    after the 2 s timeout, never hang; rank 0 then ends the job (Abort)."""
    p = mpirun(n, WORKER, tmp_path, "hang", check=False)
    assert p.returncode != 0  # ended by MPI_Abort
    for r in range(n - 1):
        found = json.load(open(tmp_path / f"hang.{r}.json"))
        assert found["type"] == "RuntimeError" and found["status_name"] == "ATTN_ERR_COMM", found
        assert 1.5 < found["seconds"] < 15, found
        assert f"rank {n - 1}" in found["msg"] or "timeout" in found["msg"], found
