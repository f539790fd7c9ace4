"""The tour's chapter loop (app/tour/chapter.py) on toy-2l with measures written here: figures in order, each
measured once without gradients and told what an earlier one found; a QkovError makes only its figure unavailable,
with the error's text; a missing model makes every figure unavailable, naming the model and the hint; a figure's
claim chart is written to the JSON only when it draws one."""

from __future__ import annotations

from pathlib import Path

import torch

from app.registry import ModelRegistry
from app.settings import Settings
from app.tour.chapter import ChapterFigure, Measured, chapter_figures
from app.tour.paper_claims import FigureClaim
from circuits_core.errors import QkovError
from circuits_core.formats.checkpoint import LoadedModel
from tests.app.conftest import LIMITS

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


class LayerCount(FigureClaim):
    n: int


FIGURES = [ChapterFigure(f"T{i}", f"title {i}", f"https://paper#{i}", f"Look at {i}.") for i in range(3)]


def registry(shipped: Path) -> ModelRegistry:
    return ModelRegistry(Settings(shipped_dir=shipped, models_dir=shipped / "none", dtype="float64", limits=LIMITS))


def test_figures_are_measured_in_order_and_a_failure_stays_its_own() -> None:
    seen: list[str] = []

    def measure(fig: ChapterFigure, loaded: LoadedModel) -> Measured:
        assert not torch.is_grad_enabled()
        seen.append(fig.id)
        if fig.id == "T1":
            raise QkovError(f"nothing to measure after {seen[0]}")
        chart = "logit_by_order" if fig.id == "T2" else None
        n_layers = loaded.model.cfg.n_layers
        return Measured(
            f"{n_layers} layers", LayerCount(n=n_layers), f"/models/toy-2l/{fig.id}", f"/api/{fig.id}", chart
        )

    figures = chapter_figures(registry(CHECKPOINTS), "toy-2l", FIGURES, measure)
    assert seen == ["T0", "T1", "T2"] and [f.id for f in figures] == ["T0", "T1", "T2"]
    t0, t1, t2 = (f.model_dump(mode="json") for f in figures)
    assert t0 == {
        "id": "T0", "title": "title 0", "anchor": "https://paper#0", "look_for": "Look at 0. Measured: 2 layers",
        "model": "toy-2l", "link": "/models/toy-2l/T0", "api": "/api/T0", "available": True, "detail": None,
        "data": {"claim": {"n": 2}},  # no claim_chart key: T0 draws none
    }  # fmt: skip
    assert t1 == {
        "id": "T1", "title": "title 1", "anchor": "https://paper#1", "look_for": "Look at 1.", "model": "toy-2l",
        "link": None, "api": None, "available": False, "detail": "nothing to measure after T0", "data": None,
    }  # fmt: skip
    assert t2["available"] and t2["data"] == {"claim": {"n": 2}, "claim_chart": "logit_by_order"}


def test_a_missing_model_makes_every_figure_unavailable_and_says_how_to_get_it(tmp_path: Path) -> None:
    def measure(fig: ChapterFigure, loaded: LoadedModel) -> Measured:
        raise AssertionError("never measured without the model")

    figures = chapter_figures(registry(tmp_path), "toy-2l", FIGURES, measure, hint="make models")
    assert [f.available for f in figures] == [False, False, False]
    for f in figures:
        assert f.detail is not None and f.detail.startswith("model 'toy-2l' is not available (make models): ")
        assert f.data is None and f.link is None and f.look_for == f"Look at {f.id[1]}."
