"""The HTML dashboard: the models page and a model's overview (plain routes), and the pages of the analyses:
one, head and detectors here, engine-2 analyses in pages_analyses.py, the tour in pages_tour.py (PAGES).

A page is declared as `Page(analysis, template, context)` (app/routers/rendering.py): its route, params
(the analysis's, or a page model extending them), JSON-twin link and frame are derived; its context runs
analyses through `call.run` (priced, cached like their API routes), turns views into chart figures with
app/charts.py and hands them to the template. Never circuits_core, never tensors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import Field
from starlette.types import Scope

from app import charts
from app.analysis import API, json_url, run
from app.deps import LimitsDep, LoadedModelDep, ModelEntryDep, RegistryDep, get_model
from app.params import (
    DEFAULT_VOCAB,
    DetectorParams,
    DirectParams,
    HeadParams,
    K,
    NoParams,
    Offset,
    OVParams,
    QKParams,
    SkipTrigramParams,
)
from app.routers import pages_analyses, pages_tour
from app.routers.api import models_view
from app.routers.pages_rotary import head_rotary_context, rotary_enabled
from app.routers.rendering import (
    Page,
    PageCall,
    applies,
    attempt,
    basis_choice,
    cached_page,
    html_page,
    is_fragment,
    keep_page,
    model_nav,
    page_context,
    page_key,
    refusal,
    render,
    url,
)
from app.scheduling import JobPending
from app.schemas import CircuitTopView, HeadScores, HeadsView, HeadView
from app.views.basis import basis
from app.views.circuits import DIRECT, OV, QK, SKIP_TRIGRAMS, has_token_counts
from app.views.composition import head_partners
from app.views.detectors import DETECTORS
from app.views.heads import HEAD, HEADS
from app.views.model_summary import summary_from_heads
from app.views.models import build_model_view
from app.views.page_claims import loss_sentence, rare_entries_sentence, scatter_sentence
from app.views.tour_figures import positivity_scatter
from circuits_core.errors import QkovError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.config import ModelConfig, all_heads, head_name, parse_head
from circuits_core.prompt.phenomena import MIN_TRAIN_COUNT

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


class CachedStaticFiles(StaticFiles):
    """Static files with cache headers: versioned vendor files are immutable for a year; our own css/js
    are revalidated on each load (ETag -> 304), so a change is seen at once."""

    def file_response(self, full_path: Any, stat_result: Any, scope: Scope, status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        immutable = "/vendor/" in str(scope.get("path", ""))
        response.headers["Cache-Control"] = "public, max-age=31536000, immutable" if immutable else "no-cache"
        return response


# The page's "tokens" picker: every token, or those seen at least N times in training (the API's min_count).
MIN_COUNT_CHOICES = (50, 200, 500, 1000, 2000)


def heads_grid(loaded: LoadedModel, heads: list[HeadScores], score: str, model_id: str) -> dict[str, Any]:
    """The overview heatmap: layers x heads of one score; a click opens the head."""
    cfg = loaded.model.cfg
    label, signed = SCORES[score]
    z: list[list[float | None]] = [[None] * cfg.n_heads for _ in range(cfg.n_layers)]
    names = [[head_name(layer, h) for h in range(cfg.n_heads)] for layer in range(cfg.n_layers)]
    for s in heads:
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
        text_in_cells=cfg.n_layers * cfg.n_heads <= 64,
        height=max(220, 70 * cfg.n_layers + 120),
    )


async def composition_partners(call: PageCall, name: str, top: int = 6) -> list[dict[str, Any]]:
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


router = APIRouter(include_in_schema=False)


@router.get("/")
async def models_page(request: Request, registry: RegistryDep) -> Response:
    view = await models_view(registry)
    ctx = await page_context(request, registry, "Models", f"{API}/models")
    return render(request, "models.html", {**ctx, "view": view})


# Query parameters the model picker carries to another model: they mean the same there (token ids,
# positions and token strings may not, so they are left behind; head names are kept when the head exists).
KEPT_ON_SWITCH = ("prompt", "k", "max_order", "weighted", "kind", "score", "seq_len", "batch", "seed", "offset")
HEAD_PARAMS = ("head", "heads", "source", "target")


def switched(here: str, old: str, cfg: ModelConfig, model: str, views: dict[str, str], view: str) -> str:
    """The URL of the page `here` (a path + query on model `old`) for `model`: the same view, the state that
    still applies; a head page whose head the model lacks, or a view it lacks, falls back to its overview."""
    parts = urlsplit(here)
    prefix = f"/models/{old}"
    base = f"/models/{quote(model, safe='')}"
    sub = (
        parts.path[len(prefix) :]
        if parts.path == prefix or parts.path.startswith(prefix + "/")
        else views.get(view, "")
    )
    segments = [s for s in sub.split("/") if s]
    if segments[:1] == ["heads"] and len(segments) >= 2 and not all(has_head(h, cfg) for h in segments[1:2]):
        sub = ""
    if segments[:1] == ["composition"] and len(segments) >= 3 and not all(has_head(h, cfg) for h in segments[1:3]):
        sub = "/composition"
    if not applies(view, cfg.n_layers) and sub == views.get(view, ""):
        sub = ""
    query: dict[str, str] = {}
    for key, value in parse_qsl(parts.query):
        if key in KEPT_ON_SWITCH:
            query[key] = value
        elif key in HEAD_PARAMS:
            kept = [h for h in value.split(",") if has_head(h.strip(), cfg)]
            if kept:
                query[key] = ",".join(kept)
    return url(base + sub, **query)


def has_head(name: str, cfg: ModelConfig) -> bool:
    try:
        parse_head(name, cfg)
        return True
    except QkovError:
        return False


@router.get("/go")
async def go(
    request: Request,
    registry: RegistryDep,
    model: str = Query(..., max_length=128),
    view: str = Query("overview", max_length=32),
    here: str = Query("", max_length=8192),
) -> Response:
    """The model picker (a GET form): to the same view of the chosen model, keeping the state that applies
    there (`here` is the page it was used on: its prompt, and its head when the new model has it)."""
    views = dict((k, s) for k, _, s in model_nav(request))
    loaded = await get_model(model, registry)
    old = urlsplit(here).path.split("/")[2] if here.startswith("/models/") and here.count("/") >= 2 else ""
    target = (
        switched(here, unquote(old), loaded.model.cfg, model, views, view)
        if old
        else f"/models/{quote(model, safe='')}{views.get(view, '')}"
    )
    return RedirectResponse(target, status_code=303)


@router.get("/models/{model}")
async def overview_page(
    request: Request,
    registry: RegistryDep,
    loaded: LoadedModelDep,
    entry: ModelEntryDep,
    limits: LimitsDep,
    score: str = Query("induction", pattern="^(" + "|".join(SCORES) + ")$"),
) -> Response:
    key = await page_key(request, registry, loaded, "/models/{model}")
    if (body := await cached_page(request, key)) is not None:
        return html_page(body)
    summary = build_model_view(loaded, entry)
    try:  # the model's facts show at once; a heads table priced over the inline budget shows its job's progress
        heads: HeadsView | None = await run(HEADS, loaded, entry.id, NoParams(), limits)
        heads_job = None
    except JobPending as exc:
        heads, heads_job = None, refusal(exc)
    ctx = await page_context(request, registry, entry.id, json_url(HEADS, entry.id, NoParams()), entry.id, "overview")
    fig = heads_grid(loaded, heads.heads, score, entry.id) if heads is not None and heads.heads else None
    scatter, scatter_claim, scatter_error = None, None, None
    if heads is not None and loaded.model.cfg.n_layers >= 2 and not is_fragment(request):
        data, scatter_error = await attempt(
            lambda: positivity_scatter(loaded, limits)[0], key=(entry.id, loaded.digest, "positivity")
        )
        if data:
            pts = data["points"]
            scatter = charts.scatter(
                [p["ov_copying"] or 0.0 for p in pts],
                [p["k_composition_positivity"] for p in pts],
                [p["head"] for p in pts],
                title=f"OV copying vs K-composition positivity with previous-token head {data['previous_token_head']}",
                x_title="OV copying score (Σλ/Σ|λ|)",
                y_title="K-composition positivity",
                links=[f"/models/{entry.id}/heads/{p['head']}" for p in pts],
            )
            scatter_claim = scatter_sentence(pts, heads)
    response = render(
        request,
        "overview.html",
        {
            **ctx,
            "summary": summary,
            "heads": heads,
            "score": score,
            "scores": SCORES,
            "fig": fig,
            "scatter": scatter,
            "scatter_claim": scatter_claim,
            "served_basis": basis(loaded),
            "scatter_refused": scatter_error["detail"] if scatter_error and scatter_error["status"] == 422 else None,
            "card_fig": training_curve(summary.card),
            "measured": summary_from_heads(loaded, heads)
            if heads is not None and heads.heads and not summary.card
            else None,
            "heads_job": heads_job,
        },
        blocks=("heads_panel",),
    )
    settled = scatter is not None or (
        scatter_error is not None and scatter_error["status"] == 422
    )  # computed, or refused for good
    if heads_job is not None:
        response.status_code = 202  # not kept: the next visit shows the table
    elif response.status_code == 200 and (settled or loaded.model.cfg.n_layers < 2 or is_fragment(request)):
        await keep_page(request, key, bytes(response.body))  # not a page whose scatter failed this time (busy, timeout)
    return response


# -- one head: its spectra and its circuits ---------------------------------------------------------------------
class HeadPageParams(OVParams):
    k: K = 10
    offset: Offset = 0  # rotary models: the QK tables at this query-key offset


async def head_context(call: PageCall) -> dict[str, Any]:
    p: HeadPageParams = call.params
    cfg, name, model = call.model.model.cfg, p.head, call.model_id
    fragment_only = is_fragment(call.request) and call.request.headers.get("HX-Target") == "circuits"
    view: HeadView | None = None if fragment_only else await call.run(HEAD, HeadParams(head=name))
    b, v = p.basis, p.vocab  # every table of the circuits panel on the weights (issue 12.2) and token set chosen
    ov: CircuitTopView = await call.run(
        OV, OVParams(head=name, token=p.token, k=p.k, min_count=p.min_count, basis=b, vocab=v)
    )
    qk_q: CircuitTopView = await call.run(
        QK,
        QKParams(
            head=name, token=p.token, k=p.k, side="query", min_count=p.min_count, offset=p.offset, basis=b, vocab=v
        ),
    )
    qk_k = None
    if p.token is not None:
        qk_k = await call.run(
            QK,
            QKParams(
                head=name, token=p.token, k=p.k, side="key", min_count=p.min_count, offset=p.offset, basis=b, vocab=v
            ),
        )
    skip = await call.run(
        SKIP_TRIGRAMS,
        SkipTrigramParams(head=name, token=p.token, k=p.k, min_count=p.min_count, offset=p.offset, basis=b, vocab=v),
    )
    partners = await composition_partners(call, name) if view is not None else []
    every_head = [head_name(*pair) for pair in all_heads(cfg)]
    i = every_head.index(name)
    call.json_params = HeadParams(head=name)
    return {
        "head": name,
        "view": view,
        "ov": ov,
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
        **basis_choice(call),
        **(await head_rotary_context(call, name) if view is not None else {"rotary": None}),
    }


# -- the direct path ----------------------------------------------------------------------------------------------
class DirectPageParams(DirectParams):
    """The direct page: min_count absent means frequent tokens where the model has training counts (issue 12.3),
    'all' means every token."""

    min_count: Annotated[
        Annotated[int, Field(ge=1, le=10**9)] | Literal["all"] | None,
        Field(
            description=f"tokens seen at least this often in training; 'all': every token (default {MIN_TRAIN_COUNT} where the "
            "model has token counts)"
        ),
    ] = None  # type: ignore[assignment]


def direct_min_count(call: PageCall, asked: int | str | None) -> int | None:
    """The min_count the direct page uses: as asked, 'all' -> None, absent -> MIN_TRAIN_COUNT where there are counts."""
    if asked is None:
        return MIN_TRAIN_COUNT if has_token_counts(call.model) else None
    return None if asked == "all" else int(asked)


async def direct_context(call: PageCall) -> dict[str, Any]:
    p: DirectPageParams = call.params
    shown = direct_min_count(call, p.min_count)
    vocab = "all" if p.min_count == "all" else p.vocab  # the picker's 'all' ranks every token, a large vocabulary's too
    params = DirectParams(token=p.token, k=p.k, basis=p.basis, min_count=shown, vocab=vocab)
    call.json_params = params
    view: CircuitTopView = await call.run(DIRECT, params)
    fig = None
    if view.token is not None:
        fig = charts.bars(
            [charts.visible(e.col.text) for e in view.entries],
            [e.value for e in view.entries],
            horizontal=True,
            title=f"top next tokens after {charts.visible(view.token.text)} (W_E W_U row)",
            height=max(260, 22 * len(view.entries) + 80),
        )
    has_counts = has_token_counts(call.model)
    return {
        "view": view,
        "token": p.token,
        "k": p.k,
        "fig": fig,
        "max_k": call.limits.max_k,
        "rare_claim": rare_entries_sentence(call.model, view.entries, MIN_TRAIN_COUNT)
        if view.token is None and shown is None
        else None,
        "min_count": shown if shown is not None else ("all" if has_counts else None),
        "has_counts": has_counts,
        "default_min_count": MIN_TRAIN_COUNT if has_counts else None,
        "min_count_choices": MIN_COUNT_CHOICES,
        "vocab": vocab if vocab == "all" and call.model.model.cfg.d_vocab > DEFAULT_VOCAB else None,
        "n_vocab": call.model.model.cfg.d_vocab,
        "default_vocab": DEFAULT_VOCAB,
        **basis_choice(call),
    }


# -- detectors ----------------------------------------------------------------------------------------------------
async def detectors_context(call: PageCall) -> dict[str, Any]:
    p: DetectorParams = call.params  # normalised: seq_len is the standard input fitted to the model when not given
    view = await call.run(DETECTORS, p)
    return {
        "view": view,
        "figs": detector_charts(view, call.model_id or ""),
        "seq_len": p.seq_len,
        "batch": p.batch,
        "claim": loss_sentence(view.loss.first_repeat, view.loss.second_repeat),
        "seed": p.seed,
        "prompt": p.prompt,
        "heads": p.heads,
    }


def detector_charts(view: Any, model_id: str) -> dict[str, Any]:
    """Per-head detector scores, the per-position loss and the attention pattern of each selected head."""
    names = [s.head for s in view.heads]
    series = {
        SCORES[k][0]: [getattr(s, k) or 0.0 for s in view.heads]
        for k in ("previous_token", "duplicate_token", "induction", "current_token", "first_token")
    }
    figs: dict[str, Any] = {
        "scores": charts.grouped_bars(names, series, title="detector scores per head", y_title="score")
    }
    labels = charts.unique_labels([charts.visible(t.text) for t in view.tokens])
    positions = list(range(len(view.loss.loss)))
    seg = view.detector_input.seq_len
    marks = [seg + (view.detector_input.bos is not None) - 0.5] if seg else []
    figs["loss"] = charts.lines(
        positions,
        {"loss (nats)": view.loss.loss},
        title="next-token loss by position (mean over the batch)",
        x_title="position",
        y_title="loss",
        vlines=marks,
    )
    figs["patterns"] = [
        (
            hp.head,
            charts.heatmap(
                hp.pattern,
                labels,
                labels,
                title=f"{hp.head} attention (first sequence)",
                x_title="key",
                y_title="query",
                signed=False,
                zmax=1.0,
                hover="query %{y}<br>key %{x}<br>%{z:.3f}",
                colorbar="attention",
                height=420,
                digits=3,
            ),
        )
        for hp in view.patterns
    ]
    return figs


PAGES: list[Page] = [
    Page(
        HEAD,
        "head.html",
        head_context,
        params=HeadPageParams,
        blocks=("circuits",),
        title="{head} · {model}",
        nav="overview",
    ),
    Page(
        DIRECT,
        "direct.html",
        direct_context,
        params=DirectPageParams,
        blocks=("direct_panel",),
        title="Direct path · {model}",
    ),
    Page(DETECTORS, "detectors.html", detectors_context, blocks=("detectors_panel",), title="Detectors · {model}"),
    *pages_analyses.PAGES,
    *pages_tour.PAGES,
]
