"""Piece models: the text <-> id step of a tokenizer, one class per kind of tokenizer directory.

:class:`~attnkit.data.tokenizer.Tokenizer` holds one piece model per side and does what every kind shares
(refusing a bare ``str``, checking id ranges, stopping decoding at the first EOS, dropping PAD/BOS/EOS);
a piece model only maps text to attnkit ids and back. Every kind gives attnkit's fixed special ids
(:mod:`attnkit.vocab`: PAD 0, UNK 1, BOS 2, EOS 3); they differ in where the ids come from:

=======================  ======================================  ===================================================
 kind                     files                                   ids
=======================  ======================================  ===================================================
 ``sentencepiece``        ``spm.model`` or ``src/tgt.model``      the SentencePiece model's own, trained by attnkit
 ``sentencepiece+vocab``  ``src.model``, ``tgt.model``,           ``vocab.json``, a list of pieces in id order; the
                          ``vocab.json``                          models only segment (Hugging Face MarianTokenizer)
 ``wordpiece``            ``wordpiece.json``                      a ``tokenizers`` JSON (BERT's WordPiece) whose
                                                                  vocabulary was renumbered into attnkit's order
 ``characters``           ``characters.json``                     a list of the training text's characters, each
                                                                  its own id after the specials (nanoGPT's char level)
 ``hf-tokenizers``        ``hf-tokenizer.json``                   a Hugging Face causal LM's ``tokenizers`` JSON, its
                                                                  ids renumbered (:mod:`attnkit.data.tokenizers_json`)
=======================  ======================================  ===================================================

Text never encodes to a special piece written in the text (``</s>``, ``[SEP]``, ``[MASK]``): a
SentencePiece model reads control symbols as characters, and the WordPiece model splits special tokens
like text (``tokenizers``' ``encode_special_tokens``), so a review that quotes ``[PAD]`` is not padding.
Decoding follows each original: a trained model writes UNK as `` ⁇ ``; the imported kinds drop UNK
and their other special pieces, as Hugging Face's ``decode(ids, skip_special_tokens=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import sentencepiece as spm
import tokenizers
from tokenizers.models import WordPiece

from attnkit.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID

from ..common.errors import UserError

__all__ = ["KINDS", "CharacterModel", "PieceModel", "load_characters",
           "SentencePieceModel", "VocabSentencePieceModel", "WordPieceModel",
           "load_sentencepiece", "load_wordpiece", "read_vocab", "split_language_code", "vocab_problem"]

PAD_PIECE, UNK_PIECE, BOS_PIECE, EOS_PIECE, MASK_PIECE = "<pad>", "<unk>", "<s>", "</s>", "<mask>"
#: Name of the metadata file inside a tokenizer directory; it names the kind and the other files.
TOKENIZER_FILE = "tokenizer.json"
FORMAT_VERSION = 1
SENTENCEPIECE, SENTENCEPIECE_VOCAB, WORDPIECE = "sentencepiece", "sentencepiece+vocab", "wordpiece"
CHARACTERS, HF_TOKENIZERS = "characters", "hf-tokenizers"
#: The kinds of tokenizer directory (``tokenizer.json``'s ``kind``; absent means ``sentencepiece``).
KINDS: tuple[str, ...] = (SENTENCEPIECE, SENTENCEPIECE_VOCAB, WORDPIECE, CHARACTERS, HF_TOKENIZERS)
JOINT_MODEL_FILE, SRC_MODEL_FILE, TGT_MODEL_FILE = "spm.model", "src.model", "tgt.model"
VOCAB_FILE, WORDPIECE_FILE, CHARACTERS_FILE = "vocab.json", "wordpiece.json", "characters.json"
NUM_SPECIAL = 4  # pad, unk, bos, eos
#: What SentencePiece writes for a space; MarianTokenizer turns any left after decoding into spaces.
SPIECE_UNDERLINE = "\u2581"
_LANGUAGE_CODE_OPEN, _LANGUAGE_CODE_CLOSE = ">>", "<<"


class PieceModel(Protocol):
    """One side's text <-> id mapping, in attnkit ids (see the module docstring for the kinds)."""

    @property
    def size(self) -> int:
        """Number of ids, special ids included."""

    @property
    def mask_id(self) -> int | None:
        """The masked-language-model piece's id, or None."""

    @property
    def absent_ids(self) -> tuple[int, ...]:
        """Special ids with no piece behind them, which a model never outputs (only ``hf-tokenizers`` has any)."""

    def encode(self, texts: list[str], threads: int) -> list[list[int]]:
        """Texts -> id lists, without BOS/EOS; ``threads`` where the backend takes it (-1: one per CPU)."""

    def pieces(self, text: str) -> list[str]:
        """The pieces of one text, aligned one-to-one with its :meth:`encode` ids."""

    def id_to_piece(self, i: int) -> str:
        """The piece of an id in ``range(size)``."""

    def decode(self, ids: list[int]) -> str:
        """Ids in ``range(size)``, without PAD/BOS/EOS -> text."""


class SentencePieceModel:
    """A SentencePiece model trained by attnkit: its own ids are attnkit's (kind ``sentencepiece``)."""

    def __init__(self, sp: spm.SentencePieceProcessor) -> None:
        self._sp = sp

    @property
    def size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def mask_id(self) -> int | None:
        """The id of ``<mask>`` (a control symbol), or None when the model was trained without it."""
        i = self._sp.piece_to_id(MASK_PIECE)
        return i if i != UNK_ID and self._sp.is_control(i) else None

    absent_ids: tuple[int, ...] = ()

    def encode(self, texts: list[str], threads: int) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int, num_threads=threads)

    def pieces(self, text: str) -> list[str]:
        return self._sp.encode(text, out_type=str)

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(i)

    def decode(self, ids: list[int]) -> str:
        """SentencePiece's decoding; UNK reads `` ⁇ ``."""
        return self._sp.decode(ids)


class CharacterModel:
    """Every character its own id (kind ``characters``): the training text's characters, sorted, after the four
    special ids. Nothing is normalised, so a newline or a run of spaces is text like any other (SentencePiece's
    ``char`` model normalises whitespace away); a character the training text lacks reads as UNK."""

    def __init__(self, characters: list[str]) -> None:
        self.characters = characters  # id NUM_SPECIAL + i is characters[i]
        self._ids = {c: i + NUM_SPECIAL for i, c in enumerate(characters)}
        self._specials = [PAD_PIECE, UNK_PIECE, BOS_PIECE, EOS_PIECE]

    @property
    def size(self) -> int:
        return NUM_SPECIAL + len(self.characters)

    @property
    def mask_id(self) -> None:
        return None

    absent_ids: tuple[int, ...] = ()

    def encode(self, texts: list[str], threads: int) -> list[list[int]]:
        return [[self._ids.get(c, UNK_ID) for c in text] for text in texts]

    def pieces(self, text: str) -> list[str]:
        return list(text)

    def id_to_piece(self, i: int) -> str:
        return self._specials[i] if i < NUM_SPECIAL else self.characters[i - NUM_SPECIAL]

    def decode(self, ids: list[int]) -> str:
        """Characters joined; UNK reads ``\ufffd`` (Unicode's replacement character)."""
        return "".join("\ufffd" if i < NUM_SPECIAL else self.characters[i - NUM_SPECIAL] for i in ids)


def load_characters(path: Path) -> CharacterModel:
    """A ``characters`` tokenizer's model from its list of characters (``characters.json``)."""
    _require_file(path, "character list", "re-run `attnkit train` in a new --run-dir")
    try:
        characters = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: cannot read the character list ({_first_line(e)}); re-train the tokenizer") from None
    if not (isinstance(characters, list) and all(isinstance(c, str) and len(c) == 1 for c in characters)
            and len(set(characters)) == len(characters)):
        raise UserError(f"{path}: expected a JSON list of distinct single characters; re-train the tokenizer")
    return CharacterModel(characters)


def split_language_code(text: str) -> tuple[list[str], str]:
    """``([code], rest)`` when ``text`` starts with a Marian language code such as ``>>fra<<``, else ``([], text)``.

    As MarianTokenizer.remove_language_code: a text that starts with ``>>`` and contains ``<<`` loses its
    prefix up to and including the first ``<<``, which is one piece (looked up in the vocabulary, so an
    unknown code is UNK); the rest is left as it is, spaces included.
    """
    end = text.find(_LANGUAGE_CODE_CLOSE) if text.startswith(_LANGUAGE_CODE_OPEN) else -1
    if end == -1:
        return [], text
    return [text[:end + len(_LANGUAGE_CODE_CLOSE)]], text[end + len(_LANGUAGE_CODE_CLOSE):]


class VocabSentencePieceModel:
    """A SentencePiece model that only segments, and a vocabulary that numbers its pieces (``sentencepiece+vocab``).

    Hugging Face's MarianTokenizer, ``_tokenize`` and ``_convert_token_to_id``: an optional language code,
    then ``sp.encode(text, out_type=str)``; a piece outside the vocabulary is UNK (the model's own ids
    are never used: they do not match the vocabulary's). Decoding drops UNK, as
    ``MarianTokenizer.decode(ids, skip_special_tokens=True)`` does, and joins the pieces with the model's
    ``decode_pieces``, turning any ``▁`` left (a piece the model does not know) into a space.
    """

    def __init__(self, sp: spm.SentencePieceProcessor, vocab: list[str]) -> None:
        """:param vocab: the piece of attnkit id ``i`` at index ``i`` (checked by :func:`vocab_problem`)."""
        self._sp = sp
        self._vocab = vocab
        self._ids = {p: i for i, p in enumerate(vocab)}

    @property
    def size(self) -> int:
        return len(self._vocab)

    @property
    def mask_id(self) -> None:
        """None: Marian models have no masked-language-model piece."""
        return None

    absent_ids: tuple[int, ...] = ()

    def encode(self, texts: list[str], threads: int) -> list[list[int]]:
        split = [split_language_code(t) for t in texts]
        if not split:
            return []
        segmented = self._sp.encode([rest for _, rest in split], out_type=str, num_threads=threads)
        return [[self._ids.get(p, UNK_ID) for p in code + pieces]
                for (code, _), pieces in zip(split, segmented, strict=True)]

    def pieces(self, text: str) -> list[str]:
        code, rest = split_language_code(text)
        return code + self._sp.encode(rest, out_type=str)

    def id_to_piece(self, i: int) -> str:
        return self._vocab[i]

    def decode(self, ids: list[int]) -> str:
        text = self._sp.decode_pieces([self._vocab[i] for i in ids if i != UNK_ID])
        return text.replace(SPIECE_UNDERLINE, " ").strip()


class WordPieceModel:
    """BERT's WordPiece through the ``tokenizers`` library, its vocabulary in attnkit's id order (``wordpiece``).

    Normalisation (lowercasing, accent stripping, Chinese characters), pre-tokenisation and UNK all come
    from the library, as in transformers' BertTokenizer; special tokens in the text are split like text.
    ``threads`` is not used: ``tokenizers`` has its own thread pool (``RAYON_NUM_THREADS``).
    """

    def __init__(self, tk: tokenizers.Tokenizer, mask_piece: str | None) -> None:
        """:param mask_piece: the masked-language-model piece (BERT's ``[MASK]``), or None."""
        self._tk = tk
        self._mask_piece = mask_piece

    @property
    def size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def mask_id(self) -> int | None:
        return self._tk.token_to_id(self._mask_piece) if self._mask_piece is not None else None

    absent_ids: tuple[int, ...] = ()

    def encode(self, texts: list[str], threads: int) -> list[list[int]]:
        return [e.ids for e in self._tk.encode_batch(texts, add_special_tokens=False)]

    def pieces(self, text: str) -> list[str]:
        return self._tk.encode(text, add_special_tokens=False).tokens

    def id_to_piece(self, i: int) -> str:
        return self._tk.id_to_token(i)

    def decode(self, ids: list[int]) -> str:
        """The library's decoding (``##`` joined, spaces before punctuation removed); special pieces are dropped."""
        return self._tk.decode(ids, skip_special_tokens=True)


def _first_line(e: BaseException) -> str:
    msg = str(e).strip()
    return msg.splitlines()[0] if msg else type(e).__name__


_RETRAIN, _REIMPORT = "re-train the tokenizer", "re-import the checkpoint"


def _require_file(path: Path, what: str, fix: str) -> None:
    if not path.is_file():
        raise UserError(f"{path}: {what} not found; {fix} or restore the file next to tokenizer.json")


def load_sentencepiece(path: Path, *, attnkit_ids: bool = True) -> spm.SentencePieceProcessor:
    """Load one SentencePiece model file; with ``attnkit_ids``, check that its special ids are attnkit's.

    :raises UserError: missing or corrupt file, or other special ids.
    """
    fix = _RETRAIN if attnkit_ids else _REIMPORT
    _require_file(path, "tokenizer model file", fix)
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        raise UserError(f"{path}: not a valid SentencePiece model ({_first_line(e)}); {fix}") from None
    if not sp.get_piece_size():
        raise UserError(f"{path}: not a valid SentencePiece model (no pieces); {fix}")
    ids = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
    if attnkit_ids and ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        raise UserError(f"{path}: special ids (pad, unk, bos, eos) are {ids}, expected "
                        f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}; re-train it with attnkit")
    return sp


def vocab_problem(pieces: object) -> str | None:
    """What is wrong with a vocabulary (a list of distinct strings, the special ids first), or None."""
    if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
        return "expected a list of pieces (strings), the piece of id i at index i"
    if len(pieces) < NUM_SPECIAL:
        return (f"{len(pieces)} pieces, fewer than the {NUM_SPECIAL} special ones "
                f"(pad, unk, bos, eos at ids 0-3)")
    first: dict[str, int] = {}
    for i, p in enumerate(pieces):
        if p in first:
            return f"piece {p!r} has two ids, {first[p]} and {i}; each piece needs exactly one"
        first[p] = i
    return None


def read_vocab(path: Path) -> list[str]:
    """Read ``vocab.json``: a JSON list, the piece of attnkit id ``i`` at index ``i``.

    :raises UserError: missing, unreadable or invalid file, naming it.
    """
    _require_file(path, "vocabulary file", _REIMPORT)
    try:
        pieces = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg}); {_REIMPORT}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(f"{path}: cannot read ({_first_line(e)}); {_REIMPORT}") from None
    problem = vocab_problem(pieces)
    if problem:
        raise UserError(f"{path}: {problem}; {_REIMPORT}")
    return pieces


def load_wordpiece(path: Path, mask_piece: str | None) -> WordPieceModel:
    """Load ``wordpiece.json``, a ``tokenizers`` WordPiece tokenizer already in attnkit's id order.

    Padding and truncation are switched off (attnkit batches and windows itself) and special tokens in
    the text are split like text.

    :raises UserError: missing file, one ``tokenizers`` cannot read, not WordPiece, or UNK not at id 1.
    """
    _require_file(path, "WordPiece tokenizer file", _REIMPORT)
    try:
        tk = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception for every parse error
        raise UserError(f"{path}: not a tokenizer the `tokenizers` library can read ({_first_line(e)}); "
                        f"{_REIMPORT}") from None
    if not isinstance(tk.model, WordPiece):
        raise UserError(f"{path}: a {type(tk.model).__name__} tokenizer, expected WordPiece; {_REIMPORT}")
    checks: list[tuple[bool, str]] = [
        (tk.get_vocab_size(with_added_tokens=True) >= NUM_SPECIAL,
         f"fewer than {NUM_SPECIAL} pieces (pad, unk, bos, eos at ids 0-3)"),
        (tk.token_to_id(tk.model.unk_token) == UNK_ID, f"the unknown piece {tk.model.unk_token!r} is not id {UNK_ID}"),
        (mask_piece is None or tk.token_to_id(mask_piece) is not None, f"no mask piece {mask_piece!r}"),
    ]
    for ok, problem in checks:
        if not ok:
            raise UserError(f"{path}: {problem}; {_REIMPORT}")
    tk.no_padding()
    tk.no_truncation()
    tk.encode_special_tokens = True
    return WordPieceModel(tk, mask_piece)
