"""The paper's 2-D view of induction ("Checking the Mechanistic Theory"): each later head's OV copying score against
the positivity of its K-composition term with the previous-token head, and the rule that names that head.

The induction head and its previous-token head come from the heads table on the standard input (app/views/heads.py):
the strongest induction head of layers >= 1, and the strongest previous-token head below it; each must score at
least HEAD_THRESHOLD (model_summary's rule for listing a head as one), so no figure or sentence calls a head an
induction or previous-token head that is none. The positivity is sum(eig)/sum(|eig|) of the token circuit
W_E W_Q^h W_K^{hT} (W_V^{p} W_O^{p})^T W_E^T of head h with the previous-token head p (circuits_core/prompt/qk_paths.py).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from app.analysis import Analysis
from app.params import NoParams
from app.schemas import HeadScores
from app.settings import Limits
from app.views.heads import build_heads_view, heads_cost
from app.views.page_claims import strongest
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.config import parse_head
from circuits_core.prompt.model_summary import HEAD_THRESHOLD
from circuits_core.prompt.qk_paths import k_composition_positivity, positivity_cost


class PositivityPoint(BaseModel):
    head: str = Field(description="L{layer}H{head}, a head of a layer above the previous-token head's")
    ov_copying: float | None = Field(description="eigenvalue copying score sum(eig)/sum(|eig|) of the full OV circuit")
    k_composition_positivity: float = Field(
        description="sum(eig)/sum(|eig|) of the K-composition token circuit with the previous-token head"
    )


class PositivityView(BaseModel):
    previous_token_head: str = Field(description="the previous-token head the K-composition term reads")
    points: list[PositivityPoint]


# The head scores of the last models seen: one tour asks for them in 7 figures per model (detector runs).
HEADS_SEEN: dict[int, tuple[LoadedModel, list[HeadScores]]] = {}


def heads_seen(loaded: LoadedModel) -> list[HeadScores]:
    seen = HEADS_SEEN.get(id(loaded))
    if seen is None or seen[0] is not loaded:  # the model object itself is kept, so its id cannot be reused
        if len(HEADS_SEEN) >= 8:
            HEADS_SEEN.clear()
        seen = HEADS_SEEN[id(loaded)] = (loaded, build_heads_view(loaded).heads)
    return seen[1]


def induction_pair(loaded: LoadedModel) -> tuple[str, str]:
    """(the strongest previous-token head of a layer below the strongest induction head, that induction head) on the
    standard input. Each must score at least HEAD_THRESHOLD (model_summary's rule for listing a head as one), so no
    figure or sentence calls a head an induction or previous-token head that is none."""
    heads = heads_seen(loaded)
    if loaded.model.cfg.n_layers < 2:
        raise InvalidInputError("induction needs at least 2 layers")
    induction = strongest(heads, "induction", range(1, loaded.model.cfg.n_layers))
    if induction is None:
        raise InvalidInputError("no head of layers >= 1 has an induction score on the standard input")
    if (induction.induction or 0.0) < HEAD_THRESHOLD:
        raise InvalidInputError(
            f"no induction head: the strongest, {induction.head}, scores {induction.induction:.2f} "
            f"(< {HEAD_THRESHOLD}) on the standard input"
        )
    prev = strongest(heads, "previous_token", range(0, induction.layer))
    if prev is None:
        raise InvalidInputError(f"no head below the induction head {induction.head} has a previous-token score")
    if (prev.previous_token or 0.0) < HEAD_THRESHOLD:
        raise InvalidInputError(
            f"no previous-token head below the induction head {induction.head}: the strongest, "
            f"{prev.head}, scores {prev.previous_token:.2f} (< {HEAD_THRESHOLD}) on the standard input"
        )
    return prev.head, induction.head


def build_positivity_view(loaded: LoadedModel, p: NoParams, limits: Limits) -> PositivityView:
    prev, _ = induction_pair(loaded)
    model = loaded.model
    layer, h = parse_head(prev, model.cfg)
    weights = model.W_Q.new_zeros(model.cfg.n_layers, model.cfg.n_heads)
    weights[layer, h] = 1.0
    qk = k_composition_positivity(model, weights)  # [L, H]
    points = [
        PositivityPoint(head=s.head, ov_copying=s.ov_copying, k_composition_positivity=float(qk[s.layer, s.index]))
        for s in heads_seen(loaded)
        if s.layer > layer
    ]
    return PositivityView(previous_token_head=prev, points=points)


def positivity_view_cost(loaded: LoadedModel, p: NoParams, limits: Limits) -> Cost:
    """The heads table (when not cached), then the positivity of every head with the previous-token head."""
    return heads_cost(loaded, p, limits).then(positivity_cost(loaded.model))


POSITIVITY = Analysis(
    name="positivity",
    path="positivity",
    params=NoParams,
    view=PositivityView,
    build=build_positivity_view,
    cost=positivity_view_cost,
    summary="OV copying vs K-composition positivity with the previous-token head",
    tags=["heads"],
    needs_layers=2,
)
