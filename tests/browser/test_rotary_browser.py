"""The rotary controls in a real browser: the head page's offset control swaps the circuits panel
without a page load, pushes the URL and captions the QK tables with δ; the kernel and band charts draw; the
composition page's offset control and the pair page's δ profile chart work; nothing leaves 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, expect

from app.settings import Limits
from tests.app.conftest import train_tokenizer
from tests.browser.conftest import checked_page, serve_model
from tests.browser.test_pages_browser import charts_drawn, mark_document, same_document, settled
from tests.core.rotary_models import rotary_config


@pytest.fixture(scope="module")
def rotary_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = rotary_config(n_layers=3, d_vocab=train_tokenizer().get_vocab_size(), n_ctx=64, n_key_value_heads=2)
    limits = Limits(
        max_prompt_tokens=64, max_k=50, max_heads=4, max_batch=8, max_seq_len=30, matrix_budget_bytes=16 * 2**20
    )
    yield from serve_model(tmp_path_factory, "rope", cfg, 3, limits)


@pytest.fixture
def rpage(browser, rotary_server: str) -> Iterator[Page]:  # noqa: ANN001
    for pg in checked_page(browser, rotary_server):
        pg.set_default_timeout(90_000)  # a cold head page computes a dozen analyses; the machine is shared
        yield pg


def test_head_page_offset_control(rpage: Page) -> None:
    rpage.goto("/models/rope/heads/L1H3", wait_until="load")
    charts_drawn(rpage, 2)
    titles = rpage.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].map(g => g.layout.title.text)")
    assert any("positional kernel of L1H3" in t for t in titles) and any("rotary band" in t for t in titles)
    expect(rpage.locator("#qk-query-table").locator("xpath=..").locator("h3")).to_contain_text("at δ = 0")
    mark_document(rpage)
    rpage.fill("#offset-input", "4")
    rpage.locator("#circuits form button.primary").click()
    settled(rpage)
    expect(rpage.locator("#circuits h3").first).to_be_visible()
    expect(rpage.locator("#qk-query-table").locator("xpath=..").locator("h3")).to_contain_text("at δ = 4")
    assert "offset=4" in rpage.url and same_document(rpage)
    rpage.reload(wait_until="load")
    expect(rpage.locator("#qk-query-table").locator("xpath=..").locator("h3")).to_contain_text("at δ = 4")
    expect(rpage.locator("#offset-input")).to_have_value("4")


def test_composition_offset_and_pair_profile(rpage: Page) -> None:
    rpage.goto("/models/rope/composition?kind=K", wait_until="load")
    charts_drawn(rpage)
    rpage.fill("#offset-input", "3")
    rpage.locator("#offset-input").locator("xpath=ancestor::form").locator(
        "button.primary"
    ).click()  # not the basis form
    settled(rpage)
    expect(rpage.locator("#composition_panel")).to_contain_text("at offset δ = 3")
    assert "offset=3" in rpage.url
    rpage.goto("/models/rope/composition/L0H1/L2H2", wait_until="load")
    charts_drawn(rpage)
    expect(rpage.locator("#rotary-profile")).to_contain_text("K-composition")
    n = rpage.evaluate("() => document.querySelector('#rotary-profile .js-plotly-plot').data.length")
    assert n == 3  # Q, K and the baseline


def test_head_page_qk_copying_offset(rpage: Page) -> None:
    """The QK eigenvalue copying panel: its curve over δ and its eigenvalue chart draw; its own offset form loads
    the page at that δ (eigenvalue chart, note and the circuits panel's offset follow)."""
    rpage.goto("/models/rope/heads/L2H1", wait_until="load")
    charts_drawn(rpage, 4)
    panel = rpage.locator("#rotary-qk-copying")
    expect(panel.locator("header .note")).to_contain_text("at δ = 0")
    rpage.fill("#qk-copying-offset", "5")
    panel.locator("form button").click()
    rpage.wait_for_url("**offset=5**")
    charts_drawn(rpage, 4)
    expect(panel.locator("header .note")).to_contain_text("at δ = 5")
    titles = rpage.evaluate(
        "() => [...document.querySelectorAll('#rotary-qk-copying .js-plotly-plot')].map(g => g.layout.title.text)"
    )
    assert any("QK eigenvalue copying of L2H1 over δ" in t for t in titles) and any("at δ = 5" in t for t in titles)
    expect(rpage.locator("#offset-input")).to_have_value("5")
