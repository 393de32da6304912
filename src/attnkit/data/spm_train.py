"""Training one SentencePiece model with attnkit's special ids, from a stream of text read once.

:func:`attnkit.data.tokenizer.train_tokenizer` decides which models to train (joint, separate, or
source only) and writes the tokenizer directory; this module trains each model and turns
SentencePiece's failures into :class:`~attnkit.common.errors.UserError` sentences.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Iterator

import sentencepiece as spm

from attnkit.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID

from ..common.errors import UserError
from .pieces import BOS_PIECE, EOS_PIECE, MASK_PIECE, NUM_SPECIAL, PAD_PIECE, UNK_PIECE

__all__ = ["MODEL_TYPES", "check_options", "train_model"]

#: SentencePiece model types attnkit trains (``char``: one piece per character).
MODEL_TYPES: tuple[str, ...] = ("unigram", "bpe", "char")
#: Threads used by the SentencePiece trainer (the target machine has two cores).
_TRAIN_THREADS = 2
#: Longest training sentence in bytes; longer ones are skipped by SentencePiece
#: (its default, 4192, would drop long classification documents).
_MAX_SENTENCE_BYTES = 1 << 15
#: SentencePiece refuses a sample (input_sentence_size) of this many sentences or fewer.
_MIN_SAMPLE = 100


def train_model(
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
                f"least {m.group(2)} entries ({NUM_SPECIAL} special ids + its characters); raise vocab_size "
                f"or lower character_coverage"
            ) from None
        raise UserError(f"SentencePiece could not train the {what} tokenizer: "
                        f"{msg.splitlines()[0] if msg else type(e).__name__}") from None
    if not seen[0]:
        raise _no_text(what, where)
    return model.getvalue()


def _no_text(what: str, where: str) -> UserError:
    return UserError(f"{where}: no non-empty {what} text to train the tokenizer on; check the file(s)")


def check_options(model_type: str, vocab_size: int, max_sentences: int, character_coverage: float) -> None:
    """Reject tokenizer options SentencePiece cannot train with, naming the option."""
    if model_type not in MODEL_TYPES:
        raise UserError(f"tokenizer model_type '{model_type}' is not supported; use one of "
                        f"{', '.join(MODEL_TYPES)}")
    if vocab_size <= NUM_SPECIAL:
        raise UserError(f"tokenizer vocab_size must be larger than {NUM_SPECIAL} (the special ids), got "
                        f"{vocab_size}; try 8000 for translation")
    if max_sentences <= _MIN_SAMPLE:
        raise UserError(f"tokenizer max_sentences must be more than {_MIN_SAMPLE} (SentencePiece's minimum "
                        f"sample), got {max_sentences}")
    if not 0.0 < character_coverage <= 1.0:
        raise UserError(f"tokenizer character_coverage must be in (0, 1], got {character_coverage}")
