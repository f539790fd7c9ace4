"""API of the tour: without the shipped models every figure degrades and names what it needs; on tiny stand-ins of
toy-0l/1l/2l each figure's data is exactly its full view's JSON, and the figures of the induction circuit are
refused with the strongest head's score."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.model.config import ModelConfig
from tests.app.conftest import LIMITS, save_qkov, train_tokenizer
from tests.app.tiny_dense import MiB


# -- the tour ------------------------------------------------------------------------------------------------
def test_tour_degrades_without_the_shipped_models(client: TestClient) -> None:
    body = client.get("/api/v1/tour").json()
    assert body["models"] == {"toy-0l": False, "toy-1l": False, "toy-2l": False}
    ids = [f["id"] for f in body["figures"]]
    paper = [f"F{i}" for i in range(6, 31)]  # the paper's figures, in order; chapters (F2-F4, R1-R3) may join them
    assert [i for i in ids if i in paper] == paper and len(set(ids)) == len(ids)
    for fig in body["figures"]:
        assert fig["anchor"].startswith("https://transformer-circuits.pub/2021/framework/index.html#")
        if fig["model"] is not None:
            assert not fig["available"] and fig["model"] in fig["detail"] and fig["data"] is None
        else:
            assert fig["available"] and fig["data"] is None  # static figures


def test_the_smollm2_chapter_is_its_own_page_and_degrades_without_the_model(client: TestClient) -> None:
    paper = [f["id"] for f in client.get("/api/v1/tour").json()["figures"]]
    body = client.get("/api/v1/tour", params={"chapter": "smollm2"}).json()
    assert [f["id"] for f in body["figures"]] == ["R1", "R2", "R3"] and not set(paper) & {"R1", "R2", "R3"}
    assert all(not f["available"] and "make smollm2" in f["detail"] for f in body["figures"])
    page = client.get("/tour", params={"chapter": "smollm2"})
    assert page.status_code == 200 and page.text.count('class="tour-step"') == 3 and "SmolLM2-135M" in page.text
    assert client.get("/api/v1/tour", params={"chapter": "gpt5"}).status_code == 422


@pytest.fixture(scope="module")
def toy_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """Tiny stand-ins for the shipped toy-0l, toy-1l and toy-2l."""
    root = tmp_path_factory.mktemp("toys")
    tok = train_tokenizer()
    for layers in (0, 1, 2):
        cfg = ModelConfig(n_layers=layers, d_model=16, n_heads=2, d_head=8, d_vocab=tok.get_vocab_size(), n_ctx=64)
        save_qkov(root / f"toy-{layers}l", cfg, tok, seed=10 + layers)
    settings = Settings(
        shipped_dir=root, dtype="float64", limits=LIMITS.model_copy(update={"matrix_budget_bytes": 16 * MiB})
    )
    with TestClient(create_app(settings)) as c:
        yield c


def test_tour_on_toy_models_matches_the_full_views(toy_client: TestClient) -> None:
    body = toy_client.get("/api/v1/tour").json()
    assert body["models"] == {"toy-0l": True, "toy-1l": True, "toy-2l": True}
    figs = {f["id"]: f for f in body["figures"]}
    # These toys have random weights: no head of toy-2l reaches the 0.4 induction score, so the figures that name
    # "the induction head" are refused and say which head came closest (its score from the heads table), never drawn.
    heads = toy_client.get("/api/v1/models/toy-2l/heads").json()["heads"]
    best = max((h for h in heads if h["layer"] >= 1), key=lambda h: h["induction"])
    assert best["induction"] < 0.4
    refused = (
        f"no induction head: the strongest, {best['head']}, scores {best['induction']:.2f} (< 0.4) "
        "on the standard input"
    )
    missing = {f["id"]: f["detail"] for f in body["figures"] if not f["available"]}
    assert missing and all(detail == refused for detail in missing.values()), missing
    assert set(missing) <= {"F20", "F22", "F23", "F25", "F26", "F29"}  # the figures of the induction circuit only
    f21 = figs["F21"]
    assert (
        f21["link"] == "/models/toy-2l/composition?kind=K" and f21["api"] == "/api/v1/models/toy-2l/composition?kind=K"
    )
    f9 = figs["F9"]["data"]["paths"]
    assert f9["total"] == pytest.approx(f9["value"], abs=1e-9)
    assert figs["F10"]["link"].startswith("/models/toy-1l/heads/L0H") and "/ov?" in figs["F10"]["api"]
    same = {
        "F6": "direct",
        "F9": "paths",
        "F10": "ov",
        "F11": "skip_trigrams",
        "F14": "qk",
        "F19": "paths",
        "F21": "K",
        "F22": "prompt",
        "F24": "detectors",
        "F25": "pair",
        "F29": "path",
    }
    for fig_id, part in same.items():  # the tour's data is exactly its full view's JSON
        if fig_id in missing:
            continue
        assert figs[fig_id]["data"][part] == toy_client.get(figs[fig_id]["api"]).json(), fig_id
    assert len(set(same) - set(missing)) >= 8
