"""Hugging Face causal language models (GPT-2, Llama, Mistral, Qwen2) to ``task: lm`` runs, and ``task: lm`` runs
back.

``attnkit import DIR -o RUN`` writes an ordinary language-model run (``config.yaml``, the tokenizer,
``imported.safetensors``) on which ``generate``, ``evaluate --data``, ``attention`` and fine-tuning with
``model.init_from`` work unchanged. The architectures are mapped in :mod:`attnkit.interop.gpt2` and
:mod:`attnkit.interop.llama`, and each family's spec names its mapping (:data:`attnkit.interop.families.FAMILIES`);
this module does what they share:

**Vocabulary.** The tokenizer is the checkpoint's own ``tokenizer.json``, run by the ``tokenizers`` library
(kind ``hf-tokenizers``, :mod:`attnkit.data.tokenizers_json`), so a prompt becomes exactly the ids
transformers' ``AutoTokenizer`` gives it (Llama's ``<s>`` in front, GPT-2's nothing). Its ids are renumbered
so that the end-of-text token (``eos_token_id``) is attnkit's ``</s>`` (3), the token the post-processor puts in
front of every text (Llama's ``<s>``; else a distinct ``bos_token_id``) attnkit's ``<s>`` (2), the model's
unknown piece ``<unk>`` (1) and a distinct ``pad_token_id`` ``<pad>`` (0); the rest follow in Hugging Face's
order. A part the model has no piece
for (GPT-2's pad, unk and bos; Llama's pad) becomes an *absent* id: an added embedding row of zeros whose logit
is fixed far below any other (:data:`attnkit.lm.ABSENT_LOGIT`), so probabilities and losses are Hugging
Face's. Generation stops at the model's end-of-text token; attnkit never samples ``<pad>``, ``<unk>`` or
``<s>`` (:data:`attnkit.sampling.NEVER_SAMPLED`), where Hugging Face's ``generate`` could.

**Chat.** The checkpoint's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``) becomes the run's ``data.chat_template``, and the pieces of the other ids of an
``eos_token_id`` list (an instruct model's ``<|im_end|>`` beside its ``<|endoftext|>``) its ``data.end_of_turn``,
at which ``attnkit chat`` stops (:func:`end_ids`, :mod:`attnkit.data.chat_template`). An export writes both back.

``attnkit export RUN --to huggingface -o DIR`` writes a ``GPT2LMHeadModel`` (learned positions, LayerNorm,
biases) or a ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU; ``MistralForCausalLM`` with a ``window``,
``Qwen2ForCausalLM`` with ``qkv_bias``) directory that ``AutoModelForCausalLM`` and ``AutoTokenizer``
``.from_pretrained`` load. An imported run goes back to its original ids, tokenizer files and ``bos_token_id``,
``eos_token_id``, ``pad_token_id`` (kept by the import, a pad that is the end-of-text token too); a character-level
run's tokenizer is written as a ``tokenizers`` JSON that encodes as attnkit does (one piece per character, ids
unchanged, special pieces in the text read as text). A trained SentencePiece tokenizer is refused:
``tokenizers`` does not reproduce SentencePiece's normalisation exactly. One exception to ``AutoTokenizer``:
transformers 5 ignores the ``tokenizer_class`` of a ``qwen2`` directory and builds Qwen2's byte-level BPE from
``tokenizer.json``'s pieces, so a character-level run exported as Qwen2 is read exactly by
``PreTrainedTokenizerFast.from_pretrained`` only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file
from tokenizers import Regex, decoders, pre_tokenizers
from tokenizers.models import WordLevel

from ..common.errors import UserError
from ..config.schema import DataConfig, ModelConfig, RunConfig, TokenizerConfig
from ..data.chat_template import end_of_turn, token_text
from ..data.pieces import BOS_PIECE, CHARACTERS, EOS_PIECE, NUM_SPECIAL, PAD_PIECE, UNK_PIECE
from ..data.tokenizer import Tokenizer
from ..data.tokenizers_json import (
    HF_TOKENIZER_CONFIG_FILE,
    HF_TOKENIZER_FILE,
    HF_TOKENIZERS,
    TOKEN_ID_KEYS,
    HFTokenizersModel,
    read_tokenizers_json,
    write_hf_tokenizers,
)
from ..lm import LanguageModel
from ..tasks import load_run, require
from ..transformer import TransformerConfig
from ..vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from .families import FamilySpec, export_family
from .hf import CONFIG, HFDirectory, check_shape, read_json, write_directory, write_run

#: The context ``attnkit evaluate`` scores with by default (``data.block_size``), at most the model's ``max_len``.
BLOCK_SIZE = 1024
TOKENIZER_JSON, TOKENIZER_CONFIG_JSON = "tokenizer.json", "tokenizer_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"  # transformers' file for a chat template, preferred to tokenizer_config's
#: What ``--to huggingface`` says of a run it does not export.
HF_REFUSAL = "only translation and language-model runs can be exported to Hugging Face"
log = logging.getLogger(__name__)


# -- import ------------------------------------------------------------------------------------------


def _one_id(hf: HFDirectory, key: str) -> int | None:
    """``key`` (``bos_token_id``, ``pad_token_id``) of ``generation_config.json`` (what ``generate`` reads), else of
    ``config.json``."""
    generation = hf.json("generation_config.json", {}) or {}
    name, value = ("generation_config.json", generation[key]) if generation.get(key) is not None else \
        (CONFIG, hf.config.get(key))
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise UserError(f"{hf.path / name}: key '{key}' is {value!r}; attnkit takes one token id")
    return value


def end_ids(hf: HFDirectory, tk: tokenizers.Tokenizer) -> tuple[int | None, list[int]]:
    """``(eos, others)``: the id attnkit's ``</s>`` becomes, and the other ids ``generate`` stops at.

    ``eos_token_id`` (of ``generation_config.json``, which ``generate`` reads, else of ``config.json``) may list
    several: an instruct model's end of turn (``<|im_end|>``, ``<|eot_id|>``) beside its end of text. ``</s>`` is
    then the one ``config.json`` names alone, else the tokenizer's ``eos_token``, else the first listed; the
    others end a turn (``data.end_of_turn``)."""
    generation = hf.json("generation_config.json", {}) or {}
    name, value = ("generation_config.json", generation["eos_token_id"]) \
        if isinstance(generation, dict) and generation.get("eos_token_id") is not None \
        else (CONFIG, hf.config.get("eos_token_id"))
    listed = value if isinstance(value, list) else [] if value is None else [value]
    if not all(type(i) is int for i in listed):
        raise UserError(f"{hf.path / name}: key 'eos_token_id' is {value!r}; expected a token id or a list of them")
    if len(listed) <= 1:
        return (listed[0] if listed else None), []
    settings = hf.json(TOKENIZER_CONFIG_JSON, {})
    piece = token_text(settings.get("eos_token")) if isinstance(settings, dict) else None
    named = hf.config.get("eos_token_id")
    preferred = [named if type(named) is int else None, tk.token_to_id(piece) if piece else None]
    eos = next((i for i in preferred if i in listed), listed[0])
    return eos, [i for i in dict.fromkeys(listed) if i != eos]


def checkpoint_chat_template(hf: HFDirectory) -> str:
    """The checkpoint's chat template, as transformers' ``AutoTokenizer`` finds it ("" if it has none):
    ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (the template, or a list of named
    ones: the one named ``default``)."""
    if (hf.path / CHAT_TEMPLATE_JINJA).is_file():
        try:
            return (hf.path / CHAT_TEMPLATE_JINJA).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{hf.path / CHAT_TEMPLATE_JINJA}: cannot read ({type(e).__name__})") from None
    settings = hf.json(TOKENIZER_CONFIG_JSON, {})
    return settings_chat_template(settings, hf.path / TOKENIZER_CONFIG_JSON) if isinstance(settings, dict) else ""


def settings_chat_template(settings: dict, path: Path) -> str:
    """``chat_template`` of a ``tokenizer_config.json`` (``path``): the template, or of a list of named ones the one
    named ``default``; "" if none."""
    value = settings.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            log.warning("%s: key 'chat_template' names no 'default' template (it has %s); the run has none: give "
                        "one with data.chat_template", path, sorted(map(str, named)))
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise UserError(f"{path}: key 'chat_template' is not a template (a string, or a list of {{name, template}})")
    return value or ""


def _added_in_front(tk: tokenizers.Tokenizer, path: Path) -> int | None:
    """The token the post-processor puts in front of every text (Llama's ``<s>``), or None; one it appends is an
    error (attnkit ends each document with the end-of-text token itself)."""
    bare, full = tk.encode("a", add_special_tokens=False).ids, tk.encode("a", add_special_tokens=True).ids
    for k in range(len(full) - len(bare) + 1):
        if full[k: k + len(bare)] == bare:
            front, back = full[:k], full[k + len(bare):]
            break
    else:
        raise UserError(f"{path}: key 'post_processor' changes the text's own tokens; attnkit reads tokenizers "
                        f"that only add tokens around them")
    if back or len(front) > 1:
        raise UserError(f"{path}: key 'post_processor' adds {len(front)} token(s) in front of a text and {len(back)} "
                        f"after it; attnkit reads tokenizers that add at most one start token")
    return front[0] if front else None


def _unknown(tk: tokenizers.Tokenizer, text: str) -> int | None:
    """The id of the tokenizer model's unknown piece (BPE, WordPiece, WordLevel ``unk_token``; Unigram
    ``unk_id``), or None (byte-level BPE has none)."""
    model = json.loads(text).get("model") or {}
    if isinstance(model.get("unk_id"), int):
        return int(model["unk_id"])
    piece = model.get("unk_token")
    return tk.token_to_id(piece) if isinstance(piece, str) else None


def lm_vocabulary(hf: HFDirectory) -> tuple[str, list[int | None], int, str | None]:
    """``(tokenizer.json text, specials, the model's vocabulary size, tokenizer_config.json text or None)``:
    ``specials`` is the Hugging Face id of attnkit's pad, unk, bos and eos, None where there is none (module doc)."""
    path = hf.file(TOKENIZER_JSON, "the tokenizer, which attnkit reads with the `tokenizers` library")
    text = path.read_text(encoding="utf-8")
    tk = read_tokenizers_json(text, str(path))
    size = hf.key("vocab_size")
    if tk.get_vocab_size(with_added_tokens=True) > size:
        raise UserError(f"{path}: the tokenizer has {tk.get_vocab_size(with_added_tokens=True)} pieces, more than "
                        f"config.json key 'vocab_size' ({size})")
    eos, _ = end_ids(hf, tk)
    if eos is None or not 0 <= eos < size:
        raise UserError(f"{hf.path / CONFIG}: key 'eos_token_id' is {eos!r}; attnkit needs the end-of-text token's id, "
                        f"below vocab_size {size}")
    bos = _added_in_front(tk, path)
    settings_path = hf.path / TOKENIZER_CONFIG_JSON
    settings = read_json(settings_path) if settings_path.is_file() else {}
    if not isinstance(settings, dict):
        raise UserError(f"{settings_path}: expected a JSON object")
    if settings.get("add_eos_token"):
        raise UserError(f"{settings_path}: key 'add_eos_token' is true; attnkit ends each document with the "
                        f"end-of-text token itself")
    if settings.get("add_bos_token") is True and bos is None:
        raise UserError(f"{settings_path}: key 'add_bos_token' is true, but {TOKENIZER_JSON}'s post-processor adds no "
                        f"token; attnkit encodes with {TOKENIZER_JSON} alone")
    if bos == eos:
        raise UserError(f"{path}: key 'post_processor' puts the end-of-text token {eos} in front of every text; "
                        f"attnkit's start and end tokens are two")
    if bos is None:  # a start token no text begins with (GPT-2's is its end-of-text token: then there is none)
        bos = _one_id(hf, "bos_token_id")
        bos = bos if bos is not None and 0 <= bos < size and bos != eos else None
    unk = _unknown(tk, text)
    unk = unk if unk not in (eos, bos) else None
    pad = _one_id(hf, "pad_token_id")
    pad = pad if pad is not None and 0 <= pad < size and pad not in (eos, bos, unk) else None
    return text, [pad, unk, bos, eos], size, settings_path.read_text(encoding="utf-8") if settings_path.is_file() \
        else None


def renumber_rows(t: torch.Tensor, pieces: HFTokenizersModel) -> torch.Tensor:
    """``t`` ``(V_hf, d)`` in Hugging Face's order -> ``(V, d)`` in attnkit's, an absent id's row zeros."""
    rows = torch.tensor([h if h is not None else 0 for h in pieces.to_hf])
    out = t[rows].clone()  # (V, d)
    out[list(pieces.absent_ids)] = 0.0
    return out


def import_causal_lm(hf: HFDirectory, out: str | Path, family: FamilySpec, *, force: bool = False,
                     source: Path | None = None) -> Path:
    """Write the ``task: lm`` run of the GPT-2, Llama, Mistral or Qwen2 checkpoint ``hf`` (of ``family``, whose
    mapping it reads with) into ``out`` (module doc); ``source``: the file the run records as ``imported_from`` when it
    is not ``hf`` itself (a GGUF)."""
    named = hf.config.get("architectures") or []
    if named and named[0] not in family.architectures:
        raise UserError(f"{hf.path / CONFIG}: key 'architectures' is {named}; attnkit imports "
                        f"{', '.join(family.architectures)} as a language model")
    cfg: TransformerConfig = family.config(hf)
    text, specials, hf_size, settings = lm_vocabulary(hf)
    tk = read_tokenizers_json(text, str(hf.path / TOKENIZER_JSON))
    tk.encode_special_tokens = bool(json.loads(settings).get("split_special_tokens", False)) if settings else False
    pieces = HFTokenizersModel(tk, specials, hf_size)
    state = family.state(hf, hf.weights(), cfg)
    for key in ("embed.embedding.weight", "out_proj.weight"):
        if key in state:
            state[key] = renumber_rows(check_shape(state[key], (hf_size, cfg.d_model), key, hf.path), pieces)
    model = LanguageModel(cfg, pieces.size, absent_ids=pieces.absent_ids)
    own = model.state_dict()
    for key, value in state.items():
        check_shape(value, own[key].shape, key, hf.path)
    unset = sorted(set(own) - set(state) - ({"out_proj.weight"} if cfg.tie_output else set()))
    if unset:  # a mapping error, never the user's: say so plainly
        raise RuntimeError(f"the {hf.model_type} mapping leaves {unset} unset")
    model.load_state_dict(state, strict=False)
    source = source or hf.path
    _, turn_ends = end_ids(hf, tk)
    data = DataConfig(imported_from=str(source.resolve()), documents="text", block_size=min(cfg.max_len, BLOCK_SIZE),
                      tokenizer=TokenizerConfig(vocab_size=pieces.size, model_type="bpe"),
                      chat_template=checkpoint_chat_template(hf),
                      end_of_turn=[p for p in map(tk.id_to_token, turn_ends) if p is not None])
    run_cfg = RunConfig(task="lm", data=data, model=ModelConfig(transformer=cfg))

    eos, _ = end_ids(hf, tk)  # one id: an instruct model's list names its ends of turn too (data.end_of_turn)
    token_ids = {key: eos if key == "eos_token_id" else _one_id(hf, key) for key in TOKEN_ID_KEYS}  # exported back

    def write_tokenizer(directory: Path) -> None:
        write_hf_tokenizers(directory, text, specials, hf_size, settings, token_ids)

    return write_run(out, run_cfg, model.state_dict(), source, write_tokenizer, force=force)


# -- export ------------------------------------------------------------------------------------------


def characters_tokenizer_json(tok: Tokenizer) -> str:
    """A ``tokenizers`` JSON that encodes as a ``characters`` tokenizer: every character its own piece, attnkit's
    ids, an unknown character ``<unk>``; the four special pieces are special tokens, which the text never
    spells (transformers' ``split_special_tokens``)."""
    pieces = tok.src_pieces_from_ids(range(tok.src_vocab_size))
    tk = tokenizers.Tokenizer(WordLevel({p: i for i, p in enumerate(pieces)}, unk_token=UNK_PIECE))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    tk.decoder = decoders.Fuse()  # characters joined as they are
    tk.add_special_tokens([tokenizers.AddedToken(p, special=True, normalized=False) for p in pieces[:NUM_SPECIAL]])
    tk.encode_special_tokens = True
    return tk.to_str(pretty=True)


def _export_vocabulary(tok: Tokenizer, run_dir: Path, max_len: int) -> tuple[list[int], dict, dict[str, str]]:
    """``(rows, ids, files)``: the attnkit id of each exported id, the exported bos/eos/pad ids, and the tokenizer
    files by name."""
    if tok.kind == HF_TOKENIZERS:  # back to the checkpoint's own ids and files
        pieces = tok._src  # the run's own piece model, its files checked when the tokenizer was loaded
        if not isinstance(pieces, HFTokenizersModel):
            raise TypeError(f"a {HF_TOKENIZERS} tokenizer holds an HFTokenizersModel, not {type(pieces).__name__}")
        pad, _, bos, eos = pieces.specials
        ids = {"bos": bos if bos is not None else eos, "eos": eos, "pad": pad}  # what an older import implies
        if pieces.token_ids is not None:  # the checkpoint's own, a pad shared with another part included
            ids = {part: pieces.token_ids[f"{part}_token_id"] for part in ids}
        files = {TOKENIZER_JSON: (run_dir / HF_TOKENIZER_FILE).read_text(encoding="utf-8")}
        if (run_dir / HF_TOKENIZER_CONFIG_FILE).is_file():
            files[TOKENIZER_CONFIG_JSON] = (run_dir / HF_TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8")
        else:
            eos_piece = pieces.id_to_piece(EOS_ID)
            files[TOKENIZER_CONFIG_JSON] = _json({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_piece,
                                                  "bos_token": pieces.id_to_piece(BOS_ID) if bos is not None else
                                                  eos_piece, "clean_up_tokenization_spaces": False})
        return pieces.to_attnkit, ids, files
    if tok.kind != CHARACTERS:
        raise UserError(f"{run_dir}: its tokenizer is of kind {tok.kind} ({tok.model_type}), which the `tokenizers` "
                        f"library cannot reproduce exactly; Hugging Face exports take character-level and imported "
                        f"runs")
    names = {"pad_token": PAD_PIECE, "unk_token": UNK_PIECE, "bos_token": BOS_PIECE, "eos_token": EOS_PIECE}
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "split_special_tokens": True,
                "clean_up_tokenization_spaces": False, "model_max_length": max_len}
    files = {TOKENIZER_JSON: characters_tokenizer_json(tok), TOKENIZER_CONFIG_JSON: _json(settings),
             "special_tokens_map.json": _json(names)}
    return list(range(tok.src_vocab_size)), {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID}, files


def _json(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"


def export_causal_lm(run_path: str | Path, out: str | Path, *, quantization: str = "float32", force: bool = False
                     ) -> Path:
    """Write a Hugging Face ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` (``MistralForCausalLM``,
    ``Qwen2ForCausalLM``) directory ``out`` from a ``task: lm`` run (module doc): ``AutoModelForCausalLM`` and
    ``AutoTokenizer`` ``.from_pretrained(out)`` load it."""
    if quantization != "float32":
        raise UserError(f"--quantization {quantization} is for CTranslate2; a Hugging Face export is float32")
    run = require(load_run(run_path), "generate", run_path, "run", HF_REFUSAL)
    cfg = run.model.cfg
    family = export_family(cfg, str(run_path))
    if run.run_dir is None:
        raise ValueError("exporting needs the run's directory (its tokenizer files)")
    rows, ids, files = _export_vocabulary(run.tok, run.run_dir, cfg.max_len)
    sd = {k: v.detach().float().cpu() for k, v in run.model.state_dict().items()}
    index = torch.tensor(rows)
    for key in ("embed.embedding.weight", "out_proj.weight"):
        sd[key] = sd[key][index].contiguous()  # (V_hf, d): the exported ids' rows
    state = family.export_state(sd, cfg)
    config = family.export_config(cfg, len(rows), ids)
    data = run.cfg.data
    settings = json.loads(files[TOKENIZER_CONFIG_JSON])
    if data.chat_template and settings_chat_template(settings, run.run_dir / HF_TOKENIZER_CONFIG_FILE) \
            != data.chat_template:  # not in the tokenizer's settings: in the file transformers reads first
        files[CHAT_TEMPLATE_JINJA] = data.chat_template
    exported_id = {a: h for h, a in enumerate(rows)}  # an absent id has none
    turn_ends = [exported_id[i] for i in end_of_turn(run.tok, data.end_of_turn)[0]
                 if exported_id.get(i, ids["eos"]) != ids["eos"]]  # transformers' generate stops at each one listed
    generation = {"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"], *turn_ends] if turn_ends else ids["eos"],
                  "pad_token_id": ids["pad"]}
    if run.tok.kind == CHARACTERS:  # attnkit never samples these (attnkit.sampling.NEVER_SAMPLED)
        generation["suppress_tokens"] = [PAD_ID, UNK_ID, BOS_ID]

    def write(directory: Path) -> None:
        for name, value in {CONFIG: config, "generation_config.json": generation}.items():
            (directory / name).write_text(_json(value), encoding="utf-8")
        for name, text in files.items():
            (directory / name).write_text(text, encoding="utf-8")
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})

    return write_directory(out, write, marker=CONFIG, force=force)
