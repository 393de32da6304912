"""Export a trained Transformer translation run to CTranslate2, and translate with the export.

A language model (``task: lm``) is exported to a ``ctranslate2.Generator`` model by
:mod:`attnkit.export.ctranslate2_lm` (``--to ctranslate2`` sends there a run whose task generates,
:attr:`attnkit.tasks.TaskSpec.generates`), with its mapping and its ``ExportedGenerator``. What both share is here:
the checks of ``OUT`` (``--force`` replaces only an earlier export), the atomic write (:func:`write_export`), the
manifest (:func:`run_manifest`, :func:`read_manifest`: an export of another task is refused with the command that
reads it) and the layer fillers.

``attnkit export RUN --to ctranslate2 -o OUT`` fills CTranslate2's ``TransformerSpec`` from the
run's weights and writes::

    OUT/model.bin, config.json        the CTranslate2 model (written by ctranslate2.specs)
    OUT/shared_vocabulary.json        the pieces in attnkit's id order (or source_/target_vocabulary.json)
    OUT/tokenizer.json, *.model       the run's SentencePiece model(s), copied
    OUT/attnkit-export.json           this manifest: source run, quantization, decode defaults

How attnkit's layers map onto the spec (the two implement the same equations):

=====================================  ============================================================
 attnkit                               CTranslate2 spec
=====================================  ============================================================
 ``in_proj`` ``[W^Q; W^K; W^V]``        self-attention ``linear[0]`` (fused QKV, same row order);
                                       cross-attention ``linear[0]`` = W^Q, ``linear[1]`` = [W^K; W^V]
 ``out_proj`` (W^O)                     ``linear[-1]``
 ``norm1`` / ``norm2`` (/ ``norm3``)    ``self_attention`` / (``attention``) / ``ffn`` ``layer_norm``:
                                       applied before the sub-layer (``pre_norm``) or after the
                                       residual add (post-norm), as in attnkit
 ``final_norm`` (pre-norm only)         encoder / decoder ``layer_norm``
 embedding x sqrt(d_model) (or x 1)    ``scale_embeddings`` (True / False)
 sinusoidal (interleaved sin/cos) or   ``position_encodings.encodings``, the table itself (CTranslate2's
 learned position table                built-in table concatenates sin and cos, so it is not used)
 ``attention_score: dot``              ``queries_scale = 1`` (scaled_dot: CTranslate2's 1/sqrt(d_k))
 token-type row 0, embedding norm      added to the position table (one segment); ``layernorm_embedding``
 ``activation`` relu / gelu / swish    ``Activation.RELU`` / ``GELU`` / ``SWISH``
 tied ``out_proj`` (+ ``output_bias``)  ``decoder.projection`` = the target embedding (aliased on save)
=====================================  ============================================================

Decoding differences, in one line: CTranslate2 takes one length limit per call, so a batch decodes to
its largest ``floor(a * src_len + b)`` and each output is cut back to its own (exact for greedy,
close for beam); the GNMT length penalty is applied by re-ranking CTranslate2's ``beam`` finished
hypotheses (raw scores, ``length_penalty=0``), which is how attnkit's beam search ranks them too.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch import Tensor, nn

from ..common.errors import UserError
from ..data.tokenizer import BOS_ID, EOS_ID, UNK_ID, Tokenizer
from ..inference.translate import check_decode_options, encode_sources, output_budget, translation_order
from ..positions import SinusoidalPositions
from ..runs.layout import tokenizer_files
from ..runs.load import LoadedRun, languages
from ..search import MAX_LEN_A, MAX_LEN_B, length_penalty
from ..tasks import TASKS, Serves, load_run, require, served_by, spec
from ..transformer import Transformer

MANIFEST = "attnkit-export.json"
FORMAT = "attnkit-ctranslate2"
FORMAT_VERSION = 1
QUANTIZATIONS = ("float32", "int8", "int8_float32", "bfloat16")
#: What ``--to ctranslate2`` says of a run it does not export.
CT2_REFUSAL = "only Transformer translation runs and language models (task: lm) can be exported to CTranslate2"


def _ctranslate2():
    """The ``ctranslate2`` module, or a one-line error saying how to install it."""
    try:
        import ctranslate2
        import ctranslate2.specs  # noqa: F401
    except ImportError:
        raise UserError("CTranslate2 is not installed; `pip install ctranslate2` (an attnkit dependency)") from None
    return ctranslate2


def _array(t: Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _linear(spec, weight: Tensor, bias: Tensor | None) -> None:
    spec.weight = _array(weight)
    if bias is not None:
        spec.bias = _array(bias)


def _norm(spec, norm: nn.Module) -> None:
    """A ``LayerNormSpec`` from an ``nn.LayerNorm`` (gamma, beta) or an ``nn.RMSNorm`` (gamma only)."""
    spec.gamma = _array(norm.weight)
    if getattr(norm, "bias", None) is not None:
        spec.beta = _array(norm.bias)


def _attention(spec, mha: nn.Module, *, cross: bool, dot: bool) -> None:
    """Fill a ``MultiHeadAttentionSpec`` from a :class:`~attnkit.multihead.MultiHeadAttention`."""
    W, b = mha.in_proj.weight, mha.in_proj.bias  # (H*(2*d_k + d_v), d_model): [W^Q; W^K; W^V]
    if cross:
        q = mha.n_heads * mha.d_k
        _linear(spec.linear[0], W[:q], None if b is None else b[:q])  # queries from the decoder
        _linear(spec.linear[1], W[q:], None if b is None else b[q:])  # [W^K; W^V] over the memory
    else:
        _linear(spec.linear[0], W, b)
    _linear(spec.linear[-1], mha.out_proj.weight, mha.out_proj.bias)
    if dot:  # unscaled q.k (seed 003 experiment)
        spec.queries_scale = np.float32(1.0)


def _positions(module: nn.Module) -> np.ndarray:
    table = module.table if isinstance(module, SinusoidalPositions) else module.table.weight  # (max_len, d_model)
    return _array(table)


def _embedding_input(spec, stack: nn.Module) -> None:
    """A stack's input (:class:`~attnkit.transformer.InputEmbedding`): the scale, the position table (with
    the token-type row every position adds folded in: one segment) and the embedding LayerNorm."""
    spec.scale_embeddings = stack.embed.scale != 1.0
    table = _positions(stack.positions)  # (max_len, d_model)
    if stack.token_type is not None:
        table = table + _array(stack.token_type.weight[0])
    spec.position_encodings.encodings = table
    if stack.embed_norm is not None:
        _norm(spec.layernorm_embedding, stack.embed_norm)


def _ffn(spec, ff: nn.Module, norm: nn.Module) -> None:
    """``linear_0`` = W_1 (SwiGLU's gate), ``linear_1`` = W_2, and SwiGLU's W_3 as ``linear_0_noact``."""
    _norm(spec.layer_norm, norm)
    _linear(spec.linear_0, ff.w1.weight, ff.w1.bias)
    _linear(spec.linear_1, ff.w2.weight, ff.w2.bias)
    if ff.w3 is not None:
        _linear(spec.linear_0_noact, ff.w3.weight, ff.w3.bias)


def transformer_spec(model: Transformer, tok: Tokenizer):
    """A validated ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights and ``tok``'s pieces."""
    specs = _ctranslate2().specs
    TransformerSpec, common_spec = specs.TransformerSpec, specs.common_spec
    cfg = model.cfg
    activation = {"relu": "RELU", "gelu": "GELU", "swish": "SWISH"}[cfg.activation]
    spec = TransformerSpec.from_config((cfg.encoder_layers, cfg.decoder_layers), cfg.n_heads,
                                       pre_norm=bool(cfg.norm_first),
                                       activation=getattr(common_spec.Activation, activation),
                                       layernorm_embedding=cfg.embedding_norm)
    dot = cfg.attention_score == "dot"
    encoder, decoder = model.encoder, model
    _embedding_input(spec.encoder, encoder)
    spec.encoder.embeddings[0].weight = _array(encoder.embed.weight)
    for layer_spec, layer in zip(spec.encoder.layer, encoder.layers, strict=True):
        _attention(layer_spec.self_attention, layer.self_attn, cross=False, dot=dot)
        _norm(layer_spec.self_attention.layer_norm, layer.norm1)
        _ffn(layer_spec.ffn, layer.ff, layer.norm2)
    _embedding_input(spec.decoder, decoder)
    spec.decoder.embeddings.weight = _array(decoder.tgt_embed.weight)
    for layer_spec, layer in zip(spec.decoder.layer, decoder.layers, strict=True):
        _attention(layer_spec.self_attention, layer.self_attn, cross=False, dot=dot)
        _norm(layer_spec.self_attention.layer_norm, layer.norm1)
        _attention(layer_spec.attention, layer.cross_attn, cross=True, dot=dot)
        _norm(layer_spec.attention.layer_norm, layer.norm2)
        _ffn(layer_spec.ffn, layer.ff, layer.norm3)
    if cfg.norm_first:
        _norm(spec.encoder.layer_norm, encoder.final_norm)
        _norm(spec.decoder.layer_norm, decoder.final_norm)
    _linear(spec.decoder.projection, decoder.out_proj.weight, decoder.out_proj.bias)
    spec.config.layer_norm_epsilon = cfg.norm_eps
    spec.config.add_source_eos = False  # the caller appends </s> itself, after cutting over-long inputs
    # the special pieces by the tokenizer's names (an imported Marian or BERT vocabulary names its own)
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = tok.tgt_pieces_from_ids([UNK_ID, BOS_ID,
                                                                                                    EOS_ID])
    spec.register_source_vocabulary(tok.src_pieces_from_ids(range(tok.src_vocab_size)))
    spec.register_target_vocabulary(tok.tgt_pieces_from_ids(range(tok.tgt_vocab_size)))
    spec.validate()
    return spec




def export_ctranslate2(run_path: str | Path, out: str | Path, *, quantization: str = "float32",
                       force: bool = False) -> Path:
    """Export a Transformer translation run to a CTranslate2 model directory ``out`` (see module doc); ``attnkit
    export --to ctranslate2`` (:func:`attnkit.export.export_to_ctranslate2`) sends a language model elsewhere.

    :raises UserError: not a translation Transformer, ``out`` exists (without ``force``), unknown quantization.
    """
    check_quantization(quantization)
    return export_translation(load_run(run_path), run_path, out, quantization=quantization, force=force)


def check_quantization(quantization: str) -> None:
    """:raises UserError: ``quantization`` is not one of :data:`QUANTIZATIONS`."""
    if quantization not in QUANTIZATIONS:
        raise UserError(f"--quantization {quantization!r} is not supported; choose one of {', '.join(QUANTIZATIONS)}")


def export_translation(run: LoadedRun, name: str | Path, out: str | Path, *, quantization: str, force: bool) -> Path:
    """:func:`export_ctranslate2` of a loaded run (``name``: how the user named it)."""
    require(run, "translate", name, "run", CT2_REFUSAL)
    if not isinstance(run.model, Transformer):  # an RNNSeq2Seq
        raise UserError(f"{name} is an RNN run; CTranslate2 has no RNN specification, so only Transformer "
                        f"translation runs can be exported (`attnkit translate` reads the run itself)")
    out = check_output(out, force)
    spec = transformer_spec(run.model, run.tok)
    src_lang, tgt_lang = languages(run.cfg)
    manifest = run_manifest(run, quantization, languages=[src_lang, tgt_lang] if src_lang and tgt_lang else None,
                            max_len=run.model.cfg.max_len,
                            decode={"beam": run.cfg.decode_beam, "lenpen": run.cfg.decode_lenpen,
                                    "max_len_a": MAX_LEN_A, "max_len_b": MAX_LEN_B})
    return write_export(out, spec, quantization, run, manifest)


def check_output(out: str | Path, force: bool) -> Path:
    """``out`` as a path, when it may be written: new, or (with ``force``) an earlier export or an empty directory.

    :raises UserError: it exists without ``force``, or it is something else (a run is never replaced).
    """
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out} already exists; choose a new directory or pass --force to replace it")
    if out.exists() and not (is_exported(out) or (out.is_dir() and not any(out.iterdir()))):
        raise UserError(f"{out} exists and is not a CTranslate2 export; --force replaces only an earlier export")
    return out


def run_manifest(run: LoadedRun, quantization: str, **fields: object) -> dict:
    """The manifest of an export of ``run``: what every export records, then the task's own ``fields``."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "engine": "ctranslate2",
            "name": run.run_dir.name, "task": run.task, "source_run": str(run.run_dir.resolve()),
            "weights": run.weights_path.name, "quantization": quantization,
            "parameters": sum(p.numel() for p in run.model.parameters()), **fields}


def write_export(out: Path, spec, quantization: str, run: LoadedRun, manifest: dict) -> Path:
    """Quantize ``spec`` and write it, the run's tokenizer files and ``manifest`` (last) to ``out``, atomically:
    everything goes to a sibling directory first, which then takes ``out``'s place (an earlier export is replaced
    only then), so ``out`` is never half-written.

    :raises UserError: the directory cannot be written.
    """
    spec.optimize(quantization=quantization)
    tmp = out.with_name(f".{out.name}.tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        spec.save(str(tmp))
        tok_dir = run.run_dir
        for name in tokenizer_files(tok_dir):
            shutil.copy2(tok_dir / name, tmp / name)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")  # last: complete
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{out}: cannot write the export ({e.strerror or e}); check the directory") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out




def is_exported(path: str | Path) -> bool:
    """True for a directory holding a CTranslate2 model (``model.bin``) or an attnkit export manifest.

    A CTranslate2 model exported by another tool is included, so that loading it with
    :class:`ExportedTranslator` says what is missing instead of "not a run directory".
    """
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST).exists() or (path / "model.bin").exists())


@dataclass
class DecodeDefaults:
    beam: int
    lenpen: float
    max_len_a: float
    max_len_b: float


def read_manifest(path: Path, route: Serves) -> dict:
    """The manifest of an attnkit export of a run that answers ``route`` (``translate``: a translation run,
    ``generate``: a language model; :func:`attnkit.tasks.served_by`), checked as far as every export's is alike.

    :raises UserError: no manifest (a foreign CTranslate2 model), an unreadable or foreign one, another
        format version, or an export of another task (saying which command reads it).
    """
    file = path / MANIFEST
    if not file.exists():
        raise UserError(f"{path}: a CTranslate2 model without {MANIFEST}, so not exported by attnkit; "
                        f"export a run with `attnkit export RUN --to ctranslate2 -o {path}`")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: cannot read ({e}); export the run again") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{file}:{e.lineno}:{e.colno}: invalid JSON ({e.msg}); export the run again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{file}: not an attnkit CTranslate2 export (format is not {FORMAT!r}); export the run again")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{file}: format_version {manifest.get('format_version')!r}, this attnkit reads "
                        f"{FORMAT_VERSION}; export the run again")
    found = manifest.get("task")
    if not served_by(found, route):
        if not isinstance(found, str):
            hint = "export the run again"
        else:
            hint = spec(found).hint if found in TASKS else "export a run of this task"
        raise UserError(f"{path} is an export of a {found} run; {hint}")
    return manifest


def open_engine(engine: type, path: Path, threads: int, device: str = "cpu"):
    """``engine`` (``ctranslate2.Translator`` or ``ctranslate2.Generator``) on ``device`` (the CPU with ``threads``
    threads, or ``cuda``).

    :raises UserError: CTranslate2 cannot load the model (one line naming ``model.bin``).
    """
    try:
        return engine(str(path), device=device, intra_threads=threads)
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path / 'model.bin'}: CTranslate2 cannot load it ({first}); export the run again") from None


def _read_manifest(path: Path) -> dict:
    """A translation export's manifest, with its decode defaults checked."""
    file = path / MANIFEST
    manifest = read_manifest(path, "translate")
    decode = manifest.get("decode")
    ok = (isinstance(decode, dict) and isinstance(manifest.get("max_len"), int)
          and isinstance(decode.get("beam"), int)
          and all(isinstance(decode.get(k), (int, float)) for k in ("lenpen", "max_len_a", "max_len_b")))
    if not ok:
        raise UserError(f"{file}: missing or mistyped 'max_len' or 'decode' (beam, lenpen, max_len_a, max_len_b); "
                        f"export the run again")
    return manifest


class ExportedTranslator:
    """Translate with an exported CTranslate2 model, tokenized exactly as ``attnkit translate`` does.

    Attributes: ``name``, ``task`` (``"translate"``), ``languages`` (``[src, tgt]`` or None),
    ``parameters``, ``quantization``, ``max_len`` and ``decode`` (:class:`DecodeDefaults`).

    :param threads: CTranslate2 intra-op threads (0: its default).
    :raises UserError: a corrupt, incomplete or foreign directory, one line naming the file.
    """

    def __init__(self, path: str | Path, *, threads: int = 0) -> None:
        ctranslate2 = _ctranslate2()
        self.path = Path(path)
        manifest = _read_manifest(self.path)
        self.name = str(manifest.get("name") or self.path.name)
        self.task = "translate"
        self.languages = manifest.get("languages")
        self.parameters = int(manifest.get("parameters") or 0)
        self.quantization = str(manifest.get("quantization"))
        self.max_len: int = manifest["max_len"]
        d = manifest["decode"]
        self.decode = DecodeDefaults(int(d["beam"]), float(d["lenpen"]), float(d["max_len_a"]), float(d["max_len_b"]))
        self.tok = Tokenizer.load(self.path)
        self._check_vocabulary()
        self._target_ids = {p: i for i, p in enumerate(self.tok.tgt_pieces_from_ids(range(self.tok.tgt_vocab_size)))}
        self._eos_piece = self.tok.tgt_pieces_from_ids([EOS_ID])[0]
        self.translator = open_engine(ctranslate2.Translator, self.path, threads)

    def _check_vocabulary(self) -> None:
        """The vocabulary files must list the tokenizer's pieces in id order (else ids would not match)."""
        expect = {"source": self.tok.src_pieces_from_ids(range(self.tok.src_vocab_size)),
                  "target": self.tok.tgt_pieces_from_ids(range(self.tok.tgt_vocab_size))}
        shared = self.path / "shared_vocabulary.json"
        files = {side: shared if shared.exists() else self.path / f"{side}_vocabulary.json" for side in expect}
        for side, file in files.items():
            try:
                pieces = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise UserError(f"{file}: cannot read the {side} vocabulary ({type(e).__name__}); export the run "
                                f"again") from None
            if pieces != expect[side]:
                raise UserError(f"{file}: the {side} vocabulary does not match the SentencePiece model beside it; "
                                f"export the run again")

    def translate(self, texts: list[str], *, beam: int, n_best: int = 1, lenpen: float,
                  max_len_a: float = MAX_LEN_A, max_len_b: float = MAX_LEN_B, batch_size: int = 64
                  ) -> list[list[str]]:
        """Like :func:`attnkit.inference.translate.translate_texts`: ``n_best`` translations per text, in input order.

        Inputs longer than the model's positions are cut (one warning each); blank texts give
        empty translations.
        """
        check_decode_options(beam=beam, n_best=n_best, lenpen=lenpen, max_len_a=max_len_a, max_len_b=max_len_b,
                             batch_size=batch_size)
        limit = self.max_len
        ids = encode_sources(self.tok, texts, limit)
        out: list[list[str]] = [[""] * n_best for _ in texts]

        def budget(i: int) -> int:  # attnkit's per-sentence output budget (attnkit.search.max_lengths)
            a, b = output_budget(limit, len(ids[i]), max_len_a, max_len_b)
            return max(1, math.floor(a * len(ids[i]) + b))

        for chunk in translation_order(ids, batch_size):
            budgets = [budget(i) for i in chunk]
            results = self.translator.translate_batch(
                [self.tok.src_pieces_from_ids(ids[i]) for i in chunk], beam_size=beam,
                num_hypotheses=beam, length_penalty=0.0, return_scores=True,
                return_end_token=True, max_decoding_length=max(budgets), min_decoding_length=0,
                max_input_length=0)
            for i, cap, result in zip(chunk, budgets, results, strict=True):
                ranked = []
                for pieces, score in zip(result.hypotheses, result.scores, strict=True):
                    ended = bool(pieces) and pieces[-1] == self._eos_piece
                    tokens = [self._target_ids.get(p, UNK_ID) for p in (pieces[:-1] if ended else pieces)]
                    if len(tokens) + ended > cap:  # past this sentence's own budget: cut there, without </s>
                        tokens, ended = tokens[:cap], False
                    ranked.append((score / length_penalty(len(tokens) + ended, lenpen), tokens))
                ranked.sort(key=lambda r: r[0], reverse=True)
                out[i] = self.tok.decode_tgt([tokens + [EOS_ID] for _, tokens in ranked[:n_best]])
        return out
