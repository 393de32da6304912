"""Attention as figures: heatmaps of :class:`~attnkit.inference.attention_maps.AttentionMaps`.

Pure functions from maps to :class:`matplotlib.figure.Figure` (:mod:`attnkit.viz.plot` draws them);
the caller decides where they are saved.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from matplotlib.figure import Figure

from ..inference.attention_maps import AttentionMaps, AttentionView, translation_maps
from ..runs.load import LoadedRun
from .plot import attention_grid, attention_heatmap, score_grid

#: Longest source text shown in a figure title; longer ones end in "...".
_TITLE_CHARS = 80


#: Kinds whose rows are shares over many keys, each drawn relative to its largest (``scale_to_max``).
SHARES = ("pooling", "windows")


def _layers_of_kind(layers: Sequence[int] | None, n: int) -> list[int]:
    """The layers ``0 .. n-1`` of one kind that ``layers`` names (negative numbers count from its last), in order;
    ``None``: all ``n``."""
    return list(range(n)) if layers is None else sorted({layer % n for layer in layers if -n <= layer < n})


def attention_figures(maps: AttentionMaps, layers: Sequence[int] | None = None) -> Iterator[tuple[str, Figure]]:
    """Heatmaps of every kind, one at a time: ``(file stem, figure)`` pairs (the caller saves each,
    :func:`attnkit.viz.plot.save_figure`, and lets it go, so that a deep model's figures are never all in memory).

    Per kind: the mean over layers and heads (``cross-mean``, when there are several layers) and, for each of
    ``layers``, the mean over heads (``cross-layer0``) and one panel per head (``cross-layer0-heads``, when
    H > 1). A kind with one layer drops the ``-layer0`` (``alignment``). A language model's maps add
    ``head-scores``: its head scores, one panel per score, layer x head.

    :param layers: the layers drawn one by one, from 0 (negative numbers count from the last: -1 is the last
        layer); ``None``: every layer. A kind with fewer layers than the deepest (a 6-layer encoder, a 2-layer
        decoder) draws those it has.
    :raises ValueError: a layer that no kind has (checked before anything is drawn).
    """
    views = maps.views()
    depth = max(len(view.layers) for view in views)
    wrong = [layer for layer in layers or [] if not -depth <= layer < depth]
    if wrong:
        raise ValueError(f"no layer {wrong[0]}: the model's attention has {depth} layer{'s' * (depth > 1)}, "
                         f"0..{depth - 1} (negative numbers count from the last, -1 is {depth - 1})")
    return _draw_figures(maps, views, layers)


def _draw_figures(maps: AttentionMaps, views: list[AttentionView], layers: Sequence[int] | None
                  ) -> Iterator[tuple[str, Figure]]:
    """:func:`attention_figures`' drawing, figure by figure."""
    heading = maps.heading(_TITLE_CHARS)
    for view in views:
        stem = view.kind.replace("_", "-")
        many = len(view.layers) > 1
        axes = {"axis_names": (view.key_name, view.query_name)}
        scale = {"scale_to_max": view.kind in SHARES}
        if many:
            mean = sum(w.mean(dim=0) for w in view.layers) / len(view.layers)  # per layer (H, T_q, T_k) -> (T_q, T_k)
            yield f"{stem}-mean", attention_heatmap(mean, view.keys, view.queries, **axes, **scale,
                                                    title=f"{heading}\n{view.title}, mean over layers and heads")
        for layer in _layers_of_kind(layers, len(view.layers)):
            weights = view.layers[layer]  # (H, T_q, T_k)
            name, where = (f"{stem}-layer{layer}", f", layer {layer}") if many else (stem, "")
            averaged = ", mean over heads" if weights.size(0) > 1 else ""
            yield name, attention_heatmap(weights.mean(dim=0), view.keys, view.queries, **axes, **scale,
                                          title=f"{heading}\n{view.title}{where}{averaged}")
            if weights.size(0) > 1:
                yield f"{name}-heads", attention_grid(weights, view.keys, view.queries, **axes,
                                                      title=f"{heading}\n{view.title}{where}, per head")
    if maps.head_scores is not None:
        yield "head-scores", score_grid(maps.head_scores.named(), title=f"{heading}\nwhat each head does")


def summary_figure(maps: AttentionMaps) -> Figure:
    """The classic picture: last layer's cross-attention averaged over heads (an RNN's alignment;
    a classifier's token importance)."""
    view = maps.views()[0]
    detail = ", last layer, mean over heads" if view.kind == "cross" else ""
    return attention_heatmap(view.layers[-1].mean(dim=0), view.keys, view.queries,  # (H, T_q, T_k) -> (T_q, T_k)
                             axis_names=(view.key_name, view.query_name), scale_to_max=view.kind in SHARES,
                             title=f"{maps.heading(_TITLE_CHARS)}\n({view.title}{detail})")


def attention_figure(run: LoadedRun, text: str) -> Figure:
    """Translate ``text`` greedily and draw which source pieces each output piece attended to
    (:func:`summary_figure`); used by ``attnkit translate --attention-dir`` and the demo."""
    return summary_figure(translation_maps(run, text))

