"""The data of a tour figure, typed: one optional field per kind of data a figure carries (a view's answer, the
values its sentence measured, what to draw), so the builders (figures.py, the chapters) and the page that draws
them (routers/pages_tour.py) agree on names and types instead of on dict keys.

A figure sets only the fields it has; the JSON twin lists exactly those (a field left unset is not written, one set
to None is), so a figure's JSON reads as the figure's data and nothing else.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializationInfo, SerializerFunctionWrapHandler, model_serializer

from app.schemas import CircuitTopView, DetectorsView, PositionalQK, SkipTrigramView, TokenRef
from app.schemas.analyses import (
    ChainView,
    CompositionPairView,
    CompositionView,
    PathsView,
    PromptView,
    QKPathsView,
    TermImportanceView,
)
from app.views.positivity import PositivityPoint

# The chart a chapter's figure draws from its sentence's values (claim): the SmolLM2 chapter's R1, R2, R3.
ClaimChart = Literal["induction_heads", "logit_by_order", "score_terms"]


class NextTokenEffect(BaseModel):
    """F23: a head's direct effect on the logit of each position's actual next token."""

    head: str
    tokens: list[TokenRef]
    effects: list[float] = Field(description="[n - 1]: position p's effect on the logit of tokens[p + 1]")
    second_copy_start: int = Field(description="first position of the prompt's second copy (n - 1: none)")


class TourData(BaseModel):
    """What one tour figure shows; every field is optional, a figure sets the ones it has."""

    direct: CircuitTopView | None = None
    ov: CircuitTopView | None = None
    qk: CircuitTopView | None = None
    min_count: int | None = Field(default=None, description="the training-count floor of the tokens shown")
    skip_trigrams: SkipTrigramView | None = None
    share: float | None = Field(default=None, description="share of frequent tokens that raise their own logit most")
    paths: PathsView | None = None
    head: str | None = None
    positional: PositionalQK | None = None
    eigenvalues: dict[str, list[tuple[float, float]]] | None = Field(
        default=None, description="each head's OV eigenvalues as (real, imaginary)"
    )
    ov_copying: dict[str, float | None] | None = None
    self_copy: dict[str, Any] | None = None
    baseline: dict[str, Any] | None = None
    qk_paths: QKPathsView | None = None
    Q: CompositionView | None = None
    K: CompositionView | None = None
    V: CompositionView | None = None
    prompt: PromptView | None = None
    induction_head: str | None = None
    induction_mass: float | None = None
    induction_weighted_mass: float | None = None
    induction_rows: int | None = None
    next_token_effect: NextTokenEffect | None = None
    detectors: DetectorsView | None = None
    pair: CompositionPairView | None = None
    previous_token_head: str | None = None
    points: list[PositivityPoint] | None = None
    term_importance: TermImportanceView | None = None
    token_ids: list[int] | None = None
    first_order_by_layer: list[float] | None = None
    loss_by_order: list[float] | None = None
    path: ChainView | None = Field(default=None, description="a chain of heads: the figure draws its pattern")
    claim: dict[str, Any] | None = Field(default=None, description="the values the figure's sentence measured")
    claim_chart: ClaimChart | None = Field(default=None, description="the chart drawn from the claim's values")

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        return {k: v for k, v in dumped.items() if k in self.model_fields_set}

    def compositions(self) -> list[CompositionView]:
        """The Q-, K- and V-composition views the figure has, in that order."""
        return [c for c in (self.Q, self.K, self.V) if c is not None]


class TourFigure(BaseModel):
    id: str = Field(description="figure id of docs/maths.md §3, e.g. F21")
    title: str
    anchor: str = Field(description="link to the paper section")
    look_for: str = Field(description="what to look for, in one sentence")
    model: str | None
    link: str | None = Field(description="the dashboard URL of the full view")
    api: str | None = Field(description="the JSON API URL of the data")
    available: bool
    detail: str | None = Field(default=None, description="why the figure could not be computed")
    data: TourData | None


class TourView(BaseModel):
    models: dict[str, bool] = Field(description="the shipped models the tour uses, and whether each is available")
    figures: list[TourFigure]
