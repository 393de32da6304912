"""Replaced-token detection (ELECTRA, Clark et al. 2020) as a pretraining objective: mlm.objective: electra."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnkit.cli import main
from attnkit.common.errors import UserError
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.mlm import (
    ReplacedTokenDetection,
    ReplacedTokenDetectionLoss,
    generator_config,
    mask_tokens,
    replaced_labels,
    sample_replacements,
)
from attnkit.runs.checkpoint import load_weights
from attnkit.tasks import make_task
from attnkit.training.trainer import Trainer
from attnkit.transformer import TransformerConfig
from test_pretrain import classify_raw, pretrain_raw, quiet, straight_and_resumed, write_yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = TransformerConfig(d_model=32, n_heads=2, d_ff=64, encoder_layers=1, dropout=0.0, max_len=64)
MASK_ID, V = 4, 40


def electra_raw(text: Path, **train) -> dict:
    raw = pretrain_raw(text, **train)
    raw["mlm"] = {"objective": "electra"}
    return raw


def masked_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(original, x^masked, selected)``: three padded rows, every selected subword -> <mask>."""
    g = torch.Generator().manual_seed(seed)
    original = torch.randint(5, V, (3, 12), generator=g)
    original[1, 9:] = original[2, 5:] = 0  # padding
    inputs, selected = mask_tokens(original, mask_id=MASK_ID, special_ids=(1, 2, 3), vocab_size=V, select=0.4,
                                   mask=1.0, random=0.0, generator=g)
    return original, inputs, selected


# -- the model ---------------------------------------------------------------------------------


def test_the_generator_is_narrower_with_the_discriminators_d_k() -> None:
    base = TransformerConfig(d_model=512, n_heads=8, d_ff=2048, encoder_layers=6)
    small = generator_config(base, 0.25)
    assert (small.d_model, small.n_heads, small.d_ff, small.encoder_layers) == (128, 2, 512, 6)
    assert small.d_model // small.n_heads == base.d_model // base.n_heads  # d_k kept
    odd = generator_config(TransformerConfig(d_model=40, n_heads=4, d_ff=80), 0.3)  # d_model 12, 1.2 -> 1 head
    assert odd.d_model % odd.n_heads == 0 and odd.n_heads >= 1
    model = ReplacedTokenDetection(TINY, V)
    assert model.generator.cfg.d_model == 8 and model.generator.layers[0].ff.w1.weight.shape == (16, 8)
    assert not any("embed" in k for k in model.state_dict() if not k.startswith("encoder."))  # one shared table


def test_replaced_labels_are_exactly_the_positions_whose_subword_differs() -> None:
    """The generator is forced to sample subword 7: where the original was 7 the position counts as original."""
    original, inputs, selected = masked_batch()
    original[0, selected[0].nonzero()[0, 0]] = 7  # at least one selected original equals the forced sample
    model = ReplacedTokenDetection(TINY, V, never_sample=(1, 2, 3, MASK_ID))
    with torch.no_grad():
        model.generator.output_bias.fill_(-1e4)
        model.generator.output_bias[7] = 1e4
    out = model(inputs, selected)
    assert torch.equal(out.corrupted[selected], torch.full((int(selected.sum()),), 7))
    assert torch.equal(out.corrupted[~selected], original[~selected])  # only the selected positions change
    replaced, real = replaced_labels(out.corrupted, original)
    assert torch.equal(real, original != 0)
    assert torch.equal(replaced, selected & (original != 7))
    assert (selected & ~replaced).any() and replaced.any()  # both cases occur
    with torch.no_grad():  # a special piece is never sampled, however likely the generator finds it
        model.generator.output_bias[MASK_ID] = 1e5
    assert not (model(inputs, selected).corrupted == MASK_ID).any()


def test_samples_follow_the_generators_softmax_and_never_a_banned_id() -> None:
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0]]).repeat_interleave(20_000, 0)
    drawn = sample_replacements(logits, never=(1,), generator=torch.Generator().manual_seed(0))  # (40000,)
    for row in range(2):
        expected = logits[row * 20_000].index_fill(0, torch.tensor([1]), float("-inf")).softmax(-1)  # (5,)
        freq = torch.bincount(drawn[row * 20_000: (row + 1) * 20_000], minlength=5).float() / 20_000
        assert freq[1] == 0 and (freq - expected).abs().max() < 0.01, (freq, expected)
    again = sample_replacements(logits, never=(1,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(drawn, again)  # the generator's seed decides every draw


def test_no_gradient_flows_through_the_sampling() -> None:
    original, inputs, selected = masked_batch(1)
    model = ReplacedTokenDetection(TINY, V, never_sample=(1, 2, 3, MASK_ID))
    out = model(inputs, selected)
    replaced, real = replaced_labels(out.corrupted, original)
    bce = F.binary_cross_entropy_with_logits(out.replaced_logits[real], replaced[real].float(), reduction="sum")
    generator = [p for n, p in model.named_parameters() if n.startswith("generator.")]
    assert all(g is None for g in torch.autograd.grad(bce, generator, retain_graph=True, allow_unused=True))
    embedding_grad, = torch.autograd.grad(bce, [model.encoder.embed.weight])
    assert embedding_grad.abs().sum() > 0  # the shared embedding learns from the discriminator

    def grads(weight: float) -> dict[str, torch.Tensor]:
        model.zero_grad()
        torch.manual_seed(5)  # the same samples
        ReplacedTokenDetectionLoss(model, weight)(inputs, selected, original[selected]).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    mlm_only, electra = grads(0.0), grads(50.0)
    assert all(torch.equal(mlm_only[n], electra[n]) for n in mlm_only if n.startswith("generator."))
    assert not torch.equal(mlm_only["encoder.layers.0.ff.w1.weight"], electra["encoder.layers.0.ff.w1.weight"])


def test_the_loss_per_selected_position_is_the_papers_mean_mlm_plus_lambda_mean_bce() -> None:
    original, inputs, selected = masked_batch(2)
    model = ReplacedTokenDetection(TINY, V, never_sample=(1, 2, 3, MASK_ID))
    torch.manual_seed(3)
    loss = ReplacedTokenDetectionLoss(model, 50.0)(inputs, selected, original[selected])
    torch.manual_seed(3)
    out = model(inputs, selected)
    replaced, real = replaced_labels(out.corrupted, original)
    mean_mlm = F.cross_entropy(out.generator_logits, original[selected])
    mean_bce = F.binary_cross_entropy_with_logits(out.replaced_logits[real], replaced[real].float())
    torch.testing.assert_close(loss / selected.sum(), mean_mlm + 50.0 * mean_bce)


# -- pretraining runs -----------------------------------------------------------------------------


def test_electra_batches_mask_every_selected_subword(tmp_path: Path, text: Path) -> None:
    task = make_task(load_config(RunConfig, electra_raw(text)), tmp_path / "run", quiet)
    torch.manual_seed(0)
    batch = task.collate(list(range(8)), torch.device("cpu"))
    assert batch.n_targets == int(batch.selected.sum()) > 0
    assert (batch.tokens[batch.selected] == task.tok.mask_id).all()
    assert isinstance(task.build_model(), ReplacedTokenDetection)


def test_the_electra_loss_falls_on_a_tiny_text(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    rows = ["one two three four five six seven eight nine ten", "red orange yellow green blue indigo violet"]
    path.write_text("".join(r + "\n" for r in rows * 4), encoding="utf-8")
    raw = electra_raw(path, max_updates=40, lr=1e-2, warmup=10, max_epochs=1000)
    raw["data"].update(valid_fraction=0.0, valid=str(path))
    raw["mlm"].update(min_len=2, generator_width=0.5)
    trainer = Trainer(load_config(RunConfig, raw), tmp_path / "run", log=quiet)
    first = trainer.validate()
    last = trainer.run()
    assert last["score"] == last["valid_rtd_acc"]
    assert last["valid_loss"] < 0.7 * first["valid_loss"]
    assert last["valid_mlm_loss"] < first["valid_mlm_loss"] and last["valid_rtd_loss"] < first["valid_rtd_loss"]


def test_resume_of_an_electra_run_is_bitwise_identical(tmp_path: Path, text: Path, capsys) -> None:
    a, b = straight_and_resumed(electra_raw(text), tmp_path)
    capsys.readouterr()
    assert a.keys() == b.keys() and any(k.startswith("generator.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_init_from_an_electra_run_copies_exactly_the_discriminators_encoder(tmp_path: Path, text: Path,
                                                                            capsys) -> None:
    pre = tmp_path / "pre"
    Trainer(load_config(RunConfig, electra_raw(text, max_updates=4)), pre, log=quiet).run()
    source = load_weights(pre / "best.safetensors")[0]
    cfg = load_config(RunConfig, classify_raw(tmp_path, pre))
    torch.manual_seed(99)
    own = make_task(cfg, tmp_path / "fine", quiet).build_model().state_dict()
    encoder = [k for k in own if k.startswith("encoder.")]
    assert sorted(encoder) == sorted(k for k in source if k.startswith("encoder."))
    assert all(torch.equal(own[k], source[k]) for k in encoder)
    assert not any(k.startswith(("generator.", "replaced_head.")) for k in own)
    config = write_yaml(tmp_path / "f.yaml", classify_raw(tmp_path, pre))
    assert main(["train", str(config), "--run-dir", str(tmp_path / "fine2")]) == 0  # end to end
    capsys.readouterr()


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(("override", "message"), [
    ("mlm.objective=bert", "mlm.objective"),
    ("mlm.generator_width=0", "in 'mlm': generator_width must be in (0, 1], got 0.0"),
    ("mlm.generator_width=1.5", "in 'mlm': generator_width must be in (0, 1], got 1.5"),
    ("mlm.electra_weight=-1", "in 'mlm': electra_weight must be a finite number >= 0, got -1.0"),
    ("mlm.generator_lr=0", "in 'mlm': generator_lr must be a finite number > 0, got 0.0"),
])
def test_config_errors_name_the_key(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(UserError, match=None) as err:
        load_config(RunConfig, electra_raw(tmp_path / "t.txt"), [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_defaults_keep_bert(tmp_path: Path) -> None:
    m = load_config(RunConfig, pretrain_raw(tmp_path / "t.txt")).mlm
    assert (m.objective, m.generator_width, m.electra_weight) == ("mlm", 0.25, 50.0)


def test_the_generator_can_learn_at_its_own_rate(tmp_path: Path, text: Path) -> None:
    """``mlm.generator_lr: 5``: every generator parameter in a group at 5 x the rate, the rest (the shared
    embeddings included) at the rate; after an update the optimiser's rates follow the schedule in that ratio."""
    raw = electra_raw(text, max_updates=1)
    raw["mlm"]["generator_lr"] = 5.0
    trainer = Trainer(load_config(RunConfig, raw), tmp_path / "run", log=quiet)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    base, gen = trainer.optimizer.param_groups
    assert all(names[id(p)].startswith("generator.") for p in gen["params"])
    assert not any(names[id(p)].startswith("generator.") for p in base["params"])
    assert len(base["params"]) + len(gen["params"]) == len(names)
    trainer.run()
    assert gen["lr"] == pytest.approx(5 * base["lr"]) and base["lr"] > 0
    plain = Trainer(load_config(RunConfig, electra_raw(text, max_updates=1)), tmp_path / "one", log=quiet)
    assert len(plain.optimizer.param_groups) == 1  # the paper's one rate by default


# -- does the committed recipe learn? (issue 38) ------------------------------------------------------


#: The committed ELECTRA recipe, kept runnable beside the configs it is not (docs/sentiment.md says why).
ELECTRA_CONFIG = ROOT / "experiments" / "configs" / "imdb-electra-pretrain.yaml"
WORDS, FIRST_WORD, SPECIALS = 60, 5, (1, 2, 3)  # ids 0-4: <pad>, <unk>, <s>, </s>, <mask> (MASK_ID)
LENGTH, BATCH = 32, 16  # (rows, words) of a training batch


def chain_corpus(rows: int, generator: torch.Generator) -> torch.Tensor:
    """``rows`` chains ``(rows, LENGTH)`` of word ids, each from a random first word, ``x_{t+1} = perm(x_t)``."""
    perm = torch.randperm(WORDS, generator=torch.Generator().manual_seed(1))  # the same language for every call
    out = torch.empty(rows, LENGTH, dtype=torch.long)
    word = torch.randint(0, WORDS, (rows,), generator=generator)  # (rows,)
    for t in range(LENGTH):
        out[:, t] = word + FIRST_WORD
        word = perm[word]
    return out


def corrupt(tokens: torch.Tensor, select: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ELECTRA's input: ``select`` of the words -> ``<mask>`` (as the pretraining task corrupts)."""
    return mask_tokens(tokens, mask_id=MASK_ID, special_ids=SPECIALS, vocab_size=FIRST_WORD + WORDS, select=select,
                       mask=1.0, random=0.0, generator=generator)


def train_on_chain(cfg: RunConfig, lr: float, *, warmup: int = 100, updates: int = 300, every: int = 100,
                   seed: int = 0) -> list[dict]:
    """``cfg``'s ELECTRA at ``lr`` for ``updates`` updates; the held-out measures every ``every`` updates."""
    torch.manual_seed(seed)
    model = ReplacedTokenDetection(replace(cfg.model.transformer, max_len=LENGTH), FIRST_WORD + WORDS,
                                   generator_width=cfg.mlm.generator_width, never_sample=(*SPECIALS, MASK_ID))
    objective = ReplacedTokenDetectionLoss(model, cfg.mlm.electra_weight)
    tc = cfg.train
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=tc.betas, eps=tc.eps)
    data = torch.Generator().manual_seed(seed + 2)
    valid = chain_corpus(128, torch.Generator().manual_seed(99))  # (128, LENGTH)
    valid_in, valid_sel = corrupt(valid, cfg.mlm.select, torch.Generator().manual_seed(5))

    def measure(update: int) -> dict:
        model.eval()
        with torch.no_grad():
            out = model(valid_in, valid_sel, torch.Generator().manual_seed(7))
            replaced, real = replaced_labels(out.corrupted, valid)
            said = out.replaced_logits[real] > 0  # (M,) the discriminator: replaced
            truth = replaced[real]
            row = {"update": update,
                   "gen_acc": 100 * (out.generator_logits.argmax(-1) == valid[valid_sel]).float().mean().item(),
                   "rtd_acc": 100 * (said == truth).float().mean().item(),
                   "prior": 100 * (1 - truth.float().mean().item())}
        model.train()
        return {k: round(v, 2) for k, v in row.items()}

    curve = []
    for update in range(1, updates + 1):
        tokens = chain_corpus(BATCH, data)  # (BATCH, LENGTH)
        inputs, selected = corrupt(tokens, cfg.mlm.select, data)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, update / warmup)
        loss = objective(inputs, selected, tokens[selected]) / selected.sum()  # the trainer's mean per selected
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip_norm)
        optimizer.step()
        if update % every == 0:
            curve.append(measure(update))
    return curve


def test_the_committed_electra_recipe_learns_on_a_corpus_whose_answer_is_known() -> None:
    """The model, objective and learning rate of ``experiments/configs/imdb-electra-pretrain.yaml`` on chains
    through a permutation, where a neighbour gives every word away. After 200 updates the generator is far above the
    unigram baseline and the discriminator above the prior (calling every word original). At the learning
    rate committed before issue 38, 5e-3, the discriminator stayed exactly at the prior: this failed then."""
    cfg = load_config(RunConfig, ELECTRA_CONFIG)
    last = train_on_chain(cfg, cfg.train.lr, warmup=100, updates=200, every=200)[-1]
    assert last["gen_acc"] > 5 * 100 / WORDS, last  # unigram: 1 / WORDS
    assert last["rtd_acc"] > last["prior"] + 2.0, last
