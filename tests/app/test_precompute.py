"""`python -m app.precompute` fills the store under the server's own keys: afterwards the head page and its
API twins are answered without computing (no computation besides loading the model), and a second run
computes nothing: what is stored is not computed again, so an interrupted run resumes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.precompute import lazy_panels, main, page_urls
from app.settings import REPO_ROOT, Settings

MODEL = "toy-2l"


def figures(out: str) -> tuple[int, int]:
    match = re.search(r"(\d+) computations, (\d+) answers already in the disk store", out)
    assert match is not None, out
    return int(match[1]), int(match[2])


def test_precomputed_tables_are_store_hits_and_a_rerun_skips_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {
        "QKOV_STORE_URL": "disk",
        "QKOV_STORE_DIR": str(tmp_path / "store"),
        "QKOV_SHIPPED_DIR": str(REPO_ROOT / "checkpoints"),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main([MODEL, "--heads", "L1H2"]) == 0
    computed, hits = figures(capsys.readouterr().out)
    assert hits == 0 and computed >= 8  # heads table, Q/K/V composition, the head's view and circuits, ...

    app = create_app(Settings())
    with TestClient(app) as client:
        service = app.state.compute
        assert client.get(f"/api/v1/models/{MODEL}").status_code == 200  # loads the model
        loads = service.stats.completed
        urls = (
            f"/models/{MODEL}/heads/L1H2",
            f"/api/v1/models/{MODEL}/heads",
            f"/api/v1/models/{MODEL}/composition?kind=V",
            f"/api/v1/models/{MODEL}/heads/L1H2/ov",
            f"/models/{MODEL}/composition",
        )
        for url in urls:
            assert client.get(url).status_code == 200, url
        # the panels the head page loads after itself (the copying panel), asked as htmx asks them
        panels = lazy_panels(client.get(urls[0]).text)
        assert panels, "the head page names no lazy panel: this check would test nothing"
        for src, target in panels:
            assert client.get(src, headers={"HX-Request": "true", "HX-Target": target}).status_code == 200, src
        assert service.stats.completed == loads  # every answer came from the store
        assert service.store is not None and service.store.hits == len(urls) + len(
            panels
        )  # one stored answer (or page) each

    assert main([MODEL, "--heads", "L1H2"]) == 0
    again, hits = figures(capsys.readouterr().out)
    assert again == 0 and hits >= 8  # everything was stored: a rerun computes nothing


def test_the_copying_overview_is_assembled_from_the_head_panels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a vocabulary over FULL_ROWS_MAX tokens with more than 16 heads the overview samples fewer rows per head than
    a head's panel: precompute asks the panels first and the overview reads its rows off their entries, so each circuit
    (every head, the baseline's random ones) is measured once. The stored overview equals one computed cold."""
    import torch

    import app.views.copying as copying_view
    from circuits_core.model.config import ModelConfig
    from tests.app.conftest import save_qkov, train_tokenizer
    from tests.app.test_copying_shared import counting_circuits

    cfg = ModelConfig(
        n_layers=2,
        d_model=8,
        n_heads=9,
        d_head=4,
        d_vocab=copying_view.FULL_ROWS_MAX + 100,
        n_ctx=16,
        positional_embedding_type="shortformer",
    )
    save_qkov(tmp_path / "models" / "wide", cfg, train_tokenizer(), seed=5)
    n_heads = cfg.n_layers * cfg.n_heads
    overview_rows, panel_rows = (copying_view.default_rows(cfg.d_vocab, None, n) for n in (n_heads, 1))
    assert overview_rows is not None and panel_rows is not None and overview_rows < panel_rows  # (else: one key)
    env = {
        "QKOV_STORE_URL": "disk",
        "QKOV_STORE_DIR": str(tmp_path / "store"),
        "QKOV_SHIPPED_DIR": str(tmp_path / "models"),
        "QKOV_DTYPE": "float64",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    calls = counting_circuits(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["wide"]) == 0
    finally:
        torch.set_num_threads(before)  # process-wide: the later tests keep theirs
    assert "assembled pages and panels" in capsys.readouterr().out
    assert (
        len(calls) == n_heads + copying_view.N_TOP_SAMPLES
    )  # each circuit once: the panels' rows, read by the overview

    with TestClient(create_app(Settings())) as client:
        stored = client.get("/api/v1/models/wide/copying").json()
        assert client.app.state.compute.store.hits == 1  # type: ignore[attr-defined]
    with TestClient(create_app(Settings(store_url="off"))) as client:
        cold = client.get("/api/v1/models/wide/copying").json()
    assert stored["n_rows"] == cold["n_rows"] == overview_rows
    assert [h["head"] for h in stored["heads"]] == [h["head"] for h in cold["heads"]]
    for got, want in zip(stored["heads"], cold["heads"], strict=True):
        assert {k: v for k, v in got.items() if k != "head"} == pytest.approx(
            {k: v for k, v in want.items() if k != "head"}, rel=1e-12, abs=1e-12
        )
    assert stored["baseline"] == pytest.approx(cold["baseline"], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("model", ["toy-1l", "toy-2l"])
def test_precompute_asks_only_the_pages_that_apply_to_the_model(model: str) -> None:
    """The pages precompute crawls are those the model's navigation offers: each answers (200, or 202 for a job),
    none is refused; toy-1l (one attention layer) has no composition page, and neither toy (attention-only) an MLP's
    expert table, which answered 422 to every crawl and was timed by the store benchmark as a page."""
    app = create_app(Settings(store_url="off"))
    with TestClient(app) as client:
        wide, per_head = page_urls(app, model)
        assert not any("expert" in url for url in wide)
        assert any(url.endswith("/composition") for url in wide) is (model == "toy-2l")
        head = "L0H0"
        for url in [*wide, *(u.replace("{head}", head) for u in per_head)]:
            assert client.get(url).status_code in (200, 202), url
