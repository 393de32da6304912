"""Subword tokenizers with fixed special ids: SentencePiece models trained here, or imported ones.

Every tokenizer, trained here or imported (:mod:`attnkit.data.pieces` lists the kinds of tokenizer
directory and their files), gives the same four special ids, so the model, the search and the
batching code can use the constants below without asking the tokenizer:

=====  =========  ==========================================
 id     piece      use
=====  =========  ==========================================
 0      ``<pad>``  padding (:data:`PAD_ID`)
 1      ``<unk>``  characters outside the vocabulary
 2      ``<s>``    beginning of sentence, added by callers
 3      ``</s>``   end of sentence, added by callers
 4      ``<mask>`` masked-language-model input (:attr:`Tokenizer.mask_id`); only in
                   tokenizers trained with ``mask=True``, for ``task: pretrain``
=====  =========  ==========================================

Imported tokenizers keep their own names for these pieces (BERT's ``[PAD] [UNK] [CLS] [SEP]``,
``[MASK]`` at any id). ``<mask>`` is a SentencePiece control symbol: text never encodes to it (a review that
contains the characters ``<mask>`` reads them as text), and tokenizers trained without it
keep their ids.

A trained tokenizer is a directory holding ``tokenizer.json`` and one model file
(``spm.model``, joint or classification) or two (``src.model``, ``tgt.model``); ``tokenizer.json``
names the kind (``"kind"``, absent for a trained one) and its files. The writers of imported
tokenizers are in :mod:`attnkit.data.hf_tokenizer`.

Text is normalised with SentencePiece's default ``nmt_nfkc`` rule, so
``decode(encode(x)) == x`` holds for NFKC-normalised text with single spaces and no
leading/trailing whitespace (ordinary sentences in any script).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from pathlib import Path

import sentencepiece as spm

from attnkit.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID

from ..common.errors import UserError
from ..common.files import atomic_write_bytes, atomic_write_text
from .hf_tokenizer import wordpiece_from_vocab_txt, write_sentencepiece_vocab, write_wordpiece
from .pieces import (
    BOS_PIECE,
    CHARACTERS,
    CHARACTERS_FILE,
    EOS_PIECE,
    FORMAT_VERSION,
    JOINT_MODEL_FILE,
    KINDS,
    MASK_PIECE,
    PAD_PIECE,
    SENTENCEPIECE,
    SENTENCEPIECE_VOCAB,
    SRC_MODEL_FILE,
    TGT_MODEL_FILE,
    TOKENIZER_FILE,
    UNK_PIECE,
    VOCAB_FILE,
    WORDPIECE,
    WORDPIECE_FILE,
    PieceModel,
    SentencePieceModel,
    VocabSentencePieceModel,
    load_characters,
    load_sentencepiece,
    load_wordpiece,
    read_vocab,
)
from .spm_train import MODEL_TYPES, check_options, train_model
from .tokenizers_json import (
    HF_TOKENIZER_CONFIG_FILE,
    HF_TOKENIZER_FILE,
    HF_TOKENIZERS,
    HFTokenizersModel,
    load_hf_tokenizers,
)

__all__ = ["BOS_ID", "BOS_PIECE", "EOS_ID", "EOS_PIECE", "KINDS", "MASK_PIECE", "MODEL_TYPES", "PAD_ID", "PAD_PIECE",
           "SPECIAL_IDS", "TOKENIZER_FILE", "tokenizer_files", "Tokenizer", "UNK_ID", "UNK_PIECE", "save_characters",
           "save_sentencepiece_vocab", "save_wordpiece", "train_tokenizer", "wordpiece_from_vocab_txt"]

#: Ids that never carry text; decoding drops them.
SPECIAL_IDS: frozenset[int] = frozenset({PAD_ID, BOS_ID, EOS_ID})
_JOINT_MODEL, _SRC_MODEL, _TGT_MODEL = JOINT_MODEL_FILE, SRC_MODEL_FILE, TGT_MODEL_FILE
#: Every file a tokenizer directory of any kind may hold, in the order :func:`tokenizer_files` lists them.
_FILES = (TOKENIZER_FILE, _JOINT_MODEL, _SRC_MODEL, _TGT_MODEL, VOCAB_FILE, WORDPIECE_FILE, CHARACTERS_FILE,
          HF_TOKENIZER_FILE, HF_TOKENIZER_CONFIG_FILE)


def tokenizer_files(directory: str | Path) -> list[str]:
    """The names of the tokenizer files in ``directory``: :data:`TOKENIZER_FILE` and its model and vocabulary
    files, in a fixed order (a digest over them does not depend on the file system's)."""
    return [n for n in _FILES if (Path(directory) / n).exists()]


def train_tokenizer(
    src_texts: Iterable[str],
    tgt_texts: Iterable[str] | None,
    out_dir: str | Path,
    *,
    vocab_size: int,
    model_type: str = "unigram",
    joint: bool = True,
    character_coverage: float = 1.0,
    seed: int = 1,
    max_sentences: int = 1_000_000,
    mask: bool = False,
    where: str = "the training data",
) -> Tokenizer:
    """Train SentencePiece model(s) from text (lists, or streams read once) and save them in ``out_dir``.

    * ``joint`` (translation): one model ``spm.model`` on source + target text, shared
      by both sides (needed for tied source/target embeddings).
    * not ``joint``: ``src.model`` on source text and ``tgt.model`` on target text.
    * ``tgt_texts`` None (classification): one model ``spm.model`` on source text.

    When the text cannot support ``vocab_size`` pieces the vocabulary is smaller than
    requested (``tokenizer.json`` records both). Training is deterministic: the same input
    and ``seed`` give byte-identical models.

    :param src_texts: source sentences (empty ones are ignored).
    :param tgt_texts: target sentences, or None for classification.
    :param out_dir: directory to write (created if needed; existing files replaced).
    :param vocab_size: requested vocabulary size per model, special ids included.
    :param model_type: ``"unigram"``, ``"bpe"`` or ``"char"`` (one piece per character).
    :param joint: one shared model for source and target.
    :param character_coverage: share of characters the alphabet must cover (1.0 keeps all).
    :param seed: seed of SentencePiece's library-wide generator.
    :param max_sentences: sample at most this many sentences per model for training (SentencePiece's
        ``input_sentence_size``, more than 100).
    :param where: the training files, named in errors.
    :param mask: also reserve ``<mask>`` (id 4) for masked-language-model pretraining (classification only).
    :raises UserError: invalid option, no text, or vocab_size too small for the alphabet.
    """
    check_options(model_type, vocab_size, max_sentences, character_coverage)
    options = dict(vocab_size=vocab_size, model_type=model_type,
                   character_coverage=character_coverage, seed=seed, max_sentences=max_sentences)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if tgt_texts is None:
        files = {"src": _JOINT_MODEL, "tgt": None}
        protos = {_JOINT_MODEL: train_model(src_texts, what="source", mask=mask, where=where, **options)}
        joint = True
    elif joint:
        files = {"src": _JOINT_MODEL, "tgt": _JOINT_MODEL}
        protos = {_JOINT_MODEL: train_model(chain(src_texts, tgt_texts), what="source+target", where=where, **options)}
    else:
        files = {"src": _SRC_MODEL, "tgt": _TGT_MODEL}
        protos = {_SRC_MODEL: train_model(src_texts, what="source", where=where, **options),
                  _TGT_MODEL: train_model(tgt_texts, what="target", where=where, **options)}
    for name, proto in protos.items():
        atomic_write_bytes(out / name, proto)

    sizes = {name: spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
             for name, proto in protos.items()}
    meta = {
        "format_version": FORMAT_VERSION,
        "joint": joint,
        "src_model": files["src"],
        "tgt_model": files["tgt"],
        "model_type": model_type,
        "requested_vocab_size": vocab_size,
        "src_vocab_size": sizes[files["src"]],
        "tgt_vocab_size": sizes[files["tgt"]] if files["tgt"] else None,
        "character_coverage": character_coverage,
        "seed": seed,
        "sentencepiece_version": spm.__version__,
    }
    atomic_write_text(out / TOKENIZER_FILE, json.dumps(meta, indent=2) + "\n")  # written last: marks completion
    return Tokenizer.load(out)


def save_characters(out: str | Path, texts: Iterable[str], where: str = "the training data") -> Tokenizer:
    """Write a ``characters`` tokenizer in ``out`` holding every character of ``texts`` (sorted), and load it.

    :raises UserError: the texts hold no character.
    """
    characters = sorted(set().union(*map(set, texts)))
    if not characters:
        raise UserError(f"{where}: no text to take characters from")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / CHARACTERS_FILE, json.dumps(characters, ensure_ascii=False) + "\n")
    meta = {"format_version": FORMAT_VERSION, "kind": CHARACTERS, "joint": True, "src_model": CHARACTERS_FILE,
            "tgt_model": None, "model_type": CHARACTERS, "src_vocab_size": len(characters) + 4}
    atomic_write_text(out / TOKENIZER_FILE, json.dumps(meta, indent=2) + "\n")  # written last: marks completion
    return Tokenizer.load(out)


def save_sentencepiece_vocab(out: str | Path, src_model: bytes, tgt_model: bytes, pieces: list[str]) -> Tokenizer:
    """Write a ``sentencepiece+vocab`` tokenizer in ``out`` (Hugging Face Marian's) and load it.

    :param src_model: the source SentencePiece model, as shipped (``source.spm``).
    :param tgt_model: the target SentencePiece model (``target.spm``).
    :param pieces: the piece of attnkit id ``i`` at index ``i``: pad, unk, bos, eos, then the rest.
    :raises ValueError: ``pieces`` is not a list of at least 4 distinct strings.
    :raises UserError: a model is not a SentencePiece model.
    """
    write_sentencepiece_vocab(Path(out), src_model, tgt_model, pieces)
    return Tokenizer.load(out)


def save_wordpiece(out: str | Path, tokenizer_json: str, pieces: list[str], mask_piece: str | None) -> Tokenizer:
    """Write a ``wordpiece`` tokenizer in ``out`` (BERT's, renumbered into ``pieces``' order) and load it.

    :param tokenizer_json: a Hugging Face ``tokenizer.json`` with a WordPiece model (or
        :func:`wordpiece_from_vocab_txt`'s).
    :param pieces: the piece of attnkit id ``i`` at index ``i``, a permutation of that vocabulary.
    :param mask_piece: the masked-language-model piece (``[MASK]``), or None.
    :raises ValueError: ``pieces`` is not a permutation of the vocabulary, or UNK or the mask piece is misplaced.
    :raises UserError: ``tokenizer_json`` is not a WordPiece tokenizer the ``tokenizers`` library can read.
    """
    write_wordpiece(Path(out), tokenizer_json, pieces, mask_piece)
    return Tokenizer.load(out)


def _model_name(meta: dict, key: str, meta_path: Path) -> str:
    """``meta[key]`` if it is a plain file name: a model file lives beside ``tokenizer.json``, never elsewhere."""
    name = meta[key]
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise UserError(f"{meta_path}: {key} {name!r} must be a file name in that directory (no path, "
                        f"no '..'); re-train the tokenizer")
    return name


def _read_metadata(meta_path: Path) -> dict:
    """``tokenizer.json`` as a dict, with the keys its kind needs.

    :raises UserError: missing, unreadable or invalid file, unknown kind, or a missing key.
    """
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{meta_path}: not found; train a tokenizer first or point to the "
                        f"directory that contains {TOKENIZER_FILE}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{meta_path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg}); "
                        f"re-train the tokenizer") from None
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(f"{meta_path}: cannot read ({e}); re-train the tokenizer") from None
    if not isinstance(meta, dict):
        raise UserError(f"{meta_path}: expected a JSON object; re-train the tokenizer")
    kind = meta.get("kind", SENTENCEPIECE)
    if kind not in KINDS:
        raise UserError(f"{meta_path}: kind {kind!r} is not one of {', '.join(KINDS)}; a newer attnkit may "
                        f"have written it, or re-create the tokenizer")
    for key in ("joint", "src_model", "tgt_model", "model_type") + (("vocab",) if kind == SENTENCEPIECE_VOCAB else ()):
        if key not in meta:
            raise UserError(f"{meta_path}: missing key '{key}'; re-train the tokenizer")
    return meta


def _load_sides(base: Path, meta: dict, meta_path: Path,
                load_one: Callable[[Path], PieceModel]) -> tuple[PieceModel, PieceModel | None]:
    """``(source, target)`` piece models from ``src_model`` and ``tgt_model`` (null: none; the same name: shared)."""
    src = load_one(base / _model_name(meta, "src_model", meta_path))
    tgt_name = meta["tgt_model"]
    if tgt_name is None:
        return src, None
    if tgt_name == meta["src_model"]:
        return src, src
    return src, load_one(base / _model_name(meta, "tgt_model", meta_path))


def _load_models(base: Path, meta: dict, meta_path: Path) -> tuple[PieceModel, PieceModel | None]:
    """The piece models of ``meta``'s kind (:mod:`attnkit.data.pieces`)."""
    kind = meta.get("kind", SENTENCEPIECE)
    if kind == SENTENCEPIECE_VOCAB:
        vocab = read_vocab(base / _model_name(meta, "vocab", meta_path))
        return _load_sides(base, meta, meta_path,
                           lambda p: VocabSentencePieceModel(load_sentencepiece(p, attnkit_ids=False), vocab))
    if kind == CHARACTERS:
        return load_characters(base / _model_name(meta, "src_model", meta_path)), None
    if kind == HF_TOKENIZERS:
        return load_hf_tokenizers(base, meta, meta_path), None
    if kind == WORDPIECE:
        mask = meta.get("mask_piece")
        if mask is not None and not isinstance(mask, str):
            raise UserError(f"{meta_path}: mask_piece {mask!r} must be a string or null; re-import the checkpoint")
        return load_wordpiece(base / _model_name(meta, "src_model", meta_path), mask), None
    return _load_sides(base, meta, meta_path, lambda p: SentencePieceModel(load_sentencepiece(p)))


class Tokenizer:
    """Source and target piece models (:mod:`attnkit.data.pieces`) behind one interface.

    Build one with :func:`train_tokenizer` or :meth:`Tokenizer.load`. Encoding adds no
    BOS/EOS (callers add :data:`BOS_ID`/:data:`EOS_ID`; an ``hf-tokenizers`` tokenizer adds what its own
    post-processor adds, as Hugging Face does: Llama's ``<s>``); decoding stops at the first EOS
    and drops PAD/BOS.
    """

    def __init__(self, src_model: PieceModel, tgt_model: PieceModel | None, *, joint: bool, model_type: str,
                 kind: str = SENTENCEPIECE) -> None:
        """:param tgt_model: None for a classification tokenizer (source only).

        :param kind: the kind of tokenizer directory (:data:`KINDS`).
        """
        self._src = src_model
        self._tgt = tgt_model
        self._joint = joint
        self.model_type = model_type
        self.kind = kind

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Load a tokenizer directory of any kind (saved by :func:`train_tokenizer` or an importer).

        :raises UserError: ``tokenizer.json`` or a model or vocabulary file is missing or corrupt.
        """
        meta_path = Path(directory) / TOKENIZER_FILE
        meta = _read_metadata(meta_path)
        src, tgt = _load_models(Path(directory), meta, meta_path)
        return cls(src, tgt, joint=bool(meta["joint"]), model_type=str(meta["model_type"]),
                   kind=meta.get("kind", SENTENCEPIECE))

    # -- properties -----------------------------------------------------------------

    @property
    def joint(self) -> bool:
        """True when source and target share one id space."""
        return self._joint

    @property
    def has_target(self) -> bool:
        """False for a classification tokenizer, which has only a source model."""
        return self._tgt is not None

    @property
    def mask_id(self) -> int | None:
        """The id of the mask piece (``<mask>``, BERT's ``[MASK]``), or None when there is none."""
        return self._src.mask_id

    @property
    def absent_ids(self) -> tuple[int, ...]:
        """Special ids with no piece behind them (an imported causal LM's missing pad, unk or bos), which the
        language model built over this tokenizer never outputs; empty for every kind but ``hf-tokenizers``."""
        return tuple(self._src.absent_ids)

    @property
    def original_ids(self) -> Sequence[int | None]:
        """The id of each attnkit id (its index) in the checkpoint this tokenizer came from: an imported causal
        language model's Hugging Face id, None for an absent id; ``AutoTokenizer`` encodes a text to
        ``[tok.original_ids[i] for i in tok.encode_src([text])[0]]``. Every other kind keeps its ids."""
        if isinstance(self._src, HFTokenizersModel):
            return self._src.to_hf
        return range(self._src.size)

    @property
    def src_vocab_size(self) -> int:
        """Number of source ids, special ids included."""
        return self._src.size

    @property
    def tgt_vocab_size(self) -> int:
        """Number of target ids, special ids included."""
        return self._target().size

    def _target(self) -> PieceModel:
        if self._tgt is None:
            raise ValueError("this tokenizer has no target model (it was trained for "
                             "classification, with tgt_texts=None)")
        return self._tgt

    # -- encoding / decoding --------------------------------------------------------

    def encode_src(self, texts: Sequence[str], *, threads: int = -1) -> list[list[int]]:
        """Source texts -> id lists, without BOS/EOS; ``threads``: SentencePiece's threads (-1: one per CPU;
        a ``wordpiece`` tokenizer uses the ``tokenizers`` thread pool instead)."""
        return _encode(self._src, texts, threads)

    def encode_tgt(self, texts: Sequence[str], *, threads: int = -1) -> list[list[int]]:
        """Target texts -> id lists, without BOS/EOS; ``threads`` as in :meth:`encode_src`."""
        return _encode(self._target(), texts, threads)

    def decode_src(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Source id lists -> texts; see :meth:`decode_tgt`."""
        return _decode(self._src, ids)

    def decode_tgt(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Target id lists -> texts, stopping at the first EOS and dropping PAD/BOS."""
        return _decode(self._target(), ids)

    # -- pieces (for attention plots) -----------------------------------------------

    def src_pieces(self, text: str) -> list[str]:
        """Subword pieces of one source text, aligned with :meth:`encode_src` ids."""
        return self._src.pieces(text)

    def src_pieces_from_ids(self, ids: Sequence[int]) -> list[str]:
        """Piece of every source id, special pieces included (``<s>``, ``</s>``, ``<pad>``)."""
        return _pieces(self._src, ids)

    def tgt_pieces_from_ids(self, ids: Sequence[int]) -> list[str]:
        """Piece of every target id, special pieces included (``<s>``, ``</s>``, ``<pad>``)."""
        return _pieces(self._target(), ids)

    def __repr__(self) -> str:
        tgt = self._tgt.size if self._tgt is not None else None
        return (f"Tokenizer(model_type={self.model_type!r}, joint={self._joint}, "
                f"src_vocab_size={self.src_vocab_size}, tgt_vocab_size={tgt})")


def _encode(model: PieceModel, texts: Sequence[str], threads: int = -1) -> list[list[int]]:
    """Encode a list of texts (a bare string is refused: it would be read as characters)."""
    if isinstance(texts, str):
        raise TypeError("encode_src/encode_tgt take a list of texts, got a single str; wrap it: [text]")
    return model.encode(list(texts), threads)


def _check_ids(model: PieceModel, ids: Sequence[int]) -> list[int]:
    """Convert to plain ints (tensors welcome) and check the range."""
    out = [int(i) for i in ids]
    size = model.size
    bad = [i for i in out if not 0 <= i < size]
    if bad:
        raise ValueError(f"token id {bad[0]} out of range for a vocabulary of {size}")
    return out


def _decode(model: PieceModel, batch: Sequence[Sequence[int]]) -> list[str]:
    """Decode each sequence up to its first EOS, ignoring PAD and BOS."""
    texts: list[str] = []
    for seq in batch:
        kept: list[int] = []
        for i in _check_ids(model, seq):
            if i == EOS_ID:
                break
            if i not in SPECIAL_IDS:
                kept.append(i)
        texts.append(model.decode(kept))
    return texts


def _pieces(model: PieceModel, ids: Sequence[int]) -> list[str]:
    return [model.id_to_piece(i) for i in _check_ids(model, ids)]
