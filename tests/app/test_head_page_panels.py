"""A head page asks its panels (OV and QK tables, skip trigrams, composition partners) at once after its view, so
they take both compute slots instead of one after the other (what they show is checked in test_pages.py and
test_snippets.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.scheduling.service import ComputeService
from app.settings import Settings
from tests.app.conftest import LIMITS

HOLD_S = 0.3  # each computation held this long, so that two running at once overlap for certain


def test_the_head_page_panels_run_at_once(model_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    spans: list[tuple[float, float]] = []  # (start, end) of every computation's hold
    lock = threading.Lock()
    inner = ComputeService._call

    def held(self: ComputeService, *args: Any, **kwargs: Any) -> None:
        start = time.monotonic()
        time.sleep(HOLD_S)  # holding the computation's slot
        with lock:  # recorded before the computation settles: once it has, the page may answer at once
            spans.append((start, time.monotonic()))
        inner(self, *args, **kwargs)

    settings = Settings(
        shipped_dir=model_dirs[0], models_dir=model_dirs[1], dtype="float64", store_url="off", limits=LIMITS,
        compute_slots=2,
    )  # fmt: skip
    with TestClient(create_app(settings)) as c:
        c.get("/api/v1/models/tiny-2l/heads").raise_for_status()  # the heads table first (the view reads it)
        c.get("/api/v1/models/tiny-2l/heads/L1H2").raise_for_status()  # and the head's view
        monkeypatch.setattr(ComputeService, "_call", held)
        page = c.get("/models/tiny-2l/heads/L1H2")
        assert page.status_code == 200
    assert len(spans) >= 3  # the panels computed for the page (the view came from the cache)
    overlapping = sum(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans) for b0, b1 in spans[i + 1 :])
    assert overlapping >= 1  # two panels computed at the same time
