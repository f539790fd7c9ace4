"""The prompt page: a prompt's tokens, the attention patterns of chosen heads and the logit path expansion at one
position (also served at the path expansion's own URL, the tour's link). A `Page` (app/routers/rendering.py) of the
path expansion; its context runs the prompt and paths analyses through `call.run` and charts their views."""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from pydantic import Field

from app import snippets, view_figures
from app.analysis import json_url
from app.params import (
    Heads,
    K,
    MaxOrder,
    PathsParams,
    Position,
    PromptInput,
    PromptParams,
    target_token,
)
from app.routers.page_inputs import snippet_source, suggested_heads, text_of
from app.routers.rendering import Page, PageCall, Refusal, url
from app.schemas.analyses import PathsView, PromptView
from app.views.prompt import PATHS, PROMPT
from app.views.shared.inputs import spelling_variants
from circuits_core.errors import InvalidInputError


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


class PromptContext(TypedDict):
    """templates/prompt.html: the attention patterns (PROMPT) and the logit's path expansion (PATHS) of one prompt,
    each with its own refusal (an htmx request for one panel computes only that one), and the form's state."""

    target_spelling: tuple[tuple[str, int], list[tuple[str, int]]] | None  # spelling_variants of the target
    pview: PromptView | None
    paths: PathsView | None
    figs: dict[str, Any]  # patterns: (head, figure) each; text, layer, waterfall, by_source: figures; snippet
    patterns_error: Refusal | None
    paths_error: Refusal | None
    state: dict[str, object]  # the form's fields as the panels' links repeat them
    base: str  # the page's path
    prompt: str | None
    heads: str
    layer: int | None
    n_layers: int
    n_heads_shown: int
    n_heads: int
    weighted: bool
    patterns_json: str  # the JSON twin of the patterns panel


async def prompt_context(call: PageCall[PromptPageParams]) -> PromptContext:
    p = call.params
    model = call.model_id
    prompt, tokens = text_of(p)
    cfg = call.model.model.cfg
    if p.layer is not None:  # every head of one layer (as many as one request takes), drawn as small multiples
        if p.layer >= cfg.n_layers:
            raise InvalidInputError(f"layer {p.layer} out of range: the model has {cfg.n_layers} layers")
        heads_str = ",".join(f"L{p.layer}H{h}" for h in range(min(cfg.n_heads, call.limits.max_heads)))
    else:
        heads_str = p.heads or ",".join(await suggested_heads(call, call.limits.max_heads))
    state: dict[str, object] = {
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
                view_figures.attention_heatmap(
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
        figs["text"] = view_figures.attention_text(pview.tokens, {hp.head: hp.pattern for hp in pview.heads}, paths)
    if pview is not None and p.layer is not None:
        figs["layer"] = view_figures.attention_text(pview.tokens, {hp.head: hp.pattern for hp in pview.heads})
        figs["patterns"] = []  # the small multiples replace the one-head heat maps
    if paths is not None:
        links = [
            url(f"/models/{model}/path", heads=",".join(t.path), prompt=prompt, tokens=tokens, target=paths.target)
            if t.kind == "head"
            else None
            for t in paths.terms
        ]
        figs["waterfall"] = view_figures.paths_waterfall(paths, links)
        figs["by_source"] = view_figures.paths_by_source(paths)
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


PROMPT_PAGE = Page(
    PATHS,
    "prompt.html",
    prompt_context,
    params=PromptPageParams,
    path="/models/{model}/prompt",
    nav="prompt",
    blocks=("prompt_main", "patterns_panel", "paths_panel"),
    label="Prompt & paths",
    order=30,
)
PATHS_PAGE = Page(
    PATHS,
    "prompt.html",
    prompt_context,
    params=PromptPageParams,
    nav="prompt",  # the tour's link for F9/F19
    blocks=("prompt_main", "patterns_panel", "paths_panel"),
)
