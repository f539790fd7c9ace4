"""The overview page of a model: its summary and model card, the heads table as a heatmap of one score (a click opens
the head), the table itself, and the paper's 2-D view of induction (OV copying against K-composition positivity with
the previous-token head). A Page (rendering.py), listed in app/routers/pages.py PAGES."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypedDict

from pydantic import Field

from app import charts
from app.analysis import Analysis
from app.charts import Figure
from app.figure_output import MAX_HEIGHT
from app.head_filter import FilterText, HeadFilter, labelled_heads
from app.params import NoParams
from app.routers.rendering import PageCall, Refusal, is_fragment, refusal
from app.scheduling import cheap
from app.scheduling.flights import JobPending
from app.schemas import HeadScores, HeadsView, ModelSummary
from app.views.model_summary import ModelSummaryView, summary_from_heads
from app.views.models import build_model_view
from app.views.positivity import POSITIVITY, partner_label
from app.views.shared.basis import basis
from app.views.shared.heads_table import HEADS
from app.views.shared.page_claims import scatter_sentence
from circuits_core.circuits.profile_shape import near_edge
from circuits_core.circuits.rotary import KERNEL_WINDOW
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name

# The head scores the overview heatmap can show: key -> (label, signed)
SCORES: dict[str, tuple[str, bool]] = {
    "induction": ("induction", False),
    "previous_token": ("previous token", False),
    "duplicate_token": ("duplicate token", False),
    "current_token": ("current token", False),
    "first_token": ("first token (BOS)", False),
    "ov_copying": ("OV copying (Σλ/Σ|λ|)", True),
    "qk_copying": ("QK copying (Σλ/Σ|λ|)", True),
}


def heads_grid(
    loaded: LoadedModel, heads: list[HeadScores], score: str, model_id: str, head_filter: HeadFilter | None = None
) -> dict[str, Any]:
    """The overview heatmap: layers x heads of one score, values in the cells when they fit; a click opens the
    head. With a head filter only the heads it keeps are coloured (the others are blank)."""
    cfg = loaded.model.cfg
    label, signed = SCORES[score]
    z: list[list[float | None]] = [[None] * cfg.n_heads for _ in range(cfg.n_layers)]
    names = [[head_name(layer, h) for h in range(cfg.n_heads)] for layer in range(cfg.n_layers)]
    for s in heads:
        if head_filter is None or head_filter.keeps(s):
            z[s.layer][s.index] = getattr(s, score)
    links = [[f"/models/{model_id}/heads/{n}" for n in row] for row in names]
    return charts.heatmap(
        z,
        [f"H{h}" for h in range(cfg.n_heads)],
        [f"L{layer}" for layer in range(cfg.n_layers)],
        title=f"{label} score per head (click a head to open it)",
        x_title="head",
        y_title="layer",
        signed=signed,
        zmax=1.0,
        customdata=names,
        hover="%{customdata}<br>" + label + " %{z:.3f}",
        links=links,
        colorbar=label,
        text_in_cells=charts.cells_fit(cfg.n_layers, cfg.n_heads),
        height=max(220, min(70 * cfg.n_layers + 120, MAX_HEIGHT)),
    )


def training_curve(card: dict[str, Any] | None) -> dict[str, Any] | None:
    """The model card's evaluation history as loss curves (train and validation loss against the step)."""
    history = (card or {}).get("history")
    if (
        not isinstance(history, list)
        or not all(isinstance(r, dict) and "step" in r for r in history)
        or len(history) < 2
    ):
        return None
    series = {
        name: [r.get(key) for r in history]
        for key, name in (("train_loss", "train loss"), ("val_loss", "validation loss"))
        if any(isinstance(r.get(key), (int, float)) for r in history)
    }
    if not series:
        return None
    return charts.lines(
        [r["step"] for r in history],
        series,
        title="training curve (model card history)",
        x_title="step",
        y_title="loss (nats)",
    )


class OverviewParams(NoParams):
    score: Literal[
        "induction", "previous_token", "duplicate_token", "current_token", "first_token", "ov_copying", "qk_copying"
    ] = Field("induction", description="the head score the heatmap shows")
    filter: FilterText = None  # of the grid, the table and the scatter


class OverviewContext(TypedDict):
    """templates/overview.html: the model's facts at once, then the heads table (or its job's progress) as a grid of
    one score, a table and the positivity scatter, each limited to the heads the filter keeps."""

    summary: ModelSummary
    heads: HeadsView | None  # None while its job runs (heads_error: 202)
    shown_heads: list[HeadScores]
    kernel_window: int
    kernel_edge: Callable[[int | None], bool]  # whether a kernel peak offset sits at the window's edge
    head_filter: str  # the filter as read ('' for none)
    filter_text: str | None  # as typed
    score: str  # the score the grid shows
    scores: dict[str, tuple[str, bool]]  # SCORES
    fig: Figure | None  # the grid
    scatter: Figure | None
    scatter_claim: str | None
    served_basis: str
    scatter_refused: str | None  # why the scatter is refused for good (422)
    card_fig: Figure | None  # the model card's training curve
    measured: ModelSummaryView | None  # the heads that matter measured here, for a model without a card
    heads_error: Refusal | None


async def overview_context(call: PageCall[OverviewParams]) -> OverviewContext:
    loaded, model_id, score = call.model, call.model_id or "", call.params.score
    head_filter = HeadFilter.parse(call.params.filter)  # 422 with the syntax when unreadable
    summary = build_model_view(loaded, await cheap(call.registry.entry, model_id))
    try:  # the model's facts show at once; a heads table priced over the inline budget shows its job's progress
        heads: HeadsView | None = await call.run(HEADS, NoParams())
        heads_error = None
    except JobPending as exc:  # status 202 (the page is not kept): the progress bar polls the job
        heads, heads_error = None, refusal(exc)
    call.title = model_id
    fig = heads_grid(loaded, heads.heads, score, model_id, head_filter) if heads is not None and heads.heads else None
    shown_heads = head_filter.apply(heads.heads) if heads is not None else []
    kept = {s.head for s in shown_heads}
    scatter, scatter_claim, refused = None, None, None
    if heads is not None and applies_to(POSITIVITY, loaded) and not is_fragment(call.request):
        view, scatter_error = await call.attempt(POSITIVITY, NoParams())
        if view is not None:
            pts = [p.model_dump() for p in view.points if p.head in kept]
            scatter = charts.scatter(
                [p["ov_copying"] or 0.0 for p in pts],
                [p["k_composition_positivity"] for p in pts],
                [p["head"] for p in pts],
                title=f"OV copying vs K-composition positivity with {partner_label(view)}",
                x_title="OV copying score (Σλ/Σ|λ|)",
                y_title="K-composition positivity",
                links=[f"/models/{model_id}/heads/{p['head']}" for p in pts],
                named=[*labelled_heads(heads.heads), *filter(None, (view.previous_token_head, heads.induction_head))],
            )
            scatter_claim = scatter_sentence([p.model_dump() for p in view.points], heads)
        elif scatter_error is not None and scatter_error["status"] == 422:
            refused = scatter_error["detail"]  # refused for good: the page says why
        else:
            call.keep = False  # failed this time (busy, timeout): the page is not kept without its scatter
    return {
        "summary": summary,
        "heads": heads,
        "shown_heads": shown_heads,
        "kernel_window": KERNEL_WINDOW,
        "kernel_edge": lambda offset: (
            offset is not None  # the kernel peak column flags a window edge (61..64)
            and KERNEL_WINDOW < loaded.model.cfg.n_ctx - 1
            and near_edge(offset, 0, KERNEL_WINDOW)
        ),
        "head_filter": str(head_filter),
        "filter_text": call.params.filter,
        "score": score,
        "scores": SCORES,
        "fig": fig,
        "scatter": scatter,
        "scatter_claim": scatter_claim,
        "served_basis": basis(loaded),
        "scatter_refused": refused,
        "card_fig": training_curve(summary.card),
        "measured": summary_from_heads(loaded, heads)
        if heads is not None and heads.heads and not summary.card
        else None,
        "heads_error": heads_error,
    }


def applies_to(analysis: Analysis[Any, Any], loaded: LoadedModel) -> bool:
    return loaded.model.cfg.n_layers >= analysis.needs_layers
