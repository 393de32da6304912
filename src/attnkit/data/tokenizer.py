"""SentencePiece subword tokenizers (unigram or BPE) with fixed special ids.

Every model trained here reserves the same four ids, so the model, the search and the
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

``<mask>`` is a SentencePiece control symbol: text never encodes to it (a review that
contains the characters ``<mask>`` reads them as text), and tokenizers trained without it
keep their ids.

A trained tokenizer is a directory holding ``tokenizer.json`` and one model file
(``spm.model``, joint or classification) or two (``src.model``, ``tgt.model``).

Text is normalised with SentencePiece's default ``nmt_nfkc`` rule, so
``decode(encode(x)) == x`` holds for NFKC-normalised text with single spaces and no
leading/trailing whitespace (ordinary sentences in any script).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path

import sentencepiece as spm

from attnkit.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID

from ..common.errors import UserError
from ..common.files import atomic_write_bytes, atomic_write_text

__all__ = [
    "BOS_ID",
    "BOS_PIECE",
    "EOS_ID",
    "EOS_PIECE",
    "MASK_PIECE",
    "MODEL_TYPES",
    "PAD_ID",
    "PAD_PIECE",
    "SPECIAL_IDS",
    "TOKENIZER_FILE",
    "tokenizer_files",
    "Tokenizer",
    "UNK_ID",
    "UNK_PIECE",
    "train_tokenizer",
]

PAD_PIECE, UNK_PIECE, BOS_PIECE, EOS_PIECE, MASK_PIECE = "<pad>", "<unk>", "<s>", "</s>", "<mask>"
#: Ids that never carry text; decoding drops them.
SPECIAL_IDS: frozenset[int] = frozenset({PAD_ID, BOS_ID, EOS_ID})
_NUM_SPECIAL = 4  # pad, unk, bos, eos
MODEL_TYPES: tuple[str, ...] = ("unigram", "bpe", "char")
#: Name of the metadata file inside a tokenizer directory.
TOKENIZER_FILE = "tokenizer.json"
_FORMAT_VERSION = 1
_JOINT_MODEL, _SRC_MODEL, _TGT_MODEL = "spm.model", "src.model", "tgt.model"


def tokenizer_files(directory: str | Path) -> list[str]:
    """The names of the tokenizer files in ``directory``: :data:`TOKENIZER_FILE` and its SentencePiece model(s),
    in a fixed order (a digest over them does not depend on the file system's)."""
    return [n for n in (TOKENIZER_FILE, _JOINT_MODEL, _SRC_MODEL, _TGT_MODEL) if (Path(directory) / n).exists()]
#: Threads used by the SentencePiece trainer (the target machine has two cores).
_TRAIN_THREADS = 2
#: Longest training sentence in bytes; longer ones are skipped by SentencePiece
#: (its default, 4192, would drop long classification documents).
_MAX_SENTENCE_BYTES = 1 << 15
#: SentencePiece refuses a sample (input_sentence_size) of this many sentences or fewer.
_MIN_SAMPLE = 100


def _train_one(
    texts: Iterable[str],
    *,
    vocab_size: int,
    model_type: str,
    character_coverage: float,
    seed: int,
    max_sentences: int,
    what: str,
    where: str,
    mask: bool = False,
) -> bytes:
    """Train one SentencePiece model in memory from streamed ``texts`` and return its serialized proto.

    SentencePiece reads the stream once and keeps a reservoir sample of at most
    ``max_sentences`` non-empty sentences (all of them, in order, when there are fewer), so the
    corpus is never held in memory. The reservoir draws from SentencePiece's own fixed seed: the
    same stream always gives the same sample.

    :raises UserError: no text to train on, or a vocabulary too small for the alphabet.
    """
    seen = [0]

    def sentences() -> Iterator[str]:
        for t in texts:
            if t.strip():
                seen[0] += 1
                yield t

    # SentencePiece 0.2 has no per-trainer seed option; seed its library-wide generator in case a
    # code path draws from it (the reservoir sampler has its own fixed seed).
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            hard_vocab_limit=False,  # tiny corpora: shrink the vocab instead of failing
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            pad_piece=PAD_PIECE, unk_piece=UNK_PIECE, bos_piece=BOS_PIECE, eos_piece=EOS_PIECE,
            control_symbols=[MASK_PIECE] if mask else [],  # id 4, right after the four special ids
            input_sentence_size=max_sentences,  # a seeded reservoir sample of the stream
            shuffle_input_sentence=True,
            max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=_TRAIN_THREADS,
            minloglevel=2,
        )
    except RuntimeError as e:
        if not seen[0]:
            raise _no_text(what, where) from None
        msg = str(e)
        m = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", msg)
        if m:
            raise UserError(
                f"tokenizer vocab_size={vocab_size} is too small for the {what} text: it needs at "
                f"least {m.group(2)} entries ({_NUM_SPECIAL} special ids + its characters); raise vocab_size "
                f"or lower character_coverage"
            ) from None
        raise UserError(f"SentencePiece could not train the {what} tokenizer: "
                        f"{msg.splitlines()[0] if msg else type(e).__name__}") from None
    if not seen[0]:
        raise _no_text(what, where)
    return model.getvalue()


def _no_text(what: str, where: str) -> UserError:
    return UserError(f"{where}: no non-empty {what} text to train the tokenizer on; check the file(s)")


def _check_options(model_type: str, vocab_size: int, max_sentences: int, character_coverage: float) -> None:
    """Reject tokenizer options SentencePiece cannot train with, naming the option."""
    if model_type not in MODEL_TYPES:
        raise UserError(f"tokenizer model_type '{model_type}' is not supported; use one of "
                        f"{', '.join(MODEL_TYPES)}")
    if vocab_size <= _NUM_SPECIAL:
        raise UserError(f"tokenizer vocab_size must be larger than {_NUM_SPECIAL} (the special ids), got "
                        f"{vocab_size}; try 8000 for translation")
    if max_sentences <= _MIN_SAMPLE:
        raise UserError(f"tokenizer max_sentences must be more than {_MIN_SAMPLE} (SentencePiece's minimum "
                        f"sample), got {max_sentences}")
    if not 0.0 < character_coverage <= 1.0:
        raise UserError(f"tokenizer character_coverage must be in (0, 1], got {character_coverage}")


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
    _check_options(model_type, vocab_size, max_sentences, character_coverage)
    options = dict(vocab_size=vocab_size, model_type=model_type,
                   character_coverage=character_coverage, seed=seed, max_sentences=max_sentences)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if tgt_texts is None:
        files = {"src": _JOINT_MODEL, "tgt": None}
        protos = {_JOINT_MODEL: _train_one(src_texts, what="source", mask=mask, where=where, **options)}
        joint = True
    elif joint:
        files = {"src": _JOINT_MODEL, "tgt": _JOINT_MODEL}
        protos = {_JOINT_MODEL: _train_one(chain(src_texts, tgt_texts), what="source+target", where=where, **options)}
    else:
        files = {"src": _SRC_MODEL, "tgt": _TGT_MODEL}
        protos = {_SRC_MODEL: _train_one(src_texts, what="source", where=where, **options),
                  _TGT_MODEL: _train_one(tgt_texts, what="target", where=where, **options)}
    for name, proto in protos.items():
        atomic_write_bytes(out / name, proto)

    sizes = {name: spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
             for name, proto in protos.items()}
    meta = {
        "format_version": _FORMAT_VERSION,
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


def _load_model(path: Path) -> spm.SentencePieceProcessor:
    """Load one model file and check it uses attnkit's special ids."""
    if not path.is_file():
        raise UserError(f"{path}: tokenizer model file not found; re-train the tokenizer or "
                        f"restore the file next to {TOKENIZER_FILE}")
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        raise UserError(f"{path}: not a valid SentencePiece model ({str(e).splitlines()[0]}); "
                        f"re-train the tokenizer") from None
    ids = (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id())
    if ids != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
        raise UserError(f"{path}: special ids (pad, unk, bos, eos) are {ids}, expected "
                        f"{(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}; re-train it with attnkit")
    return sp


def _model_name(meta: dict, key: str, meta_path: Path) -> str:
    """``meta[key]`` if it is a plain file name: a model file lives beside ``tokenizer.json``, never elsewhere."""
    name = meta[key]
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise UserError(f"{meta_path}: {key} {name!r} must be a file name in that directory (no path, "
                        f"no '..'); re-train the tokenizer")
    return name


class Tokenizer:
    """Source and target SentencePiece models behind one interface.

    Build one with :func:`train_tokenizer` or :meth:`Tokenizer.load`. Encoding adds no
    BOS/EOS (callers add :data:`BOS_ID`/:data:`EOS_ID`); decoding stops at the first EOS
    and drops PAD/BOS.
    """

    def __init__(
        self,
        src_model: spm.SentencePieceProcessor,
        tgt_model: spm.SentencePieceProcessor | None,
        *,
        joint: bool,
        model_type: str,
    ) -> None:
        """:param tgt_model: None for a classification tokenizer (source only)."""
        self._src = src_model
        self._tgt = tgt_model
        self._joint = joint
        self.model_type = model_type

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Load a tokenizer saved by :func:`train_tokenizer`.

        :raises UserError: ``tokenizer.json`` or a model file is missing or corrupt.
        """
        meta_path = Path(directory) / TOKENIZER_FILE
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
        for key in ("joint", "src_model", "tgt_model", "model_type"):
            if key not in meta:
                raise UserError(f"{meta_path}: missing key '{key}'; re-train the tokenizer")
        base = Path(directory)
        src = _load_model(base / _model_name(meta, "src_model", meta_path))
        tgt_name = meta["tgt_model"]
        if tgt_name is None:
            tgt = None
        elif tgt_name == meta["src_model"]:
            tgt = src
        else:
            tgt = _load_model(base / _model_name(meta, "tgt_model", meta_path))
        return cls(src, tgt, joint=bool(meta["joint"]), model_type=str(meta["model_type"]))

    # -- properties -----------------------------------------------------------------

    @property
    def joint(self) -> bool:
        """True when source and target share one model (and one id space)."""
        return self._joint

    @property
    def has_target(self) -> bool:
        """False for a classification tokenizer, which has only a source model."""
        return self._tgt is not None

    @property
    def mask_id(self) -> int | None:
        """The id of ``<mask>``, or None when the tokenizer was trained without it."""
        i = self._src.piece_to_id(MASK_PIECE)
        return i if i != UNK_ID and self._src.is_control(i) else None

    @property
    def src_vocab_size(self) -> int:
        """Number of source ids, special ids included."""
        return self._src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        """Number of target ids, special ids included."""
        return self._target().get_piece_size()

    def _target(self) -> spm.SentencePieceProcessor:
        if self._tgt is None:
            raise ValueError("this tokenizer has no target model (it was trained for "
                             "classification, with tgt_texts=None)")
        return self._tgt

    # -- encoding / decoding --------------------------------------------------------

    def encode_src(self, texts: Sequence[str], *, threads: int = -1) -> list[list[int]]:
        """Source texts -> id lists, without BOS/EOS; ``threads``: SentencePiece's threads (-1: one per CPU)."""
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
        return self._src.encode(text, out_type=str)

    def src_pieces_from_ids(self, ids: Sequence[int]) -> list[str]:
        """Piece of every source id, special pieces included (``<s>``, ``</s>``, ``<pad>``)."""
        return _pieces(self._src, ids)

    def tgt_pieces_from_ids(self, ids: Sequence[int]) -> list[str]:
        """Piece of every target id, special pieces included (``<s>``, ``</s>``, ``<pad>``)."""
        return _pieces(self._target(), ids)

    def __repr__(self) -> str:
        tgt = self._tgt.get_piece_size() if self._tgt is not None else None
        return (f"Tokenizer(model_type={self.model_type!r}, joint={self._joint}, "
                f"src_vocab_size={self.src_vocab_size}, tgt_vocab_size={tgt})")


def _encode(sp: spm.SentencePieceProcessor, texts: Sequence[str], threads: int = -1) -> list[list[int]]:
    """Encode a list of texts (a bare string is refused: it would be read as characters)."""
    if isinstance(texts, str):
        raise TypeError("encode_src/encode_tgt take a list of texts, got a single str; wrap it: [text]")
    return sp.encode(list(texts), out_type=int, num_threads=threads)


def _check_ids(sp: spm.SentencePieceProcessor, ids: Sequence[int]) -> list[int]:
    """Convert to plain ints (tensors welcome) and check the range."""
    out = [int(i) for i in ids]
    size = sp.get_piece_size()
    bad = [i for i in out if not 0 <= i < size]
    if bad:
        raise ValueError(f"token id {bad[0]} out of range for a vocabulary of {size}")
    return out


def _decode(sp: spm.SentencePieceProcessor, batch: Sequence[Sequence[int]]) -> list[str]:
    """Decode each sequence up to its first EOS, ignoring PAD and BOS."""
    texts: list[str] = []
    for seq in batch:
        kept: list[int] = []
        for i in _check_ids(sp, seq):
            if i == EOS_ID:
                break
            if i not in SPECIAL_IDS:
                kept.append(i)
        texts.append(sp.decode(kept))
    return texts


def _pieces(sp: spm.SentencePieceProcessor, ids: Sequence[int]) -> list[str]:
    return [sp.id_to_piece(i) for i in _check_ids(sp, ids)]
