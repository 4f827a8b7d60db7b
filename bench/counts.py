"""Instruction counts of the fused kernels under valgrind's callgrind: a
regression signal free of timing noise (issue 12). `make bench-counts`.

    python3 bench/counts.py [--bench-bin build/bench/attn_bench] [--out bench/results]

Each case runs `attn_bench` on one thread under callgrind, collecting only
inside the attention call (--toggle-collect), once with --reps 1 and once
with --reps 3: (Ir(3) - Ir(1)) / 2 is one call's instructions, the warm-up
call and the setup excluded. Valgrind's virtual CPU has no AVX-512, so the
paths counted are avx2 (when the machine runs it) and generic; the AVX-512
kernels get no count here.

The counts of this commit are added to bench/results/<cpu>/counts.json
(one entry per commit, the last run of a commit replacing the earlier one)
and the last ten commits are tabulated in counts.md beside it, so a kernel
change shows what it costs in instructions before any timing is trusted.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (label, attn_bench arguments, the function whose calls are counted)
CASES = [
    ("sdpa (1,2,256,256,64)", ["sdpa", "1", "2", "256", "256", "64"], "attn_sdpa"),
    ("sdpa (1,2,256,256,64) causal", ["sdpa", "1", "2", "256", "256", "64", "--causal"],
     "attn_sdpa"),
    ("sdpa (1,32,32,32,128) short", ["sdpa", "1", "32", "32", "32", "128"], "attn_sdpa"),
    ("decode (1,8,1,2048,128) 2 KV heads",
     ["sdpa", "1", "8", "1", "2048", "128", "--kv-heads", "2"], "attn_sdpa"),
    ("backward (1,2,128,128,64)", ["backward", "1", "2", "128", "128", "64"],
     "attn_sdpa_backward"),
]
PATHS = ["avx2", "generic"]


def cpu_slug():
    """A folder name for this CPU: vendor model, family and model numbers."""
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if ":" in line:
                k, v = (s.strip() for s in line.split(":", 1))
                info.setdefault(k, v)
            if not line.strip() and info:
                break
    name = re.sub(r"[^a-z0-9]+", "-", info.get("model name", "cpu").lower()).strip("-")
    return f"{name}-f{info.get('cpu family', 'x')}-m{info.get('model', 'x')}"


def instructions(bench, args, func, isa, reps):
    """Ir collected inside `func` for one attn_bench run."""
    with tempfile.TemporaryDirectory(prefix="attn_counts_") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
               f"--toggle-collect={func}", bench, *args, "--reps", str(reps), "--threads", "1"]
        env = dict(os.environ, ATTN_ISA=isa, OMP_NUM_THREADS="1")
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-2000:]}")
        with open(out) as f:
            for line in f:
                if line.startswith("summary:") or line.startswith("totals:"):
                    return int(line.split()[1])
    sys.exit(f"no instruction total in callgrind's output for {' '.join(cmd)}")


def supported_paths(bench):
    """The counted paths this machine runs (attn_bench reports the path it ran)."""
    paths = []
    for isa in PATHS:
        run = subprocess.run([bench, "sdpa", "1", "1", "16", "16", "16", "--reps", "1",
                              "--threads", "1"], capture_output=True, text=True,
                             env=dict(os.environ, ATTN_ISA=isa))
        if run.returncode == 0 and json.loads(run.stdout).get("isa") == isa:
            paths.append(isa)
    return paths


def commit():
    run = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"],
                         capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (run.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


def table(entries):
    """Markdown: one row per case and path, one column per commit (last 10)."""
    last = entries[-10:]
    keys = []
    for e in last:
        for k in e["counts"]:
            if k not in keys:
                keys.append(k)
    head = "| case | path | " + " | ".join(e["commit"] for e in last) + " |"
    rule = "|---|---|" + "---:|" * len(last)
    rows = []
    for k in keys:
        label, path = k.rsplit(" @ ", 1)
        cells = [f"{e['counts'][k] / 1e6:.2f}M" if k in e["counts"] else "–" for e in last]
        rows.append(f"| {label} | {path} | " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-bin", default=os.path.join(ROOT, "build", "bench", "attn_bench"))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--commit", help="the label of these counts (default: git HEAD), for a "
                    "binary built from another commit")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (scripts/bootstrap.sh valgrind)")
    paths = supported_paths(args.bench_bin)
    counts = {}
    for label, cmd, func in CASES:
        for isa in paths:
            one = instructions(args.bench_bin, cmd, func, isa, 1)
            three = instructions(args.bench_bin, cmd, func, isa, 3)
            counts[f"{label} @ {isa}"] = (three - one) // 2
            print(f"{label:40s} {isa:8s} {counts[f'{label} @ {isa}'] / 1e6:10.2f}M instructions",
                  flush=True)
    folder = os.path.join(args.out, cpu_slug())
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "counts.json")
    entries = []
    if os.path.exists(path):
        with open(path) as f:
            entries = json.load(f)
    here = args.commit or commit()
    base = here.removesuffix("-dirty")  # a commit's later run replaces its earlier ones
    entries = [e for e in entries if e["commit"].removesuffix("-dirty") != base]
    entries.append(dict(commit=here, date=time.strftime("%Y-%m-%d %H:%M"), counts=counts))
    with open(path, "w") as f:
        json.dump(entries, f, indent=1)
    with open(os.path.join(folder, "counts.md"), "w") as f:
        f.write("Instructions per call inside the attention call (callgrind Ir, one thread, "
                "warm-up excluded; `make bench-counts`), by commit, on this CPU.\n\n")
        f.write(table(entries) + "\n")
    print(f"wrote {path} and counts.md")


if __name__ == "__main__":
    main()
