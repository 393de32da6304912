"""What attention learned: every attention map of one sentence, as tensors per kind, layer and head.

A reader runs a trained model on one source text (a language model: a prompt and its continuation) and returns
:class:`AttentionMaps`: :func:`translation_maps` (Transformer or RNN), :func:`classifier_maps`, :func:`lm_maps`.
Each task names its reader (:attr:`attnkit.tasks.TaskSpec.attention_maps`), and :func:`attnkit.tasks.attention_maps`
reads a run with its task's; :mod:`attnkit.viz.figures` draws the maps as heatmaps, :mod:`attnkit.viz.explorer` as an
interactive HTML page.

Each kind is a list over layers of ``(H, T_q, T_k)`` tensors whose rows sum to 1 (softmax
over the keys, Vaswani et al. 2017 Eq. 1; Bahdanau et al. 2015 Eq. 6):

=====================  ===================================  ======================================
kind                   queries (rows)                       keys (columns)
=====================  ===================================  ======================================
``encoder_self``       source pieces ``x_1 .. x_S </s>``    source pieces
``decoder_self``       decoder inputs ``<s> y_1 .. y_T-1``  decoder inputs (look-ahead mask: u <= t)
``decoder_self`` (LM)  prompt + continuation ``y_1 .. y_T``  the same tokens (causal: u <= t)
``cross``              outputs ``y_1 .. y_T </s>``          source pieces
``alignment`` (RNN)    outputs                              source pieces (``alpha^t``: 1 layer, 1 head)
``pooling``            the predicted class                  input pieces (classifier token importance)
``windows``            for / against the predicted class    the windows a long text was read as
=====================  ===================================  ======================================

A classifier reads a text longer than its window as overlapping windows and averages their logits
(:mod:`attnkit.inference.classify`); its ``pooling`` then covers the whole text (each window's token
importance weighted 1/W), ``windows`` shows each window's share of the evidence for the prediction
(first row) and against it (second row), and ``encoder_self`` is the window that argued most for it.

Decoder position t reads ``y_{t-1}`` (``<s>`` first) and predicts ``y_t``: cross-attention rows
are labelled with what the position produced (the question "which source word did this output
word come from"), self-attention with what it read (the question "what does this word relate to").

The target is the given one (forced decoding) or the model's own translation (greedy, or beam
search), fed back under teacher forcing: one pass gives every layer's weights, the same ones
step-by-step decoding computes.

A decoder-only language model (:class:`~attnkit.lm.LanguageModel`) has one kind, its causal self-attention,
over the prompt and its continuation: the model's own, greedy (temperature 0) for ``new_tokens`` tokens or
until ``</s>``, or a given one. Position ``t`` reads ``y_t`` and predicts ``y_{t+1}``, so rows and columns are
the same tokens. Its maps also carry :class:`~attnkit.inference.head_scores.HeadScores`: what each head does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from ..classifier import DecoderClassifier, TransformerClassifier
from ..common.errors import UserError
from ..data.tokenizer import BOS_ID, EOS_ID
from ..lm import LanguageModel
from ..rnn import RNNSeq2Seq
from ..runs.load import LoadedRun
from ..sampling import generate
from ..search import LENPEN, MAX_LEN_A, MAX_LEN_B, beam_search, greedy_search
from ..transformer import Transformer
from .classify import Reading, explain
from .head_scores import LOCAL_WINDOW, REPEAT_LENGTH, HeadScores, head_scores
from .language_model import MAX_NEW_TOKENS, prompt_ids
from .translate import check_source_lengths, output_budget

__all__ = ["NEW_TOKENS", "AttentionMaps", "AttentionReader", "AttentionView", "MapOptions", "classifier_maps",
           "lm_maps", "translation_maps"]

#: How many tokens a language model continues the prompt by (greedily), unless told otherwise.
NEW_TOKENS = 32
#: A character vocabulary's white space, shown as visible marks on the axes (SentencePiece's pieces have ``▁``).
VISIBLE_SPACE = str.maketrans({" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5"})  # ␣ ↵ ⇥


@dataclass(frozen=True)
class AttentionView:
    """One kind of attention with the tokens on its two axes.

    :param kind: ``encoder_self``, ``decoder_self``, ``cross``, ``alignment``, ``pooling`` or ``windows``.
    :param title: human-readable name, e.g. ``"cross-attention"``.
    :param layers: one ``(H, T_q, T_k)`` tensor per layer.
    :param queries: ``T_q`` row labels; ``keys``: ``T_k`` column labels.
    :param query_name: what the queries are (``"output"``); ``key_name``: what the keys are (``"source"``).
    :param generated_from: a language model's: the index of the first continuation token on both axes.
    """

    kind: str
    title: str
    layers: list[Tensor]
    queries: list[str]
    keys: list[str]
    query_name: str
    key_name: str
    generated_from: int | None = None


@dataclass
class AttentionMaps:
    """Every attention weight of one sentence (batch dimension removed, float32 on the CPU).

    :param arch: ``"transformer"``, ``"rnn"``, ``"classifier"`` or ``"lm"`` (a decoder-only language model).
    :param source: the input text (a prompt); ``output``: the translation, ``"label (p=0.93)"``, or the continuation.
    :param forced: True when the target (continuation) was given rather than generated.
    :param src_tokens: source pieces ``x_1 .. x_S`` (``</s>`` included for translation; the prompt's pieces).
    :param tgt_tokens: output pieces ``y_1 .. y_T </s>`` (rows of ``cross``; the continuation's pieces).
    :param tgt_in_tokens: decoder inputs ``<s> y_1 .. y_{T-1}`` (both axes of ``decoder_self``; a language model:
        the prompt's pieces, then the continuation's).
    :param encoder_self: per layer ``(H, S, S)``.
    :param decoder_self: per layer ``(H, T, T)``, zero above the diagonal.
    :param cross: per layer ``(H, T, S)``; an RNN's alignment is one layer with one head ``(1, T, S)``.
    :param pooling: classifier only, ``(S,)``: how much the pooled vector drew on each token.
    :param windows: classifier reading a long text whole, ``(2, W)``: each window's share of the evidence
        for the prediction and against it (a row of zeros when no window argued against).
    :param window_labels: the ``W`` windows (``"1: pieces 0-255, p=0.97"``); ``window_rows``: the two rows
        (``"for pos"``, ``"against"``).
    :param encoder_tokens: the axes of ``encoder_self`` when they are not ``src_tokens`` (one window of a
        long text); ``encoder_note``: what its title adds (which window).
    :param head_scores: a language model's: what each head does (:mod:`attnkit.inference.head_scores`).
    """

    arch: Literal["transformer", "rnn", "classifier", "lm"]
    source: str
    output: str
    forced: bool
    src_tokens: list[str]
    tgt_tokens: list[str] = field(default_factory=list)
    tgt_in_tokens: list[str] = field(default_factory=list)
    encoder_self: list[Tensor] = field(default_factory=list)
    decoder_self: list[Tensor] = field(default_factory=list)
    cross: list[Tensor] = field(default_factory=list)
    pooling: Tensor | None = None
    windows: Tensor | None = None
    window_labels: list[str] = field(default_factory=list)
    window_rows: list[str] = field(default_factory=list)
    encoder_tokens: list[str] = field(default_factory=list)
    encoder_note: str = ""
    encoder_title: str = "encoder self-attention"  # a decoder-only classifier's: causal self-attention
    head_scores: HeadScores | None = None

    def heading(self, max_chars: int | None = None) -> str:
        """``"source -> output"`` (``" (given)"`` when the target was forced): the title of every
        figure, of the explorer page and of ``attnkit attention``'s output line.

        :param max_chars: cut a longer source to this many characters, ending in ``"..."``.
        """
        source = self.source
        if max_chars is not None and len(source) > max_chars:
            source = source[: max_chars - 3] + "..."
        return f"{source} -> {self.output}" + (" (given)" if self.forced else "")

    def views(self) -> list[AttentionView]:
        """The kinds this model has, each with its axis labels (see the module docstring)."""
        views = []
        if self.cross:
            kind, title = ("alignment", "alignment") if self.arch == "rnn" else ("cross", "cross-attention")
            views.append(AttentionView(kind, title, self.cross, self.tgt_tokens, self.src_tokens, "output", "source"))
        if self.encoder_self:
            tokens = self.encoder_tokens or self.src_tokens
            views.append(AttentionView("encoder_self", self.encoder_title + self.encoder_note, self.encoder_self,
                                       tokens, tokens, "source", "source"))
        if self.decoder_self and not self.cross:  # a decoder-only model: its causal self-attention
            views.append(AttentionView("decoder_self", "causal self-attention", self.decoder_self, self.tgt_in_tokens,
                                       self.tgt_in_tokens, "token", "token", generated_from=len(self.src_tokens)))
        elif self.decoder_self:
            views.append(AttentionView("decoder_self", "decoder self-attention", self.decoder_self,
                                       self.tgt_in_tokens, self.tgt_in_tokens, "decoder input", "decoder input"))
        if self.pooling is not None:
            views.append(AttentionView("pooling", "pooled representation's token importance",
                                       [self.pooling[None, None]], [self.output], self.src_tokens, "prediction",
                                       "input"))
        if self.windows is not None:
            views.append(AttentionView("windows", "windows the prediction drew on", [self.windows[None]],
                                       self.window_rows, self.window_labels, "evidence", "window"))
        return views


@dataclass(frozen=True)
class MapOptions:
    """How a reader runs the model: each reader takes what concerns its models and refuses what contradicts them.

    :param beam: beam size for a translation model's own output (1 = greedy); ``lenpen``: GNMT alpha.
    :param reading: a classifier: how a text longer than the window is read (:mod:`attnkit.inference.classify`).
    :param new_tokens: a language model: how many tokens to continue the prompt by (greedily; 0: the prompt only).
    :param window: a language model: ``w`` of the local-window head score.
    """

    beam: int = 1
    lenpen: float = LENPEN
    reading: Reading = "whole"
    new_tokens: int = NEW_TOKENS
    window: int = LOCAL_WINDOW


#: A task's reader (:attr:`attnkit.tasks.TaskSpec.attention_maps`): ``(run, source, target, options) -> maps``, where
#: ``target`` is a translation to force-decode, or a language model's continuation to show (None: the model's own).
AttentionReader = Callable[[LoadedRun, str, str | None, MapOptions], AttentionMaps]
#: The options a reader runs with unless told otherwise.
DEFAULTS = MapOptions()


def _first(weights: list[Tensor]) -> list[Tensor]:
    """Batch element 0 of each ``(1, H, T_q, T_k)`` tensor, as float32 on the CPU."""
    return [w[0].float().cpu() for w in weights]


def _translate_ids(model: Transformer | RNNSeq2Seq, src: Tensor, limit: int | None, beam: int,
                   lenpen: float) -> list[int]:
    """The model's translation of ``src`` ``(1, S)``: output ids with ``</s>`` when it ended with one."""
    a, b = output_budget(limit, src.size(1), MAX_LEN_A, MAX_LEN_B)
    if beam == 1:
        hyp = greedy_search(model, src, max_len_a=a, max_len_b=b)[0]
    else:
        hyp = beam_search(model, src, beam_size=beam, lenpen=lenpen, max_len_a=a, max_len_b=b)[0][0]
    return hyp.tokens + ([EOS_ID] if hyp.ended_with_eos else [])


#: A classifier's input longer than this many pieces is shown by its most important pieces only.
TOP_TOKENS = 40


def _most(importance: Tensor, pieces: list[str], positions: list[int], top: int) -> tuple[Tensor, list[str]]:
    """The ``top`` entries of ``importance`` in text order and their pieces labelled ``piece@position``; all of
    them, unlabelled, when there are at most ``top``."""
    if len(pieces) <= top:
        return torch.arange(len(pieces)), pieces
    keep = importance.topk(top).indices.sort().values  # (top,), in text order
    return keep, [f"{pieces[i]}@{positions[i]}" if positions[i] >= 0 else pieces[i] for i in keep.tolist()]


def classifier_maps(run: LoadedRun, source: str, target: str | None = None, options: MapOptions = DEFAULTS,
                    top: int = TOP_TOKENS) -> AttentionMaps:
    """Self-attention and token importance of a classifier (:func:`attnkit.inference.classify.explain`), read as
    ``options.reading`` says; a classifier reads only the source, so a ``target`` is an error.

    A text that is one window shows that window; over ``top`` pieces (a long review), only the ``top``
    pieces the prediction drew on most, in text order, each labelled ``piece@position``: a readable
    picture instead of a 256 x 256 grid (self-attention rows are then the weights among the kept
    pieces, so they sum to at most 1). A text read as several windows adds the ``windows`` view, and
    its self-attention is the window with the largest evidence for the prediction."""
    if target is not None:
        raise UserError("a classifier reads only the source text; drop the target (--tgt)")
    model = run.model
    if not isinstance(model, (TransformerClassifier, DecoderClassifier)) or run.classes is None:
        raise TypeError(f"expected a classifier run with classes, got {type(model).__name__}")
    e = explain(run, source, options.reading)
    label, n = run.classes[e.predicted], len(e.windows)
    output = f"{label} (p={float(e.probs[e.predicted]):.2f})"
    evidence = e.evidence()  # (W,)
    w = int(evidence.argmax())
    ids = e.windows[w]
    with torch.inference_mode():  # per layer (1, H, T, T)
        encoder_self = model.self_attention(torch.tensor([ids], device=next(model.parameters()).device))
    title = model.attention_title
    keep, window_tokens = _most(e.window_importance[w], run.tok.src_pieces_from_ids(ids),
                                e.positions[w] if n > 1 else list(range(len(ids))), top)
    weights = [x[:, keep][:, :, keep] for x in _first(encoder_self)]  # (H, k, k): weights among the kept pieces
    if n == 1:
        if len(ids) > top:
            output += f"; the {top} of {len(ids)} pieces it drew on most"
        return AttentionMaps("classifier", source, output, False, window_tokens, encoder_self=weights,
                             pooling=e.window_importance[0][keep], encoder_title=title)
    importance = e.importance()  # (L,)
    kept, tokens = _most(importance, e.pieces, list(range(len(e.pieces))), top)
    output += f"; read as {n} windows" + (f", the {top} of {len(e.pieces)} pieces it drew on most"
                                          if len(e.pieces) > top else "")
    p = e.window_logits.softmax(-1)[:, e.predicted]  # (W,) each window's own probability of the label
    spans = [[q for q in where if q >= 0] for where in e.positions]
    support, against = evidence.clamp(min=0), (-evidence).clamp(min=0)  # (W,) each
    shares = torch.stack([support / support.sum().clamp(min=1e-12), against / against.sum().clamp(min=1e-12)])
    return AttentionMaps(
        "classifier", source, output, False, tokens, encoder_self=weights, pooling=importance[kept],
        windows=shares,  # (2, W): each row sums to 1, or is zeros when no window argued that way
        window_labels=[f"{i + 1}: pieces {s[0]}-{s[-1]}, p={float(p[i]):.2f}" for i, s in enumerate(spans)],
        window_rows=[f"for {label}", "against"], encoder_tokens=window_tokens, encoder_title=title,
        encoder_note=f", window {w + 1} of {n} (the strongest for {label})")


def _continuation(model: LanguageModel, ids: list[int], new_tokens: int) -> list[int]:
    """The greedy continuation of ``ids``: at most ``new_tokens`` ids, ending with ``</s>`` if the model chose it."""
    out: list[int] = []
    if new_tokens > 0:
        for token in generate(model, [ids], new_tokens, temperature=0.0):  # (1,) per step
            out.append(int(token[0]))
            if out[-1] == EOS_ID:
                break
    return out


def lm_maps(run: LoadedRun, prompt: str, continuation: str | None = None, options: MapOptions = DEFAULTS
            ) -> AttentionMaps:
    """A language model's causal self-attention over ``prompt`` and its continuation (greedy, or the given one;
    as much of ``options.new_tokens`` as the model's positions leave room for), with every head's scores (the
    local-window score over ``options.window``). The continuation is greedy: a beam other than 1 is an error."""
    model = run.model
    if not isinstance(model, LanguageModel):
        raise TypeError(f"expected a LanguageModel run, got {type(model).__name__}")
    if options.beam != 1:
        raise UserError("a language model's continuation is greedy: drop --beam (it is for translation)")
    new_tokens, window = options.new_tokens, options.window
    if not 0 <= new_tokens <= MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens must be in 0..{MAX_NEW_TOKENS} (0 shows the prompt only), got {new_tokens}")
    ids, _ = prompt_ids(run.tok, prompt, None, 1)  # not empty, every character in a character vocabulary
    context = model.context  # None: any length
    room = new_tokens if context is None else min(new_tokens, context - len(ids))
    if room < 0:
        raise UserError(f"the prompt is {len(ids)} tokens long but the model reads at most {context} "
                        f"(model.transformer.max_len); shorten it")
    model.eval()
    out = _continuation(model, ids, room) if continuation is None else run.tok.encode_src([continuation])[0]
    if context is not None and len(ids) + len(out) > context:
        raise UserError(f"the prompt and the continuation are {len(ids) + len(out)} tokens long but the model "
                        f"reads at most {context} (model.transformer.max_len); shorten them")
    with torch.inference_mode():
        weights = _first(model.attention_weights(torch.tensor([ids + out], device=next(model.parameters()).device)))
    repeat = REPEAT_LENGTH if context is None else min(REPEAT_LENGTH, context // 2)
    low = EOS_ID + 1 + (run.tok.mask_id == EOS_ID + 1)  # the first id that is an ordinary token
    scores = head_scores(model, weights, run.tok.src_vocab_size, low=low, window=window, n=repeat)
    pieces = [p.translate(VISIBLE_SPACE) for p in run.tok.src_pieces_from_ids(ids + out)]  # (T,)
    text = run.tok.decode_src([[i for i in out if i != EOS_ID]])[0]
    return AttentionMaps("lm", prompt, text, continuation is not None, pieces[: len(ids)], pieces[len(ids):],
                         pieces, decoder_self=weights, head_scores=scores)


def translation_maps(run: LoadedRun, source: str, target: str | None = None, options: MapOptions = DEFAULTS
                     ) -> AttentionMaps:
    """Every attention map of a translation model (a Transformer's encoder, decoder and cross-attention; an RNN's
    alignment) for ``source``: under the model's own translation (greedy, or beam search with ``options.beam`` and
    ``options.lenpen``), or force-decoding ``target``.

    :raises UserError: an RNN without attention, a beam below 1, a text longer than the model's positions.
    """
    if run.cfg.model.arch == "rnn" and run.cfg.model.rnn.attention == "none":
        raise UserError(f"{run.weights_path}: this model has no attention to show (model.rnn.attention: none)")
    beam, lenpen = options.beam, options.lenpen
    model = run.model
    if beam < 1:
        raise UserError(f"--beam must be at least 1 (1 = greedy), got {beam}")
    device = next(model.parameters()).device
    src_ids = run.tok.encode_src([source])[0] + [EOS_ID]
    limit = check_source_lengths(model, [src_ids], "the source text")
    src = torch.tensor([src_ids], device=device)  # (1, S)
    model.eval()
    with torch.inference_mode():
        out_ids = _translate_ids(model, src, limit, beam, lenpen) if target is None else (
            run.tok.encode_tgt([target])[0] + [EOS_ID])
        if limit and len(out_ids) > limit:
            raise UserError(f"the target text is {len(out_ids)} subwords long (with </s>) but the model reads at "
                            f"most {limit} (model.transformer.max_len); shorten it")
        tgt_in_ids = [BOS_ID] + out_ids[:-1]  # decoder inputs: <s> y_1 .. y_{T-1}
        tgt_in = torch.tensor([tgt_in_ids], device=device)  # (1, T)
        encoder_self, decoder_self, cross = model.attention_weights(src, tgt_in)  # an RNN's: its alignment alone
    return AttentionMaps(
        run.cfg.model.arch, source, run.tok.decode_tgt([out_ids])[0],
        target is not None, run.tok.src_pieces_from_ids(src_ids), run.tok.tgt_pieces_from_ids(out_ids),
        run.tok.tgt_pieces_from_ids(tgt_in_ids), _first(encoder_self), _first(decoder_self), _first(cross))
