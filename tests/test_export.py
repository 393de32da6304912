"""Tests for attnkit.export: a tiny Transformer exported to CTranslate2 decodes as attnkit does; bad exports fail."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
import yaml

from attnkit.cli import main
from attnkit.data import dates
from attnkit.data.batching import pad_batch
from attnkit.data.tokenizer import PAD_ID
from attnkit.export.ctranslate2 import MANIFEST, ExportedTranslator, export_ctranslate2, is_exported
from attnkit.inference.translate import encode_sources, translate_texts
from attnkit.search import greedy_search
from attnkit.tasks import load_run

pytest.importorskip("ctranslate2")


#: the fixture's variants: the paper's post-norm; pre-norm; and separate vocabularies, untied output, learned
#: positions, unscaled dot-product scores and unequal depths (every other branch of the spec mapping)
VARIANTS = {"post-norm": {}, "pre-norm": {"norm_first": True},
            "separate": {"share_embeddings": False, "tie_output": False, "positions": "learned",
                         "attention_score": "dot", "encoder_layers": 1},
            # the options other published models need (attnkit import): Marian's, then BERT's
            "marian": {"activation": "swish", "position_layout": "halves", "output_bias": True},
            "bert-like": {"activation": "gelu", "scale_embeddings": False, "positions": "learned", "token_types": 2,
                          "embedding_norm": True, "norm_eps": 1e-12}}


def tiny_config(norm_first: bool, arch: str = "transformer", updates: int = 150, **model) -> dict:
    joint = model.get("share_embeddings", True)
    return {"task": "translate",
            "data": {"generate": "dates", "generate_train": 2000, "generate_valid": 20, "max_len": 64,
                     "tokenizer": {"vocab_size": 80, "joint": joint}},
            "model": {"arch": arch,
                      "transformer": {"d_model": 32, "n_heads": 2, "d_ff": 64, "encoder_layers": 2,
                                      "decoder_layers": 2, "dropout": 0.0, "max_len": 96, "norm_first": norm_first,
                                      **model},
                      "rnn": {"embed_dim": 16, "hidden_size": 16, "dropout": 0.0}},
            "train": {"max_tokens": 1000, "max_updates": updates, "valid_every": 1000, "progress": False,
                      "precision": "fp32", "threads": 1, "warmup": 20, "lr": 5e-3, "valid_bleu_sentences": 0,
                      "average_last": 0, "seed": 1},
            "decode_beam": 3, "decode_lenpen": 0.6}


def train(tmp: Path, raw: dict) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw), encoding="utf-8")
    assert main(["train", str(config), "--run-dir", str(tmp / "run")]) == 0
    return tmp / "run"


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory) -> tuple[Path, Path]:
    """``(run, export)``: a tiny date-normalising Transformer trained 150 updates, exported in float32."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp(request.param)
    variant = dict(VARIANTS[request.param])
    run = train(tmp, tiny_config(norm_first=variant.pop("norm_first", False), **variant))
    return run, export_ctranslate2(run, tmp / "ct2")


TEXTS = [s for s, _ in dates.generate_pairs(120, seed=7, split="test")]


def test_greedy_is_token_for_token_attnkits(exported):
    run_dir, out = exported
    run, ct2 = load_run(run_dir), ExportedTranslator(out, threads=1)
    ids = encode_sources(run.tok, TEXTS, run.model.cfg.max_len)
    with torch.inference_mode():
        ours = [h.tokens for h in greedy_search(run.model, pad_batch(ids, PAD_ID), max_len_a=0.0, max_len_b=90)]
    results = ct2.translator.translate_batch([run.tok.src_pieces_from_ids(s) for s in ids], beam_size=1,
                                             max_decoding_length=90, min_decoding_length=0)
    target_ids = {p: i for i, p in enumerate(run.tok.tgt_pieces_from_ids(range(run.tok.tgt_vocab_size)))}
    theirs = [[target_ids[p] for p in r.hypotheses[0]] for r in results]
    assert ours == theirs
    outputs = {tuple(t) for t in ours}
    assert len(outputs) > len(TEXTS) // 2  # trained: the outputs depend on the input
    assert ct2.translate(TEXTS, beam=1, lenpen=0.6) == translate_texts(run.model, run.tok, TEXTS, beam=1)


def test_output_budget_is_attnkits(exported):
    run_dir, out = exported
    run, ct2 = load_run(run_dir), ExportedTranslator(out, threads=1)
    for a, b in ((0.0, 3.0), (0.5, 0.0)):
        ours = translate_texts(run.model, run.tok, TEXTS[:40], beam=1, max_len_a=a, max_len_b=b)
        assert ct2.translate(TEXTS[:40], beam=1, lenpen=0.6, max_len_a=a, max_len_b=b) == ours
        assert a > 0 or all(len(run.tok.encode_tgt(h)[0]) <= b for h in ours)


def test_beam_search_mostly_agrees_and_keeps_order(exported):
    run_dir, out = exported
    run, ct2 = load_run(run_dir), ExportedTranslator(out, threads=1)
    ours = translate_texts(run.model, run.tok, TEXTS, beam=3, n_best=2, lenpen=0.6)
    theirs = ct2.translate(TEXTS, beam=3, n_best=2, lenpen=0.6)
    assert [len(h) for h in theirs] == [2] * len(TEXTS)
    assert sum(o[0] == t[0] for o, t in zip(ours, theirs, strict=True)) >= 0.9 * len(TEXTS)
    assert ct2.translate(TEXTS[5:8], beam=3, n_best=2, lenpen=0.6) == theirs[5:8]  # batching does not matter


def test_manifest_and_attributes(exported):
    run_dir, out = exported
    ct2 = ExportedTranslator(out)
    run = load_run(run_dir)
    assert is_exported(out) and not is_exported(run_dir)
    assert (ct2.task, ct2.quantization, ct2.decode.beam, ct2.decode.lenpen) == ("translate", "float32", 3, 0.6)
    assert ct2.parameters == sum(p.numel() for p in run.model.parameters())
    models = sorted(run_dir.glob("*.model"))
    assert models and all((out / m.name).read_bytes() == m.read_bytes() for m in models)


def test_cli_export_and_translate(exported, tmp_path, capsys):
    run_dir, _ = exported
    src = tmp_path / "in.txt"
    src.write_text("".join(t + "\n" for t in [*TEXTS[:6], "", "   "]), encoding="utf-8")
    out = tmp_path / "int8"
    assert main(["export", str(run_dir), "--to", "ctranslate2", "-o", str(out), "--quantization", "int8"]) == 0
    assert main(["export", str(run_dir), "--to", "ctranslate2", "-o", str(tmp_path / "f32")]) == 0
    assert (out / "model.bin").stat().st_size < 0.6 * (tmp_path / "f32" / "model.bin").stat().st_size
    capsys.readouterr()
    assert main(["translate", str(tmp_path / "f32"), "-i", str(src), "--beam", "1"]) == 0
    exported_lines = capsys.readouterr().out.splitlines()
    assert main(["translate", str(run_dir), "-i", str(src), "--beam", "1"]) == 0
    assert exported_lines == capsys.readouterr().out.splitlines()
    assert len(exported_lines) == 8 and exported_lines[6:] == ["", ""]
    assert main(["translate", str(out), "-i", str(src), "--n-best", "2"]) == 0  # beam 3 from the manifest
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8 and all(line.count("\t") == 1 for line in lines)
    ref = tmp_path / "ref.txt"
    ref.write_text("".join(t + "\n" for _, t in dates.generate_pairs(120, seed=7, split="test")[:6]) + "\n\n",
                   encoding="utf-8")
    scores = []
    for model in (run_dir, tmp_path / "f32"):
        assert main(["evaluate", str(model), "--src", str(src), "--ref", str(ref), "--beam", "1"]) == 0
        scores.append(capsys.readouterr().out)
    assert scores[0] == scores[1] and scores[0].startswith("BLEU ")


def test_overlong_input_is_cut_as_attnkit_cuts_it(exported, caplog):
    run_dir, out = exported
    run, ct2 = load_run(run_dir), ExportedTranslator(out, threads=1)
    texts = ["1 May 1999", " ".join(["Sonntag, 3. März 2024"] * 12)]
    with caplog.at_level(logging.WARNING, logger="attnkit"):
        theirs = ct2.translate(texts, beam=1, lenpen=0.6)
    assert [r.getMessage().split(" is ")[0] for r in caplog.records] == ["input line 2"]
    assert theirs == translate_texts(run.model, run.tok, texts, beam=1)


def one_line_error(capsys, *argv: str) -> str:
    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("attnkit: error: "), err
    return err


def test_rnn_runs_and_classifiers_are_refused(tmp_path, capsys):
    rnn = train(tmp_path / "rnn", tiny_config(False, arch="rnn", updates=1))
    assert "no RNN specification" in one_line_error(capsys, "export", str(rnn), "--to", "ctranslate2",
                                                    "-o", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    rows = ["text\tlabel"] + [f"{w} film\t{'pos' if i % 2 else 'neg'}" for i, w in enumerate(["good", "bad"] * 10)]
    (classifier / "d.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    raw = {"task": "classify", "data": {"train": str(classifier / "d.tsv"), "valid": str(classifier / "d.tsv"),
                                        "tokenizer": {"vocab_size": 30}},
           "model": {"transformer": {"d_model": 16, "n_heads": 2, "d_ff": 32, "encoder_layers": 1}},
           "train": {"max_updates": 1, "progress": False, "precision": "fp32", "threads": 1, "average_last": 0}}
    run = train(classifier, raw)
    assert "classify run" in one_line_error(capsys, "export", str(run), "--to", "ctranslate2", "-o",
                                            str(tmp_path / "out"))


def test_corrupt_foreign_and_existing_exports(exported, tmp_path, capsys):
    run_dir, out = exported
    assert "already exists" in one_line_error(capsys, "export", str(run_dir), "--to", "ctranslate2", "-o", str(out))
    assert "not a CTranslate2 export" in one_line_error(capsys, "export", str(run_dir), "--to", "ctranslate2", "-o",
                                                        str(run_dir), "--force")  # never deletes a run
    assert (run_dir / "config.yaml").exists()
    assert "choose from" in one_line_error(capsys, "export", str(run_dir), "--to", "onnx", "-o", str(tmp_path))

    def copy(name: str) -> Path:
        target = tmp_path / name
        target.mkdir()
        for f in out.iterdir():
            (target / f.name).write_bytes(f.read_bytes())
        return target

    broken = copy("truncated")
    (broken / "model.bin").write_bytes((out / "model.bin").read_bytes()[:200])
    assert "model.bin" in one_line_error(capsys, "translate", str(broken), "-i", "/dev/null")
    broken = copy("bad-json")
    (broken / MANIFEST).write_text("{not json", encoding="utf-8")
    assert f"{MANIFEST}:1:2: invalid JSON" in one_line_error(capsys, "translate", str(broken), "-i", "/dev/null")
    broken = copy("foreign")
    (broken / MANIFEST).unlink()
    assert "not exported by attnkit" in one_line_error(capsys, "translate", str(broken), "-i", "/dev/null")
    broken = copy("other-format")
    (broken / MANIFEST).write_text(json.dumps({"format": "something-else"}), encoding="utf-8")
    assert "not an attnkit CTranslate2 export" in one_line_error(capsys, "translate", str(broken), "-i", "/dev/null")
    broken = copy("vocabulary")
    name = next(n for n in ("shared_vocabulary.json", "target_vocabulary.json") if (out / n).exists())
    vocab = json.loads((out / name).read_text(encoding="utf-8"))
    (broken / name).write_text(json.dumps(vocab[::-1]), encoding="utf-8")
    assert "does not match" in one_line_error(capsys, "translate", str(broken), "-i", "/dev/null")
    assert "attention" in one_line_error(capsys, "translate", str(out), "-i", "/dev/null", "--attention-dir",
                                         str(tmp_path / "a"))


def test_serving_docs_export_example_runs(exported, capsys):
    """docs/serving.md's ExportedTranslator example (its one ```python3 block)."""
    _, out = exported
    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```python3\n(.*?)```", page, flags=re.S)
    exec(compile(block.replace('"runs/de-en-int8"', repr(str(out))), "docs/serving.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed == f"{ExportedTranslator(out).translate(['Ein Hund rennt über die Wiese.'], beam=4, lenpen=0.6)}\n"


def test_serve_runs_an_exported_directory(exported):
    """`attnkit serve OUT`: the export answers /translate with what ExportedTranslator gives, and /models knows it."""
    from fastapi.testclient import TestClient

    from attnkit.serve.app import create_app
    from attnkit.serve.servables import ExportedServable, load_servable

    run_dir, out = exported
    servable = load_servable(out, threads=1)
    assert isinstance(servable, ExportedServable) and servable.info.task == "translate"
    expected = ExportedTranslator(out, threads=1).translate(TEXTS[:6], beam=2, n_best=2, lenpen=0.6)
    with TestClient(create_app([servable])) as client:
        models = client.get("/models").json()
        assert [m["name"] for m in models["models"]] == [out.name]
        reply = client.post("/translate", json={"model": out.name, "texts": TEXTS[:6], "beam": 2, "n_best": 2})
        assert reply.status_code == 200, reply.text
        assert reply.json()["n_best"] == expected and reply.json()["translations"] == [h[0] for h in expected]
        refused = client.post("/translate", json={"model": out.name, "texts": TEXTS[:1], "attention": True})
        assert refused.status_code == 422 and "attention" in refused.json()["error"]
