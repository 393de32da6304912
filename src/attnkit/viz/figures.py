"""Attention as figures: heatmaps of :class:`~attnkit.inference.attention_maps.AttentionMaps`.

Pure functions from maps to :class:`matplotlib.figure.Figure` (:mod:`attnkit.viz.plot` draws them);
the caller decides where they are saved.
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure

from ..inference.attention_maps import AttentionMaps, attention_maps
from ..runs.load import LoadedRun
from .plot import attention_grid, attention_heatmap, score_grid

#: Longest source text shown in a figure title; longer ones end in "...".
_TITLE_CHARS = 80


#: Kinds whose rows are shares over many keys, each drawn relative to its largest (``scale_to_max``).
SHARES = ("pooling", "windows")


def attention_figures(maps: AttentionMaps) -> dict[str, Figure]:
    """Heatmaps of every kind: file stem -> figure (the caller saves them, :func:`attnkit.viz.plot.save_figure`).

    Per kind: the mean over heads of each layer (``cross-layer0``), one panel per head
    (``cross-layer0-heads``, when H > 1) and the mean over layers and heads (``cross-mean``,
    when there are several layers). A kind with one layer drops the ``-layer0`` (``alignment``). A language
    model's maps add ``head-scores``: its head scores, one panel per score, layer x head.
    """
    figures: dict[str, Figure] = {}
    heading = maps.heading(_TITLE_CHARS)
    for view in maps.views():
        stem = view.kind.replace("_", "-")
        many = len(view.layers) > 1
        axes = {"axis_names": (view.key_name, view.query_name)}
        scale = {"scale_to_max": view.kind in SHARES}
        if many:
            mean = torch.stack(view.layers).mean(dim=(0, 1))  # (L, H, T_q, T_k) -> (T_q, T_k)
            figures[f"{stem}-mean"] = attention_heatmap(mean, view.keys, view.queries, **axes, **scale,
                                                        title=f"{heading}\n{view.title}, mean over layers and heads")
        for layer, weights in enumerate(view.layers):
            name, where = (f"{stem}-layer{layer}", f", layer {layer}") if many else (stem, "")
            averaged = ", mean over heads" if weights.size(0) > 1 else ""
            figures[name] = attention_heatmap(weights.mean(dim=0), view.keys, view.queries, **axes, **scale,
                                              title=f"{heading}\n{view.title}{where}{averaged}")
            if weights.size(0) > 1:
                figures[f"{name}-heads"] = attention_grid(weights, view.keys, view.queries, **axes,
                                                          title=f"{heading}\n{view.title}{where}, per head")
    if maps.head_scores is not None:
        figures["head-scores"] = score_grid(maps.head_scores.named(), title=f"{heading}\nwhat each head does")
    return figures


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
    return summary_figure(attention_maps(run, text))

