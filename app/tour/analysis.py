"""The paper tour declared (app/tour/tour.py computes it): the one analysis over the server's models, a
`ServerAnalysis` keyed by the digests of the models its chapter reads."""

from __future__ import annotations

from app.analysis import ServerAnalysis
from app.params import TourParams
from app.registry import ModelRegistry
from app.settings import Limits
from app.tour.figure_data import TourView
from app.tour.tour import build_tour_view, digest_or_dash, tour_models
from app.tour.tour import tour_cost as tour_view_cost
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
