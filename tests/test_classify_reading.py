"""Reading a whole document: overlapping windows whose logits are averaged (attnkit.inference.classify)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnkit.cli import main
from attnkit.data.batching import pad_batch
from attnkit.data.documents import document_ids, reading_windows, truncate
from attnkit.data.tokenizer import PAD_ID
from attnkit.inference.classify import classify_texts, explain, predict
from attnkit.tasks import attention_maps, load_run
from attnkit.viz.explorer import explorer_data
from attnkit.viz.figures import attention_figures
from tiny_runs import labelled_rows, write_lines


@pytest.mark.parametrize("length,max_len,stride", [(0, 4, None), (3, 4, None), (4, 4, None), (5, 4, None),
                                                   (17, 6, None), (17, 6, 5), (100, 8, 3)])
def test_windows_cover_the_document_within_max_len(length: int, max_len: int, stride: int | None) -> None:
    ids = list(range(100, 100 + length))
    windows = reading_windows(ids, max_len, stride)
    assert all(1 <= len(w) <= max_len for w in windows)
    if length <= max_len:
        assert windows == [ids or [PAD_ID]]  # what fits is read as it is
        return
    assert all(len(w) == max_len for w in windows) and windows[0] == ids[:max_len] and windows[-1] == ids[-max_len:]
    assert {i for w in windows for i in w} == set(ids)  # every subword is read
    starts = [ids.index(w[0]) for w in windows]
    step = stride or max_len // 2
    assert all(b - a == step for a, b in zip(starts[:-2], starts[1:-1], strict=True))
    assert 0 < starts[-1] - starts[-2] <= step  # the last window ends at the end


@pytest.fixture(scope="module")
def run(classifier_run):
    return load_run(classifier_run)


def with_window(run, max_len: int):
    """The same trained model, reading windows of ``max_len`` subwords."""
    return dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, data=dataclasses.replace(run.cfg.data,
                                                                                             max_len=max_len)))


def test_a_text_that_fits_is_read_as_in_training(run) -> None:
    texts = [t for t, _ in labelled_rows(12, seed=5)] + [""]
    whole, inputs = predict(run, texts)
    cut, _ = predict(run, texts, reading=run.cfg.data.truncate)
    expected = run.model(pad_batch(inputs, PAD_ID)).float().softmax(-1)  # the old predict: one padded batch
    torch.testing.assert_close(whole, cut, atol=1e-6, rtol=0)
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=0)


def test_a_long_text_averages_the_logits_of_its_windows(run) -> None:
    small = with_window(run, 6)
    texts = [" ".join(t for t, _ in labelled_rows(5, seed=s)) for s in (7, 8)] + ["good film"]
    probs, inputs = predict(small, texts, batch_size=2)
    for i, ids in enumerate(document_ids(small.tok, texts, small.cfg.data)):
        windows = reading_windows(ids, 6)
        assert len(windows) > 1 or len(ids) <= 6
        logits = torch.cat([small.model(pad_batch([w], PAD_ID)).float() for w in windows])  # (W, C)
        torch.testing.assert_close(probs[i], logits.mean(dim=0).softmax(-1), atol=1e-5, rtol=0)
        assert inputs[i] == truncate(ids, 6, small.cfg.data.truncate)  # what --with-attention shows
    head, _ = predict(small, texts, reading="head")
    first = [reading_windows(ids, 6)[0] for ids in document_ids(small.tok, texts, small.cfg.data)]
    torch.testing.assert_close(head, small.model(pad_batch(first, PAD_ID)).float().softmax(-1), atol=1e-5, rtol=0)


def test_evaluate_and_classify_read_as_told(run, classifier_run, tmp_path, capsys) -> None:
    rows = labelled_rows(10, seed=9)
    data = tmp_path / "test.tsv"
    write_lines(data, ["sentence\tlabel"] + [f"{t}\t{label}" for t, label in rows])
    texts = write_lines(tmp_path / "texts.txt", [t for t, _ in rows])
    for reading in ("whole", "head", "head+tail"):
        assert main(["classify", str(classifier_run), "-i", str(texts), "--read", reading]) == 0
        labels = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
        probs, _ = predict(run, [t for t, _ in rows], reading=reading)
        assert labels == [run.classes[int(c)] for c in probs.argmax(-1)]
        assert main(["evaluate", str(classifier_run), "--data", str(data), "--read", reading]) == 0
        assert "accuracy" in capsys.readouterr().out
    assert main(["classify", str(classifier_run), "-i", str(texts), "--read", "tail"]) == 2
    assert "--read" in capsys.readouterr().err


def long_text() -> str:
    return " ".join(t for t, _ in labelled_rows(6, seed=11))


def test_explain_adds_the_windows_up_to_the_prediction(run) -> None:
    small = with_window(run, 6)
    text = long_text()
    ids = document_ids(small.tok, [text], small.cfg.data)[0]
    e = explain(small, text)
    assert e.windows == reading_windows(ids, 6) and len(e.windows) > 2
    assert all([ids[p] for p in where] == w for w, where in zip(e.windows, e.positions, strict=True))
    torch.testing.assert_close(e.probs, predict(small, [text])[0][0], atol=1e-5, rtol=0)
    z = e.window_logits.mean(dim=0)  # (C,) the text's logits
    torch.testing.assert_close(e.evidence().mean(), z[e.predicted] - z.mean(), atol=1e-5, rtol=0)
    expected = torch.zeros(len(ids))
    for w, where in zip(e.windows, e.positions, strict=True):
        share = small.model.token_importance(pad_batch([w], PAD_ID))[0]  # (T_w,)
        for j, p in enumerate(where):
            expected[p] += share[j] / len(e.windows)
    torch.testing.assert_close(e.importance(), expected, atol=1e-6, rtol=0)
    assert abs(float(e.importance().sum()) - 1) < 1e-5  # no <s>, </s> in this model: all of it on pieces
    line = classify_texts(small, [text], with_attention=True, top=3)[0]
    best = e.importance().argsort(descending=True)[:3].tolist()
    assert line.split("\t")[3] == " ".join(f"{e.pieces[j]}:{e.importance()[j]:.2f}" for j in best)


def test_attention_over_a_whole_text_shows_its_windows(run) -> None:
    small = with_window(run, 6)
    text = long_text()
    e = explain(small, text)
    maps = attention_maps(small, text)
    assert [v.kind for v in maps.views()] == ["encoder_self", "pooling", "windows"]
    assert f"; read as {len(e.windows)} windows" in maps.output
    windows = maps.windows  # (2, W): the evidence for and against, each row a share
    evidence = e.evidence()
    torch.testing.assert_close(windows[0], evidence.clamp(min=0) / evidence.clamp(min=0).sum())
    assert abs(float(windows[1].sum()) - (1.0 if (evidence < 0).any() else 0.0)) < 1e-5
    assert len(maps.window_labels) == len(e.windows) and maps.window_labels[0].startswith("1: pieces 0-5, p=")
    torch.testing.assert_close(maps.pooling, e.importance())  # a short text: every piece, in order
    strongest = int(evidence.argmax())
    assert f"window {strongest + 1} of {len(e.windows)}" in maps.views()[0].title
    _, _, weights = small.model.encoder(torch.tensor([e.windows[strongest]]), need_weights=True)
    torch.testing.assert_close(maps.encoder_self[0], weights[0][0])
    assert maps.encoder_tokens == small.tok.src_pieces_from_ids(e.windows[strongest])
    assert {"windows", "pooling"} <= set(dict(attention_figures(maps)))
    page = explorer_data(maps)
    assert page["views"][2]["queries"] == [f"for {small.classes[e.predicted]}", "against"]
    head = attention_maps(small, text, reading="head")  # one window: as before, no windows view
    assert [v.kind for v in head.views()] == ["encoder_self", "pooling"] and head.windows is None
