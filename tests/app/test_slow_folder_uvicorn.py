"""A slow user folder never holds up the listing, `/` or /readyz: a real uvicorn on 127.0.0.1 whose loader takes
60 s for the folder "slow" and whose format detection (reading config.json) takes 60 s for "slowconfig" (the server
process wraps app.registry.load_checkpoint and detect_format with a sleep for those folders, as a folder on a slow
disk or holding a hostile file would be). Each of the three answers within a few seconds (they used
to wait for the load: a minute here), naming both as loading, while the folder beside it is listed and ready; the
slow model's own route still waits for its load.

Also, with the app's registry alone: a load refused by the memory watchdog is retried after `load_retry_s` although
the folder is unchanged (any other failure is remembered until the folder changes)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from app.registry import ModelRegistry
from app.settings import Settings
from bench.server import free_port
from circuits_core.errors import CheckpointError
from circuits_core.formats import checkpoint as checkpoint_module
from circuits_core.formats.load_watchdog import LoadMemoryExceeded
from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from tests.app.live_server import start

pytestmark = pytest.mark.xdist_group("uvicorn")
TINY = ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=64, n_ctx=16, attn_only=True)
SLOW_S = 60.0
ANSWER_WITHIN_S = 5.0  # the listing waits 0.5 s for user folders; the rest is a shared 2-core machine's latency

SERVER = """
import os, sys, time
from pathlib import Path
import uvicorn
import app.registry as registry
real = registry.load_checkpoint
def slow(folder, **options):
    if Path(folder).name == "slow":
        time.sleep(float(os.environ["SLOW_S"]))
    return real(folder, **options)
registry.load_checkpoint = slow
real_detect = registry.detect_format
def slow_detect(folder):
    if Path(folder).name == "slowconfig":
        time.sleep(float(os.environ["SLOW_S"]))
    return real_detect(folder)
registry.detect_format = slow_detect
from app.main import create_app
from app.settings import Settings
uvicorn.run(create_app(Settings()), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def _folders(root: Path) -> tuple[Path, Path]:
    shipped, models = root / "shipped", root / "models"
    shipped.mkdir()
    for name in ("good", "slow", "slowconfig"):
        save_checkpoint(random_model(TINY, seed=0, dtype=torch.float32), models / name)
    return shipped, models


def test_a_slow_folder_is_listed_as_loading_and_holds_nothing_up(tmp_path):
    shipped, models = _folders(tmp_path)
    port = free_port()
    env = {
        "QKOV_SHIPPED_DIR": str(shipped),
        "QKOV_MODELS_DIR": str(models),
        "QKOV_STORE_URL": "off",
        "QKOV_LISTING_WAIT_S": "0.5",
        "SLOW_S": str(SLOW_S),
    }
    proc = start(["-c", SERVER, str(port)], port, env)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=SLOW_S / 2) as client:
            for _ in range(40):  # "good" loads in the background too; the listing answers at once meanwhile
                start_s = time.monotonic()
                listed = client.get("/api/v1/models")
                assert listed.status_code == 200 and time.monotonic() - start_s < ANSWER_WITHIN_S
                if listed.json():
                    break
                time.sleep(0.25)
            answers = {}
            for path in ("/api/v1/models", "/api/v1/unavailable-models", "/readyz", "/"):
                start_s = time.monotonic()
                answers[path] = client.get(path)
                took = time.monotonic() - start_s
                assert answers[path].status_code == 200, (path, answers[path].text[:300])
                assert took < ANSWER_WITHIN_S, (path, took)
            assert [m["id"] for m in answers["/api/v1/models"].json()] == ["good"]
            unavailable = answers["/api/v1/unavailable-models"].json()
            assert [(u["id"], u["state"]) for u in unavailable] == [("slow", "loading"), ("slowconfig", "loading")]
            ready = answers["/readyz"].json()
            assert ready["status"] == "ready"
            assert ready["models"] == {"good": "ok", "slow": "loading", "slowconfig": "loading"}
            page = answers["/"].text
            assert "slow" in page and "loading" in page
            # The slow model's own route waits for its load (under way in the background since the listing).
            with pytest.raises(httpx.ReadTimeout):
                client.get("/api/v1/models/slow", timeout=2.0)
            assert client.get("/healthz").status_code == 200
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_load_the_watchdog_refused_is_retried_after_a_while(tmp_path, monkeypatch):
    shipped, models = _folders(tmp_path)
    calls: list[str] = []
    real = checkpoint_module.load_checkpoint

    def refused_once(folder, **options):
        calls.append(Path(folder).name)
        if len(calls) == 1:
            raise LoadMemoryExceeded("good: loading it grew the process by 900 MiB, over its limit")
        if len(calls) == 3:
            raise CheckpointError("config.json: not a known checkpoint format")
        return real(folder, **options)

    monkeypatch.setattr("app.registry.load_checkpoint", refused_once)
    registry = ModelRegistry(Settings(shipped_dir=shipped, models_dir=models, store_url="off", load_retry_s=0.5))
    with pytest.raises(CheckpointError, match="over its limit"):
        registry.get("good")
    with pytest.raises(CheckpointError, match="over its limit"):
        registry.get("good")  # remembered for now: no second load
    assert calls == ["good"]
    time.sleep(0.6)
    assert registry.get("good").model.cfg.d_model == TINY.d_model  # retried once due, though unchanged
    assert calls == ["good", "good"]
    # Any other failure is remembered until the folder changes, however long it waits.
    registry = ModelRegistry(Settings(shipped_dir=shipped, models_dir=models, store_url="off", load_retry_s=0.5))
    with pytest.raises(CheckpointError, match="not a known checkpoint format"):
        registry.get("good")
    time.sleep(0.6)
    with pytest.raises(CheckpointError, match="not a known checkpoint format"):
        registry.get("good")
    assert calls == ["good", "good", "good"]
