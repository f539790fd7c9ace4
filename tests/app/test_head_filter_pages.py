"""The head filter on the pages analyses declare (app/page_spec.py `head_filter`, the page-context hook): every such
page, enumerated from the catalog, lists in its table and colours in its heat map exactly the heads whose scores in
the heads table (its JSON, filtered here by hand) pass the filter; its JSON twin stays the unfiltered answer."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.analysis import Analysis
from app.catalog import ANALYSES
from app.main import create_app
from app.settings import Settings
from circuits_core.model.config import ModelConfig
from tests.app.conftest import save_qkov, train_tokenizer

FILTERED = sorted(a.name for a in ANALYSES if isinstance(a, Analysis) and a.page and a.page.head_filter)
M = "tiny-2l"


def test_the_every_head_pages_carry_the_filter() -> None:
    """Copying, attention entropy and the shared per-head pages (QK circuit norm, OV effective rank) declare it."""
    assert {"copying-all", "attention-entropy", "qk-circuit-norm", "ov-effective-rank"} <= set(FILTERED)


def table_heads(page: str) -> list[str]:
    """The head names of the rows of the page's head table (the first cell of each row linking a head page)."""
    return re.findall(rf'<tr><td[^>]*><a class="head-label" href="/models/{M}/heads/(L\d+H\d+)"', page)


def heatmap_cells(page: str) -> set[str] | None:
    """The heads the page's heat map colours (non-null z), or None when the page draws none."""
    for spec in re.findall(r'data-plotly[^>]*>\s*<script type="application/json">(.*?)</script>', page, re.S):
        fig = json.loads(spec)
        for trace in fig.get("data", []):
            if trace.get("type") == "heatmap":
                ys, xs = trace["y"], trace["x"]
                return {
                    f"{ys[i]}{xs[j]}" for i, row in enumerate(trace["z"]) for j, v in enumerate(row) if v is not None
                }
    return None


def page_of(name: str) -> str:
    return next(a for a in ANALYSES if a.name == name).page_path.replace("{model}", M)


@pytest.mark.parametrize("name", FILTERED)
@pytest.mark.parametrize("score", ["layer", "induction", "previous_token"])
def test_filtered_page_keeps_the_heads_passing_the_filter(client: TestClient, name: str, score: str) -> None:
    """A filter on one score (cut at its median) and the head index; the kept heads read off the heads table's JSON."""
    heads: list[dict[str, Any]] = client.get(f"/api/v1/models/{M}/heads").json()["heads"]
    cut = f"{sorted(h[score] for h in heads)[len(heads) // 2]:.6f}"
    text = f"{score} >= {cut} and head < 3"
    want = [h["head"] for h in heads if h[score] >= float(cut) and h["index"] < 3]
    assert 0 < len(want) < len(heads)
    whole = client.get(page_of(name))
    assert whole.status_code == 200, whole.text
    every = table_heads(whole.text)
    assert set(every) == {h["head"] for h in heads}  # unfiltered: the table lists every head
    page = client.get(page_of(name), params={"filter": text})
    assert page.status_code == 200, page.text
    assert table_heads(page.text) == [h for h in every if h in want]  # the kept heads, in the table's order
    assert 'id="filter-note"' in page.text
    assert f"{len(want)} of {len(heads)} heads match" in page.text
    cells = heatmap_cells(page.text)
    if cells is not None:
        assert cells == set(want)
    twin = re.search(r'id="json-link" class="json-link" href="([^"]+)"', page.text)
    assert twin is not None and "filter" not in twin.group(1)  # the JSON twin: the analysis's unfiltered answer
    answer = client.get(html.unescape(twin.group(1)))
    assert answer.status_code == 200 and answer.json()["model"]["id"] == M


@pytest.mark.parametrize("name", FILTERED)
def test_unreadable_filter_is_refused_with_the_syntax(client: TestClient, name: str) -> None:
    r = client.get(page_of(name), params={"filter": "inductoin > 0.4"})
    assert r.status_code == 422
    assert "fields: layer, head, induction" in html.unescape(r.text)


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """A random model of SmolLM2's head grid (30 layers x 9 heads), narrow enough to be cheap."""
    root = tmp_path_factory.mktemp("deep")
    tok = train_tokenizer()
    cfg = ModelConfig(
        n_layers=30, d_model=16, n_heads=9, d_head=4, d_vocab=tok.get_vocab_size(), n_ctx=32,
        positional_embedding_type="standard",
    )  # fmt: skip
    save_qkov(root / "deep", cfg, tok, seed=7)
    settings = Settings(shipped_dir=root, models_dir=None, store_url="off", dtype="float64")
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize(
    ("page", "chart"), [("qk-circuit-norm", "deep-qk-circuit-norm"), ("attention-entropy", "deep-entropy")]
)
def test_per_head_heat_maps_give_each_of_30_layers_a_label(deep: TestClient, page: str, chart: str) -> None:
    """At 30 layers the per-head heat maps label every layer and are tall enough for one label per row (13 px each,
    beside 170 px of margins); they were drawn at plotly's default 450 px, 7 px a row, their labels run together (the
    SmolLM2 browser test checks the drawn labels do not overlap)."""
    r = deep.get(f"/models/deep/{page}")
    assert r.status_code == 200, r.text
    for spec in re.findall(rf'data-name="{chart}">\s*<script type="application/json">(.*?)</script>', r.text, re.S):
        fig = json.loads(spec)
        assert fig["data"][0]["y"] == [f"L{layer}" for layer in range(30)]
        assert fig["layout"]["yaxis"]["dtick"] == 1
        assert (fig["layout"]["height"] - 170) / 30 >= 13
        return
    raise AssertionError(f"no chart {chart}")
