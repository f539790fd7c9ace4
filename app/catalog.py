"""Every declared analysis (app/analysis.py), in the order of the API docs. An analysis is declared beside its
builder in app/views/<topic>.py and listed here once; create_app derives its routes from this list."""

from __future__ import annotations

from typing import Any

from app.analysis import Declared, ServerAnalysis
from app.params import TourParams
from app.registry import ModelRegistry
from app.settings import Limits
from app.tour.figure_data import TourView
from app.tour.tour import build_tour_view, digest_or_dash, tour_models
from app.tour.tour import tour_cost as tour_view_cost
from app.views import circuits, composition, detectors, heads, models, path, prompt, qk_paths, rotary, term_importance
from app.views.attention_entropy import ATTENTION_ENTROPY
from app.views.copying import COPYING_ALL
from app.views.model_summary import MODEL_SUMMARY
from app.views.positivity import POSITIVITY
from app.views.qk_circuit_norm import QK_CIRCUIT_NORM
from app.views.residual import RESIDUAL, RESIDUAL_PAIR
from app.views.residual_usage import RESIDUAL_USAGE
from app.views.shared.heads_table import HEADS
from app.views.skip_trigrams import SKIP_TRIGRAMS
from circuits_core.cost import Cost


def build_tour(registry: ModelRegistry, p: TourParams, limits: Limits) -> TourView:
    return build_tour_view(registry, limits, p.chapter)


def tour_cost(registry: ModelRegistry, p: TourParams, limits: Limits) -> Cost:
    """The tour's figures priced by the engine cost functions of what they compute (app.tour.tour.tour_cost)."""
    return tour_view_cost(registry, limits, p.chapter)


def tour_reads(registry: ModelRegistry, p: TourParams) -> tuple[str, ...]:
    """Each model the chapter reads, as `id=digest` (`id=-` when it is not available): the tour's cache key."""
    return tuple(f"{m}={digest_or_dash(registry, m)}" for m in tour_models(p.chapter))


TOUR = ServerAnalysis(
    name="tour",
    path="/tour",
    params=TourParams,
    view=TourView,
    build=build_tour,
    cost=tour_cost,
    reads=tour_reads,
    summary="The paper's figures on the shipped models",
    tags=["tour"],
)

ANALYSES: list[Declared[Any, Any]] = [
    models.TOKENIZE,
    HEADS,
    MODEL_SUMMARY,
    heads.HEAD,
    heads.COPYING,
    COPYING_ALL,
    POSITIVITY,
    circuits.OV,
    circuits.QK,
    SKIP_TRIGRAMS,
    circuits.DIRECT,
    detectors.DETECTORS,
    composition.COMPOSITION,
    composition.COMPOSITION_PAIR,
    prompt.PROMPT,
    prompt.PATHS,
    path.PATH,
    qk_paths.QK_PATHS,
    term_importance.TERM_IMPORTANCE,
    *rotary.ANALYSES,
    ATTENTION_ENTROPY,
    QK_CIRCUIT_NORM,
    RESIDUAL,
    RESIDUAL_USAGE,
    RESIDUAL_PAIR,
    TOUR,
]
