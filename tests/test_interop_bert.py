"""Hugging Face BERT -> attnkit, checked against transformers itself (issue 26).

A tiny random BertForSequenceClassification becomes a classification run whose probabilities equal
transformers'; a BertForMaskedLM becomes a pretraining run whose MLM logits equal transformers' and which
a classification config fine-tunes with ``model.init_from``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from attnkit.cli import main
from attnkit.inference.classify import predict
from attnkit.tasks import load_run

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (after the skip: it builds models with transformers)

TEXTS = hf_models.sentences(40, seed=5)[:30] + hf_models.ACCENTED + ["", "Zürich 北京 ☃ QUICK Brown"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> tuple[Path, Path]:
    return hf_models.imported(tmp_path_factory.mktemp("bert"), hf_models.bert_dir)


def hf_probabilities(hf: Path, texts: list[str]) -> torch.Tensor:
    model = transformers.BertForSequenceClassification.from_pretrained(str(hf)).eval()
    batch = transformers.BertTokenizerFast.from_pretrained(str(hf))(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits.softmax(-1)


def test_tokenization_is_bert_tokenizers(classifier):
    hf, run = classifier
    tok = load_run(run).tok
    reference = transformers.BertTokenizerFast.from_pretrained(str(hf))
    pieces = [tok.src_pieces_from_ids([i])[0] for i in range(tok.src_vocab_size)]
    vocab = reference.get_vocab()
    for text in TEXTS:
        assert [vocab[pieces[i]] for i in tok.encode_src([text])[0]] == reference(text, add_special_tokens=False)[
            "input_ids"], text


def test_probabilities_equal_transformers(classifier, tmp_path, capsys):
    hf, run = classifier
    loaded = load_run(run)
    assert loaded.classes == ["negative", "positive"] and loaded.cfg.data.frame
    probs, _ = predict(loaded, TEXTS, reading="head")
    torch.testing.assert_close(probs, hf_probabilities(hf, TEXTS), atol=1e-5, rtol=1e-4)
    # through the command line, four decimals
    (tmp_path / "in.txt").write_text("\n".join(t for t in TEXTS if t) + "\n", encoding="utf-8")
    assert main(["classify", str(run), "-i", str(tmp_path / "in.txt"), "--read", "head"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = hf_probabilities(hf, [t for t in TEXTS if t])
    for line, p in zip(lines, expected, strict=True):
        label, prob, _ = line.split("\t", 2)
        best = int(p.argmax())
        assert label == ["negative", "positive"][best] and prob == f"{p[best].item():.4f}"


def test_vocab_txt_only_checkpoint_gives_the_same_run(classifier, tmp_path):
    hf = hf_models.bert_dir(tmp_path / "hf", tokenizer_json=False)
    assert main(["import", str(hf), "-o", str(tmp_path / "run")]) == 0
    a, b = load_run(classifier[1]), load_run(tmp_path / "run")
    assert a.tok.encode_src(TEXTS) == b.tok.encode_src(TEXTS)


def test_masked_lm_import_and_fine_tuning_from_it(tmp_path, capsys):
    hf = hf_models.bert_dir(tmp_path / "hf", architecture="BertForMaskedLM")
    assert main(["import", str(hf), "-o", str(tmp_path / "pre")]) == 0
    pre = load_run(tmp_path / "pre")
    assert pre.task == "pretrain"
    reference = transformers.BertForMaskedLM.from_pretrained(str(hf)).eval()
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(hf))
    batch = tokenizer(TEXTS[:8], padding=True, return_tensors="pt")
    pieces = [pre.tok.src_pieces_from_ids([i])[0] for i in range(pre.tok.src_vocab_size)]
    vocab = tokenizer.get_vocab()
    order = [vocab[p] for p in pieces]
    back = {m: i for i, m in enumerate(order)}
    ids = batch["input_ids"].clone().apply_(lambda m: back[m])
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**batch).logits[real][:, order]
        got = pre.model(ids, real)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # fine-tune a classifier from it: the config repeats the encoder's settings (a mismatch is an error)
    rows = [(t, "pos" if i % 2 else "neg") for i, t in enumerate(hf_models.sentences(60, seed=2)[:80])]
    (tmp_path / "train.tsv").write_text("text\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows), encoding="utf-8")
    config = {"task": "classify",
              "data": {"train": str(tmp_path / "train.tsv"), "valid_fraction": 0.2, "max_len": 64, "frame": True},
              "model": {"init_from": str(tmp_path / "pre"), "pooling": "first", "pooler": True,
                        "transformer": pre.cfg.model.transformer.__dict__},
              "train": {"max_updates": 3, "valid_every": 3, "progress": False, "threads": 1, "precision": "fp32",
                        "max_tokens": 512, "average_last": 0}}
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main(["train", str(tmp_path / "ft.yaml"), "--run-dir", str(tmp_path / "ft")]) == 0
    fine = load_run(tmp_path / "ft")
    state = fine.model.state_dict()
    assert fine.tok.encode_src(TEXTS) == pre.tok.encode_src(TEXTS)
    assert state["encoder.token_type.weight"].shape == (2, 32)
    config["model"]["transformer"] = {**config["model"]["transformer"], "activation": "relu"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    assert main(["train", str(tmp_path / "bad.yaml"), "--run-dir", str(tmp_path / "bad")]) == 2
    assert "model.transformer.activation" in capsys.readouterr().err


@pytest.mark.parametrize("changes, message", [
    ({"position_embedding_type": "relative_key"}, "key 'position_embedding_type' is 'relative_key'"),
    ({"hidden_act": "gelu_new"}, "key 'hidden_act' is 'gelu_new', which attnkit cannot represent"),
    ({"vocab_size": 10}, "but config.json key 'vocab_size' is 10"),
    ({"architectures": ["BertForTokenClassification"]}, "key 'architectures' is ['BertForTokenClassification']"),
    ({"problem_type": "multi_label_classification"}, "key 'problem_type' is 'multi_label_classification'"),
])
def test_unsupported_configs_are_one_line_errors(classifier, tmp_path, capsys, changes, message):
    bad = tmp_path / "bad"
    shutil.copytree(classifier[0], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **changes}))
    assert main(["import", str(bad), "-o", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not (tmp_path / "run").exists()


def test_missing_tokenizer_is_named(classifier, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(classifier[0], bad)
    (bad / "tokenizer.json").unlink()
    (bad / "vocab.txt").unlink()
    assert main(["import", str(bad), "-o", str(tmp_path / "run")]) == 2
    assert "vocab.txt: missing (BERT's WordPiece vocabulary: tokenizer.json or vocab.txt)" in capsys.readouterr().err
