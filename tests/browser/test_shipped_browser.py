"""The screenshot pass on the real shipped models (artifacts/screenshots/real-*.png): each main page draws
every chart with no JavaScript error and nothing fetched from outside, and what the review found stays fixed
(the induction head drawn in the tour's repeated-tokens figure, no blank band under a short heatmap)."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import screenshot
from tests.browser.test_pages_browser import charts_drawn

PROMPT = (
    "def total(values):\n    result = 0\n    for value in values:\n        result = result + value\n    return result\n"
)


@pytest.mark.parametrize(
    "path,shot",
    [
        ("/models/toy-2l", "real-01-overview"),
        ("/models/toy-2l/heads/L1H2", "real-02-head-L1H2"),
        ("/models/toy-2l/heads/L0H5", "real-03-head-L0H5"),
        ("/models/toy-2l/composition?kind=K", "real-04-composition-K"),
        ("/models/toy-2l/composition/L0H5/L1H2", "real-05-pair"),
        ("/models/toy-2l/prompt?prompt=" + PROMPT.replace("\n", "%0A").replace(" ", "+"), "real-06-prompt"),
        ("/models/toy-2l/detectors", "real-07-detectors"),
        ("/models/toy-1l/heads/L0H0", "real-08-head-1l"),
    ],
)
def test_shipped_pages_draw(shipped_page: Page, path: str, shot: str) -> None:
    response = shipped_page.goto(path)
    assert response is not None and response.ok
    charts_drawn(shipped_page, shipped_page.locator("[data-plotly]").count())
    screenshot(shipped_page, shot)


def test_short_heatmap_leaves_no_blank_band(shipped_page: Page) -> None:
    shipped_page.goto("/models/toy-2l/composition?kind=K")
    charts_drawn(shipped_page)
    box, height = (
        shipped_page.evaluate("""() => { const el = document.querySelector('#composition_panel [data-plotly]');
        return [el.getBoundingClientRect().height, el.querySelector('.js-plotly-plot').layout.height]; }""")
    )
    assert height and box <= height + 8, (box, height)


def test_tour_repeated_tokens_shows_the_induction_head(shipped_page: Page) -> None:
    shipped_page.goto("/tour")
    charts_drawn(shipped_page, 10)
    titles = shipped_page.evaluate(
        "() => [...document.querySelectorAll('#F24 .js-plotly-plot')].map(g => g.layout.title.text)"
    )
    assert any("L1H2 attention" in t or "L1H0 attention" in t for t in titles), titles  # the induction heads of toy-2l
    expect(shipped_page.locator("article.tour-step")).to_have_count(
        len(shipped_page.request.get("/api/v1/tour").json()["figures"])
    )
    shipped_page.locator("#F24").scroll_into_view_if_needed()
    screenshot(shipped_page, "real-09-tour-F24")
