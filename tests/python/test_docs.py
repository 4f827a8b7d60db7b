"""The examples in docs/python.md run, and the two columns of the
PyTorch <-> attn example agree."""

import os
import re

import numpy as np
import torch

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")


def python_blocks():
    return re.findall(r"```python\n(.*?)```", open(DOC).read(), flags=re.S)


def test_side_by_side_example_agrees():
    torch_code, attn_code, beyond_code = python_blocks()[:3]
    torch.manual_seed(0)
    ns = {}
    exec(torch_code, ns)
    with torch.no_grad():
        t_out, t_y, t_w = ns["out"], *ns["mha"](ns["x"], ns["x"], ns["x"],
                                                  key_padding_mask=ns["pad"])
    exec(attn_code, ns)
    assert isinstance(ns["out"], torch.Tensor) and ns["out"].shape == (2, 8, 128, 32)
    assert ns["y"].shape == (4, 100, 512) and ns["w"].shape == (4, 100, 100)
    # float32: both within float32 rounding of the exact result.
    np.testing.assert_allclose(ns["out"], t_out.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ns["y"], t_y.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ns["w"], t_w.numpy(), rtol=1e-4, atol=1e-6)
    exec(beyond_code, ns)
    assert ns["w"].shape == (2, 8, 128, 256) and ns["lse"].shape == (2, 8, 128)
    assert ns["m"].head_dim == 32 and ns["m"].q_proj_weight is None


def test_attn_nn_example_trains():
    """The attn.nn.MultiheadAttention example runs: a training step moves the
    parameters, and its eval output is torch's module's (same weights)."""
    (code,) = [b for b in python_blocks() if "attn.nn.MultiheadAttention(" in b]
    ns = {}
    exec(code, ns)
    mha, ref, x, pad = ns["mha"], ns["reference"], ns["x"], ns["pad"]
    assert x.grad is not None and ns["w"].shape == (4, 10, 10)
    assert not torch.equal(mha.in_proj_weight, ref.in_proj_weight)  # opt.step() moved it
    ref.load_state_dict(mha.state_dict())
    ref.eval()
    with torch.no_grad():
        y_ref, _ = ref(x, x, x, key_padding_mask=pad)
    torch.testing.assert_close(ns["y"], y_ref, rtol=1e-5, atol=1e-6)


def test_training_examples_run():
    """The section "Training with attn" runs top to bottom: gradients reach
    every input, the compiled step trains, and patch_torch routes."""
    text = open(DOC).read()
    section = text[text.index("## Training with attn"):text.index("## API")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3
    torch.manual_seed(0)
    torch._dynamo.reset()
    ns = {}
    exec(blocks[0], ns)
    grads = [ns[n].grad.clone() for n in ("q", "k", "v", "bias")]
    assert grads[3].shape == (128, 256) and all(g.abs().sum() > 0 for g in grads)
    exec(blocks[1], ns)  # torch.compile; the step's gradients add to the first ones
    assert not torch.equal(ns["q"].grad, grads[0])
    exec(blocks[2], ns)
    assert ns["out"].shape == (2, 8, 128, 32)
    assert ns["F"].scaled_dot_product_attention is ns["F"].__dict__["scaled_dot_product_attention"]


def test_plot_attention_example(tmp_path, monkeypatch):
    """The attn.plot_attention example runs and saves a PNG of 4 panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    (code,) = [b for b in python_blocks() if 'path="attention.png"' in b]
    monkeypatch.chdir(tmp_path)
    ns = {}
    exec(code, ns)
    assert mpimg.imread(tmp_path / "attention.png").shape[2] in (3, 4)
    assert sum(1 for a in ns["fig"].axes if a.images) == 4
    assert sum(1 for a in ns["one"].axes if a.images) == 1
    plt.close("all")


def test_bfloat16_example_runs():
    import textwrap

    (block,) = [b for b in python_blocks() if "ml_dtypes.bfloat16" in b]
    exec(textwrap.dedent(block), {})
