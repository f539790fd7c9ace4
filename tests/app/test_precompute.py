"""`python -m app.precompute` fills the store under the server's own keys: afterwards the head page and its
API twins are answered without computing (no computation besides loading the model), and a second run
resumes by skipping what is there."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.precompute import main
from app.settings import REPO_ROOT, Settings

MODEL = "toy-2l"


def test_precomputed_tables_are_store_hits_and_a_rerun_skips_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    env = {"QKOV_STORE_URL": "disk", "QKOV_STORE_DIR": str(tmp_path / "store"), "QKOV_SHIPPED_DIR": str(REPO_ROOT / "checkpoints")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main([MODEL, "--heads", "L1H2"]) == 0
    first = capsys.readouterr().out
    assert "0 already in the disk store" in first
    computed = int(first.split(": ")[1].split(" tables")[0])
    assert computed >= 8  # heads table, Q/K/V composition, the head's view, OV/QK at two k, skip-trigrams

    app = create_app(Settings())
    with TestClient(app) as client:
        service = app.state.compute
        assert client.get(f"/api/v1/models/{MODEL}").status_code == 200  # loads the model
        loads = service.stats.completed
        for url in (f"/models/{MODEL}/heads/L1H2", f"/api/v1/models/{MODEL}/heads", f"/api/v1/models/{MODEL}/composition?kind=V",
                    f"/api/v1/models/{MODEL}/heads/L1H2/ov"):
            assert client.get(url).status_code == 200, url
        assert service.stats.completed == loads  # every table came from the store
        assert service.store is not None and service.store.hits >= 8

    assert main([MODEL, "--heads", "L1H2"]) == 0
    assert capsys.readouterr().out.startswith(f"{MODEL}: 0 tables computed, {computed} already in the disk store")
