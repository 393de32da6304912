"""``task: lm`` (attnkit.tasks.language_model) and scoring a text (attnkit.inference.language_model).

The data a language model trains on (the characters tokenizer, nanoGPT's tail split, one document per line or
per ``.tsv`` row, extra files, the packed stream), the blocks an epoch cuts from it, scoring a text against a
brute-force reference (one forward pass per scored token, over exactly the tokens of its window), and a tiny
character model trained end to end: validation, ``attnkit evaluate``, exact resume.

The helpers at the top (``corpus``, ``lm_config``, ``train_lm``) are also used by ``test_generate_cli.py``.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from attnkit.cli import main
from attnkit.common.errors import UserError
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.data.tokenizer import EOS_ID, UNK_ID, Tokenizer, save_characters, train_tokenizer
from attnkit.data.tokenizers_json import write_hf_tokenizers
from attnkit.inference.language_model import (
    document_stream,
    read_documents,
    score_stream,
    score_text_file,
    scored_characters,
    stream_characters,
)
from attnkit.lm import LanguageModel
from attnkit.tasks import load_run, make_task
from attnkit.tasks.language_model import block_batches, lm_documents
from attnkit.tasks.pretraining import pretraining_texts
from attnkit.training.trainer import Trainer
from attnkit.transformer import TransformerConfig
from test_train import assert_same_checkpoint
from tiny_runs import write_tsv, write_yaml

# -- helpers (shared with test_generate_cli.py) -------------------------------------------

TINY_LM = {"d_model": 32, "n_heads": 2, "d_ff": 64, "decoder_layers": 2, "dropout": 0.0, "max_len": 48,
           "positions": "learned"}
TINY_LM_TRAIN = {"max_tokens": 256, "max_updates": 30, "valid_every": 30, "progress": False, "precision": "fp32",
                 "threads": 1, "warmup": 2, "lr": 3e-3, "average_last": 0, "label_smoothing": 0.0}
WORDS = ["the", "king", "shall", "speak", "of", "love", "and", "night", "my", "lord", "good", "sweet", "fair",
         "what", "is", "this", "so", "come", "away", "to", "bed"]
NAMES = ["ROMEO", "JULIET", "NURSE"]


def corpus(n_lines: int, seed: int = 0) -> str:
    """Play-like text: speaker lines, verse, blank lines and runs of spaces; no ``-``, ``Z`` or tab."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        if i % 4 == 0:
            lines.append(f"{rng.choice(NAMES)}:")
        elif i % 9 == 0:
            lines.append("")
        else:
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
            lines.append(("  " if i % 5 == 0 else "") + " ".join(words) + rng.choice([",", ".", ""]))
    return "".join(line + "\n" for line in lines)


def lm_config(train: Path, *, model: dict | None = None, train_options: dict | None = None, **data) -> dict:
    """A tiny character-level language-model config on ``train`` (``data`` overrides the data section)."""
    return {"task": "lm",
            "data": {"train": str(train), "documents": "text", "valid_fraction": 0.1, "block_size": 16,
                     "tokenizer": {"model_type": "characters"}, **data},
            "model": {"transformer": {**TINY_LM, **(model or {})}},
            "train": {**TINY_LM_TRAIN, **(train_options or {})}}


def quiet(msg: str) -> None:
    pass


def train_lm(raw: dict, run_dir: Path) -> Trainer:
    """Train ``raw`` into ``run_dir`` (silently); the trainer keeps the task and the trained model."""
    trainer = Trainer(load_config(RunConfig, raw), run_dir, log=quiet)
    trainer.run()
    return trainer


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``attnkit ARGV`` run in-process."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """Exit status 2, and the last stderr line is the one ``attnkit: error:`` line, naming what is wrong (progress
    lines may come before it), no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert [ln for ln in lines if ln.startswith("attnkit: error:")] == lines[-1:], err
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])


def prepared(raw: dict, run_dir: Path):
    """The task of ``raw`` with its data prepared in ``run_dir`` (no training)."""
    return make_task(load_config(RunConfig, raw), run_dir, quiet)


def stream_of(tok: Tokenizer, documents: list[str]) -> list[int]:
    """What training packs: each document's ids followed by ``</s>``."""
    return [i for ids in tok.encode_src(documents) for i in [*ids, EOS_ID]]


# -- the characters tokenizer -------------------------------------------------------------


def test_characters_tokenizer_round_trips_whitespace_exactly(tmp_path):
    training = "ab  c\n\n   d\te\n"
    tok = save_characters(tmp_path, [training, "a"])
    assert tok.kind == "characters"
    characters = sorted(set(training))
    assert tok.src_vocab_size == 4 + len(characters)
    assert tok.src_pieces_from_ids(range(4, tok.src_vocab_size)) == characters  # sorted, after the specials
    text = "  \n\n\nd  \te   ab\n "  # runs of spaces and newlines, leading and trailing whitespace
    ids = tok.encode_src([text])[0]
    assert len(ids) == len(text) and UNK_ID not in ids
    assert [tok.src_pieces_from_ids([i])[0] for i in ids] == list(text)  # one id per character
    assert tok.decode_src([ids]) == [text]
    assert Tokenizer.load(tmp_path).encode_src([text]) == [ids]  # the saved tokenizer reads the same


def test_characters_tokenizer_reads_an_unknown_character_as_unk(tmp_path):
    tok = save_characters(tmp_path, ["abc"])
    a, b = tok.encode_src(["a", "b"])
    assert tok.encode_src(["aZb", "é"]) == [[a[0], UNK_ID, b[0]], [UNK_ID]]
    assert tok.decode_src([[a[0], UNK_ID, b[0]]]) == ["a\ufffdb"]


def test_characters_tokenizer_needs_some_text(tmp_path):
    with pytest.raises(UserError, match="no text"):
        save_characters(tmp_path, ["", ""])


# -- the documents and the prepared stream ------------------------------------------------


@pytest.mark.parametrize(("n_chars", "cut"), [(1000, 900), (1015, 913)])  # nanoGPT: int(n * 0.9), 913.5 -> 913
def test_text_documents_hold_out_the_last_tenth_of_the_first_file(tmp_path, n_chars, cut):
    """documents: text: training is the first 90% of the first file, then each extra file; validation is
    the last 10% of the first file, contiguous (nanoGPT's split)."""
    first = corpus(200)[:n_chars - 1] + "\n"
    assert len(first) == n_chars
    extras = [corpus(10, seed=1), corpus(12, seed=2) + "xyz"]  # the last without a final newline
    for i, text in enumerate(extras):
        (tmp_path / f"extra{i}.txt").write_text(text, encoding="utf-8")
    extras[1] += "\n"  # read_text ends every line with a newline
    (tmp_path / "train.txt").write_text(first, encoding="utf-8")
    raw = lm_config(tmp_path / "train.txt", extra_text=[str(tmp_path / f"extra{i}.txt") for i in range(2)])
    cfg = load_config(RunConfig, raw)
    assert list(lm_documents(cfg)) == [first[:cut], *extras]
    assert list(lm_documents(cfg, held_out=True)) == [first[cut:]]

    task = prepared(raw, tmp_path / "run")
    tok = task.tok
    assert tok.src_pieces_from_ids(range(4, tok.src_vocab_size)) == sorted(set(first[:cut] + "".join(extras)))
    assert np.asarray(task.stream).tolist() == stream_of(tok, [first[:cut], *extras])
    assert task.valid_ids.tolist() == tok.encode_src([first[cut:]])[0]  # one document: no </s>


def test_text_documents_without_extra_files(tmp_path):
    text = corpus(300, seed=4)[:1999] + "\n"
    (tmp_path / "train.txt").write_text(text, encoding="utf-8")
    task = prepared(lm_config(tmp_path / "train.txt"), tmp_path / "run")
    train_ids = np.asarray(task.stream).tolist()
    assert train_ids[-1] == EOS_ID and EOS_ID not in train_ids[:-1]
    assert task.tok.decode_src([train_ids[:-1]]) == [text[:1800]]
    assert task.tok.decode_src([task.valid_ids.tolist()]) == [text[1800:]]


def test_lines_documents_split_rows_as_pretraining_does(tmp_path):
    """documents: lines: one document per non-blank line of every file; held-out rows are pretraining's, the
    others are training documents, in order; the stream is each document then </s>."""
    lines = [f"line {i}: " + " ".join(random.Random(i).sample(WORDS, 4)) for i in range(120)]
    body = [*lines[:60], "", "   ", *lines[60:100]]  # blank lines are no documents
    (tmp_path / "train.txt").write_text("".join(s + "\n" for s in body), encoding="utf-8")
    (tmp_path / "extra.txt").write_text("".join(s + "\n" for s in lines[100:]), encoding="utf-8")
    raw = lm_config(tmp_path / "train.txt", documents="lines", valid_fraction=0.2,
                    extra_text=[str(tmp_path / "extra.txt")])
    cfg = load_config(RunConfig, raw)
    train, held = list(lm_documents(cfg)), list(lm_documents(cfg, held_out=True))
    paths = [cfg.data.train, *cfg.data.extra_text]
    assert held == list(pretraining_texts(cfg, paths, held_out=True))
    assert sorted(train + held) == sorted(lines) and not set(train) & set(held)
    assert train == [s for s in lines if s in set(train)]  # file order kept
    assert 0.05 < len(held) / len(lines) < 0.4

    task = prepared(raw, tmp_path / "run")
    assert np.asarray(task.stream).tolist() == stream_of(task.tok, train)
    assert task.valid_ids.tolist() == document_stream(task.tok, held).tolist()


def test_lines_documents_read_the_text_column_of_a_tsv(tmp_path):
    rows = [(f"row {i} " + " ".join(random.Random(i).sample(WORDS, 3)), "pos" if i % 2 else "neg")
            for i in range(30)]
    valid_rows = [(f"held {i} the king", "pos") for i in range(5)]
    write_tsv(tmp_path / "train.tsv", rows)
    write_tsv(tmp_path / "valid.tsv", valid_rows)
    raw = lm_config(tmp_path / "train.tsv", documents="lines", valid_fraction=0.0, valid=str(tmp_path / "valid.tsv"))
    task = prepared(raw, tmp_path / "run")
    texts = [t for t, _ in rows]
    assert list(lm_documents(task.cfg)) == texts  # the labels are not text
    assert np.asarray(task.stream).tolist() == stream_of(task.tok, texts)
    assert task.valid_ids.tolist() == document_stream(task.tok, [t for t, _ in valid_rows]).tolist()
    assert read_documents(str(tmp_path / "valid.tsv"), "lines") == [t for t, _ in valid_rows]


def test_document_stream_joins_documents_with_eos(tmp_path):
    tok = save_characters(tmp_path, ["abc"])
    a, b, c = (tok.encode_src([ch])[0][0] for ch in "abc")
    assert document_stream(tok, ["ab", "c", "ba"]).tolist() == [a, b, EOS_ID, c, EOS_ID, b, a]
    assert document_stream(tok, ["ab"]).tolist() == [a, b]


# -- blocks ------------------------------------------------------------------------------


@pytest.mark.parametrize(("n_tokens", "block", "per_batch"), [(1000, 16, 5), (200, 7, 3), (50, 16, 2)])
def test_an_epoch_cuts_the_stream_once_into_blocks(n_tokens, block, per_batch):
    for epoch in range(4):
        batches = block_batches(n_tokens, block, per_batch, seed=3, epoch=epoch)
        sizes = [len(b) for b in batches]
        assert all(s == per_batch for s in sizes[:-1]) and 1 <= sizes[-1] <= per_batch
        starts = sorted(s for b in batches for s in b)
        shift = starts[0]
        assert 0 <= shift < block
        assert starts == list(range(shift, shift + block * len(starts), block))  # no gap, no overlap, once each
        last = starts[-1] + block + 1  # every block holds block + 1 tokens of the stream ...
        assert last <= n_tokens < last + block  # ... and no further block fits


def test_block_order_is_seeded_per_epoch():
    def starts(seed: int, epoch: int) -> list[list[int]]:
        return list(block_batches(5000, 16, 8, seed, epoch))

    assert starts(1, 0) == starts(1, 0) and starts(1, 3) == starts(1, 3)
    epochs = [starts(1, e) for e in range(5)]
    assert all(epochs[i] != epochs[j] for i in range(5) for j in range(i))
    assert starts(2, 0) != starts(1, 0)


def test_too_few_tokens_for_one_block_is_a_user_error(tmp_path, capsys):
    assert list(block_batches(17, 16, 4, 0, 0)) == [[0]]  # exactly block + 1 tokens: one block
    with pytest.raises(UserError, match="block_size"):
        block_batches(16, 16, 4, 0, 0)
    (tmp_path / "short.txt").write_text("a short text.\n", encoding="utf-8")
    config = write_yaml(tmp_path / "lm.yaml", lm_config(tmp_path / "short.txt"))
    code, _, err = cli(capsys, "train", config, "--run-dir", tmp_path / "run")
    assert_one_line_error(code, err, "block_size")


def test_collate_shifts_targets_by_one(tmp_path):
    (tmp_path / "train.txt").write_text(corpus(150), encoding="utf-8")
    task = prepared(lm_config(tmp_path / "train.txt"), tmp_path / "run")
    stream = np.asarray(task.stream)
    for epoch in (0, 1):
        for indices in task.batches(epoch):
            batch = task.collate(indices, torch.device("cpu"))
            assert batch.inputs.shape == batch.targets.shape == (len(indices), 16)
            assert batch.n_targets == len(indices) * 16
            for row, s in enumerate(indices):
                assert batch.inputs[row].tolist() == stream[s: s + 16].tolist()
                assert batch.targets[row].tolist() == stream[s + 1: s + 17].tolist()
            assert int(batch.inputs.min()) >= 3 and int(batch.inputs.max()) < task.tok.src_vocab_size


def test_valid_blocks_validates_on_the_first_blocks_of_the_held_out_text(tmp_path, capsys):
    (tmp_path / "train.txt").write_text(corpus(300), encoding="utf-8")
    whole = prepared(lm_config(tmp_path / "train.txt"), tmp_path / "whole").valid_ids
    assert len(whole) > 3 * 16 + 1
    sample = prepared(lm_config(tmp_path / "train.txt", valid_blocks=3), tmp_path / "sample").valid_ids
    assert np.asarray(sample).tolist() == np.asarray(whole[: 3 * 16 + 1]).tolist()  # 3 windows of 16, each scored
    many = prepared(lm_config(tmp_path / "train.txt", valid_blocks=10 ** 6), tmp_path / "many").valid_ids
    assert np.asarray(many).tolist() == np.asarray(whole).tolist()  # more blocks than there are: all of it
    config = write_yaml(tmp_path / "bad.yaml", lm_config(tmp_path / "train.txt", valid_blocks=-1))
    code, _, err = cli(capsys, "train", config, "--run-dir", tmp_path / "bad")
    assert_one_line_error(code, err, "data.valid_blocks")


# -- scoring a text ------------------------------------------------------------------------


def brute_force_loss(model: torch.nn.Module, ids: list[int], context: int) -> float:
    """Mean ``-ln p(ids[t] | its window's earlier tokens)`` over t >= 1, one forward pass per token: token t
    is predicted from ``ids[w * context : t]`` where ``w = (t - 1) // context`` is the window of position t - 1."""
    total = 0.0
    with torch.no_grad():
        for t in range(1, len(ids)):
            start = (t - 1) // context * context
            logits = model(torch.tensor(ids[start:t])[None]).double()[0, -1]  # (V,)
            total -= torch.log_softmax(logits, dim=-1)[ids[t]].item()
    return total / (len(ids) - 1)


@pytest.fixture(scope="module")
def random_lm() -> LanguageModel:
    """A small model with weights large enough (std 0.3) that positions and context matter."""
    torch.manual_seed(0)
    model = LanguageModel(TransformerConfig(d_model=32, n_heads=2, d_ff=64, decoder_layers=2, dropout=0.0,
                                            max_len=64, positions="learned"), vocab_size=20)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.mark.parametrize("n", [2, 17, 50])
@pytest.mark.parametrize("context", [1, 4, 16, 64])
def test_score_stream_equals_brute_force(random_lm, n, context):
    ids = np.random.default_rng(n).integers(4, 20, size=n)
    expected = brute_force_loss(random_lm, ids.tolist(), context)
    for max_tokens in (1, context, 10_000):  # one window per forward pass, or all together (the last padded)
        s = score_stream(random_lm, ids, context, max_tokens, n - 1)
        assert s.tokens == n - 1 and s.characters == n - 1  # every token but the first, once
        assert math.isclose(s.loss, expected, rel_tol=1e-5), (max_tokens, s.loss, expected)
        assert math.isclose(s.perplexity, math.exp(s.loss), rel_tol=1e-12)


def test_the_context_decides_the_windows(random_lm):
    ids = np.random.default_rng(7).integers(4, 20, size=60)
    losses = [score_stream(random_lm, ids, c, 1000, len(ids) - 1).loss for c in (1, 4, 16, 60)]
    assert all(abs(a - b) > 1e-4 for i, a in enumerate(losses) for b in losses[:i])


def test_bits_per_character_of_a_characters_tokenizer(tmp_path, random_lm):
    tok = save_characters(tmp_path, ["abcdefghijklmn \n"])  # 16 characters: the model's vocabulary of 20
    docs = ["abc de\n\nfg", "  hij", "kn l\n"]
    ids = document_stream(tok, docs)
    s = score_stream(random_lm, ids, 8, 1000, scored_characters(tok, ids))
    n_chars = sum(map(len, docs)) + len(docs) - 1 - 1  # + the </s> between documents, - the first (unscored)
    assert s.tokens == len(ids) - 1 == n_chars == s.characters
    assert math.isclose(s.bits_per_character, s.loss / math.log(2) * s.tokens / s.characters, rel_tol=1e-12)
    assert math.isclose(s.bits_per_character, s.loss / math.log(2), rel_tol=1e-12)


def test_an_unknown_character_counts_as_one_character(tmp_path, random_lm):
    tok = save_characters(tmp_path, ["abc"])
    text = "abZcaé"
    ids = document_stream(tok, [text])
    assert ids.tolist().count(UNK_ID) == 2
    s = score_stream(random_lm, ids, 8, 1000, scored_characters(tok, ids))
    assert s.characters == len(text) - 1


#: Documents of characters that take several bytes (é, an emoji, Hangul), with newlines, for bits per character.
NON_ASCII = ["Café crème — déjà vu.\nNext line 🙂 and 서울 and 東京.", "é", "\n\nemoji 🚀🙂 at the end 🙂",
             "Hangul 한국어 text\nwith two lines"]


def tokenizer_of_kind(kind: str, out: Path) -> Tokenizer:
    """A tokenizer of ``kind`` made here: characters, SentencePiece trained as attnkit trains it, or an imported
    causal language model's (tests/hf_models.py): GPT-2's byte-level BPE, Llama's BPE with byte fallback."""
    import hf_models

    texts = hf_models.causal_texts() + NON_ASCII
    if kind == "characters":
        return save_characters(out, texts)
    if kind == "sentencepiece":
        return train_tokenizer(texts, None, out, vocab_size=300)
    out.mkdir(parents=True)
    tk = (hf_models.gpt2_tokenizer if kind == "byte-level-bpe" else hf_models.llama_tokenizer)(out, texts)
    specials = [None, 0, 1, 2] if kind == "byte-fallback" else [None, None, None, tk.token_to_id("<|endoftext|>")]
    write_hf_tokenizers(out / "tok", (out / "tokenizer.json").read_text(encoding="utf-8"), specials,
                        tk.get_vocab_size())
    return Tokenizer.load(out / "tok")


@pytest.mark.parametrize("kind", ["characters", "sentencepiece", "byte-level-bpe", "byte-fallback"])
def test_bits_per_character_counts_the_characters_of_the_scored_text(tmp_path, kind):
    """The characters scored are those of the scored tokens' text, however many tokens spell a character (GPT-2's
    ``é`` is two bytes, ``Ã©``; Llama's newline may be the byte piece ``<0x0A>``; an emoji is four bytes)."""
    tok = tokenizer_of_kind(kind, tmp_path / kind)
    # the text scored is the documents as the tokenizer decodes them, joined by </s> (one character, a line break);
    # SentencePiece's normalisation reads each run of whitespace as one space and drops it at either end
    texts = [" ".join(doc.split()) for doc in NON_ASCII] if kind == "sentencepiece" else NON_ASCII
    ids = document_stream(tok, NON_ASCII)
    assert tok.decode_src(tok.encode_src(NON_ASCII)) == texts
    text = "\n".join(texts)
    assert stream_characters(tok, ids) == len(text)
    first = tok.decode_src([ids[:1]])[0]  # the first token is not scored: "C", or Llama's <s> and SentencePiece's ▁
    assert first == text[: len(first)] and len(first) <= 1
    torch.manual_seed(0)
    model = LanguageModel(TransformerConfig(d_model=16, n_heads=2, d_ff=32, decoder_layers=1, dropout=0.0,
                                            max_len=64, positions="learned"), vocab_size=tok.src_vocab_size).eval()
    s = score_stream(model, ids, 16, 1000, scored_characters(tok, ids))
    assert (s.tokens, s.characters) == (len(ids) - 1, len(text) - len(first))
    assert math.isclose(s.bits_per_character, s.loss * s.tokens / (math.log(2) * s.characters), rel_tol=1e-12)
    if kind != "characters":  # more tokens than characters: a byte, or a piece of a character, is not one
        assert s.tokens != s.characters


# -- a tiny character language model, end to end -------------------------------------------


@dataclass
class TrainedLM:
    run: Path
    trainer: Trainer
    text: str  # the training file
    tail: Path  # a file holding the held-out last tenth of it


@pytest.fixture(scope="module")
def trained_lm(tmp_path_factory) -> TrainedLM:
    tmp = tmp_path_factory.mktemp("lm")
    text = corpus(200)[:1499] + "\n"
    (tmp / "train.txt").write_text(text, encoding="utf-8")
    trainer = train_lm(lm_config(tmp / "train.txt"), tmp / "run")
    (tmp / "tail.txt").write_text(text[1350:], encoding="utf-8")
    assert set(text[1350:]) <= set(text[:1350])  # no unknown character in the validation text
    return TrainedLM(tmp / "run", trainer, text, tmp / "tail.txt")


def test_validation_reports_loss_perplexity_and_bits_per_character(trained_lm):
    task, model = trained_lm.trainer.task, trained_lm.trainer.model
    model.train()
    metrics = task.validate(model, torch.device("cpu"))
    loss = metrics["valid_loss"]
    assert math.isfinite(loss) and 0 < loss < math.log(task.tok.src_vocab_size - 3)  # learned something
    assert math.isclose(metrics["valid_ppl"], math.exp(loss), rel_tol=1e-12)
    assert math.isclose(metrics["valid_bpc"], loss / math.log(2), rel_tol=1e-12)  # one id per character
    assert metrics["score"] == -loss
    assert model.training  # validation leaves the model as it found it
    assert math.isclose(loss, brute_force_loss(model.eval(), task.valid_ids.tolist(), 16), rel_tol=1e-5)
    model.train()


def test_evaluate_prints_the_validation_score_of_the_held_out_text(trained_lm, capsys):
    run = load_run(trained_lm.run)
    expected = score_text_file(run, str(trained_lm.tail))
    valid = trained_lm.trainer.task.validate(trained_lm.trainer.model, torch.device("cpu"))
    assert math.isclose(expected.loss, valid["valid_loss"], rel_tol=1e-5)
    assert math.isclose(expected.bits_per_character, valid["valid_bpc"], rel_tol=1e-5)
    assert expected.tokens == expected.characters == len(trained_lm.text) - 1350 - 1
    code, out, _ = cli(capsys, "evaluate", trained_lm.run, "--data", trained_lm.tail)
    assert code == 0 and out == f"{expected}\n"
    assert f"loss {valid['valid_loss']:.4f} nats/token" in out


def test_evaluate_context_sets_the_windows(trained_lm, capsys):
    run = load_run(trained_lm.run)
    ids = run.tok.encode_src([trained_lm.tail.read_text(encoding="utf-8")])[0]
    four = score_text_file(run, str(trained_lm.tail), context=4)
    assert math.isclose(four.loss, brute_force_loss(run.model, ids, 4), rel_tol=1e-5)
    assert abs(four.loss - score_text_file(run, str(trained_lm.tail)).loss) > 1e-4
    code, out, _ = cli(capsys, "evaluate", trained_lm.run, "--data", trained_lm.tail, "--context", "4")
    assert code == 0 and out == f"{four}\n"


def test_evaluate_context_beyond_the_position_table_is_an_error(trained_lm, capsys):
    run = load_run(trained_lm.run)
    assert score_text_file(run, str(trained_lm.tail), context=48).tokens > 0  # max_len itself is fine
    with pytest.raises(UserError, match="--context 49 exceeds the model's 48 positions"):
        score_text_file(run, str(trained_lm.tail), context=49)
    code, out, err = cli(capsys, "evaluate", trained_lm.run, "--data", trained_lm.tail, "--context", "49")
    assert_one_line_error(code, err, "--context 49")
    assert out == ""
    code, _, err = cli(capsys, "evaluate", trained_lm.run)
    assert_one_line_error(code, err, "--data")


def test_evaluate_reads_lines_as_the_run_reads_its_validation_file(tmp_path):
    lines = [f"line {i} of text<br />second part {i}" for i in range(60)]
    (tmp_path / "train.txt").write_text("".join(s + "\n" for s in lines[:50]), encoding="utf-8")
    (tmp_path / "valid.txt").write_text("".join(s + "\n" for s in lines[50:]), encoding="utf-8")
    raw = lm_config(tmp_path / "train.txt", documents="lines", valid_fraction=0.0, valid=str(tmp_path / "valid.txt"))
    task = prepared(raw, tmp_path / "run")
    d = task.cfg.data
    evaluated = document_stream(task.tok, read_documents(d.valid, d.documents, d.text_column))
    assert evaluated.tolist() == task.valid_ids.tolist()


# -- exact resume -------------------------------------------------------------------------


def test_resume_is_bitwise_identical(tmp_path, capsys):
    """N updates straight equal n updates, then --resume to N: the same weights, optimizer state and
    validations (resumed mid-epoch, after an epoch with its own block offset and order)."""
    (tmp_path / "train.txt").write_text(corpus(120, seed=5), encoding="utf-8")
    raw = lm_config(tmp_path / "train.txt", model={"dropout": 0.1})
    n_epoch = len(prepared(raw, tmp_path / "scratch").batches(0))
    assert 3 <= n_epoch <= 8
    n = n_epoch + n_epoch // 2 + 1
    total = 2 * n
    raw["train"]["valid_every"] = n_epoch
    config = write_yaml(tmp_path / "lm.yaml", raw)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", str(config), "--run-dir", str(straight), f"train.max_updates={total}"]) == 0
    assert main(["train", str(config), "--run-dir", str(resumed), f"train.max_updates={n}"]) == 0
    assert main(["train", str(config), "--run-dir", str(resumed), "--resume", f"train.max_updates={total}"]) == 0
    capsys.readouterr()

    assert_same_checkpoint(straight, resumed, total)

    def logged(run: Path) -> dict[int, dict]:
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {m["step"]: {k: v for k, v in m.items() if k != "minutes"} for m in lines}

    straight_log, resumed_log = logged(straight), logged(resumed)
    assert sorted(straight_log) == [*range(n_epoch, total + 1, n_epoch), *[total] * bool(total % n_epoch)]
    assert all(resumed_log[step] == straight_log[step] for step in straight_log)
    assert all(math.isfinite(m["valid_loss"]) for m in straight_log.values())
