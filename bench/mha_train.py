"""MHA training costs: attn_mha_forward vs attn_mha_forward_train (what the
saved context costs), attn_mha_backward, the saved context's size, and the
per-call overhead of attn.nn.MultiheadAttention (parameter copies, autograd)
over the raw calls. Best of --repeat alternating calls (the backward: one
call), float32, the threads attn uses.

    python3 bench/mha_train.py [--repeat 9] [--only bert|seed]
"""
import argparse
import time

import numpy as np

import attn
from attn import _attn

SHAPES = {  # name: (N, L, E, heads), self-attention, sequence-first
    "seed": (32, 128, 200, 5),
    "bert": (8, 512, 768, 12),
}


def best(fns, repeat):
    """Best time (ms) of each function, calls alternating: a load change on a
    shared machine hits both sides alike."""
    for fn in fns:
        fn()  # warm up
    times = [[] for _ in fns]
    for _ in range(repeat):
        for t, fn in zip(times, fns):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [min(t) * 1e3 for t in times]


def saved_bytes(N, L, E, H):
    # Q, K, V, O (N, L, D) each in float32, lse (N, H, L) in float64; no masks here.
    return 4 * 4 * N * L * E + 8 * N * H * L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--only")
    a = ap.parse_args()
    print(f"attn {attn.__version__}, {attn.get_num_threads()} threads, {_attn.blas_info()}")
    for name, (N, L, E, H) in SHAPES.items():
        if a.only and a.only != name:
            continue
        m, g = _attn.MHA(E, H), _attn.MHA(E, H)
        x = np.random.default_rng(0).standard_normal((L, N, E)).astype(np.float32)
        dout = np.ones_like(x)
        kw = dict(empty=np.empty, need_weights=False)
        fwd, train = best([lambda: m.forward(x, x, x, **kw),
                           lambda: m.forward_train(x, x, x, **kw)], a.repeat)
        _, _, saved = m.forward_train(x, x, x, **kw)
        (bwd,) = best([lambda: m.backward(saved, x, x, x, dout, empty=np.empty, grads=g)], 1)
        line = (f"{name} (N={N}, L={L}, E={E}, {H} heads): forward {fwd:.1f} ms, "
                f"forward_train {train:.1f} ms ({100 * (train / fwd - 1):+.0f}%), backward "
                f"{bwd:.0f} ms, saved {saved_bytes(N, L, E, H) / 2**20:.1f} MiB "
                f"(input {x.nbytes / 2**20:.1f} MiB)")
        try:
            import torch
            import attn.nn as attn_nn
        except ImportError:
            print(line, flush=True)
            continue
        mod = attn_nn.MultiheadAttention(E, H)
        xt = torch.from_numpy(x)
        params = [p for _, p in mod.named_parameters()]
        cm = attn_nn._cmodules(mod)

        def nn_forward():
            with torch.no_grad():
                mod(xt, xt, xt, need_weights=False)

        def nn_train_forward():  # records the graph, keeps the saved context
            mod(xt.requires_grad_(), xt, xt, need_weights=False)
            xt.requires_grad_(False)

        raw, nn_fwd, nn_train = best([lambda: m.forward(x, x, x, **kw), nn_forward,
                                      nn_train_forward], a.repeat)
        (copy,) = best([lambda: cm.get(cm.key, params)], a.repeat)
        line += (f"; attn.nn forward {nn_fwd:.1f} ms (no grad) / {nn_train:.1f} ms (grad) vs "
                 f"raw {raw:.1f} ms; parameter copy {copy:.2f} ms")
        print(line, flush=True)


if __name__ == "__main__":
    main()
