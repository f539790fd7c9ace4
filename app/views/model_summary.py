"""The model summary of any model, computed on first use (circuits_core/prompt/model_summary.py's figures).

`make smollm2` writes model_summary.json beside SmolLM2's weights; any other model, and SmolLM2 dropped as a bare
GGUF folder, had none. Here the same summary (repeat losses, induction and previous-token heads, the heads that
matter) is read off the heads table (app/views/shared/heads_table.py: one detector pass on the standard input, which
also gives the next-token losses on both copies of r), so it costs no pass of its own, and is kept in the result store
with every other answer.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, Field

from app.analysis import Analysis, build_cached, cache_key
from app.params import NoParams
from app.scheduling import is_cached
from app.schemas import HeadsView, ModelRef
from app.settings import Limits
from app.views.shared.heads_table import HEADS, heads_cost
from app.views.shared.inputs import model_ref
from circuits_core.cost import FREE, Cost
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.prompt.model_summary import summarise


class ScoredHead(BaseModel):
    head: str
    score: float


class ModelSummaryView(BaseModel):
    model: ModelRef
    basis: str = Field(description="the input the figures are measured on, in words")
    loss_first_copy: float | None = Field(description="mean next-token loss (nats) on the first copy of r")
    loss_second_copy: float | None = Field(description="the same on the second copy")
    head_threshold: float = Field(description="a head is listed as an induction / previous-token head from this score")
    induction_heads: list[ScoredHead] = Field(
        description="heads with induction score >= head_threshold, strongest first"
    )
    previous_token_heads: list[ScoredHead] = Field(description="the same for the previous-token score")
    induction_head: str | None = Field(description="the heads that matter (heads_rule): the induction head")
    previous_token_head: str | None = Field(description="the heads that matter (heads_rule): its previous-token head")
    heads_rule: str | None = Field(description="how the heads that matter are chosen, used by every page's defaults")
    sentences: list[str]
    stored: str = Field(description="where this summary comes from")


def _scores(loaded: LoadedModel, heads: HeadsView, name: str) -> torch.Tensor:
    """[L, H] float64 scores (NaN where a head has none) from the heads view."""
    cfg = loaded.model.cfg
    out = torch.full((cfg.n_layers, cfg.n_heads), float("nan"), dtype=torch.float64)
    for h in heads.heads:
        value = getattr(h, name)
        if value is not None:
            out[h.layer, h.index] = value
    return out


def summary_from_heads(loaded: LoadedModel, heads: HeadsView) -> ModelSummaryView:
    meta = heads.detector_input
    basis = (
        f"measured on BOS + r + r, r = {meta.seq_len} token ids drawn uniformly from all {loaded.model.cfg.d_vocab}, "
        f"{meta.batch} sequences, seed {meta.seed} (the heads table's standard input)"
    )
    first, second = heads.loss_first_copy, heads.loss_second_copy
    found = summarise(
        _scores(loaded, heads, "induction"),
        _scores(loaded, heads, "previous_token"),
        first or float("nan"),
        second or float("nan"),
        basis,
    )
    return ModelSummaryView(
        model=model_ref(loaded),
        basis=basis,
        loss_first_copy=first,
        loss_second_copy=second,
        head_threshold=found["head_threshold"],
        induction_heads=[ScoredHead(**h) for h in found["induction_heads"]],
        previous_token_heads=[ScoredHead(**h) for h in found["previous_token_heads"]],
        induction_head=heads.induction_head,
        previous_token_head=heads.previous_token_head,
        heads_rule=heads.heads_rule,
        sentences=found["sentences"] if first is not None and second is not None else found["sentences"][1:],
        stored="computed on first use from the heads table and kept in the result store with the other answers",
    )


def build_model_summary(loaded: LoadedModel, p: NoParams, limits: Limits) -> ModelSummaryView:
    return summary_from_heads(loaded, build_cached(HEADS, loaded, loaded.path.name, NoParams(), limits))


def model_summary_cost(loaded: LoadedModel, p: NoParams, limits: Limits) -> Cost:
    """The heads table when it is not computed yet; else nothing (the summary is read off it)."""
    if is_cached(cache_key(HEADS, loaded.path.name, loaded, NoParams())):
        return FREE.with_answer(numbers=4 * loaded.model.cfg.n_layers * loaded.model.cfg.n_heads)
    return heads_cost(loaded, p, limits)


MODEL_SUMMARY = Analysis(
    name="summary",
    path="summary",
    params=NoParams,
    view=ModelSummaryView,
    build=build_model_summary,
    cost=model_summary_cost,
    summary="Measured summary: repeat losses, induction and previous-token heads, the heads that matter",
    tags=["heads"],
)
