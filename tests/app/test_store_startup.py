"""The server starts without its result store when the store cannot be opened, and says so on /readyz and in the
log: a corrupt cache.db, a store folder that cannot be created (a file in the way, as on a read-only root)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from tests.app.conftest import LIMITS


def _serve(model_dirs: tuple[Path, Path], store_dir: Path, caplog: pytest.LogCaptureFixture) -> tuple[dict, int]:
    shipped, user = model_dirs
    settings = Settings(
        shipped_dir=shipped, models_dir=user, dtype="float64", limits=LIMITS, store_url="disk", store_dir=store_dir
    )
    with caplog.at_level(logging.ERROR, logger="qkov"), TestClient(create_app(settings)) as client:
        ready = client.get("/readyz").json()
        answered = client.get("/api/v1/models/tiny-2l/heads/L0H0").status_code
    return ready, answered


def test_a_corrupt_cache_db_leaves_the_server_running_without_the_store(model_dirs, tmp_path, caplog):
    store = tmp_path / "store"
    store.mkdir()
    (store / "cache.db").write_bytes(b"this is not an SQLite database" * 100)
    ready, answered = _serve(model_dirs, store, caplog)
    assert answered == 200
    assert ready["store"]["ok"] is False and "running without the result store" in ready["store"]["detail"]
    assert any("running without the result store" in r.getMessage() for r in caplog.records)


def test_a_store_folder_that_cannot_be_created_leaves_the_server_running(model_dirs, tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the store's parent folder should be")
    ready, answered = _serve(model_dirs, blocker / "store", caplog)
    assert answered == 200
    assert ready["store"]["ok"] is False and "NotADirectoryError" in ready["store"]["detail"]
