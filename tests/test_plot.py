"""Tests for attnkit.viz.plot: labels, sizes, shape and range errors, PNG output, no global state, Hangul drawn
from the fallback font."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib import font_manager
from matplotlib.backends.backend_agg import RendererAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties

import attnkit.viz.plot
from attnkit.viz.plot import attention_grid, attention_heatmap, save_figure, score_grid

SRC = ["▁3", "▁March", "▁2021", "</s>"]
TGT = ["2021", "-", "03", "-", "03", "</s>"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOT_PY = Path(attnkit.viz.plot.__file__)


def _weights(*lead: int, t_tgt: int = len(TGT), t_src: int = len(SRC), seed: int = 0) -> np.ndarray:
    """Row-stochastic weights of shape (*lead, t_tgt, t_src)."""
    w = np.random.default_rng(seed).random((*lead, t_tgt, t_src))
    return w / w.sum(-1, keepdims=True)


def _labels(ticks: list) -> list[str]:
    return [t.get_text() for t in ticks]


def test_heatmap_labels_title_and_colorbar() -> None:
    fig = attention_heatmap(_weights(), SRC, TGT, title="3 March 2021")
    assert isinstance(fig, Figure)
    heat, cbar = fig.axes  # the heatmap and its colorbar
    assert _labels(heat.get_xticklabels()) == SRC
    assert _labels(heat.get_yticklabels()) == TGT
    assert heat.get_title() == "3 March 2021"
    assert all(label.get_rotation() == 90 for label in heat.get_xticklabels())
    image = heat.get_images()[0]
    assert image.get_clim() == (0.0, 1.0)
    np.testing.assert_allclose(image.get_array(), _weights())
    assert cbar.get_ylabel() == "attention weight"


def test_heatmap_accepts_torch_tensor_with_grad() -> None:
    w = torch.tensor(_weights(), dtype=torch.float32, requires_grad=True)
    fig = attention_heatmap(w, SRC, TGT)
    np.testing.assert_allclose(fig.axes[0].get_images()[0].get_array(), _weights(), rtol=1e-6)


def test_figure_size_grows_with_token_counts() -> None:
    small = attention_heatmap(_weights(t_tgt=3, t_src=3), ["a"] * 3, ["b"] * 3)
    wide = attention_heatmap(_weights(t_tgt=3, t_src=30), ["a"] * 30, ["b"] * 3)
    tall = attention_heatmap(_weights(t_tgt=30, t_src=3), ["a"] * 3, ["b"] * 30)
    (w0, h0), (w1, h1), (w2, h2) = (f.get_size_inches() for f in (small, wide, tall))
    assert w1 > w0 and h1 == pytest.approx(h0)
    assert h2 > h0 and w2 == pytest.approx(w0)


def test_heatmap_shape_mismatch_names_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(6, 3\).*\(6, 4\)"):
        attention_heatmap(_weights(t_src=3), SRC, TGT)
    with pytest.raises(ValueError, match=r"\(5, 4\).*\(6, 4\)"):
        attention_heatmap(_weights(t_tgt=5), SRC, TGT)
    with pytest.raises(ValueError, match="attention_grid"):
        attention_heatmap(_weights(2), SRC, TGT)
    with pytest.raises(ValueError, match="no tokens"):
        attention_heatmap(np.zeros((0, 0)), [], [])


def test_heatmap_rejects_scores_and_nan() -> None:
    with pytest.raises(ValueError, match="outside \\[0, 1\\]"):
        attention_heatmap(_weights() * 5 - 1, SRC, TGT)
    bad = _weights()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        attention_heatmap(bad, SRC, TGT)


@pytest.mark.parametrize(("heads", "rows", "cols"), [(1, 1, 1), (4, 1, 4), (6, 2, 4), (8, 2, 4)])
def test_grid_one_panel_per_head(heads: int, rows: int, cols: int) -> None:
    w = _weights(heads)
    fig = attention_grid(w, SRC, TGT, title="layer 0")
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == [f"head {h}" for h in range(heads)]
    for h, ax in enumerate(panels):
        np.testing.assert_allclose(ax.get_images()[0].get_array(), w[h])
        assert _labels(ax.get_xticklabels()) == SRC
        first_column = h % cols == 0
        assert _labels(ax.get_yticklabels()) == (TGT if first_column else [""] * len(TGT))
    # the grid has rows * cols slots, one colorbar, and empty slots hidden
    assert len(fig.axes) == rows * cols + 1
    assert sum(not ax.axison for ax in fig.axes) == rows * cols - heads
    assert fig.get_suptitle() == "layer 0"


def test_grid_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"\(H, T_tgt, T_src\).*\(6, 4\)"):
        attention_grid(_weights(), SRC, TGT)
    with pytest.raises(ValueError, match=r"\(2, 6, 3\).*\(6, 4\)"):
        attention_grid(_weights(2, t_src=3), SRC, TGT)
    with pytest.raises(ValueError, match="H >= 1"):
        attention_grid(np.zeros((0, 6, 4)), SRC, TGT)


def test_save_figure_writes_png(tmp_path: Path) -> None:
    fig = attention_heatmap(_weights(), SRC, TGT)
    out = save_figure(fig, tmp_path / "deep" / "dir" / "attn.png")
    assert out == tmp_path / "deep" / "dir" / "attn.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    out2 = save_figure(attention_grid(_weights(3), SRC, TGT), str(tmp_path / "grid.png"))
    assert isinstance(out2, Path) and out2.read_bytes()[:8] == PNG_MAGIC


def test_save_figure_refuses_other_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.png"):
        save_figure(attention_heatmap(_weights(), SRC, TGT), tmp_path / "attn.pdf")
    assert not list(tmp_path.iterdir())


def test_no_global_matplotlib_state_changed(tmp_path: Path) -> None:
    """In a fresh interpreter: importing, plotting and saving leave rcParams and the
    backend alone and never import pyplot (which would register global figures)."""
    script = textwrap.dedent(
        f"""
        import sys
        import matplotlib
        before = matplotlib.rcParams.copy()  # copy() does not resolve the backend
        import importlib.util
        # Load plot.py by path: the attnkit package __init__ imports torch, which is slow
        # and has nothing to do with matplotlib state.
        spec = importlib.util.spec_from_file_location("attnkit_plot", {str(PLOT_PY)!r})
        plot = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plot)
        w = [[0.5, 0.5], [1.0, 0.0]]
        plot.save_figure(plot.attention_heatmap(w, ["a", "b"], ["x", "y"]), {str(tmp_path / "a.png")!r})
        plot.save_figure(plot.attention_grid([w, w], ["a", "b"], ["x", "y"]), {str(tmp_path / "g.png")!r})
        assert "matplotlib.pyplot" not in sys.modules, "pyplot was imported"
        assert matplotlib.rcParams.copy() == before, "rcParams changed"
        backend = matplotlib.get_backend()  # resolving the backend is allowed to import pyplot
        plot.attention_heatmap(w, ["a", "b"], ["x", "y"])
        assert matplotlib.get_backend() == backend, "backend changed"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


KOREAN = ["2021년", "3월", "3일", "</s>"]  # a Korean date's pieces (the dates task reads such dates)


def _missing_glyphs(recwarn: pytest.WarningsRecorder, caplog: pytest.LogCaptureFixture) -> list[str]:
    """matplotlib's complaints about glyphs or fonts it could not find: warnings and log records."""
    return ([str(w.message) for w in recwarn if "missing from font" in str(w.message)]
            + [r.getMessage() for r in caplog.records if "findfont" in r.getMessage()])


def test_korean_text_renders_without_missing_glyphs(tmp_path: Path, recwarn: pytest.WarningsRecorder,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Hangul in tick labels, axis names and titles is drawn from the fallback font: no missing-glyph warning (which
    the same title in a plain figure does raise, so the check can fail)."""
    caplog.set_level(logging.WARNING, logger="matplotlib")
    figures = [attention_heatmap(_weights(t_src=4), KOREAN, TGT, title="2021년 3월 3일", axis_names=("원문", "출력")),
               attention_grid(_weights(2, t_src=4), KOREAN, TGT, title="2021년 3월 3일"),
               score_grid({"이전": [[0.5, 0.25]]}, title="머리")]
    for i, fig in enumerate(figures):
        save_figure(fig, tmp_path / f"{i}.png")
    assert _missing_glyphs(recwarn, caplog) == []
    plain = Figure()
    plain.add_subplot().set_title("2021년 3월")
    plain.savefig(tmp_path / "plain.png")
    assert any("missing from font" in m for m in _missing_glyphs(recwarn, caplog))


def _extent(text: str, prop: FontProperties) -> tuple[float, float, float]:
    """(width, height, descent) in pixels of ``text`` drawn by Agg with ``prop``."""
    return RendererAgg(100, 100, 100).get_text_width_height_descent(text, prop, ismath=False)


def test_the_fallback_font_draws_only_the_glyphs_the_default_lacks() -> None:
    """The figures' fonts are the default family, then Noto Sans KR: Latin and digits are drawn exactly as with the
    default font (DejaVu Sans) and Hangul exactly as with Noto Sans KR, glyph by glyph."""
    fig = attention_heatmap(_weights(t_src=4), KOREAN, TGT, title="3 March 2021")
    title, tick = fig.axes[0].title, fig.axes[0].get_xticklabels()[0]
    default = list(matplotlib.rcParams["font.family"])
    assert title.get_fontfamily() == tick.get_fontfamily() == [*default, "Noto Sans KR"]
    assert font_manager.findfont(FontProperties(family=default)).endswith("DejaVuSans.ttf")
    prop = title.get_fontproperties()
    only = {name: prop.copy() for name in ("default", "fallback")}
    only["default"].set_family(default)
    only["fallback"].set_family("Noto Sans KR")
    assert _extent("3 March 2021", prop) == _extent("3 March 2021", only["default"])
    assert _extent("3 March 2021", prop) != _extent("3 March 2021", only["fallback"])  # the fonts do differ
    assert _extent("년월일", prop) == _extent("년월일", only["fallback"])
