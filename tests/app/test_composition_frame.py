"""The composition page of a model whose heat maps take a while: the page answers its frame at once and the heat maps
load after it, as a panel whose htmx request computes them (issue "real models": a page shows its first useful
content at once). The wide model (9 layers x 9 heads) is served at an arithmetic rate that prices its three kinds
at 2 s, over the page's FRAME_FIRST_S and under the inline budget: each kind still runs within its request."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.params import CompositionParams
from app.routers.pages_composition import FRAME_FIRST_S
from app.settings import Limits, Settings
from app.views.composition import COMPOSITION
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.model.config import ModelConfig
from tests.app.conftest import save_qkov, train_tokenizer
from tests.app.test_wide_model_pages import charts_in

M = "wide"
PRICED_S = 2.0  # the three kinds' price at the server's rate set below


def served(root: Path, rate: float, dtype: str = "float64") -> Settings:
    return Settings(shipped_dir=root, models_dir=None, store_url="off", dtype=dtype, compute_flops_per_s=rate)


def slow_wide_model(root: Path, dtype: str = "float64") -> Settings:
    """The wide model saved under root, and a server's settings whose rate prices its three kinds at PRICED_S."""
    tok = train_tokenizer()
    cfg = ModelConfig(
        n_layers=9, d_model=32, n_heads=9, d_head=4, d_vocab=tok.get_vocab_size(), n_ctx=64,
        positional_embedding_type="standard",
    )  # fmt: skip
    save_qkov(root / M, cfg, tok, seed=5)
    loaded = load_checkpoint(root / M, dtype=getattr(torch, dtype))
    flops = sum(COMPOSITION.priced(loaded, CompositionParams(kind=k), Limits()).flops for k in ("Q", "K", "V"))
    return served(root, flops / PRICED_S, dtype)


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with TestClient(create_app(slow_wide_model(tmp_path_factory.mktemp("wide-frame")))) as client:
        yield client


def lazy_panel(html: str) -> tuple[str, str]:
    """(hx-get, hx-select) of the page's panel loaded after it."""
    tag = re.search(r'<section class="panel" id="composition-lazy"[^>]*>', html)
    assert tag, "no lazy composition panel"
    get, select = re.search(r'hx-get="([^"]+)"', tag[0]), re.search(r'hx-select="([^"]+)"', tag[0])
    assert get and select and 'hx-trigger="load"' in tag[0]
    return get[1].replace("&amp;", "&"), select[1]


def test_the_frame_comes_first_and_the_panel_brings_the_heat_maps(slow: TestClient) -> None:
    assert PRICED_S > FRAME_FIRST_S
    frame = slow.get(f"/models/{M}/composition", params={"kind": "K", "block": "2-5"})
    assert frame.status_code == 200
    assert charts_in(frame.text) == {} and 'id="composition_panel"' not in frame.text  # nothing computed yet
    assert "about 2 s of arithmetic" in frame.text
    src, select = lazy_panel(frame.text)
    assert src == f"/models/{M}/composition?kind=K&block=2-5" and select == "#composition_panel"
    panel = slow.get(src, headers={"HX-Request": "true", "HX-Target": "composition-lazy"})
    assert panel.status_code == 200 and panel.text.lstrip().startswith('<section class="panel" id="composition_panel"')
    figs = charts_in(panel.text)
    api = slow.get(f"/api/v1/models/{M}/composition", params={"kind": "K"}).json()
    zoom = figs[f"{M}-K-composition-block-2-5"]["data"][0]  # the zoom, with its values in the cells
    i, j = api["sources"].index("L2H3"), api["targets"].index("L5H7")
    assert zoom["z"][3][7] == pytest.approx(api["minus_baseline"][i][j], abs=1e-4) and "texttemplate" in zoom
    # one colour scale over Q, K and V, worked out here from the three answers
    every = [slow.get(f"/api/v1/models/{M}/composition", params={"kind": k}).json() for k in ("Q", "K", "V")]
    top = max(abs(x) for a in every for row in a["minus_baseline"] for x in row if x is not None)
    blocks = figs[f"{M}-K-composition-blocks"]["data"][0]
    assert blocks["zmax"] == pytest.approx(top, abs=1e-4) and blocks["zmin"] == pytest.approx(-top, abs=1e-4)
    # the heat maps kept now: the next visit gets the whole page at once
    whole = slow.get(f"/models/{M}/composition", params={"kind": "K", "block": "2-5"})
    assert 'id="composition-lazy"' not in whole.text and set(charts_in(whole.text)) == set(figs)


def test_a_cheap_composition_comes_with_its_page(tmp_path: Path) -> None:
    """The same model at the default rate: its heat maps are priced far below FRAME_FIRST_S and drawn in the page."""
    tok = train_tokenizer()
    cfg = ModelConfig(n_layers=3, d_model=16, n_heads=2, d_head=4, d_vocab=tok.get_vocab_size(), n_ctx=32)
    save_qkov(tmp_path / M, cfg, tok, seed=1)
    with TestClient(create_app(served(tmp_path, Settings().compute_flops_per_s))) as client:
        page = client.get(f"/models/{M}/composition", params={"kind": "Q"})
    assert page.status_code == 200 and 'id="composition-lazy"' not in page.text
    assert f"{M}-Q-composition" in charts_in(page.text)
