"""OV effective rank of every head (circuits_core/circuits/ov_effective_rank.py): page and JSON."""

from __future__ import annotations

from pydantic import BaseModel, Field

from app import snippets
from app.analysis import Analysis
from app.page_spec import PerHeadPage
from app.params import NoParams
from app.schemas import ModelRef
from app.settings import Limits
from app.views.shared.inputs import model_ref
from circuits_core.circuits import ov_effective_rank
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel


class OVEffectiveRankView(BaseModel):
    model: ModelRef
    d_head: int = Field(description="the largest possible rank of a head's W_V W_O")
    group_size: int = Field(description="query heads per key/value head (1 without grouped-query attention)")
    ranks: list[list[float]] = Field(
        description="[layer][head] (sum sigma^2)^2 / sum sigma^4 over the singular values of the head's W_V W_O "
        "(its key/value group's W_V), weights as served: 1 to d_head, 0 for a zero circuit"
    )


def build_ov_effective_rank_view(loaded: LoadedModel, p: NoParams, limits: Limits) -> OVEffectiveRankView:
    return OVEffectiveRankView(
        model=model_ref(loaded),
        d_head=loaded.model.cfg.d_head,
        group_size=loaded.model.cfg.group_size,
        ranks=ov_effective_rank.ov_effective_ranks(loaded.model).tolist(),  # [L, H]
    )


def ov_effective_rank_cost(loaded: LoadedModel, p: NoParams, limits: Limits) -> Cost:
    return ov_effective_rank.cost(loaded.model)


OV_EFFECTIVE_RANK = Analysis(
    name="ov-effective-rank",
    path="ov-effective-rank",
    params=NoParams,
    view=OVEffectiveRankView,
    build=build_ov_effective_rank_view,
    cost=ov_effective_rank_cost,
    summary="OV effective rank of every head",
    snippet=snippets.ov_effective_rank_body,
    tags=["circuits"],
    needs_layers=1,
    weights="attention",
    page=PerHeadPage(
        values="ranks",
        title="OV effective rank",
        explanation="The participation ratio (Σσ²)² / Σσ⁴ of the singular values σ of each head's OV circuit W_V W_O "
        "(d_model × d_model, rank at most d_head; computed from its factors, never formed; under grouped-query "
        "attention each query head reads its key/value group's W_V): 1 when one direction carries the whole circuit, "
        "d_head when all its directions are equally strong.",
        quantity="effective rank (Σσ²)² / Σσ⁴ of W_V W_O",
        nav=120,
    ),
)
