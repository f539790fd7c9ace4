"""Dashboard pages of the prompt and composition analyses: composition and one pair, the prompt (tokens, attention
patterns, logit path expansion), a chain of heads, QK paths, term importance. Each is a `Page`
(app/routers/rendering.py) of its analysis: route, params, JSON twin and frame are derived; the context functions here
run the analyses through `call.run` / `call.attempt` and chart their views. Page URLs mirror the JSON API
(`/models/{m}/<view>` <-> `/api/v1/models/{m}/<view>`), so the paper tour's links land on these pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import Field

from app import block_heatmaps, charts, snippets
from app.analysis import HeadField, json_url
from app.params import (
    HEAD_DOC,
    ChainParams,
    CompositionParams,
    Heads,
    K,
    MaxOrder,
    NoParams,
    PathsParams,
    Position,
    PromptInput,
    PromptParams,
    QKPathsParams,
    target_token,
)
from app.routers.pages_rotary import pair_rotary_context, rotary_enabled
from app.routers.rendering import Page, PageCall, url
from app.scheduling import cheap
from app.views.composition import COMPOSITION, COMPOSITION_PAIR
from app.views.heads import HEADS
from app.views.inputs import spelling_variants
from app.views.page_claims import ablation_sentence, composition_sentence
from app.views.path import PATH
from app.views.prompt import PATHS, PROMPT
from app.views.qk_paths import QK_PATHS
from app.views.term_importance import TERM_IMPORTANCE
from app.views.tour_figures import REPEATED
from circuits_core.errors import InvalidInputError

# The prompt a page starts with: repeated code, where induction heads have something to do.
DEFAULT_PROMPT = REPEATED


class HasText(Protocol):
    @property
    def prompt(self) -> str | None: ...
    @property
    def tokens(self) -> str | None: ...


async def snippet_source(call: PageCall) -> tuple[Path, str]:
    """The folder and dtype a panel's "copy as Python" snippet loads the model from (as this server does)."""
    entry = await cheap(call.registry.entry, call.model_id or "")
    return entry.path, str(call.registry.dtype).removeprefix("torch.")


def text_of(p: HasText) -> tuple[str | None, str | None]:
    """(prompt, tokens) of a page. A page opened with token ids (a tour link) keeps them in a hidden field beside
    its prompt box, so its form sends both: text typed in the box wins, an empty box keeps the ids. Neither given:
    DEFAULT_PROMPT."""
    if p.prompt:
        return p.prompt, None
    if p.tokens is not None:
        return None, p.tokens
    return (p.prompt, None) if p.prompt is not None else (DEFAULT_PROMPT, None)


def default_heads(n_layers: int, n_heads: int, count: int) -> list[str]:
    """One head of each layer (H0), up to `count`: a starting point for the pattern and chain views."""
    return [f"L{layer}H0" for layer in range(n_layers)][: max(1, count)] if n_heads else []


async def suggested_heads(call: PageCall, count: int) -> list[str]:
    """Where a researcher starts on a model of 2+ layers: the heads that matter (the heads view's previous_token_head
    and induction_head, chosen by detectors.heads_that_matter from the model's own scores); else `default_heads`."""
    cfg = call.model.model.cfg
    fallback = default_heads(cfg.n_layers, cfg.n_heads, count)
    if cfg.n_layers < 2 or count < 2:
        return fallback
    view, _ = await call.attempt(HEADS, NoParams())
    if view is None or view.previous_token_head is None or view.induction_head is None:
        return fallback
    return [view.previous_token_head, view.induction_head]


# -- composition ------------------------------------------------------------------------------------------------
class CompositionPageParams(CompositionParams):
    """The composition page: the analysis's params and, on a model drawn as layer blocks, the block zoomed into."""

    block: Annotated[
        str | None,
        Field(pattern=r"^\d{1,4}-\d{1,4}$", description="zoom into layer block 'a-b' (earlier layer a, later b)"),
    ] = None


async def composition_context(call: PageCall) -> dict[str, Any]:
    page: CompositionPageParams = call.params
    params = CompositionParams(**page.model_dump(exclude={"block"}))
    call.json_params = params
    view, error = await call.attempt(COMPOSITION, params)
    kind = params.kind
    call.title = f"{kind}-composition · {call.model_id}"
    zmax, claim = None, None
    if view is not None:  # one colour scale for Q, K and V (the other kinds' answers are cached like this one)
        views = [view] + [
            v
            for k in ("Q", "K", "V")
            if k != kind
            for v, _ in [await call.attempt(COMPOSITION, params.model_copy(update={"kind": k}))]
            if v is not None
        ]
        zmax = charts.shared_range([v.minus_baseline for v in views])
        k_view = next((v for v in views if v.kind == "K"), None)
        if not params.offset:  # what this model shows (detector scores on the standard input, cached)
            claim = composition_sentence(call.model_id or "", (await call.attempt(HEADS, NoParams()))[0], k_view)
    base = f"/models/{call.model_id}/composition"
    state = {"kind": kind, "offset": params.offset or None, "basis": page.basis if page.basis != "served" else None}
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
        fig = charts.composition_heatmap(view, call.model_id or "", zmax)
    snippet = (
        snippets.composition(*await snippet_source(call), kind) if view is not None and not params.offset else None
    )
    return {
        "view": view,
        "error": error,
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


async def pair_context(call: PageCall) -> dict[str, Any]:
    view = await call.run(COMPOSITION_PAIR, call.params)
    call.title = f"{view.source} → {view.target} · {call.model_id}"
    figs = {
        "k_eig": charts.complex_scatter(
            charts.complex_points(view.k_composition.eigenvalues),
            title="eigenvalues of the K-composition token circuit",
        ),
        "v_eig": charts.complex_scatter(
            charts.complex_points(view.virtual_head.ov.eigenvalues),
            title="eigenvalues of the virtual head's OV circuit",
        ),
    }
    rotary = await pair_rotary_context(call, view.source, view.target)
    return {"view": view, "k": call.params.k, "figs": figs, "max_k": call.limits.max_k, **rotary}


# -- prompt: tokens, patterns, logit path expansion ------------------------------------------------------------
class PromptPageParams(PromptInput):
    """The prompt page: the patterns (PromptParams) and the path expansion (PathsParams) of one prompt."""

    heads: Heads = None
    layer: Annotated[
        int | None, Field(ge=0, le=10_000, description="all heads of this layer, as small multiples (instead of heads)")
    ] = None
    weighted: bool = False
    position: Position = None
    target: str | None = target_token("the logit to expand")  # type: ignore[assignment]
    contrast: str | None = target_token("subtract this token's logit")  # type: ignore[assignment]
    max_order: MaxOrder = 2
    k: K = 20


async def prompt_context(call: PageCall) -> dict[str, Any]:
    p: PromptPageParams = call.params
    model = call.model_id
    prompt, tokens = text_of(p)
    cfg = call.model.model.cfg
    if p.layer is not None:  # every head of one layer (as many as one request takes), drawn as small multiples
        if p.layer >= cfg.n_layers:
            raise InvalidInputError(f"layer {p.layer} out of range: the model has {cfg.n_layers} layers")
        heads_str = ",".join(f"L{p.layer}H{h}" for h in range(min(cfg.n_heads, call.limits.max_heads)))
    else:
        heads_str = p.heads or ",".join(await suggested_heads(call, call.limits.max_heads))
    state = {
        "prompt": prompt,
        "tokens": tokens,
        "heads": heads_str if p.layer is None else None,
        "layer": p.layer,
        "weighted": "true" if p.weighted else None,
        "position": p.position,
        "target": p.target,
        "contrast": p.contrast,
        "max_order": p.max_order,
        "k": p.k,
    }
    block = call.request.headers.get("HX-Target")
    patterns = PromptParams(prompt=prompt, tokens=tokens, heads=heads_str or None, weighted=p.weighted)
    expansion = PathsParams(
        prompt=prompt,
        tokens=tokens,
        position=p.position,
        target=p.target,
        contrast=p.contrast,
        max_order=p.max_order,
        by_source=True,
        k=p.k,
    )
    pview = patterns_error = paths = paths_error = None
    if block != "paths_panel":
        pview, patterns_error = await call.attempt(PROMPT, patterns)
    if block != "patterns_panel":
        paths, paths_error = await call.attempt(PATHS, expansion)
    call.json_params = expansion
    call.title = f"Prompt · {model}"
    figs: dict[str, Any] = {}
    if pview is not None:
        figs["patterns"] = [
            (
                hp.head,
                charts.attention_heatmap(
                    pview.tokens,
                    hp.pattern,
                    f"{hp.head} {'value-weighted ' if p.weighted else ''}attention",
                    weighted=p.weighted,
                    height=380,
                ),
            )
            for hp in pview.heads
        ]
    if pview is not None:
        figs["text"] = charts.attention_text(pview.tokens, {hp.head: hp.pattern for hp in pview.heads}, paths)
    if pview is not None and p.layer is not None:
        figs["layer"] = charts.attention_text(pview.tokens, {hp.head: hp.pattern for hp in pview.heads})
        figs["patterns"] = []  # the small multiples replace the one-head heat maps
    if paths is not None:
        links = [
            url(f"/models/{model}/path", heads=",".join(t.path), prompt=prompt, tokens=tokens, target=paths.target)
            if t.kind == "head"
            else None
            for t in paths.terms
        ]
        figs["waterfall"] = charts.paths_waterfall(paths, links)
        figs["by_source"] = charts.paths_by_source(paths)
        if paths.contrast_token is None:
            figs["snippet"] = snippets.logit_paths(
                *await snippet_source(call),
                [t.id for t in paths.prompt_tokens],
                paths.position,
                paths.target_token.id,
                paths.max_order,
            )
    return {
        "target_spelling": spelling_variants(
            call.model, p.target
        ),  # 'Paris' is not ' Paris': say which, offer the other
        "pview": pview,
        "paths": paths,
        "figs": figs,
        "patterns_error": patterns_error,
        "paths_error": paths_error,
        "state": state,
        "base": f"/models/{model}/prompt",
        "prompt": prompt,
        "heads": heads_str,
        "layer": p.layer,
        "n_layers": cfg.n_layers,
        "n_heads_shown": min(cfg.n_heads, call.limits.max_heads),
        "n_heads": cfg.n_heads,
        "weighted": p.weighted,
        "patterns_json": json_url(PROMPT, model, patterns),
    }


# -- a chain of heads (virtual head) ----------------------------------------------------------------------------
class ChainPageParams(ChainParams):
    heads: Heads = None  # type: ignore[assignment]  # default: the suggested heads


async def chain_context(call: PageCall) -> dict[str, Any]:
    p: ChainPageParams = call.params
    prompt, tokens = text_of(p)
    heads = p.heads or ",".join(await suggested_heads(call, min(2, call.limits.max_order)))
    params = ChainParams(heads=heads, prompt=prompt, tokens=tokens, target=p.target, k=p.k)
    view, error = await call.attempt(PATH, params)
    heads_str = ",".join(view.heads) if view else heads
    call.json_params = params.model_copy(update={"heads": heads_str})
    call.title = f"{heads_str.replace(',', ' → ')} · {call.model_id}"
    ctx = {
        "view": view,
        "error": error,
        "figs": {},
        "prompt": prompt,
        "tokens": tokens,
        "heads": heads_str,
        "target": p.target,
        "k": p.k,
        "max_k": call.limits.max_k,
    }
    if view is None:
        return ctx
    labels = charts.token_labels(view.tokens)
    ctx["figs"] = {
        "text": charts.attention_text(view.tokens, {" → ".join(view.heads): view.pattern}),
        "pattern": charts.attention_heatmap(
            view.tokens, view.pattern, f"pattern of the chain {' → '.join(view.heads)}"
        ),
        "contribution": charts.bars(
            labels,
            view.contribution,
            title=f"contribution to logit({charts.visible(view.target.text)}) by position",
            x_title="destination position",
        ),
        "next_token": charts.bars(
            [f"{a} → {b}" for a, b in zip(labels[:-1], labels[1:], strict=True)],
            view.next_token_contribution,
            title="contribution to the logit of each position's actual next token",
            x_title="position → next token",
        ),
        "by_source": charts.lines(
            list(range(len(labels))),
            {s.source: s.values for s in view.by_source},
            title="the same chain entered from each source",
            x_title="position",
            y_title="logit",
        ),
        "ov_eig": charts.complex_scatter(
            charts.complex_points(view.ov.eigenvalues), title="eigenvalues of the chain's OV circuit"
        ),
    }
    return ctx


# -- QK paths -----------------------------------------------------------------------------------------------------
class QKPathsPageParams(QKPathsParams):
    head: Annotated[str | None, Field(max_length=16, description=HEAD_DOC), HeadField()] = None  # type: ignore[assignment]


async def qk_paths_context(call: PageCall) -> dict[str, Any]:
    p: QKPathsPageParams = call.params
    cfg = call.model.model.cfg
    prompt, tokens = text_of(p)
    head = p.head  # default: the induction head of a 2+ layer model, else H0 of the last layer
    if not head:
        head = (await suggested_heads(call, 2))[-1] if cfg.n_layers else "L0H0"
    params = QKPathsParams(head=head, prompt=prompt, tokens=tokens, k=p.k, query=p.query, key=p.key)
    view, error = await call.attempt(QK_PATHS, params)
    call.json_params = params
    call.title = f"QK paths of {head} · {call.model_id}"
    ctx = {
        "view": view,
        "error": error,
        "head": head,
        "figs": {},
        "prompt": prompt,
        "tokens": tokens,
        "query": p.query,
        "key": p.key,
        "k": p.k,
        "max_k": call.limits.max_k,
    }
    if view is None:
        return ctx
    labels = charts.token_labels(view.tokens)
    ctx["head"] = view.head
    if view.at is not None:
        ctx["snippet"] = snippets.qk_score_terms(
            *await snippet_source(call),
            view.head,
            [t.id for t in view.tokens],
            view.at.query,
            view.at.key,
            len(view.at.terms),
        )
    ctx["figs"] = {
        "std": charts.heatmap(
            view.std,
            view.components,
            view.components,
            title="std of each term's scores over (query, key) positions",
            x_title="key-side component",
            y_title="query-side component",
            signed=False,
            hover="query %{y} · key %{x}<br>std %{z:.4f}",
            colorbar="std",
            height=max(300, 40 * len(view.components) + 140),
        ),
        "scores": charts.heatmap(
            view.scores,
            labels,
            labels,
            title=f"real attention scores of {view.head}",
            x_title="key",
            y_title="query",
            signed=True,
            colorbar="score",
            height=charts.label_room(len(labels), 420),
        ),
        "terms": [
            (
                name,
                charts.heatmap(
                    z,
                    labels,
                    labels,
                    title=name.replace("|", " · "),
                    x_title="key",
                    y_title="query",
                    signed=True,
                    colorbar="score",
                    height=380,
                ),
            )
            for name, z in view.terms.items()
        ],
    }
    return ctx


# -- term importance --------------------------------------------------------------------------------------------
async def term_importance_context(call: PageCall) -> dict[str, Any]:
    view, error = await call.attempt(TERM_IMPORTANCE, call.params)
    prompt, model = call.params.prompt, call.model_id
    ctx = {"view": view, "error": error, "figs": {}, "prompt": prompt, "heads": call.params.heads}
    if view is None:
        return ctx
    ctx["claim"] = ablation_sentence(view, (await call.attempt(HEADS, NoParams()))[0])
    n = len(view.loss_by_order)
    ctx["figs"] = {
        "by_order": charts.bars(
            [f"order ≤ {i}" for i in range(n)],
            view.loss_by_order,
            title="mean loss keeping paths up to each order",
            y_title="loss (nats)",
        ),
        "marginal": charts.bars(
            [f"order {i + 1}" for i in range(len(view.marginal_by_order))],
            view.marginal_by_order,
            title="loss reduction added by each order",
            y_title="Δ loss (nats)",
        ),
        "by_layer": charts.bars(
            [f"layer {i}" for i in range(len(view.first_order_by_layer))],
            view.first_order_by_layer,
            title="first-order terms of each layer alone (over the direct path)",
            y_title="Δ loss (nats)",
        ),
        "heads": charts.bars(
            [h.head for h in view.heads],
            [h.loss_change for h in view.heads],
            title="loss increase when one head is removed (patterns frozen)",
            y_title="Δ loss (nats)",
            links=[f"/models/{model}/heads/{h.head}" for h in view.heads],
        ),
        "heads_recomputed": charts.bars(
            [h.head for h in view.heads],
            [h.loss_change_recomputed for h in view.heads],
            title="loss increase when one head is removed (later patterns recomputed)",
            y_title="Δ loss (nats)",
            links=[f"/models/{model}/heads/{h.head}" for h in view.heads],
        ),
    }
    return ctx


COMPOSITION_PAGE = Page(
    COMPOSITION,
    "composition.html",
    composition_context,
    params=CompositionPageParams,
    blocks=("composition_panel",),
    nav="composition",
    label="Composition",
)
PAIR_PAGE = Page(COMPOSITION_PAIR, "pair.html", pair_context, blocks=("pair_panel",), nav="composition")
PROMPT_PAGE = Page(
    PATHS,
    "prompt.html",
    prompt_context,
    params=PromptPageParams,
    path="/models/{model}/prompt",
    nav="prompt",
    blocks=("prompt_main", "patterns_panel", "paths_panel"),
    label="Prompt & paths",
)
PATHS_PAGE = Page(
    PATHS,
    "prompt.html",
    prompt_context,
    params=PromptPageParams,
    nav="prompt",  # the tour's link for F9/F19
    blocks=("prompt_main", "patterns_panel", "paths_panel"),
)
CHAIN_PAGE = Page(
    PATH, "chain.html", chain_context, params=ChainPageParams, blocks=("chain_panel",), label="Chain of heads"
)
QK_PATHS_PAGE = Page(
    QK_PATHS, "qk_paths.html", qk_paths_context, params=QKPathsPageParams, blocks=("qk_panel",), label="QK paths"
)
TERM_IMPORTANCE_PAGE = Page(
    TERM_IMPORTANCE,
    "term_importance.html",
    term_importance_context,
    blocks=("ti_panel",),
    title="Term importance · {model}",
    label="Term importance",
)
