"""Hugging Face tokenizers written as attnkit tokenizer directories (kinds ``sentencepiece+vocab`` and ``wordpiece``).

The importer (:mod:`attnkit.interop`) decides the id order, the special pieces first (pad, unk, bos,
eos); the functions here write the files :class:`~attnkit.data.tokenizer.Tokenizer` loads through
:mod:`attnkit.data.pieces`, each atomically and ``tokenizer.json`` last, so a directory without it
is an interrupted write. :func:`attnkit.data.tokenizer.save_sentencepiece_vocab` and
:func:`~attnkit.data.tokenizer.save_wordpiece` call them and load the result.

* Marian (``sentencepiece+vocab``): the two SentencePiece models are kept byte for byte; ``vocab.json``
  lists the pieces in attnkit id order.
* BERT (``wordpiece``): WordPiece segments by the *set* of pieces only, so the ``tokenizers`` JSON is
  renumbered into attnkit's order (model vocabulary and added tokens) and loses its post-processor,
  padding and truncation (attnkit adds its own special ids and windows).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm
import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers
from tokenizers.models import WordPiece

from attnkit.vocab import UNK_ID

from ..common.errors import UserError
from ..common.files import atomic_write_bytes, atomic_write_text
from .pieces import (
    FORMAT_VERSION,
    KINDS,
    SENTENCEPIECE_VOCAB,
    SRC_MODEL_FILE,
    TGT_MODEL_FILE,
    TOKENIZER_FILE,
    VOCAB_FILE,
    WORDPIECE,
    WORDPIECE_FILE,
    vocab_problem,
)

__all__ = ["BERT_SPECIAL_PIECES", "read_vocab_txt", "spm_model_type", "wordpiece_from_vocab_txt", "write_metadata",
           "write_sentencepiece_vocab", "write_wordpiece"]

#: BERT's special pieces; those in a ``vocab.txt`` become special added tokens, as in BertTokenizer.
BERT_SPECIAL_PIECES = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_BERT_UNK, _BERT_PREFIX, _BERT_MAX_WORD_CHARS = "[UNK]", "##", 100
#: SentencePiece's ``TrainerSpec.ModelType`` enum (sentencepiece_model.proto).
_SPM_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}


def write_metadata(out: Path, kind: str, meta: dict) -> None:
    """Write ``out/tokenizer.json`` for a tokenizer of ``kind``: last, once its files are in place.

    :param meta: the kind's keys (``joint``, ``src_model``, ``tgt_model``, ``model_type`` and its own).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {KINDS}")
    full = {"format_version": FORMAT_VERSION, "kind": kind, **meta}
    atomic_write_text(out / TOKENIZER_FILE, json.dumps(full, indent=2, ensure_ascii=False) + "\n")


def _check_pieces(pieces: list[str]) -> None:
    problem = vocab_problem(pieces)
    if problem:
        raise ValueError(f"tokenizer pieces: {problem}")


# -- Marian: two SentencePiece models and a vocabulary -------------------------------------------------


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` of a protobuf message: a varint as int, anything else as bytes."""
    pos = 0
    sizes = {1: 8, 5: 4}  # fixed64, fixed32
    while pos < len(data):
        key, pos = _varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield field, wire, value
            continue
        if wire == 2:
            size, pos = _varint(data, pos)
        elif wire in sizes:
            size = sizes[wire]
        else:
            raise ValueError(f"protobuf wire type {wire} is not supported")
        yield field, wire, data[pos:pos + size]
        pos += size


def spm_model_type(proto: bytes) -> str:
    """The model type a SentencePiece model was trained as (``unigram``, ``bpe``, ``word``, ``char``).

    The Python module has no accessor for it, so it is read from the serialized ``ModelProto``:
    ``trainer_spec`` (field 2), its ``model_type`` (field 3, ``unigram`` when absent); ``unknown`` if the
    bytes do not parse. Only a label for ``tokenizer.json`` and :class:`Tokenizer`'s repr.
    """
    try:
        for field, wire, value in _fields(proto):
            if field == 2 and wire == 2 and isinstance(value, bytes):
                for sub, sub_wire, sub_value in _fields(value):
                    if sub == 3 and sub_wire == 0 and isinstance(sub_value, int):
                        return _SPM_MODEL_TYPES.get(sub_value, "unknown")
                return _SPM_MODEL_TYPES[1]
    except (IndexError, ValueError):
        return "unknown"
    return _SPM_MODEL_TYPES[1]


def write_sentencepiece_vocab(out: Path, src_model: bytes, tgt_model: bytes, pieces: list[str]) -> None:
    """Write ``src.model``, ``tgt.model``, ``vocab.json`` and ``tokenizer.json`` (kind ``sentencepiece+vocab``).

    :param pieces: the piece of attnkit id ``i`` at index ``i``; one id space for both sides.
    :raises ValueError: ``pieces`` is not a list of at least 4 distinct strings.
    :raises UserError: a model is not a SentencePiece model.
    """
    _check_pieces(pieces)
    for what, proto in (("source", src_model), ("target", tgt_model)):
        try:
            size = spm.SentencePieceProcessor(model_proto=proto).get_piece_size()
        except RuntimeError as e:
            size, why = 0, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        else:
            why = "no pieces"
        if not size:
            raise UserError(f"the {what} SentencePiece model is not valid ({why}); check the checkpoint's "
                            f"{what} model file")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / SRC_MODEL_FILE, src_model)
    atomic_write_bytes(out / TGT_MODEL_FILE, tgt_model)
    atomic_write_text(out / VOCAB_FILE, json.dumps(pieces, indent=0, ensure_ascii=False) + "\n")
    write_metadata(out, SENTENCEPIECE_VOCAB, {
        "joint": True,
        "src_model": SRC_MODEL_FILE,
        "tgt_model": TGT_MODEL_FILE,
        "vocab": VOCAB_FILE,
        "model_type": f"marian-{spm_model_type(src_model)}",
        "src_vocab_size": len(pieces),
        "tgt_vocab_size": len(pieces),
        "sentencepiece_version": spm.__version__,
    })


# -- BERT: WordPiece through the tokenizers library ----------------------------------------------------


def _parse_wordpiece(tokenizer_json: str) -> dict:
    """The Hugging Face ``tokenizer.json`` as a dict, checked to be a WordPiece tokenizer."""
    try:
        data = json.loads(tokenizer_json)
    except json.JSONDecodeError as e:
        raise UserError(f"the Hugging Face tokenizer.json is not valid JSON ({e.msg}, line {e.lineno} column "
                        f"{e.colno}); check the checkpoint's tokenizer.json") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "WordPiece" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        raise UserError(f"the Hugging Face tokenizer.json has a {kind or 'missing'} model, not WordPiece with a "
                        f"vocabulary; attnkit imports BERT's WordPiece tokenizers")
    added = data.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(t, dict) and isinstance(t.get("content"), str)
                                              for t in added):
        raise UserError("the Hugging Face tokenizer.json: 'added_tokens' is not a list of tokens with a "
                        "'content'; check the checkpoint's tokenizer.json")
    return data


def _check_permutation(pieces: list[str], data: dict, mask_piece: str | None) -> None:
    """``pieces`` must number exactly the tokenizer's pieces (model vocabulary and added tokens), UNK at id 1."""
    _check_pieces(pieces)
    model = data["model"]
    original = set(model["vocab"]) | {t["content"] for t in data.get("added_tokens") or []}
    missing, extra = sorted(original - set(pieces)), sorted(set(pieces) - original)
    if missing or extra:
        raise ValueError(f"tokenizer pieces are not a permutation of the WordPiece vocabulary: {len(missing)} "
                         f"missing {missing[:3]}, {len(extra)} not in it {extra[:3]}")
    if pieces[UNK_ID] != model.get("unk_token"):
        raise ValueError(f"tokenizer pieces: id {UNK_ID} is {pieces[UNK_ID]!r}, but the WordPiece model's unknown "
                         f"piece is {model.get('unk_token')!r}")
    if mask_piece is not None and mask_piece not in original:
        raise ValueError(f"mask piece {mask_piece!r} is not in the WordPiece vocabulary")


def write_wordpiece(out: Path, tokenizer_json: str, pieces: list[str], mask_piece: str | None) -> None:
    """Write ``wordpiece.json`` (renumbered into ``pieces``' order) and ``tokenizer.json`` (kind ``wordpiece``).

    :param tokenizer_json: a ``tokenizers`` serialisation with a WordPiece model (Hugging Face's
        ``tokenizer.json``, or :func:`wordpiece_from_vocab_txt`'s).
    :param pieces: the piece of attnkit id ``i`` at index ``i``, a permutation of its vocabulary.
    :param mask_piece: the masked-language-model piece, or None.
    :raises ValueError: ``pieces`` is not a permutation of the vocabulary, or UNK or the mask piece is misplaced.
    :raises UserError: ``tokenizer_json`` is not a WordPiece tokenizer the ``tokenizers`` library can read.
    """
    data = _parse_wordpiece(tokenizer_json)
    _check_permutation(pieces, data, mask_piece)
    ids = {p: i for i, p in enumerate(pieces)}
    model = data["model"]
    model["vocab"] = {p: ids[p] for p in sorted(model["vocab"], key=ids.__getitem__)}
    added = [dict(t, id=ids[t["content"]]) for t in data.get("added_tokens") or []]
    data["added_tokens"] = sorted(added, key=lambda t: t["id"])
    data.update(post_processor=None, padding=None, truncation=None)
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    try:
        tk = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a plain Exception for every parse error
        raise UserError(f"the Hugging Face tokenizer.json cannot be read by the tokenizers library "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); check the checkpoint") from None
    wrong = [i for i, p in enumerate(pieces) if tk.id_to_token(i) != p]
    if wrong:
        raise ValueError(f"renumbered WordPiece tokenizer maps id {wrong[0]} to {tk.id_to_token(wrong[0])!r}, "
                         f"expected {pieces[wrong[0]]!r}")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / WORDPIECE_FILE, text)
    write_metadata(out, WORDPIECE, {
        "joint": True,
        "src_model": WORDPIECE_FILE,
        "tgt_model": None,
        "model_type": "wordpiece",
        "src_vocab_size": len(pieces),
        "tgt_vocab_size": None,
        "mask_piece": mask_piece,
        "tokenizers_version": tokenizers.__version__,
    })


def read_vocab_txt(vocab_txt: Path) -> dict[str, int]:
    """``vocab.txt`` as transformers' ``load_vocab`` reads it: line ``i`` is the piece of id ``i``.

    Lines end at ``\\n`` only (``str.splitlines`` would also split at ``\\x85``, ``\\u2028`` and others, which
    BERT vocabularies may hold); a later duplicate wins, so ids can have gaps.

    :raises UserError: the file cannot be read as UTF-8.
    """
    try:
        text = vocab_txt.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise UserError(f"{vocab_txt}: cannot read ({e}); check the checkpoint's vocab.txt") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return {piece: i for i, piece in enumerate(lines)}


def wordpiece_from_vocab_txt(vocab_txt: Path, lowercase: bool, strip_accents: bool | None) -> str:
    """A ``tokenizers`` JSON for a BERT checkpoint that ships only ``vocab.txt``, as transformers builds it.

    transformers' BertConverter (convert_slow_tokenizer.py) and BertTokenizer: a WordPiece model
    (``##`` continuation prefix, ``[UNK]``, words over 100 characters are ``[UNK]``), BertNormalizer
    (``clean_text``, ``handle_chinese_chars``, ``strip_accents``, ``lowercase``), BertPreTokenizer, the
    WordPiece decoder, and BERT's special pieces as special added tokens.

    :param lowercase: BERT's ``do_lower_case`` (uncased checkpoints).
    :param strip_accents: strip accents; None: as ``lowercase`` (as the original BERT).
    :raises UserError: unreadable ``vocab.txt``, or one without ``[UNK]``.
    """
    vocab = read_vocab_txt(vocab_txt)
    if _BERT_UNK not in vocab:
        raise UserError(f"{vocab_txt}: no {_BERT_UNK} piece; attnkit imports BERT vocabularies, which have one")
    tk = tokenizers.Tokenizer(WordPiece(vocab, unk_token=_BERT_UNK, continuing_subword_prefix=_BERT_PREFIX,
                                        max_input_chars_per_word=_BERT_MAX_WORD_CHARS))
    tk.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                               strip_accents=strip_accents, lowercase=lowercase)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix=_BERT_PREFIX)
    tk.add_special_tokens([tokenizers.AddedToken(p, special=True, normalized=False)
                           for p in BERT_SPECIAL_PIECES if p in vocab])
    return tk.to_str()
