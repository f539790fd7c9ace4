"""The HTML dashboard: every page (PAGES, the one list: these with contexts of their own, then the pages analyses
declare; its labelled pages make a model's navigation, in their declared order),
the models listing and the model picker (plain routes: no analysis behind them), and the contexts of the direct path
and the detectors (the overview's is in pages_overview.py, one head's in pages_heads.py, the composition pages' in
pages_composition.py, the prompt page's in pages_prompt.py, the chain, QK paths and term importance pages' in
pages_analyses.py, the tour's in pages_tour.py).

A page is declared as `Page(analysis, template, context)` (app/routers/rendering.py): its route, params
(the analysis's, or a page model extending them), JSON-twin link and frame are derived; its context runs
analyses through `call.run` (priced, cached like their API routes), turns views into chart figures with
app/charts.py and hands them to the template. Never circuits_core, never tensors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypedDict
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import Field
from starlette.types import Scope

from app import charts, snippets
from app.analysis import API
from app.catalog import ANALYSES
from app.charts import Figure
from app.deps import RegistryDep, get_model
from app.head_filter import FilterText, HeadFilter
from app.labels import unique_labels, visible
from app.params import (
    DEFAULT_VOCAB,
    DetectorParams,
    DirectParams,
)
from app.routers import pages_analyses, pages_composition, pages_prompt, pages_tour
from app.routers.api import models_view
from app.routers.declared_pages import declared_pages
from app.routers.navigation import NavEntry, model_nav
from app.routers.pages_heads import MIN_COUNT_CHOICES, HeadPageParams, head_context
from app.routers.pages_overview import SCORES, OverviewParams, overview_context
from app.routers.rendering import Page, PageCall, page_context, render, url
from app.scheduling import cheap
from app.schemas import CircuitTopView, DetectorsView, HeadScores
from app.views.circuits import DIRECT
from app.views.detectors import DETECTORS
from app.views.heads import HEAD
from app.views.shared.heads_table import HEADS
from app.views.shared.page_claims import loss_sentence, rare_entries_sentence
from app.views.shared.token_sets import has_token_counts
from circuits_core.errors import QkovError
from circuits_core.model.config import ModelConfig
from circuits_core.model.head_names import parse_head
from circuits_core.prompt.phenomena import MIN_TRAIN_COUNT


class CachedStaticFiles(StaticFiles):
    """Static files with cache headers: versioned vendor files are immutable for a year; our own css/js
    are revalidated on each load (ETag -> 304), so a change is seen at once."""

    def file_response(self, full_path: Any, stat_result: Any, scope: Scope, status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        immutable = "/vendor/" in str(scope.get("path", ""))
        response.headers["Cache-Control"] = "public, max-age=31536000, immutable" if immutable else "no-cache"
        return response


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


def switched(here: str, old: str, cfg: ModelConfig, model: str, nav: list[NavEntry], view: str) -> str:
    """The URL of the page `here` (a path + query on model `old`) for `model`: the same view, the state that
    still applies; a head page whose head the model lacks, or a view it lacks, falls back to its overview."""
    views = {e.key: e.sub for e in nav}
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
    if not all(e.applies(cfg.n_layers, cfg.attn_only) for e in nav if e.key == view) and sub == views.get(view, ""):
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
    nav = model_nav(request)
    views = {e.key: e.sub for e in nav}
    loaded = await get_model(model, registry)
    old = urlsplit(here).path.split("/")[2] if here.startswith("/models/") and here.count("/") >= 2 else ""
    target = (
        switched(here, unquote(old), loaded.model.cfg, model, nav, view)
        if old
        else f"/models/{quote(model, safe='')}{views.get(view, '')}"
    )
    return RedirectResponse(target, status_code=303)


# -- the direct path ----------------------------------------------------------------------------------------------
class DirectPageParams(DirectParams):
    """The direct page: min_count absent means frequent tokens where the model has training counts,
    'all' means every token."""

    min_count: Annotated[
        Annotated[int, Field(ge=1, le=10**9)] | Literal["all"] | None,
        Field(
            description=f"tokens seen at least this often in training; 'all': every token (default {MIN_TRAIN_COUNT} "
            f"where the model has token counts)"
        ),
    ] = None  # type: ignore[assignment]


def direct_min_count(call: PageCall[Any], asked: int | str | None) -> int | None:
    """The min_count the direct page uses: as asked, 'all' -> None, absent -> MIN_TRAIN_COUNT where there are counts."""
    if asked is None:
        return MIN_TRAIN_COUNT if has_token_counts(call.model) else None
    return None if asked == "all" else int(asked)


class DirectContext(TypedDict):
    """templates/direct.html: the direct path's top entries (one token's row as a bar chart) and the token-set
    pickers' state (min_count: frequent tokens only; vocab: every token of a large vocabulary)."""

    view: CircuitTopView
    token: str | None
    k: int
    fig: Figure | None  # the row's bars, when a token is given
    max_k: int
    rare_claim: str | None  # how many of the tokens shown are rare in training (global table, every token)
    min_count: int | Literal["all"] | None  # the floor used; "all" when counts exist but every token is ranked
    has_counts: bool  # the folder has token_counts.npy
    default_min_count: int | None
    min_count_choices: tuple[int, ...]
    vocab: Literal["all"] | None  # "all" only where it differs from the default (a vocabulary over DEFAULT_VOCAB)
    n_vocab: int
    default_vocab: int


async def direct_context(call: PageCall[DirectPageParams]) -> DirectContext:
    p = call.params
    shown = direct_min_count(call, p.min_count)
    vocab = "all" if p.min_count == "all" else p.vocab  # the picker's 'all' ranks every token, a large vocabulary's too
    params = DirectParams(token=p.token, k=p.k, basis=p.basis, min_count=shown, vocab=vocab)
    call.json_params = params
    view: CircuitTopView = await call.run(DIRECT, params)
    fig = None
    if view.token is not None:
        fig = charts.bars(
            [visible(e.col.text) for e in view.entries],
            [e.value for e in view.entries],
            horizontal=True,
            title=f"top next tokens after {visible(view.token.text)} (W_E W_U row)",
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
    }


# -- detectors ----------------------------------------------------------------------------------------------------
class DetectorPageParams(DetectorParams):
    filter: FilterText = None  # of the chart and the table


TOP_CHARTED = 12  # heads in the detector chart: those with the largest score of any detector (the table has all)


class DetectorsContext(TypedDict):
    """templates/detectors.html: the detector scores (the heads the filter keeps), their charts, the loss sentence and
    the input's form state."""

    view: DetectorsView
    snippet: str | None  # "copy as Python" on the standard input (random tokens repeated)
    shown_heads: list[HeadScores]
    head_filter: str  # the filter as read ('' for none)
    filter_text: str | None  # as typed
    figs: dict[str, Any]  # detector_charts
    seq_len: int | None
    batch: int
    claim: str | None  # loss_sentence
    seed: int
    prompt: str | None
    heads: str | None


async def detectors_context(call: PageCall[DetectorPageParams]) -> DetectorsContext:
    page = call.params  # normalised: seq_len is the standard input fitted to the model
    head_filter = HeadFilter.parse(page.filter)
    p = DetectorParams(**page.model_dump(exclude={"filter"}))
    call.json_params = p
    view = await call.run(DETECTORS, p)
    shown = head_filter.apply(view.heads)
    inp = view.detector_input
    snippet = None
    if inp.kind == "repeated_random" and inp.seq_len is not None and inp.seed is not None:
        entry = await cheap(call.registry.entry, call.model_id or "")
        dtype = str(call.registry.dtype).removeprefix("torch.")
        snippet = snippets.detectors(entry.path, dtype, inp.seq_len, inp.batch, inp.seed, inp.bos)
    return {
        "view": view,
        "snippet": snippet,
        "shown_heads": shown,
        "head_filter": str(head_filter),
        "filter_text": page.filter,
        "figs": detector_charts(view, call.model_id or "", shown),
        "seq_len": p.seq_len,
        "batch": p.batch,
        "claim": loss_sentence(view.loss.first_repeat, view.loss.second_repeat),
        "seed": p.seed,
        "prompt": p.prompt,
        "heads": p.heads,
    }


DETECTOR_KEYS = ("previous_token", "duplicate_token", "induction", "current_token", "first_token")


def top_heads(heads: list[HeadScores], most: int = TOP_CHARTED) -> list[HeadScores]:
    """The `most` heads with the largest score of any detector, in layer order (all of them when fewer)."""
    best = sorted(heads, key=lambda s: -max((getattr(s, k) or 0.0) for k in DETECTOR_KEYS))[:most]
    return sorted(best, key=lambda s: (s.layer, s.index))


def detector_charts(view: Any, model_id: str, shown: list[HeadScores] | None = None) -> dict[str, Any]:
    """The detector scores of the top heads (of `shown`: the head filter's), the per-position loss and the
    attention pattern of each selected head. The table lists every shown head."""
    charted = top_heads(view.heads if shown is None else shown)
    names = [s.head for s in charted]
    series = {SCORES[k][0]: [getattr(s, k) or 0.0 for s in charted] for k in DETECTOR_KEYS}
    n_all = len(view.heads if shown is None else shown)
    figs: dict[str, Any] = {
        "scores": charts.grouped_bars(
            names,
            series,
            title=f"detector scores of the {len(charted)} heads with the largest score"
            + (f" (of {n_all}; all in the table below)" if n_all > len(charted) else ""),
            y_title="score",
        )
    }
    labels = unique_labels([visible(t.text) for t in view.tokens])
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


# Every page: those with a context of their own, then those the analyses declare (app/routers/declared_pages.py). A
# labelled page is in a model's navigation at its `order` (ascending; declared pages use their `nav`): 10 overview,
# 20 composition, 30 prompt, 40 chain, 50 QK paths, 60 detectors, 70 term importance, 80 direct path, then the
# declared ones (90 copying, 100 attention entropy, 110 QK norm, 120 OV effective rank, 130-140 residual stream).
PAGES: list[Page[Any]] = [
    Page(
        HEADS,
        "overview.html",
        overview_context,
        params=OverviewParams,
        path="/models/{model}",
        blocks=("heads_panel",),
        title="{model}",
        nav="overview",
        label="Overview",
        order=10,
    ),
    pages_composition.COMPOSITION_PAGE,
    pages_prompt.PROMPT_PAGE,
    pages_analyses.CHAIN_PAGE,
    pages_analyses.QK_PATHS_PAGE,
    Page(
        DETECTORS,
        "detectors.html",
        detectors_context,
        params=DetectorPageParams,
        blocks=("detectors_panel",),
        title="Detectors · {model}",
        label="Detectors",
        order=60,
    ),
    pages_analyses.TERM_IMPORTANCE_PAGE,
    Page(
        DIRECT,
        "direct.html",
        direct_context,
        params=DirectPageParams,
        blocks=("direct_panel",),
        title="Direct path · {model}",
        label="Direct path",
        order=80,
    ),
    Page(
        HEAD,
        "head.html",
        head_context,
        params=HeadPageParams,
        blocks=("circuits",),
        title="{head} · {model}",
        nav="head",  # no navigation entry is a head page, so none is highlighted; the picker falls back to the overview
    ),
    pages_composition.PAIR_PAGE,
    pages_prompt.PATHS_PAGE,
    *pages_tour.PAGES,
    *declared_pages(ANALYSES),  # the pages analyses declare (their `page=`), each at its `nav` place
]
