"""The paper's 2-D view of induction ("Checking the Mechanistic Theory"): each later head's OV copying score against
the positivity of its K-composition term with the previous-token head, and the rule that names that head.

The induction head and its previous-token head come from the heads table on the standard input (app/views/heads.py):
the heads that matter (circuits_core.prompt.detectors.heads_that_matter: the strongest induction head of layers >= 1,
and the strongest previous-token head below it); each must score at least HEAD_THRESHOLD (model_summary's rule for
listing a head as one), so no figure or sentence calls a head an induction or previous-token head that is none. The
positivity is sum(eig)/sum(|eig|) of the token circuit W_E W_Q^h W_K^{hT} (W_V^{p} W_O^{p})^T W_E^T of head h with
the previous-token head p (circuits_core/prompt/qk_paths.py), the heads table's qk_k_composition column.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from app import snippets
from app.analysis import Analysis, build_cached, cache_key
from app.params import NoParams
from app.scheduling import is_cached
from app.schemas import DetectorInput, HeadScores, HeadsView
from app.schemas.common import ModelRef, QKFormed
from app.settings import Limits
from app.views.shared.heads_table import HEADS, heads_cost
from app.views.shared.inputs import model_ref, qk_form_fields
from circuits_core.cost import FREE, Cost
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import parse_head
from circuits_core.prompt.model_summary import HEAD_THRESHOLD


class PositivityPoint(BaseModel):
    head: str = Field(description="L{layer}H{head}, a head of a layer above the previous-token head's")
    ov_copying: float | None = Field(description="eigenvalue copying score sum(eig)/sum(|eig|) of the full OV circuit")
    k_composition_positivity: float = Field(
        description="sum(eig)/sum(|eig|) of the K-composition token circuit with the previous-token head"
    )


class PositivityView(QKFormed):
    model: ModelRef
    previous_token_head: str = Field(
        description="the strongest previous-token scorer below the induction head: the K-composition term reads it"
    )
    previous_token_score: float = Field(description="its previous-token score on the standard input")
    threshold: float = Field(description="the score from which model_summary names a head a previous-token head")
    points: list[PositivityPoint]
    detector_input: DetectorInput | None = Field(
        default=None, description="the heads table's input (BOS + r + r) its scores, and so these points, come from"
    )


def heads_view(loaded: LoadedModel) -> HeadsView:
    """The heads table (detector and copying scores, the heads that matter), from the result cache when there: the
    overview, this view and every tour figure read the same answer instead of running the detectors again."""
    return build_cached(HEADS, loaded, loaded.path.name, NoParams(), Limits())


def heads_seen(loaded: LoadedModel) -> list[HeadScores]:
    return heads_view(loaded).heads


def partner_of_induction(loaded: LoadedModel) -> tuple[str, str, float]:
    """(partner, induction head, the partner's previous-token score): the heads that matter
    (detectors.heads_that_matter, the heads view's previous_token_head and induction_head) on the standard input. The
    induction head must score at least HEAD_THRESHOLD (model_summary's rule for listing a head as one); its partner,
    the strongest previous-token-scoring head below it, is returned with its score whatever it is, for the positivity
    view to label it."""
    if loaded.model.cfg.n_layers < 2:
        raise InvalidInputError("induction needs at least 2 layers")
    view = heads_view(loaded)
    by_name = {h.head: h for h in view.heads}
    induction = by_name.get(view.induction_head or "")
    prev = by_name.get(view.previous_token_head or "")
    if induction is None or prev is None:
        raise InvalidInputError("no head of layers >= 1 has an induction score on the standard input")
    if (induction.induction or 0.0) < HEAD_THRESHOLD:
        raise InvalidInputError(
            f"no induction head: the strongest, {induction.head}, scores {induction.induction:.2f} "
            f"(< {HEAD_THRESHOLD}) on the standard input"
        )
    return prev.head, induction.head, prev.previous_token or 0.0


def induction_pair(loaded: LoadedModel) -> tuple[str, str]:
    """(previous-token head, induction head): partner_of_induction, where the partner must also score at least
    HEAD_THRESHOLD, so no figure or sentence calls a head an induction or previous-token head that is none."""
    prev, induction, score = partner_of_induction(loaded)
    if score < HEAD_THRESHOLD:
        raise InvalidInputError(
            f"no previous-token head below the induction head {induction}: the strongest, "
            f"{prev}, scores {score:.2f} (< {HEAD_THRESHOLD}) on the standard input"
        )
    return prev, induction


def build_positivity_view(loaded: LoadedModel, p: NoParams, limits: Limits) -> PositivityView:
    """Every later head's (OV copying, K-composition positivity with the previous-token head that matters): the heads
    table's own qk_k_composition column, which is measured against that head."""
    prev, _, score = partner_of_induction(loaded)
    layer = parse_head(prev, loaded.model.cfg)[0]
    points = [
        PositivityPoint(head=s.head, ov_copying=s.ov_copying, k_composition_positivity=s.qk_k_composition)
        for s in heads_seen(loaded)
        if s.layer > layer and s.qk_k_composition is not None
    ]
    return PositivityView(
        model=model_ref(loaded),
        **qk_form_fields(loaded, "weight"),  # the K-composition positivity
        previous_token_head=prev,
        previous_token_score=score,
        threshold=HEAD_THRESHOLD,
        points=points,
        detector_input=heads_view(loaded).detector_input,
    )


def partner_label(view: PositivityView) -> str:
    """How a figure names the head the K-composition term reads: a previous-token head only from the threshold up."""
    if view.previous_token_score >= view.threshold:
        return f"previous-token head {view.previous_token_head}"
    return (
        f"{view.previous_token_head} (previous-token score {view.previous_token_score:.2f}, below the "
        f"{view.threshold} that names a previous-token head)"
    )


def positivity_view_cost(loaded: LoadedModel, p: NoParams, limits: Limits) -> Cost:
    """The heads table when it is not computed yet (the points are read off it), else only the answer."""
    answer = FREE.with_answer(numbers=2 * loaded.model.cfg.n_layers * loaded.model.cfg.n_heads)
    return (
        answer if is_cached(cache_key(HEADS, loaded.path.name, loaded, NoParams())) else heads_cost(loaded, p, limits)
    )


POSITIVITY = Analysis(
    name="positivity",
    path="positivity",
    params=NoParams,
    view=PositivityView,
    build=build_positivity_view,
    cost=positivity_view_cost,
    summary="OV copying vs K-composition positivity with the previous-token head",
    snippet=snippets.positivity_body,
    tags=["heads"],
    needs_layers=2,
)
