"""`python -m app.precompute` fills the store under the server's own keys: afterwards the head page and its
API twins are answered without computing (no computation besides loading the model), and a second run
computes nothing: what is stored is not computed again, so an interrupted run resumes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.precompute import lazy_panels, main
from app.settings import REPO_ROOT, Settings

MODEL = "toy-2l"


def figures(out: str) -> tuple[int, int]:
    match = re.search(r"(\d+) computations, (\d+) answers already in the disk store", out)
    assert match is not None, out
    return int(match[1]), int(match[2])


def test_precomputed_tables_are_store_hits_and_a_rerun_skips_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    env = {"QKOV_STORE_URL": "disk", "QKOV_STORE_DIR": str(tmp_path / "store"), "QKOV_SHIPPED_DIR": str(REPO_ROOT / "checkpoints")}
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
        urls = (f"/models/{MODEL}/heads/L1H2", f"/api/v1/models/{MODEL}/heads", f"/api/v1/models/{MODEL}/composition?kind=V",
                f"/api/v1/models/{MODEL}/heads/L1H2/ov", f"/models/{MODEL}/composition")
        for url in urls:
            assert client.get(url).status_code == 200, url
        # the panels the head page loads after itself (the copying panel), asked as htmx asks them
        panels = lazy_panels(client.get(urls[0]).text)
        assert panels, "the head page names no lazy panel: this check would test nothing"
        for src, target in panels:
            assert client.get(src, headers={"HX-Request": "true", "HX-Target": target}).status_code == 200, src
        assert service.stats.completed == loads  # every answer came from the store
        assert service.store is not None and service.store.hits == len(urls) + len(panels)  # one stored answer (or page) each

    assert main([MODEL, "--heads", "L1H2"]) == 0
    again, hits = figures(capsys.readouterr().out)
    assert again == 0 and hits >= 8  # everything was stored: a rerun computes nothing
