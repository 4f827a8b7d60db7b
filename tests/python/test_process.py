"""The package inside a real process (issue 9): Ctrl-C during a long call,
fork() after parallel calls, and an address-space limit under the BLAS.
Each runs in a child interpreter, since each changes process-wide state."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

# A child that starts a call of many seconds, prints "started", and reports
# how it ended and how long after the signal; then checks the package still
# gives the same bits as a fresh call.
LONG_CALL = textwrap.dedent("""
    import signal, sys, time, numpy as np, attn
    # A parent that ran us in the background (a CI runner, nohup, `cmd &`)
    # leaves SIGINT ignored, and Python then keeps it so: restore the
    # interactive default this test is about.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    kind = sys.argv[1]
    rng = np.random.default_rng(0)
    small = rng.standard_normal((1, 2, 32, 16)).astype(np.float32)
    before = attn.scaled_dot_product_attention(small, small, small)
    if kind == "sdpa":   # ~1.1 TFLOP: many seconds on 2 cores
        q = rng.standard_normal((1, 16, 16384, 64)).astype(np.float32)
        call = lambda: attn.scaled_dot_product_attention(q, q, q)
    else:                # the projections and the attention of a large module
        m = attn.MultiheadAttention(1024, 16)
        x = rng.standard_normal((4096, 4, 1024)).astype(np.float32)
        call = lambda: m(x, x, x, need_weights=False)
    print("started", flush=True)
    t0 = time.monotonic()
    try:
        call()
        print("finished", time.monotonic() - t0, flush=True)
    except KeyboardInterrupt:
        print("interrupted", time.monotonic() - t0, flush=True)
    after = attn.scaled_dot_product_attention(small, small, small)
    print("usable", bool(np.array_equal(before, after)), flush=True)
""")


def _interrupt(kind, delay=0.5):
    child = subprocess.Popen([sys.executable, "-c", LONG_CALL, kind], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "started", child.stderr.read()
    time.sleep(delay)  # well inside the call
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    ended = child.stdout.readline().split()
    latency = time.monotonic() - sent
    usable = child.stdout.readline().split()
    child.wait(timeout=60)
    return ended, latency, usable, child


@pytest.mark.parametrize("kind", ["sdpa", "mha"])
def test_ctrl_c_stops_a_long_call(kind):
    """A 20-second call ignored SIGINT until it ended. Now KeyboardInterrupt
    comes within about half a second, and the package still works."""
    ended, latency, usable, child = _interrupt(kind)
    assert ended and ended[0] == "interrupted", (ended, child.stderr.read())
    print(f"{kind}: KeyboardInterrupt {latency * 1e3:.0f} ms after SIGINT")
    assert latency < 0.5, f"{kind}: {latency:.3f} s from SIGINT to KeyboardInterrupt"
    assert usable == ["usable", "True"]


def test_ctrl_c_leaves_a_users_handler_in_charge():
    """With the user's own SIGINT handler, the call is not cut short: the
    handler runs (when Python next checks signals) and the result is whole."""
    code = textwrap.dedent("""
        import signal, time, numpy as np, attn
        seen = []
        signal.signal(signal.SIGINT, lambda *a: seen.append(1))
        # about 1.2 s on Zen 5 (0.3 s at 8,192 rows: the signal could come
        # after the call, as the interpreter exits with SIGINT's default)
        q = np.random.default_rng(0).standard_normal((1, 8, 16384, 64)).astype(np.float32)
        print("started", flush=True)
        out = attn.scaled_dot_product_attention(q, q, q)
        print("finished", out.shape, bool(np.isfinite(out).all()), seen, flush=True)
        print(signal.getsignal(signal.SIGINT) is not signal.default_int_handler)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "started"
    time.sleep(0.3)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert "finished (1, 8, 16384, 64) True [1]" in out, out + err
    assert out.splitlines()[-1] == "True"


def test_fork_after_a_parallel_call():
    """A child forked after a parallel call hung on its first parallel call
    (multiprocessing's fork start method). Now it gives the parent's bits."""
    code = textwrap.dedent("""
        import multiprocessing as mp, numpy as np, attn
        attn.set_num_threads(2)
        rng = np.random.default_rng(1)
        q = rng.standard_normal((2, 4, 300, 32)).astype(np.float32)
        m = attn.MultiheadAttention(64, 4, batch_first=True, seed=2)
        x = rng.standard_normal((2, 200, 64)).astype(np.float32)
        want = (attn.scaled_dot_product_attention(q, q, q), m(x, x, x)[0])

        def child(conn):
            conn.send((attn.scaled_dot_product_attention(q, q, q), m(x, x, x)[0]))

        ctx = mp.get_context("fork")
        a, b = ctx.Pipe()
        p = ctx.Process(target=child, args=(b,))
        p.start()
        got = a.recv() if a.poll(60) else None
        p.join(10)
        print(got is not None and all(np.array_equal(g, w) for g, w in zip(got, want)),
              p.exitcode)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["True", "0"], out.stdout + out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ulimit -v is Linux's")
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="ASan reserves terabytes of shadow memory: no address-space limit")
def test_address_space_limit_gives_memory_error():
    """MultiheadAttention(512, 8) on (64, 1024, 512) under ulimit -v 1300000
    spun forever inside OpenBLAS's buffer allocator. Now MemoryError, and
    quickly; a small call afterwards still works."""
    code = textwrap.dedent("""
        import resource, numpy as np, attn
        m = attn.MultiheadAttention(512, 8, batch_first=True)
        x = np.ones((64, 1024, 512), np.float32)
        resource.setrlimit(resource.RLIMIT_AS, (1300000 * 1024, 1300000 * 1024))
        try:
            m(x, x, x, need_weights=False)
            print("result")
        except MemoryError as e:
            print("MemoryError", str(e)[:60])
    """)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.startswith("MemoryError") or out.stdout.startswith("result"), \
        out.stdout + out.stderr
    assert time.monotonic() - t0 < 30
