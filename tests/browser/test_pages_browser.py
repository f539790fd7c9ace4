"""The dashboard in a real browser: pickers swap their panel without a page load and push the URL; reload
and back show the same screen; charts draw; errors land in their panel; exports download; nothing is
fetched from outside 127.0.0.1 (checked by the `page` fixture); the first load stays under 1 MB."""

from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import ARTIFACTS, screenshot

M = "toy-2l"
CHARTS_DRAWN = """(n) => {
  const plots = [...document.querySelectorAll('[data-plotly] .js-plotly-plot')];
  return plots.length >= n && plots.every(g => Array.isArray(g.data) && g.data.length > 0);
}"""


def charts_drawn(pg: Page, n: int = 1) -> None:
    pg.wait_for_function(CHARTS_DRAWN, arg=n)


def settled(pg: Page) -> None:
    pg.wait_for_function("() => !document.querySelector('.htmx-request') && !document.querySelector('.htmx-settling')")


def mark_document(pg: Page) -> None:
    """A flag on window: still there after an htmx swap, gone after a real page load."""
    pg.evaluate("() => { window.__qkovSameDocument = true; }")


def same_document(pg: Page) -> bool:
    return bool(pg.evaluate("() => window.__qkovSameDocument === true"))


def chart_title(pg: Page, scope: str) -> str:
    return str(pg.evaluate("(s) => document.querySelector(s + ' .js-plotly-plot').layout.title.text", scope))


def wait_chart_title(pg: Page, scope: str, text: str, present: bool = True) -> None:
    """Wait until the first chart in `scope` is drawn with (or without) `text` in its title (after history
    navigation the URL changes before the restored content arrives)."""
    pg.wait_for_function(
        """([s, t, present]) => { const g = document.querySelector(s + ' .js-plotly-plot');
             return !!(g && g.layout && g.layout.title) && g.layout.title.text.includes(t) === present; }""",
        arg=[scope, text, present],
    )


def test_first_load_is_under_one_megabyte_and_cached_reload_is_fast(page: Page, server: str) -> None:
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    sizes: dict[str, int] = {}
    urls: dict[str, str] = {}
    cdp.on("Network.responseReceived", lambda e: urls.__setitem__(e["requestId"], e["response"]["url"]))
    cdp.on("Network.loadingFinished", lambda e: sizes.__setitem__(e["requestId"], int(e["encodedDataLength"])))
    page.goto(f"/models/{M}", wait_until="load")
    charts_drawn(page)
    page.wait_for_timeout(300)  # the last loadingFinished events
    total = sum(sizes.values())
    by_url = {urls.get(k, k): v for k, v in sizes.items()}
    assert any("plotly" in u for u in by_url), by_url
    assert total < 1_000_000, f"first load transferred {total} bytes: {by_url}"

    page.reload(wait_until="load")  # warm: static files from the cache, the heads view from the server's cache
    charts_drawn(page)
    nav = page.evaluate(
        "() => { const n = performance.getEntriesByType('navigation')[0]; return {ttfb: n.responseStart - "
        "n.requestStart, load: n.loadEventEnd - n.startTime}; }"
    )
    reload_sizes = sum(sizes.values()) - total
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "browser-metrics.json").write_text(
        json.dumps(
            {
                "first_load_bytes": total,
                "first_load_by_url": by_url,
                "cached_reload_ms": nav,
                "reload_bytes": reload_sizes,
            },
            indent=1,
        )
    )
    print(f"\nfirst load {total} bytes; cached reload {nav}")


def test_models_page_lists_models_and_links_them(page: Page) -> None:
    page.goto("/")
    expect(page.locator("#models-table")).to_contain_text(M)
    expect(page.locator('link[rel="alternate"][type="application/json"]')).to_have_attribute("href", "/api/v1/models")
    screenshot(page, "01-models")
    page.locator("#models-table").get_by_role("link", name=M).click()
    page.wait_for_url(f"**/models/{M}")
    charts_drawn(page)


def test_overview_score_picker_swaps_pushes_and_restores(page: Page) -> None:
    page.goto(f"/models/{M}")
    charts_drawn(page)
    assert "induction" in chart_title(page, "#heads_panel")
    screenshot(page, "02-overview")
    mark_document(page)
    page.select_option("#heads_panel select[name=score]", "previous_token")
    page.wait_for_url(re.compile(r"score=previous_token"))
    settled(page)
    charts_drawn(page)
    assert same_document(page), "the picker must swap the panel, not load a page"
    assert "previous token" in chart_title(page, "#heads_panel")

    page.reload()
    charts_drawn(page)
    expect(page.locator("#heads_panel select[name=score]")).to_have_value("previous_token")
    assert "previous token" in chart_title(page, "#heads_panel")

    page.go_back()
    page.wait_for_url(re.compile(rf"/models/{M}$"))
    wait_chart_title(page, "#heads_panel", "induction")
    expect(page.locator("#heads_panel select[name=score]")).to_have_value("induction")


def test_heatmap_cell_opens_its_head(page: Page) -> None:
    page.goto(f"/models/{M}")
    charts_drawn(page)
    box = page.locator("#heads_panel .nsewdrag").first.bounding_box()
    assert box
    # 2 layers (rows, L0 on top) x 4 heads: the centre of row 1, column 3 is L1H3
    page.mouse.click(box["x"] + box["width"] * 3.5 / 4, box["y"] + box["height"] * 1.5 / 2)
    page.wait_for_url(f"**/models/{M}/heads/L1H3")
    expect(page.locator("h1")).to_contain_text("L1H3")


def test_head_token_click_swaps_circuits_and_history_restores(page: Page) -> None:
    page.goto(f"/models/{M}/heads/L1H2")
    charts_drawn(page, 3)
    screenshot(page, "03-head")
    mark_document(page)
    first = page.locator("#ov-table tbody tr").first.locator("a.tok").first
    token_id = first.get_attribute("title").split()[-1]
    first.click()
    page.wait_for_url(re.compile(rf"token={token_id}"))
    settled(page)
    assert same_document(page)
    expect(page.locator("#circuits h2")).to_contain_text("for")
    expect(page.locator("#circuits input[name=token]")).to_have_value(token_id)
    expect(page.locator("#qk-key-table")).to_be_visible()
    screenshot(page, "04-head-token")

    page.reload()
    expect(page.locator("#circuits input[name=token]")).to_have_value(token_id)
    expect(page.locator("#qk-key-table")).to_be_visible()
    charts_drawn(page, 3)

    page.go_back()
    page.wait_for_url(re.compile(r"/heads/L1H2$"))
    expect(page.locator("#circuits input[name=token]")).to_have_value("")  # expect() waits for the restore
    expect(page.locator("#qk-key-table")).to_have_count(0)
    charts_drawn(page, 3)


def test_error_appears_inside_the_panel_that_asked(page: Page) -> None:
    page.goto(f"/models/{M}/heads/L0H1")
    charts_drawn(page)
    before = page.url
    page.fill("#circuits input[name=token]", "999999")
    page.locator("#circuits button[type=submit]").click()
    err = page.locator("#circuits .panel-body .error")
    expect(err).to_contain_text("999999")
    expect(page.locator("#circuits form")).to_be_visible()  # the form stays to fix the input
    assert page.url == before, "an error is not pushed to the address bar"
    screenshot(page, "05-head-error")


def test_direct_path_form(page: Page) -> None:
    page.goto(f"/models/{M}/direct")
    mark_document(page)
    page.fill("#direct_panel input[name=token]", "7")
    page.locator("#direct_panel button[type=submit]").click()
    page.wait_for_url(re.compile(r"token=7"))
    settled(page)
    charts_drawn(page)
    assert same_document(page)
    expect(page.locator("#direct_panel h2")).to_contain_text("Next tokens after")
    screenshot(page, "06-direct")
    page.go_back()
    page.wait_for_url(re.compile(r"/direct$"))
    expect(page.locator("#direct_panel h2")).to_contain_text("Largest bigram entries")


def test_detectors_form(page: Page) -> None:
    page.goto(f"/models/{M}/detectors?seq_len=12&batch=2")
    charts_drawn(page, 3)
    mark_document(page)
    page.fill("#detectors_panel input[name=seq_len]", "20")
    page.locator("#detectors_panel").get_by_role("button", name="Run").click()
    page.wait_for_url(re.compile(r"seq_len=20"))
    settled(page)
    charts_drawn(page, 3)
    assert same_document(page)
    screenshot(page, "07-detectors")
    page.reload()
    expect(page.locator("#detectors_panel input[name=seq_len]")).to_have_value("20")


def test_table_csv_and_chart_svg_export(page: Page) -> None:
    page.goto(f"/models/{M}")
    charts_drawn(page)
    with page.expect_download() as dl:
        page.locator('button[data-csv="heads-table"]').click()
    text = open(dl.value.path(), encoding="utf-8").read()
    lines = text.strip().splitlines()
    assert lines[0].startswith("head,") and len(lines) == 1 + 8  # toy-2l: 2 layers x 4 heads
    assert lines[1].startswith("L0H0,")
    page.locator("#heads_panel .js-plotly-plot").hover()
    with page.expect_download() as svg:
        page.locator('#heads_panel .modebar-btn[data-title="Download plot as SVG"]').click()
    assert svg.value.suggested_filename.endswith(".svg")
    assert "<svg" in open(svg.value.path(), encoding="utf-8").read(400)


def test_prompt_token_click_and_weighted_toggle(page: Page) -> None:
    page.goto(f"/models/{M}/prompt?prompt=the+cat+sat+on+the+mat")
    charts_drawn(page, 3)
    expect(page.locator("#paths_panel .sum-check")).to_contain_text("= model")
    screenshot(page, "08-prompt")
    mark_document(page)
    page.locator("#paths_panel .tokens a").nth(2).click()
    page.wait_for_url(re.compile(r"position=2"))
    settled(page)
    assert same_document(page)
    expect(page.locator("#paths_panel .tokens a.sel")).to_have_attribute("title", re.compile(r"position 2$"))
    expect(page.locator("#paths_panel h2")).to_contain_text("position 2")
    page.locator("#patterns_panel .seg a", has_text="value-weighted").click()
    page.wait_for_url(re.compile(r"weighted=true"))
    settled(page)
    charts_drawn(page, 3)
    assert same_document(page)
    assert "position=2" in page.url, "the other panel's state stays in the URL"
    expect(page.locator("#paths_panel h2")).to_contain_text("position 2")
    assert "value-weighted" in chart_title(page, "#patterns_panel")

    page.reload()
    charts_drawn(page, 3)
    expect(page.locator("#paths_panel h2")).to_contain_text("position 2")
    assert "value-weighted" in chart_title(page, "#patterns_panel")
    page.go_back()
    page.wait_for_url(re.compile(r"^(?!.*weighted).*position=2"))
    wait_chart_title(page, "#patterns_panel", "value-weighted", present=False)
    page.go_back()
    page.wait_for_url(re.compile(r"mat$"))
    last = page.locator("#paths_panel .tokens a").count() - 1  # the default position: the last token
    expect(page.locator("#paths_panel .tokens a.sel")).to_have_attribute("title", re.compile(rf"position {last}$"))


def test_composition_kind_toggle_and_cell_click(page: Page) -> None:
    page.goto(f"/models/{M}/composition")
    charts_drawn(page)
    screenshot(page, "09-composition")
    page.locator("#composition_panel .seg a", has_text="V").click()
    page.wait_for_url(re.compile(r"kind=V"))
    settled(page)
    charts_drawn(page)
    assert chart_title(page, "#composition_panel").startswith("V-composition")
    box = page.locator("#composition_panel .nsewdrag").first.bounding_box()
    assert box  # rows L0H0..L0H3 (earlier), columns L1H0..L1H3 (later): the cell L0H1 -> L1H2
    page.mouse.click(box["x"] + box["width"] * 2.5 / 4, box["y"] + box["height"] * 1.5 / 4)
    page.wait_for_url(f"**/models/{M}/composition/L0H1/L1H2")
    charts_drawn(page, 2)
    screenshot(page, "10-pair")


def test_tour_draws_its_figures(page: Page) -> None:
    page.goto("/tour")
    charts_drawn(page, 10)
    expect(page.locator("article.tour-step")).to_have_count(
        len(page.request.get("/api/v1/tour").json()["figures"])
    )  # one per figure of the twin
    expect(page.locator("#F21 .js-plotly-plot")).to_have_count(3)
    screenshot(page, "14-tour")
    page.locator("#F6").get_by_role("link", name="Open the full view →").click()
    page.wait_for_url(re.compile(r"/models/toy-0l/direct"))


@pytest.mark.parametrize(
    "path,shot",
    [
        ("/", None),
        (f"/models/{M}", None),
        (f"/models/{M}/heads/L0H0", None),
        (f"/models/{M}/direct", None),
        (f"/models/{M}/detectors", None),
        (f"/models/{M}/path?heads=L0H1,L1H2", "11-chain"),
        (f"/models/{M}/qk-paths?head=L1H2", "12-qk-paths"),
        (f"/models/{M}/term-importance", "13-term-importance"),
        ("/models/toy-1l", "15-overview-1l"),
        ("/models/toy-0l", None),
    ],
)
def test_pages_load_with_every_asset_local(page: Page, path: str, shot: str | None) -> None:
    response = page.goto(path)
    assert response is not None and response.ok
    href = page.locator('link[rel="alternate"][type="application/json"]').get_attribute("href")
    assert href and href.startswith("/api/v1/")
    expect(page.locator("a.json-link")).to_be_visible()
    if page.locator("[data-plotly]").count():
        charts_drawn(page, page.locator("[data-plotly]").count())
    if shot:
        screenshot(page, shot)
