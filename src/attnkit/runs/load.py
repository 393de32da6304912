"""Loading a trained run: its config, tokenizer, classes and model, and what it can be used for.

:func:`build_model` is the one model factory: the trainer builds a new model with it and every
other command rebuilds a trained one with it before loading the weights (:func:`load_run`).
:func:`require` is the one check that a command got the kind of run it needs, with a hint of
what to do instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..classifier import DecoderClassifier, TransformerClassifier
from ..common.errors import UserError
from ..common.log import to_stderr
from ..config.loader import load_config
from ..config.schema import RunConfig
from ..data.tokenizer import BOS_ID, EOS_ID, UNK_ID, Tokenizer
from ..engine import Engine, prepare, resolve
from ..lm import LanguageModel
from ..lora import apply_lora, lora_state_dict, merge_lora
from ..mlm import MaskedLanguageModel, ReplacedTokenDetection
from ..rnn import RNNSeq2Seq
from ..transformer import Transformer
from .adapters import checked_base
from .checkpoint import check_compatible, load_weights
from .layout import CLASSES_FILE, CONFIG_FILE, find_run, find_weights

__all__ = ["LoadedRun", "build_model", "languages", "load_run", "load_trained", "read_classes", "require"]


@dataclass
class LoadedRun:
    """A trained run: ``model`` holds the weights of ``weights_path`` and decodes with the engine."""

    cfg: RunConfig
    tok: Tokenizer
    model: nn.Module
    classes: list[str] | None  # class names (classification), else None
    weights_path: Path
    run_dir: Path | None = None
    engine: Engine = field(default_factory=Engine)  # how ``model`` runs

    @property
    def task(self) -> str:
        return self.cfg.task


def read_classes(path: Path) -> list[str]:
    """The class names a classifier run was trained with (``classes.json``)."""
    try:
        classes = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read the class names ({type(e).__name__}); is this a complete run?") from None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise UserError(f"{path}: expected a JSON list of class names")
    return classes


def build_translation_model(cfg: RunConfig, tok: Tokenizer, classes: list[str] | None = None) -> nn.Module:
    """A :class:`Transformer` or :class:`RNNSeq2Seq` sized for the tokenizer's vocabularies."""
    V_src, V_tgt = tok.src_vocab_size, tok.tgt_vocab_size
    if cfg.model.arch == "rnn":
        return RNNSeq2Seq(cfg.model.rnn, V_src, V_tgt)
    tcfg = cfg.model.transformer
    if tcfg.share_embeddings and not tok.joint:
        raise UserError("model.transformer.share_embeddings needs data.tokenizer.joint: true")
    return Transformer(tcfg, V_src, V_tgt)


def build_classifier(cfg: RunConfig, tok: Tokenizer, classes: list[str] | None) -> nn.Module:
    """The classifier for the run's classes: the encoder-only :class:`TransformerClassifier`, or the
    :class:`DecoderClassifier` over a causal language model's layers (``model.classifier: decoder``)."""
    if cfg.model.arch != "transformer":
        raise UserError("task classify needs model.arch: transformer")
    if classes is None:
        raise UserError(f"a classifier needs its class names ({CLASSES_FILE}); is this a complete run?")
    if 0 < cfg.model.ngram_buckets <= tok.src_vocab_size:
        raise UserError(f"model.ngram_buckets ({cfg.model.ngram_buckets}) must exceed the vocabulary size "
                        f"({tok.src_vocab_size}): unigrams take its ids, bigrams the slots after them")
    if cfg.model.classifier == "decoder":
        return DecoderClassifier(cfg.model.transformer, tok.src_vocab_size, len(classes), pooling=cfg.model.pooling,
                                 ngram_buckets=cfg.model.ngram_buckets)
    return TransformerClassifier(cfg.model.transformer, tok.src_vocab_size, len(classes or []),
                                 pooling=cfg.model.pooling, pooler=cfg.model.pooler,
                                 ngram_buckets=cfg.model.ngram_buckets)


def build_encoder_lm(cfg: RunConfig, tok: Tokenizer, classes: list[str] | None = None) -> nn.Module:
    """The model an encoder is pretrained as (``mlm.objective``): a :class:`MaskedLanguageModel`, or ELECTRA's
    :class:`ReplacedTokenDetection` (its generator never samples a special piece, which no target is)."""
    if cfg.model.arch != "transformer":
        raise UserError("task pretrain needs model.arch: transformer")
    if cfg.mlm.objective == "electra":
        specials = (UNK_ID, BOS_ID, EOS_ID) + ((tok.mask_id,) if tok.mask_id is not None else ())
        return ReplacedTokenDetection(cfg.model.transformer, tok.src_vocab_size,
                                      generator_width=cfg.mlm.generator_width, never_sample=specials)
    return MaskedLanguageModel(cfg.model.transformer, tok.src_vocab_size)


def build_language_model(cfg: RunConfig, tok: Tokenizer, classes: list[str] | None = None) -> nn.Module:
    """The decoder-only :class:`LanguageModel` over the tokenizer's vocabulary (its absent ids never output)."""
    return LanguageModel(cfg.model.transformer, tok.src_vocab_size, absent_ids=tok.absent_ids)


#: The model each task trains, by ``cfg.task``.
MODELS: dict[str, Callable[[RunConfig, Tokenizer, list[str] | None], nn.Module]] = {
    "translate": build_translation_model, "classify": build_classifier, "pretrain": build_encoder_lm,
    "lm": build_language_model}

#: What to do with a run of each task when a command needs another kind.
HINTS = {"translate": "use `attnkit translate`", "classify": "use `attnkit classify`",
         "pretrain": "fine-tune it (model.init_from) first", "lm": "use `attnkit generate`"}


def build_model(cfg: RunConfig, tok: Tokenizer, classes: list[str] | None = None) -> nn.Module:
    """The model of ``cfg.task`` and ``cfg.model``, sized for ``tok`` (and ``classes``), freshly initialised."""
    return MODELS[cfg.task](cfg, tok, classes)


def load_trained(model: nn.Module, cfg: RunConfig, run_dir: Path, weights: Path) -> nn.Module:
    """Load the trained weights of the run ``run_dir`` (its config ``cfg``, its weights file ``weights``) into
    ``model``, a model :func:`build_model` made for it -> ``model``.

    A run's weights file holds every weight; an adapted run's (``model.lora``) holds its adapters only, which go on
    its base's weights (the file :func:`~attnkit.runs.adapters.checked_base` checks; an adapted base is loaded so in
    turn) and are merged into them (:func:`~attnkit.lora.merge_lora`): the model is a plain one that computes as the
    adapted one did, at no extra cost.
    """
    state, _ = load_weights(weights)
    if cfg.model.lora is None:
        check_compatible(model.state_dict(), state, weights)
        model.load_state_dict(state)
        return model
    base = checked_base(run_dir)
    base_dir = find_run(base)
    base_cfg = load_config(RunConfig, base_dir / CONFIG_FILE)
    load_trained(model, base_cfg, base_dir, base)
    apply_lora(model, cfg.model.lora)
    check_compatible(lora_state_dict(model), state, weights)
    model.load_state_dict(state, strict=False)
    return merge_lora(model)


def base_run(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The directory of the run ``run_dir`` was trained on (``model.init_from``): an adapted run's checked base
    (:func:`~attnkit.runs.adapters.checked_base`), else the run ``init_from`` names if it is still there; None."""
    if cfg.model.lora is not None:
        return find_run(checked_base(run_dir))
    start = Path(cfg.model.init_from) if cfg.model.init_from else None
    return find_weights(start)[0] if start is not None and start.exists() else None


def inherit_chat(cfg: RunConfig, run_dir: Path, depth: int = 8) -> RunConfig:
    """``cfg`` with the chat template of the run it was trained on (and so on up) where it has none of its own, and
    that run's end-of-turn pieces unless it lists some: a model fine-tuned from an instruct model speaks as that
    model (``attnkit chat``, the server and the export read them) -> ``cfg``, changed in place."""
    base = base_run(cfg, run_dir) if depth > 0 and not cfg.data.chat_template else None
    if base is not None:
        base_cfg = inherit_chat(load_config(RunConfig, base / CONFIG_FILE), base, depth - 1)
        cfg.data.chat_template = cfg.data.chat_template or base_cfg.data.chat_template
        cfg.data.end_of_turn = cfg.data.end_of_turn or list(base_cfg.data.end_of_turn)
    return cfg


def load_run(path: str | Path, device: torch.device | None = None, engine: Engine | None = None) -> LoadedRun:
    """Config (:func:`inherit_chat`), tokenizer and model with trained weights (an adapted run's merged into its
    base's: :func:`load_trained`), from a run directory or checkpoint file, made to run as ``engine`` says (default:
    :class:`~attnkit.engine.Engine`'s, the engine's eager kernels in float32)."""
    run_dir, weights = find_weights(Path(path))
    cfg = inherit_chat(load_config(RunConfig, run_dir / CONFIG_FILE), run_dir)
    tok = Tokenizer.load(run_dir)
    classes = read_classes(run_dir / CLASSES_FILE) if (run_dir / CLASSES_FILE).exists() else None  # classifiers
    model = load_trained(build_model(cfg, tok, classes), cfg, run_dir, weights)
    model = model.to(device or torch.device("cpu"))
    engine, choice = resolve(model, engine or Engine())
    if choice is not None:
        to_stderr(f"attnkit: --precision auto: {choice.describe()}")
    model = prepare(model, engine).eval()
    return LoadedRun(cfg, tok, model, classes, weights, run_dir, engine)


def require(run: LoadedRun, task: str, name: str | Path, what: str = "model", hint: str | None = None
            ) -> LoadedRun:
    """``run`` when it was trained for ``task``; else a :class:`UserError` naming its task and what to do.

    :param name: how the user named the run (the command's argument).
    :param hint: what to say instead of the default hint for the run's task (:data:`HINTS`).
    """
    if run.task != task:
        raise UserError(f"{name} is a {run.task} {what}; {hint or HINTS[run.task]}")
    return run


def language(path: str | None) -> str | None:
    """The two-letter language code in a corpus file name (``train.de.gz`` -> ``de``), if it has one."""
    suffixes = [s[1:] for s in Path(path or "").suffixes if s != ".gz"]
    return suffixes[-1] if suffixes and re.fullmatch(r"[a-z]{2}", suffixes[-1]) else None


def languages(cfg: RunConfig) -> tuple[str | None, str | None]:
    """``(source, target)`` language codes of a translation run, read from its two training file names
    (``train.de.gz``, ``train.en.gz``); None where a name has none (or the corpus is one file)."""
    data = cfg.data
    if not data.train_tgt:
        return None, None
    return language(data.train), language(data.train_tgt)
