"""The residual stream page in Debian's chromium: the writers x readers heatmap is drawn, the usage panel arrives
by htmx, and a click on a cell opens that pair's virtual weight (a real server on tiny random models)."""

from __future__ import annotations

from playwright.sync_api import Page, expect

from tests.browser.test_pages_browser import charts_drawn, screenshot, settled


def test_residual_heatmap_click_opens_the_virtual_weight(page: Page) -> None:
    page.goto("/models/toy-1l/residual")
    charts_drawn(page)
    expect(page.locator("#usage_panel #bandwidth")).to_be_visible(timeout=60_000)  # swapped in by hx-get on load
    settled(page)
    charts_drawn(page, 3)  # the heatmap, then the usage panel's load bars and overlap map
    screenshot(page, "residual")
    # rows: embed, pos, L0H0, L0H1; columns: L0H{0,1}.Q, L0H{0,1}.K, L0H{0,1}.V, unembed -> the cell L0H1 -> unembed
    box = page.locator("#residual_panel .nsewdrag").first.bounding_box()
    assert box
    page.mouse.click(box["x"] + box["width"] * 6.5 / 7, box["y"] + box["height"] * 3.5 / 4)
    page.wait_for_url("**/models/toy-1l/residual/L0H1/unembed")
    charts_drawn(page)
    expect(page.locator("#directions-table tbody tr")).to_have_count(5)
    expect(page.locator("#directions-table .tok").first).to_be_visible()  # reader side: tokens (logits)
    expect(page.get_by_role("link", name="writer head →")).to_have_attribute("href", "/models/toy-1l/heads/L0H1")
