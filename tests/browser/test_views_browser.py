"""The reading views in a real browser: the basis picker (head, direct, composition and
pair pages), the direct page's frequent-token default, and the copying panel the overview and head pages load on
their own (top-1 / top-k self-copy shares beside the eigenvalue score)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, expect
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from app.settings import Limits
from circuits_core.model.config import ModelConfig
from tests.app.conftest import train_tokenizer
from tests.browser.conftest import checked_page, serve_model
from tests.browser.test_pages_browser import mark_document, same_document, settled


def choose(page: Page, select: str, value: str, submit: str, url: str) -> None:
    """Pick `value` in a select, submit its form, wait for the URL and for htmx to settle."""
    page.select_option(select, value)
    page.locator(submit).click()
    try:
        page.wait_for_url(url, timeout=45000)  # the suite's other worker may hold both cores meanwhile
    except PlaywrightTimeoutError as exc:  # say what the page shows instead (an error fragment is never pushed)
        raise AssertionError(f"no {url} after the submit; the page shows: {page.inner_text('main')[:600]}") from exc
    settled(page)


def test_head_page_basis_picker_swaps_the_circuits_panel(page: Page) -> None:
    """toy-1l of the browser server has learned positions, so its unembedding is centred when served."""
    page.goto("/models/toy-1l/heads/L0H0?k=5")
    expect(page.locator("#circuits")).to_contain_text("unembedding centred")
    mark_document(page)
    choose(page, "#basis-select", "raw", "#circuits form button[type=submit]", "**basis=raw**")
    expect(page.locator("#circuits")).to_contain_text("Basis: raw weights, as stored")
    assert same_document(page)  # an htmx swap of the panel, not a page load
    href = page.locator("#ov-table tbody a.tok").first.get_attribute("href") or ""
    assert "basis=raw" in href  # a token's row stays on the raw weights
    page.reload()
    expect(page.locator("#basis-select")).to_have_value("raw")


def test_direct_page_basis_picker(page: Page) -> None:
    page.goto("/models/toy-1l/direct?k=5")
    before = page.locator("#direct-table tbody td.num").first.get_attribute("data-value")
    choose(page, "#basis-select", "raw", "#direct_panel form button[type=submit]", "**basis=raw**")
    expect(page.locator("#direct_panel")).to_contain_text("Basis: raw weights, as stored")
    assert page.locator("#direct-table tbody td.num").first.get_attribute("data-value") != before


def test_plain_models_have_no_basis_picker(page: Page) -> None:
    page.goto("/models/toy-2l/heads/L1H0")
    expect(page.locator("#circuits")).to_contain_text("the stored weights are the only basis")
    expect(page.locator("#basis-select")).to_have_count(0)


@pytest.fixture(scope="module")
def ln_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 2-layer LayerNorm model (processed when served), so the composition pages offer the raw weights."""
    cfg = ModelConfig(
        n_layers=2,
        d_model=16,
        n_heads=2,
        d_head=4,
        d_vocab=train_tokenizer().get_vocab_size(),
        n_ctx=32,
        positional_embedding_type="standard",
        normalization_type="LN",
    )
    yield from serve_model(tmp_path_factory, "ln-2l", cfg, 7, Limits(max_k=50, max_heads=4))


def test_composition_basis_picker_and_pair_page(browser, ln_server: str) -> None:  # noqa: ANN001
    for page in checked_page(browser, ln_server):
        page.goto("/models/ln-2l/composition?kind=K")
        expect(page.locator("#composition_panel")).to_contain_text("processed weights: LayerNorm folded")
        choose(page, "#basis-select", "raw", "#basis-form button[type=submit]", "**basis=raw**")
        expect(page.locator("#composition_panel")).to_contain_text("Basis: raw weights, as stored")
        page.locator("#composition_panel .seg a", has_text="Q").click()  # the kind switch keeps the basis
        page.wait_for_url("**kind=Q**")
        assert "basis=raw" in page.url
        settled(page)
        page.locator("#pairs-table a", has_text="pair →").first.click()
        page.wait_for_url("**/composition/L0H*/L1H*?basis=raw")
        expect(page.locator("#basis-select")).to_have_value("raw")
        expect(page.locator(".page-head")).to_contain_text("Basis: raw weights, as stored")
        choose(page, "#basis-select", "served", "#basis-form button[type=submit]", "**basis=served**")
        expect(page.locator(".page-head")).to_contain_text("processed weights")


def test_overview_and_head_pages_load_the_copying_panel(page: Page) -> None:
    page.goto("/models/toy-2l")
    rows = page.locator("#copying #copying-table tbody tr")
    expect(rows).to_have_count(2 * 4 + 1)  # every head and the random-weights row
    expect(page.locator("#copying-sample")).to_contain_text("every one of the")
    expect(page.locator("#copying-table thead")).to_contain_text("top-1 self-copy")
    page.goto("/models/toy-2l/heads/L1H2")
    expect(page.locator("#copying #copying-table tbody tr")).to_have_count(2)
    expect(page.locator("#copying-table tbody tr").first).to_contain_text("L1H2")


def test_direct_page_defaults_to_frequent_tokens(shipped_page: Page) -> None:
    """The shipped toys carry token counts: the direct page ranks tokens seen >= 50 times unless asked for all."""
    page = shipped_page
    page.goto("/models/toy-0l/direct?k=10")
    expect(page.locator("#min-count")).to_have_value("50")
    expect(page.locator("#direct_panel")).to_contain_text("tokens seen at least 50 times in training")
    choose(page, "#min-count", "all", "#direct_panel form button[type=submit]", "**min_count=all**")
    expect(page.locator("#direct_panel")).not_to_contain_text("tokens seen at least 50 times")
    expect(page.locator("#min-count")).to_have_value("all")


def test_copying_page_rows_input_samples_source_tokens(page: Page) -> None:
    page.goto("/models/toy-2l/copying?samples=10")
    expect(page.locator("#copying-sample")).to_contain_text("every one of the")
    page.fill("#copying input[name=rows]", "40")
    page.locator("#copying form").get_by_role("button", name="Run").click()  # (the head filter's Apply is beside it)
    page.wait_for_url("**rows=40**")
    expect(page.locator("#copying-sample")).to_contain_text("40 of the")
    expect(page.locator("#copying-table tbody tr").first).to_contain_text(
        "±"
    )  # sampled shares carry their standard error


def test_a_lazy_panel_shows_the_servers_refusal_instead_of_emptying(page: Page) -> None:
    """The copying panel loads after the page with hx-select of its own block; an error answer has no such block.
    Its request is rerouted to an invalid `rows` so the real server refuses it (422 problem fragment): the panel
    keeps its header and shows the refusal (its body used to be emptied, as on a 503 'busy')."""
    page.route("**/copying?*", lambda route: route.continue_(url=route.request.url + "&rows=0"))
    page.goto("/models/toy-2l/heads/L1H2")
    panel = page.locator("#copying-lazy")  # the lazy panel keeps its id: no #copying block came back
    expect(panel.locator(".error")).to_contain_text("422")
    expect(panel.locator(".error")).to_contain_text("rows")
    expect(panel.locator("header h2")).to_be_visible()


def test_residual_stream_pages_basis_picker(browser, ln_server: str) -> None:  # noqa: ANN001
    """The residual-stream table, a virtual weight and the usage page take the raw weights from their picker."""
    for page in checked_page(browser, ln_server):
        page.goto("/models/ln-2l/residual")
        expect(page.locator("#residual_panel")).to_contain_text("processed weights: LayerNorm folded")
        choose(page, "#basis-select", "raw", "#residual_panel form button[type=submit]", "**basis=raw**")
        expect(page.locator("#residual_panel")).to_contain_text("Basis: raw weights, as stored")
        page.goto("/models/ln-2l/residual/L0H1/L1H0.V")
        choose(page, "#basis-select", "raw", "#basis-form button[type=submit]", "**basis=raw**")
        expect(page.locator("#pair_panel")).to_contain_text("Basis: raw weights, as stored")
        page.goto("/models/ln-2l/residual/usage?basis=raw")
        expect(page.locator("#basis-select")).to_have_value("raw")
        expect(page.locator("#usage_panel")).to_contain_text("Basis: raw weights, as stored")
