"""Dashboard pages of composition: every pair of heads of a model (Q, K and V composition against the random
baseline) and one pair (its composition circuits, and on rotary models the profile over offsets). Each is a `Page`
(app/routers/rendering.py) of its analysis; the context functions run the analyses through `call.run` and chart
their views."""

from __future__ import annotations

from typing import Annotated, Literal, TypedDict

from pydantic import Field

from app import block_heatmaps, charts, snippets, view_figures
from app.charts import Figure
from app.head_filter import FilterText
from app.params import (
    CompositionPairParams,
    CompositionParams,
    NoParams,
)
from app.routers.page_inputs import filtered_heads, snippet_source
from app.routers.pages_rotary import PairRotary, pair_rotary_context, rotary_enabled
from app.routers.rendering import Page, PageCall, Refusal, is_fragment, url
from app.schemas.analyses import CompositionPair, CompositionPairView, CompositionView
from app.views.composition import COMPOSITION, COMPOSITION_PAIR
from app.views.shared.heads_table import HEADS
from app.views.shared.page_claims import composition_sentence

# -- composition ------------------------------------------------------------------------------------------------
FRAME_FIRST_S = 0.5  # heat maps priced over this many seconds (the three kinds) load after the page frame


class CompositionPageParams(CompositionParams):
    """The composition page: the analysis's params and, on a model drawn as layer blocks, the block zoomed into."""

    block: Annotated[
        str | None,
        Field(pattern=r"^\d{1,4}-\d{1,4}$", description="zoom into layer block 'a-b' (earlier layer a, later b)"),
    ] = None
    filter: FilterText = None  # of the map's rows and columns and the strongest pairs


def of_heads(view: CompositionView, kept: set[str] | None) -> CompositionView:
    """The view on the kept heads only: the maps' rows and columns, and the strongest pairs among them (as many as
    the whole view lists, largest raw score first); `kept` None: every head."""
    if kept is None:
        return view
    rows = [i for i, s in enumerate(view.sources) if s in kept]
    cols = [j for j, t in enumerate(view.targets) if t in kept]
    scored = [(view.scores[i][j], i, j) for i in rows for j in cols if view.scores[i][j] is not None]
    strongest = sorted(scored, key=lambda e: -float(e[0] or 0.0))[: len(view.top_pairs)]
    pairs = [
        CompositionPair(
            source=view.sources[i],
            target=view.targets[j],
            score=float(score or 0.0),
            minus_baseline=float(view.minus_baseline[i][j] or 0.0),
        )
        for score, i, j in strongest
    ]
    return view.model_copy(
        update={
            "sources": [view.sources[i] for i in rows],
            "targets": [view.targets[j] for j in cols],
            "scores": [[view.scores[i][j] for j in cols] for i in rows],
            "minus_baseline": [[view.minus_baseline[i][j] for j in cols] for i in rows],
            "top_pairs": pairs,
        }
    )


class CompositionFrameContext(TypedDict):
    """templates/composition.html before its heat maps: the URL of the panel whose htmx request computes them, the
    kind shown, and their price in seconds at this server's rate."""

    panel_url: str
    kind: Literal["Q", "K", "V"]
    panel_seconds: float


class CompositionContext(TypedDict):
    """templates/composition.html whole: the kind's view of the heads the filter keeps (None on a refusal), its heat
    map or layer-block map and zoomed block, the sentence on what the model shows, and the pickers' state."""

    view: CompositionView | None
    error: Refusal | None
    head_filter: str
    filter_text: str | None
    n_heads: int | None  # heads in the answer
    n_shown: int | None  # heads the filter keeps
    snippet: str | None
    kind: Literal["Q", "K", "V"]
    fig: Figure | None  # the heat map, or on many heads the layer-block map
    blocks: bool
    block: str | None  # the zoomed block "a-b"
    zoom: Figure | None
    all_blocks_url: str
    offset: int | None
    is_rotary: bool
    n_ctx: int
    claim: str | None
    latent_kv_rank: int | None  # multi-head latent attention


class PairContext(TypedDict):
    """templates/pair.html: one pair's composition circuits, its eigenvalue charts, and on rotary models its
    profiles over the offset."""

    view: CompositionPairView
    k: int
    figs: dict[str, Figure]
    max_k: int
    rotary: PairRotary | None  # None: not a rotary model


def heat_map_seconds(call: PageCall[CompositionPageParams], params: CompositionParams) -> float:
    """The time the page's heat maps would compute here: its three kinds (they share one colour scale), each priced at
    the server's rate unless kept already (SmolLM2's 270 heads: 134 GFLOP by the engine's count, ~7 s at 20 GFLOP/s)."""
    return sum(call.seconds_left(COMPOSITION, params.model_copy(update={"kind": k})) for k in ("Q", "K", "V"))


async def composition_context(
    call: PageCall[CompositionPageParams],
) -> CompositionFrameContext | CompositionContext:
    page = call.params
    params = CompositionParams(**page.model_dump(exclude={"block", "filter"}))
    call.json_params = params
    kind = params.kind
    call.title = f"{kind}-composition · {call.model_id}"
    base = f"/models/{call.model_id}/composition"
    state = {
        "kind": kind,
        "offset": params.offset or None,
        "basis": page.basis if page.basis != "served" else None,
        "filter": page.filter or None,
    }
    seconds = 0.0 if is_fragment(call.request) else heat_map_seconds(call, params)
    if seconds > FRAME_FIRST_S:  # the page's frame at once; its panel's htmx request computes the heat maps
        call.keep = False  # a frame is not kept: once its heat maps are, the page comes whole
        frame: CompositionFrameContext = {
            "panel_url": url(base, **state, block=page.block),
            "kind": kind,
            "panel_seconds": seconds,
        }
        return frame
    head_filter, kept, filter_error = await filtered_heads(call, page.filter)
    whole, error = await call.attempt(COMPOSITION, params)
    view = None if whole is None else of_heads(whole, kept)
    zmax, claim = None, None
    if whole is not None:  # one colour scale for Q, K and V (the other kinds' answers are cached like this one)
        views = [whole] + [
            v
            for k in ("Q", "K", "V")
            if k != kind
            for v, _ in [await call.attempt(COMPOSITION, params.model_copy(update={"kind": k}))]
            if v is not None
        ]
        zmax = view_figures.shared_range([v.minus_baseline for v in views])
        k_view = next((v for v in views if v.kind == "K"), None)
        if not params.offset:  # what this model shows (detector scores on the standard input, cached)
            claim = composition_sentence(call.model_id or "", (await call.attempt(HEADS, NoParams()))[0], k_view)
    fig = zoom = None
    blocks = view is not None and block_heatmaps.needs_blocks(len(view.sources))
    if view is not None and blocks:  # 30 layers x 9 heads: one cell per layer block, a click zooms in
        fig = block_heatmaps.composition_block_map(view, zmax, lambda a, b: url(base, **state, block=f"{a}-{b}"))
        if page.block:
            a, b = (int(x) for x in page.block.split("-"))
            zoom = block_heatmaps.composition_block(view, call.model_id or "", zmax, a, b)
            if zoom is None:
                error = {
                    "status": 422,
                    "title": "No such layer block",
                    "detail": f"block {page.block}: layer {a} has no head writing to a head of layer {b} "
                    f"(the earlier layer must be below the later one, both inside the model)",
                }
    elif view is not None:
        fig = view_figures.composition_heatmap(view, call.model_id or "", zmax)
    snippet = (
        snippets.composition(*await snippet_source(call), kind) if view is not None and not params.offset else None
    )
    return {
        "view": view,
        "error": error or filter_error,
        "head_filter": str(head_filter),
        "filter_text": page.filter,
        "n_heads": None if whole is None else len(set(whole.sources) | set(whole.targets)),
        "n_shown": None if view is None else len(set(view.sources) | set(view.targets)),
        "snippet": snippet,
        "kind": kind,
        "fig": fig,
        "blocks": blocks,
        "block": page.block if zoom is not None else None,
        "zoom": zoom,
        "all_blocks_url": url(base, **state),
        "offset": params.offset or None,
        "is_rotary": rotary_enabled(call),
        "n_ctx": call.model.model.cfg.n_ctx if call.model else 0,
        "claim": claim,
        "latent_kv_rank": call.model.model.cfg.mla_kv_rank if call.model else None,  # multi-head latent attention
    }


async def pair_context(call: PageCall[CompositionPairParams]) -> PairContext:
    view = await call.run(COMPOSITION_PAIR, call.params)
    call.title = f"{view.source} → {view.target} · {call.model_id}"
    figs = {
        "k_eig": charts.complex_scatter(
            view_figures.complex_points(view.k_composition.eigenvalues),
            title="eigenvalues of the K-composition token circuit",
        ),
        "v_eig": charts.complex_scatter(
            view_figures.complex_points(view.virtual_head.ov.eigenvalues),
            title="eigenvalues of the virtual head's OV circuit",
        ),
    }
    rotary = await pair_rotary_context(call, view.source, view.target)
    return {"view": view, "k": call.params.k, "figs": figs, "max_k": call.limits.max_k, "rotary": rotary["rotary"]}


COMPOSITION_PAGE = Page(
    COMPOSITION,
    "composition.html",
    composition_context,
    params=CompositionPageParams,
    blocks=("composition_panel",),
    nav="composition",
    label="Composition",
    order=20,
)
PAIR_PAGE = Page(COMPOSITION_PAIR, "pair.html", pair_context, blocks=("pair_panel",), nav="composition")
