"""The serving options of the attn tool: `attn sdpa --window/--alibi-slopes/
--softcap/--sinks`, `attn varlen` and `attn kvcache`, round trips through
.npy files against the Python package (the same library) and the float64
formula of test_serving_api.py; index files in every layout NumPy writes;
usage and runtime errors. The tool is build/tools/attn (make test builds
it), or ATTN_CLI.
"""

import os
import subprocess

import numpy as np
import pytest

import attn
from test_serving_api import kvcache_reference, reference, varlen_reference

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CLI = os.environ.get("ATTN_CLI", os.path.join(ROOT, "build", "tools", "attn"))

pytestmark = pytest.mark.skipif(
    not os.access(CLI, os.X_OK), reason=f"the attn tool is not built at {CLI} (make build)")


def run(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


def ok(*args):
    r = run(*args)
    assert r.returncode == 0, r.stderr
    return r


def save(tmp_path, name, array):
    path = tmp_path / f"{name}.npy"
    np.save(path, array)
    return path


def close(ours, ref, tol=1e-12):
    np.testing.assert_allclose(ours, np.asarray(ref), rtol=tol, atol=tol)


# ---- attn sdpa's modifiers ----


def test_sdpa_modifier_options(tmp_path, rng):
    q, k, v = (rng.standard_normal(s) for s in ((3, 5, 8), (3, 7, 8), (3, 7, 4)))
    slopes, sinks = np.array([0.5, 0.25, 0.125]), np.array([0.3, -1.0, 2.0])
    files = {n: save(tmp_path, n, a) for n, a in
             dict(q=q, k=k, v=v, slopes=slopes, sinks=sinks).items()}
    out, lse = tmp_path / "out.npy", tmp_path / "lse.npy"
    r = ok("sdpa", "-q", files["q"], "-k", files["k"], "-v", files["v"], "-o", out, "--lse", lse,
           "--window", "2,1", "--softcap", "1.5", "--alibi-slopes", files["slopes"], "--sinks",
           files["sinks"], "--causal=bottom-right")
    assert "sdpa:" in r.stdout
    ref_out, ref_lse = reference(q, k, v, causal=True, window=(2, 1), alibi=slopes, softcap=1.5,
                                 sinks=sinks)
    close(np.load(out), ref_out)
    close(np.load(lse), ref_lse)


@pytest.mark.parametrize("option, value, match", [
    ("--window", "-2,0", "--window: '-2,0'"),
    ("--window", "3", "--window: '3'"),
    ("--window", "1,2,3", "--window"),
    ("--window", " 1,2", "--window"),
    ("--window", "1,x", "--window"),
    ("--softcap", "-1", "--softcap: '-1'"),
    ("--softcap", "inf", "--softcap"),
])
def test_sdpa_bad_modifier_values_are_usage_errors(tmp_path, option, value, match):
    q = save(tmp_path, "q", np.ones((2, 3, 4)))
    r = run("sdpa", "-q", q, "-k", q, "-v", q, "-o", tmp_path / "o.npy", option, value)
    assert r.returncode == 2 and match in r.stderr
    assert not (tmp_path / "o.npy").exists()


def test_sdpa_modifier_file_of_the_wrong_shape_names_it(tmp_path):
    q = save(tmp_path, "q", np.ones((2, 3, 4)))
    bad = save(tmp_path, "slopes", np.ones(5))
    r = run("sdpa", "-q", q, "-k", q, "-v", q, "-o", tmp_path / "o.npy", "--alibi-slopes", bad)
    assert r.returncode == 1 and "alibi_slopes" in r.stderr


# ---- attn varlen ----


def varlen_files(tmp_path, rng, index_dtype=np.int32):
    lens_q, lens_k = [3, 1, 5], [4, 6, 2]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(index_dtype)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(index_dtype)
    q = rng.standard_normal((10, 4, 8))
    k, v = rng.standard_normal((12, 2, 8)), rng.standard_normal((12, 2, 6))
    arrays = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k)
    return arrays, {n: save(tmp_path, n, a) for n, a in arrays.items()}


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64, ">i4", ">i8"])
def test_varlen_round_trip(tmp_path, rng, index_dtype):
    a, f = varlen_files(tmp_path, rng, index_dtype)
    out, lse = tmp_path / "out.npy", tmp_path / "lse.npy"
    r = ok("varlen", "-q", f["q"], "-k", f["k"], "-v", f["v"], "--cu-seqlens-q", f["cu_q"],
           "--cu-seqlens-k", f["cu_k"], "-o", out, "--lse", lse, "--causal", "--window", "3,0",
           "--softcap", "2.5")
    assert "varlen: 3 sequences" in r.stdout
    cu_q, cu_k = a["cu_q"].astype(np.int32), a["cu_k"].astype(np.int32)
    want_out, want_lse = attn.varlen_attention(a["q"], a["k"], a["v"], cu_q, cu_k, 5, 6,
                                               causal=True, window_size=(3, 0), softcap=2.5,
                                               return_softmax_lse=True)
    np.testing.assert_array_equal(np.load(out), want_out)  # one library: the same bits
    np.testing.assert_array_equal(np.load(lse), want_lse)
    ref_out, ref_lse = varlen_reference(a["q"], a["k"], a["v"], cu_q, cu_k, causal=True,
                                        window=(3, 0), softcap=2.5)
    close(np.load(out), ref_out)
    close(np.load(lse), ref_lse)


def test_varlen_fortran_order_index_file_and_modifier_files(tmp_path, rng):
    a, f = varlen_files(tmp_path, rng)
    np.save(f["cu_q"], np.asfortranarray(a["cu_q"]))  # 1-D: the same bytes either way
    slopes = rng.random((3, 4))
    sinks = rng.standard_normal(4)
    out = tmp_path / "out.npy"
    ok("varlen", "-q", f["q"], "-k", f["k"], "-v", f["v"], "--cu-seqlens-q", f["cu_q"],
       "--cu-seqlens-k", f["cu_k"], "-o", out, "--alibi-slopes", save(tmp_path, "s", slopes),
       "--sinks", save(tmp_path, "k2", sinks), "--max-seqlen-q", 9, "--max-seqlen-k", 9)
    ref_out, _ = varlen_reference(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], alibi=slopes,
                                  sinks=sinks)
    close(np.load(out), ref_out)


@pytest.mark.parametrize("header", [
    '{"descr": "<i4", "fortran_order": False, "shape": (4,), }',
    "{'descr'\t:\t'<i4', 'fortran_order': False, 'shape': (4,)}",
])
def test_varlen_index_file_headers_as_numpy_reads_them(tmp_path, rng, header):
    """Index files whose header spells "descr" in double quotes, or with tabs
    around its colon, are valid .npy files NumPy reads; the tool said they
    were not int32 arrays (hostile tester, 2026-11-28)."""
    a, f = varlen_files(tmp_path, rng)
    text = header.encode()
    text += b" " * ((64 - (10 + len(text) + 1) % 64) % 64) + b"\n"
    raw = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + a["cu_q"].tobytes()
    (tmp_path / "cu_raw.npy").write_bytes(raw)
    np.testing.assert_array_equal(np.load(tmp_path / "cu_raw.npy"), a["cu_q"])
    out, want = tmp_path / "out.npy", tmp_path / "want.npy"
    common = ("-q", f["q"], "-k", f["k"], "-v", f["v"], "--cu-seqlens-k", f["cu_k"])
    ok("varlen", *common, "--cu-seqlens-q", tmp_path / "cu_raw.npy", "-o", out)
    ok("varlen", *common, "--cu-seqlens-q", f["cu_q"], "-o", want)
    np.testing.assert_array_equal(np.load(out), np.load(want))


@pytest.mark.parametrize("descr, extra, match", [
    ("<i44", b"", "is not an int32 or int64 .npy array"),
    ("|i4", b"", "is not an int32 or int64 .npy array"),
    ("<i4", b"x", "cu_raw.npy': .npy data is"),
])
def test_varlen_broken_index_files_are_named_as_integers(tmp_path, rng, descr, extra, match):
    """An index file's broken descr or length: the message names the file
    and no float (the tool reads index files as the float of their width;
    it named '<f44' and '|f4', and no path; hostile tester, 2026-11-30)."""
    a, f = varlen_files(tmp_path, rng)
    text = ("{'descr': '%s', 'fortran_order': False, 'shape': (%d,), }"
            % (descr, a["cu_q"].size)).encode()
    text += b" " * ((64 - (10 + len(text) + 1) % 64) % 64) + b"\n"
    raw = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + a["cu_q"].tobytes()
    (tmp_path / "cu_raw.npy").write_bytes(raw + extra)
    r = run("varlen", "-q", f["q"], "-k", f["k"], "-v", f["v"], "--cu-seqlens-q",
            tmp_path / "cu_raw.npy", "--cu-seqlens-k", f["cu_k"], "-o", tmp_path / "o.npy")
    assert r.returncode == 1 and match in r.stderr and "f4" not in r.stderr, r.stderr
    assert not (tmp_path / "o.npy").exists()


@pytest.mark.parametrize("cu_q, code, match", [
    (np.array([0.0, 3, 10]), 1, "index files are int32"),
    (np.array([0, 3, 10], np.int16), 1, "index files are int32"),
    (np.array([0, 5, 3, 10], np.int32), 1, "cu_seqlens_q"),
    (np.array([0, 3, 4, 99], np.int32), 1, "cu_seqlens_q"),
    (np.array([0, 3, 2**40]), 1, "does not fit in int32"),
    # 0-d: the library's parser reads () as (1,), which was "0 sequences", exit 0
    (np.array(0, np.int32), 1, "holds a 0-d array"),
    (np.array(0, np.int64), 1, "holds a 0-d array"),
])
def test_varlen_bad_index_files(tmp_path, rng, cu_q, code, match):
    _, f = varlen_files(tmp_path, rng)
    r = run("varlen", "-q", f["q"], "-k", f["k"], "-v", f["v"], "--cu-seqlens-q",
            save(tmp_path, "bad", cu_q), "--cu-seqlens-k", f["cu_k"], "-o", tmp_path / "o.npy")
    assert r.returncode == code and match in r.stderr, r.stderr
    assert not (tmp_path / "o.npy").exists()


@pytest.mark.parametrize("args, match", [
    ([], "-o OUT.npy is required"),
    (["-o", "o.npy"], "-q, -k and -v are required"),
    (["-o", "o.npy", "-q", "q", "-k", "k", "-v", "v"], "--cu-seqlens-q and --cu-seqlens-k"),
    (["--k-cache", "x"], "unknown option '--k-cache'"),
    (["--dropout", "0.5", "-o", "o", "-q", "q", "-k", "k", "-v", "v", "--cu-seqlens-q", "a",
      "--cu-seqlens-k", "b"], "--dropout needs --seed"),
    (["--max-seqlen-q", "-3"], "--max-seqlen-q: '-3'"),
    (["--window"], "--window needs a value"),
])
def test_varlen_usage_errors(args, match):
    r = run("varlen", *args)
    assert r.returncode == 2 and match in r.stderr, r.stderr


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_varlen_lse_is_float32_or_float64(tmp_path, rng, dtype):
    """Hostile test: float16 queries with --lse built the lse in float16,
    and filled it through a double pointer: a heap overflow."""
    a, f = varlen_files(tmp_path, rng)
    for n in ("q", "k", "v"):
        a[n] = a[n].astype(dtype)
        f[n] = save(tmp_path, n, a[n])
    out, lse = tmp_path / "out.npy", tmp_path / "lse.npy"
    ok("varlen", "-q", f["q"], "-k", f["k"], "-v", f["v"], "--cu-seqlens-q", f["cu_q"],
       "--cu-seqlens-k", f["cu_k"], "-o", out, "--lse", lse, "--causal")
    assert np.load(out).dtype == dtype
    assert np.load(lse).dtype == (np.float64 if dtype == np.float64 else np.float32)
    wide = {n: a[n].astype(np.float64) for n in ("q", "k", "v")}  # the same rounded values
    ref_out, ref_lse = varlen_reference(wide["q"], wide["k"], wide["v"], a["cu_q"], a["cu_k"],
                                        causal=True)
    tol = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    close(np.load(out).astype(np.float64), ref_out, tol)
    close(np.load(lse), ref_lse, tol)


def test_no_output_replaces_a_modifier_or_index_file(tmp_path, rng):
    """Hostile test: the output-over-input check left out --alibi-slopes and
    --sinks (and attn sdpa had none): -o over --sinks replaced it."""
    _, f = varlen_files(tmp_path, rng)
    sinks = save(tmp_path, "sinks", np.array([0.1, 0.2, 0.3, 0.4]))
    slopes = save(tmp_path, "slopes", np.array([0.5, 0.25, 0.125, 0.0625]))
    before = {p: p.read_bytes() for p in (sinks, slopes, f["cu_q"], f["q"])}
    varlen = ["varlen", "-q", f["q"], "-k", f["k"], "-v", f["v"], "--cu-seqlens-q", f["cu_q"],
              "--cu-seqlens-k", f["cu_k"], "--sinks", sinks, "--alibi-slopes", slopes]
    q3 = save(tmp_path, "q3", rng.standard_normal((4, 3, 8)))
    sdpa = ["sdpa", "-q", q3, "-k", q3, "-v", q3, "--sinks", sinks]
    for args, match in ((varlen + ["-o", sinks], "-o '%s' is the file of --sinks" % sinks),
                        (varlen + ["-o", tmp_path / "o.npy", "--lse", slopes],
                         "is the file of --alibi-slopes"),
                        (varlen + ["-o", tmp_path / "o.npy", "--lse", f["cu_q"]],
                         "is the file of --cu-seqlens-q"),
                        (sdpa + ["-o", sinks], "is the file of --sinks"),
                        (sdpa + ["-o", q3], "is the file of -q")):
        r = run(*args)
        assert r.returncode == 2 and match in r.stderr and "never overwritten" in r.stderr, r.stderr
    assert not (tmp_path / "o.npy").exists()
    for p, b in before.items():
        assert p.read_bytes() == b, p


def test_an_index_fifo_without_a_writer_is_refused_not_waited_on(tmp_path, rng):
    _, f = varlen_files(tmp_path, rng)
    fifo = tmp_path / "cu.npy"
    os.mkfifo(fifo)
    r = run("varlen", "-q", f["q"], "-k", f["k"], "-v", f["v"], "--cu-seqlens-q", fifo,
            "--cu-seqlens-k", f["cu_k"], "-o", tmp_path / "o.npy")
    assert r.returncode == 1 and "--cu-seqlens-q" in r.stderr, r.stderr


def test_a_file_size_limit_fails_cleanly_and_leaves_nothing(tmp_path, rng):
    """Hostile test: under `ulimit -f` the tool died of SIGXFSZ with no
    message and left its temporary beside the target."""
    import resource

    _, f = varlen_files(tmp_path, rng)
    out = tmp_path / "out.npy"

    def limit():  # the child's SIGXFSZ is the default again (restore_signals)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))

    r = subprocess.run([CLI, "varlen", "-q", f["q"], "-k", f["k"], "-v", f["v"],
                        "--cu-seqlens-q", f["cu_q"], "--cu-seqlens-k", f["cu_k"], "-o", out],
                       capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert r.returncode == 1 and "File too large" in r.stderr, (r.returncode, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in f.values())


# ---- attn kvcache ----


def kvcache_files(tmp_path, rng, paged=False):
    B, Hq, Hkv, E = 2, 4, 2, 8
    if paged:
        table = np.array([[3, 0, 5], [1, 4, 2]], np.int32)
        k_cache, v_cache = (rng.standard_normal((6, 4, Hkv, E)) for _ in range(2))
    else:
        table = None
        k_cache, v_cache = (rng.standard_normal((B, 12, Hkv, E)) for _ in range(2))
    arrays = dict(q=rng.standard_normal((B, 2, Hq, E)), k_cache=k_cache, v_cache=v_cache,
                  k=rng.standard_normal((B, 2, Hkv, E)), v=rng.standard_normal((B, 2, Hkv, E)),
                  seqlens=np.array([3, 7], np.int32))
    if table is not None:
        arrays["table"] = table
    return arrays, {n: save(tmp_path, n, a) for n, a in arrays.items()}


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_round_trip_writes_the_caches_to_new_files(tmp_path, rng, paged):
    a, f = kvcache_files(tmp_path, rng, paged)
    inputs_before = {n: p.read_bytes() for n, p in f.items()}
    out, lse = tmp_path / "out.npy", tmp_path / "lse.npy"
    kc_out, vc_out = tmp_path / "kc2.npy", tmp_path / "vc2.npy"
    args = ["kvcache", "-q", f["q"], "--k-cache", f["k_cache"], "--v-cache", f["v_cache"],
            "--k", f["k"], "--v", f["v"], "--cache-seqlens", f["seqlens"], "-o", out, "--lse",
            lse, "--k-cache-out", kc_out, "--v-cache-out", vc_out, "--sinks",
            save(tmp_path, "sinks", np.array([0.1, 0.2, 0.3, 0.4]))]
    if paged:
        args += ["--block-table", f["table"]]
    r = ok(*args)
    assert "kvcache:" in r.stdout and ("paged" in r.stdout) == paged
    for n, p in f.items():  # no input file was written
        assert p.read_bytes() == inputs_before[n], n
    k_cache, v_cache = a["k_cache"].copy(), a["v_cache"].copy()
    want_out, want_lse = attn.attention_with_kvcache(
        a["q"], k_cache, v_cache, a["k"], a["v"], cache_seqlens=a["seqlens"],
        block_table=a.get("table"), sinks=np.array([0.1, 0.2, 0.3, 0.4]),
        return_softmax_lse=True)
    np.testing.assert_array_equal(np.load(out), want_out)
    np.testing.assert_array_equal(np.load(lse), want_lse)
    np.testing.assert_array_equal(np.load(kc_out), k_cache)  # the appended caches
    np.testing.assert_array_equal(np.load(vc_out), v_cache)
    assert not np.array_equal(k_cache, a["k_cache"])
    ref = kvcache_reference(a["q"], k_cache, v_cache, a["seqlens"] + 2,
                            sinks=np.array([0.1, 0.2, 0.3, 0.4]), block_table=a.get("table"))
    close(np.load(out), ref[0])


def test_kvcache_no_causal_and_no_new_rows(tmp_path, rng):
    a, f = kvcache_files(tmp_path, rng)
    out = tmp_path / "out.npy"
    ok("kvcache", "-q", f["q"], "--k-cache", f["k_cache"], "--v-cache", f["v_cache"],
       "--cache-seqlens", f["seqlens"], "--no-causal", "-o", out)
    ref = kvcache_reference(a["q"], a["k_cache"], a["v_cache"], a["seqlens"], causal=False)
    close(np.load(out), ref[0])


def test_kvcache_refuses_an_output_over_an_input(tmp_path, rng):
    _, f = kvcache_files(tmp_path, rng)
    before = f["k_cache"].read_bytes()
    link = tmp_path / "link.npy"
    os.symlink(f["k_cache"], link)
    for target in (f["k_cache"], link):
        r = run("kvcache", "-q", f["q"], "--k-cache", f["k_cache"], "--v-cache", f["v_cache"],
                "--k", f["k"], "--v", f["v"], "--cache-seqlens", f["seqlens"], "-o",
                tmp_path / "o.npy", "--k-cache-out", target)
        assert r.returncode == 2 and "--k-cache-out" in r.stderr and "never" in r.stderr
    assert f["k_cache"].read_bytes() == before
    assert not (tmp_path / "o.npy").exists()


def test_kvcache_float16_queries_write_a_float32_lse(tmp_path, rng):
    a, f = kvcache_files(tmp_path, rng)
    half = {n: a[n].astype(np.float16) for n in ("q", "k_cache", "v_cache")}
    files = {n: save(tmp_path, n + "16", x) for n, x in half.items()}
    out, lse = tmp_path / "out.npy", tmp_path / "lse.npy"
    ok("kvcache", "-q", files["q"], "--k-cache", files["k_cache"], "--v-cache",
       files["v_cache"], "--cache-seqlens", f["seqlens"], "-o", out, "--lse", lse)
    assert np.load(out).dtype == np.float16 and np.load(lse).dtype == np.float32
    wide = {n: x.astype(np.float64) for n, x in half.items()}  # the same rounded values
    ref = kvcache_reference(wide["q"], wide["k_cache"], wide["v_cache"], a["seqlens"])
    close(np.load(lse), ref[1], 1e-5)
    close(np.load(out).astype(np.float64), ref[0], 2e-3)


def test_kvcache_overflow_is_refused_and_nothing_written(tmp_path, rng):
    _, f = kvcache_files(tmp_path, rng)
    full = save(tmp_path, "full", np.array([3, 11], np.int32))  # 11 + 2 new rows > 12
    r = run("kvcache", "-q", f["q"], "--k-cache", f["k_cache"], "--v-cache", f["v_cache"],
            "--k", f["k"], "--v", f["v"], "--cache-seqlens", full, "-o", tmp_path / "o.npy",
            "--k-cache-out", tmp_path / "kc.npy")
    assert r.returncode == 1 and "cache_seqlens" in r.stderr
    assert not (tmp_path / "o.npy").exists() and not (tmp_path / "kc.npy").exists()


def test_kvcache_0d_cache_seqlens_is_refused(tmp_path, rng):
    """np.array(4) was taken as one sequence's length (exit 0)."""
    _, f = kvcache_files(tmp_path, rng)
    r = run("kvcache", "-q", f["q"], "--k-cache", f["k_cache"], "--v-cache", f["v_cache"],
            "--cache-seqlens", save(tmp_path, "zero_d", np.array(4, np.int32)),
            "-o", tmp_path / "o.npy")
    assert r.returncode == 1 and "--cache-seqlens" in r.stderr and "0-d" in r.stderr, r.stderr
    assert not (tmp_path / "o.npy").exists()


def test_kvcache_block_id_out_of_range(tmp_path, rng):
    _, f = kvcache_files(tmp_path, rng, paged=True)
    bad = save(tmp_path, "bad", np.array([[3, 0, 5], [1, 4, 60]], np.int32))
    r = run("kvcache", "-q", f["q"], "--k-cache", f["k_cache"], "--v-cache", f["v_cache"],
            "--k", f["k"], "--v", f["v"], "--cache-seqlens", f["seqlens"], "--block-table", bad,
            "-o", tmp_path / "o.npy")
    assert r.returncode == 1 and "block_table" in r.stderr


@pytest.mark.parametrize("args, match", [
    (["-o", "o.npy"], "-q, --k-cache and --v-cache are required"),
    (["-o", "o", "-q", "q", "--k-cache", "a", "--v-cache", "b", "--k", "k"],
     "give --k and --v together"),
    (["--cu-seqlens-q", "x"], "unknown option '--cu-seqlens-q'"),
    (["--dropout", "0.1"], "unknown option '--dropout'"),
    (["--softcap", "nan"], "--softcap: 'nan'"),
])
def test_kvcache_usage_errors(args, match):
    r = run("kvcache", *args)
    assert r.returncode == 2 and match in r.stderr, r.stderr


def test_help_texts_list_the_serving_commands():
    top = ok("--help").stdout
    for text in ("attn varlen", "attn kvcache", "--window L,R", "attn kvcache --help"):
        assert text in top
    assert len(top) < 8000  # test_cli.c reads it through an 8 KiB buffer
    assert "--alibi-slopes" in ok("sdpa", "--help").stdout
    kvcache = ok("kvcache", "--help").stdout
    assert "--block-table" in kvcache and "--k-cache-out" in kvcache
    assert "--cu-seqlens-k" in ok("varlen", "-h").stdout


@pytest.mark.parametrize("stdout", ["full", "closed pipe"])
def test_an_unwritable_stdout_replaces_no_output(tmp_path, rng, stdout):
    """The summary line was printed after the outputs were renamed: with
    stdout on /dev/full (or a closed pipe) the tool exited 1 with the old
    files already replaced. It is flushed before the commit now, and a failure
    there leaves every target as it was (hostile tester, 2026-11-28)."""
    a, f = varlen_files(tmp_path, rng)
    out = tmp_path / "out.npy"
    out.write_bytes(b"OLD")
    args = [CLI, "varlen", "-q", f["q"], "-k", f["k"], "-v", f["v"], "--cu-seqlens-q",
            f["cu_q"], "--cu-seqlens-k", f["cu_k"], "-o", out]
    if stdout == "full":
        with open("/dev/full", "w") as full:
            r = subprocess.run(list(map(str, args)), stdout=full, stderr=subprocess.PIPE,
                               text=True, timeout=120)
    else:
        read_end, write_end = os.pipe()
        os.close(read_end)  # nobody reads: a write gets EPIPE (SIGPIPE is ignored by the tool)
        r = subprocess.run(list(map(str, args)), stdout=write_end, stderr=subprocess.PIPE,
                           text=True, timeout=120)
        os.close(write_end)
    assert r.returncode == 1 and "cannot write to standard output" in r.stderr, r.stderr
    assert out.read_bytes() == b"OLD"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
