"""Reading a wide model in a real browser: the composition page's layer blocks and the zoom into one, the head
filter shared by the overview's table and grid and by the composition page, every head of a layer as small
multiples with one shared hover and the weights in a tooltip, glossary links on first use, token markup drawn as text
by plotly, the attention text view's weight on hover. Real uvicorn + Debian's chromium (tests/browser/conftest.py);
screenshots in artifacts/screenshots/."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from app import charts
from app.figure_output import for_page
from app.settings import Limits
from circuits_core.model.config import ModelConfig
from tests.app.conftest import train_tokenizer
from tests.app.test_composition_frame import slow_wide_model
from tests.browser.conftest import CHROMIUM, checked_page, screenshot, serve, serve_model
from tests.browser.test_pages_browser import charts_drawn, mark_document, same_document, settled

W = "wide"


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """9 layers x 9 heads: 72 earlier x 72 later heads, past the 64 rows a heat map labels one by one."""
    cfg = ModelConfig(
        n_layers=9,
        d_model=32,
        n_heads=9,
        d_head=4,
        d_vocab=train_tokenizer().get_vocab_size(),
        n_ctx=64,
        positional_embedding_type="standard",
    )
    yield from serve_model(tmp_path_factory, W, cfg, 5, Limits(max_seq_len=30, max_batch=4, max_heads=16))


@pytest.fixture
def wide(browser, wide_server: str) -> Iterator[Page]:  # noqa: ANN001
    for pg in checked_page(browser, wide_server):
        pg.set_default_timeout(90_000)  # a cold composition of 81 heads on a shared machine
        yield pg


def click_block_2_to_5(page: Page) -> None:
    """Click the K-composition block map's cell of layers 2 -> 5 through plotly's own click event, and wait for the
    zoomed page (its URL names the block) to draw its two charts."""
    page.evaluate(
        """() => {
          const gd = document.querySelector('[data-name="wide-K-composition-blocks"] .js-plotly-plot');
          gd.emit('plotly_click', {points: [{curveNumber: 0, pointIndex: [2, 4]}]});
        }"""
    )
    page.wait_for_url(re.compile(r"block=2-5"))
    charts_drawn(page, 2)


def test_layer_block_map_zooms_into_a_block_on_click(wide: Page) -> None:
    wide.goto(f"/models/{W}/composition?kind=K")
    charts_drawn(wide, 1)
    blocks = wide.locator('[data-name="wide-K-composition-blocks"] .js-plotly-plot')
    expect(blocks).to_be_visible()
    box = blocks.bounding_box()
    assert box is not None and box["height"] <= 900 + 2  # capped: it drew 72 rows at 26 px each
    ticks = wide.eval_on_selector_all(
        '[data-name="wide-K-composition-blocks"] .ytick text', "els => els.map(e => e.textContent)"
    )
    assert sorted(ticks) == [f"L{a}" for a in range(8)]
    click_block_2_to_5(wide)
    zoom = wide.locator("#block-zoom .js-plotly-plot")
    expect(zoom).to_be_visible()
    cells = wide.eval_on_selector_all("#block-zoom .heatmaplayer text", "els => els.map(e => e.textContent)")
    numbers = [c for c in cells if re.fullmatch(r"-?\d\.\d{2}", c)]
    assert len(numbers) == 81  # every cell of the 9 x 9 block carries its value
    api = wide.request.get(f"/api/v1/models/{W}/composition", params={"kind": "K"}).json()
    i, j = api["sources"].index("L2H0"), api["targets"].index("L5H0")
    assert f"{api['minus_baseline'][i][j]:.2f}" in numbers
    screenshot(wide, "wide-composition-block-zoom")
    wide.click("#all-blocks")
    wide.wait_for_function("() => !document.querySelector('#block-zoom')")


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same model at a rate that prices its three composition kinds at 2 s: the page comes as its frame first."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"browser tests need {CHROMIUM} (make browser-deps)")
    yield from serve(slow_wide_model(tmp_path_factory.mktemp("browser-slow"), "float32"))


def test_composition_heat_maps_load_after_the_frame_and_zoom(browser, slow_server: str) -> None:  # noqa: ANN001
    """The frame first, then the panel's heat maps swapped in by htmx (the page itself not reloaded); the block map
    zooms into a block as on a page drawn whole, and the Q/K/V switch keeps one colour scale."""
    for pg in checked_page(browser, slow_server):
        pg.set_default_timeout(90_000)
        with pg.expect_response(lambda r: r.request.headers.get("hx-target") == "composition-lazy") as panel:
            pg.goto(f"/models/{W}/composition?kind=K")  # the frame; its panel asks for the heat maps
        mark_document(pg)
        assert panel.value.status == 200
        charts_drawn(pg, 1)
        expect(pg.locator("#composition-lazy")).to_have_count(0)
        assert same_document(pg)  # swapped into the frame, not a reload
        zmax = pg.evaluate(
            """() => document.querySelector('[data-name="wide-K-composition-blocks"] .js-plotly-plot').data[0].zmax"""
        )
        click_block_2_to_5(pg)
        cells = pg.eval_on_selector_all("#block-zoom .heatmaplayer text", "els => els.map(e => e.textContent)")
        assert len([c for c in cells if re.fullmatch(r"-?\d\.\d{2}", c)]) == 81
        pg.click('[aria-label="composition kind"] a:text-is("V")')
        v_zmax = pg.wait_for_function(
            """() => { const gd = document.querySelector('[data-name="wide-V-composition-blocks"] .js-plotly-plot');
                       return gd && gd.data && gd.data[0].zmax; }"""
        ).json_value()
        assert v_zmax == pytest.approx(zmax)
        screenshot(pg, "wide-composition-after-frame")


def test_head_filter_applies_to_table_and_grid(wide: Page) -> None:
    wide.goto(f"/models/{W}?score=previous_token")
    charts_drawn(wide, 1)
    all_rows = wide.locator("#heads-table tbody tr").count()
    assert all_rows == 81
    heads = wide.request.get(f"/api/v1/models/{W}/heads").json()["heads"]
    cut = sorted(h["previous_token"] for h in heads)[len(heads) // 2]  # about half the heads pass
    wide.fill("#head-filter", f"previous_token > {cut} and layer < 4")
    wide.click("#head-filter-apply")
    settled(wide)
    expect(wide.locator("#filter-note")).to_be_visible()
    want = [h["head"] for h in heads if h["previous_token"] > cut and h["layer"] < 4]
    rows = wide.eval_on_selector_all(
        "#heads-table tbody tr td:first-child", "els => els.map(e => e.textContent.trim())"
    )
    assert rows == want and 0 < len(rows) < all_rows
    charts_drawn(wide, 1)
    z = wide.evaluate("""() => document.querySelector('[data-name="wide-previous_token"] .js-plotly-plot').data[0].z""")
    coloured = {f"L{a}H{h}" for a, row in enumerate(z) for h, v in enumerate(row) if v is not None}
    assert coloured == set(want)
    assert "filter=previous_token" in wide.url  # the filter is in the address: shared by link
    screenshot(wide, "wide-overview-head-filter")


def test_head_filter_applies_to_the_composition_map_and_pairs(wide: Page) -> None:
    """The same filter on a second page: typed on the composition page, its map is redrawn on the kept heads only
    (cell by cell: few enough now) and the strongest pairs list only pairs of kept heads."""
    wide.goto(f"/models/{W}/composition?kind=K")
    charts_drawn(wide, 1)
    heads = wide.request.get(f"/api/v1/models/{W}/heads").json()["heads"]
    cut = sorted(h["induction"] for h in heads)[len(heads) // 2]
    kept = {h["head"] for h in heads if h["induction"] > cut and h["layer"] >= 2}
    wide.fill("#head-filter", f"induction > {cut} and layer >= 2")
    wide.click("#head-filter-apply")
    wide.wait_for_url(re.compile(r"filter=induction"))
    settled(wide)
    expect(wide.locator("#filter-note")).to_be_visible()
    charts_drawn(wide, 1)
    api = wide.request.get(f"/api/v1/models/{W}/composition", params={"kind": "K"}).json()
    trace = wide.evaluate(
        """() => { const t = document.querySelector('[data-name="wide-K-composition"] .js-plotly-plot').data[0];
                   return {x: t.x, y: t.y}; }"""
    )
    assert trace["y"] == [s for s in api["sources"] if s in kept]
    assert trace["x"] == [t for t in api["targets"] if t in kept]
    pairs = wide.eval_on_selector_all(
        "#pairs-table tbody tr",
        "rows => rows.map(r => [...r.querySelectorAll('td')].slice(0, 2).map(td => td.textContent.trim()))",
    )
    assert pairs and all(s in kept and t in kept for s, t in pairs)
    screenshot(wide, "wide-composition-head-filter")


def test_small_multiples_share_one_hover_and_show_weights(wide: Page) -> None:
    prompt = "the cat sat on the mat while the dog ran"
    wide.goto(f"/models/{W}/prompt?prompt={prompt.replace(' ', '+')}&layer=3")
    canvases = wide.locator("#layer-multiples canvas[data-head]")
    expect(canvases.first).to_be_visible()
    assert canvases.count() == 9
    twin = wide.request.get(
        f"/api/v1/models/{W}/prompt", params={"prompt": prompt, "heads": ",".join(f"L3H{h}" for h in range(9))}
    ).json()
    n = len(twin["tokens"])
    q, k = n - 1, 2
    box = canvases.nth(4).bounding_box()
    assert box is not None
    wide.mouse.move(box["x"] + (k + 0.5) * box["width"] / n, box["y"] + (q + 0.5) * box["height"] / n)
    tip = wide.locator("#layer-multiples .sm-tooltip")
    expect(tip).to_be_visible()
    lines = tip.locator("div").all_text_contents()
    assert (
        lines[0]
        == f"query {json.dumps(twin['tokens'][q]['text'])} [{q}] → key {json.dumps(twin['tokens'][k]['text'])} [{k}]"
    )
    for head, line in zip(twin["heads"], lines[1:], strict=True):  # the page's data is rounded to 4 digits
        name, value = line.split(": ")
        assert name == head["head"] and float(value) == pytest.approx(head["pattern"][q][k], abs=6e-4)
    # the same hover shows in every head: the strip marks the query and the key
    assert wide.locator("#layer-multiples .sm-tok.dest").get_attribute("data-pos") == str(q)
    assert wide.locator("#layer-multiples .sm-tok.src").get_attribute("data-pos") == str(k)
    screenshot(wide, "wide-small-multiples-tooltip")
    wide.locator("#layer-multiples .sm-tok").nth(q).hover()
    lines = tip.locator("div").all_text_contents()
    for head, line in zip(twin["heads"], lines[1:], strict=True):
        row = head["pattern"][q][: q + 1]
        best = max(range(len(row)), key=row.__getitem__)
        assert line.startswith(f"{head['head']}: ") and f"[{best}] " in line
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(row[best], abs=6e-4)


def test_glossary_links_open_their_definitions(wide: Page) -> None:
    wide.goto(f"/models/{W}/composition?kind=K")
    link = wide.locator("main a.term").first
    expect(link).to_be_visible()
    linked = wide.eval_on_selector_all("main a.term", "els => els.map(e => e.dataset.term)")
    assert len(linked) == len(set(linked))  # first use only
    anchor = link.get_attribute("data-term")
    link.click()
    wide.wait_for_url(re.compile(rf"/glossary#{anchor}$"))
    heading = wide.locator(f"h3#{anchor}")
    expect(heading).to_be_visible()
    assert wide.locator("main a.term").count() == 0  # the glossary does not link to itself


def test_plotly_draws_token_markup_as_text(wide: Page) -> None:
    token = "<b>x</b><br>&amp;"
    fig = for_page(charts.bars([token, "b"], [1.0, -1.0], title=f"after {token}"))
    wide.goto(f"/models/{W}")
    charts_drawn(wide, 1)
    drawn = wide.evaluate(
        """fig => {
          const div = document.createElement('div');
          div.style.width = '600px'; div.style.height = '300px';
          document.body.appendChild(div);
          return Plotly.newPlot(div, fig.data, fig.layout).then(() => ({
            ticks: Array.from(div.querySelectorAll('.xtick text')).map(e => e.textContent),
            bold: div.querySelectorAll('.xtick text tspan[style*="bold"]').length,
            title: div.querySelector('.gtitle').textContent,
          }));
        }""",
        fig,
    )
    assert drawn["ticks"][0] == token and drawn["bold"] == 0
    assert drawn["title"] == f"after {token}"


def test_attention_text_view_shows_the_hovered_weight(page: Page) -> None:
    prompt = "the cat sat on the mat"
    page.goto(f"/models/toy-2l/prompt?prompt={prompt.replace(' ', '+')}&heads=L1H0")
    toks = page.locator("#attn_text .attn-tok")
    expect(toks.first).to_be_visible()
    twin = page.request.get("/api/v1/models/toy-2l/prompt", params={"prompt": prompt, "heads": "L1H0"}).json()
    pattern = twin["heads"][0]["pattern"]
    q = len(twin["tokens"]) - 1
    toks.nth(q).click()  # pin the last query
    toks.nth(1).hover()
    caption = page.locator("#attn_text .attn-caption").text_content() or ""
    assert f"weight {pattern[q][1]:.3f} from the pinned position {q}" in caption
    assert f"attention from position {q}: {pattern[q][1]:.3f}" in (toks.nth(1).get_attribute("title") or "")


@pytest.fixture(scope="module")
def bands_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A rotary model with SmolLM2's d_head = 64: 32 rotary bands on one chart."""
    cfg = ModelConfig(
        n_layers=1,
        d_model=64,
        n_heads=2,
        d_head=64,
        d_vocab=train_tokenizer().get_vocab_size(),
        n_ctx=64,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_base=10000.0,
    )
    yield from serve_model(tmp_path_factory, "bands", cfg, 7, Limits(max_seq_len=30, max_batch=4))


def test_rotary_band_ticks_are_inside_the_chart(browser, bands_server: str) -> None:  # noqa: ANN001
    """32 bands: every tick label lies inside the chart. (It passes with the old 'k=0 (λ=6.28)' labels too on this
    chart: it guards the short labels, it does not reproduce the clipping seen on SmolLM2's head page.)"""
    for pg in checked_page(browser, bands_server):
        pg.set_default_timeout(90_000)
        pg.goto("/models/bands/heads/L0H1")
        chart = pg.locator('[data-name="bands-L0H1-rotary-bands"]')
        pg.wait_for_function(
            "() => document.querySelectorAll('[data-name=\"bands-L0H1-rotary-bands\"] .xtick text').length > 0"
        )
        # ticks measured against their own chart in one pass (panels arriving later move the page between calls)
        outside = chart.evaluate(
            """el => {
              const svg = el.querySelector('.main-svg').getBoundingClientRect();
              const ticks = Array.from(el.querySelectorAll('.xtick text'));
              return {n: ticks.length, out: ticks.map(t => t.getBoundingClientRect()).filter(b =>
                b.top < svg.top - 1 || b.bottom > svg.bottom + 1 || b.left < svg.left - 1 || b.right > svg.right + 1
              ).length};
            }"""
        )
        assert outside["n"] >= 16 and outside["out"] == 0, outside
        screenshot(pg, "rotary-bands-32")


def test_toolbar_offers_a_link_to_the_chart_not_a_dead_share_button(wide: Page) -> None:
    wide.goto(f"/models/{W}")
    charts_drawn(wide, 1)
    chart = wide.locator(f'[data-name="{W}-induction"]')
    chart.hover()
    assert chart.locator('.modebar-btn[data-title="Share chart..."]').count() == 0
    chart.locator('.modebar-btn[data-title="Link to this chart"]').click()
    link = chart.locator(".chart-link a")
    expect(link).to_be_visible()
    href = link.get_attribute("href") or ""
    assert href.endswith(f"#chart-{W}-induction")
    wide.goto(href)
    assert wide.evaluate(f"() => document.getElementById('chart-{W}-induction') !== null")
