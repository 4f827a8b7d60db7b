#!/usr/bin/env python3
"""Ring attention, 1 -> 2 ranks, one thread each (``make bench-ring``).

    python3 bench/ring_run.py [--build build] [--heads 2] [--len 16384] [--dim 64]
                              [--reps 3] [--min-rounds 3] [--max-rounds 7] [--spread 0.03]
                              [--no-net] [--no-crossover] [--out bench/results/<cpu>]

Runs bench/ring_bench (built with attn_ring) under mpirun for L = S = 16,384,
E = 64, non-causal and causal (zigzag), as:
  attn_sdpa   one process, plain attn_sdpa on the whole tensors (the baseline)
  1 rank      attn_ring_sdpa on one rank (no messages)
  2 ranks     two ranks on this host (Open MPI's shared-memory transport)
  2 ranks, veth  one rank in each of two network namespaces, TCP over a veth
                 pair (scripts/ring_netns.sh; needs root)
every one with one thread (attn_set_num_threads(1), OMP_NUM_THREADS=1).
Each launch makes a warm-up call and --reps timed calls (a call's time is the
slowest rank's; the launch reports its median). Launches alternate, in an order
rotated every round, so a busy neighbour slows all alike; rounds repeat until
each configuration's spread ((max - min) / median over rounds) is at most
--spread, or --max-rounds; the spread is reported either way, with the load
average before each round (this is a 2-core machine shared with others).

Reported: the median time, GFLOP/s, strong-scaling efficiency T1 / (2 T2)
(T1: 1 rank; also round by round, and against T1 = attn_sdpa), and per rank and step the share of the step spent waiting for
the next K/V shard after its compute (attn_ring_stats). Also the veth's
latency and bandwidth (tests/ring/ring_driver pingpong), and the check of
docs/distributed.md's model: the veth capped (--crossover-rate, tc tbf), shard
lengths around the model's shortest shard that hides its transfer.

Writes OUT/ring.json and OUT/ring.md and prints the table.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from counts import cpu_slug  # noqa: E402  (bench/counts.py)
ROOT = os.path.dirname(HERE)
BYTES = 4  # float32


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", ATTN_NUM_THREADS="1",
             OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return e


def launch(args, kind, causal, length=None, heads=None, reps=None, rate=None):
    """One mpirun of ring_bench; its JSON (plus the veth's counters)."""
    bench = [args.ring_bench, "-H", str(heads or args.heads), "-L", str(length or args.len),
             "-E", str(args.dim), "--reps", str(reps or args.reps), "--warmup", "1",
             "--threads", "1"] + (["--causal"] if causal else [])
    mpirun = ["mpirun", "--bind-to", "none", "-x", "OMP_NUM_THREADS", "-x", "ATTN_NUM_THREADS"]
    if kind == "attn_sdpa":
        cmd = mpirun + ["-np", "1"] + bench + ["--local"]
    elif kind == "1 rank":
        cmd = mpirun + ["-np", "1"] + bench
    elif kind == "2 ranks":
        cmd = mpirun + ["-np", "2", "--mca", "btl", "vader,self"] + bench
    elif kind == "2 ranks, veth":
        cmd = [os.path.join(ROOT, "scripts", "ring_netns.sh"), "--timeout", "600"]
        if rate:
            cmd += ["--rate", rate]
        cmd += ["--"] + bench
    else:
        raise ValueError(kind)
    run = subprocess.run(cmd, capture_output=True, text=True, env=env(), stdin=subprocess.DEVNULL)
    if run.returncode != 0 or not run.stdout.strip():
        sys.exit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    out = json.loads(run.stdout)
    for line in run.stderr.splitlines():  # ring_netns.sh's counters
        if line.startswith("ring_netns.sh: veth"):
            words = line.split()
            out["veth_sent_bytes"] = int(words[words.index("sent") + 1])
            out["veth_received_bytes"] = int(words[words.index("received") + 1])
    return out


def step_shares(res):
    """Per rank: each step's wait / (compute + wait), and the call's share."""
    shares = []
    for r in res["per_rank"]:
        steps = [w / (c + w) if c + w > 0 else 0.0
                 for c, w in zip(r["step_compute"], r["step_wait"])]
        shares.append(dict(rank=r["rank"], steps=steps,
                           call=r["wait"] / r["total"] if r["total"] > 0 else 0.0,
                           cpu_per_wall=r["cpu"] / r["total"] if r["total"] > 0 else 0.0))
    return shares


def wait_for_quiet(limit_s, load):
    t0 = time.time()
    while os.getloadavg()[0] > load and time.time() - t0 < limit_s:
        time.sleep(5)
    return os.getloadavg()


def pingpong(args, rate=None):
    if not os.path.exists(args.driver):
        log(f"no {args.driver}: the link is not measured")
        return None
    cmd = [os.path.join(ROOT, "scripts", "ring_netns.sh"), "--timeout", "300"]
    if rate:
        cmd += ["--rate", rate]
    cmd += ["--", args.driver, "pingpong", "--reps", "7"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env(), stdin=subprocess.DEVNULL)
    if run.returncode != 0:
        log(f"pingpong failed: {run.stderr.strip()}")
        return None
    return json.loads(run.stdout)


def fmt_pct(x):
    return f"{100 * x:.0f}%" if x >= 0.005 else "0%"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--len", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-rounds", type=int, default=3)
    ap.add_argument("--max-rounds", type=int, default=7)
    ap.add_argument("--spread", type=float, default=0.03)
    ap.add_argument("--no-net", action="store_true", help="skip the veth runs")
    ap.add_argument("--no-crossover", action="store_true", help="skip the capped-link check")
    ap.add_argument("--crossover-rate", default="200mbit", help="the cap for it (tc tbf rate)")
    ap.add_argument("--quiet-load", type=float, default=0.5,
                    help="wait (up to --quiet-wait s) for the 1-min load to fall below this")
    ap.add_argument("--quiet-wait", type=float, default=120)
    ap.add_argument("--out", default=os.path.join(HERE, "results", cpu_slug()),
                    help="where the results go (default: bench/results/<this CPU>)")
    args = ap.parse_args()
    args.ring_bench = os.path.join(args.build, "bench", "ring_bench")
    args.driver = os.path.join(args.build, "tests", "ring", "ring_driver")  # for the ping-pong
    if not os.path.exists(args.ring_bench):
        sys.exit(f"no {args.ring_bench}: build with MPI found (attn_ring)")
    net = not args.no_net and os.geteuid() == 0
    if not args.no_net and not net:
        log("not root: skipping the veth runs (ip netns needs root)")

    load0 = wait_for_quiet(args.quiet_wait, args.quiet_load)
    log(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at the start")
    kinds = ["attn_sdpa", "1 rank", "2 ranks"] + (["2 ranks, veth"] if net else [])
    configs = [(k, c) for c in (False, True) for k in kinds]
    runs = {cfg: [] for cfg in configs}
    loads = []
    rounds = 0
    while True:
        rounds += 1
        loads.append(os.getloadavg()[0])
        order = configs[rounds % len(configs):] + configs[:rounds % len(configs)]
        for cfg in order:
            runs[cfg].append(launch(args, cfg[0], cfg[1]))
        spreads = {cfg: (max(r["median"] for r in rs) - min(r["median"] for r in rs))
                   / statistics.median(r["median"] for r in rs) for cfg, rs in runs.items()}
        worst = max(spreads.values())
        log(f"round {rounds}: load {loads[-1]:.2f}, largest spread {100 * worst:.1f}%")
        if rounds >= args.min_rounds and (worst <= args.spread or rounds >= args.max_rounds):
            break

    results = []
    for (kind, causal), rs in runs.items():
        med = statistics.median(r["median"] for r in rs)
        rep = min(rs, key=lambda r: abs(r["median"] - med))  # the round nearest the median
        results.append(dict(config=kind, causal=causal, ranks=rep["ranks"], median_s=med,
                            round_medians_s=[r["median"] for r in rs],
                            spread=spreads[(kind, causal)], gflops=rep["flops"] / med / 1e9,
                            flops=rep["flops"], per_rank=rep["per_rank"],
                            wait_share=step_shares(rep),
                            veth_bytes=[rep.get("veth_sent_bytes"), rep.get("veth_received_bytes")]))
    by = {(r["config"], r["causal"]): r for r in results}
    for r in results:
        r["efficiency"] = r["efficiency_vs_attn_sdpa"] = r["efficiency_rounds"] = None
        if r["ranks"] > 1:
            one, sdpa = by[("1 rank", r["causal"])], by[("attn_sdpa", r["causal"])]
            r["efficiency"] = one["median_s"] / (r["ranks"] * r["median_s"])
            r["efficiency_vs_attn_sdpa"] = sdpa["median_s"] / (r["ranks"] * r["median_s"])
            # round by round: launches next to each other saw the same machine
            r["efficiency_rounds"] = [a / (r["ranks"] * b) for a, b in
                                      zip(one["round_medians_s"], r["round_medians_s"])]

    link = pingpong(args) if net else None
    crossover = None
    if net and not args.no_crossover:
        # one rank's compute rate: step 1 (the other's shard, nothing in flight)
        v = by[("2 ranks, veth", False)]["per_rank"][0]
        shard = args.len // 2
        rate_flops = 4.0 * shard * shard * args.dim * args.heads / v["step_compute"][1]
        crossover = run_crossover(args, rate_flops)

    machine = dict(cpu=platform.processor() or platform.machine(), cpu_model=cpu_model(),
                   cores=os.cpu_count(), threads_per_rank=1,
                   mpi=subprocess.run(["mpirun", "--version"], capture_output=True,
                                      text=True).stdout.splitlines()[0],
                   date=time.strftime("%Y-%m-%d %H:%M"))
    doc = dict(machine=machine, shape=dict(B=1, H=args.heads, L=args.len, S=args.len, E=args.dim),
               rounds=rounds, reps_per_launch=args.reps, load_before_rounds=loads,
               load_at_start=list(load0), results=results, link=link, crossover=crossover)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ring.json"), "w") as f:
        json.dump(doc, f, indent=1)
    table = render(doc)
    with open(os.path.join(args.out, "ring.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    log(f"wrote {args.out}/ring.json, ring.md")


def run_crossover(args, rate_flops):
    """The model's check on a slow link: the veth capped (tc tbf), 2 ranks,
    non-causal. Step 0 computes on the own shard while the other shard
    travels; the model says it waits max(0, bytes / BW - compute), so that
    the shortest shard that hides its transfer is L* = R b / (2 BW) (R: one
    rank's compute rate, from the uncapped 2-rank runs; BW: the capped link
    one way, measured here). Shard lengths from L*/2 to 2 L*."""
    rate = args.crossover_rate
    link = pingpong(args, rate)
    if link is None:
        return None
    # One way: plain TCP carries the cap each way at once, but an MPI
    # Sendrecv ping-pong over TCP sometimes gets half of it each way, while
    # the ring's transfers came out near the cap (both figures recorded).
    bw = 1e9 / 8 * statistics.median(x["one_way_gbit_s"] for x in link["results"]
                                     if x["bytes"] >= (16 << 20))
    lstar = rate_flops * BYTES / (2 * bw)
    points = []
    for f in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0):
        shard = max(64, int(round(f * lstar / 64)) * 64)
        res = launch(args, "2 ranks, veth", False, length=2 * shard, reps=3, rate=rate)
        kv_bytes = 2 * shard * args.dim * args.heads * BYTES
        comp = [r["step_compute"][0] for r in res["per_rank"]]
        wait = [r["step_wait"][0] for r in res["per_rank"]]
        points.append(dict(shard=shard, L=2 * shard, kv_bytes=kv_bytes,
                           transfer_model_s=kv_bytes / bw,
                           wait_model_s=[max(0.0, kv_bytes / bw - c) for c in comp],
                           step0_compute_s=comp, step0_wait_s=wait, median_s=res["median"]))
        log(f"crossover shard {shard}: step 0 compute "
            f"{1e3 * statistics.mean(comp):.1f} ms, transfer {1e3 * kv_bytes / bw:.1f} ms (model),"
            f" wait {', '.join(f'{1e3 * w:.1f}' for w in wait)} ms")
    return dict(rate=rate, link_bytes_per_s=bw, compute_flops_per_s=rate_flops,
                lstar_model=lstar, link=link, points=points)


def render(doc):
    m, s = doc["machine"], doc["shape"]
    loads = doc["load_before_rounds"]
    lines = [f"attn_ring on {m['cpu_model']} ({m['cores']} cores), {m['mpi']}, one thread per "
             f"rank, {m['date']}. B = {s['B']}, H = {s['H']}, L = S = {s['L']}, E = {s['E']}, "
             f"float32. Median over {doc['rounds']} alternating rounds of each launch's median of "
             f"{doc['reps_per_launch']} calls (after a warm-up); spread = (max - min) / median "
             f"over rounds. 1-min load average before the rounds: "
             f"{', '.join(f'{x:.2f}' for x in loads)}.", "",
             "| case | ranks | time s | spread | GFLOP/s | efficiency T1/(2·T2) | "
             "per round, min–max | T1 = attn_sdpa | wait share per step, rank 0 / rank 1 "
             "| CPU/wall |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in doc["results"]:
        name = r["config"] + (", causal (zigzag)" if r["causal"] else "")
        eff = rng = vs = ""
        if r["efficiency"] is not None:
            eff = f"**{100 * r['efficiency']:.0f}%**"
            rng = (f"{100 * min(r['efficiency_rounds']):.0f}–"
                   f"{100 * max(r['efficiency_rounds']):.0f}%")
            vs = f"{100 * r['efficiency_vs_attn_sdpa']:.0f}%"
        waits = " / ".join("[" + ", ".join(fmt_pct(x) for x in w["steps"]) + "]"
                           for w in r["wait_share"]) if r["ranks"] > 1 else ""
        cpu = min(w["cpu_per_wall"] for w in r["wait_share"])
        lines.append(f"| {name} | {r['ranks']} | {r['median_s']:.3f} | {100 * r['spread']:.1f}% | "
                     f"{r['gflops']:.1f} | {eff} | {rng} | {vs} | {waits} | {cpu:.2f} |")
    if doc.get("link"):
        res = {x["bytes"]: x for x in doc["link"]["results"]}
        big = res[max(res)]
        lines += ["", f"veth (two namespaces, TCP): latency {res[8]['latency_us']:.1f} µs one way "
                  f"(half the 8-byte round trip); {big['one_way_gbit_s']:.1f} Gbit/s one way, "
                  f"{big['both_ways_gbit_s_each']:.1f} Gbit/s each way when both send "
                  f"({max(res) >> 20} MiB messages)."]
    c = doc.get("crossover")
    if c:
        lines += ["", f"The model on a slow link: the veth capped at {c['rate']} (tc tbf; measured "
                  f"{c['link_bytes_per_s'] * 8 / 1e6:.0f} Mbit/s one way), 2 ranks, non-causal, "
                  f"H = {s['H']}, E = {s['E']}. One rank computes "
                  f"{c['compute_flops_per_s'] / 1e9:.1f} GFLOP/s (uncapped 2-rank run), so the "
                  f"model's shortest shard that hides its transfer is L* = R·b / (2·BW) = "
                  f"{c['lstar_model']:.0f}. Step 0 computes on the own shard while the other "
                  f"travels:", "",
                  "| shard | shard / L* | K/V bytes | step-0 compute ms | transfer ms (model) | "
                  "wait ms, model | wait ms, measured (rank 0 / 1) |",
                  "|---:|---:|---:|---:|---:|---:|---|"]
        for p in c["points"]:
            lines.append(f"| {p['shard']} | {p['shard'] / c['lstar_model']:.2f} | {p['kv_bytes']} | "
                         f"{1e3 * statistics.mean(p['step0_compute_s']):.1f} | "
                         f"{1e3 * p['transfer_model_s']:.1f} | "
                         f"{1e3 * statistics.mean(p['wait_model_s']):.1f} | "
                         + " / ".join(f"{1e3 * w:.1f}" for w in p["step0_wait_s"]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
