"""Dashboard pages of the engine-2 analyses (included by app/routers/pages.py): composition and one pair,
the prompt (tokens, attention patterns, logit path expansion), a chain of heads, QK paths, term importance.

Same rules as pages.py: parse, call the builders of app/views through `compute`, chart, render; htmx
requests get the block named by HX-Target. Page URLs mirror the JSON API (`/models/{m}/<view>` <->
`/api/v1/models/{m}/<view>`), so the paper tour's links land on these pages.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from app import charts
from app.compute import compute
from app.deps import LimitsDep, LoadedModelDep, RegistryDep
from app.routers.api import Params, cache_key, split_heads
from app.routers.pages import API, attempt, page_context, render, url
from app.settings import Settings
from app.views.composition import build_composition_pair_view, build_composition_view
from app.views.heads import build_heads_view
from app.views.path import build_path_view
from app.views.prompt import build_paths_view, build_prompt_view
from app.views.qk_paths import build_qk_paths_view
from app.views.term_importance import build_term_importance_view
from app.views.tour_figures import REPEATED
from circuits_core.weights import LoadedModel

# The prompt a page starts with: repeated code, where induction heads have something to do.
DEFAULT_PROMPT = REPEATED


def default_heads(n_layers: int, n_heads: int, count: int) -> list[str]:
    """One head of each layer (H0), up to `count`: a starting point for the pattern and chain views."""
    return [f"L{layer}H0" for layer in range(n_layers)][: max(1, count)] if n_heads else []


async def suggested_heads(loaded: LoadedModel, count: int) -> list[str]:
    """Where a researcher starts on a model of 2+ layers: the previous-token head of layer 0 and the strongest
    induction head of the last layer (detector scores of the overview, cached); else `default_heads`."""
    cfg = loaded.model.cfg
    fallback = default_heads(cfg.n_layers, cfg.n_heads, count)
    if cfg.n_layers < 2 or count < 2:
        return fallback
    view, _ = await attempt(build_heads_view, loaded, key=cache_key(loaded, "heads"))
    first = [h for h in (view.heads if view else []) if h.layer == 0 and h.previous_token is not None]
    last = [h for h in (view.heads if view else []) if h.layer == cfg.n_layers - 1 and h.induction is not None]
    if not first or not last:
        return fallback
    return [max(first, key=lambda h: h.previous_token).head, max(last, key=lambda h: h.induction).head]


def build_router(settings: Settings) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    p = Params(settings.limits)
    lim = settings.limits

    def max_order_q(default: int = 2) -> Any:
        return Query(min(default, lim.max_order), ge=0, le=lim.max_order)

    def token_q() -> Any:
        return Query(None, max_length=256)

    # -- composition ----------------------------------------------------------------------------------
    @router.get("/models/{model}/composition")
    async def composition_page(request: Request, registry: RegistryDep, loaded: LoadedModelDep, model: str,
                               kind: Literal["Q", "K", "V"] = Query("K")) -> Response:
        view, error = await attempt(build_composition_view, loaded, kind, key=cache_key(loaded, "composition", kind))
        json_url = url(f"{API}/models/{model}/composition", kind=kind)
        ctx = await page_context(request, registry, f"{kind}-composition · {model}", json_url, model, "composition")
        fig = charts.composition_heatmap(view, model) if view else None
        return render(request, "composition.html", {**ctx, "view": view, "error": error, "kind": kind, "fig": fig},
                      blocks=("composition_panel",))

    @router.get("/models/{model}/composition/{source}/{target}")
    async def pair_page(request: Request, registry: RegistryDep, loaded: LoadedModelDep, limits: LimitsDep, model: str,
                        source: str, target: str, k: int = p.k(10)) -> Response:
        view = await compute(build_composition_pair_view, loaded, source, target, k, limits,
                             key=cache_key(loaded, "composition-pair", source, target, k))
        json_url = url(f"{API}/models/{model}/composition/{view.source}/{view.target}", k=k)
        ctx = await page_context(request, registry, f"{view.source} → {view.target} · {model}", json_url, model, "composition")
        figs = {
            "k_eig": charts.complex_scatter(charts.complex_points(view.k_composition.eigenvalues),
                                            title="eigenvalues of the K-composition token circuit"),
            "v_eig": charts.complex_scatter(charts.complex_points(view.virtual_head.ov.eigenvalues),
                                            title="eigenvalues of the virtual head's OV circuit"),
        }
        return render(request, "pair.html", {**ctx, "view": view, "k": k, "figs": figs, "max_k": limits.max_k}, blocks=("pair_panel",))

    # -- prompt: tokens, patterns, logit path expansion ----------------------------------------------------
    async def prompt_page(request: Request, registry: RegistryDep, loaded: LoadedModelDep, limits: LimitsDep, model: str,
                          prompt: str | None = p.prompt(), heads: str | None = p.heads(), weighted: bool = Query(False),
                          position: int | None = Query(None, ge=-lim.max_prompt_tokens, lt=lim.max_prompt_tokens),
                          target: str | None = token_q(), contrast: str | None = token_q(), max_order: int = max_order_q(),
                          k: int = p.k(20)) -> Response:
        prompt = prompt if prompt else DEFAULT_PROMPT
        head_list = split_heads(heads) or await suggested_heads(loaded, limits.max_heads)
        heads_str = ",".join(head_list)
        target, contrast = target or None, contrast or None
        state = {"prompt": prompt, "heads": heads_str, "weighted": "true" if weighted else None, "position": position,
                 "target": target, "contrast": contrast, "max_order": max_order, "k": k}
        block = request.headers.get("HX-Target")
        pview = patterns_error = paths = paths_error = None
        if block != "paths_panel":
            pview, patterns_error = await attempt(build_prompt_view, loaded, limits, prompt, None, head_list or None, weighted)
        if block != "patterns_panel":
            paths, paths_error = await attempt(build_paths_view, loaded, limits, prompt, None, position, target, contrast, max_order, True, k)
        base = f"/models/{model}/prompt"
        json_url = url(f"{API}/models/{model}/paths", prompt=prompt, position=position, target=target, contrast=contrast,
                       max_order=max_order, by_source="true", k=k)
        patterns_json = url(f"{API}/models/{model}/prompt", prompt=prompt, heads=heads_str, weighted=state["weighted"])
        ctx = await page_context(request, registry, f"Prompt · {model}", json_url, model, "prompt")
        figs: dict[str, Any] = {}
        if pview is not None:
            figs["patterns"] = [(hp.head, charts.attention_heatmap(pview.tokens, hp.pattern, f"{hp.head} {'value-weighted ' if weighted else ''}attention",
                                                                   weighted=weighted, height=380)) for hp in pview.heads]
        if paths is not None:
            links = [url(f"/models/{model}/path", heads=",".join(t.path), prompt=prompt, target=paths.target)
                     if t.kind == "head" else None for t in paths.terms]
            figs["waterfall"] = charts.paths_waterfall(paths, links)
            figs["by_source"] = charts.paths_by_source(paths)
        return render(request, "prompt.html", {
            **ctx, "pview": pview, "paths": paths, "figs": figs, "patterns_error": patterns_error, "paths_error": paths_error, "state": state, "base": base, "prompt": prompt,
            "heads": heads_str, "weighted": weighted, "patterns_json": patterns_json, "limits": limits,
        }, blocks=("prompt_main", "patterns_panel", "paths_panel"))

    router.add_api_route("/models/{model}/prompt", prompt_page, methods=["GET"])
    router.add_api_route("/models/{model}/paths", prompt_page, methods=["GET"])  # the tour's link for F9/F19

    # -- a chain of heads (virtual head) -------------------------------------------------------------------
    @router.get("/models/{model}/path")
    async def chain_page(request: Request, registry: RegistryDep, loaded: LoadedModelDep, limits: LimitsDep, model: str,
                         heads: str | None = p.heads(), prompt: str | None = p.prompt(), target: str | None = token_q(),
                         k: int = p.k(20)) -> Response:
        prompt = prompt if prompt else DEFAULT_PROMPT
        head_list = split_heads(heads) or await suggested_heads(loaded, min(2, limits.max_order))
        target = target or None
        view, error = await attempt(build_path_view, loaded, limits, head_list, prompt, None, target, k)
        heads_str = ",".join(view.heads if view else head_list)
        json_url = url(f"{API}/models/{model}/path", heads=heads_str, prompt=prompt, target=target, k=k)
        ctx = await page_context(request, registry, f"{heads_str.replace(',', ' → ')} · {model}", json_url, model, "path")
        if view is None:
            return render(request, "chain.html", {**ctx, "view": None, "error": error, "figs": {}, "prompt": prompt, "heads": heads_str,
                                                  "target": target, "k": k, "max_k": limits.max_k}, blocks=("chain_panel",))
        labels = charts.token_labels(view.tokens)
        figs = {
            "pattern": charts.attention_heatmap(view.tokens, view.pattern, f"pattern of the chain {' → '.join(view.heads)}"),
            "contribution": charts.bars(labels, view.contribution, title=f"contribution to logit({charts.visible(view.target.text)}) by position",
                                        x_title="destination position"),
            "by_source": charts.lines(list(range(len(labels))), {s.source: s.values for s in view.by_source},
                                      title="the same chain entered from each source", x_title="position", y_title="logit"),
            "ov_eig": charts.complex_scatter(charts.complex_points(view.ov.eigenvalues), title="eigenvalues of the chain's OV circuit"),
        }
        return render(request, "chain.html", {**ctx, "view": view, "figs": figs, "prompt": prompt, "heads": heads_str,
                                              "target": target, "k": k, "max_k": limits.max_k}, blocks=("chain_panel",))

    # -- QK paths --------------------------------------------------------------------------------------------
    @router.get("/models/{model}/qk-paths")
    async def qk_paths_page(request: Request, registry: RegistryDep, loaded: LoadedModelDep, limits: LimitsDep, model: str,
                            head: str | None = Query(None, max_length=16), prompt: str | None = p.prompt(), k: int = p.k(6)) -> Response:
        cfg = loaded.model.cfg
        prompt = prompt if prompt else DEFAULT_PROMPT
        if not head:  # the induction head of a 2+ layer model, else H0 of the last layer
            head = (await suggested_heads(loaded, 2))[-1] if cfg.n_layers else "L0H0"
        view, error = await attempt(build_qk_paths_view, loaded, limits, head, prompt, None, k)
        json_url = url(f"{API}/models/{model}/qk-paths", head=head, prompt=prompt, k=k)
        ctx = await page_context(request, registry, f"QK paths of {head} · {model}", json_url, model, "qk-paths")
        if view is None:
            return render(request, "qk_paths.html", {**ctx, "view": None, "error": error, "head": head, "figs": {}, "prompt": prompt,
                                                     "k": k, "max_k": limits.max_k}, blocks=("qk_panel",))
        labels = charts.token_labels(view.tokens)
        figs = {
            "std": charts.heatmap(view.std, view.components, view.components, title="std of each term's scores over (query, key) positions",
                                  x_title="key-side component", y_title="query-side component", signed=False,
                                  hover="query %{y} · key %{x}<br>std %{z:.4f}", colorbar="std", height=max(300, 40 * len(view.components) + 140)),
            "scores": charts.heatmap(view.scores, labels, labels, title=f"real attention scores of {view.head}", x_title="key",
                                     y_title="query", signed=True, colorbar="score", height=420),
            "terms": [(name, charts.heatmap(z, labels, labels, title=name.replace("|", " · "), x_title="key", y_title="query",
                                            signed=True, colorbar="score", height=380)) for name, z in view.terms.items()],
        }
        return render(request, "qk_paths.html", {**ctx, "view": view, "head": view.head, "figs": figs, "prompt": prompt, "k": k, "max_k": limits.max_k},
                      blocks=("qk_panel",))

    # -- term importance -------------------------------------------------------------------------------------
    @router.get("/models/{model}/term-importance")
    async def term_importance_page(request: Request, registry: RegistryDep, loaded: LoadedModelDep, limits: LimitsDep, model: str,
                                   prompt: str | None = p.prompt()) -> Response:
        prompt = prompt or None
        key = cache_key(loaded, "term-importance") if prompt is None else None
        view, error = await attempt(build_term_importance_view, loaded, limits, prompt, None, key=key)
        json_url = url(f"{API}/models/{model}/term-importance", prompt=prompt)
        ctx = await page_context(request, registry, f"Term importance · {model}", json_url, model, "term-importance")
        if view is None:
            return render(request, "term_importance.html", {**ctx, "view": None, "error": error, "figs": {}, "prompt": prompt},
                          blocks=("ti_panel",))
        n = len(view.loss_by_order)
        figs = {
            "by_order": charts.bars([f"order ≤ {i}" for i in range(n)], view.loss_by_order, title="mean loss keeping paths up to each order",
                                    y_title="loss (nats)"),
            "marginal": charts.bars([f"order {i + 1}" for i in range(len(view.marginal_by_order))], view.marginal_by_order,
                                    title="loss reduction added by each order", y_title="Δ loss (nats)"),
            "by_layer": charts.bars([f"layer {i}" for i in range(len(view.first_order_by_layer))], view.first_order_by_layer,
                                    title="first-order terms of each layer alone (over the direct path)", y_title="Δ loss (nats)"),
            "heads": charts.bars([h.head for h in view.heads], [h.loss_change for h in view.heads],
                                 title="loss increase when one head is removed (patterns frozen)", y_title="Δ loss (nats)",
                                 links=[f"/models/{model}/heads/{h.head}" for h in view.heads]),
        }
        return render(request, "term_importance.html", {**ctx, "view": view, "figs": figs, "prompt": prompt}, blocks=("ti_panel",))

    return router
