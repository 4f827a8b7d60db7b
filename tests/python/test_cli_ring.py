"""`mpirun -np N attn sdpa --ring`: ring attention over MPI on .npy files.

Each case runs the ring on 1 to 4 ranks (oversubscribed on a small machine)
and the single-process `attn sdpa` on the same files, and compares the
outputs and log-sum-exps within float32 (or float64) rounding scaled by the
values' magnitude; a fixed N gives the same bytes run after run. Hostile
cases: a file missing from one rank's folder, files that differ between
ranks, an output folder that cannot be written, a disk that fills while the
ranks write, a rank killed mid-ring: each fails on every rank with a message
naming the option, file and rank, and leaves an existing target as it was
with no temporary beside it.

The tool is build/tools/attn (make build), or ATTN_CLI; the tests skip when
mpirun or a ring build (`attn info`: "ring (sdpa --ring): yes") is absent.
"""

import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CLI = os.environ.get("ATTN_CLI", os.path.join(ROOT, "build", "tools", "attn"))
MPIRUN = shutil.which("mpirun")

pytestmark = pytest.mark.skipif(
    not os.access(CLI, os.X_OK), reason=f"the attn tool is not built at {CLI} (make build)")


def ring_built():
    if not os.access(CLI, os.X_OK):
        return False
    info = subprocess.run([CLI, "info"], capture_output=True, text=True, timeout=60).stdout
    return "ring (sdpa --ring): yes" in info


RING = ring_built()
needs_ring = pytest.mark.skipif(not RING, reason="attn was built without MPI (no attn_ring)")
needs_mpirun = pytest.mark.skipif(not RING or MPIRUN is None,
                                  reason="needs mpirun and an attn built with MPI")

# Open MPI refuses root without these; --oversubscribe runs 3-4 ranks on 2
# cores.
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1")


def mpirun(n, *args, timeout=120):
    cmd = [MPIRUN, "--oversubscribe", "-np", str(n), CLI, "sdpa", "--ring", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def mpirun_per_rank(folders, *args, timeout=120):
    """One rank in each folder (relative input paths resolve there): what
    ranks on machines that do not share every file see."""
    cmd = [MPIRUN, "--oversubscribe"]
    for i, d in enumerate(folders):
        cmd += ([":"] if i else []) + ["-np", "1", "-wdir", str(d), CLI, "sdpa", "--ring",
                                        *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def single(*args):
    """The single-process `attn sdpa` (which has no --layout)."""
    args = list(args)
    if "--layout" in args:
        del args[args.index("--layout"):args.index("--layout") + 2]
    r = subprocess.run([CLI, "sdpa", *map(str, args)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def save(path, a):
    np.save(path, a)
    return path


# name: (q shape, k shape, v shape, options, dtype). Sequence lengths are
# uneven over 3 and 4 ranks, and L != S in several.
CASES = {
    "plain": ((2, 3, 40, 16), (2, 3, 40, 16), (2, 3, 40, 8), [], np.float32),
    "causal_zigzag": ((1, 4, 45, 16), (1, 4, 45, 16), (1, 4, 45, 16), ["--causal"], np.float32),
    "causal_bottom_right": ((2, 2, 19, 8), (2, 2, 33, 8), (2, 2, 33, 8),
                            ["--causal=bottom-right"], np.float32),
    "contiguous_causal": ((2, 2, 37, 16), (2, 2, 29, 16), (2, 2, 29, 4),
                          ["--causal", "--layout", "contiguous"], np.float32),
    "gqa": ((1, 8, 30, 16), (1, 2, 30, 16), (1, 2, 30, 12), ["--gqa", "--causal"], np.float32),
    "dropout": ((2, 2, 33, 8), (2, 2, 27, 8), (2, 2, 27, 8),
                ["--dropout", "0.25", "--seed", "1234"], np.float32),
    "scale_rank3": ((3, 23, 8), (3, 41, 8), (3, 41, 5), ["--scale", "0.3"], np.float32),
    "rank2_float64": ((50, 8), (31, 8), (31, 6), ["--causal"], np.float64),
    "float16_causal": ((1, 2, 41, 16), (1, 2, 41, 16), (1, 2, 41, 8), ["--causal"], np.float16),
}

def make_inputs(tmp_path, case, seed=0):
    qs, ks, vs, opts, dtype = CASES[case]
    g = np.random.default_rng(seed)
    q = save(tmp_path / "q.npy", (g.standard_normal(qs) * 2).astype(dtype))
    k = save(tmp_path / "k.npy", g.standard_normal(ks).astype(dtype))
    v = save(tmp_path / "v.npy", (g.standard_normal(vs) * 3).astype(dtype))
    return q, k, v, opts, dtype


def check_close(got, want, magnitude, p=0.0):
    """Within 32 ulps of the compute type (float32, or float64 for float64
    files) at the values' magnitude (the output is a weighted mean of v's
    rows, scaled by 1/(1-p) under dropout), plus, for a 16-bit file, the
    two roundings to it: a float32 lse is held to float32's bound even
    beside float16 outputs."""
    assert got.dtype == want.dtype and got.shape == want.shape
    compute = np.float64 if got.dtype == np.float64 else np.float32
    stored = 2 * np.finfo(got.dtype).eps if np.finfo(got.dtype).bits == 16 else 0.0
    bound = (32 * np.finfo(compute).eps + stored) * magnitude / (1 - p)
    err = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
    if os.environ.get("ATTN_RING_REPORT"):
        print(f"error {err:.3g}, {100 * err / bound:.1f}% of the bound")
    assert err <= bound, f"max error {err:.3g} > bound {bound:.3g}"


@needs_mpirun
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_against_single_process(tmp_path, case, n):
    q, k, v, opts, dtype = make_inputs(tmp_path, case)
    single("-q", q, "-k", k, "-v", v, *opts, "-o", tmp_path / "ref.npy", "--lse",
           tmp_path / "ref_lse.npy")
    r = mpirun(n, "-q", q, "-k", k, "-v", v, *opts, "-o", tmp_path / "out.npy", "--lse",
               tmp_path / "lse.npy")
    assert r.returncode == 0, r.stderr
    assert f"{n} rank" in r.stdout and "-> " + str(tmp_path / "out.npy") in r.stdout
    assert r.stderr == ""
    p = float(opts[opts.index("--dropout") + 1]) if "--dropout" in opts else 0.0
    check_close(np.load(tmp_path / "out.npy"), np.load(tmp_path / "ref.npy"),
                np.abs(np.load(v)).max(), p)
    lse = np.load(tmp_path / "ref_lse.npy")
    check_close(np.load(tmp_path / "lse.npy"), lse, max(1.0, np.abs(lse).max()))
    assert sorted(os.listdir(tmp_path)) == ["k.npy", "lse.npy", "out.npy", "q.npy", "ref.npy",
                                            "ref_lse.npy", "v.npy"]  # no temporary left


@needs_mpirun
@pytest.mark.parametrize("n", [2, 3])
def test_same_bytes_run_to_run(tmp_path, n):
    q, k, v, opts, _ = make_inputs(tmp_path, "dropout", seed=5)
    outs = []
    for i in range(2):
        o, lse = tmp_path / f"o{i}.npy", tmp_path / f"l{i}.npy"
        r = mpirun(n, "-q", q, "-k", k, "-v", v, "--causal", *opts, "-o", o, "--lse", lse)
        assert r.returncode == 0, r.stderr
        outs.append((o.read_bytes(), lse.read_bytes()))
    assert outs[0] == outs[1]


@needs_ring
def test_without_mpirun_is_one_rank(tmp_path):
    """Open MPI's singleton start: `attn sdpa --ring` alone is -np 1."""
    q, k, v, opts, dtype = make_inputs(tmp_path, "causal_zigzag")
    single("-q", q, "-k", k, "-v", v, *opts, "-o", tmp_path / "ref.npy")
    r = subprocess.run([CLI, "sdpa", "--ring", "-q", q, "-k", k, "-v", v, *opts, "-o",
                        tmp_path / "out.npy"], capture_output=True, text=True, timeout=120,
                       env=ENV)
    assert r.returncode == 0 and "1 rank (zigzag)" in r.stdout, r.stderr
    check_close(np.load(tmp_path / "out.npy"), np.load(tmp_path / "ref.npy"),
                np.abs(np.load(v)).max())


@needs_ring
def test_an_unwritable_stdout_replaces_no_output(tmp_path):
    """Rank 0 printed its summary after renaming the outputs: with stdout on
    /dev/full the run failed with the old file already replaced. The summary
    is flushed before the renames now, as in the other commands (a singleton
    run: under mpirun, rank 0's stdout is a pipe to mpirun)."""
    q, k, v, opts, _ = make_inputs(tmp_path, "plain")
    target = old_target(tmp_path)
    with open("/dev/full", "w") as full:
        r = subprocess.run(list(map(str, [CLI, "sdpa", "--ring", "-q", q, "-k", k, "-v", v,
                                          *opts, "-o", target])),
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, env=ENV)
    assert r.returncode == 1 and "cannot write to standard output" in r.stderr, r.stderr
    assert_untouched(target)


def test_without_ring_no_mpi(tmp_path):
    """Without --ring the tool never starts MPI (an MPI set up to fail at
    its start does not matter); an attn without MPI says so for --ring."""
    q, k, v, _, _ = make_inputs(tmp_path, "plain")
    env = dict(os.environ, OMPI_MCA_pml="no-such-component")
    r = subprocess.run([CLI, "sdpa", "-q", q, "-k", k, "-v", v, "-o", tmp_path / "o.npy"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([CLI, "sdpa", "--ring", "-q", q, "-k", k, "-v", v, "-o",
                        tmp_path / "o.npy"], capture_output=True, text=True, timeout=120,
                       env=ENV)
    if RING:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 2 and "built without MPI" in r.stderr, r.stderr


def test_ring_options_without_ring(tmp_path):
    q, k, v, _, _ = make_inputs(tmp_path, "plain")
    for extra, needle in ((["--layout", "zigzag"], "--layout needs --ring"),
                          (["--ring-timeout", "5"], "--ring-timeout needs --ring")):
        r = subprocess.run([CLI, "sdpa", "-q", q, "-k", k, "-v", v, "-o", tmp_path / "o.npy",
                            *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert not (tmp_path / "o.npy").exists()


@needs_mpirun
@pytest.mark.parametrize("extra,needle", [
    (["--mask", "q.npy"], "--mask is not available with --ring"),
    (["--weights", "w.npy"], "--weights is not available with --ring"),
    (["--layout", "diagonal"], "--layout: 'diagonal' is not zigzag or contiguous"),
    (["--ring-timeout", "0"], "--ring-timeout: '0' is not a positive number"),
    (["--frobnicate"], "unknown option '--frobnicate'"),
])
def test_usage_errors_print_once(tmp_path, extra, needle):
    q, k, v, _, _ = make_inputs(tmp_path, "plain")
    r = mpirun(3, "-q", q, "-k", k, "-v", v, "-o", tmp_path / "o.npy", *extra)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count(needle) == 1, r.stderr  # once, not once per rank
    assert "[rank" not in r.stderr  # every rank said it: no rank named


@needs_mpirun
def test_help():
    r = subprocess.run([MPIRUN, "-np", "2", CLI, "sdpa", "--ring", "--help"],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 0 and r.stdout.count("usage: attn sdpa") == 1, r.stderr
    assert "--ring-timeout SECONDS" in r.stdout and "--layout L" in r.stdout


def old_target(folder):
    """An existing output that a failed run must leave as it was."""
    target = folder / "out.npy"
    target.write_bytes(b"the previous result")
    return target


def assert_untouched(target):
    assert target.read_bytes() == b"the previous result"
    temps = [f for f in os.listdir(target.parent) if f.endswith(".tmp")]
    assert temps == [], temps


def rank_folders(tmp_path, n):
    folders = [tmp_path / f"rank{i}" for i in range(n)]
    for d in folders:
        d.mkdir()
    return folders


@needs_mpirun
def test_file_missing_on_one_rank(tmp_path):
    d = rank_folders(tmp_path, 2)
    make_inputs(d[0], "plain")
    make_inputs(d[1], "plain")
    os.remove(d[1] / "v.npy")
    target = old_target(tmp_path)
    r = mpirun_per_rank(d, "-q", "q.npy", "-k", "k.npy", "-v", "v.npy", "-o", target)
    assert r.returncode == 1, r.stderr
    assert "[rank 1] attn: reading -v: cannot open 'v.npy': No such file" in r.stderr, r.stderr
    assert "[rank 0]" not in r.stderr
    assert_untouched(target)


@needs_mpirun
def test_files_differ_between_ranks(tmp_path):
    """Rank 2 reads a -k of one more key: found from the headers, before any
    read of the data or any compute."""
    d = rank_folders(tmp_path, 3)
    for folder in d:
        make_inputs(folder, "plain")
    np.save(d[2] / "k.npy", np.zeros((2, 3, 41, 16), np.float32))
    target = old_target(tmp_path)
    r = mpirun_per_rank(d, "-q", "q.npy", "-k", "k.npy", "-v", "v.npy", "-o", target)
    assert r.returncode == 1, r.stderr
    assert ("[rank 2] attn: reading -k: 'k.npy' holds float32 (2, 3, 41, 16) on this rank but "
            "float32 (2, 3, 40, 16) on rank 0") in r.stderr, r.stderr
    assert_untouched(target)


@needs_mpirun
def test_output_folder_differs_between_ranks(tmp_path):
    """A relative -o names another folder on rank 1 (no shared file system):
    rank 1 cannot open rank 0's temporary, and nothing is written anywhere."""
    d = rank_folders(tmp_path, 2)
    for folder in d:
        make_inputs(folder, "plain")
    targets = [old_target(folder) for folder in d]
    r = mpirun_per_rank(d, "-q", "q.npy", "-k", "k.npy", "-v", "v.npy", "-o", "out.npy")
    assert r.returncode == 1, r.stderr
    assert "[rank 1] attn: writing -o 'out.npy': cannot open the temporary file" in r.stderr
    assert "(every rank must see the same folder)" in r.stderr, r.stderr
    for target in targets:
        assert_untouched(target)


@needs_mpirun
@pytest.mark.parametrize("content,needle", [
    ("fortran", "x.npy' is in Fortran order"),
    ("big_endian", "x.npy' is big-endian"),
    ("bool", "x.npy' holds bool"),
    ("vector", "x.npy' holds fewer than 2 dimensions"),
    ("truncated", ".npy data is"),
])
def test_unreadable_input(tmp_path, content, needle):
    q, k, v, _, _ = make_inputs(tmp_path, "plain")
    x = tmp_path / "x.npy"
    a = np.load(q)
    if content == "fortran":
        np.save(x, np.asfortranarray(a))
    elif content == "big_endian":
        np.save(x, a.astype(">f4"))
    elif content == "bool":
        np.save(x, a > 0)
    elif content == "vector":
        np.save(x, a.ravel())
    else:
        x.write_bytes(q.read_bytes()[:-4])
    target = old_target(tmp_path)
    r = mpirun(2, "-q", q, "-k", x, "-v", v, "-o", target)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("attn: reading -k: ") == 1 and needle in r.stderr, r.stderr
    assert_untouched(target)


@needs_mpirun
def test_too_many_ranks(tmp_path):
    q = save(tmp_path / "q.npy", np.ones((1, 7, 4), np.float32))
    r = mpirun(4, "-q", q, "-k", q, "-v", q, "-o", tmp_path / "o.npy")
    assert r.returncode == 1
    assert "attn: -q: 7 queries cannot be split over 4 ranks" in r.stderr, r.stderr
    r = mpirun(4, "-q", q, "-k", q, "-v", q, "-o", tmp_path / "o.npy", "--layout", "contiguous")
    assert r.returncode == 0, r.stderr  # 7 >= 4: one run each


@needs_mpirun
def test_device_target_refused(tmp_path):
    q, k, v, _, _ = make_inputs(tmp_path, "plain")
    r = mpirun(2, "-q", q, "-k", k, "-v", v, "-o", "/dev/null")
    assert r.returncode == 1 and "'/dev/null': --ring writes its output by offset" in r.stderr


def mount_tmpfs(folder, size):
    """A small file system of our own: only root may mount one."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True)
    return r.returncode == 0


@needs_mpirun
def test_output_folder_not_writable(tmp_path):
    q, k, v, _, _ = make_inputs(tmp_path, "plain")
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = mount_tmpfs(folder, "1m")
    try:
        target = old_target(folder)
        if mounted:  # root ignores permission bits: a read-only file system
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
            reason = "Read-only file system"
        else:
            folder.chmod(0o555)
            reason = "Permission denied"
        r = mpirun(3, "-q", q, "-k", k, "-v", v, "-o", target)
        assert r.returncode == 1, r.stderr
        assert ("attn: writing -o '%s': cannot create a temporary file beside it: %s"
                % (target, reason)) in r.stderr, r.stderr
        assert_untouched(target)
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)])
        else:
            folder.chmod(0o755)


@needs_mpirun
def test_disk_full_while_ranks_write(tmp_path):
    """Rank 0 frames the file (a header and a hole of the full size); the
    ranks' writes then fill a 64 KiB file system: the run fails, the
    temporary is removed, the old target stays."""
    g = np.random.default_rng(1)
    q = save(tmp_path / "q.npy", g.standard_normal((1, 2, 256, 64)).astype(np.float32))
    folder = tmp_path / "small"
    folder.mkdir()
    if not mount_tmpfs(folder, "64k"):
        pytest.skip("cannot mount a small tmpfs (needs root)")
    try:
        target = old_target(folder)
        r = mpirun(2, "-q", q, "-k", q, "-v", q, "-o", target)  # out: 128 KiB
        assert r.returncode == 1, r.stderr
        assert "attn: writing -o '%s': No space left on device" % target in r.stderr, r.stderr
        assert_untouched(target)
    finally:
        subprocess.run(["umount", str(folder)])


def children(pid):
    """The processes whose parent is pid, with their environments."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    found[int(entry)] = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
    return found


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_rank_mid_ring(tmp_path, sig, *extra):
    """Runs 2 ranks on a problem of seconds, sends rank 1 `sig` once it is
    computing; returns (exit code, stderr, seconds from the signal).
    The problem keeps each rank computing for seconds on the fastest CPU
    seen (Zen 5: ~3 s; at (1, 8, 8192, 64) the job ended in 0.4 s, before
    rank 1 had used the 0.5 s of CPU that marks it as computing)."""
    g = np.random.default_rng(2)
    q = save(tmp_path / "q.npy", g.standard_normal((1, 16, 16384, 64)).astype(np.float32))
    target = old_target(tmp_path)
    cmd = [MPIRUN, "-np", "2", CLI, "sdpa", "--ring", "-q", q, "-k", q, "-v", q, "-o", target,
           "--threads", "1", *extra]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=ENV)
    victim = None
    try:
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline and job.poll() is None:
            for pid, env in children(job.pid).items():
                # Computing: the inputs take milliseconds, the ring seconds.
                if b"OMPI_COMM_WORLD_RANK=1" in env and cpu_seconds(pid) > 0.5:
                    victim = pid
            time.sleep(0.05)
        assert victim is not None, "rank 1 never started computing"
        os.kill(victim, sig)
        start = time.monotonic()
        _, err = job.communicate(timeout=90)
        return job.returncode, err, time.monotonic() - start
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        if victim is not None and sig == signal.SIGSTOP:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass


@needs_mpirun
def test_rank_killed_mid_ring(tmp_path):
    """A rank that dies while the ring computes ends the job (mpirun sees
    it): the other rank does not hang, nothing is written."""
    rc, err, _ = stop_rank_mid_ring(tmp_path, signal.SIGKILL)
    assert rc != 0, err
    assert_untouched(tmp_path / "out.npy")


@needs_mpirun
def test_rank_hung_mid_ring(tmp_path):
    """A rank that stops answering (SIGSTOP) is given up after --ring-timeout:
    rank 0 says what it waited for and ends the job with MPI_Abort."""
    rc, err, seconds = stop_rank_mid_ring(tmp_path, signal.SIGSTOP, "--ring-timeout", "3")
    assert rc != 0 and seconds < 30, err
    assert "[rank 0] attn: sdpa --ring: attn_ring: " in err and "within 3 s" in err, err
    assert_untouched(tmp_path / "out.npy")
