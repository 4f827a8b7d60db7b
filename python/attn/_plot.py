"""attn.plot_attention: a heatmap of attention weights with matplotlib.

The picture follows `attn heatmap` (tools/heatmap_cmd.c): rows are queries,
columns keys, viridis from the smallest to the largest finite weight drawn
(or vmin/vmax), NaN magenta, +inf red, -inf black, one colour bar for all
panels. matplotlib is imported on the first call, so `import attn` does not
need it.
"""

import errno
import io
import math
import numbers
import os
import stat
import time

import numpy as np

from ._arrays import _is_torch_tensor, check_int

# The colours of weights that are not numbers (RGBA), as the CLI paints them.
NONFINITE_RGBA = {"nan": (1.0, 0.0, 1.0, 1.0), "+inf": (1.0, 0.0, 0.0, 1.0),
                  "-inf": (0.0, 0.0, 0.0, 1.0)}
TOKEN_CHARS = 20  # longer labels end in "…"
# Cells drawn in one call, at most: the CLI's 32 Mpx. Colouring takes about
# 16 bytes a cell (the normalised value and its RGBA bytes), and a panel is
# drawn in at most 12 inches anyway.
MAX_CELLS = 32 << 20
FIFO_READER_WAIT_S = 5.0  # as the CLI waits for a FIFO's reader


def _matplotlib():
    try:
        import matplotlib.pyplot as plt
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize
    except ImportError as e:
        raise ImportError(
            "attn.plot_attention needs matplotlib, which is not installed: "
            "pip install matplotlib (or scripts/bootstrap.sh bench)") from e
    return plt, ScalarMappable, Normalize


def _as_array(weights):
    """float64 NumPy array of the weights; TypeError for what is not real."""
    if _is_torch_tensor(weights):
        if weights.is_meta or weights.is_nested:
            raise TypeError("weights is a meta or nested tensor: it has no values to draw")
        if weights.is_complex():
            raise TypeError(f"weights must be real; got a torch tensor of {weights.dtype}")
        return weights.detach().cpu().double().numpy()  # bfloat16 has no NumPy dtype
    a = np.asarray(weights)
    if a.dtype.kind not in "fiub":
        raise TypeError(f"weights must be an array of real numbers; got dtype {a.dtype}")
    return a.astype(np.float64, copy=False)


def _labels(tokens, name, count, what, whats):
    if tokens is None:
        return None
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of strings, one per {what}; got one "
                        f"{type(tokens).__name__}")
    labels = [str(t) for t in tokens]
    if len(labels) != count:
        raise ValueError(f"{name} has {len(labels)} entries but the weights have {count} "
                         f"{whats}")
    return [t if len(t) <= TOKEN_CHARS else t[:TOKEN_CHARS - 1] + "…" for t in labels]


def _bound(x, name):
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
        raise ValueError(f"{name} must be None or a finite number; got {x!r}")
    return float(x)


def _select(w, head, batch):
    """(panels, head numbers, batch element) drawn; None for what w lacks."""
    if w.ndim not in (2, 3, 4):
        raise ValueError(f"weights must be (L, S), (H, L, S) or (N, H, L, S); got shape "
                         f"{tuple(w.shape)}")
    if 0 in w.shape:
        raise ValueError(f"weights of shape {tuple(w.shape)} are empty: nothing to draw")
    b = None
    if w.ndim == 4:
        b = check_int(0 if batch is None else batch, "batch", minimum=0,
                      maximum=w.shape[0] - 1, bound=f" (the weights have N = {w.shape[0]})")
        w = w[b]
    elif batch is not None:
        raise ValueError(f"batch is given but the weights (shape {tuple(w.shape)}) have no "
                         f"batch dimension")
    if w.ndim == 2:
        if head is not None:
            raise ValueError("head is given but the weights (L, S) have no head dimension")
        return w[None], [None], b
    if head is None:
        return w, list(range(w.shape[0])), b
    h = check_int(head, "head", minimum=0, maximum=w.shape[0] - 1,
                  bound=f" (the weights have H = {w.shape[0]} heads)")
    return w[h:h + 1], [h], b


def _rgba(panel, norm, cmap):
    """The panel's colours (RGBA bytes): the map for finite weights, fixed
    colours for the rest."""
    finite = np.isfinite(panel)
    rgba = cmap(norm(np.where(finite, panel, 0.0)), bytes=True)
    for where, colour in ((np.isnan(panel), "nan"), (np.isposinf(panel), "+inf"),
                          (np.isneginf(panel), "-inf")):
        rgba[where] = np.round(np.array(NONFINITE_RGBA[colour]) * 255).astype(np.uint8)
    return rgba


def _cell_inches(x):
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not (
            math.isfinite(x) and x > 0):
        raise ValueError(f"cell_inches must be a finite number > 0; got {x!r}")
    return float(x)


def _path(path):
    """path as a str (bytes decoded as the file system does), checked."""
    try:
        name = os.fsdecode(os.fspath(path))
    except TypeError:
        raise TypeError(f"path must be a str, bytes or os.PathLike; got "
                        f"{type(path).__name__}") from None
    if name == "":
        raise ValueError("path is empty")
    if "\0" in name:
        raise ValueError("path contains a NUL character")
    return name


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_in_place(target, data):
    """A device or FIFO cannot be replaced: it is written as it is, waiting
    a bounded time for a FIFO's reader."""
    deadline = time.monotonic() + FIFO_READER_WAIT_S
    while True:
        try:
            fd = os.open(target, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC)
            break
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:
                if e.errno == errno.ENXIO:
                    raise OSError(e.errno, "a FIFO that no process opened for reading "
                                  f"within {FIFO_READER_WAIT_S:g} s", target) from None
                raise
            time.sleep(0.01)
    try:
        os.set_blocking(fd, True)
        _write_all(fd, data)
    finally:
        os.close(fd)


def _replace(target, data, old):
    """A temporary beside target, fsync, renamed over it; the new file keeps
    the old one's permission bits (and owner, where allowed)."""
    folder, base = os.path.split(target)
    for _ in range(100):
        temp = os.path.join(folder, f".{base[:200]}.{os.urandom(4).hex()}.tmp")
        try:  # 0666 less the umask, as any new file
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name beside", target)
    try:
        try:
            if old is not None:
                try:
                    os.fchown(fd, old.st_uid, old.st_gid)
                except PermissionError:
                    pass  # only root may give a file away: it stays the caller's
                os.fchmod(fd, stat.S_IMODE(old.st_mode))
            _write_all(fd, data)
            os.fsync(fd)  # on disk before the name points at it
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException:
        os.unlink(temp)
        raise


def _save(fig, name):
    """Written whole or not at all, as the CLI writes its files: the figure
    is rendered first; a symbolic link is followed (a dangling one creates
    its target), a device or FIFO written in place, a folder refused, and a
    regular file replaced through a temporary beside it. name: _path's."""
    fmt = os.path.splitext(name)[1][1:].lower() or "png"
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=fig.dpi)
    target = os.path.realpath(name)
    try:
        old = os.stat(target)
    except FileNotFoundError:
        old = None
    if old is not None and stat.S_ISDIR(old.st_mode):
        raise IsADirectoryError(errno.EISDIR, "path is a folder, not a file", name)
    if old is not None and not stat.S_ISREG(old.st_mode):
        _write_in_place(target, buffer.getvalue())
    else:
        _replace(target, buffer.getvalue(), old)


def plot_attention(weights, tokens=None, key_tokens=None, head=None, ax=None, path=None, *,
                   batch=None, vmin=None, vmax=None, cmap="viridis", cell_inches=0.3):
    """A heatmap of attention weights; returns the matplotlib Figure.

    weights: (L, S), (H, L, S) or (N, H, L, S), a NumPy array or a torch
    tensor (what scaled_dot_product_attention(..., return_weights=True) or
    MultiheadAttention(need_weights=True, average_attn_weights=False) give).
    Rows are queries, columns keys. tokens labels the rows (L strings),
    key_tokens the columns (S strings; default: tokens when L == S); labels
    longer than 20 characters end in "…". head picks one head; by default
    every head of batch element `batch` (default 0) is drawn, one panel each
    in a grid, with one colour bar. ax draws one head into your Axes (head
    is then needed when H > 1). path also saves the figure there (PNG, or
    the format its extension names), whole or not at all, as the CLI writes
    its files: a symbolic link followed, a device or FIFO written in place,
    the old file's permission bits kept. At most 32 Mi cells are drawn in
    one call (MAX_CELLS).

    The scale runs from the smallest to the largest finite weight drawn,
    unless vmin/vmax fix it (weights beyond take the end colours). NaN
    weights are magenta, +inf red and -inf black. The figure belongs to
    pyplot: plt.show() shows it, plt.close(fig) frees it.
    """
    plt, ScalarMappable, Normalize = _matplotlib()
    cell_inches = _cell_inches(cell_inches)
    name = None if path is None else _path(path)  # refused before any drawing
    w = _as_array(weights)
    panels, heads, b = _select(w, head, batch)
    if panels.size > MAX_CELLS:
        raise ValueError(f"weights: {panels.shape[0]} panel(s) of {panels.shape[1]} x "
                         f"{panels.shape[2]} are {panels.size} cells; plot_attention draws "
                         f"at most {MAX_CELLS} (about 16 bytes each): pass head=, or a slice")
    L, S = panels.shape[1:]
    rows = _labels(tokens, "tokens", L, "query", "queries")
    cols = _labels(key_tokens, "key_tokens", S, "key", "keys")
    if cols is None and rows is not None and L == S:
        cols = rows
    lo, hi = _bound(vmin, "vmin"), _bound(vmax, "vmax")
    finite = panels[np.isfinite(panels)]
    data_lo, data_hi = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    lo = data_lo if lo is None else lo
    hi = data_hi if hi is None else hi
    if lo > hi:
        raise ValueError(f"vmin {lo:g} is above vmax {hi:g} (the weights drawn run from "
                         f"{data_lo:g} to {data_hi:g})")
    if not math.isfinite(float(hi) - float(lo)):  # matplotlib's scale and colour bar need it
        raise ValueError(f"the scale from {lo:g} to {hi:g} is wider than a float can hold "
                         f"(weights drawn from {data_lo:g} to {data_hi:g}): pass vmin and "
                         f"vmax less than 8.9e307 apart")
    norm = Normalize(vmin=lo, vmax=hi, clip=True)
    colours = plt.get_cmap(cmap)
    if ax is not None:
        if len(heads) > 1:
            raise ValueError(f"ax holds one panel but the weights have {len(heads)} heads: "
                             f"pass head=N, or ax=None for a grid of every head")
        fig, axes = ax.figure, [ax]
    else:
        ncols = math.ceil(math.sqrt(len(heads)))
        nrows = math.ceil(len(heads) / ncols)
        # Cells of cell_inches (within 1.5 to 12 inches a panel), plus room
        # for the labels at ~0.08 inch a character of the 10 pt font.
        chars = [max(map(len, t), default=0) if t else 2 for t in (rows, cols)]
        panel_w = min(max(S * cell_inches, 1.5), 12) + 0.7 + 0.08 * chars[0]
        panel_h = min(max(L * cell_inches, 1.5), 12) + 1.0 + 0.09 * chars[1]
        fig, grid = plt.subplots(nrows, ncols, squeeze=False, layout="constrained",
                                 figsize=(ncols * panel_w + 1.2, nrows * panel_h))
        axes = list(grid.flat)
        for extra in axes[len(heads):]:
            extra.set_visible(False)
    for a, panel, h in zip(axes, panels, heads):
        a.imshow(_rgba(panel, norm, colours), interpolation="nearest", aspect="equal")
        a.set_xlabel("keys")
        a.set_ylabel("queries")
        if h is not None:
            a.set_title(f"head {h}" if b is None else f"batch {b}, head {h}")
        if rows is not None:
            a.set_yticks(range(L), rows)
        if cols is not None:
            a.set_xticks(range(S), cols, rotation=90)
    fig.colorbar(ScalarMappable(norm=norm, cmap=colours), ax=axes[:len(heads)])
    if name is not None:
        _save(fig, name)
    return fig
