"""An interactive attention explorer: one self-contained HTML page per sentence.

The page (template ``explorer.html`` beside this module, drawn by ``explorer.js`` with the style
``explorer.css``, which the serving page of :mod:`attnkit.serve` inlines too) shows the queries of one kind of
attention in a column on the left and its keys on the right, as bertviz does for
encoder-only and decoder-only models, here for every kind :class:`~attnkit.inference.attention_maps.AttentionMaps`
holds: encoder and decoder self-attention, cross-attention, an RNN's alignment and a
classifier's token importance. Pick the kind, layer and head (or all heads: one colour per
head, shading by their mean); hover or click a token to draw its weights as lines and shading.
A language model's page marks the continuation (italic) and adds a table per head score
(:mod:`attnkit.inference.head_scores`), layer x head; clicking a cell shows that head.

Everything is inlined (the weights as JSON, the script and the style): the file opens
offline, from a mail attachment or a CI artifact, and loads nothing from the network.
"""

from __future__ import annotations

import html
import json
import math
import re
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.errors import UserError
from ..common.files import atomic_write_text
from ..inference.attention_maps import AttentionMaps, AttentionView

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = ["explorer_data", "explorer_html", "fill_page", "script_json", "write_explorer"]

#: Decimals kept per weight in the page (the file stays small; 1e-4 is below what shading shows).
DECIMALS = 4


def _view_json(view: AttentionView) -> dict:
    return {
        "kind": view.kind,
        "title": view.title,
        "queries": view.queries,
        "keys": view.keys,
        "queries_label": view.query_name,
        "keys_label": view.key_name,
        # per layer (H, T_q, T_k) -> nested lists [layer][head][query][key]
        "layers": [[[[round(float(w), DECIMALS) for w in row] for row in head] for head in layer.tolist()]
                   for layer in view.layers],
        "generated_from": view.generated_from,  # a language model's first continuation token, else None
    }


def _scores_json(maps: AttentionMaps, views: list[AttentionView]) -> dict | None:
    """A language model's head scores for the page: names, one-line notes, values ``[score][layer][head]`` (None
    where a score had no row to average), and the index of the view a clicked cell selects."""
    scores = maps.head_scores
    if scores is None:
        return None
    named, notes = scores.named(), scores.notes()
    return {
        "names": list(named),
        "notes": [notes[name] for name in named],
        # per score (L, H) -> nested lists [layer][head]; NaN (no row to average) -> null, which JSON has
        "values": [[[None if math.isnan(v) else round(v, DECIMALS) for v in row] for row in value.tolist()]
                   for value in named.values()],
        "view": next(i for i, v in enumerate(views) if v.kind == "decoder_self"),
    }


def explorer_data(maps: AttentionMaps) -> dict:
    """What the explorer's script draws (``mountExplorer(root, data)`` in ``explorer.js``): the title,
    every view of ``maps``, weights as nested lists ``[layer][head][query][key]``, and a language model's head
    scores (``scores``, else None); plain JSON types, no NaN."""
    views = maps.views()
    return {"title": maps.heading(), "views": [_view_json(v) for v in views], "scores": _scores_json(maps, views)}


def script_json(data: object) -> str:
    """``data`` as JSON to embed in a ``<script>`` element: ``<`` escaped (``\\u003c``), so no token text can
    close the element or inject markup."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")


def fill_page(template: Traversable, fills: dict[str, str]) -> str:
    """The page ``template`` (package data, e.g. ``files("attnkit.serve") / "serve.html"``) with its
    ``__ATTNKIT_...__`` placeholders filled from ``fills``, and the explorer's script and style inlined
    (``__ATTNKIT_EXPLORER_JS__``, ``__ATTNKIT_EXPLORER_CSS__``)."""
    assets = files(__package__)
    fills = {**fills, "__ATTNKIT_EXPLORER_JS__": assets.joinpath("explorer.js").read_text(encoding="utf-8"),
             "__ATTNKIT_EXPLORER_CSS__": assets.joinpath("explorer.css").read_text(encoding="utf-8")}
    # one pass: a placeholder inside a sentence (or the script) is text, not a slot to fill
    return re.sub("|".join(map(re.escape, fills)), lambda m: fills[m.group(0)],
                  template.read_text(encoding="utf-8"))


def explorer_html(maps: AttentionMaps) -> str:
    """The explorer page for ``maps`` as one HTML string (no external resources).

    The weights are embedded as JSON with ``<`` escaped (:func:`script_json`); the script inserts
    tokens as text, never HTML.
    """
    data = explorer_data(maps)
    return fill_page(files(__package__).joinpath("explorer.html"),
                     {"__ATTNKIT_TITLE__": html.escape(f"attnkit attention: {data['title']}"),
                      "__ATTNKIT_DATA__": script_json(data)})


def write_explorer(maps: AttentionMaps, path: str | Path) -> Path:
    """Write :func:`explorer_html` to ``path`` (atomically, parent directories created); returns the path.

    :raises UserError: the file cannot be written.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, explorer_html(maps))
    except OSError as e:
        raise UserError(f"{path}: cannot write the explorer page ({e.strerror})") from None
    return path
