"""pytest set-up for attn's Python conformance suite against PyTorch 2.13.

The random cases are drawn from one seed: ATTN_TEST_SEED (default below).
The summary at the end of a run repeats the seed and the accuracy observed.
"""

import sys
import warnings

import pytest

import conformance


def pytest_configure(config):
    import torch

    # Small problems: one torch thread is fastest and leaves the second core
    # to attn's own threads.
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="torch")


def pytest_report_header(config):
    return f"attn conformance seed: {conformance.SEED} (set ATTN_TEST_SEED to change it)"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stats = conformance.STATS
    tr = terminalreporter
    tr.write_line(
        f"attn conformance: seed {conformance.SEED} (ATTN_TEST_SEED={conformance.SEED} "
        f"repeats this run); torch {conformance.torch_version()}"
    )
    backward = sys.modules.get("test_sdpa_backward")
    if backward is not None and backward.GRAD_STATS["checks"]:
        g = backward.GRAD_STATS
        tr.write_line(
            f"  sdpa backward: {g['checks']} gradients checked, at most "
            f"{100 * g['worst_usage']:.0f}% of the bar used"
        )
    varlen = sys.modules.get("test_varlen_backward")
    if varlen is not None and varlen.STATS["checks"]:
        g = varlen.STATS
        tr.write_line(
            f"  varlen backward: {g['cases']} packed batches, {g['checks']} gradients checked on "
            f"every kernel path (at most {100 * g['worst_usage']:.0f}% of the bar used); "
            f"{g['gradchecks']} float64 gradchecks"
        )
    serving = sys.modules.get("test_serving_conformance")
    if serving is not None:
        for line in serving.summary_lines():
            tr.write_line(line)
    half = stats["half"]
    if half["cases"]:
        tr.write_line(
            f"  float16/bfloat16 sdpa: {half['cases']} cases checked (bar: ours <= 2 x torch in "
            f"the same dtype + 1e-6): error ratio ours/torch median "
            f"{conformance.median(half['ratios']):.3g}, worst {half['worst_ratio']:.3g}; at most "
            f"{100 * half['worst_usage']:.0f}% of the bar used"
        )
    mh = stats["mha_half"]
    if mh["cases"]:
        rms = ", ".join(f"{k} {v:.3g}" for k, v in mh.get("rms_ratio", {}).items())
        tr.write_line(
            f"  float16/bfloat16 mha: {mh['cases']} cases checked (bar: ours <= 2 x torch in the "
            f"same dtype + u·max|ref|): error ratio ours/torch median "
            f"{conformance.median(mh['ratios']):.3g}; at most {100 * mh['worst_usage']:.0f}% of "
            f"the bar used; RMS over all cases, ours/torch: {rms}"
        )
    for kind in ("sdpa", "mha", "encoder"):
        s = stats[kind]
        if s["cases"] == 0:
            continue
        tr.write_line(
            f"  {kind}: {s['cases']} cases checked. float32 (bar: ours <= 2 x torch + 1e-6): "
            f"error ratio ours/torch median {conformance.median(s['ratios']):.3g}, worst "
            f"{s['worst_ratio']:.3g}; at most {100 * s['worst_usage']:.0f}% of the bar used. "
            f"float64: worst relative error "
            f"{s['worst_rel64']:.3g} vs torch"
            + (
                f", {s['worst_exact64']:.3g} vs the exact result (bar: 1e-12 relative; the "
                f"float64 rounding floor needed in {s['floor_used']} checks, torch's own "
                f"error in {s['allowance_used']})"
                if kind == "sdpa"
                else " (bar: 1e-12)"
            )
        )


@pytest.fixture
def rng(request):
    """A generator seeded from the run seed and the test's name."""
    import zlib

    import numpy as np

    return np.random.default_rng([conformance.SEED, zlib.crc32(request.node.nodeid.encode())])
