"""Attention heatmaps: (weights, source tokens, target tokens) -> figure.

Pure functions. Figures are built with matplotlib's object-oriented API
(:class:`matplotlib.figure.Figure`), never through ``pyplot``: importing this module or
drawing a figure changes no backend, no rcParams and registers no figure with a global
figure manager. The caller decides where, or whether, a figure is saved
(:func:`save_figure`).

Layout convention (as in Bahdanau et al. 2015, Fig. 3): rows are target tokens (y axis,
top to bottom in output order), columns are source tokens (x axis, labels rotated), and
the colour scale is fixed to [0, 1] so plots of different sentences are comparable.

Glyphs: matplotlib's bundled DejaVu Sans has no Hangul, and the seeds, the dates task and
their tokens are Korean. Every text of a figure drawn here (title, axis names, tick labels)
lists Noto Sans KR (from the ``pylopdf-fonts-ko`` package) after its own font family, so
matplotlib (>= 3.6) takes from it only the glyphs the first font lacks: Latin text is drawn as
before. The font is registered with matplotlib's font manager on the first figure, not at
import (:func:`_fallback_family`).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import font_manager
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.text import Text

__all__ = ["attention_grid", "attention_heatmap", "save_figure", "score_grid"]

#: Inches per token along either axis (at most), and the fixed margin for labels and colorbar.
_CELL_INCHES = 0.35
#: Tick label size in points: _TICK_POINTS at full cell size, smaller (down to _MIN_TICK_POINTS)
#: when a long sentence shrinks the cells to fit the figure, so labels never overlap.
_TICK_POINTS = 10.0
_MIN_TICK_POINTS = 5.0
_MARGIN_INCHES = (2.0, 1.5)  # (width, height)
_MIN_AXES_INCHES = 1.5
_MAX_FIGURE_INCHES = 40.0
_GRID_MAX_COLS = 4
_DPI = 120
_CMAP = "viridis"
#: The axes' names unless the caller names them: ``(x axis, y axis)``.
_AXIS_NAMES = ("source", "target")
#: Weights may exceed [0, 1] by float rounding; beyond this they are not probabilities.
_RANGE_TOLERANCE = 1e-4


def _weights(weights: Any, dims: tuple[str, ...], src_tokens: list[str], tgt_tokens: list[str], what: str,
             hint: str) -> np.ndarray:
    """``weights`` as a float64 array of shape ``dims``, e.g. ``("H", "T_tgt", "T_src")``, checked.

    :param weights: a torch tensor (any device/dtype, with or without grad) or array-like.
    :param hint: what the error for a wrong number of dims adds (where to go instead).
    :raises ValueError: naming ``what``: not ``len(dims)`` dims or a leading dim of 0, or as :func:`_check_weights`.
    """
    if hasattr(weights, "detach"):  # torch.Tensor, without importing torch here
        weights = weights.detach().to("cpu").float().numpy()
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != len(dims) or 0 in w.shape[:-2]:
        leading = "".join(f" with {d} >= 1" for d in dims[:-2])
        raise ValueError(f"{what} must have shape ({', '.join(dims)}){leading}, got {tuple(w.shape)}; {hint}")
    _check_weights(w, src_tokens, tgt_tokens, what)
    return w


def _check_weights(w: np.ndarray, src_tokens: list[str], tgt_tokens: list[str], what: str) -> None:
    """Raise ValueError unless ``w[..., T_tgt, T_src]`` matches the token lists and is in [0, 1]."""
    expected = (len(tgt_tokens), len(src_tokens))
    if w.shape[-2:] != expected:
        raise ValueError(
            f"{what} has shape {tuple(w.shape)} but the tokens give (T_tgt, T_src) = {expected} "
            f"({len(tgt_tokens)} target, {len(src_tokens)} source tokens); the last two dims "
            "must be (target, source)"
        )
    if 0 in expected:
        raise ValueError(f"cannot plot attention with no tokens: (T_tgt, T_src) = {expected}")
    if not np.isfinite(w).all():
        raise ValueError(f"{what} contains NaN or infinite values")
    lo, hi = float(w.min()), float(w.max())
    if lo < -_RANGE_TOLERANCE or hi > 1 + _RANGE_TOLERANCE:
        raise ValueError(
            f"{what} ranges over [{lo:.4g}, {hi:.4g}], outside [0, 1]: pass normalized attention "
            "weights (after softmax), not scores"
        )


@cache
def _fallback_family() -> str:
    """The family name of the font that draws what the default font cannot (Hangul): Noto Sans KR, shipped by the
    ``pylopdf-fonts-ko`` package, registered with matplotlib's font manager on the first call."""
    import pylopdf_fonts_ko  # font files only: importing it changes nothing

    path = pylopdf_fonts_ko.sans_path()
    font_manager.fontManager.addfont(path)
    return font_manager.get_font(path).family_name


def _with_fallback_font(fig: Figure) -> Figure:
    """``fig`` with every text's font family followed by :func:`_fallback_family`: matplotlib draws each glyph
    from the first family that has it, so Latin keeps the default font and Hangul comes from the fallback.
    Ticks added when the figure is drawn copy the first tick's font, so they fall back too."""
    fallback = _fallback_family()
    for text in fig.findobj(Text):
        families = text.get_fontfamily()
        if fallback not in families:
            text.set_fontfamily([*families, fallback])
    return fig


def _layout(n_tgt: int, n_src: int, n_panels: int = 1) -> tuple[int, float]:
    """``(columns, inches per token)`` for ``n_panels`` heatmaps: the largest cell, up to
    :data:`_CELL_INCHES`, with which the figure fits :data:`_MAX_FIGURE_INCHES` both ways; on a
    tie (short sentences) the most columns, up to :data:`_GRID_MAX_COLS`."""
    best_cols, best_cell = 1, 0.0
    for cols in range(min(n_panels, _GRID_MAX_COLS), 0, -1):
        rows = math.ceil(n_panels / cols)
        fit_w = (_MAX_FIGURE_INCHES - 1.0) / cols - _MARGIN_INCHES[0] / 2
        fit_h = (_MAX_FIGURE_INCHES - 0.5) / rows - _MARGIN_INCHES[1]
        cell = min(_CELL_INCHES, fit_w / max(n_src, 1), fit_h / max(n_tgt, 1))
        if cell > best_cell + 1e-9:
            best_cols, best_cell = cols, cell
    return best_cols, best_cell


def _axes_inches(n_tgt: int, n_src: int, cell: float) -> tuple[float, float]:
    """(width, height) in inches of one heatmap's axes: ``cell`` inches per token."""
    return (max(_MIN_AXES_INCHES, cell * n_src), max(_MIN_AXES_INCHES, cell * n_tgt))


def _tick_points(cell: float) -> float:
    """Tick label size that fits a cell of ``cell`` inches (72 points per inch, some space between)."""
    return max(_MIN_TICK_POINTS, min(_TICK_POINTS, 0.8 * 72 * cell))


def _draw(
    ax: Axes,
    w: np.ndarray,
    src_tokens: list[str],
    tgt_tokens: list[str],
    *,
    x_labels: bool,
    y_labels: bool,
    cell: float,
    axis_names: tuple[str, str],
) -> AxesImage:
    """Draw one (T_tgt, T_src) heatmap on ``ax`` with fixed [0, 1] colour scale."""
    image = ax.imshow(w, cmap=_CMAP, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    size = _tick_points(cell)
    ax.set_xticks(range(len(src_tokens)), labels=src_tokens if x_labels else [], rotation=90, fontsize=size)
    ax.set_yticks(range(len(tgt_tokens)), labels=tgt_tokens if y_labels else [], fontsize=size)
    if x_labels:
        ax.set_xlabel(axis_names[0])
    if y_labels:
        ax.set_ylabel(axis_names[1])
    return image


def attention_heatmap(weights: Any, src_tokens: list[str], tgt_tokens: list[str], *, title: str | None = None,
                      axis_names: tuple[str, str] = _AXIS_NAMES, scale_to_max: bool = False) -> Figure:
    """Heatmap of one attention matrix: entry (i, j) is alpha_ij, how much target token i
    attends to source token j (Bahdanau et al. 2015, Eq. 6).

    :param weights: shape (T_tgt, T_src), values in [0, 1] (rows of a softmax); a torch
        tensor (any device, may require grad) or anything :func:`numpy.asarray` accepts.
    :param src_tokens: T_src labels for the x axis (columns).
    :param tgt_tokens: T_tgt labels for the y axis (rows).
    :param title: optional figure title.
    :param axis_names: ``(x axis, y axis)`` names, e.g. ``("source", "output")``.
    :param scale_to_max: each row is drawn relative to its largest weight instead of on [0, 1]: for
        shares spread thin over many keys (a long review's token importance), which would all look
        alike on [0, 1].
    :return: a new :class:`~matplotlib.figure.Figure`, sized from the token counts (cells and
        tick labels shrink for long sentences so that the figure stays within 40 inches).
    :raises ValueError: if the shape does not match the token lists (the message gives
        both), there are no tokens, or the values are not finite numbers in [0, 1].
    """
    w = _weights(weights, ("T_tgt", "T_src"), src_tokens, tgt_tokens, "weights",
                 "for (H, T_tgt, T_src) use attention_grid, for a batch pick one element first")

    _, cell = _layout(len(tgt_tokens), len(src_tokens))
    axes_w, axes_h = _axes_inches(len(tgt_tokens), len(src_tokens), cell)
    # labels longer than the margins hold (about 10 characters): more room, the x labels being vertical
    chars = _tick_points(cell) * 0.6 / 72  # inches per label character
    label_w = max(0.0, max(map(len, tgt_tokens)) * chars - 1.0)
    label_h = max(0.0, max(map(len, src_tokens)) * chars - 0.8)
    width = min(_MAX_FIGURE_INCHES, axes_w + _MARGIN_INCHES[0] + label_w)
    if title is not None:  # a narrow figure (few keys) wraps a long heading: about 10 characters to the inch
        title = "\n".join(textwrap.fill(line, max(30, int(width * 10))) for line in title.split("\n"))
    title_h = 0.22 * max(0, (title or "").count("\n") - 1)
    size = (width, min(_MAX_FIGURE_INCHES, axes_h + _MARGIN_INCHES[1] + label_h + title_h))
    fig = Figure(figsize=size, layout="constrained")
    ax = fig.add_subplot()
    if scale_to_max:
        w = w / np.maximum(w.max(axis=1, keepdims=True), 1e-12)  # a row of zeros stays zeros
    image = _draw(ax, w, src_tokens, tgt_tokens, x_labels=True, y_labels=True, cell=cell, axis_names=axis_names)
    fig.colorbar(image, ax=ax, label="weight / the largest of its row" if scale_to_max else "attention weight")
    if title is not None:
        ax.set_title(title)
    return _with_fallback_font(fig)


def attention_grid(weights_per_head: Any, src_tokens: list[str], tgt_tokens: list[str], *, title: str | None = None,
                   axis_names: tuple[str, str] = _AXIS_NAMES) -> Figure:
    """One heatmap per head, for inspecting multi-head attention, with one shared colorbar.

    Heads are laid out row by row, at most 4 per row (fewer when long sentences need the
    width); source labels appear on every panel, target labels on the first column only.

    :param weights_per_head: shape (H, T_tgt, T_src), values in [0, 1]; torch tensor or
        array-like (one batch element: ``weights[b]`` of a (B, H, T_tgt, T_src) tensor).
    :param src_tokens: T_src labels for the x axes.
    :param tgt_tokens: T_tgt labels for the y axes.
    :param title: optional figure title (each panel is titled ``head h``).
    :param axis_names: ``(x axis, y axis)`` names, shared by all panels.
    :return: a new :class:`~matplotlib.figure.Figure`.
    :raises ValueError: as :func:`attention_heatmap`, or if there is not exactly one head dim.
    """
    w = _weights(weights_per_head, ("H", "T_tgt", "T_src"), src_tokens, tgt_tokens, "weights_per_head",
                 "for a batch pick one element first")

    n_heads = w.shape[0]
    n_cols, cell = _layout(len(tgt_tokens), len(src_tokens), n_heads)
    n_rows = math.ceil(n_heads / n_cols)
    axes_w, axes_h = _axes_inches(len(tgt_tokens), len(src_tokens), cell)
    size = (
        min(_MAX_FIGURE_INCHES, n_cols * (axes_w + _MARGIN_INCHES[0] / 2) + 1.0),
        min(_MAX_FIGURE_INCHES, n_rows * (axes_h + _MARGIN_INCHES[1]) + 0.5),
    )
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False)  # (n_rows, n_cols) array of Axes

    used: list[Axes] = []
    image = None
    for h in range(n_rows * n_cols):
        ax = axes[h // n_cols, h % n_cols]
        if h >= n_heads:
            ax.set_axis_off()  # empty slot in the last row
            continue
        image = _draw(ax, w[h], src_tokens, tgt_tokens, x_labels=True, y_labels=h % n_cols == 0, cell=cell,
                      axis_names=axis_names)
        ax.set_xlabel("")  # one shared "source"/"target" label per figure instead
        ax.set_ylabel("")
        ax.set_title(f"head {h}")
        used.append(ax)
    fig.supxlabel(axis_names[0])
    fig.supylabel(axis_names[1])
    fig.colorbar(image, ax=used, label="attention weight", fraction=0.02, pad=0.01)
    if title is not None:
        fig.suptitle(title)
    return _with_fallback_font(fig)


#: Inches per cell of a score grid, and the most cells in which the value is written.
_SCORE_CELL_INCHES, _SCORE_MAX_LABELLED = 0.45, 400


def _scores(scores: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``scores`` as float64 arrays of one shape ``(L, H)``, checked: values in [0, 1] or NaN (no row to average).

    :raises ValueError: naming the score: no scores, not 2-D, shapes that differ, values outside [0, 1].
    """
    if not scores:
        raise ValueError("score_grid needs at least one score")
    arrays = {}
    for name, value in scores.items():
        if hasattr(value, "detach"):  # torch.Tensor, without importing torch here
            value = value.detach().to("cpu").float().numpy()
        a = np.asarray(value, dtype=np.float64)
        if a.ndim != 2 or 0 in a.shape:
            raise ValueError(f"score {name!r} must have shape (L, H) with L, H >= 1, got {tuple(a.shape)}")
        known = a[~np.isnan(a)]
        if known.size and (not np.isfinite(known).all() or known.min() < -_RANGE_TOLERANCE
                           or known.max() > 1 + _RANGE_TOLERANCE):
            raise ValueError(f"score {name!r} ranges over [{known.min():.4g}, {known.max():.4g}], outside [0, 1]")
        arrays[name] = a
    shapes = {a.shape for a in arrays.values()}
    if len(shapes) > 1:
        raise ValueError(f"every score must have the same (L, H) shape, got {sorted(shapes)}")
    return arrays


def score_grid(scores: Mapping[str, Any], *, title: str | None = None,
               axis_names: tuple[str, str] = ("head", "layer")) -> Figure:
    """One heatmap per score of every attention head, side by side: panel ``name`` shows ``scores[name]``
    ``(L, H)``, cell ``(l, h)`` the score of head ``h`` in layer ``l`` (written in the cell when there are at most
    400). The colour scale is fixed to [0, 1], as in :func:`attention_heatmap`; a NaN cell is left blank.

    :param scores: score name -> ``(L, H)`` values in [0, 1] (a torch tensor or array-like), e.g.
        :meth:`attnkit.inference.head_scores.HeadScores.named`.
    :param axis_names: ``(x axis, y axis)`` names.
    :raises ValueError: as :func:`_scores`.
    """
    arrays = _scores(scores)
    L, H = next(iter(arrays.values())).shape
    panel = (max(_MIN_AXES_INCHES, _SCORE_CELL_INCHES * H), max(_MIN_AXES_INCHES, _SCORE_CELL_INCHES * L))
    width = min(_MAX_FIGURE_INCHES, len(arrays) * (panel[0] + 0.8) + 1.5)
    fig = Figure(figsize=(width, min(_MAX_FIGURE_INCHES, panel[1] + 1.6)), layout="constrained")
    axes = fig.subplots(1, len(arrays), squeeze=False)[0]  # (n_scores,) array of Axes
    image = None
    for i, (ax, (name, a)) in enumerate(zip(axes, arrays.items(), strict=True)):
        image = ax.imshow(a, cmap=_CMAP, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(H), labels=[str(h) for h in range(H)])
        ax.set_yticks(range(L), labels=[str(layer) for layer in range(L)] if i == 0 else [])
        ax.set_title(name)
        if L * H <= _SCORE_MAX_LABELLED:
            for (layer, h), value in np.ndenumerate(a):
                if not np.isnan(value):  # dark cells (low values in viridis) get white text
                    ax.text(h, layer, f"{value:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if value < 0.5 else "black")
    fig.supxlabel(axis_names[0])
    fig.supylabel(axis_names[1])
    fig.colorbar(image, ax=list(axes), label="score", fraction=0.03, pad=0.02)
    if title is not None:
        fig.suptitle(title)
    return _with_fallback_font(fig)


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (dpi 120), creating parent directories.

    :param fig: a figure, e.g. from :func:`attention_heatmap`.
    :param path: destination; must end in ``.png``.
    :return: the path written, as a :class:`~pathlib.Path`.
    :raises ValueError: if the suffix is not ``.png`` (the file would lie about its format).
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"save_figure writes PNG files; give a path ending in .png, not {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=_DPI)
    return path
