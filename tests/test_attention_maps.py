"""Tests for attnkit.inference.attention_maps, attnkit.viz.explorer and `attnkit attention`: the weights of every
kind (shapes, rows summing to 1, the look-ahead triangle, equal to step-by-step decoding, outputs
unchanged), a language model's causal self-attention over prompt and continuation with its head scores,
the heatmap files, the self-contained HTML page and one-line errors."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch

from attnkit.cli import main
from attnkit.common.errors import UserError
from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.data.documents import classifier_inputs
from attnkit.data.tokenizer import BOS_ID, EOS_ID
from attnkit.inference.attention_maps import NEW_TOKENS, VISIBLE_SPACE, AttentionMaps
from attnkit.inference.head_scores import previous_token_score, sink_score
from attnkit.inference.language_model import continue_text
from attnkit.runs.load import LoadedRun
from attnkit.search import greedy_search
from attnkit.tasks import attention_maps, load_run
from attnkit.training.trainer import Trainer
from attnkit.viz.explorer import explorer_data, explorer_html, write_explorer
from attnkit.viz.figures import attention_figure, attention_figures, summary_figure
from attnkit.viz.plot import attention_grid, attention_heatmap, save_figure, score_grid

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DPI = 120
TRAIN = {"max_tokens": 500, "max_updates": 8, "valid_every": 8, "progress": False, "precision": "fp32",
         "threads": 1, "warmup": 4, "lr": 3e-3, "valid_bleu_sentences": 0, "average_last": 0}
DATA = {"generate": "dates", "generate_train": 200, "generate_valid": 10, "max_len": 48,
        "tokenizer": {"vocab_size": 80}}
SOURCE = "Sonntag, 3. März 2024"


def train_run(tmp: Path, model: dict, data: dict | None = None, task: str = "translate",
              updates: int = TRAIN["max_updates"]) -> LoadedRun:
    train = {**TRAIN, "max_updates": updates, "valid_every": updates}
    cfg = load_config(RunConfig, {"task": task, "data": data or DATA, "model": model, "train": train})
    Trainer(cfg, tmp, log=lambda msg: None).run()
    return load_run(tmp)


@pytest.fixture(scope="module")
def transformer_run(tmp_path_factory) -> LoadedRun:
    model = {"transformer": {"d_model": 32, "n_heads": 2, "d_ff": 64, "encoder_layers": 2, "decoder_layers": 2,
                             "dropout": 0.0, "max_len": 64}}
    return train_run(tmp_path_factory.mktemp("transformer"), model)


@pytest.fixture(scope="module")
def one_layer_run(tmp_path_factory) -> LoadedRun:
    model = {"transformer": {"d_model": 16, "n_heads": 2, "d_ff": 32, "encoder_layers": 1, "decoder_layers": 1,
                             "dropout": 0.0, "max_len": 64}}
    return train_run(tmp_path_factory.mktemp("one-layer"), model)


@pytest.fixture(scope="module")
def rnn_run(tmp_path_factory) -> LoadedRun:
    model = {"arch": "rnn", "rnn": {"embed_dim": 16, "hidden_size": 24, "attention": "general", "dropout": 0.0}}
    return train_run(tmp_path_factory.mktemp("rnn"), model)


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory) -> LoadedRun:
    tmp = tmp_path_factory.mktemp("classifier")
    rows = [("a good film", "pos"), ("a bad film", "neg"), ("good plot", "pos"), ("bad plot", "neg")] * 10
    for name in ("train.tsv", "valid.tsv"):
        (tmp / name).write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows), encoding="utf-8")
    data = {"train": str(tmp / "train.tsv"), "valid": str(tmp / "valid.tsv"), "tokenizer": {"vocab_size": 30}}
    model = {"transformer": {"d_model": 16, "n_heads": 2, "d_ff": 32, "encoder_layers": 2, "dropout": 0.0},
             "pooling": "mean"}
    return train_run(tmp / "run", model, data, task="classify")


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> LoadedRun:
    """A character-level language model with learned positions (a context of 48), trained for 8 updates."""
    tmp = tmp_path_factory.mktemp("lm")
    (tmp / "text.txt").write_text("".join(f"the cat sat on the mat {i % 7}. a dog ran to the park.\n"
                                          for i in range(200)), encoding="utf-8")
    data = {"train": str(tmp / "text.txt"), "documents": "text", "valid_fraction": 0.1, "block_size": 32,
            "tokenizer": {"model_type": "characters"}}
    model = {"transformer": {"d_model": 32, "n_heads": 2, "d_ff": 64, "decoder_layers": 2, "dropout": 0.0,
                             "max_len": 48, "positions": "learned"}}
    return train_run(tmp / "run", model, data, task="lm")


@pytest.fixture(scope="module")
def deep_lm_run(tmp_path_factory) -> LoadedRun:
    """A character-level language model of 12 tiny layers, trained for 1 update: depth is what it is for."""
    tmp = tmp_path_factory.mktemp("deep-lm")
    (tmp / "text.txt").write_text("the cat sat on the mat.\n" * 40, encoding="utf-8")
    data = {"train": str(tmp / "text.txt"), "documents": "text", "valid_fraction": 0.1, "block_size": 16,
            "tokenizer": {"model_type": "characters"}}
    model = {"transformer": {"d_model": 8, "n_heads": 2, "d_ff": 16, "decoder_layers": 12, "dropout": 0.0,
                             "max_len": 32, "positions": "learned"}}
    return train_run(tmp / "run", model, data, task="lm", updates=1)


def rows_sum_to_one(weights: torch.Tensor) -> None:
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5, rtol=0)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from the PNG header."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 2000, path
    return struct.unpack(">II", data[16:24])


# -- the weights -----------------------------------------------------------------------------


def test_transformer_maps_every_kind_per_layer_and_head(transformer_run):
    maps = attention_maps(transformer_run, SOURCE)
    S, T = len(maps.src_tokens), len(maps.tgt_tokens)
    assert maps.arch == "transformer" and not maps.forced
    assert maps.src_tokens[-1] == "</s>" and maps.tgt_in_tokens[0] == "<s>"
    assert maps.tgt_in_tokens[1:] == maps.tgt_tokens[:-1]  # position t reads y_{t-1}, predicts y_t
    assert "".join(maps.src_tokens[:-1]).replace("\u2581", " ").strip() == SOURCE
    for name, weights, shape in (("encoder_self", maps.encoder_self, (2, S, S)),
                                 ("decoder_self", maps.decoder_self, (2, T, T)), ("cross", maps.cross, (2, T, S))):
        assert len(weights) == 2, name
        for w in weights:
            assert w.shape == shape and w.dtype == torch.float32, (name, w.shape)
            rows_sum_to_one(w)
    for w in maps.decoder_self:  # the look-ahead mask: nothing above the diagonal
        assert torch.all(w.triu(diagonal=1) == 0)
    assert [v.kind for v in maps.views()] == ["cross", "encoder_self", "decoder_self"]


def test_teacher_forced_weights_equal_step_by_step_decoding(transformer_run):
    """The explorer's one-pass weights are the ones greedy search computes step by step (last layer, mean)."""
    maps = attention_maps(transformer_run, SOURCE)
    src = torch.tensor([transformer_run.tok.encode_src([SOURCE])[0] + [EOS_ID]])
    with torch.inference_mode():
        hyp = greedy_search(transformer_run.model, src, need_weights=True)[0]
    assert transformer_run.tok.decode_tgt([hyp.tokens])[0] == maps.output
    torch.testing.assert_close(maps.cross[-1].mean(dim=0), hyp.attention, atol=1e-5, rtol=1e-4)


def test_asking_for_weights_leaves_the_outputs_unchanged(transformer_run):
    model = transformer_run.model
    src = torch.tensor([transformer_run.tok.encode_src([SOURCE, "May 1, 1999"])[0] + [EOS_ID]])
    tgt_in = torch.tensor([[BOS_ID] + transformer_run.tok.encode_tgt(["2024-03-03"])[0]])
    with torch.inference_mode():
        memory, memory_mask, _ = model.encoder(src, need_weights=True)
        plain_memory, _ = model.encode(src)
        hidden, self_w, cross_w = model.decode(tgt_in, memory, memory_mask, need_weights=True)
        plain_hidden, no_self, no_cross = model.decode(tgt_in, plain_memory, memory_mask)
    torch.testing.assert_close(memory, plain_memory, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, plain_hidden, atol=1e-5, rtol=1e-5)
    assert no_self == [] and no_cross == [] and len(self_w) == len(cross_w) == 2


def test_forced_target(transformer_run):
    maps = attention_maps(transformer_run, SOURCE, "2024-03-03")
    pieces = transformer_run.tok.tgt_pieces_from_ids(transformer_run.tok.encode_tgt(["2024-03-03"])[0])
    assert maps.forced and maps.output == "2024-03-03"
    assert maps.tgt_tokens == pieces + ["</s>"] and maps.tgt_in_tokens == ["<s>"] + pieces
    assert maps.cross[0].shape[1] == len(pieces) + 1


def test_rnn_alignment_is_the_decoders_alpha(rnn_run):
    maps = attention_maps(rnn_run, SOURCE)
    assert maps.arch == "rnn" and maps.encoder_self == [] and maps.decoder_self == []
    (alignment,) = maps.cross
    assert alignment.shape == (1, len(maps.tgt_tokens), len(maps.src_tokens))
    rows_sum_to_one(alignment)
    src = torch.tensor([rnn_run.tok.encode_src([SOURCE])[0] + [EOS_ID]])
    with torch.inference_mode():
        hyp = greedy_search(rnn_run.model, src, need_weights=True)[0]
    torch.testing.assert_close(alignment[0], hyp.attention, atol=1e-5, rtol=1e-4)
    assert [v.kind for v in maps.views()] == ["alignment"]


def test_classifier_self_attention_and_pooling(classifier_run):
    maps = attention_maps(classifier_run, "a good plot")
    S = len(maps.src_tokens)
    assert maps.arch == "classifier" and re.fullmatch(r"(pos|neg) \(p=\d\.\d\d\)", maps.output)
    assert len(maps.encoder_self) == 2 and all(w.shape == (2, S, S) for w in maps.encoder_self)
    x = torch.tensor([classifier_run.tok.encode_src(["a good plot"])[0]])
    torch.testing.assert_close(maps.pooling, classifier_run.model.token_importance(x)[0])
    assert [v.kind for v in maps.views()] == ["encoder_self", "pooling"]


PROMPT = "the cat"


def test_language_model_maps_cover_prompt_and_greedy_continuation(lm_run):
    maps = attention_maps(lm_run, PROMPT)
    model, tok = lm_run.model, lm_run.tok
    ids = tok.encode_src([PROMPT])[0]
    assert maps.arch == "lm" and not maps.forced and maps.source == PROMPT
    assert maps.output == "".join(continue_text(model, tok, ids, NEW_TOKENS, temperature=0))  # greedy
    assert maps.src_tokens == [p.translate(VISIBLE_SPACE) for p in tok.src_pieces_from_ids(ids)] == list("the\u2423cat")
    assert 0 < len(maps.tgt_tokens) <= NEW_TOKENS and maps.tgt_in_tokens == maps.src_tokens + maps.tgt_tokens
    T = len(maps.tgt_in_tokens)
    assert len(maps.decoder_self) == 2 and maps.encoder_self == [] and maps.cross == []
    for w in maps.decoder_self:
        assert w.shape == (2, T, T) and w.dtype == torch.float32
        rows_sum_to_one(w)
        assert torch.all(w.triu(diagonal=1) == 0)  # causal: nothing from a later token
    (view,) = maps.views()
    assert (view.kind, view.title, view.generated_from) == ("decoder_self", "causal self-attention", len(ids))
    scores = maps.head_scores
    assert scores is not None and scores.text_length == T and scores.repeat_length == 24  # half the 48 positions
    torch.testing.assert_close(scores.previous_token, previous_token_score(torch.stack(maps.decoder_self)))
    torch.testing.assert_close(scores.sink, sink_score(torch.stack(maps.decoder_self)))
    assert all(v.shape == (2, 2) for v in scores.named().values())


def test_language_model_weights_equal_the_cached_decoding(lm_run):
    """The one-pass weights of the continuation are those of the model's own cached decoding: the last row
    of every layer, recomputed by feeding the tokens one at a time through the key/value cache."""
    maps = attention_maps(lm_run, PROMPT, new_tokens=5)
    model, tok = lm_run.model, lm_run.tok
    ids = torch.tensor([tok.encode_src([PROMPT])[0] + tok.encode_src([maps.output])[0]])  # (1, T)
    state, rows = model.init_state(), []
    with torch.inference_mode():
        for t in range(ids.size(1)):
            _, weights, state = model.features(ids[:, t:t + 1], state, need_weights=True)  # per layer (1, H, 1, t+1)
            rows.append(weights)
    for layer, w in enumerate(maps.decoder_self):
        for t, step in enumerate(rows):
            torch.testing.assert_close(w[:, t, : t + 1], step[layer][0, :, 0], atol=1e-5, rtol=1e-4)


def test_language_model_given_continuation_and_context(lm_run):
    forced = attention_maps(lm_run, PROMPT, " sat on")
    assert forced.forced and forced.output == " sat on" and forced.tgt_tokens == list("\u2423sat\u2423on")
    assert forced.heading() == "the cat ->  sat on (given)"
    only_prompt = attention_maps(lm_run, PROMPT, new_tokens=0)
    assert only_prompt.tgt_tokens == [] and only_prompt.decoder_self[0].shape == (2, 7, 7)
    near_the_end = attention_maps(lm_run, "the cat sat " * 3 + "on the ma")  # 45 of the 48 positions
    assert len(near_the_end.tgt_in_tokens) <= 48 and len(near_the_end.tgt_tokens) <= 3
    for prompt, target, match in (("the cat sat " * 5, None, "at most 48"), (PROMPT, "on the mat " * 4, "at most 48"),
                                  ("", None, "empty"), ("the c@t", None, "'@'")):
        with pytest.raises(UserError, match=match):
            attention_maps(lm_run, prompt, target)
    with pytest.raises(UserError, match="--beam"):
        attention_maps(lm_run, PROMPT, beam=2)


def test_cli_language_model_prints_head_scores_and_writes_files(lm_run, tmp_path, capsys):
    out = tmp_path / "attn"
    code = main(["attention", str(lm_run.weights_path.parent), "--src", PROMPT, "-o", str(out), "--html",
                 "--max-new-tokens", "10", "--local-window", "4", "--layers", "all"])
    printed = capsys.readouterr().out.splitlines()
    assert code == 0
    maps = attention_maps(lm_run, PROMPT, new_tokens=10, window=4)
    assert printed[0] == maps.heading() and printed[1:6] == maps.head_scores.table().splitlines()
    assert printed[1].split() == ["layer", "head", "previous", "sink", "local-4", "induction"]
    figures = dict(attention_figures(maps))
    assert set(figures) == {"decoder-self-mean", "decoder-self-layer0", "decoder-self-layer0-heads",
                            "decoder-self-layer1", "decoder-self-layer1-heads", "head-scores"}
    assert sorted(Path(p).name for p in printed[6:]) == sorted([f"{n}.png" for n in figures] + ["attention.html"])
    png_size(out / "head-scores.png")
    panels = [ax for ax in figures["head-scores"].axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == list(maps.head_scores.named())
    for ax, value in zip(panels, maps.head_scores.named().values(), strict=True):
        torch.testing.assert_close(torch.tensor(ax.get_images()[0].get_array(), dtype=torch.float32), value)
    data = json.loads(re.search(r'<script id="attention-data" type="application/json">(.*?)</script>',
                                (out / "attention.html").read_text(encoding="utf-8"), flags=re.S)[1])
    assert data["views"][0]["generated_from"] == len(maps.src_tokens) and data["scores"]["view"] == 0
    assert data["scores"]["names"] == list(maps.head_scores.named())
    torch.testing.assert_close(torch.tensor(data["scores"]["values"]),
                               torch.stack(list(maps.head_scores.named().values())), atol=6e-5, rtol=0)


def test_a_deep_model_draws_the_last_layer_unless_told_otherwise(deep_lm_run, tmp_path, capsys):
    """However deep the model, the default is the mean over layers, the last layer and its heads (and the head
    scores); --layers names others, all of them, or a layer that is not there (a one-line error)."""
    run = str(deep_lm_run.weights_path.parent)

    def drawn(*layers: str) -> set[str]:
        out = tmp_path / f"attn{len(list(tmp_path.iterdir()))}"
        assert main(["attention", run, "--src", "the", "--max-new-tokens", "2", "-o", str(out), *layers]) == 0
        printed = capsys.readouterr().out.splitlines()
        assert sorted(Path(p).name for p in printed if p.endswith(".png")) == sorted(p.name for p in out.iterdir())
        return {p.stem for p in out.iterdir()}

    fixed = {"decoder-self-mean", "head-scores"}
    assert drawn() == fixed | {"decoder-self-layer11", "decoder-self-layer11-heads"}
    assert drawn("--layers=-2,0,5,5") == fixed | {f"decoder-self-layer{n}{h}" for n in (0, 5, 10)
                                                  for h in ("", "-heads")}
    for bad in ("12", "-13", "0,99"):
        error = one_line_error(capsys, "attention", run, "--src", "the", "-o", str(tmp_path / "no"), f"--layers={bad}")
        assert "--layers" in error and "12 layers, 0..11" in error, error
    assert "layer numbers" in one_line_error(capsys, "attention", run, "--src", "the", "--layers", "last")
    assert not (tmp_path / "no").exists() or not list((tmp_path / "no").iterdir())


def test_cli_language_model_errors_are_one_line(lm_run, tmp_path, capsys):
    run = str(lm_run.weights_path.parent)
    assert "--beam" in one_line_error(capsys, "attention", run, "--src", "the", "--beam", "2", "-o", str(tmp_path))
    assert "at most 48" in one_line_error(capsys, "attention", run, "--src", "the cat " * 7, "-o", str(tmp_path))
    assert "'@'" in one_line_error(capsys, "attention", run, "--src", "@", "-o", str(tmp_path))


def test_undefined_head_scores_are_null_in_the_page(lm_run):
    """A text of at most ``window`` tokens has no local-window score (NaN): the page's JSON says null, as JSON can
    (the server sends it with allow_nan=False)."""
    maps = attention_maps(lm_run, "the", new_tokens=1)
    assert maps.head_scores.local_window.isnan().all()
    data = explorer_data(maps)
    json.dumps(data, allow_nan=False)
    assert data["scores"]["values"][2] == [[None, None], [None, None]]
    assert explorer_data(attention_maps(lm_run, PROMPT))["scores"]["values"][2][0][0] is not None


def test_score_grid_draws_every_score_on_a_fixed_scale():
    scores = {"previous token": torch.tensor([[1.0, 0.2, 0.0]]), "sink": [[0.5, float("nan"), 0.25]]}
    fig = score_grid(scores, title="what each head does")
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == ["previous token", "sink"]
    assert panels[0].get_images()[0].get_clim() == (0.0, 1.0)
    assert [t.get_text() for t in panels[1].texts] == ["0.50", "0.25"]  # the NaN cell stays blank
    with pytest.raises(ValueError, match="same"):
        score_grid({"a": [[0.1, 0.2]], "b": [[0.1], [0.2]]})
    with pytest.raises(ValueError, match="outside"):
        score_grid({"a": [[1.5]]})
    with pytest.raises(ValueError, match=r"\(L, H\)"):
        score_grid({"a": [0.5]})


# -- figures and the command -----------------------------------------------------------------


def test_attention_figures_names_and_sizes(transformer_run):
    maps = attention_maps(transformer_run, SOURCE)
    figures = dict(attention_figures(maps))
    expected = {f"{kind}-{part}" for kind in ("cross", "encoder-self", "decoder-self")
                for part in ("mean", "layer0", "layer0-heads", "layer1", "layer1-heads")}
    assert set(figures) == expected
    assert {stem for stem, _ in attention_figures(maps, [0])} == {name for name in expected if "layer1" not in name}
    mean = figures["cross-mean"].axes[0].get_images()[0].get_array()
    torch.testing.assert_close(torch.tensor(mean, dtype=torch.float32), torch.stack(maps.cross).mean(dim=(0, 1)))
    heads = figures["cross-layer1-heads"]
    assert [ax.get_title() for ax in heads.axes if ax.get_images()] == ["head 0", "head 1"]
    assert figures["decoder-self-layer0"].axes[0].get_xlabel() == "decoder input"
    assert figures["cross-mean"].axes[0].get_ylabel() == "output"


def test_long_sentences_keep_legible_labels(transformer_run):
    """A 60-piece sentence: the figure stays within 40 inches and tick labels do not overlap."""
    maps = attention_maps(transformer_run, " ".join([SOURCE] * 3), "2024-03-03")
    src = maps.src_tokens
    assert len(src) >= 60
    weights = maps.encoder_self[0].repeat(4, 1, 1)  # (8, S, S): eight heads, as in the `base` preset
    for fig in (attention_heatmap(weights[0], src, src), attention_grid(weights, src, src)):
        width, height = fig.get_size_inches()
        assert width <= 40 and height <= 40
        ax = fig.axes[0]
        cell_inches = ax.get_position().width * width / len(ax.get_xticks())
        label_inches = ax.get_xticklabels()[0].get_fontsize() / 72
        assert label_inches <= cell_inches, (label_inches, cell_inches)


def test_cli_writes_heatmaps_and_html(one_layer_run, tmp_path, capsys):
    out = tmp_path / "attn"
    code = main(["attention", str(one_layer_run.weights_path.parent), "--src", SOURCE, "--tgt", "2024-03-03",
                 "-o", str(out), "--html"])
    printed = capsys.readouterr().out.splitlines()
    assert code == 0
    maps = attention_maps(one_layer_run, SOURCE, "2024-03-03")
    assert printed[0] == f"{SOURCE} -> 2024-03-03 (given)"
    figures = dict(attention_figures(maps))
    assert set(figures) == {"cross", "cross-heads", "encoder-self", "encoder-self-heads", "decoder-self",
                            "decoder-self-heads"}  # one layer: no -layer0, no mean over layers
    assert sorted(Path(p).name for p in printed[1:]) == sorted([f"{n}.png" for n in figures] + ["attention.html"])
    for name, fig in figures.items():  # files of the size the figure asks for (not pixels)
        width, height = fig.get_size_inches() * DPI
        got = png_size(out / f"{name}.png")
        assert abs(got[0] - width) <= 2 and abs(got[1] - height) <= 2, (name, got, (width, height))
    assert (out / "attention.html").stat().st_size > 1000


def test_cli_rnn_and_classifier(rnn_run, classifier_run, tmp_path, capsys):
    assert main(["attention", str(rnn_run.weights_path.parent), "--src", SOURCE, "-o", str(tmp_path / "r"),
                 "--tgt", "2024-03-03"]) == 0
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["alignment.png"]
    assert main(["attention", str(classifier_run.weights_path.parent), "--src", "a bad film",
                 "-o", str(tmp_path / "c"), "--html", "--no-png"]) == 0
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["attention.html"]
    assert main(["attention", str(classifier_run.weights_path.parent), "--src", "a bad film",
                 "-o", str(tmp_path / "c2")]) == 0
    names = {p.name for p in (tmp_path / "c2").iterdir()}
    assert {"pooling.png", "encoder-self-mean.png", "encoder-self-layer1-heads.png"} <= names
    capsys.readouterr()


def test_a_korean_date_is_drawn_in_hangul(transformer_run, tmp_path, recwarn):
    """The dates task reads Korean dates: their pieces and the title are drawn without a missing-glyph warning, in
    the picture `attnkit translate --attention-dir` and the demo draw, and in a grid of heads."""
    text = "2024년 3월 3일 일요일"
    maps = attention_maps(transformer_run, text)
    assert any(re.search("[\uac00-\ud7a3]", piece) for piece in maps.src_tokens), maps.src_tokens
    save_figure(attention_figure(transformer_run, text), tmp_path / "summary.png")
    save_figure(attention_grid(maps.encoder_self[-1], maps.src_tokens, maps.src_tokens, title=text),
                tmp_path / "heads.png")
    assert [str(w.message) for w in recwarn if "missing from font" in str(w.message)] == []


def test_summary_figure_is_the_last_layers_mean(transformer_run):
    maps = attention_maps(transformer_run, SOURCE)
    image = summary_figure(maps).axes[0].get_images()[0].get_array()
    torch.testing.assert_close(torch.tensor(image, dtype=torch.float32), maps.cross[-1].mean(0))


def one_line_error(capsys, *argv: str) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_cli_errors_are_one_line(transformer_run, classifier_run, tmp_path, capsys):
    run = str(transformer_run.weights_path.parent)
    assert "--tgt" in one_line_error(capsys, "attention", str(classifier_run.weights_path.parent), "--src", "x",
                                     "--tgt", "y", "-o", str(tmp_path))
    assert "--no-png" in one_line_error(capsys, "attention", run, "--src", "x", "--no-png")
    assert "at most 64" in one_line_error(capsys, "attention", run, "--src", "3 March 2021 " * 12, "-o", str(tmp_path))
    assert "target text" in one_line_error(capsys, "attention", run, "--src", "x", "--tgt", "1" * 80,
                                           "-o", str(tmp_path))
    assert "--beam" in one_line_error(capsys, "attention", run, "--src", "x", "--beam", "0", "-o", str(tmp_path))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert "cannot create" in one_line_error(capsys, "attention", run, "--src", "x", "-o", str(blocker / "sub"))
    assert "not a run directory" in one_line_error(capsys, "attention", str(tmp_path), "--src", "x")


def test_cli_help_is_complete(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["attention", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for needle in ("--src", "--tgt", "--out-dir", "--html", "--no-png", "--beam", "--lenpen", "cross-layerL.png",
                   "alignment.png", "attention.html", "decoder inputs", "--max-new-tokens", "--local-window",
                   "head-scores.png", "induction", "--layers"):
        assert needle in out, needle


# -- the HTML page, without a browser ---------------------------------------------------------


def tricky_maps() -> AttentionMaps:
    """Hand-made weights with tokens that would break a page that pasted them as HTML."""
    g = torch.Generator().manual_seed(0)
    src = ["</script><b>x", "&amp;", "\u2581한국어", "</s>"]
    tgt = ["\"q'", "<!--", "</s>"]
    return AttentionMaps("transformer", "a </script> source", "an output", True, src, tgt, ["<s>", *tgt[:-1]],
                         encoder_self=[torch.rand(3, 4, 4, generator=g).softmax(-1)],
                         decoder_self=[torch.rand(3, 3, 3, generator=g).tril().softmax(-1)],
                         cross=[torch.rand(3, 3, 4, generator=g).softmax(-1) for _ in range(2)])


def test_html_is_self_contained_and_escapes_tokens(tmp_path):
    page = explorer_html(tricky_maps())
    assert page.count("<script") == 2 and page.count("</script>") == 2  # the data and the code, nothing else
    assert not re.search(r"""(src|href)\s*=|<link|@import|url\(|fetch\(|XMLHttpRequest""", page)
    assert set(re.findall(r"https?://[^\s\"'<>)]+", page)) == {"http://www.w3.org/2000/svg"}  # a namespace name
    assert "<b>x" not in page and "한국어" in page
    path = write_explorer(tricky_maps(), tmp_path / "sub" / "page.html")
    assert path.read_text(encoding="utf-8") == page


def test_html_carries_every_weight(transformer_run):
    maps = attention_maps(transformer_run, SOURCE)
    page = explorer_html(maps)
    data = json.loads(re.search(r'<script id="attention-data" type="application/json">(.*?)</script>', page,
                                flags=re.S)[1])
    assert [v["kind"] for v in data["views"]] == ["cross", "encoder_self", "decoder_self"]
    for view, ref in zip(data["views"], maps.views(), strict=True):
        assert view["queries"] == ref.queries and view["keys"] == ref.keys
        torch.testing.assert_close(torch.tensor(view["layers"]), torch.stack(ref.layers), atol=6e-5, rtol=0)



def test_readme_python_api_example_runs(transformer_run, tmp_path, monkeypatch, capsys):
    """The README's notebook example (a ```py block, which test_readme.py does not run: it needs a run)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```py\n(.*?)```", readme, flags=re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(block.replace('"runs/de-en"', repr(str(transformer_run.weights_path.parent))), "README.md", "exec"),
         {})
    assert capsys.readouterr().out.startswith(attention_maps(transformer_run, "Ein Hund rennt.").output)
    png_size(tmp_path / "cross.png")
    assert (tmp_path / "attention.html").stat().st_size > 1000


def test_heading_names_source_output_and_a_forced_target() -> None:
    maps = AttentionMaps("transformer", "Ein sehr langer Satz.", "A very long sentence.", False, ["x"])
    assert maps.heading() == "Ein sehr langer Satz. -> A very long sentence."
    forced = AttentionMaps("transformer", "Ein sehr langer Satz.", "A long one.", True, ["x"])
    assert forced.heading(10) == "Ein seh... -> A long one. (given)"


def test_a_long_text_shows_the_pieces_the_classifier_drew_on_most(classifier_run):
    text = " ".join(["a good film", "a bad plot"] * 30)
    ids = classifier_inputs(classifier_run.tok, [text], classifier_run.cfg.data)[0]
    assert len(ids) > 40
    maps = attention_maps(classifier_run, text, reading=classifier_run.cfg.data.truncate)  # one window
    importance = classifier_run.model.token_importance(torch.tensor([ids]))[0]
    positions = [int(t.rsplit("@", 1)[1]) for t in maps.src_tokens]
    assert len(positions) == 40 and positions == sorted(set(positions))  # in text order
    torch.testing.assert_close(maps.pooling, importance[positions])
    assert maps.pooling.min() >= importance.topk(40).values.min() - 1e-6  # the most important ones
    assert all(w.shape == (2, 40, 40) for w in maps.encoder_self)
    assert maps.output.endswith(f"the 40 of {len(ids)} pieces it drew on most")


