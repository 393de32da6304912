"""Tests for attnkit.tasks (batches, loss, translate_texts), attnkit.evaluate and the shipped configs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import sacrebleu
import torch
import torch.nn.functional as F

from attnkit import dates
from attnkit.config import load_config
from attnkit.data import pad_batch, padding_fraction
from attnkit.demo import DEMO_CONFIG
from attnkit.errors import UserError
from attnkit.evaluate import classification_scores, translation_scores
from attnkit.runconfig import RunConfig
from attnkit.search import beam_search
from attnkit.tasks import TranslationTask, translate_texts
from attnkit.tokenizer import EOS_ID, PAD_ID
from attnkit.train import Trainer
from attnkit.transformer import Transformer, TransformerConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def tiny_config(**train) -> RunConfig:
    raw = {
        "task": "translate",
        "data": {"generate": "dates", "generate_train": 300, "generate_valid": 20, "max_len": 64,
                 "tokenizer": {"vocab_size": 80}},
        "model": {"transformer": {"d_model": 32, "n_heads": 2, "d_ff": 64, "encoder_layers": 1,
                                  "decoder_layers": 1, "dropout": 0.0, "max_len": 128}},
        "train": {"max_tokens": 500, "max_updates": 40, "valid_every": 40, "progress": False, "precision": "fp32",
                  "threads": 1, "warmup": 10, "lr": 3e-3, "valid_bleu_sentences": 0, **train},
    }
    return load_config(RunConfig, raw)


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> TranslationTask:
    return TranslationTask(tiny_config(), tmp_path_factory.mktemp("task"), log=lambda msg: None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trainer:
    torch.set_num_threads(1)
    trainer = Trainer(tiny_config(), tmp_path_factory.mktemp("run"), log=lambda msg: None)
    trainer.run()
    trainer.model.eval()
    return trainer


# -- batches ---------------------------------------------------------------------------


@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_every_example_in_exactly_one_batch_per_epoch(task, epoch):
    batches = task.batches(epoch)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(task.src)))
    assert len(task.src) == 300


def test_batches_respect_budget_and_bucketing_keeps_padding_low(task):
    batches = task.batches(0)
    src_lens = [len(s) for s in task.src]
    tgt_lens = [len(t) - 1 for t in task.tgt]
    for b in batches:
        longest = max(max(src_lens[i], tgt_lens[i]) for i in b)
        assert len(b) == 1 or len(b) * longest <= task.cfg.train.max_tokens
    bucketed = padding_fraction(batches, src_lens, tgt_lens)
    # the same batch sizes filled at random, for comparison
    order = list(range(len(src_lens)))
    random.Random(0).shuffle(order)
    shuffled, pos = [], 0
    for b in batches:
        shuffled.append(order[pos: pos + len(b)])
        pos += len(b)
    unbucketed = padding_fraction(shuffled, src_lens, tgt_lens)
    assert bucketed < 0.25
    assert bucketed < unbucketed / 2


def test_batch_order_changes_with_epoch_but_is_reproducible(task):
    assert task.batches(1) == task.batches(1)
    assert task.batches(0) != task.batches(1)


# -- loss ------------------------------------------------------------------------------


def test_translation_loss_ignores_padding(task):
    torch.manual_seed(0)
    model = task.build_model().eval()
    by_tgt = sorted(range(len(task.tgt)), key=lambda i: (len(task.tgt[i]), len(task.src[i])))
    indices = by_tgt[:3] + by_tgt[-3:] + by_tgt[150:152]  # short and long sides: padding on both
    batch = task.collate(indices, torch.device("cpu"))
    assert batch.src.eq(PAD_ID).any() and batch.tgt_in.eq(PAD_ID).any()  # padded source and target
    with torch.no_grad():
        batched = task.loss(task.objective(model), batch, label_smoothing=0.1)
        single = sum(task.loss(task.objective(model), task.collate([i], torch.device("cpu")), label_smoothing=0.1)
                     for i in indices)
    assert batch.n_targets == sum(len(task.tgt[i]) - 1 for i in indices)
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-4)


def test_translation_loss_is_summed_cross_entropy(task):
    torch.manual_seed(0)
    model = task.build_model().eval()
    idx = task.batches(0)[0][:1]
    batch = task.collate(idx, torch.device("cpu"))
    with torch.no_grad():
        logits = model(batch.src, batch.tgt_in)[0]  # (T, V) at every position, padding included
        expected = F.cross_entropy(logits[batch.scored[0]], batch.targets, reduction="sum")
        assert torch.allclose(task.loss(task.objective(model), batch, 0.0), expected, atol=1e-5)


# -- translate_texts -------------------------------------------------------------------


def test_beam_1_equals_greedy(trained):
    model, tok = trained.model, trained.task.tok
    texts = [s for s, _ in dates.generate_pairs(12, seed=5, split="test")]
    greedy = translate_texts(model, tok, texts, beam=1)
    ids = [s + [EOS_ID] for s in tok.encode_src(texts)]
    with torch.inference_mode():
        hyps = beam_search(model, pad_batch(ids, PAD_ID), beam_size=1, lenpen=0.6)
    beam1 = tok.decode_tgt([h[0].tokens for h in hyps])
    assert [g[0] for g in greedy] == beam1
    assert translate_texts(model, tok, texts, beam=1, batch_size=5) == greedy  # batching does not matter


def test_translate_texts_keeps_input_order_and_n_best(trained):
    model, tok = trained.model, trained.task.tok
    texts = ["1. Mai 1999", "May 1, 1999 and some more words here", "1999/05/01"]
    out = translate_texts(model, tok, texts, beam=3, n_best=2)
    assert [len(h) for h in out] == [2, 2, 2]
    single = [translate_texts(model, tok, [t], beam=3, n_best=2)[0] for t in texts]
    assert out == single
    assert translate_texts(model, tok, [], beam=2) == []


class NeverEnds(Transformer):
    """A Transformer that never emits </s>: every output runs to its length budget."""

    longest = 0  # most decoder positions used so far

    def decode_step(self, prev, state, need_weights=False):
        self.longest = max(self.longest, state.tokens.size(1) + 1)
        logits, state, weights = super().decode_step(prev, state, need_weights)
        logits[:, EOS_ID] = float("-inf")
        return logits, state, weights


def test_translate_texts_stays_within_the_models_positions(trained):
    tok = trained.task.tok
    torch.manual_seed(0)
    model = NeverEnds(TransformerConfig(d_model=32, n_heads=2, d_ff=64, encoder_layers=1, decoder_layers=1,
                                        max_len=24), tok.src_vocab_size, tok.tgt_vocab_size).eval()
    texts = ["1 May 1999", "Sonntag, 3. März 2024"]
    for beam in (1, 2):
        model.longest = 0
        translate_texts(model, tok, texts, beam=beam, max_len_b=50)  # budget 50+ > 24 positions
        assert model.longest == 24
        model.longest = 0
        translate_texts(model, tok, texts, beam=beam, max_len_a=0.0, max_len_b=5)  # within the limit
        assert model.longest == 5
    with pytest.raises(UserError, match=r"input line 2 .* at most 24"):
        translate_texts(model, tok, ["1 May 1999", " ".join(["Sonntag, 3. März 2024"] * 4)])


# -- evaluation ------------------------------------------------------------------------


def test_classification_scores_hand_computed():
    classes = ["a", "b", "c"]
    true = [0, 0, 0, 1, 1, 2]
    pred = [0, 0, 1, 1, 2, 2]
    s = classification_scores(true, pred, classes)
    assert s.confusion == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert s.accuracy == pytest.approx(100 * 4 / 6)
    # F1: a = 2*2/(4+0+1) = 0.8; b = 2/(2+1+1) = 0.5; c = 2/(2+1+0) = 2/3
    assert s.macro_f1 == pytest.approx(100 * (0.8 + 0.5 + 2 / 3) / 3)
    text = str(s)
    assert "accuracy 66.67" in text and "macro-F1 65.56" in text and "confusion matrix" in text


def test_classification_scores_absent_class_counts_as_zero():
    s = classification_scores([0, 0], [0, 0], ["x", "y"])
    assert s.accuracy == 100.0 and s.macro_f1 == pytest.approx(50.0)


def test_translation_scores_match_sacrebleu():
    hyps = ["The cat sat on the mat.", "a dog barks", "Hello there world"]
    refs = ["The cat sat on the mat.", "A dog is barking.", "hello world"]
    s = translation_scores(hyps, refs)
    assert s.bleu == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert s.bleu_lowercase == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], lowercase=True).score, abs=1e-9)
    assert s.chrf == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    assert s.bleu_lowercase > s.bleu
    assert "tok:13a" in s.signature and "case:mixed" in s.signature
    assert "signature: " in str(s)
    with pytest.raises(ValueError):
        translation_scores(hyps, refs[:2])


# -- configs ---------------------------------------------------------------------------


def test_demo_yaml_equals_demo_config():
    assert load_config(RunConfig, CONFIGS / "demo.yaml") == load_config(RunConfig, DEMO_CONFIG)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(RunConfig, path)
    assert cfg.task in ("translate", "classify", "pretrain")
