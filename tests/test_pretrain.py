"""Masked-language-model pretraining (task: pretrain) and fine-tuning from it (model.init_from)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from attnkit.classifier import TransformerClassifier
from attnkit.cli import main
from attnkit.common.errors import UserError
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.data.labelled import read_labelled
from attnkit.data.tokenizer import Tokenizer
from attnkit.mlm import MaskedLanguageModel, mask_tokens
from attnkit.runs.checkpoint import load_weights
from attnkit.tasks import load_run, make_task
from attnkit.tasks.init_from import load_pretrained_body
from attnkit.training.trainer import Trainer
from attnkit.transformer import TransformerConfig

TINY = {"d_model": 32, "n_heads": 2, "d_ff": 64, "encoder_layers": 1, "dropout": 0.0, "max_len": 64}


def quiet(msg: str) -> None:
    pass


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    subjects, verbs, objects = ["the film", "this movie", "the actor", "the plot"], ["was", "seemed", "felt"], [
        "great", "awful", "boring", "moving", "funny"]
    return [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} and {rng.choice(subjects)} "
            f"{rng.choice(verbs)} {rng.choice(objects)}" for _ in range(n)]


def pretrain_raw(text: Path, **train) -> dict:
    return {"task": "pretrain",
            "data": {"train": str(text), "valid_fraction": 0.2, "max_len": 32, "tokenizer": {"vocab_size": 60}},
            "model": {"transformer": dict(TINY)},
            "train": {"max_tokens": 256, "max_updates": 12, "valid_every": 1000, "progress": False,
                      "precision": "fp32", "threads": 1, "warmup": 5, "lr": 3e-3, "average_last": 0, **train}}


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path




# -- masking -----------------------------------------------------------------------------


def test_masking_follows_berts_15_80_10_10_and_never_touches_special_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, 1000, (400, 500), generator=g)
    tokens[:, 400:] = 0  # padding
    tokens[:, 0], tokens[:, 1] = 2, 3  # <s>, </s>
    tokens[:, 2] = 1  # <unk>
    inputs, selected = mask_tokens(tokens, mask_id=4, special_ids=(1, 2, 3), vocab_size=1000,
                                   generator=torch.Generator().manual_seed(1))
    candidates = tokens >= 5
    assert not selected[~candidates].any()
    assert torch.equal(inputs[~selected], tokens[~selected])  # only selected positions change
    share = selected.sum().item() / candidates.sum().item()
    assert abs(share - 0.15) < 0.003
    n = selected.sum().item()
    masked = (inputs[selected] == 4).sum().item() / n
    kept = (inputs[selected] == tokens[selected]).sum().item() / n
    replaced = inputs[selected][(inputs[selected] != 4) & (inputs[selected] != tokens[selected])]
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(len(replaced) / n - 0.1) < 0.01
    assert replaced.min() >= 5  # a random replacement is never a special piece


def test_masking_selects_at_least_one_position() -> None:
    tokens = torch.tensor([[7, 8, 0, 0]])
    _, selected = mask_tokens(tokens, mask_id=4, special_ids=(1, 2, 3), vocab_size=10, select=1e-9)
    assert selected.tolist() == [[True, False, False, False]]


def test_prediction_layer_is_tied_to_the_embeddings() -> None:
    model = MaskedLanguageModel(TransformerConfig(**TINY), 50)
    names = [n for n, _ in model.named_parameters()]
    assert "encoder.embed.embedding.weight" in names and not any("decoder" in n or "output.weight" in n
                                                                 for n in names)
    tokens = torch.randint(5, 50, (2, 7))
    selected = torch.zeros(2, 7, dtype=torch.bool)
    selected[0, 3] = selected[1, 5] = True
    logits = model(tokens, selected)
    assert logits.shape == (2, 50)
    logits.sum().backward()
    assert model.encoder.embed.weight.grad is not None


# -- pretraining runs ----------------------------------------------------------------------


def test_tiny_encoder_overfits_a_tiny_text(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    rows = ["one two three four five six seven eight nine ten", "red orange yellow green blue indigo violet",
            "monday tuesday wednesday thursday friday saturday sunday"]
    path.write_text("".join(r + "\n" for r in rows * 4), encoding="utf-8")
    raw = pretrain_raw(path, max_updates=400, lr=1e-2, warmup=30, max_epochs=1000)
    raw["data"].update(valid_fraction=0.0, valid=str(path))  # validate on the training text itself
    raw["mlm"] = {"min_len": 2}
    trainer = Trainer(load_config(RunConfig, raw), tmp_path / "run", log=quiet)
    first = trainer.validate()["valid_mlm_acc"]
    metrics = trainer.run()
    assert metrics["valid_mlm_acc"] > 80.0 > first


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_weights(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors")[0]


def straight_and_resumed(raw: dict, tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weights after 12 updates of ``raw`` (dropout 0.1) trained straight, and trained 7 then resumed to 12."""
    raw = {**raw, "train": {**raw["train"], "valid_every": 5, "keep_checkpoints": 10}}
    raw["model"] = {**raw["model"], "transformer": {**raw["model"]["transformer"], "dropout": 0.1}}
    config = write_yaml(tmp_path / "p.yaml", raw)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", str(config), "--run-dir", str(straight), "train.max_updates=12"]) == 0
    assert main(["train", str(config), "--run-dir", str(resumed), "train.max_updates=7"]) == 0
    assert main(["train", str(config), "--run-dir", str(resumed), "--resume", "train.max_updates=12"]) == 0
    return weights(straight, 12), weights(resumed, 12)


def test_resume_of_a_pretraining_run_is_bitwise_identical(tmp_path: Path, text: Path, capsys) -> None:
    a, b = straight_and_resumed(pretrain_raw(text), tmp_path)
    capsys.readouterr()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_pretraining_reads_the_text_column_and_says_labels_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "l.tsv"
    path.write_text("label\ttext\n" + "".join(f"{i % 2}\t{s}\n" for i, s in enumerate(sentences(60))))
    logged: list[str] = []
    task = make_task(load_config(RunConfig, pretrain_raw(path)), tmp_path / "run", logged.append)
    assert any("column 'text'" in m and "labels in 'label' are ignored" in m for m in logged)
    assert task.tok.mask_id == 4
    assert all(4 not in x for x in task.x)  # text never encodes to <mask>


def test_a_pretraining_file_without_text_is_an_error(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n", encoding="utf-8")
    config = write_yaml(tmp_path / "p.yaml", pretrain_raw(empty))
    assert main(["train", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the log lines come before it
    assert err.startswith(f"attnkit: error: {empty}: no non-empty source text")


# -- fine-tuning from a pretraining run ----------------------------------------------------------


@pytest.fixture
def pretrained(tmp_path: Path, text: Path) -> Path:
    run = tmp_path / "pre"
    Trainer(load_config(RunConfig, pretrain_raw(text)), run, log=quiet).run()
    return run


def classify_raw(tmp_path: Path, init_from: Path | None, **transformer) -> dict:
    path = tmp_path / "labelled.tsv"
    path.write_text("label\ttext\n" + "".join(f"{'pos' if 'great' in s else 'neg'}\t{s}\n"
                                              for s in sentences(80, seed=1)))
    return {"task": "classify",
            "data": {"train": str(path), "valid_fraction": 0.2, "max_len": 32, "tokenizer": {"vocab_size": 50}},
            "model": {"init_from": str(init_from) if init_from else None, "transformer": {**TINY, **transformer}},
            "train": {"max_tokens": 256, "max_updates": 3, "valid_every": 1000, "progress": False,
                      "precision": "fp32", "threads": 1, "average_last": 0}}


def test_init_from_copies_exactly_the_encoder_weights(tmp_path: Path, pretrained: Path) -> None:
    run = tmp_path / "fine"
    cfg = load_config(RunConfig, classify_raw(tmp_path, pretrained))
    task = make_task(cfg, run, quiet)
    torch.manual_seed(99)
    model = task.build_model()
    source = load_weights(pretrained / "best.safetensors")[0]
    own = model.state_dict()
    encoder = [k for k in own if k.startswith("encoder.")]
    assert encoder and all(torch.equal(own[k], source[k]) for k in encoder)
    assert "head.weight" in own and "head.weight" not in source
    assert (run / "spm.model").read_bytes() == (pretrained / "spm.model").read_bytes()
    assert task.tok.mask_id == 4


def test_init_from_with_another_shape_lists_the_mismatched_keys(tmp_path: Path, pretrained: Path, capsys) -> None:
    config = write_yaml(tmp_path / "f.yaml", classify_raw(tmp_path, pretrained, d_ff=48))
    assert main(["train", str(config), "--run-dir", str(tmp_path / "fine")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # before anything is written: the key that differs
    assert err.startswith("attnkit: error: model.transformer.d_ff is 48 here but 64 in ")
    assert err.endswith("(model.init_from); copy that run's model.transformer (dropout may differ)")
    assert not (tmp_path / "fine").exists()
    # a task built without the command line checks the config too, and the weights are checked themselves
    with pytest.raises(UserError, match="model.transformer.d_ff is 48 here but 64 in"):
        make_task(load_config(RunConfig, classify_raw(tmp_path, pretrained, d_ff=48)), tmp_path / "fine1", quiet)
    cfg = load_config(RunConfig, classify_raw(tmp_path, pretrained))
    vocab = Tokenizer.load(pretrained).src_vocab_size
    shape = r"'encoder.layers.0.ff.w1.weight' checkpoint \(64, 32\) vs model \(48, 32\)"
    for changes, message in [({"d_ff": 48}, shape), ({"encoder_layers": 2}, "missing key")]:
        other = TransformerClassifier(replace(cfg.model.transformer, **changes), vocab, 2)
        with pytest.raises(UserError, match=message):
            load_pretrained_body(other, cfg)


def test_init_from_compares_norm_first_as_the_layers_read_it(tmp_path: Path, pretrained: Path, capsys) -> None:
    """Unset norm_first is an encoder's post-norm: a config that says false starts from a run that left it unset
    (and an imported BERT's false from a config that leaves it unset, configs/imdb-bert.yaml); true is refused."""
    same = write_yaml(tmp_path / "f.yaml", classify_raw(tmp_path, pretrained, norm_first=False))
    assert main(["train", str(same), "--run-dir", str(tmp_path / "fine")]) == 0
    capsys.readouterr()
    other = write_yaml(tmp_path / "g.yaml", classify_raw(tmp_path, pretrained, norm_first=True))
    assert main(["train", str(other), "--run-dir", str(tmp_path / "fine2")]) == 2
    assert "model.transformer.norm_first is True here but False in" in capsys.readouterr().err


def test_init_from_reads_longer_windows_when_the_positions_have_no_weights(tmp_path: Path, pretrained: Path, text: Path,
                                                                          capsys) -> None:
    """Sinusoidal positions: a classifier may read longer texts than the pretraining windows (imdb-finetune.yaml);
    a learned table has rows for max_len positions only, so there max_len must stay the pretraining run's."""
    longer = write_yaml(tmp_path / "f.yaml", classify_raw(tmp_path, pretrained, max_len=128))
    assert main(["train", str(longer), "--run-dir", str(tmp_path / "fine")]) == 0
    capsys.readouterr()
    learned = tmp_path / "learned"
    pre = pretrain_raw(text)
    pre["model"]["transformer"]["positions"] = "learned"
    Trainer(load_config(RunConfig, pre), learned, log=quiet).run()
    config = write_yaml(tmp_path / "g.yaml", classify_raw(tmp_path, learned, positions="learned", max_len=128))
    assert main(["train", str(config), "--run-dir", str(tmp_path / "fine2")]) == 2
    assert "model.transformer.max_len is 128 here but 64 in" in capsys.readouterr().err


def test_init_from_a_missing_or_non_pretraining_run_is_an_error(tmp_path: Path, pretrained: Path, capsys) -> None:
    config = write_yaml(tmp_path / "f.yaml", classify_raw(tmp_path, tmp_path / "nowhere"))
    assert main(["train", str(config), "--run-dir", str(tmp_path / "fine")]) == 2
    assert "model.init_from:" in capsys.readouterr().err and not (tmp_path / "fine").exists()
    scratch = tmp_path / "scratch"
    assert main(["train", str(write_yaml(tmp_path / "s.yaml", classify_raw(tmp_path, None))),
                 "--run-dir", str(scratch)]) == 0
    capsys.readouterr()
    config = write_yaml(tmp_path / "g.yaml", classify_raw(tmp_path, scratch))
    assert main(["train", str(config), "--run-dir", str(tmp_path / "fine3")]) == 2
    assert "is a classify run; give a `task: pretrain` run" in capsys.readouterr().err


def test_init_from_refuses_a_run_dir_with_another_tokenizer(tmp_path: Path, pretrained: Path, capsys) -> None:
    other = tmp_path / "other"
    assert main(["train", str(write_yaml(tmp_path / "s.yaml", classify_raw(tmp_path, None))),
                 "--run-dir", str(other), "train.max_updates=1"]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()}
    config = write_yaml(tmp_path / "f.yaml", classify_raw(tmp_path, pretrained))
    assert main(["train", str(config), "--run-dir", str(other), "--resume", f"model.init_from={pretrained}"]) == 2
    assert "another tokenizer" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in other.iterdir() if p.is_file()} == before  # nothing overwritten


def test_a_fine_tuned_run_classifies_and_evaluates(tmp_path: Path, pretrained: Path, capsys) -> None:
    fine = tmp_path / "fine"
    config = write_yaml(tmp_path / "f.yaml", classify_raw(tmp_path, pretrained))
    assert main(["train", str(config), "--run-dir", str(fine)]) == 0
    run = load_run(fine)
    assert run.tok.mask_id == 4 and run.classes == ["neg", "pos"]
    capsys.readouterr()
    assert main(["evaluate", str(fine), "--data", str(tmp_path / "labelled.tsv")]) == 0
    assert "accuracy" in capsys.readouterr().out
    assert main(["evaluate", str(pretrained), "--data", str(tmp_path / "labelled.tsv")]) == 2
    assert "pretraining run" in capsys.readouterr().err


def test_pretraining_holds_out_the_rows_the_fine_tuning_run_validates_on(tmp_path: Path) -> None:
    """With the same data.valid_fraction and valid_seed, no validation text of the fine-tuning run is pretrained on."""
    from attnkit.data.documents import clean_text
    from attnkit.tasks.classification import read_validation
    from attnkit.tasks.pretraining import pretraining_texts

    raw = classify_raw(tmp_path, None)
    cfg = load_config(RunConfig, raw)
    valid = read_validation(cfg, quiet)
    pretraining = load_config(RunConfig, pretrain_raw(tmp_path))
    held = list(pretraining_texts(pretraining, [raw["data"]["train"]], held_out=True))
    kept = list(pretraining_texts(pretraining, [raw["data"]["train"]], held_out=False))
    assert [clean_text(t, cfg.data.line_break_tags) for t in valid.texts] == held  # the same rows, in order
    assert held and len(held) + len(kept) == len(read_labelled(raw["data"]["train"]))


def test_distributed_pretraining_resumes_exactly(tmp_path: Path, text: Path) -> None:
    """Two workers under torchrun: stopped after 3 updates and resumed to 6 in new processes == straight to 6."""
    import torch.distributed as dist

    from test_distributed import torchrun

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this PyTorch build has no torch.distributed with the gloo backend")
    raw = pretrain_raw(text, valid_every=3)
    raw["model"]["transformer"]["dropout"] = 0.1
    config = str(write_yaml(tmp_path / "p.yaml", raw))
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    torchrun([config, "--run-dir", straight, "train.max_updates=6"], [config, "--run-dir", resumed,
                                                                      "train.max_updates=3"])
    torchrun([config, "--run-dir", resumed, "--resume", "train.max_updates=6"])
    a, b = weights(Path(straight), 6), weights(Path(resumed), 6)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_unlabelled_reviews_of_held_out_movies_stay_out_of_pretraining(tmp_path: Path) -> None:
    """IMDB's unlabelled reviews (movie, text; no label column) read beside the labelled ones: a movie held out
    of the labelled reviews has none of its unlabelled reviews in the training text; a file without the group
    column is held out by row."""
    from attnkit.tasks.pretraining import pretraining_texts

    labelled, unlabelled, lines = tmp_path / "train.tsv", tmp_path / "unsup.tsv", tmp_path / "more.txt"
    texts = sentences(90, seed=3)
    labelled.write_text("label\tmovie\ttext\n" + "".join(f"{i % 2}\tm{i % 9}\tlabelled {s}\n"
                                                        for i, s in enumerate(texts[:30])), encoding="utf-8")
    unlabelled.write_text("movie\ttext\n" + "".join(f"m{i % 9}\tunlabelled {s}\n"
                                                    for i, s in enumerate(texts[30:60])), encoding="utf-8")
    lines.write_text("".join(f"plain {s}\n" for s in texts[60:]), encoding="utf-8")
    raw = pretrain_raw(labelled)
    raw["data"].update(group_column="movie", valid_fraction=0.3, extra_text=[str(unlabelled), str(lines)])
    cfg = load_config(RunConfig, raw)
    paths = [str(labelled), str(unlabelled), str(lines)]
    train = list(pretraining_texts(cfg, paths))
    held = list(pretraining_texts(cfg, paths, held_out=True))
    movie = {f"{kind} {s}": f"m{i % 9}" for kind, block in (("labelled", texts[:30]), ("unlabelled", texts[30:60]))
             for i, s in enumerate(block)}
    held_movies = {movie[t] for t in held if t in movie}
    assert held_movies and all(movie[t] not in held_movies for t in train if t in movie)  # whole movies held out
    assert any(t.startswith("unlabelled") for t in held) and any(t.startswith("unlabelled") for t in train)
    assert sorted(train + held) == sorted([f"labelled {s}" for s in texts[:30]] + [f"unlabelled {s}" for s in
                                           texts[30:60]] + [f"plain {s}" for s in texts[60:]])
