"""Tests for attnkit.tasks (batches, loss, translate_texts), attnkit.inference.scores and the shipped configs."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import sacrebleu
import torch
import torch.nn.functional as F

from attnkit.common.errors import UserError
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.data import dates
from attnkit.data.batching import pad_batch, padding_fraction
from attnkit.data.tokenizer import EOS_ID, PAD_ID
from attnkit.demo import demo_config
from attnkit.inference.scores import classification_scores, translation_scores
from attnkit.inference.translate import check_source_lengths, translate_texts
from attnkit.search import Uncached, beam_search
from attnkit.tasks import TASKS
from attnkit.tasks.translation import TranslationTask
from attnkit.training.trainer import Trainer
from attnkit.transformer import Transformer, TransformerConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


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
    src_lens, tgt_lens = (lens.tolist() for lens in task.lengths(task.src, task.tgt))  # with </s> / <s>
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


def test_batch_order_is_a_function_of_seed_and_epoch_alone(task, tmp_path):
    """Resume and DDP rely on it: a new process must rebuild an epoch's batches without replaying earlier ones."""
    later = [task.batches(epoch) for epoch in (0, 1, 2)][1]  # epoch 1 after epoch 0 was drawn in this process
    random.seed(123)
    torch.manual_seed(123)  # other global random states than the fixture's
    fresh = TranslationTask(tiny_config(), tmp_path / "fresh", log=lambda msg: None)
    assert fresh.batches(1) == later  # drawn first here
    assert fresh.batches(0) != fresh.batches(1)
    other_seed = TranslationTask(tiny_config(seed=7), tmp_path / "seed7", log=lambda msg: None)
    assert other_seed.batches(1) != later


# -- loss ------------------------------------------------------------------------------


def test_translation_loss_ignores_padding(task):
    torch.manual_seed(0)
    model = task.build_model().eval()
    by_tgt = sorted(range(len(task.tgt)), key=lambda i: (len(task.tgt[i]), len(task.src[i])))  # ids, no </s>
    indices = by_tgt[:3] + by_tgt[-3:] + by_tgt[150:152]  # short and long sides: padding on both
    batch = task.collate(indices, torch.device("cpu"))
    assert batch.src.eq(PAD_ID).any() and batch.tgt_in.eq(PAD_ID).any()  # padded source and target
    with torch.no_grad():
        batched = task.loss(task.objective(model), batch, label_smoothing=0.1)
        single = sum(task.loss(task.objective(model), task.collate([i], torch.device("cpu")), label_smoothing=0.1)
                     for i in indices)
    assert batch.n_targets == sum(len(task.tgt[i]) + 1 for i in indices)  # y_1 .. y_T </s>
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


def test_uncached_decoding_equals_cached(trained):
    model, tok = trained.model, trained.task.tok
    texts = [s for s, _ in dates.generate_pairs(8, seed=9, split="test")]
    for beam in (1, 3):
        assert translate_texts(Uncached(model), tok, texts, beam=beam) == translate_texts(model, tok, texts, beam=beam)


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
    assert check_source_lengths(model, [[5] * 24]) == 24
    with pytest.raises(UserError, match=r"the source text .* at most 24"):  # attention plots: the whole text or nothing
        check_source_lengths(model, [[5] * 25], "the source text")


def test_an_overlong_line_is_cut_with_one_warning_and_the_output_stays_aligned(trained, caplog):
    model, tok = trained.model, trained.task.tok
    limit = model.cfg.max_len
    long = " ".join(["Sonntag, 3. März 2024"] * 30)
    texts = ["1 May 1999", long, "2. Mai 2001", long]
    assert len(tok.encode_src([long])[0]) + 1 > limit
    with caplog.at_level(logging.WARNING, logger="attnkit"):
        out = translate_texts(model, tok, texts, beam=2)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and warned[0].startswith("input line 2 is ") and warned[1].startswith("input line 4 is ")
    assert f"first {limit - 1} subwords" in warned[0]
    assert len(out) == 4 and out[1] == out[3] and out[0] == translate_texts(model, tok, texts[:1], beam=2)[0]
    cut = tok.encode_src([long])[0][: limit - 1] + [EOS_ID]  # what the model reads of it
    with torch.inference_mode():
        expect = beam_search(model, pad_batch([cut], PAD_ID), beam_size=2, lenpen=0.6, max_len_a=0.0,
                             max_len_b=limit)
    assert out[1] == tok.decode_tgt([expect[0][0].tokens])


def test_blank_lines_translate_to_empty_lines(trained):
    model, tok = trained.model, trained.task.tok
    texts = ["", "1 May 1999", "   ", "\t"]
    for beam, n_best in ((1, 1), (3, 2)):
        out = translate_texts(model, tok, texts, beam=beam, n_best=n_best)
        assert out[0] == out[2] == out[3] == [""] * n_best
        assert out[1] == translate_texts(model, tok, texts[1:2], beam=beam, n_best=n_best)[0] and out[1][0]


@pytest.mark.parametrize("option", ["lenpen", "max_len_a", "max_len_b"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_decoding_options_are_refused(trained, option, value):
    with pytest.raises(UserError, match=f"{option} must be a finite number"):
        translate_texts(trained.model, trained.task.tok, ["1 May 1999"], beam=2, **{option: value})


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


def test_demo_config_is_the_packaged_yaml_which_configs_links_to():
    assert (CONFIGS / "demo.yaml").resolve() == (ROOT / "src" / "attnkit" / "demo.yaml").resolve()
    assert load_config(RunConfig, CONFIGS / "demo.yaml") == demo_config()


def test_every_file_the_package_reads_is_shipped_as_package_data():
    """A plain ``pip install .`` copies only the package data pyproject.toml lists besides the code."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {f"{package}/{name}".replace(".", "/", package.count(".")) for package, names in listed.items()
               for name in names}
    src = ROOT / "src"
    data = {str(p.relative_to(src)) for p in (src / "attnkit").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts}
    assert {"attnkit/demo.yaml", "attnkit/viz/explorer.html"} <= data  # the listing still sees them
    assert data <= shipped, f"not shipped: {sorted(data - shipped)}"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(RunConfig, path)
    assert cfg.task in TASKS
