"""Work a page needs, shared with what was computed already: the detectors page on the standard input reads the
heads table's scores and losses (one detector pass, with the repeat losses) and runs only its first sequence for the
patterns it shows. The shared answer must equal the one computed from scratch, in float64."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings

DETECTOR_FIELDS = ("previous_token", "induction", "duplicate_token", "current_token", "first_token")


def test_detectors_after_the_heads_table_equal_detectors_from_scratch() -> None:
    settings = Settings(store_url="off", dtype="float64", models_dir=None)
    with TestClient(create_app(settings)) as alone:
        fresh = alone.get("/api/v1/models/toy-2l/detectors").json()
    with TestClient(create_app(settings)) as c:
        c.get("/api/v1/models/toy-2l/heads").raise_for_status()
        shared = c.get("/api/v1/models/toy-2l/detectors").json()
        other_seed = c.get("/api/v1/models/toy-2l/detectors", params={"seed": 1}).json()
    assert shared["detector_input"] == fresh["detector_input"] and shared["selected"] == fresh["selected"]
    for a, b in zip(shared["heads"], fresh["heads"], strict=True):
        assert a["head"] == b["head"]
        for name in DETECTOR_FIELDS:
            assert a[name] == pytest.approx(b[name], abs=1e-9), (a["head"], name)
    assert shared["loss"]["loss"][:-1] == pytest.approx(fresh["loss"]["loss"][:-1], abs=1e-9)
    assert shared["loss"]["first_repeat"] == pytest.approx(fresh["loss"]["first_repeat"], abs=1e-9)
    assert shared["loss"]["second_repeat"] == pytest.approx(fresh["loss"]["second_repeat"], abs=1e-9)
    for a, b in zip(shared["patterns"], fresh["patterns"], strict=True):
        assert a["head"] == b["head"]
        for row_a, row_b in zip(a["pattern"], b["pattern"], strict=True):
            assert row_a == pytest.approx(row_b, abs=1e-12)
    assert other_seed["tokens"] != fresh["tokens"]  # another input is not taken from the table
