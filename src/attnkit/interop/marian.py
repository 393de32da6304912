"""Hugging Face Marian (``MarianMTModel``, the OPUS-MT family) to an attnkit translation run, and back.

The two implement the same equations; what differs is named and mapped here:

==================================  ====================================================================
 Marian (Hugging Face)              attnkit
==================================  ====================================================================
 ``activation_function``            ``activation`` (OPUS-MT: ``swish``)
 sinusoids: sines, then cosines     ``positions: sinusoidal``, ``position_layout: halves`` (a stored
                                    table that is not Marian's, as an attnkit export's: that table)
 ``scale_embedding``                ``scale_embeddings`` (x sqrt(d_model))
 ``final_logits_bias``              ``output_bias`` (the output projection's bias)
 shared, tied embeddings            ``share_embeddings``, ``tie_output``
 ``q_proj``, ``k_proj``, ``v_proj``  ``in_proj`` = ``[W^Q; W^K; W^V]`` (rows stacked)
 ``*_layer_norm`` (post-norm)       ``norm1`` / ``norm2`` (/ ``norm3``), ``norm_first: false``
 ``fc1``, ``fc2``                   ``ff.w1``, ``ff.w2``
==================================  ====================================================================

**Vocabulary.** Marian numbers its one vocabulary (``vocab.json``) with ``</s>`` = 0, ``<unk>`` = 1 and
``<pad>`` last, and starts decoding from ``<pad>`` (``decoder_start_token_id``), whose embedding is the
decoder's first input. attnkit reserves ``<pad> <unk> <s> </s>`` = 0..3 and starts from ``<s>``. The
import renumbers: attnkit id ``i`` holds Marian id ``order[i]`` with ``order = [pad, unk, pad, eos, the
rest in Marian's order]``, so ``<s>`` is a copy of Marian's start row and attnkit's vocabulary is one
longer. ``<s>`` is never an output (its bias is ``-inf``); nor is ``<pad>`` where the model's generation
settings forbid it (``bad_words_ids``, as OPUS-MT's do). The tokenizer keeps Marian's two SentencePiece
models and maps their pieces through the renumbered vocabulary, as ``MarianTokenizer`` does
(:mod:`attnkit.data.pieces`). The export does the reverse: attnkit's ``<pad>`` row is dropped and ``<s>``
becomes Marian's ``<pad>``.

Decoding differences: Hugging Face's length penalty divides by ``length ** alpha`` where attnkit uses
GNMT's; greedy search is the same, token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..common.errors import UserError
from ..config.schema import DataConfig, ModelConfig, RunConfig, TokenizerConfig
from ..data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, save_sentencepiece_vocab
from ..positions import sinusoidal_table
from ..runs.load import languages
from ..tasks import load_run, require
from ..transformer import Transformer, TransformerConfig
from .hf import HFDirectory, check_shape, tensor, write_directory, write_run

#: Marian's activation names -> attnkit's.
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}
#: Marian's sub-layer names -> attnkit's, per encoder and decoder layer.
ENCODER_LAYER = {"self_attn_layer_norm": "norm1", "fc1": "ff.w1", "fc2": "ff.w2", "final_layer_norm": "norm2"}
DECODER_LAYER = {"self_attn_layer_norm": "norm1", "encoder_attn_layer_norm": "norm2", "fc1": "ff.w1",
                 "fc2": "ff.w2", "final_layer_norm": "norm3"}
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")
BOS_PIECE = "<s>"


POSITION_TABLES = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")


def position_kind(state: dict[str, torch.Tensor], d_model: int) -> tuple[str, str]:
    """``(positions, position_layout)``: Marian computes its sinusoids in halves; a checkpoint that stores
    another table (an attnkit export: interleaved, or learned) is read as what it holds."""
    stored = [state[k].float() for k in POSITION_TABLES if k in state]
    for layout in ("halves", "interleaved"):
        if all(torch.allclose(t, sinusoidal_table(t.size(0), d_model, layout), atol=1e-5) for t in stored):
            return "sinusoidal", layout
    return "learned", "interleaved"


def marian_config(hf: HFDirectory, state: dict[str, torch.Tensor]) -> TransformerConfig:
    """attnkit's dimensions and options for the Marian model ``hf.config`` describes (``state``: its weights)."""
    hf.refuse("share_encoder_decoder_embeddings", True, "imports Marian models with one shared vocabulary")
    hf.refuse("tie_word_embeddings", True, "imports Marian models whose output layer is the embedding")
    hf.refuse("normalize_before", False, "imports Marian's post-norm layers only")
    hf.refuse("add_final_layer_norm", False, "imports Marian's post-norm layers only")
    hf.refuse("static_position_embeddings", True, "imports Marian's sinusoidal positions only")
    d_model = hf.key("d_model")
    if d_model % 2:
        raise UserError(f"{hf.path / 'config.json'}: key 'd_model' is {d_model}; Marian's sinusoids need an even width")
    positions, layout = position_kind(state, d_model)
    return TransformerConfig(
        d_model=d_model, n_heads=hf.same("encoder_attention_heads", "decoder_attention_heads"),
        d_ff=hf.same("encoder_ffn_dim", "decoder_ffn_dim"), encoder_layers=hf.key("encoder_layers"),
        decoder_layers=hf.key("decoder_layers"), dropout=float(hf.key("dropout", (int, float), 0.1)),
        attention_dropout=float(hf.key("attention_dropout", (int, float), 0.0)),
        activation_dropout=float(hf.key("activation_dropout", (int, float), 0.0)),
        norm_first=False, positions=positions, position_layout=layout,
        max_len=hf.key("max_position_embeddings"), share_embeddings=True, tie_output=True,
        activation=hf.choice("activation_function", ACTIVATIONS, "gelu"),
        scale_embeddings=bool(hf.key("scale_embedding", bool, False)), output_bias=True)


def _forbidden(hf: HFDirectory) -> set[int]:
    """Token ids the model's generation settings never emit (``bad_words_ids`` of one token)."""
    generation = hf.json("generation_config.json", {}) or {}
    bad = generation.get("bad_words_ids", hf.config.get("bad_words_ids")) or []
    return {int(w[0]) for w in bad if isinstance(w, list) and len(w) == 1 and isinstance(w[0], int)}


def marian_vocabulary(hf: HFDirectory) -> tuple[list[str], list[int]]:
    """``(pieces, order)``: attnkit id ``i`` is the piece ``pieces[i]``, Marian id ``order[i]`` (module doc)."""
    for name in TOKENIZER_FILES:
        hf.file(name, "MarianTokenizer's files: source.spm, target.spm and vocab.json")
    path = hf.path / "vocab.json"
    vocab = hf.json("vocab.json")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise UserError(f"{path}: expected an object of pieces and their ids")
    size = hf.key("vocab_size")
    if sorted(vocab.values()) != list(range(size)):
        raise UserError(f"{path}: holds {len(vocab)} pieces with ids {min(vocab.values(), default=0)}.."
                        f"{max(vocab.values(), default=-1)}, but config.json key 'vocab_size' is {size}")
    tokenizer_config = hf.json("tokenizer_config.json", {}) or {}
    if tokenizer_config.get("separate_vocabs"):
        raise UserError(f"{hf.path / 'tokenizer_config.json'}: key 'separate_vocabs' is true; attnkit imports "
                        f"Marian models with one shared vocabulary")
    piece = {i: p for p, i in vocab.items()}
    unk_piece = str(tokenizer_config.get("unk_token") or "<unk>")
    if unk_piece not in vocab:
        raise UserError(f"{path}: lacks the unknown piece {unk_piece!r} (tokenizer_config.json 'unk_token')")
    pad, eos, unk = hf.key("pad_token_id"), hf.key("eos_token_id"), vocab[unk_piece]
    start = hf.key("decoder_start_token_id", int, pad)
    if start != pad:
        raise UserError(f"{hf.path / 'config.json'}: key 'decoder_start_token_id' is {start}, not the pad id {pad}; "
                        f"attnkit imports Marian models that start decoding from <pad>")
    if len({pad, eos, unk}) < 3 or not all(0 <= i < size for i in (pad, eos)):
        raise UserError(f"{hf.path / 'config.json'}: pad ({pad}), eos ({eos}) and unk ({unk}) ids must be "
                        f"distinct ids of the vocabulary")
    bos = BOS_PIECE if BOS_PIECE not in vocab else "<s:decoder-start>"
    order = [pad, unk, pad, eos] + [i for i in range(size) if i not in (pad, unk, eos)]
    pieces = [piece[pad], piece[unk], bos, piece[eos]] + [piece[i] for i in order[4:]]
    return pieces, order


def _attention(state: dict, out: dict, hf_prefix: str, prefix: str, path: Path) -> None:
    qkv = [tensor(state, path, f"{hf_prefix}.{p}_proj.weight") for p in "qkv"]
    out[f"{prefix}.in_proj.weight"] = torch.cat(qkv)  # (3 d_model, d_model): [W^Q; W^K; W^V]
    out[f"{prefix}.in_proj.bias"] = torch.cat([tensor(state, path, f"{hf_prefix}.{p}_proj.bias") for p in "qkv"])
    for kind in ("weight", "bias"):
        out[f"{prefix}.out_proj.{kind}"] = tensor(state, path, f"{hf_prefix}.out_proj.{kind}")


def _linear(state: dict, out: dict, hf_name: str, name: str, path: Path) -> None:
    for kind in ("weight", "bias"):
        out[f"{name}.{kind}"] = tensor(state, path, f"{hf_name}.{kind}")


def marian_state(hf: HFDirectory, state: dict[str, torch.Tensor], cfg: TransformerConfig, order: list[int]
                 ) -> dict[str, torch.Tensor]:
    """attnkit's state dict (:class:`~attnkit.transformer.Transformer` names) from Marian's weights ``state``."""
    path = hf.path
    names = [f"{p}.weight" for p in ("model.shared", "model.encoder.embed_tokens", "model.decoder.embed_tokens")]
    embedding = tensor(state, path, *names, "lm_head.weight")
    check_shape(embedding, (hf.key("vocab_size"), cfg.d_model), names[0], path)
    index = torch.tensor(order)
    out = {"encoder.embed.embedding.weight": embedding[index]}  # (V + 1, d_model), rows renumbered
    bias = tensor(state, path, "final_logits_bias") if "final_logits_bias" in state else torch.zeros(1, len(order) - 1)
    bias = check_shape(bias.reshape(1, -1), (1, embedding.size(0)), "final_logits_bias", path)[0, index].clone()
    bias[BOS_ID] = float("-inf")  # <s> is an input only
    if order[PAD_ID] in _forbidden(hf):
        bias[PAD_ID] = float("-inf")  # as Hugging Face's generate, which bans <pad>
    out["out_proj.bias"] = bias
    if cfg.positions == "learned":
        out["encoder.positions.table.weight"] = tensor(state, path, POSITION_TABLES[0])
        out["positions.table.weight"] = tensor(state, path, POSITION_TABLES[1])
    for i in range(cfg.encoder_layers):
        hf_layer, layer = f"model.encoder.layers.{i}", f"encoder.layers.{i}"
        _attention(state, out, f"{hf_layer}.self_attn", f"{layer}.self_attn", path)
        for hf_name, name in ENCODER_LAYER.items():
            _linear(state, out, f"{hf_layer}.{hf_name}", f"{layer}.{name}", path)
    for i in range(cfg.decoder_layers):
        hf_layer, layer = f"model.decoder.layers.{i}", f"layers.{i}"
        _attention(state, out, f"{hf_layer}.self_attn", f"{layer}.self_attn", path)
        _attention(state, out, f"{hf_layer}.encoder_attn", f"{layer}.cross_attn", path)
        for hf_name, name in DECODER_LAYER.items():
            _linear(state, out, f"{hf_layer}.{hf_name}", f"{layer}.{name}", path)
    return out


def import_marian(hf: HFDirectory, out: str | Path, *, force: bool = False) -> Path:
    """Write the attnkit translation run of Marian model ``hf`` into ``out`` (see the module doc)."""
    weights = hf.weights()
    cfg = marian_config(hf, weights)
    pieces, order = marian_vocabulary(hf)
    beam = hf.json("generation_config.json", {}).get("num_beams") or hf.config.get("num_beams") or 4
    run_cfg = RunConfig(
        task="translate", model=ModelConfig(arch="transformer", transformer=cfg),
        data=DataConfig(imported_from=str(hf.path.resolve()), max_len=cfg.max_len - 4,
                        tokenizer=TokenizerConfig(vocab_size=len(pieces), joint=True)),
        decode_beam=int(beam))
    source_model = (hf.path / "source.spm").read_bytes()
    target_model = (hf.path / "target.spm").read_bytes()

    def write_tokenizer(directory: Path) -> object:
        return save_sentencepiece_vocab(directory, source_model, target_model, pieces)

    state = marian_state(hf, weights, cfg, order)
    model = Transformer(cfg, len(pieces), len(pieces))
    own = model.state_dict()
    for key, value in state.items():
        check_shape(value, own[key].shape, key, hf.path)
    tied = {"tgt_embed.embedding.weight", "out_proj.weight"}  # the shared embedding, loaded through its first name
    unset = sorted(set(own) - set(state) - tied)
    if unset:  # a mapping error, never the user's: say so plainly
        raise RuntimeError(f"the Marian mapping leaves {unset} unset")
    model.load_state_dict(state, strict=False)
    return write_run(out, run_cfg, model.state_dict(), hf.path, write_tokenizer, force=force)


def _check_exportable(cfg: TransformerConfig, tok_joint: bool, name: str) -> None:
    problems = [why for bad, why in [
        (cfg.norm_first, "it is pre-norm (model.transformer.norm_first); Marian is post-norm"),
        (not (cfg.share_embeddings and cfg.tie_output and tok_joint),
         "its source and target embeddings are not one shared, tied table (Marian's are)"),
        (cfg.attention_score != "scaled_dot", "its attention is not scaled dot-product"),
        (cfg.token_types > 0 or cfg.embedding_norm, "it has BERT's token types or embedding norm"),
        (cfg.encoder_layers < 1 or cfg.decoder_layers < 1, "it lacks an encoder or decoder layer"),
    ] if bad]
    if problems:
        raise UserError(f"{name} cannot be exported to Hugging Face Marian: {problems[0]}")


def hf_order(vocab_size: int) -> list[int]:
    """The attnkit id of each Marian id in an export: ``</s>``, ``<unk>``, the rest, then ``<s>`` as ``<pad>``."""
    return [EOS_ID, UNK_ID] + list(range(4, vocab_size)) + [BOS_ID]


def marian_export_state(model: Transformer) -> dict[str, torch.Tensor]:
    """``MarianMTModel``'s state dict from an attnkit Transformer (the inverse of :func:`marian_state`)."""
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    cfg, index = model.cfg, torch.tensor(hf_order(model.encoder.embed.weight.size(0)))
    embedding = sd["encoder.embed.embedding.weight"][index]
    out = {name: embedding.clone() for name in ("model.shared.weight", "model.encoder.embed_tokens.weight",
                                                  "model.decoder.embed_tokens.weight", "lm_head.weight")}
    bias = sd.get("out_proj.bias", torch.zeros(len(index) + 1))[index].clone()
    bias[-1] = 0.0  # Marian's <pad>: banned by bad_words_ids instead of an infinite bias
    out["final_logits_bias"] = bias[None]  # (1, V - 1)
    out["model.encoder.embed_positions.weight"] = _table(model.encoder.positions)
    out["model.decoder.embed_positions.weight"] = _table(model.positions)
    layers = [("model.encoder.layers", "encoder.layers", cfg.encoder_layers, ENCODER_LAYER, ("self_attn",)),
              ("model.decoder.layers", "layers", cfg.decoder_layers, DECODER_LAYER, ("self_attn", "encoder_attn"))]
    for hf_stack, stack, n, names, attentions in layers:
        for i in range(n):
            for hf_attn in attentions:
                prefix = f"{stack}.{i}.{'self_attn' if hf_attn == 'self_attn' else 'cross_attn'}"
                q, k, v = sd[f"{prefix}.in_proj.weight"].chunk(3)
                qb, kb, vb = sd[f"{prefix}.in_proj.bias"].chunk(3)
                for p, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
                    out[f"{hf_stack}.{i}.{hf_attn}.{p}_proj.weight"] = w.clone()
                    out[f"{hf_stack}.{i}.{hf_attn}.{p}_proj.bias"] = b.clone()
                for kind in ("weight", "bias"):
                    out[f"{hf_stack}.{i}.{hf_attn}.out_proj.{kind}"] = sd[f"{prefix}.out_proj.{kind}"]
            for hf_name, name in names.items():
                for kind in ("weight", "bias"):
                    out[f"{hf_stack}.{i}.{hf_name}.{kind}"] = sd[f"{stack}.{i}.{name}.{kind}"]
    return out


def _table(positions: torch.nn.Module) -> torch.Tensor:
    """A position table as Marian stores it (the export writes attnkit's own, interleaved or learned)."""
    table = positions.table if isinstance(positions.table, torch.Tensor) else positions.table.weight
    return table.detach().float().clone()


def marian_files(model: Transformer, pieces: list[str], beam: int, languages: tuple[str | None, str | None]
                 ) -> dict[str, str]:
    """``config.json``, ``generation_config.json``, ``vocab.json`` and the tokenizer's settings, as text."""
    cfg, order = model.cfg, hf_order(len(pieces))
    size, pad = len(order), len(order) - 1
    names = [pieces[i] for i in order[:-1]] + ["<pad>"]
    vocab = {piece: i for i, piece in enumerate(names)}
    if len(vocab) != size:
        raise UserError("the vocabulary has a piece named <pad> besides its padding; it cannot be exported to Marian")
    config = {
        "architectures": ["MarianMTModel"], "model_type": "marian", "vocab_size": size, "decoder_vocab_size": size,
        "d_model": cfg.d_model, "encoder_layers": cfg.encoder_layers, "decoder_layers": cfg.decoder_layers,
        "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff, "activation_function": cfg.activation,
        "max_position_embeddings": cfg.max_len, "scale_embedding": cfg.scale_embeddings,
        "dropout": cfg.dropout, "attention_dropout": cfg.attention_dropout,
        "activation_dropout": cfg.activation_dropout, "pad_token_id": pad, "eos_token_id": 0,
        "decoder_start_token_id": pad, "forced_eos_token_id": None, "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True, "is_encoder_decoder": True, "dtype": "float32"}
    generation = {"bad_words_ids": [[pad]], "decoder_start_token_id": pad, "eos_token_id": 0, "pad_token_id": pad,
                  "num_beams": beam, "max_length": cfg.max_len, "forced_eos_token_id": None}
    source, target = languages
    tokenizer = {"tokenizer_class": "MarianTokenizer", "source_lang": source or "src", "target_lang": target or "tgt",
                 "separate_vocabs": False, "eos_token": names[0], "unk_token": names[1], "pad_token": "<pad>",
                 "model_max_length": cfg.max_len}
    specials = {"eos_token": names[0], "unk_token": names[1], "pad_token": "<pad>"}
    return {"config.json": config, "generation_config.json": generation, "vocab.json": vocab,
            "tokenizer_config.json": tokenizer, "special_tokens_map.json": specials}


def export_marian(run_path: str | Path, out: str | Path, *, quantization: str = "float32", force: bool = False
                  ) -> Path:
    """Write a Hugging Face Marian directory ``out`` from a Transformer translation run: ``MarianMTModel`` and
    ``MarianTokenizer`` ``.from_pretrained(out)`` load it and translate as attnkit does (module doc)."""
    if quantization != "float32":
        raise UserError(f"--quantization {quantization} is for CTranslate2; a Hugging Face export is float32")
    run = require(load_run(run_path), "translate", run_path, "run", "only translation runs can be exported to Marian")
    model = run.model
    if not isinstance(model, Transformer):
        raise UserError(f"{run_path} is an RNN run; Marian is a Transformer, so only Transformer runs can be exported")
    _check_exportable(model.cfg, run.tok.joint, str(run_path))
    tok_dir, meta = run.run_dir, json.loads((run.run_dir / "tokenizer.json").read_text(encoding="utf-8"))
    pieces = run.tok.tgt_pieces_from_ids(range(run.tok.tgt_vocab_size))
    files = marian_files(model, pieces, run.cfg.decode_beam, languages(run.cfg))
    state = marian_export_state(model)
    src_model, tgt_model = (tok_dir / meta["src_model"]).read_bytes(), (tok_dir / meta["tgt_model"]).read_bytes()

    def write(directory: Path) -> None:
        for name, value in files.items():
            write_json(directory / name, value)
        (directory / "source.spm").write_bytes(src_model)
        (directory / "target.spm").write_bytes(tgt_model)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})

    return write_directory(out, write, marker="config.json", force=force)


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
