"""Kind ``hf-tokenizers``: a Hugging Face ``tokenizer.json`` run by the ``tokenizers`` library, renumbered so
that attnkit's special ids come first (the tokenizer of an imported causal language model).

A causal language model numbers its vocabulary its own way: GPT-2 has one special piece, ``<|endoftext|>`` at id
50256, for both the start and the end of a text; Llama has ``<unk> <s> </s>`` at 0..2 and no padding piece.
attnkit reserves PAD 0, UNK 1, BOS 2, EOS 3 (:mod:`attnkit.vocab`). ``specials`` says which Hugging Face id
plays each of these parts, and the rest follow in Hugging Face's order::

    attnkit id     0 (pad)     1 (unk)     2 (bos)     3 (eos)     4, 5, ...
    HF id          specials[0] specials[1] specials[2] specials[3] every other HF id, in HF's order

A part the model has no piece for (GPT-2's pad, unk and bos; Llama's pad) is null: an *absent* id, a row the
import adds to the model, which its output never scores (:attr:`HFTokenizersModel.absent_ids`,
:class:`attnkit.lm.LanguageModel`'s ``absent_ids``). The end-of-text piece always has an id. An absent id is
called by attnkit's name for it (``<pad>``, ``<unk>``, ``<s>``), unless the vocabulary has a piece of that name
in another part (llama2.c's converted tokenizers keep ``<unk>`` but name no ``unk_token``): then by the first of
``<attnkit-unk>``, ``<attnkit-unk-2>``, ... that it has not, so no two ids spell the same piece.

Encoding is the library's, with the tokenizer's own post-processor: Llama's adds ``<s>`` in front of every text
(attnkit id 2), GPT-2's adds nothing, exactly as Hugging Face's ``AutoTokenizer`` encodes a prompt; special
pieces written in the text are read as those pieces, as there, unless ``tokenizer_config.json`` says
``split_special_tokens: true`` (then they are text, as in attnkit's own tokenizers). Decoding drops the special
pieces (``skip_special_tokens=True``).

Files: ``hf-tokenizer.json`` (the checkpoint's ``tokenizer.json``, byte for byte), ``hf-tokenizer_config.json``
(its ``tokenizer_config.json``, when it has one, kept for ``attnkit export``) and attnkit's ``tokenizer.json``
naming them with ``specials``, ``hf_vocab_size`` (the model's rows, which may be more than the tokenizer's) and
``hf_token_ids``: the checkpoint's ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` as its config gives
them, which ``attnkit export`` writes back (a pad id that is also the end-of-text id has no attnkit id of its own).
"""

from __future__ import annotations

import json
from collections.abc import Container
from itertools import count
from pathlib import Path

import tokenizers

from ..common.errors import UserError
from ..common.files import atomic_write_text
from .pieces import (
    BOS_PIECE,
    EOS_PIECE,
    FORMAT_VERSION,
    HF_TOKENIZERS,
    NUM_SPECIAL,
    PAD_PIECE,
    TOKENIZER_FILE,
    UNK_PIECE,
)

__all__ = ["HF_TOKENIZERS", "HF_TOKENIZER_CONFIG_FILE", "HF_TOKENIZER_FILE", "HFTokenizersModel", "TOKEN_ID_KEYS",
           "absent_piece", "load_hf_tokenizers", "read_tokenizers_json", "write_hf_tokenizers"]

HF_TOKENIZER_FILE, HF_TOKENIZER_CONFIG_FILE = "hf-tokenizer.json", "hf-tokenizer_config.json"
_NAMES = (PAD_PIECE, UNK_PIECE, BOS_PIECE, EOS_PIECE)  # what an absent id is called (absent_piece)
_REIMPORT = "re-import the checkpoint"
#: The checkpoint's own special ids kept in ``hf_token_ids`` (module doc).
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def read_tokenizers_json(text: str, where: str) -> tokenizers.Tokenizer:
    """A ``tokenizers.Tokenizer`` from its JSON, with padding and truncation off (attnkit batches and windows).

    :raises UserError: the library cannot read it, naming ``where``.
    """
    try:
        tk = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a plain Exception for every parse error
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{where}: not a tokenizer the `tokenizers` library can read ({reason})") from None
    tk.no_padding()
    tk.no_truncation()
    return tk


def absent_piece(name: str, vocabulary: Container[str]) -> str:
    """What an absent id is called: ``name`` (``<unk>``), or where ``vocabulary`` has that piece, the first of
    ``<attnkit-unk>``, ``<attnkit-unk-2>``, ... it has not (module doc)."""
    if name not in vocabulary:
        return name
    stem = f"<attnkit-{name.strip('<>/')}"
    return next(p for p in (stem + (f"-{k}>" if k > 1 else ">") for k in count(1)) if p not in vocabulary)


class HFTokenizersModel:
    """A Hugging Face tokenizer, its ids renumbered into attnkit's (kind ``hf-tokenizers``; module doc).

    :param tk: the tokenizer.
    :param specials: the Hugging Face id of attnkit's pad, unk, bos and eos, or None where it has none (eos has one).
    :param hf_size: the model's vocabulary, ``>=`` the tokenizer's (rows past it are ids no text encodes to).
    :param token_ids: the checkpoint's :data:`TOKEN_ID_KEYS` (module doc), or None where the import kept none.
    """

    def __init__(self, tk: tokenizers.Tokenizer, specials: list[int | None], hf_size: int,
                 token_ids: dict[str, int | None] | None = None) -> None:
        present = set(specials) - {None}
        self._tk = tk
        self.specials = list(specials)
        self.hf_size = hf_size
        self.token_ids = token_ids
        self.to_hf: tuple[int | None, ...] = (*self.specials, *(i for i in range(hf_size) if i not in present))
        self.to_attnkit = [0] * hf_size  # every HF id has an attnkit id
        for i, hf in enumerate(self.to_hf):
            if hf is not None:
                self.to_attnkit[hf] = i
        vocabulary = tk.get_vocab(with_added_tokens=True)
        self._absent_pieces = {i: absent_piece(_NAMES[i], vocabulary) for i in self.absent_ids}

    @property
    def size(self) -> int:
        return len(self.to_hf)

    @property
    def mask_id(self) -> None:
        return None

    @property
    def absent_ids(self) -> tuple[int, ...]:
        """The special ids the Hugging Face vocabulary has no piece for (module doc)."""
        return tuple(i for i, hf in enumerate(self.specials) if hf is None)

    def encode(self, texts: list[str], threads: int) -> list[list[int]]:
        """With the tokenizer's post-processor (Llama's ``<s>``); ``threads`` is not used (``RAYON_NUM_THREADS``)."""
        return [[self.to_attnkit[i] for i in e.ids] for e in self._tk.encode_batch(texts, add_special_tokens=True)]

    def pieces(self, text: str) -> list[str]:
        return self._tk.encode(text, add_special_tokens=True).tokens

    def id_to_piece(self, i: int) -> str:
        hf = self.to_hf[i]
        if hf is None:
            return self._absent_pieces[i]
        piece = self._tk.id_to_token(hf)
        return piece if piece is not None else f"<row {hf}>"  # a model row past the tokenizer's vocabulary

    def decode(self, ids: list[int]) -> str:
        """The library's decoding of the Hugging Face ids; special pieces are dropped."""
        hf = [self.to_hf[i] for i in ids]
        return self._tk.decode([i for i in hf if i is not None], skip_special_tokens=True)


def _specials_problem(specials: object, hf_size: object) -> str | None:
    if not isinstance(hf_size, int) or isinstance(hf_size, bool) or hf_size < 1:
        return f"hf_vocab_size {hf_size!r} must be a positive integer"
    if not (isinstance(specials, list) and len(specials) == NUM_SPECIAL
            and all(i is None or (isinstance(i, int) and not isinstance(i, bool)) for i in specials)):
        return f"specials {specials!r} must be a list of {NUM_SPECIAL} ids or nulls (pad, unk, bos, eos)"
    present = [i for i in specials if i is not None]
    if specials[-1] is None or len(set(present)) != len(present) or not all(0 <= i < hf_size for i in present):
        return f"specials {specials!r} must be distinct ids below hf_vocab_size {hf_size}, eos among them"
    return None


def _token_ids_problem(token_ids: object) -> str | None:
    if token_ids is None or (isinstance(token_ids, dict) and set(token_ids) == set(TOKEN_ID_KEYS) and all(
            i is None or (isinstance(i, int) and not isinstance(i, bool)) for i in token_ids.values())):
        return None
    return f"hf_token_ids {token_ids!r} must map {', '.join(TOKEN_ID_KEYS)} to ids or nulls"


def load_hf_tokenizers(directory: Path, meta: dict, meta_path: Path) -> HFTokenizersModel:
    """The piece model of an ``hf-tokenizers`` directory (``meta`` is its ``tokenizer.json``).

    :raises UserError: a missing or unreadable file, or ``specials`` / ``hf_vocab_size`` that do not fit it, or
        ``hf_token_ids`` that are not ids.
    """
    path = directory / HF_TOKENIZER_FILE
    if not path.is_file():
        raise UserError(f"{path}: Hugging Face tokenizer file not found; {_REIMPORT}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read ({type(e).__name__}); {_REIMPORT}") from None
    tk = read_tokenizers_json(text, str(path))
    specials, hf_size, token_ids = meta.get("specials"), meta.get("hf_vocab_size"), meta.get("hf_token_ids")
    problem = _specials_problem(specials, hf_size) or _token_ids_problem(token_ids)
    if problem is None and tk.get_vocab_size(with_added_tokens=True) > hf_size:
        problem = f"the tokenizer has {tk.get_vocab_size(with_added_tokens=True)} pieces, more than hf_vocab_size"
    if problem:
        raise UserError(f"{meta_path}: {problem}; {_REIMPORT}")
    tk.encode_special_tokens = bool(meta.get("split_special_tokens", False))
    return HFTokenizersModel(tk, specials, hf_size, token_ids)


def write_hf_tokenizers(out: Path, tokenizer_json: str, specials: list[int | None], hf_size: int,
                        tokenizer_config: str | None = None, token_ids: dict[str, int | None] | None = None) -> None:
    """Write an ``hf-tokenizers`` directory (module doc): the files first, ``tokenizer.json`` last.

    :raises UserError: a tokenizer the library cannot read.
    :raises ValueError: ``specials`` that do not fit ``hf_size`` (the importer checks them first), or
        ``token_ids`` that are not :data:`TOKEN_ID_KEYS`' ids.
    """
    tk = read_tokenizers_json(tokenizer_json, "tokenizer.json")
    problem = _specials_problem(specials, hf_size) or _token_ids_problem(token_ids)
    if problem:
        raise ValueError(problem)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / HF_TOKENIZER_FILE, tokenizer_json)
    if tokenizer_config is not None:
        atomic_write_text(out / HF_TOKENIZER_CONFIG_FILE, tokenizer_config)
    model = json.loads(tokenizer_json).get("model") or {}
    settings = json.loads(tokenizer_config) if tokenizer_config is not None else {}
    meta = {"format_version": FORMAT_VERSION, "kind": HF_TOKENIZERS, "joint": True, "src_model": HF_TOKENIZER_FILE,
            "tgt_model": None, "model_type": str(model.get("type", "unknown")).lower(),
            "src_vocab_size": HFTokenizersModel(tk, specials, hf_size).size, "specials": specials,
            "hf_vocab_size": hf_size, "hf_token_ids": token_ids,
            "split_special_tokens": bool(settings.get("split_special_tokens", False)),
            "hf_tokenizer_config": HF_TOKENIZER_CONFIG_FILE if tokenizer_config else None,
            "tokenizers_version": tokenizers.__version__}
    atomic_write_text(out / TOKENIZER_FILE, json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
