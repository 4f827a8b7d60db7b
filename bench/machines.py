#!/usr/bin/env python3
"""Every machine's last `make bench`, side by side.

    python3 bench/machines.py [--readme]

Reads bench/results/<cpu>/results.json (one folder per CPU, bench/run.py
writes them) and writes bench/results/machines.md: a row per case, a column
per machine, each cell the PyTorch/attn time ratio and attn's share of that
machine's FMA peak (read bandwidth for decoding), so that every figure stays
tied to the machine it was measured on. --readme also puts the table in
README.md between its `<!-- machines -->` markers.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
README = os.path.join(os.path.dirname(HERE), "README.md")
BEGIN, END = "<!-- machines -->", "<!-- /machines -->"


def load():
    """(folder, results) of every machine measured, oldest run first."""
    runs = []
    for folder in sorted(os.listdir(RESULTS)):
        path = os.path.join(RESULTS, folder, "results.json")
        if os.path.isfile(path):
            with open(path) as f:
                runs.append((folder, json.load(f)))
    return sorted(runs, key=lambda r: r[1]["machine"]["date"])


def cell(c):
    """speed-up, and % of the peak (or of the read bandwidth)."""
    share = f"{c['bw_pct']:.0f}% BW" if "bw_pct" in c else f"{c['peak_pct']:.0f}%"
    return f"{c['ms_torch'] / c['ms_attn']:.2f}×, {share}"


def short_summary(cases, tensors=False):
    """The short sweep's count of shapes at least PyTorch's speed and its
    slowest; `tensors`: attn on torch tensors (runs that measured it)."""
    short = [c for c in cases if c["group"] == "short" and (not tensors or "ratio_tensors" in c)]
    if not short:
        return "–"

    def ratio(c):
        return c["ratio_tensors"] if tensors else c["ms_torch"] / c["ms_attn"]
    worst = min(short, key=ratio)
    met = sum(ratio(c) >= 1.0 for c in short)
    return (f"{met} of {len(short)} ≥ 1.0×; slowest {worst['label'].removeprefix('short ')} "
            f"{ratio(worst):.2f}×")


def table(runs):
    heads, rule, about = ["case"], ["---"], []
    for i, (folder, r) in enumerate(runs, 1):
        m = r["machine"]
        core = m.get("blas", "?").rpartition("core ")[2] or "?"
        peak = max(m["fma_peak_gflops"])
        heads.append(f"[{i}] {folder}")
        rule.append("---:")
        about.append(f"[{i}] `{folder}`: {m['cpu_model']}, {m['attn_isa']} path, OpenBLAS core "
                     f"{core}, {m['threads']} threads, FMA peak {peak:.0f} GFLOP/s, read "
                     f"bandwidth {m['read_bandwidth_gbps']:.1f} GB/s; attn {m['attn']} "
                     f"(commit {m.get('commit', '?')}), {m['date']}.")
    labels = []
    for _, r in runs:
        for c in r["cases"]:
            if c["group"] not in ("sweep", "short") and c["label"] not in labels:
                labels.append(c["label"])
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(rule) + "|"]
    for label in labels:
        row = []
        for _, r in runs:
            found = [c for c in r["cases"] if c["label"] == label]
            row.append(cell(found[0]) if found else "–")
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines.append("| short sequences (1,H,L,L,E) | " +
                 " | ".join(short_summary(r["cases"]) for _, r in runs) + " |")
    lines.append("| short sequences, attn on torch tensors | " +
                 " | ".join(short_summary(r["cases"], True) for _, r in runs) + " |")
    return ["Each cell: PyTorch time / attn time in the same run (> 1: attn faster), then "
            "attn's share of that machine's FMA peak (decoding: of its read bandwidth; "
            "bfloat16 rows: against PyTorch's bfloat16, of the bfloat16 products' peak: "
            "AVX512-BF16 dot products, or AMX tiles where the path is amx).",
            ""] + \
        lines + [""] + about


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", action="store_true", help="also update README.md's table")
    args = ap.parse_args()
    runs = load()
    if not runs:
        sys.exit(f"no results under {RESULTS}/<cpu>/results.json: run `make bench` first")
    text = "\n".join(table(runs)) + "\n"
    with open(os.path.join(RESULTS, "machines.md"), "w") as f:
        f.write("# Every machine measured (bench/machines.py)\n\n" + text)
    if args.readme:
        with open(README) as f:
            readme = f.read()
        if BEGIN not in readme or END not in readme:
            sys.exit(f"README.md has no {BEGIN} ... {END} markers")
        head, _, rest = readme.partition(BEGIN)
        _, _, tail = rest.partition(END)
        with open(README, "w") as f:
            f.write(head + BEGIN + "\n" + text + END + tail)
    print(text, end="")


if __name__ == "__main__":
    main()
