"""The head filter on SmolLM2-135M (30 layers x 9 heads) in a real browser, on the pages analyses declare with the
filter hook (app/page_spec.py `head_filter`): the QK circuit norm page (the shared per-head page) and the attention
entropy page. Typed in the page's form, the filter leaves in the table and in the heat map exactly the heads whose
scores in the heads table's JSON pass it (filtered here by hand), and stays in the address.

Needs the real model (make smollm2) and Debian's chromium; a server on the models folder (only SmolLM2 is
opened), no store. Run it under the heavy lock: the model's load and its heads table take a few GiB and a minute
of CPU."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from app.settings import Settings
from tests.browser.conftest import CHROMIUM, checked_page, screenshot, serve
from tests.browser.test_pages_browser import charts_drawn

SMOLLM2 = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"
M = "smollm2-135m"
FILTER = "induction > 0.4 and layer < 20"


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"browser tests need {CHROMIUM} (make browser-deps)")
    if not list(SMOLLM2.glob("*.gguf")):
        pytest.skip("SmolLM2-135M not fetched (make smollm2)")
    empty = tmp_path_factory.mktemp("no-shipped")
    yield from serve(Settings(models_dir=SMOLLM2.parent, shipped_dir=empty, store_url="off"))


@pytest.fixture
def smol(browser, smollm2_server: str) -> Iterator[Page]:  # noqa: ANN001
    for pg in checked_page(browser, smollm2_server):
        pg.set_default_timeout(240_000)  # a cold load and heads table on a shared 2-core machine
        yield pg


def heads_table(pg: Page) -> list[dict[str, Any]]:
    """The heads table's JSON (polled while it is a job: 202)."""
    deadline = time.monotonic() + 300
    while True:
        r = pg.request.get(f"/api/v1/models/{M}/heads", timeout=240_000)
        if r.status == 200:
            heads: list[dict[str, Any]] = r.json()["heads"]
            return heads
        assert r.status == 202 and time.monotonic() < deadline, (r.status, r.text()[:300])
        time.sleep(2)


def wanted(heads: list[dict[str, Any]]) -> list[str]:
    return [h["head"] for h in heads if h["induction"] > 0.4 and h["layer"] < 20]


def rows_and_cells(pg: Page, chart: str) -> tuple[list[str], set[str]]:
    """The head names of the page's table rows, and the heads its heat map colours (non-null z)."""
    rows = pg.eval_on_selector_all(
        "table.data tbody tr td:first-child a.head-label", "els => els.map(e => e.textContent.trim())"
    )
    trace = pg.evaluate(
        f"""() => {{ const t = document.querySelector('[data-name="{chart}"] .js-plotly-plot').data[0];
                   return {{x: t.x, y: t.y, z: t.z}}; }}"""
    )
    cells = {
        f"{trace['y'][i]}{trace['x'][j]}"
        for i, row in enumerate(trace["z"])
        for j, v in enumerate(row)
        if v is not None
    }
    return rows, cells


def layer_labels_apart(pg: Page, chart: str) -> None:
    """The heat map labels each of the 30 layers, and no two labels overlap (it grows with the layers, under the
    figure cap)."""
    boxes = pg.eval_on_selector_all(
        f'[data-name="{chart}"] .ytick text',
        "els => els.map(e => { const b = e.getBoundingClientRect(); return [e.textContent, b.top, b.bottom]; })",
    )
    boxes.sort(key=lambda b: b[1])  # top to bottom as drawn
    assert [t for t, _, _ in boxes] == [f"L{layer}" for layer in range(30)]  # L0 at the top
    assert all(b0 <= t1 + 0.5 for (_, _, b0), (_, t1, _) in zip(boxes, boxes[1:], strict=False)), boxes


def test_head_filter_on_the_qk_circuit_norm_page(smol: Page) -> None:
    heads = heads_table(smol)
    want = wanted(heads)
    assert 0 < len(want) < len(heads) == 30 * 9
    smol.goto(f"/models/{M}/qk-circuit-norm")
    charts_drawn(smol, 1)
    rows, cells = rows_and_cells(smol, f"{M}-qk-circuit-norm")
    assert len(rows) == len(cells) == 270
    layer_labels_apart(smol, f"{M}-qk-circuit-norm")
    smol.fill("#head-filter", FILTER)
    smol.click("#head-filter-apply")
    smol.wait_for_url(re.compile(r"filter=induction"))
    charts_drawn(smol, 1)
    expect(smol.locator("#filter-note")).to_contain_text(f"{len(want)} of 270 heads match")
    rows, cells = rows_and_cells(smol, f"{M}-qk-circuit-norm")
    assert rows == want and cells == set(want)
    screenshot(smol, "smollm2-qk-circuit-norm-head-filter")


def test_head_filter_on_the_attention_entropy_page_keeps_the_prompt(smol: Page) -> None:
    heads = heads_table(smol)
    want = wanted(heads)
    prompt = "The cat sat on the mat. The cat sat on the"
    smol.goto(f"/models/{M}/attention-entropy")
    charts_drawn(smol, 1)
    smol.fill("textarea[name=prompt]", prompt)
    smol.fill("#head-filter", FILTER)
    smol.click("#head-filter-apply")
    smol.wait_for_url(re.compile(r"filter=induction"))
    charts_drawn(smol, 1)
    expect(smol.locator("#filter-note")).to_contain_text(f"{len(want)} of 270 heads match")
    n = len(smol.request.get(f"/api/v1/models/{M}/attention-entropy", params={"prompt": prompt}).json()["tokens"])
    expect(smol.locator("h2", has_text="On your prompt")).to_contain_text(f"On your prompt, {n} tokens")
    rows, cells = rows_and_cells(smol, f"{M}-entropy")
    assert rows == want and cells == set(want)
    layer_labels_apart(smol, f"{M}-entropy")
    screenshot(smol, "smollm2-attention-entropy-head-filter")
