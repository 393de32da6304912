"""Export a decoder-only language model (``task: lm``) to CTranslate2, and generate with the export.

``attnkit export RUN --to ctranslate2 -o OUT`` on a language-model run fills CTranslate2's
``TransformerDecoderModelSpec`` (what a ``ctranslate2.Generator`` runs, as for GPT-2 or Llama) and writes::

    OUT/model.bin, config.json        the CTranslate2 model (written by ctranslate2.specs)
    OUT/vocabulary.json               the pieces in attnkit's id order
    OUT/tokenizer.json, *.model       the run's tokenizer files, copied
    OUT/attnkit-export.json           the manifest: source run, quantization, context (attnkit.export.ctranslate2)

How :class:`~attnkit.lm.LanguageModel` maps onto the spec (the layers are the translation export's,
:mod:`attnkit.export.ctranslate2`, without cross-attention; these are the language model's options):

=======================================  ==========================================================
 attnkit (``model.transformer``)          CTranslate2 ``TransformerDecoderSpec``
=======================================  ==========================================================
 ``in_proj`` ``[W^Q; W^K; W^V]``          ``self_attention.linear[0]``; ``n_kv_heads``: ``num_heads_kv``
                                         (each key/value head serves consecutive query heads in both)
 ``norm_first`` (default true) / false    ``pre_norm`` (+ ``layer_norm`` = ``final_norm``) / post-norm
 ``norm: layernorm`` / ``rmsnorm``         ``LayerNormSpec`` gamma, beta / ``rms_norm`` (gamma only)
 ``activation`` relu / gelu / gelu_tanh    ``Activation.RELU`` / ``GELU`` / ``GELUTanh`` / ``SWISH``
 / swish
 ``activation: swiglu``                   ``ffn_glu`` + ``SWISH``: ``linear_0`` = W_1 (gate),
                                         ``linear_0_noact`` = W_3 (up), ``linear_1`` = W_2
 ``bias: false``                          no ``bias`` in any ``LinearSpec``
 ``qkv_bias`` (Qwen2)                     ``self_attention.linear[0].bias`` = ``[b^Q; b^K; b^V]``; none on
                                         ``linear[1]`` (each ``LinearSpec``'s bias is optional on its own)
 ``positions: learned`` / ``sinusoidal``  ``position_encodings.encodings``, the table itself
 ``positions: rope``, ``rope_theta``      ``rotary_dim = 0`` (every dimension), ``rotary_interleave =
                                         False`` (pairs ``(i, i + d/2)``, attnkit's layout), ``rotary_base``
 ``positions: alibi``                     ``alibi``: CTranslate2 adds ``m_h (s - t_last)``, which differs
                                         from ``-m_h (t - s)`` by a constant per query row (the softmax
                                         ignores it); the slopes are the paper's in both
 ``positions: none``                      ``encodings`` = zeros, ``max_len`` rows (CTranslate2 always adds a
                                         table), so the export sees at most ``max_len`` positions
 ``window``                               ``sliding_window``: each position sees the ``window`` keys ending
                                         at its own
 ``attention_score: dot``                 ``queries_scale = 1``
 embedding x sqrt(d_model) (or x 1)      ``scale_embeddings``
 tied ``out_proj`` (+ ``output_bias``)    ``projection`` = the embedding (aliased on save)
=======================================  ==========================================================

Refused, with one line naming the option and nothing written: a vocabulary in which two ids spell the
same piece (CTranslate2 maps each piece to one id). :class:`ExportedGenerator` generates as
:func:`attnkit.sampling.generate` does: greedy decoding gives the same tokens; samples come from
CTranslate2's own random generator, and its top-p keeps the nucleus of ``softmax(z / T)`` where attnkit
keeps that of ``softmax(z)`` (the same at ``T = 1``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ..common.errors import UserError
from ..data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from ..inference.language_model import MAX_NEW_TOKENS, ContextLimit, TextStream, check_sampling, context_limit
from ..lm import LanguageModel
from ..runs.load import LoadedRun
from ..sampling import in_float32
from .ctranslate2 import (
    MANIFEST,
    _array,
    _attention,
    _ctranslate2,
    _ffn,
    _linear,
    _norm,
    _positions,
    check_output,
    open_engine,
    read_manifest,
    run_manifest,
    write_export,
)

VOCABULARY = "vocabulary.json"
#: attnkit's activation -> CTranslate2's ``Activation`` (swiglu: SWISH, gated by ``ffn_glu``).
ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "gelu_tanh": "GELUTanh", "swish": "SWISH", "swiglu": "SWISH"}


def pieces_of(tok: Tokenizer) -> list[str]:
    """Every piece in id order, checked to be distinct (CTranslate2 looks ids up by piece).

    :raises UserError: two ids spell the same piece, naming it.
    """
    pieces = tok.src_pieces_from_ids(range(tok.src_vocab_size))
    seen: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        if piece in seen:
            raise UserError(f"the vocabulary has the piece {piece!r} twice (ids {seen[piece]} and {i}); CTranslate2 "
                            f"maps each piece to one id, so this language model cannot be exported to it")
        seen[piece] = i
    return pieces


def decoder_spec(model: LanguageModel, tok: Tokenizer):
    """A validated ``ctranslate2.specs.TransformerDecoderModelSpec`` with ``model``'s weights, ``tok``'s pieces."""
    specs = _ctranslate2().specs
    cfg = model.cfg
    pre_norm = model.final_norm is not None
    kv = cfg.n_kv_heads if cfg.n_kv_heads and cfg.n_kv_heads != cfg.n_heads else None
    spec = specs.TransformerDecoderModelSpec.from_config(
        cfg.decoder_layers, cfg.n_heads, pre_norm=pre_norm,
        activation=getattr(specs.common_spec.Activation, ACTIVATIONS[cfg.activation]),
        ffn_glu=cfg.activation == "swiglu", rms_norm=cfg.norm == "rmsnorm", alibi=cfg.positions == "alibi",
        rotary_dim=0 if cfg.positions == "rope" else None, rotary_interleave=False, rotary_base=cfg.rope_theta,
        num_heads_kv=kv, sliding_window=cfg.window or None)
    decoder = spec.decoder
    decoder.scale_embeddings = model.embed.scale != 1.0
    decoder.embeddings.weight = _array(model.embed.weight)
    if model.positions is not None:
        decoder.position_encodings.encodings = _positions(model.positions)  # (max_len, d_model)
    elif cfg.positions == "none":
        decoder.position_encodings.encodings = np.zeros((cfg.max_len, cfg.d_model), dtype=np.float32)
    dot = cfg.attention_score == "dot"
    for layer_spec, layer in zip(decoder.layer, model.layers, strict=True):
        _attention(layer_spec.self_attention, layer.self_attn, cross=False, dot=dot)
        _norm(layer_spec.self_attention.layer_norm, layer.norm1)
        _ffn(layer_spec.ffn, layer.ff, layer.norm2)
    if pre_norm:
        _norm(decoder.layer_norm, model.final_norm)
    _linear(decoder.projection, model.out_proj.weight, model.out_proj.bias)
    spec.config.layer_norm_epsilon = cfg.norm_eps
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = tok.src_pieces_from_ids(
        [UNK_ID, BOS_ID, EOS_ID])
    spec.register_vocabulary(pieces_of(tok))
    spec.validate()
    return spec


def export_context(model: LanguageModel) -> int | None:
    """The most positions the export sees: the table's ``max_len`` (zeros for ``positions: none``), else None."""
    return model.cfg.max_len if model.cfg.positions in ("learned", "sinusoidal", "none") else None


def export_language_model(run: LoadedRun, out: str | Path, *, quantization: str, force: bool) -> Path:
    """Export a ``task: lm`` run (already loaded) to the CTranslate2 directory ``out`` (see module doc); ``attnkit
    export RUN --to ctranslate2`` calls it through :func:`attnkit.export.export_to_ctranslate2`.

    :raises UserError: ``out`` exists (without ``force``), or the model cannot be represented; nothing is written.
    """
    out = check_output(out, force)
    model = run.model
    if not isinstance(model, LanguageModel):
        raise UserError(f"{run.run_dir} holds a {type(model).__name__}, not a language model; train it with task: lm")
    spec = decoder_spec(model, run.tok)
    manifest = run_manifest(run, quantization, positions=model.cfg.positions, max_len=model.cfg.max_len,
                            context=export_context(model), trained_context=context_limit(run).length,
                            window=model.cfg.window)
    return write_export(out, spec, quantization, run, manifest)


class ExportedGenerator:
    """Continue token ids with an exported language model (``ctranslate2.Generator``).

    Attributes: ``name``, ``task`` (``"lm"``), ``parameters``, ``quantization``, ``context`` (the most positions a
    prompt and its continuation may fill, or None: any), ``limit`` (the run's
    :class:`~attnkit.inference.language_model.ContextLimit`), ``window`` (the sliding window, 0: none), ``tok`` (the
    run's tokenizer) and ``generator`` (the ``ctranslate2.Generator``).
    Prompts are ids as ``tok.encode_src`` gives them (no ``<s>``: attnkit's language models start without one);
    ``<pad>``, ``<unk>`` and ``<s>`` are never generated, as in :func:`attnkit.sampling.generate`.

    :param threads: CTranslate2 intra-op threads (0: its default).
    :param device: ``cpu``, or ``cuda`` where this CTranslate2 build finds the CUDA libraries it was built for.
    :param seed: the seed of this engine's random numbers (None: a random seed). CTranslate2 draws them from one
        generator per worker thread, seeded when the thread first samples, so a seed is given once, here: the
        same seed and the same calls give the same samples.
    :raises UserError: a corrupt, incomplete or foreign directory, or an export of another task; one line.
    """

    task = "lm"

    def __init__(self, path: str | Path, *, threads: int = 0, seed: int | None = None, device: str = "cpu") -> None:
        ctranslate2 = _ctranslate2()
        self.path = Path(path)
        manifest = read_manifest(self.path, "generate")
        context = manifest.get("context")
        if context is not None and not (isinstance(context, int) and context > 0):
            raise UserError(f"{self.path / MANIFEST}: 'context' must be a positive integer or null, got "
                            f"{context!r}; export the run again")
        self.context: int | None = context
        trained = manifest.get("trained_context") or manifest.get("max_len")  # exports before trained_context
        if context is None and not (isinstance(trained, int) and trained > 0):
            raise UserError(f"{self.path / MANIFEST}: 'trained_context' must be a positive integer, got "
                            f"{trained!r}; export the run again")
        self.limit = ContextLimit(context, fixed=True) if context is not None else ContextLimit(trained, fixed=False)
        self.window = int(manifest.get("window") or 0)  # sliding window (0: none)
        self.name = str(manifest.get("name") or self.path.name)
        self.parameters = int(manifest.get("parameters") or 0)
        self.quantization = str(manifest.get("quantization"))
        self.tok = Tokenizer.load(self.path)
        self._pieces = self._check_vocabulary()
        if seed is not None:
            ctranslate2.set_random_seed(seed)
        self.generator = open_engine(ctranslate2.Generator, self.path, threads, device)
        if seed is not None:  # one sample now seeds the worker thread's generator with ``seed``
            self.generator.generate_batch([[self._pieces[EOS_ID]]], max_length=1, sampling_topk=0)

    def _check_vocabulary(self) -> list[str]:
        """The pieces of ``vocabulary.json``, which must be the tokenizer's in id order (else ids would not match)."""
        file = self.path / VOCABULARY
        try:
            pieces = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UserError(f"{file}: cannot read the vocabulary ({type(e).__name__}); export the run again") from None
        if pieces != self.tok.src_pieces_from_ids(range(self.tok.src_vocab_size)):
            raise UserError(f"{file}: the vocabulary does not match the tokenizer beside it; export the run again")
        return pieces

    def _options(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_k: int,
                 top_p: float) -> dict:
        """generate_batch / generate_tokens options, after checking the request (:raises UserError:)."""
        check_sampling(temperature, top_k, top_p)
        if not 0 < max_new_tokens <= MAX_NEW_TOKENS:
            raise UserError(f"max_new_tokens must be in 1..{MAX_NEW_TOKENS}, got {max_new_tokens}")
        V = len(self._pieces)
        for ids in prompts:
            if not len(ids):
                raise UserError("a prompt is empty: give at least one token to continue")
            bad = [i for i in ids if not 0 <= int(i) < V]
            if bad:
                raise UserError(f"token id {bad[0]} is out of range for a vocabulary of {V}")
            if self.context is not None and len(ids) + max_new_tokens > self.context:
                raise UserError(f"the prompt ({len(ids)} tokens) and max_new_tokens {max_new_tokens} exceed the "
                                f"export's {self.context} positions; shorten the prompt or ask for fewer tokens")
        greedy = temperature == 0 or top_k == 1
        # CTranslate2 takes float32: a top-p below its range would be 0, which it refuses (attnkit's own sampling
        # keeps the most likely token however small top-p is, as CTranslate2 does at its smallest)
        sampling = ({"sampling_topk": 1} if greedy else
                    {"sampling_topk": top_k if top_k < V else 0, "sampling_topp": in_float32(top_p),
                     "sampling_temperature": in_float32(temperature)})
        pad, bos = self._pieces[PAD_ID], self._pieces[BOS_ID]
        return {"max_length": max_new_tokens, "disable_unk": True, "suppress_sequences": [[pad], [bos]], **sampling}

    def _prompt_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self._pieces[int(i)] for i in ids]

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 1.0,
                       top_k: int = 0, top_p: float = 1.0, include_eos: bool = False) -> list[list[int]]:
        """The continuation of every prompt, in order: at most ``max_new_tokens`` ids, ending where ``</s>`` was chosen.

        :param temperature: 0 is greedy (argmax); else sample ``softmax(z / T)`` after ``top_k`` (0: all) and
            ``top_p`` (1: all).
        :param include_eos: end a continuation that chose ``</s>`` with :data:`EOS_ID` (so an ended document can
            be told from one cut at ``max_new_tokens``).
        :raises UserError: a bad option, an empty prompt, or a prompt too long for ``context``.
        """
        if not prompts:
            return []
        options = self._options(prompts, max_new_tokens, temperature, top_k, top_p)
        # one call per prompt length: in a batch of unequal prompts CTranslate2 forwards only the shortest length
        # at once and returns the rest of the longer prompts as if generated (within max_length)
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(i)
        out: list[list[int]] = [[] for _ in prompts]
        for length, rows in by_length.items():
            # a prompt longer than a sliding window is read exactly only token by token (include_prompt_in_result:
            # forced steps; CTranslate2 forwards a whole one in chunks that see up to twice the window)
            stepwise = bool(self.window) and length > self.window
            skip = length if stepwise else 0
            results = self.generator.generate_batch(
                [self._prompt_pieces(prompts[i]) for i in rows], include_prompt_in_result=stepwise,
                return_end_token=include_eos, **{**options, "max_length": max_new_tokens + max(skip - 1, 0)})
            for i, result in zip(rows, results, strict=True):  # the prompt leads the result, less a first <s>
                out[i] = list(result.sequences_ids[0])[skip - (stepwise and int(prompts[i][0]) == BOS_ID):]
        return out

    def stream(self, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, include_eos: bool = False) -> Iterator[int]:
        """The continuation of one prompt, id by id as it is generated (options as in :meth:`generate_batch`).

        A prompt longer than a sliding window is continued whole first, then yielded (CTranslate2's streaming
        call forwards the prompt at once, which is exact only up to the window)."""
        if self.window and len(prompt) > self.window:
            yield from self.generate_batch([prompt], max_new_tokens, temperature=temperature, top_k=top_k,
                                           top_p=top_p, include_eos=include_eos)[0]
            return
        options = self._options([prompt], max_new_tokens, temperature, top_k, top_p)
        for step in self.generator.generate_tokens(self._prompt_pieces(prompt), **options):
            if step.token_id == EOS_ID:
                if include_eos:
                    yield EOS_ID
                return
            yield step.token_id

    def continue_text(self, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                      top_p: float = 1.0, stop: Sequence[str] = ()) -> Iterator[str]:
        """The continuation of one prompt as text pieces, as :func:`attnkit.inference.language_model.continue_text`
        gives them: streamed, ending at ``</s>``, after ``max_new_tokens`` or at the first ``stop`` string (not
        yielded)."""
        tokens = self.stream(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        yield from TextStream(self.tok, stop, context=prompt).pieces(tokens)

    def log_probs(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Next-token log-probabilities ``(T, V)`` at every position of each sequence (row ``t`` predicts ``t + 1``),
        as ``log_softmax(LanguageModel(ids))`` gives them.

        :raises UserError: an empty sequence, or one longer than a sliding window (CTranslate2 forwards a whole
            sequence through a sliding-window model only up to ``window`` tokens; generation has no such limit).
        """
        for s in sequences:
            if not len(s) or (self.window and len(s) > self.window):
                raise UserError(f"cannot score a sequence of {len(s)} tokens with this export: it takes 1.."
                                f"{self.window or 'any'} tokens at once")
        out = self.generator.forward_batch([[int(i) for i in s] for s in sequences], return_log_probs=True)
        table = np.asarray(out)  # (B, T_max, V)
        return [table[b, : len(s)] for b, s in enumerate(sequences)]
