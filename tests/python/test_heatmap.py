"""attn.plot_attention looked at: the saved PNG is decoded and read back
through the colour map. Each cell of the L x S grid, found where the axes'
transform puts cell (i, j), is one colour that inverts to its weight within
the map's quantisation; the brightest cell of each row is the row's argmax;
the colour bar runs from the first colour to the last; token labels put text
where their tick labels are; NaN and infinities get their own colours.
Then the arguments it refuses, and a missing matplotlib."""

import math
import os
import sys

import numpy as np
import pytest

import attn

matplotlib = pytest.importorskip("matplotlib")  # bootstrap.sh python installs it
matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

SEED = int(os.environ.get("ATTN_TEST_SEED", "0"))
LUT = matplotlib.colormaps["viridis"](np.arange(256), bytes=True)[:, :3].astype(int)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def clear_max_weights(rng, shape):
    """Softmax rows whose largest weight leads the next by 0.04 or more
    (ten colour bins or more of any scale at most 1 wide)."""
    w = np.empty(shape)
    for idx in np.ndindex(*shape[:-1]):
        while True:
            x = np.exp(2 * rng.standard_normal(shape[-1]))
            x /= x.sum()
            top2 = np.sort(x)[-2:]
            if top2[1] - top2[0] >= 0.04:
                break
        w[idx] = x
    return w


def decode(path):
    img = mpimg.imread(path)
    assert img.dtype == np.float32 and img.ndim == 3  # PNGs decode to floats in [0, 1]
    return np.round(img[..., :3] * 255).astype(int)


def invert(rgb):
    """The colour-map indices within one unit per channel of rgb (rounding),
    as (lo, hi); None when rgb is no colour of the map."""
    near = np.flatnonzero(np.abs(LUT - np.asarray(rgb)).max(axis=1) <= 1)
    return (near.min(), near.max()) if near.size else None


def cell_block(img, ax, i, j, half=3):
    """The pixels around the centre of cell (i, j) (PNG rows count down)."""
    x, y = ax.transData.transform((j, i))
    r, c = int(img.shape[0] - y), int(x)
    return img[r - half:r + half + 1, c - half:c + half + 1].reshape(-1, 3)


def panels_of(fig):
    return [a for a in fig.axes if a.images]


def check_cells(img, ax, w, vmin, vmax, what):
    L, S = w.shape
    assert ax.get_xlim() == (-0.5, S - 0.5) and ax.get_ylim() == (L - 0.5, -0.5), what
    bin_ = (vmax - vmin) / 256
    for i in range(L):
        shown = []
        for j in range(S):
            block = cell_block(img, ax, i, j)
            assert (block == block[0]).all(), f"{what}: cell ({i}, {j}) is not one colour"
            found = invert(block[0])
            assert found is not None, f"{what}: cell ({i}, {j}) colour {block[0]} not in the map"
            lo, hi = found
            assert vmin + (lo - 1) * bin_ - 1e-12 <= w[i, j] <= vmin + (hi + 2) * bin_ + 1e-12, (
                f"{what}: cell ({i}, {j}) shows bins {lo}..{hi}, weight {w[i, j]}")
            shown.append(lo)
        assert int(np.argmax(shown)) == int(np.argmax(w[i])), (
            f"{what}: row {i}: brightest cell {np.argmax(shown)}, argmax {np.argmax(w[i])}")
    # Exactly S columns and L rows: 3 px past the last ones (and the spine)
    # is background (away from the tick marks at whole positions).
    for (x, y), (dx, dy) in (((S - 0.5, 0), (3, 0)), ((-0.25, L - 0.5), (0, -3))):
        px, py = ax.transData.transform((x, y))
        rgb = img[int(img.shape[0] - py - dy), int(px + dx)]
        assert (rgb == 255).all(), f"{what}: {rgb} beyond the {L} x {S} cells"


def check_colorbar(img, fig, vmin, vmax, what):
    cbar = [a for a in fig.axes if not a.images][-1]
    assert np.allclose(cbar.get_ylim(), (vmin, vmax)), what
    x0, y0, x1, y1 = cbar.get_window_extent().extents
    c = int((x0 + x1) / 2)
    rows = range(int(img.shape[0] - y1) + 3, int(img.shape[0] - y0) - 3)
    idx = [invert(img[r, c]) for r in rows]
    assert all(k is not None for k in idx), f"{what}: colour bar has colours outside the map"
    lows = [k[0] for k in idx]
    assert lows == sorted(lows, reverse=True), f"{what}: colour bar not monotonic"
    assert idx[0][1] >= 250 and idx[-1][0] <= 5, f"{what}: colour bar ends {idx[0]}, {idx[-1]}"


@pytest.mark.parametrize("trial", range(8))
def test_cells_show_the_weights(tmp_path, trial):
    rng = np.random.default_rng(1000 * SEED + trial)
    rank = 2 + trial % 3
    shape = tuple(int(n) for n in rng.integers(1, 4, size=rank - 2)) + (
        int(rng.integers(1, 10)), int(rng.integers(2, 12)))
    w = clear_max_weights(rng, shape)
    head = int(rng.integers(0, shape[-3])) if rank >= 3 and trial % 2 else None
    batch = int(rng.integers(0, shape[0])) if rank == 4 else None
    path = tmp_path / "w.png"
    fig = attn.plot_attention(w.astype(np.float32) if trial % 2 else w, head=head, batch=batch,
                              path=path)
    img = decode(path)
    assert img.shape[:2] == (round(fig.get_figheight() * fig.dpi),
                             round(fig.get_figwidth() * fig.dpi))
    drawn = w if rank == 2 else (w[batch] if rank == 4 else w)
    drawn = drawn[None] if rank == 2 else (drawn[head:head + 1] if head is not None else drawn)
    if trial % 2:
        drawn = drawn.astype(np.float32).astype(np.float64)
    panels = panels_of(fig)
    assert len(panels) == drawn.shape[0]
    vmin, vmax = drawn.min(), drawn.max()
    for k, ax in enumerate(panels):
        check_cells(img, ax, drawn[k], vmin, vmax, f"trial {trial} panel {k} {shape}")
    check_colorbar(img, fig, vmin, vmax, f"trial {trial}")


def dark_pixels(img, bbox):
    x0, y0, x1, y1 = bbox.extents
    h = img.shape[0]
    box = img[int(h - y1):int(math.ceil(h - y0)), int(x0):int(math.ceil(x1))]
    return int((box.sum(axis=-1) < 3 * 128).sum())


def test_labels_show_the_tokens(tmp_path):
    rng = np.random.default_rng(SEED + 77)
    w = clear_max_weights(rng, (5, 5))
    tokens = ["The", "cät", "sat", "on", "an-extremely-long-token-that-is-cut"]
    fig = attn.plot_attention(w, tokens=tokens, path=tmp_path / "t.png")
    img = decode(tmp_path / "t.png")
    (ax,) = panels_of(fig)
    shown = [t.get_text() for t in ax.get_yticklabels()]
    assert shown == tokens[:4] + ["an-extremely-long-t…"]
    assert [t.get_text() for t in ax.get_xticklabels()] == shown  # keys default to tokens
    for label in ax.get_yticklabels() + ax.get_xticklabels():
        assert dark_pixels(img, label.get_window_extent()) >= 5, f"no text for {label}"
    check_cells(img, ax, w, w.min(), w.max(), "labelled")
    # Without tokens the margins hold index ticks: the pictures differ there.
    fig2 = attn.plot_attention(w, path=tmp_path / "plain.png")
    assert [t.get_text() for t in panels_of(fig2)[0].get_yticklabels()] != shown
    plain = decode(tmp_path / "plain.png")
    assert plain.shape != img.shape or (plain != img).any()
    # L != S: tokens for the rows only; key_tokens for the columns.
    w2 = clear_max_weights(rng, (2, 3))
    fig3 = attn.plot_attention(w2, tokens=["a", "b"], key_tokens=("x", "y", "z"))
    ax3 = panels_of(fig3)[0]
    assert [t.get_text() for t in ax3.get_xticklabels()] == ["x", "y", "z"]
    assert [t.get_text() for t in ax3.get_yticklabels()] == ["a", "b"]


def test_nonfinite_cells_have_their_colours(tmp_path):
    w = np.array([[np.nan, 0.2, 0.3], [0.1, np.inf, 0.4], [0.5, 0.25, -np.inf]])
    fig = attn.plot_attention(w, path=tmp_path / "nf.png")
    img = decode(tmp_path / "nf.png")
    (ax,) = panels_of(fig)
    for (i, j), rgb in {(0, 0): (255, 0, 255), (1, 1): (255, 0, 0), (2, 2): (0, 0, 0)}.items():
        assert (cell_block(img, ax, i, j) == rgb).all(), (i, j)
    check_colorbar(img, fig, 0.1, 0.5, "finite scale")
    # vmin/vmax: weights beyond take the end colours.
    fig = attn.plot_attention(w, vmin=0.25, vmax=0.3, path=tmp_path / "clip.png")
    img = decode(tmp_path / "clip.png")
    ax = panels_of(fig)[0]
    assert invert(cell_block(img, ax, 0, 1)[0])[0] == 0  # 0.2 < vmin
    assert invert(cell_block(img, ax, 1, 2)[0])[1] == 255  # 0.4 > vmax


def test_torch_tensors_and_your_axes():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    out, w = attn.scaled_dot_product_attention(q, k, v, return_weights=True)
    fig = attn.plot_attention(w, tokens="a b c d".split())  # requires_grad: fine
    assert len(panels_of(fig)) == 2
    fig2 = attn.plot_attention(w.to(torch.bfloat16), head=1)
    assert len(panels_of(fig2)) == 1
    own_fig, own_ax = plt.subplots()
    assert attn.plot_attention(w.detach().numpy(), head=0, ax=own_ax) is own_fig
    assert own_ax.images and own_ax.get_title() == "batch 0, head 0"
    with pytest.raises(ValueError, match="head=N"):
        attn.plot_attention(w, ax=own_ax)


@pytest.mark.parametrize("call, error, match", [
    (lambda: attn.plot_attention(np.zeros(4)), ValueError, r"\(L, S\)"),
    (lambda: attn.plot_attention(np.zeros((1, 1, 1, 2, 2))), ValueError, "shape"),
    (lambda: attn.plot_attention(np.zeros((0, 3))), ValueError, "empty"),
    (lambda: attn.plot_attention(np.zeros((2, 2), complex)), TypeError, "real"),
    (lambda: attn.plot_attention(np.array([["a"]])), TypeError, "real"),
    (lambda: attn.plot_attention(np.ones((2, 3)), tokens=["a"]), ValueError, "tokens has 1"),
    (lambda: attn.plot_attention(np.ones((2, 3)), key_tokens=["a"] * 4), ValueError,
     "key_tokens has 4"),
    (lambda: attn.plot_attention(np.ones((2, 2)), tokens="ab"), TypeError, "sequence"),
    (lambda: attn.plot_attention(np.ones((2, 2)), head=0), ValueError, "no head"),
    (lambda: attn.plot_attention(np.ones((3, 2, 2)), head=3), ValueError, "H = 3"),
    (lambda: attn.plot_attention(np.ones((3, 2, 2)), head=-1), ValueError, "head"),
    (lambda: attn.plot_attention(np.ones((3, 2, 2)), head=1.0), TypeError, "head"),
    (lambda: attn.plot_attention(np.ones((3, 2, 2)), batch=0), ValueError, "batch"),
    (lambda: attn.plot_attention(np.ones((2, 3, 2, 2)), batch=2), ValueError, "N = 2"),
    (lambda: attn.plot_attention(np.ones((2, 2)), vmin=float("nan")), ValueError, "vmin"),
    (lambda: attn.plot_attention(np.ones((2, 2)), vmin=2, vmax=1), ValueError, "vmin"),
    (lambda: attn.plot_attention(np.ones((2, 2)), vmin=5), ValueError, "vmin"),
    # a scale whose width overflows a double: matplotlib's NaN axis limits before
    (lambda: attn.plot_attention(np.array([[-1e308, 1e308]])), ValueError, "wider than"),
    (lambda: attn.plot_attention(np.ones((2, 2)), vmin=-1e308, vmax=1e308), ValueError,
     "wider than"),
    (lambda: attn.plot_attention(np.ones((2, 2)), cell_inches=float("nan")), ValueError,
     "cell_inches"),
    (lambda: attn.plot_attention(np.ones((2, 2)), cell_inches=0), ValueError, "cell_inches"),
    (lambda: attn.plot_attention(np.ones((2, 2)), cell_inches="big"), ValueError, "cell_inches"),
    (lambda: attn.plot_attention(np.ones((2, 2)), path=""), ValueError, "path is empty"),
    (lambda: attn.plot_attention(np.ones((2, 2)), path=3), TypeError, "path must be"),
    (lambda: attn.plot_attention(np.ones((2, 2)), path="."), IsADirectoryError, "folder"),
    # 33M cells, a view of 8 bytes: refused before anything is allocated
    (lambda: attn.plot_attention(np.broadcast_to(np.float64(1), (1, 5793, 5793))), ValueError,
     "at most 33554432"),
])
def test_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_saves_whole_or_not_at_all(tmp_path):
    target = tmp_path / "keep.png"
    target.write_bytes(b"old")
    with pytest.raises(ValueError):  # a format matplotlib does not write
        attn.plot_attention(np.ones((2, 2)), path=tmp_path / "keep.notaformat")
    with pytest.raises(FileNotFoundError):
        attn.plot_attention(np.ones((2, 2)), path=tmp_path / "missing" / "x.png")
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["keep.png"]
    attn.plot_attention(np.ones((2, 2)), path=str(target))
    assert target.read_bytes()[:4] == b"\x89PNG" and sorted(os.listdir(tmp_path)) == ["keep.png"]


def test_saves_through_links_and_into_fifos_as_the_cli_does(tmp_path):
    """A link is followed (its target replaced, a dangling one's created),
    a FIFO written in place, the old file's permission bits kept: the save
    replaced each of them with a file of its own before."""
    import threading
    w = np.ones((2, 2))
    target = tmp_path / "target.png"
    target.write_bytes(b"old")
    os.chmod(target, 0o640)
    link = tmp_path / "link.png"
    os.symlink(target, link)
    attn.plot_attention(w, path=link)
    assert os.path.islink(link) and target.read_bytes()[:4] == b"\x89PNG"
    assert os.stat(target).st_mode & 0o777 == 0o640
    dangling = tmp_path / "dangling.png"
    os.symlink(tmp_path / "created.png", dangling)
    attn.plot_attention(w, path=bytes(dangling))  # bytes, as os.fspath gives them
    assert os.path.islink(dangling) and (tmp_path / "created.png").read_bytes()[:4] == b"\x89PNG"
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    attn.plot_attention(w, path=fifo)
    reader.join(10)
    assert got and got[0][:4] == b"\x89PNG" and not os.path.isfile(fifo)
    assert sorted(os.listdir(tmp_path)) == ["created.png", "dangling.png", "fifo.png",
                                            "link.png", "target.png"]  # no temporary left


def test_missing_matplotlib_says_so(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # None: "import fails"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        attn.plot_attention(np.ones((2, 2)))
