"""Hugging Face BERT (``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``) to an attnkit run.

BERT is attnkit's encoder with options the textbook model leaves off (:mod:`attnkit.layers`):

======================================  ==============================================================
 BERT (Hugging Face)                    attnkit
======================================  ==============================================================
 word embeddings, no scale              ``encoder.embed``, ``scale_embeddings: false``
 learned ``position_embeddings``        ``positions: learned``
 ``token_type_embeddings``              ``token_types`` (one segment: row 0 at every position)
 ``embeddings.LayerNorm``               ``embedding_norm: true``, ``norm_eps: layer_norm_eps``
 ``query``, ``key``, ``value``          ``self_attn.in_proj`` = ``[W^Q; W^K; W^V]``
 ``attention.output``, ``.LayerNorm``   ``self_attn.out_proj``, ``norm1`` (post-norm)
 ``intermediate``, ``output``           ``ff.w1`` (``activation: gelu``), ``ff.w2``, ``norm2``
 ``pooler.dense`` + tanh                ``model.pooler: true`` on the first token (``pooling: first``)
 ``classifier``                         the classification ``head``
 ``cls.predictions``                    the MLM head of a ``task: pretrain`` run (``transform``, ``output_bias``)
 ``[CLS] text [SEP]``                   ``data.frame: true`` (``<s> text </s>``)
======================================  ==============================================================

A sequence-classification checkpoint becomes a classification run (``classify``, ``evaluate``,
``attention``, ``serve``); a bare or masked-LM checkpoint becomes a ``task: pretrain`` run that a
classification config starts from with ``model.init_from`` (a bare checkpoint's MLM head is new,
seeded; fine-tuning reads only the encoder). The vocabulary is renumbered so that ``[PAD] [UNK]
[CLS] [SEP]`` take attnkit's ids 0..3, the rest in BERT's order; the WordPiece tokenizer itself is the
``tokenizers`` library's, reading the renumbered vocabulary (:mod:`attnkit.data.pieces`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..classifier import TransformerClassifier
from ..common.errors import UserError
from ..config.schema import DataConfig, ModelConfig, RunConfig, TokenizerConfig
from ..data.hf_tokenizer import read_vocab_txt
from ..data.tokenizer import save_wordpiece, wordpiece_from_vocab_txt
from ..mlm import MaskedLanguageModel
from ..transformer import TransformerConfig
from .hf import HFDirectory, check_shape, read_json, tensor, write_run

ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "silu": "swish", "swish": "swish"}
ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForPreTraining")
#: attnkit's special ids 0..3 take these BERT pieces (tokenizer_config.json may rename them).
SPECIALS = (("pad_token", "[PAD]"), ("unk_token", "[UNK]"), ("cls_token", "[CLS]"), ("sep_token", "[SEP]"))


def bert_config(hf: HFDirectory) -> TransformerConfig:
    """attnkit's encoder dimensions and options for the BERT model ``hf.config`` describes."""
    hf.refuse("position_embedding_type", "absolute", "has absolute (learned) positions, not relative ones")
    hf.refuse("is_decoder", False, "imports BERT as an encoder")
    layers = hf.key("num_hidden_layers")
    return TransformerConfig(
        d_model=hf.key("hidden_size"), n_heads=hf.key("num_attention_heads"), d_ff=hf.key("intermediate_size"),
        encoder_layers=layers, decoder_layers=0, dropout=float(hf.key("hidden_dropout_prob", (int, float), 0.1)),
        attention_dropout=float(hf.key("attention_probs_dropout_prob", (int, float), 0.1)), norm_first=False,
        positions="learned", max_len=hf.key("max_position_embeddings"),
        activation=hf.choice("hidden_act", ACTIVATIONS, "gelu"), scale_embeddings=False,
        token_types=hf.key("type_vocab_size", int, 2), embedding_norm=True,
        norm_eps=float(hf.key("layer_norm_eps", (int, float), 1e-12)))


def architecture(hf: HFDirectory, state: dict[str, torch.Tensor]) -> str:
    """Which BERT the checkpoint is: ``config.json``'s ``architectures``, else what its weights hold."""
    named = hf.config.get("architectures") or []
    if named:
        if named[0] not in ARCHITECTURES:
            raise UserError(f"{hf.path / 'config.json'}: key 'architectures' is {named}; attnkit imports "
                            f"{', '.join(ARCHITECTURES)}")
        return str(named[0])
    if "classifier.weight" in state:
        return "BertForSequenceClassification"
    return "BertForMaskedLM" if any(k.startswith("cls.predictions") for k in state) else "BertModel"


def bert_vocabulary(hf: HFDirectory) -> tuple[str, list[str], list[int], str | None]:
    """``(tokenizer JSON, pieces, order, mask piece)``: attnkit id ``i`` is ``pieces[i]``, BERT id ``order[i]``."""
    settings = {**(hf.json("special_tokens_map.json", {}) or {}), **(hf.json("tokenizer_config.json", {}) or {})}
    if (hf.path / "tokenizer.json").is_file():
        text = (hf.path / "tokenizer.json").read_text(encoding="utf-8")
        model = read_json(hf.path / "tokenizer.json").get("model") or {}
        if model.get("type") != "WordPiece" or not isinstance(model.get("vocab"), dict):
            raise UserError(f"{hf.path / 'tokenizer.json'}: key 'model' is not a WordPiece model with a vocab")
        vocab = {str(p): int(i) for p, i in model["vocab"].items()}
    else:
        vocab_txt = hf.file("vocab.txt", "BERT's WordPiece vocabulary: tokenizer.json or vocab.txt")
        vocab = read_vocab_txt(vocab_txt)  # as transformers reads it
        text = wordpiece_from_vocab_txt(vocab_txt, lowercase=bool(settings.get("do_lower_case", True)),
                                        strip_accents=settings.get("strip_accents"))
    size = hf.key("vocab_size")
    if sorted(vocab.values()) != list(range(size)):
        raise UserError(f"{hf.path}: the tokenizer has {len(vocab)} pieces, but config.json key 'vocab_size' is "
                        f"{size}")
    piece = {i: p for p, i in vocab.items()}
    special = []
    for key, default in SPECIALS:
        name = settings.get(key) or default
        name = name.get("content", default) if isinstance(name, dict) else str(name)
        if name not in vocab:
            raise UserError(f"{hf.path}: the vocabulary lacks {key} {name!r}")
        special.append(vocab[name])
    order = special + [i for i in range(size) if i not in special]
    mask = settings.get("mask_token") or "[MASK]"
    mask = mask.get("content", "[MASK]") if isinstance(mask, dict) else str(mask)
    return text, [piece[i] for i in order], order, mask if mask in vocab else None


def encoder_state(state: dict[str, torch.Tensor], path: Path, cfg: TransformerConfig, order: list[int],
                  prefix: str) -> dict[str, torch.Tensor]:
    """attnkit's ``encoder.*`` tensors from BERT's ``embeddings.*`` and ``encoder.layer.*``."""
    p = f"{prefix}embeddings"
    words = check_shape(tensor(state, path, f"{p}.word_embeddings.weight"), (len(order), cfg.d_model),
                        f"{p}.word_embeddings.weight", path)
    out = {"encoder.embed.embedding.weight": words[torch.tensor(order)],
           "encoder.positions.table.weight": tensor(state, path, f"{p}.position_embeddings.weight"),
           "encoder.token_type.weight": tensor(state, path, f"{p}.token_type_embeddings.weight"),
           "encoder.embed_norm.weight": tensor(state, path, f"{p}.LayerNorm.weight"),
           "encoder.embed_norm.bias": tensor(state, path, f"{p}.LayerNorm.bias")}
    for i in range(cfg.encoder_layers):
        hf_layer, layer = f"{prefix}encoder.layer.{i}", f"encoder.layers.{i}"
        for kind in ("weight", "bias"):
            out[f"{layer}.self_attn.in_proj.{kind}"] = torch.cat(
                [tensor(state, path, f"{hf_layer}.attention.self.{n}.{kind}") for n in ("query", "key", "value")])
            for hf_name, name in (("attention.output.dense", "self_attn.out_proj"),
                                  ("attention.output.LayerNorm", "norm1"), ("intermediate.dense", "ff.w1"),
                                  ("output.dense", "ff.w2"), ("output.LayerNorm", "norm2")):
                out[f"{layer}.{name}.{kind}"] = tensor(state, path, f"{hf_layer}.{hf_name}.{kind}")
    return out


def _heads(kind: str, state: dict, path: Path, order: list[int], prefix: str) -> dict[str, torch.Tensor]:
    """The classification head and pooler, or the MLM head, under attnkit's names (none for a bare model)."""
    if kind == "BertForSequenceClassification":
        return {"pooler.weight": tensor(state, path, f"{prefix}pooler.dense.weight"),
                "pooler.bias": tensor(state, path, f"{prefix}pooler.dense.bias"),
                "head.weight": tensor(state, path, "classifier.weight"),
                "head.bias": tensor(state, path, "classifier.bias")}
    if any(k.startswith("cls.predictions") for k in state):
        bias = tensor(state, path, "cls.predictions.bias", "cls.predictions.decoder.bias")
        return {"transform.0.weight": tensor(state, path, "cls.predictions.transform.dense.weight"),
                "transform.0.bias": tensor(state, path, "cls.predictions.transform.dense.bias"),
                "transform.2.weight": tensor(state, path, "cls.predictions.transform.LayerNorm.weight"),
                "transform.2.bias": tensor(state, path, "cls.predictions.transform.LayerNorm.bias"),
                "output_bias": bias[torch.tensor(order)]}
    return {}


def class_names(hf: HFDirectory) -> list[str]:
    """The class names in label-id order (``id2label``, else ``LABEL_i`` for ``num_labels``)."""
    if hf.config.get("problem_type") not in (None, "single_label_classification"):
        raise UserError(f"{hf.path / 'config.json'}: key 'problem_type' is {hf.config['problem_type']!r}; attnkit "
                        f"classifiers pick one label per text")
    labels = hf.config.get("id2label") or {}
    n = len(labels) or hf.key("num_labels", int, 2)
    names = [str(labels.get(str(i), labels.get(i, f"LABEL_{i}"))) for i in range(n)]
    if n < 2 or len(set(names)) != n:
        raise UserError(f"{hf.path / 'config.json'}: key 'id2label' must name at least two distinct classes")
    return names


def import_bert(hf: HFDirectory, out: str | Path, *, force: bool = False) -> Path:
    """Write the attnkit run of BERT checkpoint ``hf`` into ``out`` (see the module doc)."""
    cfg = bert_config(hf)
    text, pieces, order, mask = bert_vocabulary(hf)
    state = {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
             for k, v in hf.weights().items()}
    kind = architecture(hf, state)
    prefix = "bert." if any(k.startswith("bert.") for k in state) else ""
    weights = {**encoder_state(state, hf.path, cfg, order, prefix), **_heads(kind, state, hf.path, order, prefix)}
    data = DataConfig(imported_from=str(hf.path.resolve()), max_len=cfg.max_len, frame=True,
                      tokenizer=TokenizerConfig(vocab_size=len(pieces), model_type="unigram"))
    torch.manual_seed(0)  # a bare checkpoint's new MLM head
    classes = None
    if kind == "BertForSequenceClassification":
        classes = class_names(hf)
        run_cfg = RunConfig(task="classify", data=data,
                            model=ModelConfig(transformer=cfg, pooling="first", pooler=True))
        model: torch.nn.Module = TransformerClassifier(cfg, len(pieces), len(classes), pooling="first", pooler=True)
    else:
        if kind == "BertForMaskedLM" and cfg.activation != "gelu":
            raise UserError(f"{hf.path / 'config.json'}: key 'hidden_act' is {hf.config.get('hidden_act')!r}; "
                            f"attnkit's MLM head uses gelu")
        run_cfg = RunConfig(task="pretrain", data=data, model=ModelConfig(transformer=cfg))
        model = MaskedLanguageModel(cfg, len(pieces))
    own = model.state_dict()
    missing = sorted(set(own) - set(weights) - {k for k in own if k.startswith(("transform.", "output_bias"))})
    if missing:
        raise UserError(f"{hf.path}: the weights lack what attnkit's model needs: {', '.join(missing[:3])}")
    for key, value in weights.items():
        check_shape(value, own[key].shape, key, hf.path)
    model.load_state_dict(weights, strict=False)

    def write_tokenizer(directory: Path) -> object:
        return save_wordpiece(directory, text, pieces, mask)

    return write_run(out, run_cfg, model.state_dict(), hf.path, write_tokenizer, classes=classes, force=force)
