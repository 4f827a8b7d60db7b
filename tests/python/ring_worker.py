"""One rank of tests/python/test_ring.py, run as
``mpirun -np N python3 ring_worker.py DIR``.

DIR/cases.json lists the cases; DIR/<name>.in.npz holds each case's whole
inputs (every rank reads them: the tensors are small). Each rank cuts its
shards, runs attn.distributed.ring_attention (and, for torch cases, the
backward), and rank 0 writes the gathered whole results to DIR/<name>.N.npz.
A case that raises is recorded by every rank in DIR/<name>.N.err.<rank>.json
(and the run goes on: a refused call fails on every rank together).
"""

import json
import os
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import attn
import attn.distributed as ad

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


def cut(x, c, dim=-2):
    """This rank's shard: the layout's, or a custom contiguous cut."""
    if c.get("cuts") is None:
        return ad.shard(x, RANK, SIZE, dim=dim, layout=c["layout"])
    cuts = c["cuts"][str(SIZE)]
    lo = sum(cuts[:RANK])
    idx = [slice(None)] * x.ndim
    idx[dim] = slice(lo, lo + cuts[RANK])
    return x[tuple(idx)]


def whole(x, c, dim=-2):
    """Every rank's shard joined (on rank 0)."""
    if c.get("cuts") is None:
        return ad.gather(x, COMM, dim=dim, layout=c["layout"], root=0)
    import torch

    a = x.detach().numpy() if isinstance(x, torch.Tensor) else x
    parts = COMM.gather(a, root=0)
    return None if parts is None else np.concatenate(parts, axis=dim)


def options(c, kpm):
    return dict(
        key_padding_mask=kpm, is_causal=c["causal"], causal_alignment=c["alignment"],
        enable_gqa=c["gqa"], dropout_p=c["dropout_p"], seed=c["seed"],
        rng_offset=c["rng_offset"], scale=c["scale"], layout=c["layout"],
        timeout=c["timeout"], return_lse=True,
    )


def kpm_shard(inp, c):
    if "kpm" not in inp:
        return None
    return cut(inp["kpm"], c, dim=-1)


def run_numpy(c, inp):
    q, k, v = (cut(inp[n], c) for n in ("q", "k", "v"))
    if c.get("mismatch") == "E" and RANK == SIZE - 1:  # locally consistent, not globally
        q, k = q[..., :-1], k[..., :-1]
    if c.get("mismatch") == "local" and RANK == 0:  # q and k disagree on this rank only
        q = q[..., :-1]
    out, lse = ad.ring_attention(q, k, v, COMM, **options(c, kpm_shard(inp, c)))
    return {"out": whole(out, c), "lse": whole(lse[..., None], c)}


def run_torch(c, inp):
    import torch

    q, k, v = (torch.from_numpy(cut(inp[n], c)).requires_grad_() for n in ("q", "k", "v"))
    kpm = kpm_shard(inp, c)
    out, lse = ad.ring_attention(q, k, v, COMM,
                                 **options(c, None if kpm is None else torch.from_numpy(kpm)))
    assert isinstance(out, torch.Tensor) and out.requires_grad
    out.backward(torch.from_numpy(cut(inp["dout"], c)))
    res = {"out": whole(out.detach(), c), "lse": whole(lse[..., None], c)}
    for n, t in (("dq", q), ("dk", k), ("dv", v)):
        res[n] = whole(t.grad, c)
    return res


def checks():
    """The API's own checks, one line each: name -> what happened."""
    import torch

    x = np.arange(2 * 3 * 10 * 4, dtype=np.float32).reshape(2, 3, 10, 4)
    kpm = torch.zeros(2, 5, dtype=torch.bool, requires_grad=False)
    found = {}

    def attempt(name, f):
        try:
            f()
            found[name] = "ok"
        except Exception as e:
            found[name] = f"{type(e).__name__}: {e}"

    s = ad.shard(x, RANK, SIZE)
    attempt("layout", lambda: ad.ring_attention(s, s, s, COMM, layout="striped"))
    attempt("comm_type", lambda: ad.ring_attention(s, s, s, comm=42))
    attempt("comm_null", lambda: ad.ring_attention(s, s, s, MPI.COMM_NULL))
    attempt("timeout", lambda: ad.ring_attention(s, s, s, COMM, timeout=0))
    attempt("timeout_huge", lambda: ad.ring_attention(s, s, s, COMM, timeout=10**400))
    # ranks that disagree: the values as written (once the bits of 0.1, enum numbers)
    attempt("scale_differs", lambda: ad.ring_attention(s, s, s, COMM, scale=0.1 + 0.1 * RANK))
    d = s.astype(np.float64) if RANK == 1 else s
    attempt("dtype_differs", lambda: ad.ring_attention(d, d, d, COMM))
    attempt("lse_differs", lambda: ad.ring_attention(s, s, s, COMM, return_lse=RANK == 0))
    attempt("mask_ndim", lambda: ad.ring_attention(s, s, s, COMM,
                                                   key_padding_mask=np.zeros((1, 1, 5), bool)))
    grad_mask = torch.zeros(5, requires_grad=True)
    attempt("mask_grad", lambda: ad.ring_attention(torch.from_numpy(s), s, s, COMM,
                                                   key_padding_mask=grad_mask))
    attempt("mask_wrong_length", lambda: ad.ring_attention(s, s, s, COMM,
                                                           key_padding_mask=kpm[:, :4]))
    # seed=None: rank 0's seed everywhere; torch.manual_seed repeats it
    t = torch.from_numpy(s)
    outs = []
    for _ in range(2):
        torch.manual_seed(RANK)  # a different generator state on every rank
        outs.append(ad.ring_attention(t, t, t, COMM, dropout_p=0.5))
    found["seed_repeats"] = bool(torch.equal(outs[0], outs[1]))
    found["root_gather"] = repr(type(ad.gather(s, COMM, root=SIZE - 1)))
    found["whole_gather"] = bool(np.array_equal(ad.gather(s, COMM), x))
    # an mpi4py that runs another MPI library than attn's is refused
    real = MPI.Get_library_version
    MPI.Get_library_version = lambda: "MPICH Version: 4.1.2\nMPICH Release date: ..."
    ad._library_checked = False
    attempt("other_mpi", lambda: ad.ring_attention(s, s, s, COMM))
    MPI.Get_library_version = real
    return found


def hang(d):
    """The last rank never joins; the others give up after the timeout and
    end the job, as attn_ring.h says to."""
    x = np.ones((1, 1, 4 * SIZE, 8), dtype=np.float32)
    s = ad.shard(x, RANK, SIZE)
    if RANK == SIZE - 1:
        time.sleep(60)  # hung: Abort ends it sooner
        return
    t0 = time.monotonic()
    try:
        ad.ring_attention(s, s, s, COMM, timeout=2.0)
        found = {"type": None}
    except Exception as e:
        found = {"type": type(e).__name__, "msg": str(e),
                 "status_name": getattr(e, "status_name", None)}
    found["seconds"] = time.monotonic() - t0
    with open(os.path.join(d, f"hang.{RANK}.json"), "w") as f:
        json.dump(found, f)
    if RANK == 0:  # once every waiting rank has written (no collective: one rank is hung)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(d, f"hang.{r}.json")) for r in range(SIZE - 1)):
            time.sleep(0.05)
        COMM.Abort(3)
    time.sleep(60)


def main():
    d = sys.argv[1]
    if sys.argv[2:] == ["hang"]:
        return hang(d)
    if sys.argv[2:] == ["checks"]:
        found = checks()
        with open(os.path.join(d, f"checks.{RANK}.json"), "w") as f:
            json.dump(found, f)
        return
    attn.set_num_threads(1)  # the ranks share the machine's cores
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    cases = json.load(open(os.path.join(d, "cases.json")))
    for c in cases:
        if SIZE < c.get("min_ranks", 1):
            continue
        inp = dict(np.load(os.path.join(d, c["name"] + ".in.npz")))
        t0 = time.monotonic()
        try:
            res = run_torch(c, inp) if c["torch"] else run_numpy(c, inp)
        except Exception as e:  # recorded for the test, which expects it or not
            err = {"type": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0,
                   "status_name": getattr(e, "status_name", None),
                   "arg": getattr(e, "arg", None), "trace": traceback.format_exc()}
            with open(os.path.join(d, f"{c['name']}.{SIZE}.err.{RANK}.json"), "w") as f:
                json.dump(err, f)
            continue
        if RANK == 0:
            np.savez(os.path.join(d, f"{c['name']}.{SIZE}.npz"), **res)


if __name__ == "__main__":
    main()
