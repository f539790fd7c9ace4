"""The pages of a model's heads: the overview (the model's summary, the heads table as a heatmap, the paper's 2-D
view of induction) and one head (its spectra, its circuits, the heads it composes with). Pages (rendering.py),
listed in app/routers/pages.py PAGES."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal, TypedDict

from pydantic import Field

from app import charts, snippets
from app.analysis import Analysis
from app.charts import Figure
from app.figure_output import MAX_HEIGHT
from app.head_filter import FilterText, HeadFilter, labelled_heads
from app.params import (
    DEFAULT_VOCAB,
    HeadParams,
    K,
    NoParams,
    Offset,
    OVParams,
    QKParams,
    SkipTrigramParams,
)
from app.routers.pages_rotary import HeadRotary, HeadRotaryContext, head_rotary_context, rotary_enabled
from app.routers.rendering import (
    PageCall,
    Refusal,
    attempt,
    is_fragment,
    refusal,
)
from app.scheduling import cheap
from app.scheduling.flights import JobPending
from app.schemas import CircuitTopView, HeadScores, HeadsView, HeadView, ModelSummary, SkipTrigramView
from app.views.circuits import OV, QK
from app.views.composition import head_partners
from app.views.heads import HEAD
from app.views.latent import latent_head_panel
from app.views.model_summary import ModelSummaryView, summary_from_heads
from app.views.models import build_model_view
from app.views.positivity import POSITIVITY, partner_label
from app.views.shared.basis import basis
from app.views.shared.heads_table import HEADS
from app.views.shared.page_claims import scatter_sentence
from app.views.shared.token_sets import has_token_counts
from app.views.skip_trigrams import SKIP_TRIGRAMS
from circuits_core.circuits.profile_shape import near_edge
from circuits_core.circuits.rotary import KERNEL_WINDOW
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import all_heads, head_name

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

POSITIONAL_SHOWN = 64  # first positions drawn in the positional QK heatmap (the JSON twin has them all)

# The page's "tokens" picker: every token, or those seen at least N times in training (the API's min_count).
MIN_COUNT_CHOICES = (50, 200, 500, 1000, 2000)


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


async def composition_partners(call: PageCall[Any], name: str, top: int = 6) -> list[dict[str, Any]]:
    """The heads this head composes with most (Q, K, V; score minus baseline): only the pairs naming it
    (views.composition.head_partners), not every pair of the model."""
    if call.loaded is None or call.loaded.model.cfg.n_layers < 2:
        return []
    loaded = call.loaded
    rows, _ = await attempt(
        head_partners, loaded, name, top, key=(loaded.path.name, loaded.digest, "partners", name, top)
    )
    return rows or []


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


def head_charts(view: HeadView) -> dict[str, Any]:
    figs: dict[str, Any] = {
        "ov_eig": charts.complex_scatter(
            [(c.re, c.im) for c in view.ov_eigenvalues],
            title=f"OV eigenvalues of W_E W_OV W_U · copying {view.scores.ov_copying:+.3f}"
            if view.scores.ov_copying is not None
            else "OV eigenvalues",
        ),
        "qk_eig": charts.complex_scatter(
            [(c.re, c.im) for c in view.qk_eigenvalues],
            title=f"QK eigenvalues of W_E W_QK W_E^T · {view.scores.qk_copying:+.3f}"
            if view.scores.qk_copying is not None
            else "QK eigenvalues",
        ),
        "svals": charts.grouped_bars(
            [str(i) for i in range(len(view.ov_singular_values))],
            {"W_OV": view.ov_singular_values, "W_QK": view.qk_singular_values},
            title="singular values of W_OV and W_QK",
            x_title="index",
        ),
    }
    if view.positional is not None:
        n = min(view.positional.n_positions, POSITIONAL_SHOWN)
        figs["positional"] = charts.heatmap(
            [row[:n] for row in view.positional.pattern[:n]],
            [str(i) for i in range(n)],
            [str(i) for i in range(n)],
            digits=3,
            title="softmax(W_pos W_QK W_pos^T / √d_head), causal",
            x_title="key position",
            y_title="query position",
            signed=False,
            zmax=1.0,
            hover="query %{y} → key %{x}<br>%{z:.3f}",
            colorbar="attention",
        )
    return figs


# -- a model's overview: its summary, the heads table and the paper's 2-D view of induction -------------------------
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


# -- one head: its spectra and its circuits ---------------------------------------------------------------------
class HeadPageParams(OVParams):
    k: K = 10
    offset: Offset = 0  # rotary models: the QK tables at this query-key offset


class HeadContext(TypedDict):
    """templates/head.html: one head's spectra (view) and its circuit tables (OV, QK from both sides, skip-trigrams)
    on the chosen weights and tokens, its composition partners, the rotary and latent panels where they apply, and
    the pickers' state."""

    head: str
    view: HeadView | None  # None on an htmx request for the circuits panel only
    ov: CircuitTopView
    ov_snippet: str
    qk_q: CircuitTopView
    qk_k: CircuitTopView | None  # the key side, when a token is given
    skip: SkipTrigramView
    token: str | None
    k: int
    figs: dict[str, Any]  # head_charts
    max_k: int
    partners: list[dict[str, Any]]  # composition_partners
    prev_head: str | None
    next_head: str | None
    base_url: str
    min_count: int | None
    has_counts: bool
    min_count_choices: tuple[int, ...]
    offset: int | None  # the QK tables' offset δ (None: 0)
    is_rotary: bool
    n_ctx: int
    vocab: Literal["all"] | None  # "all" only where it differs from the default
    n_vocab: int
    default_vocab: int
    rotary: HeadRotary | None
    latent: dict[str, Any] | None  # latent_head_panel


async def head_context(call: PageCall[HeadPageParams]) -> HeadContext:
    p = call.params
    cfg, name, model = call.model.model.cfg, p.head, call.model_id
    fragment_only = is_fragment(call.request) and call.request.headers.get("HX-Target") == "circuits"
    view: HeadView | None = None if fragment_only else await call.run(HEAD, HeadParams(head=name))
    b, v = p.basis, p.vocab  # every table of the circuits panel on the weights and token set chosen

    async def query_and_key() -> tuple[CircuitTopView | None, CircuitTopView]:
        qk_k = None
        if p.token is not None:  # first: the QK snippet offered is the query side's, run last
            qk_k = await call.run(
                QK,
                QKParams(
                    head=name, token=p.token, k=p.k, side="key", min_count=p.min_count, offset=p.offset, basis=b,
                    vocab=v,
                ),
            )  # fmt: skip
        qk_q: CircuitTopView = await call.run(
            QK,
            QKParams(
                head=name, token=p.token, k=p.k, side="query", min_count=p.min_count, offset=p.offset, basis=b, vocab=v
            ),
        )
        return qk_k, qk_q

    async def no_partners() -> list[dict[str, Any]]:
        return []

    async def no_rotary() -> HeadRotaryContext:
        return {"rotary": None}

    # The panels are independent once the view answered (a view still computing answers 202 before any of them
    # starts): asked at once, they take both compute slots when both are free, instead of one after the other. Each
    # is awaited to its end (answers are kept for the next visit), then the first failure, in the panels' order, is
    # the page's, as when they ran in turn.
    done = await asyncio.gather(
        call.run(OV, OVParams(head=name, token=p.token, k=p.k, min_count=p.min_count, basis=b, vocab=v)),
        query_and_key(),
        call.run(
            SKIP_TRIGRAMS,
            SkipTrigramParams(
                head=name, token=p.token, k=p.k, min_count=p.min_count, offset=p.offset, basis=b, vocab=v
            ),
        ),
        composition_partners(call, name) if view is not None else no_partners(),
        head_rotary_context(call, name) if view is not None else no_rotary(),
        return_exceptions=True,
    )
    for part in done:
        if isinstance(part, BaseException):
            raise part
    ov, (qk_k, qk_q), skip, partners, rotary = done
    entry = await cheap(call.registry.entry, model or "")
    ov_snippet = snippets.ov_table(
        entry.path,
        str(call.registry.dtype).removeprefix("torch."),
        name,
        ov.k,
        ov.token_ids,  # the token set the table ranked, as the view ranked it
        None if ov.token is None else ov.token.id,
        raw=p.basis == "raw",
    )
    every_head = [head_name(*pair) for pair in all_heads(cfg)]
    i = every_head.index(name)
    call.json_params = HeadParams(head=name)
    return {
        "head": name,
        "view": view,
        "ov": ov,
        "ov_snippet": ov_snippet,
        "qk_q": qk_q,
        "qk_k": qk_k,
        "skip": skip,
        "token": p.token,
        "k": p.k,
        "figs": head_charts(view) if view is not None else {},
        "max_k": call.limits.max_k,
        "partners": partners,
        "prev_head": every_head[i - 1] if i > 0 else None,
        "next_head": every_head[i + 1] if i + 1 < len(every_head) else None,
        "base_url": f"/models/{model}/heads/{name}",
        "min_count": p.min_count,
        "has_counts": has_token_counts(call.model),
        "min_count_choices": MIN_COUNT_CHOICES,
        "offset": p.offset or None,
        "is_rotary": rotary_enabled(call),
        "n_ctx": cfg.n_ctx,
        "vocab": p.vocab if p.vocab == "all" and cfg.d_vocab > DEFAULT_VOCAB else None,
        "n_vocab": cfg.d_vocab,
        "default_vocab": DEFAULT_VOCAB,
        "rotary": rotary["rotary"],
        "latent": latent_head_panel(call.model, name, view.latent) if view is not None else None,
    }
