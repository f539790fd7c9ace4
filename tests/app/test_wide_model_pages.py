"""Pages of a model too wide to draw head by head (9 layers x 9 heads: 72 earlier x 72 later heads in its
composition matrix, past the 64 rows that can each be labelled): the composition page draws layer blocks and
zooms into one; the overview and detectors pages apply a head filter to their tables and plots; the detector
chart draws the top heads only (it drew every head: 1,350 bars on SmolLM2). Every figure's height is capped."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.figure_output import MAX_HEIGHT
from app.main import create_app
from app.settings import Limits, Settings
from circuits_core.model.config import ModelConfig
from tests.app.conftest import save_qkov, train_tokenizer

M = "wide"
API = f"/api/v1/models/{M}"


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    root: Path = tmp_path_factory.mktemp("wide")
    tok = train_tokenizer()
    cfg = ModelConfig(
        n_layers=9,
        d_model=32,
        n_heads=9,
        d_head=4,
        d_vocab=tok.get_vocab_size(),
        n_ctx=64,
        positional_embedding_type="standard",
    )
    save_qkov(root / M, cfg, tok, seed=5)
    limits = Limits(max_seq_len=30, max_batch=4)
    settings = Settings(shipped_dir=root, models_dir=None, store_url="off", dtype="float64", limits=limits)
    with TestClient(create_app(settings)) as client:
        yield client


def charts_in(html: str) -> dict[str, dict]:
    found = re.findall(r'data-name="([^"]+)">\s*<script type="application/json">(.*?)</script>', html, re.S)
    return {name: json.loads(body) for name, body in found}


def test_composition_page_draws_layer_blocks_and_zooms_into_one(wide: TestClient) -> None:
    api = wide.get(f"{API}/composition", params={"kind": "K"}).json()
    page = wide.get(f"/models/{M}/composition", params={"kind": "K"})
    assert page.status_code == 200
    figs = charts_in(page.text)
    blocks = figs[f"{M}-K-composition-blocks"]
    trace = blocks["data"][0]
    assert trace["y"] == [f"L{a}" for a in range(8)] and trace["x"] == [f"L{b}" for b in range(1, 9)]
    assert blocks["layout"]["height"] <= MAX_HEIGHT
    # each block's value is its strongest pair, worked out here from the API's matrix
    for a in range(8):
        for b in range(1, 9):
            cells = [
                (api["minus_baseline"][i][j], s, t)
                for i, s in enumerate(api["sources"])
                for j, t in enumerate(api["targets"])
                if s.startswith(f"L{a}H") and t.startswith(f"L{b}H") and api["minus_baseline"][i][j] is not None
            ]
            value = trace["z"][a][b - 1]
            if b <= a:
                assert value is None and not cells
                continue
            best = max(cells)
            assert value == pytest.approx(best[0], abs=1e-4) and trace["customdata"][a][b - 1] == [best[1], best[2]]
    link = blocks["links"]["0"][2][4]  # L2 -> L5
    assert link == f"/models/{M}/composition?kind=K&block=2-5"
    zoomed = wide.get(link)
    assert zoomed.status_code == 200 and 'id="block-zoom"' in zoomed.text and 'id="all-blocks"' in zoomed.text
    zoom = charts_in(zoomed.text)[f"{M}-K-composition-block-2-5"]
    zt = zoom["data"][0]
    assert zt["y"] == [f"L2H{h}" for h in range(9)] and zt["x"] == [f"L5H{h}" for h in range(9)]
    assert "texttemplate" in zt  # values written in the cells
    i, j = api["sources"].index("L2H3"), api["targets"].index("L5H7")
    assert zt["z"][3][7] == pytest.approx(api["minus_baseline"][i][j], abs=1e-4)
    assert zoom["links"]["0"][3][7] == f"/models/{M}/composition/L2H3/L5H7"
    # the Q/K/V switch keeps the block; a block with no pairs is refused with why
    assert "kind=V&amp;block=2-5" in zoomed.text
    refused = wide.get(f"/models/{M}/composition", params={"kind": "K", "block": "5-2"})
    assert refused.status_code == 422 and "layer 5 has no head writing to a head of layer 2" in refused.text
    assert wide.get(f"/models/{M}/composition", params={"block": "x"}).status_code == 422


def test_overview_head_filter_applies_to_table_and_grid(wide: TestClient) -> None:
    heads = wide.get(f"{API}/heads").json()["heads"]
    cut = sorted(h["previous_token"] for h in heads)[len(heads) // 2]  # about half the heads pass
    text = f"previous_token > {cut} and layer < 6"
    page = wide.get(f"/models/{M}", params={"filter": text, "score": "previous_token"})
    assert page.status_code == 200
    want = [h["head"] for h in heads if h["previous_token"] > cut and h["layer"] < 6]
    table = page.text.split('id="heads-table"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r'<tr><td data-value="(L\d+H\d+)">', table)
    assert rows == want and 0 < len(rows) < len(heads)
    assert f"{len(want)} of {len(heads)} heads match" in page.text
    grid = charts_in(page.text)[f"{M}-previous_token"]["data"][0]
    coloured = {f"L{a}H{h}" for a, row in enumerate(grid["z"]) for h, v in enumerate(row) if v is not None}
    assert coloured == set(want)
    assert "texttemplate" in grid  # 9 x 9 cells: values fit in them
    bad = wide.get(f"/models/{M}", params={"filter": "induction >> 2"})
    assert bad.status_code == 422 and "induction &gt; 0.4 and layer &lt; 20" in bad.text


def test_detectors_chart_the_top_heads_and_filter_the_table(wide: TestClient) -> None:
    params = {"seq_len": 20, "batch": 2}
    api = wide.get(f"{API}/detectors", params=params).json()
    keys = ("previous_token", "duplicate_token", "induction", "current_token", "first_token")
    top = sorted(api["heads"], key=lambda h: -max(h[k] or 0.0 for k in keys))[:12]
    page = wide.get(f"/models/{M}/detectors", params=params)
    chart = charts_in(page.text)[f"{M}-detector-scores"]
    assert set(chart["data"][0]["x"]) == {h["head"] for h in top}  # 12 heads, not 81 x 5 bars
    assert all(len(t["x"]) == 12 for t in chart["data"])
    table = page.text.split('id="detectors-table"', 1)[1]
    assert len(re.findall(r'<tr><td data-value="L', table)) == 81  # the table has every head
    filtered = wide.get(f"/models/{M}/detectors", params={**params, "filter": "layer >= 7"})
    table = filtered.text.split('id="detectors-table"', 1)[1]
    rows = re.findall(r'<tr><td data-value="(L\d+H\d+)">', table)
    assert rows == [f"L{a}H{h}" for a in (7, 8) for h in range(9)]
    assert set(charts_in(filtered.text)[f"{M}-detector-scores"]["data"][0]["x"]) <= set(rows)
    assert (
        'href="/api/v1/models/wide/detectors?' in filtered.text
        and "filter=" not in filtered.text.split('id="json-link"', 1)[1].split(">", 1)[0]
    )


def test_copying_chart_draws_the_top_heads(wide: TestClient) -> None:
    """The copying page's bar chart draws the MOST_HEAD_BARS heads with the highest eigenvalue score (it drew all 81;
    270 on SmolLM2); its table lists every head."""
    from app.charts import MOST_HEAD_BARS

    api = wide.get(f"{API}/copying").json()["heads"]
    top = sorted(api, key=lambda h: -h["ov_copying"])[:MOST_HEAD_BARS]
    page = wide.get(f"/models/{M}/copying")
    chart = charts_in(page.text)[f"{M}-copying"]
    assert chart["data"][0]["x"] == [h["head"] for h in top]
    assert f"the {MOST_HEAD_BARS} highest of 81 heads" in chart["layout"]["title"]["text"]
    table = page.text.split('id="copying-table"', 1)[1]
    assert len(re.findall(r'<tr><td data-value="L', table)) == 81


def filter_half(wide: TestClient) -> tuple[str, set[str]]:
    """A filter on an induction threshold that about half the heads pass, and those heads (read off the heads table's
    JSON and tested here)."""
    heads = wide.get(f"{API}/heads").json()["heads"]
    cut = sorted(h["induction"] for h in heads)[len(heads) // 2]
    return f"induction > {cut} and layer >= 2", {h["head"] for h in heads if h["induction"] > cut and h["layer"] >= 2}


def test_composition_map_and_pairs_follow_the_head_filter(wide: TestClient) -> None:
    """The same filter on the composition page: its map's rows and columns and the strongest pairs are the kept heads
    (the whole answer from the JSON twin, restricted here)."""
    text, kept = filter_half(wide)
    api = wide.get(f"{API}/composition", params={"kind": "K"}).json()
    page = wide.get(f"/models/{M}/composition", params={"kind": "K", "filter": text})
    assert page.status_code == 200
    sources = [s for s in api["sources"] if s in kept]
    targets = [t for t in api["targets"] if t in kept]
    fig = charts_in(page.text)[f"{M}-K-composition"]["data"][0]  # few enough heads now: drawn cell by cell
    assert fig["y"] == sources and fig["x"] == targets
    i, j = api["sources"].index(sources[0]), api["targets"].index(targets[-1])
    assert fig["z"][0][-1] == pytest.approx(api["minus_baseline"][i][j], abs=1e-4)
    table = page.text.split('id="pairs-table"', 1)[1].split("</table>", 1)[0]
    pairs = re.findall(r'<tr><td data-value="(L\d+H\d+)">.*?<td data-value="(L\d+H\d+)">', table, re.S)
    # the strongest pairs among the kept heads, ranked here from the whole matrix
    among = sorted(
        (
            (-api["scores"][i][j], s, t)
            for i, s in enumerate(api["sources"])
            for j, t in enumerate(api["targets"])
            if s in kept and t in kept and api["scores"][i][j] is not None
        )
    )
    assert pairs == [(s, t) for _, s, t in among[: len(api["top_pairs"])]] and pairs
    assert f"{len(set(sources) | set(targets))} of 81 heads match" in page.text
    assert "filter=" in page.text.split('aria-label="composition kind"', 1)[1].split("</span>", 1)[0]  # Q/K/V keep it
    bad = wide.get(f"/models/{M}/composition", params={"filter": "layer <> 3"})
    assert bad.status_code == 422 and "cannot read the head filter clause" in bad.text


def test_term_importance_follows_the_head_filter(wide: TestClient) -> None:
    """The same filter on term importance's head ablations (table and charts)."""
    text, kept = filter_half(wide)
    ti = {"prompt": "the cat sat on the mat", "heads": "L1-L4"}
    whole = wide.get(f"{API}/term-importance", params=ti).json()
    page = wide.get(f"/models/{M}/term-importance", params={**ti, "filter": text})
    assert page.status_code == 200
    table = page.text.split('id="ablation-table"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r'<tr><td data-value="(L\d+H\d+)">', table)
    assert rows == [h["head"] for h in whole["heads"] if h["head"] in kept] and 0 < len(rows) < 36
    assert charts_in(page.text)[f"{M}-head-ablation"]["data"][0]["x"] == rows
    assert f"{len(rows)} of 36 heads match" in page.text


def test_every_figure_of_every_page_is_capped(wide: TestClient) -> None:
    """Every chart of every page of the 81-head model is drawn at most MAX_HEIGHT px tall (the QK paths map was
    11,860 px on SmolLM2, the composition map 6,926, the overview grid 2,220)."""
    prompt = "the cat sat on the mat and the cat sat"
    pages = [
        "",
        "/composition?kind=K",
        f"/prompt?prompt={prompt}",
        f"/path?prompt={prompt}",
        f"/qk-paths?prompt={prompt}&head=L5H3",
        "/detectors?seq_len=20&batch=2",
        f"/term-importance?prompt={prompt}&heads=L1",
        "/direct",
        "/copying?rows=8",
        f"/attention-entropy?prompt={prompt}",
        "/qk-circuit-norm",
        "/heads/L5H3",
        "/composition/L2H1/L5H3",
    ]
    drawn = 0
    for sub in pages:
        page = wide.get(f"/models/{M}{sub}")
        assert page.status_code == 200, sub
        for name, fig in charts_in(page.text).items():
            assert fig["layout"].get("height", 0) <= MAX_HEIGHT, (sub, name, fig["layout"].get("height"))
            drawn += 1
    assert drawn > len(pages)
