#!/usr/bin/env python3
"""attn against PyTorch, side by side, in one run.

    python3 bench/run.py [--quick] [--threads N] [--reps N] [--only TEXT] [--serving]

For every shape the same seeded float32 inputs go to attn and to PyTorch 2.13
(``F.scaled_dot_product_attention``; ``nn.MultiheadAttention`` in eval mode
under ``torch.inference_mode``), in the same process, with the same thread
count, after warm-up, alternating attn and PyTorch call by call so that a
noisy neighbour slows both alike. Reported per shape: median milliseconds,
GFLOP/s (4·B·H·L·S·E for SDPA, half of it when causal; MHA counts its four
projections too), the percentage of the FMA peak that ``attn_bench peak``
measures in the same run, the PyTorch/attn speed ratio (> 1: attn faster),
peak extra memory of one call, output included (measured in a fresh interpreter
from the kernel's RSS high-water mark), and the largest
difference between the two outputs.

The backward (prefill shapes, causal and not): attn's PyTorch operator
(``attn.scaled_dot_product_attention`` on tensors that require grad: the
forward keeps its lse, ``.backward(dout)`` runs ``attn_sdpa_backward``)
against PyTorch's ``F.scaled_dot_product_attention(...).backward(dout)``, on
the same seeded q, k, v, dout, alternating call by call. Reported: ms of
forward+backward and of the backward alone, GFLOP/s with
4·B·H·L·S·E for the forward and 10·B·H·L·S·E for the backward (half when
causal), % of the same-run FMA peak, the PyTorch/attn ratios, the largest
difference of dq, dk, dv; and ``attn_bench memory-backward``'s peak RSS at
L = S = 65536 (8192 with --quick).

The serving cases of issue 14 (bench/serving.py: a paged KV-cache decode,
the sliding window, varlen batches; attn through `attn_bench decode|window|
varlen`, alternating call by call with PyTorch) end the run; --serving runs
them alone (with the peak and bandwidth probes) and writes only
serving.json and serving.md (in the results folder).

Short sequences: (1, H, L, L, E) for L in 16..512, E in 32, 64, 128 and H in
1, 8, 32, each timed in samples of many calls (~2 ms), against >= 1.0x.

Each case runs at least --reps alternating rounds, and more (up to three
times as many) while its spread, half the interquartile range over the
median, is above 5%; the spread is reported beside each median.

The machine's state is probed between a case's rounds too (these VMs move
by 2x within minutes): the FMA peak beside the prefill and backward cases,
the bfloat16 products' peak beside the bfloat16 cases (AMX tiles read
2,200 or 5,300 GFLOP/s by turns on one Emerald Rapids VM, and attn's
bfloat16 BERT-base module 66-82 ms or 35-47 ms with them), and the read
bandwidth beside the decode. Each row notes its median and range; the
targets stay graded against the run's own peak (the decode's bandwidth
against its probes beside).

Writes results.json, results.md and throughput.png (and serving.json,
serving.md) under bench/results/<cpu>/ (the CPU's model name, family and
model: one folder per machine measured, with its ISA path, BLAS core and
commit recorded inside), and prints the Markdown table.
bench/machines.py puts every machine's results side by side.

glibc's malloc is set as a long-running process ends up with it (blocks
below 32 MiB from the heap, which is trimmed past 64 MiB free), from the
start: otherwise its thresholds rise only once a large block is freed, so a
case's PyTorch time depended on the cases before it. PyTorch's seed 000 MHA
maps, faults in and unmaps its 10 MB intermediates on every call until
then: 14-17 ms in a fresh process, 7-9 ms after (Emerald Rapids; attn keeps
its workspace between calls and ran 8-10 ms either way), so `--only` runs
and full runs disagreed (1.61x against 1.03x).

An OPENBLAS_CORETYPE in the environment is dropped before attn loads (and so
for attn_bench too), unless --keep-blas-core: the bench measures attn as it
loads by default, which picks OpenBLAS's kernels for the CPU. (This
workplace's VMs set OPENBLAS_CORETYPE=Haswell, AVX2 kernels, on AVX-512
CPUs: MHA BERT-base ran at 47% of the FMA peak under it on Zen 5, 76%
without.) The results name the core that ran and the setting dropped.
"""
import argparse
import ctypes
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

DROPPED_BLAS_CORE = None
if "--keep-blas-core" not in sys.argv and "OPENBLAS_CORETYPE" in os.environ:
    DROPPED_BLAS_CORE = os.environ.pop("OPENBLAS_CORETYPE")

import numpy as np
import torch
import torch.nn.functional as F

import attn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import serving  # noqa: E402  (bench/serving.py)
from counts import commit, cpu_slug  # noqa: E402  (bench/counts.py)

# (name, kind, params). SDPA params: B, H, L, S, E, causal, kv_heads.
PREFILL = [(1, 8, 512, 512, 64), (1, 16, 2048, 2048, 64), (1, 8, 8192, 8192, 64),
           (4, 12, 512, 512, 64), (1, 16, 2048, 2048, 128)]
DECODE = [(1, 32, 1, 4096, 128, 8), (1, 32, 1, 32768, 128, 8)]
MHA = [("seed 000", 128, 32, 200, 5), ("BERT-base", 8, 512, 768, 12)]
SWEEP = [256, 512, 1024, 2048, 4096]  # (1, 16, L, L, 64) for the plot
SHORT = dict(L=[16, 32, 64, 128, 256, 512], E=[32, 64, 128], H=[1, 8, 32])  # (1, H, L, L, E)
HALF = [(1, 16, 2048, 2048, 64), (1, 16, 2048, 2048, 128)]  # bfloat16 prefill (issue 13)

# The speed issue's targets, checked and reported (never used to skip
# anything): prefill at 85% of the FMA peak on AVX-512 and 80% on AVX2
# (E = 64, 128, L >= 1024), causal L = 512 at 75%, every prefill shape
# >= 1.2x PyTorch; decoding's K/V at 70% of the read bandwidth; MHA >= 1.5x,
# BERT-base at 70% of the peak; every short sequence >= 1.0x.
TARGET_PREFILL_RATIO = 1.2
TARGET_PEAK_PCT = {"avx512": 85.0, "avx2": 80.0}
TARGET_CAUSAL512_PCT = 75.0
TARGET_DECODE_RATIO, TARGET_BW_PCT = 1.2, 70.0
TARGET_MHA_RATIO, TARGET_BERT_PEAK_PCT = 1.5, 70.0
TARGET_SHORT_RATIO = 1.0
TARGET_BWD_RATIO, TARGET_BWD_PEAK_PCT = 1.3, 60.0  # forward+backward vs PyTorch; backward alone
# Issue 13: bfloat16 prefill >= 1.7x attn's own float32 where the CPU has
# AVX512-BF16, and >= 1.5x PyTorch's bfloat16.
TARGET_HALF_VS_F32, TARGET_HALF_VS_TORCH = 1.7, 1.5
TARGET_HALF_VS_F32_AMX = 4.0  # on AMX tiles


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def probe(args, *cmd):
    exe = args.bench_bin
    # Not check=True: `memory` exits 1 when over budget, and says so in its JSON.
    run = subprocess.run([exe, *cmd, "--threads", str(args.threads)], capture_output=True,
                         text=True)
    if not run.stdout.strip():
        sys.exit(f"{exe} {' '.join(cmd)} failed: {run.stderr.strip()}")
    return json.loads(run.stdout)


def probe_huge_bandwidth(args):
    """The read bandwidth probe on transparent huge pages (GB/s), the
    yardstick of the serving bench's decode on huge pages."""
    return probe(args, "bandwidth", "--thp")["gbps"]


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


SPREAD_MAX = 0.05  # repeat a case while its spread is above this (at most 3x the reps)


def spread(xs):
    """Half the interquartile range over the median: ±this covers the middle
    half of the calls."""
    q = statistics.quantiles(xs, n=4) if len(xs) >= 4 else [min(xs), 0, max(xs)]
    return (q[2] - q[0]) / 2 / statistics.median(xs)


def alternate(run_attn, run_torch, reps, inner=1, beside=None):
    """Medians of ms per call of each, and their spreads: calls interleaved
    (order flipped every round), `inner` calls per sample (short calls), and
    more rounds while either spread is above SPREAD_MAX, up to 3x reps.
    beside (optional): called after every round, its values returned as
    "beside" (the read bandwidth probed between a decode's rounds)."""
    ta, tt, bs = [], [], []

    def rounds(n):
        for _ in range(n):
            pair = ((run_attn, ta), (run_torch, tt))
            for fn, out in (pair if len(ta) % 2 == 0 else pair[::-1]):
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                out.append((time.perf_counter() - t0) * 1e3 / inner)
            if beside is not None:
                bs.append(beside())
    rounds(reps)
    while max(spread(ta), spread(tt)) > SPREAD_MAX and len(ta) < 3 * reps:
        rounds(max(2, reps // 2))
    return dict(ms_attn=statistics.median(ta), ms_torch=statistics.median(tt),
                spread_attn=spread(ta), spread_torch=spread(tt), samples=len(ta),
                **({"beside": bs} if beside is not None else {}))


def peak_memory(args, lib, kind, params):
    """Peak RSS growth (MiB) of one call, in a fresh interpreter: forking this
    one is unsafe once OpenMP thread pools exist (the child can deadlock)."""
    spec = json.dumps(dict(lib=lib, kind=kind, params=list(params), threads=args.threads))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-probe", spec],
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_probe(spec):
    """Child side of peak_memory: build the inputs, reset the kernel's RSS
    high-water mark (Linux: "5" to /proc/self/clear_refs), make the one call,
    and print how far the high-water mark rose above the RSS before it."""
    spec = json.loads(spec)
    torch.set_num_threads(spec["threads"])
    attn.set_num_threads(spec["threads"])
    call = (sdpa_calls if spec["kind"] == "sdpa" else mha_calls)(*spec["params"])[spec["lib"]]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    result = call()
    peak = _status_kib("VmHWM")
    del result
    print((peak - before) / 1024.0)


# ---- SDPA ----

def sdpa_inputs(B, H, L, S, E, kv_heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g)
    k = torch.randn(B, kv_heads, S, E, generator=g)
    v = torch.randn(B, kv_heads, S, E, generator=g)
    return q, k, v


def sdpa_calls(B, H, L, S, E, causal, kv_heads):
    """The two calls on the same inputs (NumPy views of the torch tensors)."""
    gqa = kv_heads != H
    q, k, v = sdpa_inputs(B, H, L, S, E, kv_heads)
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()  # views, no copies

    def run_attn():
        return attn.scaled_dot_product_attention(qn, kn, vn, is_causal=causal, enable_gqa=gqa)

    def run_torch():
        with torch.inference_mode():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    def run_attn_tensors():  # the call a PyTorch model makes: torch tensors in and out
        with torch.inference_mode():
            return attn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return dict(attn=run_attn, torch=run_torch, attn_tensors=run_attn_tensors)


def bench_sdpa(args, B, H, L, S, E, causal=False, kv_heads=None, reps=None, beside=None):
    kv_heads = kv_heads or H
    calls = sdpa_calls(B, H, L, S, E, causal, kv_heads)
    run_attn, run_torch = calls["attn"], calls["torch"]

    out_a, out_t = run_attn(), run_torch()  # warm-up, and the outputs to compare
    run_attn(), run_torch()
    reps = reps or (args.reps if L * S <= 4096 * 4096 else max(3, args.reps // 3))
    times = alternate(run_attn, run_torch, reps, beside=beside)
    flops = 4.0 * B * H * L * S * E * (0.5 if causal else 1.0)
    kv_bytes = 2 * B * kv_heads * S * E * 4
    return dict(**times, flops=flops, kv_bytes=kv_bytes,
                max_diff=float(np.max(np.abs(np.asarray(out_a) - out_t.numpy()))),
                checksum=float(np.asarray(out_a, dtype=np.float64).sum()),
                mem_attn=peak_memory(args, "attn", "sdpa", (B, H, L, S, E, causal, kv_heads)),
                mem_torch=peak_memory(args, "torch", "sdpa", (B, H, L, S, E, causal, kv_heads)))


def bench_half(args, B, H, L, S, E, causal, dtype=torch.bfloat16, beside=None):
    """bfloat16 prefill (issue 13): attn on torch bfloat16 tensors against
    PyTorch's bfloat16 SDPA, then against attn's own float32 on the same
    values (each pair alternating, as everywhere)."""
    q, k, v = (x.to(dtype) for x in sdpa_inputs(B, H, L, S, E, H))
    q32, k32, v32 = (x.float().numpy() for x in (q, k, v))

    def run_attn():
        return attn.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def run_torch():
        with torch.inference_mode():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def run_f32():
        return attn.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)

    out_a, out_t = run_attn(), run_torch()
    run_f32()
    reps = max(3, args.reps // 3)
    vs_torch = alternate(run_attn, run_torch, reps, beside=beside)
    vs_f32 = alternate(run_attn, run_f32, reps)
    flops = 4.0 * B * H * L * S * E * (0.5 if causal else 1.0)
    return dict(vs_torch, ms_f32=vs_f32["ms_torch"], spread_f32=vs_f32["spread_torch"],
                ms_attn_2=vs_f32["ms_attn"], flops=flops, kv_bytes=0, dtype=str(dtype)[6:],
                max_diff=float((out_a.double() - out_t.double()).abs().max()))


def bench_mha_half(args, N, L, E, H, dtype=torch.bfloat16, beside=None):
    """bfloat16 MHA (issue 13): attn.MultiheadAttention in bfloat16 on torch
    bfloat16 tensors against torch's module in bfloat16, then against attn's
    own float32 module on the same values, each pair alternating."""
    ref, ours32, x = mha_modules(N, L, E, H)
    ref16, x16 = ref.to(dtype), x.to(dtype)
    ours = attn.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    ours.load_state_dict(ref16.state_dict())
    ours.eval()
    ours32.load_state_dict({k: v.float() for k, v in ref16.state_dict().items()})
    x32 = x16.float().numpy()

    def run_attn():
        return ours(x16, x16, x16, need_weights=False)[0]

    def run_torch():
        with torch.inference_mode():
            return ref16(x16, x16, x16, need_weights=False)[0]

    def run_f32():
        return ours32(x32, x32, x32, need_weights=False)[0]

    out_a, out_t = run_attn(), run_torch()
    run_f32()
    vs_torch = alternate(run_attn, run_torch, args.reps, beside=beside)
    vs_f32 = alternate(run_attn, run_f32, args.reps)
    D = E
    flops = 2.0 * N * L * E * 3 * D + 2.0 * N * L * D * E + 4.0 * N * H * L * L * (D // H)
    return dict(vs_torch, ms_f32=vs_f32["ms_torch"], spread_f32=vs_f32["spread_torch"],
                ms_attn_2=vs_f32["ms_attn"], flops=flops, kv_bytes=0, dtype=str(dtype)[6:],
                mha=True, max_diff=float(np.max(np.abs(np.asarray(out_a, np.float64) -
                                                       out_t.double().numpy()))))


def half_table(cases, peak_bf16, bf16_isa="avx512_bf16"):
    """The bfloat16 rows: attn against PyTorch's bfloat16 and its own float32."""
    half = [c for c in cases if c["group"] == "half"]
    if not half:
        return []
    what = "AMX tile" if bf16_isa == "amx" else "AVX512-BF16 dot-product"
    peak_note = (f"the {what} peak measured in the same run, "
                 f"{peak_bf16:.0f} GFLOP/s" if peak_bf16 else "no AVX512-BF16 on this CPU")
    lines = ["", f"bfloat16 (issue 13): prefill, attn on torch bfloat16 tensors (float32 "
             f"accumulation and softmax, outputs rounded once) against PyTorch's bfloat16 SDPA, "
             f"and MHA, attn.MultiheadAttention in bfloat16 against torch's module in bfloat16 "
             f"(need_weights=False), each also against attn's own float32 on the same values, "
             f"each pair alternating; % of peak: of {peak_note}.", "",
             "| case | attn bf16 ms | attn f32 ms | PyTorch bf16 ms | vs attn f32 | "
             "vs PyTorch bf16 | attn bf16 GFLOP/s | % of bf16 peak | max \\|diff\\| vs PyTorch | "
             "note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in half:
        pct = f"{100 * c['gflops_attn'] / peak_bf16:.0f}%" if peak_bf16 else "–"
        lines.append(f"| {c['label']} | {c['ms_attn']:.2f} | {c['ms_f32']:.2f} | "
                     f"{c['ms_torch']:.2f} | **{c['vs_f32']:.2f}×** | **{c['ratio']:.2f}×** | "
                     f"{c['gflops_attn']:.1f} | {pct} | {c['max_diff']:.1e} | "
                     f"{c.get('extra', '')} |")
    return lines


def bench_short(args, H, L, E):
    """One point of the short-sequence sweep, (1, H, L, L, E): calls of
    microseconds, timed `inner` at a time so a sample lasts about 2 ms."""
    calls = sdpa_calls(1, H, L, L, E, False, H)
    run_attn, run_torch = calls["attn"], calls["torch"]
    out_a, out_t = run_attn(), run_torch()
    one = max(timed(run_attn), timed(run_torch), 1e-3)
    times = alternate(run_attn, run_torch, args.reps, inner=max(1, int(2.0 / one)))
    # The same on torch tensors (a model's call): their Python route costs
    # more per call than the NumPy one, which the first grid shows alone.
    tensors = alternate(calls["attn_tensors"], run_torch, args.reps, inner=max(1, int(2.0 / one)))
    return dict(**times, flops=4.0 * H * L * L * E, kv_bytes=0,
                ratio_tensors=tensors["ms_torch"] / tensors["ms_attn"],
                ms_attn_tensors=tensors["ms_attn"],
                max_diff=float(np.max(np.abs(np.asarray(out_a) - out_t.numpy()))))


def short_grid(short, key):
    """Rows of the sweep's grid: a row per (H, E), a column per L, cells
    c[key], the PyTorch/attn time ratio (> 1: attn faster; below 1 bold)."""
    Ls = sorted({c["L"] for c in short})
    cell = {(c["H"], c["E"], c["L"]): c for c in short}
    lines = ["| H | E | " + " | ".join(f"L = {L}" for L in Ls) + " |",
             "|---:|---:|" + "---:|" * len(Ls)]
    for H, E in sorted({(c["H"], c["E"]) for c in short}):
        row = [cell.get((H, E, L)) for L in Ls]
        lines.append(f"| {H} | {E} | " + " | ".join(
            "–" if c is None or key not in c else (f"{c[key]:.2f}×" if c[key] >= 1 else
                                                   f"**{c[key]:.2f}×**") for c in row) + " |")
    return lines


def short_table(cases):
    """The sweep as two grids: attn on NumPy arrays, then on torch tensors."""
    short = [c for c in cases if c["group"] == "short"]
    if not short:
        return []
    lines = ["", f"Short sequences, (1, H, L, L, E) float32, not causal: PyTorch time / attn "
             f"time (> 1: attn faster), medians of ≥ {short[0]['samples']} alternating samples "
             "of ~2 ms each; attn on NumPy views of PyTorch's tensors.", ""]
    lines += short_grid(short, "ratio")
    # µs a torch call took over the NumPy call of the same shape, on the
    # shapes whose calls last microseconds (longer ones' noise swamps it)
    extra = sorted(1e3 * (c["ms_attn_tensors"] - c["ms_attn"]) for c in short
                   if "ms_attn_tensors" in c and c["L"] <= 64)
    if any("ratio_tensors" in c for c in short):
        cost = (f": a torch call took a median {extra[len(extra) // 2]:.1f} µs more than the "
                f"NumPy call of the same shape ({extra[0]:.1f} to {extra[-1]:.1f} µs over the "
                f"{len(extra)} shapes of L ≤ 64; PyTorch's call pays the inference_mode context "
                "too)" if extra else "")
        lines += ["", "The same calls with attn on the torch tensors themselves (under "
                  f"inference_mode, as PyTorch's){cost}.", ""]
        lines += short_grid(short, "ratio_tensors")
    return lines


# ---- MHA ----

def mha_modules(N, L, E, H):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    ours = attn.MultiheadAttention(E, H, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    ours.eval()
    x = torch.randn(N, L, E, generator=torch.Generator().manual_seed(1))
    return ref, ours, x


def mha_calls(N, L, E, H):
    ref, ours, x = mha_modules(N, L, E, H)
    xn = x.numpy()

    def run_attn():
        return ours(xn, xn, xn, need_weights=False)[0]

    def run_torch():
        with torch.inference_mode():
            return ref(x, x, x, need_weights=False)[0]
    return dict(attn=run_attn, torch=run_torch)


def bench_mha(args, N, L, E, H):
    calls = mha_calls(N, L, E, H)
    run_attn, run_torch = calls["attn"], calls["torch"]

    out_a, out_t = run_attn(), run_torch()
    run_attn(), run_torch()
    times = alternate(run_attn, run_torch, args.reps)
    D = E  # head_dim * heads
    flops = 2.0 * N * L * E * 3 * D + 2.0 * N * L * D * E + 4.0 * N * H * L * L * (D // H)

    return dict(**times, flops=flops, kv_bytes=0,
                max_diff=float(np.max(np.abs(np.asarray(out_a) - out_t.numpy()))),
                checksum=float(np.asarray(out_a, dtype=np.float64).sum()),
                mem_attn=peak_memory(args, "attn", "mha", (N, L, E, H)),
                mem_torch=peak_memory(args, "torch", "mha", (N, L, E, H)))


# ---- backward ----
# Both through autograd in this process, as a training loop calls them: attn
# by its PyTorch operator (the forward saves lse, the backward is
# attn_sdpa_backward), PyTorch by its own SDPA, alternating call by call.

def backward_inputs(B, H, L, S, E, seed=0):
    """sdpa_inputs' q, k, v and a seeded dout shaped like the output."""
    q, k, v = sdpa_inputs(B, H, L, S, E, H, seed)
    dout = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(seed + 1))
    return q, k, v, dout


def backward_call(sdpa, q, k, v, dout, causal):
    """One forward then .backward(dout) with fresh gradients: (forward+backward
    ms, backward ms)."""
    q.grad = k.grad = v.grad = None
    t0 = time.perf_counter()
    out = sdpa(q, k, v, is_causal=causal)
    t1 = time.perf_counter()
    out.backward(dout)
    t2 = time.perf_counter()
    return (t2 - t0) * 1e3, (t2 - t1) * 1e3


def grads(q, k, v):
    """Copies of the gradients of q, k, v."""
    return [t.grad.clone() for t in (q, k, v)]


def bench_backward(args, B, H, L, S, E, causal, beside=None):
    """Medians over calls that alternate attn and PyTorch (order flipped
    every call); gradients compared on the warm-up calls. beside: as
    alternate's (the FMA peak probed after every round)."""
    q, k, v, dout = backward_inputs(B, H, L, S, E)
    for t in (q, k, v):
        t.requires_grad_()
    reps = args.reps if L * S <= 4096 * 4096 else max(3, args.reps // 3)
    backward_call(attn.scaled_dot_product_attention, q, k, v, dout, causal)  # warm-up
    ours = grads(q, k, v)
    backward_call(F.scaled_dot_product_attention, q, k, v, dout, causal)
    theirs = grads(q, k, v)
    diffs = {name: float((a - b).abs().max()) for name, a, b in zip(("dq", "dk", "dv"), ours, theirs)}
    runs = dict(attn_fwd_bwd=[], attn_bwd=[], torch_fwd_bwd=[], torch_bwd=[])
    probes = []
    for r in range(reps):
        pair = (("attn", attn.scaled_dot_product_attention), ("torch", F.scaled_dot_product_attention))
        for name, sdpa in (pair if r % 2 == 0 else pair[::-1]):
            both, bwd = backward_call(sdpa, q, k, v, dout, causal)
            runs[name + "_fwd_bwd"].append(both)
            runs[name + "_bwd"].append(bwd)
        if beside is not None:
            probes.append(beside())
    half = 0.5 if causal else 1.0
    med = {key: statistics.median(x) for key, x in runs.items()}
    beside_figures = dict(beside=probes) if beside is not None else {}
    return dict(ms_attn=med["attn_fwd_bwd"], ms_attn_bwd=med["attn_bwd"],
                ms_torch=med["torch_fwd_bwd"], ms_torch_bwd=med["torch_bwd"],
                flops=14.0 * B * H * L * S * E * half, flops_bwd=10.0 * B * H * L * S * E * half,
                max_diff=diffs, reps=reps, runs_ms=runs, **beside_figures)


def backward_figures(c, peak):
    """Ratios, GFLOP/s and % of peak of one backward case (in place)."""
    c["ratio"] = c["ms_torch"] / c["ms_attn"]
    c["ratio_bwd"] = c["ms_torch_bwd"] / c["ms_attn_bwd"]
    c["gflops_attn"] = c["flops"] / c["ms_attn"] / 1e6
    c["gflops_torch"] = c["flops"] / c["ms_torch"] / 1e6
    c["gflops_attn_bwd"] = c["flops_bwd"] / c["ms_attn_bwd"] / 1e6
    c["gflops_torch_bwd"] = c["flops_bwd"] / c["ms_torch_bwd"] / 1e6
    c["peak_pct"] = 100 * c["gflops_attn"] / peak
    c["peak_pct_bwd"] = 100 * c["gflops_attn_bwd"] / peak


def fmt_backward_row(c):
    d = c["max_diff"]
    beside = (f"{100 * c['gflops_attn_bwd'] / c['peak_beside']:.0f}% "
              f"({c['peak_beside']:.0f} GFLOP/s, {min(c['beside']):.0f}–{max(c['beside']):.0f})"
              if "peak_beside" in c else "–")
    return (f"| {c['label']} | {c['ms_attn']:.2f} | {c['ms_attn_bwd']:.2f} | "
            f"{c['ms_torch']:.2f} | {c['ms_torch_bwd']:.2f} | **{c['ratio']:.2f}×** | "
            f"{c['ratio_bwd']:.2f}× | {c['gflops_attn']:.1f} | {c['gflops_torch']:.1f} | "
            f"{c['gflops_attn_bwd']:.1f} | {c['peak_pct']:.0f}% | {c['peak_pct_bwd']:.0f}% | "
            f"{beside} | {d['dq']:.1e} / {d['dk']:.1e} / {d['dv']:.1e} |")


def backward_table(cases):
    """The backward's Markdown table, with how it counts and measures."""
    if not cases:
        return []
    return ["", "Backward: attn.scaled_dot_product_attention(...).backward(dout) (attn's "
            "PyTorch operator: attn_sdpa with lse, then attn_sdpa_backward) vs PyTorch's "
            "F.scaled_dot_product_attention(...).backward(dout), on the same seeded q, k, v, "
            "dout, alternating call by call (order flipped every call). GFLOP/s count the forward as 4·B·H·L·S·E and the backward as "
            "10·B·H·L·S·E (forward+backward 14·B·H·L·S·E), half of it when causal. "
            "Speed-ups are PyTorch ms / attn ms.", "",
            "| case | attn fwd+bwd ms | attn bwd ms | PyTorch fwd+bwd ms | PyTorch bwd ms | "
            "speed-up fwd+bwd | speed-up bwd | attn fwd+bwd GFLOP/s | PyTorch fwd+bwd GFLOP/s | "
            "attn bwd GFLOP/s | attn fwd+bwd % of peak | attn bwd % of peak | "
            "attn bwd % of the FMA peak probed between its rounds | "
            "max \\|diff\\| dq / dk / dv |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"] + \
        [fmt_backward_row(c) for c in cases]


def backward_verdicts(cases, memory):
    """The issue's backward targets: per case, then the memory bound."""
    verdict = []
    for c in cases:
        verdict.append((c["label"], f"fwd+bwd ≥ {TARGET_BWD_RATIO}× PyTorch",
                        c["ratio"] >= TARGET_BWD_RATIO, f"{c['ratio']:.2f}×"))
        verdict.append((c["label"], f"bwd ≥ {TARGET_BWD_PEAK_PCT:.0f}% of FMA peak",
                        c["peak_pct_bwd"] >= TARGET_BWD_PEAK_PCT, f"{c['peak_pct_bwd']:.0f}%"))
    if memory is not None:
        m = memory
        verdict.append((f"L = S = {m['L']}, H = 1, E = {m['E']} (attn_bench memory-backward)",
                        "backward peak RSS ≤ inputs + outputs + gradients + 64 MiB",
                        m["within_budget"],
                        f"{m['used_mib']:.1f} MiB (inputs + outputs + gradients "
                        f"{m['inputs_outputs_gradients_mib']:.0f} MiB + "
                        f"{m['used_mib'] - m['inputs_outputs_gradients_mib']:.1f} MiB; "
                        f"budget {m['budget_mib']:.0f} MiB)"))
    return verdict


# ---- report ----

def fmt_row(c, peak):
    ratio = c["ms_torch"] / c["ms_attn"]
    g_a, g_t = c["flops"] / c["ms_attn"] / 1e6, c["flops"] / c["ms_torch"] / 1e6
    return (f"| {c['label']} | {c['ms_attn']:.2f} ±{100 * c['spread_attn']:.0f}% | "
            f"{c['ms_torch']:.2f} ±{100 * c['spread_torch']:.0f}% | **{ratio:.2f}×** | "
            f"{g_a:.1f} | {g_t:.1f} | {100 * g_a / peak:.0f}% | {c['extra']} | "
            f"{c['mem_attn']:.0f} / {c['mem_torch']:.0f} | {c['max_diff']:.1e} |")


def plot(cases, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot (scripts/bootstrap.sh bench installs it)")
        return False
    sweep = [c for c in cases if c["group"] == "sweep"]
    if not sweep:
        return False
    for causal in (False, True):
        pts = sorted((c["L"], c) for c in sweep if c["causal"] == causal)
        if not pts:
            continue
        xs = [p[0] for p in pts]
        style = "--" if causal else "-"
        tag = "causal" if causal else "non-causal"
        plt.plot(xs, [c["flops"] / c["ms_attn"] / 1e6 for _, c in pts], "o" + style,
                 color="tab:blue", label=f"attn, {tag}")
        plt.plot(xs, [c["flops"] / c["ms_torch"] / 1e6 for _, c in pts], "s" + style,
                 color="tab:orange", label=f"PyTorch {torch.__version__}, {tag}")
    plt.xscale("log", base=2)
    plt.xlabel("sequence length L = S  (B=1, H=16, E=64, float32)")
    plt.ylabel("GFLOP/s")
    plt.title(f"SDPA throughput, {cases[0]['threads']} threads")
    plt.grid(alpha=0.3)
    plt.legend()
    plt.savefig(path, dpi=110, bbox_inches="tight")
    return True


def cpu_model():
    """/proc/cpuinfo's model name, family and model (platform.processor()
    is empty on Linux)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        return platform.processor() or platform.machine()
    return (f"{fields.get('model name', platform.machine())} "
            f"(family {fields.get('cpu family', '?')} model {fields.get('model', '?')})")


def write_serving(args, res, verdict, machine, peak, bw):
    """serving.json and serving.md in the results folder: the serving section alone."""
    with open(os.path.join(args.out, "serving.json"), "w") as f:
        json.dump(dict(machine=machine, serving=res,
                       targets=[dict(case=a, target=b, met=m, value=v) for a, b, m, v in verdict]),
                  f, indent=1)
    info = res["decode"]["info"]
    lines = [f"attn {info['attn']} ({info['isa']}) vs PyTorch {machine['torch']}, "
             f"float32, {args.threads} threads, {machine['date']}, {machine['cpu_model']}. "
             f"Measured in the same run: FMA peak {peak:.0f} GFLOP/s ({machine['peak_isa']}), "
             f"read bandwidth {bw:.1f} GB/s."]
    lines += serving.table(res, machine)
    lines += ["", "| target | case | measured | met |", "|---|---|---:|:---:|"]
    lines += [f"| {b} | {a} | {v} | {'yes' if m else '**no**'} |" for a, b, m, v in verdict]
    with open(os.path.join(args.out, "serving.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def blas_env_note(machine):
    dropped = machine.get("blas_env_dropped")
    return (f" (OPENBLAS_CORETYPE={dropped} from the environment dropped: attn's own choice)"
            if dropped else "")


def steady_heap():
    """glibc's malloc thresholds fixed at what a long-running process ends up with
    (module docstring): mmap only from 32 MiB (M_MMAP_THRESHOLD, -3), trim
    the heap past 64 MiB free (M_TRIM_THRESHOLD, -1). Without glibc: left
    as they are (False)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(-3, 32 << 20)) and bool(libc.mallopt(-1, 64 << 20))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="small shapes only (a smoke run)")
    ap.add_argument("--only", default="", help="run cases whose label contains this text, "
                    "or any of several joined by '|' ('serving': the serving section)")
    ap.add_argument("--serving", action="store_true",
                    help="only the serving section; writes only serving.json and serving.md")
    ap.add_argument("--bench-bin", default=os.path.join(ROOT, "build", "bench", "attn_bench"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", cpu_slug()),
                    help="where the results go (default: bench/results/<this CPU>)")
    ap.add_argument("--keep-blas-core", action="store_true",
                    help="keep OPENBLAS_CORETYPE from the environment (dropped by default)")
    ap.add_argument("--memory-probe", help=argparse.SUPPRESS)
    return ap.parse_args()


def serving_only(args, machine, peak0, bw):
    """--serving: the serving section alone, into serving.json and serving.md."""
    res = serving.run(args, lambda: probe(args, "bandwidth")["gbps"],
                      bandwidth_probe_huge=lambda: probe_huge_bandwidth(args))
    peak1 = probe(args, "peak")
    peak = max(peak0["gflops"], peak1["gflops"])
    verdict = serving.figures(res, bw["gbps"], peak)
    machine.update(fma_peak_gflops=[peak0["gflops"], peak1["gflops"]],
                   read_bandwidth_gbps=[bw["gbps"], res["decode"]["bandwidth_probe_gbps"]])
    print("\n".join(write_serving(args, res, verdict, machine, peak,
                                   res["decode"]["bandwidth_gbps"])))
    log(f"wrote {args.out}/serving.json, serving.md")


def build_plan(quick):
    """Every case of a run, in order: (group, parameters)."""
    plan = []
    prefill = PREFILL if not quick else [(1, 8, 512, 512, 64)]
    for shp in prefill:
        for causal in (False, True):
            plan.append(("prefill", shp + (causal, None)))
    for shp in (DECODE if not quick else [(1, 32, 1, 4096, 128, 8)]):
        plan.append(("decode", shp[:5] + (False, shp[5])))
    for name, N, L, E, H in (MHA if not quick else MHA[:1]):
        plan.append(("mha", (name, N, L, E, H)))
    for Ls in (SWEEP if not quick else [256, 512]):
        for causal in (False, True):
            plan.append(("sweep", (1, 16, Ls, Ls, 64, causal, None)))
    for H in (SHORT["H"] if not quick else [8]):
        for E in (SHORT["E"] if not quick else [64]):
            for Ls in (SHORT["L"] if not quick else [16, 128]):
                plan.append(("short", (1, H, Ls, Ls, E, False, None)))
    for shp in prefill:
        for causal in (False, True):
            plan.append(("backward", shp + (causal, None)))
    for shp in (HALF if not quick else [(1, 8, 512, 512, 64)]):
        for causal in (False, True):
            plan.append(("half", shp + (causal, None)))
    for name, N, L, E, H in (MHA if not quick else MHA[:1]):
        plan.append(("half_mha", (name, N, L, E, H)))
    return plan


def case_label(group, p):
    if group in ("mha", "half_mha"):
        name, N, L, E, H = p
        return ("bfloat16 " if group == "half_mha" else "") + f"MHA {name} ({N},{L},{E}) {H} heads"
    B, H, L, S, E, causal, kvh = p
    return (("backward " if group == "backward" else "short " if group == "short"
             else "bfloat16 " if group == "half" else "") + f"({B},{H},{L},{S},{E})" +
            (" causal" if causal else "") + (f" {kvh} KV heads" if kvh else ""))


class Beside:
    """The machine's state beside a case's own rounds (shared VMs move by 2x
    within minutes): the FMA peak after every round of the prefill and
    backward cases, the bfloat16 products' peak after every round of the
    bfloat16 cases against PyTorch (where this CPU has them), the read
    bandwidth after every round of a decode."""

    def __init__(self, args):
        self.args = args
        self.bf16_path = attn.kernel_info()["isa"] in ("avx512_bf16", "amx")

    def fma(self):
        return probe(self.args, "peak", "--rounds", "3")["gflops"]

    def bf16(self):
        return probe(self.args, "peak", "--bf16", "--rounds", "2")["gflops"]

    def bandwidth(self):
        return probe(self.args, "bandwidth")["gbps"]


def run_backward_case(args, p, label, beside):
    B, H, L, S, E, causal, _ = p
    t0 = time.perf_counter()
    c = bench_backward(args, B, H, L, S, E, causal, beside=beside.fma)
    c.update(group="backward", label=label, threads=args.threads, L=L, causal=causal)
    c["peak_beside"] = statistics.median(c["beside"])
    log(f"    attn fwd+bwd {c['ms_attn']:.2f} ms (bwd {c['ms_attn_bwd']:.2f}), torch "
        f"{c['ms_torch']:.2f} ms (bwd {c['ms_torch_bwd']:.2f}), "
        f"{c['ms_torch'] / c['ms_attn']:.2f}x, max |diff| "
        f"{max(c['max_diff'].values()):.1e} ({time.perf_counter() - t0:.0f} s)")
    return c


def run_case(args, group, p, label, beside, bw):
    """One forward case (every group but the backward), timed and annotated."""
    t0 = time.perf_counter()
    half_beside = beside.bf16 if beside.bf16_path else None
    if group == "mha":
        c = bench_mha(args, *p[1:])
    elif group == "half_mha":  # reported among the bfloat16 rows
        c = bench_mha_half(args, *p[1:], beside=half_beside)
        c["vs_f32"] = c["ms_f32"] / c["ms_attn_2"]
        group = "half"
    else:
        B, H, L, S, E, causal, kvh = p
        if group == "short":
            c = bench_short(args, H, L, E)
            c.update(H=H, E=E)
        elif group == "half":
            c = bench_half(args, B, H, L, S, E, causal, beside=half_beside)
            c["vs_f32"] = c["ms_f32"] / c["ms_attn_2"]
        else:  # prefill, sweep, decode
            c = bench_sdpa(args, B, H, L, S, E, causal, kvh,
                           beside={"prefill": beside.fma,
                                   "decode": beside.bandwidth}.get(group))
        c.update(L=L, causal=causal)
    c.update(group=group, label=label, threads=args.threads)
    c["ratio"] = c["ms_torch"] / c["ms_attn"]
    c["gflops_attn"] = c["flops"] / c["ms_attn"] / 1e6
    c["gflops_torch"] = c["flops"] / c["ms_torch"] / 1e6
    c["extra"] = ""
    if group == "decode":
        c["kv_gbps"] = c["kv_bytes"] / c["ms_attn"] / 1e6
        # graded against the bandwidth probed between its own rounds (the
        # VM's moves by 2x through a run); the run's first probe beside it
        c["bw_beside_gbps"] = statistics.median(c["beside"])
        c["bw_pct"] = 100 * c["kv_gbps"] / c["bw_beside_gbps"]
        c["bw_pct_first"] = 100 * c["kv_gbps"] / bw["gbps"]
        c["extra"] = (f"K/V {c['kv_gbps']:.1f} GB/s = {c['bw_pct']:.0f}% of the read BW "
                      f"probed between its rounds ({c['bw_beside_gbps']:.1f} GB/s), "
                      f"{c['bw_pct_first']:.0f}% of the run's first probe")
    elif "beside" in c:  # a peak probed between its rounds (FMA, or bfloat16 products)
        c["peak_beside"] = statistics.median(c["beside"])
        what = "bfloat16 peak" if group == "half" else "FMA peak"
        c["extra"] = (f"{c['gflops_attn'] / c['peak_beside']:.0%} of the {what} probed "
                      f"between its rounds ({c['peak_beside']:.0f} GFLOP/s, "
                      f"{min(c['beside']):.0f}–{max(c['beside']):.0f})")
    log(f"    attn {c['ms_attn']:.3f} ms ±{100 * c['spread_attn']:.0f}%, torch "
        f"{c['ms_torch']:.3f} ms ±{100 * c['spread_torch']:.0f}%, {c['ratio']:.2f}x, "
        f"{c['gflops_attn']:.1f} GFLOP/s, {c['extra']} ({time.perf_counter() - t0:.0f} s)")
    return c


def run_memory(args):
    """attn_bench memory (forward) and memory-backward, as the run asks."""
    memory = None
    if not args.quick and not args.only:
        log("memory: attn_bench memory (L = S = 65536, H = 1, E = 64) ...")
        memory = probe(args, "memory")
        log(f"    peak RSS grew {memory['used_mib']:.1f} MiB for {memory['inputs_outputs_mib']:.0f} "
            f"MiB of inputs and outputs (budget {memory['budget_mib']:.0f} MiB) in "
            f"{memory['seconds']:.1f} s")
    # The backward's memory at the issue's length; a short one as a smoke test
    # when --quick (the verdict names the length measured).
    memory_bwd = None
    if not args.only or "memory" in args.only:
        mlen = 65536 if not args.quick else 8192
        log(f"memory: attn_bench memory-backward (L = S = {mlen}, H = 1, E = 64) ...")
        memory_bwd = probe(args, "memory-backward", "--len", str(mlen))
        log(f"    peak RSS grew {memory_bwd['used_mib']:.1f} MiB for "
            f"{memory_bwd['inputs_outputs_gradients_mib']:.0f} MiB of inputs, outputs and "
            f"gradients (budget {memory_bwd['budget_mib']:.0f} MiB); backward "
            f"{memory_bwd['seconds']:.1f} s")
    return memory, memory_bwd


def forward_verdicts(cases, peak_isa, peak_bf16, bf16_isa):
    """The forward's targets, as the issues state them: (case, target, met, value)."""
    verdict = []
    peak_target = TARGET_PEAK_PCT.get(peak_isa)
    for c in cases:
        if c["group"] == "prefill":
            verdict.append((c["label"], f"≥ {TARGET_PREFILL_RATIO}× PyTorch",
                            c["ratio"] >= TARGET_PREFILL_RATIO, f"{c['ratio']:.2f}×"))
            if c["L"] >= 1024 and peak_target is not None:
                verdict.append((c["label"], f"≥ {peak_target:.0f}% of FMA peak ({peak_isa})",
                                c["peak_pct"] >= peak_target, f"{c['peak_pct']:.0f}%"))
            if c["L"] == 512 and c["causal"]:
                verdict.append((c["label"], f"≥ {TARGET_CAUSAL512_PCT:.0f}% of FMA peak",
                                c["peak_pct"] >= TARGET_CAUSAL512_PCT, f"{c['peak_pct']:.0f}%"))
        elif c["group"] == "decode":
            verdict.append((c["label"], f"≥ {TARGET_DECODE_RATIO}× PyTorch",
                            c["ratio"] >= TARGET_DECODE_RATIO, f"{c['ratio']:.2f}×"))
            verdict.append((c["label"], f"K/V at ≥ {TARGET_BW_PCT:.0f}% of read bandwidth",
                            c["bw_pct"] >= TARGET_BW_PCT, f"{c['bw_pct']:.0f}%"))
        elif c["group"] == "mha":
            verdict.append((c["label"], f"≥ {TARGET_MHA_RATIO}× PyTorch",
                            c["ratio"] >= TARGET_MHA_RATIO, f"{c['ratio']:.2f}×"))
            if "BERT" in c["label"]:
                verdict.append((c["label"], f"≥ {TARGET_BERT_PEAK_PCT:.0f}% of FMA peak",
                                c["peak_pct"] >= TARGET_BERT_PEAK_PCT, f"{c['peak_pct']:.0f}%"))
    for c in (c for c in cases if c["group"] == "half" and not c.get("mha")):
        if peak_bf16:  # the float32 target is for CPUs with bf16 products
            want, name = ((TARGET_HALF_VS_F32_AMX, "AMX") if bf16_isa == "amx"
                          else (TARGET_HALF_VS_F32, "AVX512-BF16"))
            verdict.append((c["label"], f"≥ {want}× attn float32 ({name})",
                            c["vs_f32"] >= want, f"{c['vs_f32']:.2f}×"))
        verdict.append((c["label"], f"≥ {TARGET_HALF_VS_TORCH}× PyTorch bfloat16",
                        c["ratio"] >= TARGET_HALF_VS_TORCH, f"{c['ratio']:.2f}×"))
    return verdict + short_verdicts([c for c in cases if c["group"] == "short"])


def short_verdicts(short):
    """The short-sequence sweep: every shape at PyTorch's speed or better,
    on NumPy arrays and on torch tensors (the call a PyTorch model makes)."""
    verdict = []
    for key, what in (("ratio", "short sequences"),
                      ("ratio_tensors", "short sequences on torch tensors")):
        timed = [c for c in short if key in c]
        if not timed:
            continue
        slow = [c for c in timed if c[key] < TARGET_SHORT_RATIO]
        worst = min(timed, key=lambda c: c[key])
        verdict.append((f"{what}, {len(timed)} shapes", f"each ≥ {TARGET_SHORT_RATIO}× PyTorch",
                        not slow, f"{len(timed) - len(slow)} of {len(timed)}; slowest "
                        f"{worst['label'].removeprefix('short ')} {worst[key]:.2f}×"))
    return verdict


def memory_verdict(memory):
    return [("L = S = 65536, H = 1, E = 64 (attn_bench memory)",
             "peak RSS ≤ inputs + outputs + 64 MiB", memory["within_budget"],
             f"{memory['used_mib']:.1f} MiB (inputs + outputs "
             f"{memory['inputs_outputs_mib']:.0f} MiB + "
             f"{memory['used_mib'] - memory['inputs_outputs_mib']:.1f} MiB; "
             f"budget {memory['budget_mib']:.0f} MiB)")] if memory is not None else []


def results_markdown(args, machine, peak, peak0, bw, cases, backward, serving_res, verdict,
                     peak_bf16, bf16_isa):
    lines = [f"attn {machine['attn']} ({machine['attn_isa']}, commit {machine['commit']}) vs "
             f"PyTorch {machine['torch']}, float32, {args.threads} threads, {machine['date']}, "
             f"{machine['cpu_model']}, BLAS {machine['blas']}"
             f"{blas_env_note(machine)}. Measured in the same run: "
             f"FMA peak {peak:.0f} GFLOP/s ({peak0['isa']}), read bandwidth {bw['gbps']:.1f} GB/s. "
             f"Medians of ≥ {args.reps} alternating calls after warm-up (more while the spread, "
             f"half the interquartile range, is above {100 * SPREAD_MAX:.0f}%).", "",
             "| case | attn ms | PyTorch ms | speed-up | attn GFLOP/s | PyTorch GFLOP/s | "
             "attn % of peak | note | extra memory MiB attn / PyTorch | max \\|diff\\| |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    lines += [fmt_row(c, peak) for c in cases if c["group"] not in ("sweep", "short", "half")]
    lines += short_table(cases)
    lines += half_table(cases, peak_bf16, bf16_isa)
    lines += backward_table(backward)
    if serving_res is not None:
        lines += serving.table(serving_res, machine)
    lines += ["", "| target | case | measured | met |", "|---|---|---:|:---:|"]
    lines += [f"| {b} | {a} | {v} | {'yes' if m else '**no**'} |" for a, b, m, v in verdict]
    return "\n".join(lines)


def main():
    args = parse_args()
    if args.memory_probe:
        memory_probe(args.memory_probe)
        return

    steady_heap()
    torch.set_num_threads(args.threads)
    attn.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)

    log(f"attn {attn.__version__} ({attn.kernel_info()['isa']}), PyTorch {torch.__version__}, "
        f"{args.threads} threads")
    peak0 = probe(args, "peak")
    bw = probe(args, "bandwidth")
    log(f"measured FMA peak {peak0['gflops']:.1f} GFLOP/s ({peak0['isa']}), "
        f"read bandwidth {bw['gbps']:.1f} GB/s")

    machine = dict(cpu=platform.processor() or platform.machine(), cpu_model=cpu_model(),
                   cpu_folder=cpu_slug(), threads=args.threads, peak_isa=peak0["isa"],
                   attn=attn.__version__, attn_isa=attn.kernel_info()["isa"],
                   blas=attn.kernel_info()["blas"], blas_env_dropped=DROPPED_BLAS_CORE,
                   torch=torch.__version__,
                   commit=commit(), date=time.strftime("%Y-%m-%d %H:%M"))
    if args.serving:
        serving_only(args, machine, peak0, bw)
        return

    plan, beside = build_plan(args.quick), Beside(args)
    cases, backward = [], []
    for i, (group, p) in enumerate(plan):
        label = case_label(group, p)
        if args.only and not any(part in label for part in args.only.split("|")):
            continue
        log(f"[{i + 1}/{len(plan)}] {group}: {label} ...")
        if group == "backward":
            backward.append(run_backward_case(args, p, label, beside))
        else:
            cases.append(run_case(args, group, p, label, beside, bw))

    serving_res = None
    if not args.only or args.only == "serving":
        serving_res = serving.run(args, beside.bandwidth,
                                  bandwidth_probe_huge=lambda: probe_huge_bandwidth(args))
    memory, memory_bwd = run_memory(args)

    bf16_probe = probe(args, "peak", "--bf16") if any(
        c["group"] == "half" for c in cases) else {"gflops": 0.0, "isa": "none"}
    peak_bf16, bf16_isa = bf16_probe["gflops"], bf16_probe["isa"]
    peak1 = probe(args, "peak")  # again at the end: the machine may have changed
    peak = max(peak0["gflops"], peak1["gflops"])
    for c in cases:
        c["peak_pct"] = 100 * c["gflops_attn"] / (peak_bf16 if c["group"] == "half" and peak_bf16
                                                    else peak)
    for c in backward:
        backward_figures(c, peak)

    verdict = forward_verdicts(cases, peak0["isa"], peak_bf16, bf16_isa)
    verdict += memory_verdict(memory)
    verdict += backward_verdicts(backward, memory_bwd)
    serving_verdict = []
    if serving_res is not None:
        serving_verdict = serving.figures(serving_res, bw["gbps"], peak)
        verdict += serving_verdict

    machine.update(fma_peak_gflops=[peak0["gflops"], peak1["gflops"]],
                   read_bandwidth_gbps=bw["gbps"], bf16_peak_gflops=peak_bf16,
                   bf16_peak_isa=bf16_isa)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(machine=machine, cases=cases, memory=memory,
                       targets=[dict(case=a, target=b, met=m, value=v) for a, b, m, v in verdict],
                       backward=backward, memory_backward=memory_bwd, serving=serving_res),
                  f, indent=1)
    if serving_res is not None:
        write_serving(args, serving_res, serving_verdict, machine, peak,
                      serving_res["decode"]["bandwidth_gbps"])
    table = results_markdown(args, machine, peak, peak0, bw, cases, backward, serving_res,
                             verdict, peak_bf16, bf16_isa)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")
    plotted = plot(cases, os.path.join(args.out, "throughput.png"))
    print(table)
    log(f"wrote {args.out}/results.json, results.md" + (", throughput.png" if plotted else "") +
        (", serving.json, serving.md" if serving_res is not None else ""))

if __name__ == "__main__":
    main()
