"""Navigation and reading in a real browser: the attention text view follows the hovered
token (colours checked against the JSON API's pattern and path terms), tables sort and filter, the model picker
keeps the prompt and the head, an empty prompt is an error, a long prompt is cut with an offer to continue, a
0-layer model hides the views of heads with its reason, /docs has the app's frame, byte-level tokens read as
text, heat-map axes label every token, Q/K/V composition share one colour scale, scatter labels do not overlap.
Real uvicorn + Debian's chromium (tests/browser/conftest.py); screenshots at 1280x800 in artifacts/screenshots/.
"""

from __future__ import annotations

import math
import re
from urllib.parse import parse_qs, urlsplit

import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import screenshot
from tests.browser.test_pages_browser import charts_drawn, settled

M = "toy-2l"
PROMPT = "the cat sat on the mat. the dog sat on the log. the cat sat on the"
HEADS = "L0H1,L1H2"
ALPHA_STEP = 1.01 / 255  # the browser stores a colour's alpha in 1/255 steps


def api(pg: Page, path: str, **params: object) -> dict:
    answer = pg.request.get(path, params={k: str(v) for k, v in params.items()})
    assert answer.ok, answer.text()
    return answer.json()


def token_colours(pg: Page) -> list[dict]:
    return pg.eval_on_selector_all(
        "#attn_text .attn-tok",
        "els => els.map(e => ({bg: getComputedStyle(e).backgroundColor, w: e.dataset.weight, text: e.textContent}))",
    )


def alpha(css: str) -> float:
    found = re.fullmatch(r"rgba?\((\d+), (\d+), (\d+)(?:, ([\d.]+))?\)", css)
    assert found, css
    return float(found.group(4)) if found.group(4) is not None else 1.0


def test_attention_text_view_colours_tokens_by_the_hovered_tokens_attention(page: Page) -> None:
    page.goto(f"/models/{M}/prompt?" + f"prompt={PROMPT.replace(' ', '+')}&heads={HEADS}&k=20")
    expect(page.locator("#attn_text .attn-tok").first).to_be_visible()
    twin = api(page, f"/api/v1/models/{M}/prompt", prompt=PROMPT, heads=HEADS)
    pattern = {h["head"]: h["pattern"] for h in twin["heads"]}
    assert [t["text"] for t in token_colours(page)] == [t["text"] for t in twin["tokens"]]  # the prompt as text

    def check(dest: int, head: str) -> list[str]:
        page.locator("#attn_text .attn-tok").nth(dest).hover()
        shown = token_colours(page)
        for j, tok in enumerate(shown):
            if j > dest:  # a later token gets no attention (causal) and no colour
                assert tok["w"] == "" and alpha(tok["bg"]) == 0.0
                continue
            assert float(tok["w"]) == pytest.approx(pattern[head][dest][j], abs=1e-4)
            assert alpha(tok["bg"]) == pytest.approx(0.9 * pattern[head][dest][j], abs=ALPHA_STEP)
        expect(page.locator("#attn_text .attn-caption")).to_contain_text(f"position {dest}")
        return [t["bg"] for t in shown]

    first = check(12, "L0H1")
    second = check(20, "L0H1")
    assert first != second  # hovering another token recolours the prompt
    screenshot(page, "reading-attention-text-hover")

    # another head: chosen in the select, kept in the URL
    page.select_option("#attn_text select.attn-mode", "head:L1H2")
    assert parse_qs(urlsplit(page.url).query)["attn_head"] == ["L1H2"]
    check(20, "L1H2")

    # click pins a token: the URL holds it, a reload shows the same colours without hovering
    page.locator("#attn_text .attn-tok").nth(20).click()
    assert parse_qs(urlsplit(page.url).query)["attn_token"] == ["20"]
    pinned = [t["bg"] for t in token_colours(page)]
    page.mouse.move(5, 5)
    assert [t["bg"] for t in token_colours(page)] == pinned  # pinned: leaving the text keeps the colours
    page.reload()
    expect(page.locator("#attn_text .attn-tok.pinned")).to_have_count(1)
    assert [t["bg"] for t in token_colours(page)] == pinned


def test_attention_text_view_colours_sources_by_a_path_term(page: Page) -> None:
    page.goto(f"/models/{M}/prompt?" + f"prompt={PROMPT.replace(' ', '+')}&heads={HEADS}&k=20")
    paths = api(page, f"/api/v1/models/{M}/paths", prompt=PROMPT, k=20, max_order=2, by_source="true")
    term = next(t for t in paths["terms"] if t["kind"] == "head" and len(t["path"]) == 1)
    index = [t for t in paths["terms"] if t["by_source"] is not None].index(term)
    page.select_option("#attn_text select.attn-mode", f"term:{index}")
    shown = token_colours(page)
    strongest = max(abs(v) for v in term["by_source"])
    for tok, v in zip(shown, term["by_source"], strict=True):
        assert float(tok["w"]) == pytest.approx(v, abs=1e-4)
        assert alpha(tok["bg"]) == pytest.approx(0.9 * abs(v) / strongest, abs=ALPHA_STEP)
        if abs(v) > 0.05 * strongest:  # blue raises the logit, red lowers it
            assert tok["bg"].startswith("rgba(33, 102, 172" if v > 0 else "rgba(178, 24, 43")
    assert parse_qs(urlsplit(page.url).query)["attn_term"] == [str(index)]
    expect(page.locator("#attn_text .attn-caption")).to_contain_text(term["path"][0])
    expect(page.locator("#attn_text .attn-caption")).to_contain_text(f"at position {paths['position']}")
    expect(page.locator("#attn_text .attn-tok.dest")).to_have_attribute("data-pos", str(paths["position"]))
    screenshot(page, "reading-attention-text-term")


def test_tables_sort_by_a_column_and_filter_rows(page: Page) -> None:
    page.goto(f"/models/{M}/prompt?" + f"prompt={PROMPT.replace(' ', '+')}&heads={HEADS}&k=20")
    table = page.locator("#terms-table")
    expect(table).to_be_visible()

    def values() -> list[float]:
        return [
            float(v)
            for v in table.locator("tbody tr:not([hidden]) td.num[data-value]").evaluate_all(
                "els => els.map(e => e.dataset.value)"
            )
        ]

    before = values()
    assert len(before) >= 8
    table.locator("thead th", has_text="value").click()
    assert values() == sorted(before)
    table.locator("thead th", has_text="value").click()
    assert values() == sorted(before, reverse=True)
    expect(table.locator("thead th", has_text="value")).to_have_attribute("aria-sort", "descending")

    rows = table.locator("tbody tr")
    total = rows.count()
    box = page.locator(".table-filter").first
    box.fill("L1H2")
    visible = table.locator("tbody tr:not([hidden])")
    expect(visible.first).to_be_visible()
    texts = visible.evaluate_all("els => els.map(e => e.textContent)")
    assert texts and all("L1H2" in t for t in texts) and len(texts) < total
    expected = sum("L1H2" in t for t in rows.evaluate_all("els => els.map(e => e.textContent)"))
    assert len(texts) == expected
    screenshot(page, "reading-table-filtered")
    box.fill("")
    assert table.locator("tbody tr:not([hidden])").count() == total


def test_model_picker_keeps_the_prompt_and_the_head_that_exists(page: Page) -> None:
    page.goto(f"/models/{M}/heads/L0H1")
    page.select_option("#model-picker", "toy-1l")
    page.wait_for_url(re.compile(r"/models/toy-1l/heads/L0H1"))
    expect(page.locator("h1")).to_contain_text("L0H1")

    page.goto(f"/models/{M}/heads/L1H3")  # toy-1l has one layer of 2 heads: no L1H3 there
    page.select_option("#model-picker", "toy-1l")
    page.wait_for_url(re.compile(r"/models/toy-1l$"))

    page.goto(f"/models/{M}/prompt")  # a prompt typed on the page (htmx swap, URL pushed) is carried over
    page.fill("#prompt_main textarea[name=prompt]", "the dog sat on the log")
    page.locator("#prompt_main form.picker button[type=submit]").first.click()
    page.wait_for_url(re.compile(r"prompt=the(\+|%20)dog"))
    settled(page)
    page.select_option("#model-picker", "toy-0l")
    page.wait_for_url(re.compile(r"/models/toy-0l/prompt\?"))
    expect(page.locator("#prompt_main textarea[name=prompt]")).to_have_value("the dog sat on the log")


def test_empty_prompt_is_an_error_not_the_default_text(page: Page) -> None:
    page.goto(f"/models/{M}/prompt")
    page.fill("#prompt_main textarea[name=prompt]", "")
    page.locator("#prompt_main form.picker button[type=submit]").first.click()
    expect(page.locator("#prompt_main .error").first).to_contain_text("the prompt is empty")
    expect(page.locator("#prompt_main textarea[name=prompt]")).to_have_value("")
    expect(page.locator("#attn_text")).to_have_count(0)  # nothing was run on a substitute text
    screenshot(page, "reading-empty-prompt")


def test_long_prompt_is_cut_with_an_offer_to_continue(page: Page) -> None:
    long = " ".join(f"the cat sat on mat {i}." for i in range(40))
    page.goto(f"/models/{M}/prompt?prompt=" + long.replace(" ", "+"))
    note = page.locator("#cut-note")
    expect(note).to_contain_text("this model takes at most 64")
    kept = page.locator("#prompt_main textarea[name=prompt]").input_value()
    assert long.startswith(kept) and 0 < len(kept) < len(long)
    tokens = api(page, f"/api/v1/models/{M}/tokenize", prompt=kept)["tokens"]
    assert len(tokens) <= 64  # what is shown fits the model
    expect(page.locator("#attn_text .attn-tok")).to_have_count(len(tokens))
    screenshot(page, "reading-long-prompt-cut")
    note.locator("a.continue").click()
    page.wait_for_load_state()
    nxt = page.locator("#prompt_main textarea[name=prompt]").input_value()
    assert nxt and long[len(kept) :].startswith(nxt) and nxt != kept


def test_zero_layer_model_hides_the_views_of_heads_and_says_why(page: Page) -> None:
    page.goto("/models/toy-0l")
    nav = page.locator("nav.sidenav")
    for label in ("Composition", "QK paths", "Chain of heads", "Detectors", "Term importance"):
        expect(nav.locator("a.item", has_text=label)).to_have_count(0)
    expect(nav.locator("a.item", has_text="Direct path")).to_have_count(1)
    expect(page.locator("#nav-note")).to_contain_text("toy-0l has no attention layers")
    expect(page.locator("#nav-note")).to_contain_text("Composition")
    screenshot(page, "reading-zero-layer-nav")

    page.goto("/models/toy-1l")  # one layer: heads yes, composition between layers no
    expect(page.locator("nav.sidenav a.item", has_text="Detectors")).to_have_count(1)
    expect(page.locator("nav.sidenav a.item", has_text="Composition")).to_have_count(0)
    expect(page.locator("#nav-note")).to_contain_text("1 attention layer")

    page.goto("/models/toy-0l/composition")  # opened anyway: the reason above the refusal
    expect(page.locator(".view-note")).to_contain_text("no attention layers")


def test_docs_page_has_the_apps_navigation(page: Page) -> None:
    page.goto("/docs")
    expect(page.locator("header.topbar a.brand")).to_be_visible()
    expect(page.locator("header.topbar nav a", has_text="Paper tour")).to_be_visible()
    expect(page.locator("#model-picker")).to_be_visible()
    expect(page.locator(".api-docs")).to_contain_text("/api/v1/models/{model}/heads/{head}/qk")
    screenshot(page, "reading-docs")
    page.select_option("#model-picker", M)
    page.wait_for_url(re.compile(rf"/models/{M}$"))


def test_byte_level_tokens_read_as_text(page: Page) -> None:
    text = "café déjà vu"
    page.goto(f"/models/{M}/prompt?prompt=" + text.replace(" ", "+") + f"&heads={HEADS}")
    expect(page.locator("#attn_text .attn-tok").first).to_be_visible()
    shown = page.locator("#attn_text .attn-tokens").inner_text()
    ids = api(page, f"/api/v1/models/{M}/tokenize", prompt=text)["tokens"]
    assert "é" in shown and "à" in shown
    assert "\\xc3" in shown  # this vocabulary splits é over two tokens: the first shows its byte, the second the letter
    assert not any(c in shown for c in "ÃĠ©")  # no letter of the byte alphabet on screen
    letters = re.sub(r"\\x[0-9a-f]{2}", "", shown)  # the first bytes of a split character are shown as bytes
    assert letters.endswith(text) and len(ids) == page.locator("#attn_text .attn-tok").count()
    for label in page.locator("#patterns_panel .js-plotly-plot").first.evaluate("g => g.data[0].x"):
        assert "Ã" not in label


def boxes_of(chart, selector: str) -> list[list[float]]:  # noqa: ANN001
    return chart.locator(selector).evaluate_all(
        "els => els.map(e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; })"
    )


def disjoint(boxes: list[list[float]]) -> bool:
    return all(
        a[2] <= b[0] + 1 or b[2] <= a[0] + 1 or a[3] <= b[1] + 1 or b[3] <= a[1] + 1
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
    )


@pytest.mark.parametrize("prompt", ["the cat sat on the mat", PROMPT])
def test_heatmap_axes_label_every_token_where_there_is_room(page: Page, prompt: str) -> None:
    page.goto(f"/models/{M}/prompt?" + f"prompt={prompt.replace(' ', '+')}&heads={HEADS}")
    charts_drawn(page, 2)
    n = len(api(page, f"/api/v1/models/{M}/prompt", prompt=prompt, heads=HEADS)["tokens"])
    chart = page.locator("#patterns_panel .js-plotly-plot").first
    rows = boxes_of(chart, ".yaxislayer-above .ytick text")
    columns = boxes_of(chart, ".xaxislayer-above .xtick text")
    assert len(rows) == n  # every row labelled: the figure grows to give each one room
    if n <= 24:
        assert len(columns) == n  # every column too while a half-width chart has room
    assert disjoint(rows)  # no row label runs into another
    angle, size = chart.evaluate("g => [g._fullLayout.xaxis.tickangle, g._fullLayout.xaxis.tickfont.size]")
    if not isinstance(angle, (int, float)) or angle == 0:
        assert disjoint(columns)
    else:  # slanted labels are parallel strips: apart when their spacing across the slant exceeds the type size
        centres = sorted((b[0] + b[2]) / 2 for b in columns)
        assert (
            min(b - a for a, b in zip(centres, centres[1:], strict=False)) * abs(math.sin(math.radians(angle)))
            >= 0.9 * size
        )
    chart.scroll_into_view_if_needed()
    screenshot(page, f"reading-heatmap-labels-{n}")


def test_q_k_v_composition_share_one_colour_scale(page: Page) -> None:
    bound = max(
        abs(v)
        for kind in "QKV"
        for row in api(page, f"/api/v1/models/{M}/composition", kind=kind)["minus_baseline"]
        for v in row
        if v is not None
    )
    ranges = []
    for kind in "QKV":
        page.goto(f"/models/{M}/composition?kind={kind}")
        charts_drawn(page)
        trace = page.locator("#composition_panel .js-plotly-plot").first.evaluate(
            "g => [g.data[0].zmin, g.data[0].zmax]"
        )
        ranges.append(trace)
    assert all(r == pytest.approx([-bound, bound], rel=1e-6) for r in ranges), ranges
    screenshot(page, "reading-composition-shared-scale")


def test_scatter_labels_do_not_overlap(shipped_page: Page) -> None:
    page = shipped_page  # the real toy-2l: 8 heads in layer 1, several of them close together
    page.goto(f"/models/{M}")
    charts_drawn(page, 2)
    scatter = page.locator(".js-plotly-plot").filter(has=page.locator(".scatterlayer .textpoint")).first
    scatter.scroll_into_view_if_needed()
    boxes = scatter.locator(".textpoint text").evaluate_all(
        "els => els.filter(e => e.textContent).map(e => { const r = e.getBoundingClientRect(); return [r.left, r.top, "
        "r.right, r.bottom]; })"
    )
    assert boxes, "no labelled point"
    assert disjoint(boxes)
    heads = api(page, f"/api/v1/models/{M}/heads")["heads"]
    last = max(h["layer"] for h in heads)
    names = scatter.evaluate("g => g.data[0].customdata")
    assert sorted(names) == sorted(
        h["head"] for h in heads if h["layer"] == last
    )  # every head is a point, named on hover
    screenshot(page, "reading-scatter-labels")


def test_chain_page_reuses_the_text_view_with_the_chains_pattern(page: Page) -> None:
    page.goto(f"/models/{M}/path?heads={HEADS}&prompt=" + PROMPT.replace(" ", "+"))
    twin = api(page, f"/api/v1/models/{M}/path", heads=HEADS, prompt=PROMPT)
    tokens = page.locator("#chain_text .attn-tok")
    expect(tokens.first).to_be_visible()
    tokens.nth(15).hover()
    shown = page.eval_on_selector_all("#chain_text .attn-tok", "els => els.map(e => e.dataset.weight)")
    for j, w in enumerate(shown[:16]):
        assert float(w) == pytest.approx(twin["pattern"][15][j], abs=1e-4)
    assert all(w == "" for w in shown[16:])
