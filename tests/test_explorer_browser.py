"""The attention explorer in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``.ci/run``) driven by Selenium. Load the page, switch kind,
layer and head, hover and click tokens, check the highlighted weights against the tensors,
take a screenshot.

The ``browser`` fixture (``conftest.py``) skips without a browser and says what to install; under
CI (``CI=true``) it fails instead, since ``.ci/run`` installs one and a silent skip would hide a
broken page.
"""

from __future__ import annotations

from pathlib import Path

import torch

from attnkit.inference.attention_maps import AttentionMaps
from attnkit.viz.explorer import write_explorer

TOLERANCE = 1e-4 + 5e-5  # the page keeps 4 decimals and shows them rounded to 4 again


def explorer_maps() -> AttentionMaps:
    """Random row-stochastic weights: 2 layers x 3 heads of cross-attention, 1 layer of self-attention."""
    g = torch.Generator().manual_seed(1)
    src = ["\u2581Ein", "\u2581Hund", "\u2581rennt", ".", "</s>"]
    tgt = ["\u2581A", "\u2581dog", "\u2581runs", ".", "</s>"]
    causal = torch.ones(5, 5).tril().bool()
    return AttentionMaps(
        "transformer", "Ein Hund rennt.", "A dog runs.", False, src, tgt, ["<s>", *tgt[:-1]],
        encoder_self=[torch.randn(3, 5, 5, generator=g).mul(3).softmax(-1)],
        decoder_self=[torch.randn(3, 5, 5, generator=g).mul(3).masked_fill(~causal, float("-inf")).softmax(-1)],
        cross=[torch.randn(3, 5, 5, generator=g).mul(3).softmax(-1) for _ in range(2)])


def shown_weights(driver, side: str) -> list[float]:
    """The data-weight of every token in the column ``side`` (``queries`` or ``keys``)."""
    from selenium.webdriver.common.by import By

    return [float(el.get_attribute("data-weight")) for el in driver.find_elements(By.CSS_SELECTOR, f"#{side} .tok")]


def assert_shown(driver, side: str, expected: torch.Tensor) -> None:
    """The page highlights exactly ``expected`` (one weight per token of ``side``), to the 4 decimals it keeps."""
    torch.testing.assert_close(torch.tensor(shown_weights(driver, side), dtype=torch.float64), expected.double(),
                               atol=TOLERANCE, rtol=0)


def test_explorer_in_headless_chromium(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    maps = explorer_maps()
    page = write_explorer(maps, tmp_path / "attention.html")
    browser.get(page.as_uri())
    assert browser.find_element(By.ID, "title").text == "Ein Hund rennt. -> A dog runs."
    kinds = Select(browser.find_element(By.ID, "kind"))
    assert [o.text for o in kinds.options] == ["cross-attention", "encoder self-attention", "decoder self-attention"]

    def tokens(side: str):
        return browser.find_elements(By.CSS_SELECTOR, f"#{side} .tok")

    assert [t.text for t in tokens("queries")] == ["\u2581A", "\u2581dog", "\u2581runs", ".", "</s>"]

    # cross-attention, layer 1, head 2: hover the output "dog" -> its row of weights shades the source
    Select(browser.find_element(By.ID, "layer")).select_by_value("1")
    Select(browser.find_element(By.ID, "head")).select_by_value("2")
    ActionChains(browser).move_to_element(tokens("queries")[1]).perform()
    assert_shown(browser, "keys", maps.cross[1][2, 1])
    lines = browser.find_elements(By.CSS_SELECTOR, "#lines line")
    assert 1 <= len(lines) <= 5  # one line per source token above 0.01
    assert "attends to" in browser.find_element(By.ID, "info").text

    # all heads: shading by the mean over heads, one line per head and key
    Select(browser.find_element(By.ID, "head")).select_by_value("all")
    ActionChains(browser).move_to_element(tokens("keys")[0]).move_to_element(tokens("queries")[3]).perform()
    assert_shown(browser, "keys", maps.cross[1][:, 3].mean(0))
    expected_lines = int((maps.cross[1][:, 3] > 0.01).sum())
    assert len(browser.find_elements(By.CSS_SELECTOR, "#lines line")) == expected_lines
    shot = tmp_path / "explorer.png"  # for people to look at: a hovered token, its lines and shading
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000

    # decoder self-attention, head 0: hover a key (column) -> the queries that attend to it; nothing from the past
    kinds.select_by_visible_text("decoder self-attention")
    Select(browser.find_element(By.ID, "head")).select_by_value("0")
    assert [t.text for t in tokens("keys")][0] == "<s>"
    ActionChains(browser).move_to_element(tokens("keys")[2]).perform()
    assert_shown(browser, "queries", maps.decoder_self[0][0, :, 2])
    assert shown_weights(browser, "queries")[:2] == [0.0, 0.0]  # the look-ahead mask

    # click pins a query: moving away keeps its weights; a second click releases it
    kinds.select_by_visible_text("encoder self-attention")
    assert Select(browser.find_element(By.ID, "head")).first_selected_option.text == "head 0"  # the head is kept
    Select(browser.find_element(By.ID, "head")).select_by_value("all")
    query = tokens("queries")[4]
    ActionChains(browser).move_to_element(query).click().move_to_element(tokens("keys")[0]).perform()
    assert_shown(browser, "keys", maps.encoder_self[0].mean(0)[4])
    assert "focus" in query.get_attribute("class")
    ActionChains(browser).move_to_element(query).click().perform()
    assert not browser.find_elements(By.CSS_SELECTOR, ".tok.focus")
    assert all(el.get_attribute("data-weight") is None for el in tokens("keys"))

    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_a_long_reviews_windows_and_pieces_are_shaded_relative_to_the_largest(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    pieces = [f"\u2581w{i}@{10 * i}" for i in range(6)]
    pooling = torch.tensor([0.01, 0.04, 0.02, 0.01, 0.005, 0.015])  # a long text: small shares of the whole
    windows = torch.tensor([[0.1, 0.6, 0.3], [1.0, 0.0, 0.0]])  # (2, W): evidence for / against
    maps = AttentionMaps("classifier", "a long review", "pos (p=0.90); read as 3 windows", False, pieces,
                         encoder_self=[torch.full((1, 6, 6), 1 / 6)], pooling=pooling, windows=windows,
                         window_labels=[f"{i + 1}: pieces {64 * i}-{64 * i + 127}, p=0.9" for i in range(3)],
                         window_rows=["for pos", "against"],
                         encoder_tokens=pieces, encoder_note=", window 2 of 3 (the strongest for pos)")
    browser.get(write_explorer(maps, tmp_path / "attention.html").as_uri())
    kinds = Select(browser.find_element(By.ID, "kind"))
    assert [o.text for o in kinds.options] == ["encoder self-attention, window 2 of 3 (the strongest for pos)",
                                               "pooled representation's token importance",
                                               "windows the prediction drew on"]

    def tokens(side: str):
        return browser.find_elements(By.CSS_SELECTOR, f"#{side} .tok")

    kinds.select_by_visible_text("windows the prediction drew on")
    assert [t.text for t in tokens("queries")] == ["for pos", "against"]
    ActionChains(browser).move_to_element(tokens("queries")[0]).perform()
    assert_shown(browser, "keys", windows[0])  # the values themselves ...
    shading = [t.value_of_css_property("background-color") for t in tokens("keys")]
    assert shading == ["rgba(31, 119, 180, 0.17)", "rgba(31, 119, 180, 1)", "rgba(31, 119, 180, 0.5)"]  # ... / 0.6
    kinds.select_by_visible_text("pooled representation's token importance")
    ActionChains(browser).move_to_element(tokens("queries")[0]).perform()
    assert_shown(browser, "keys", pooling)
    shading = [t.value_of_css_property("background-color") for t in tokens("keys")]
    assert shading[:3] == ["rgba(31, 119, 180, 0.25)", "rgba(31, 119, 180, 1)", "rgba(31, 119, 180, 0.5)"]  # / 0.04
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
