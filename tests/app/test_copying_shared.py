"""The copying panel of each head page (/copying?heads=<head>) shares what does not depend on the head (issue 13:
precompute fills 144 such panels on GPT-2): the random baseline is computed once per (weights, k, samples, rows,
tokens) and the eigenvalue scores come from the cached spectra of all heads. Checked against the engine called
directly (float64): the same baseline and scores as an uncached computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

import app.views.copying as copying_view
from app.main import create_app
from app.settings import Settings
from circuits_core import circuits, copying
from circuits_core.weights import load_checkpoint
from tests.app.conftest import LIMITS


def test_one_baseline_for_every_heads_panel(model_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    inner = copying.random_baseline

    def counted(*args: object, **kwargs: object) -> copying.CopyingBaseline:
        calls.append(1)
        return inner(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(copying_view.copying, "random_baseline", counted)
    settings = Settings(shipped_dir=model_dirs[0], models_dir=model_dirs[1], dtype="float64", store_url="off", limits=LIMITS)
    with TestClient(create_app(settings)) as c:
        answers = [c.get("/api/v1/models/tiny-2l/copying", params={"heads": h, "samples": 20}).json() for h in ("L0H1", "L1H3")]
    assert len(calls) == 1  # the second panel reused the first's baseline
    assert answers[0]["baseline"] == answers[1]["baseline"]

    model = load_checkpoint(model_dirs[0] / "tiny-2l", dtype=torch.float64).model
    n = model.cfg.d_vocab
    base = inner(model, n_samples=20, n_top_samples=copying_view.N_TOP_SAMPLES, k=10, rows=copying_view.default_rows(n, None, 1),
                 budget_bytes=LIMITS.matrix_budget_bytes)
    assert answers[0]["baseline"]["ov_copying_mean"] == pytest.approx(float(base.ov_copying.mean()), rel=1e-12)
    assert answers[0]["baseline"]["top1_mean"] == pytest.approx(float(base.top1.mean()), rel=1e-12)
    scores = circuits.ov_copying_scores(model)  # [L, H], straight from the weights
    assert answers[0]["heads"][0]["ov_copying"] == pytest.approx(float(scores[0, 1]), abs=1e-12)
    assert answers[1]["heads"][0]["ov_copying"] == pytest.approx(float(scores[1, 3]), abs=1e-12)
