"""The HTML dashboard: server-rendered pages, one per screen, each the twin of a JSON answer under /api/v1.

Each route parses its query parameters (the same constraints as the API, from app.routers.api.Params),
calls the view builders of app/views through `compute` (never circuits_core, never tensors), turns views
into chart figures with app/charts.py and renders a template. All state is in the URL: pickers are GET
forms with hx-get + hx-push-url, so a pasted link, a reload and the back button show the same screen.

For an htmx request (`HX-Request: true`, not a history restore nor a boosted link) only the swapped block
is rendered: the block named like the request's `HX-Target` element id when the page declares it, else
the page's main block. Every answer sends `Vary: HX-Request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2_fragments.fastapi import Jinja2Blocks
from starlette.types import Scope

from app import charts
from app.compute import compute
from app.deps import LimitsDep, LoadedModelDep, ModelEntryDep, RegistryDep
from app.errors import kind_of
from app.routers.api import Params, cache_key, split_heads
from app.schemas import CircuitTopView, HeadScores, HeadsView, HeadView
from app.settings import REPO_ROOT, Settings
from app.views.circuits import (
    build_direct_view,
    build_ov_view,
    build_qk_view,
    build_skip_trigrams_view,
    has_token_counts,
)
from app.views.composition import build_composition_view
from app.views.detectors import build_detectors_view
from app.views.heads import build_head_view, build_heads_view
from app.views.models import build_model_view, build_models_view
from app.views.tour_figures import positivity_scatter
from circuits_core.config import head_name, parse_head
from circuits_core.errors import QkovError
from circuits_core.weights import LoadedModel

API = "/api/v1"
templates = Jinja2Blocks(directory=str(REPO_ROOT / "templates"))
# The shared macros as a global `m`: a top-level {% import %} is not run when a single block is rendered.
templates.env.policies["json.dumps_kwargs"] = {"separators": (",", ":")}  # compact figure JSON
templates.env.filters["visible"] = charts.visible  # tokens shown with whitespace and control characters visible
templates.env.globals["m"] = templates.env.get_template("_macros.html").module

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

# The left navigation of a model: (key, label, path below /models/{model}); a view not built yet is absent.
MODEL_NAV: list[tuple[str, str, str]] = [
    ("overview", "Overview", ""),
    ("composition", "Composition", "/composition"),
    ("prompt", "Prompt & paths", "/prompt"),
    ("path", "Chain of heads", "/path"),
    ("qk-paths", "QK paths", "/qk-paths"),
    ("detectors", "Detectors", "/detectors"),
    ("term-importance", "Term importance", "/term-importance"),
    ("direct", "Direct path", "/direct"),
]


class CachedStaticFiles(StaticFiles):
    """Static files with cache headers: versioned vendor files are immutable for a year; our own css/js
    are revalidated on each load (ETag -> 304), so a change is seen at once."""

    def file_response(self, full_path: Any, stat_result: Any, scope: Scope, status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        immutable = "/vendor/" in str(scope.get("path", ""))
        response.headers["Cache-Control"] = "public, max-age=31536000, immutable" if immutable else "no-cache"
        return response


def url(path: str, **params: Any) -> str:
    """`path?query` with the parameters that are set (None and '' are left out)."""
    query = {k: v for k, v in params.items() if v is not None and v != ""}
    return f"{path}?{urlencode(query)}" if query else path


# The page's "tokens" picker: every token, or those seen at least N times in training (the API's min_count).
MIN_COUNT_CHOICES = (50, 200, 500, 1000, 2000)


def min_count_query() -> Any:
    return Query(None, max_length=10, pattern=r"^\d*$",
                 description="frequent tokens only: tokens seen at least this often in training (empty or 0: every token)")


def parse_min_count(value: str | None) -> int | None:
    return int(value) if value and int(value) > 0 else None


def is_fragment(request: Request) -> bool:
    h = request.headers
    return h.get("HX-Request") == "true" and h.get("HX-History-Restore-Request") != "true" and h.get("HX-Boosted") != "true"


async def model_ids(registry: Any) -> list[str]:
    return [e.id for e in await compute(registry.entries)]


async def attempt(fn: Any, *args: Any, key: Any = None) -> tuple[Any, dict[str, Any] | None]:
    """Run a builder through `compute`; a refusal (QkovError: bad prompt, limit exceeded) becomes an error
    shown inside the panel, with its form kept so the input can be fixed: (view, None) or (None, error)."""
    try:
        return await compute(fn, *args, key=key), None
    except QkovError as exc:
        kind = kind_of(exc)
        return None, {"status": kind.status, "title": kind.title, "detail": str(exc)}


def render(request: Request, template: str, context: dict[str, Any], blocks: Sequence[str] = ("main",)) -> Response:
    """The full page, or for htmx only the block the request targets (default: the first of `blocks`).
    Errors of `attempt` in the context (keys ending in 'error') set the status; they are not pushed to history."""
    context = {"request": request, "API": API, "url": url, **context}
    errors = [v for k, v in context.items() if k.endswith("error") and isinstance(v, dict)]
    if is_fragment(request):
        target = request.headers.get("HX-Target", "")
        block = target if target in blocks else blocks[0]
        response = templates.TemplateResponse(request, template, context, block_name=block)
    else:
        response = templates.TemplateResponse(request, template, context)
    response.headers["Vary"] = "HX-Request"
    if errors:
        response.status_code = errors[0]["status"]
        response.headers["HX-Push-Url"] = "false"
    return response


async def page_context(request: Request, registry: Any, title: str, json_url: str, model_id: str | None = None,
                       nav: str | None = None) -> dict[str, Any]:
    """What base.html needs: the title, the JSON twin, the model picker and the model's navigation."""
    ctx: dict[str, Any] = {"title": title, "json_url": json_url, "model_id": model_id, "nav": nav}
    if not is_fragment(request):
        ctx["models"] = await model_ids(registry)
        if model_id:
            ctx["model_nav"] = [(key, label, f"/models/{model_id}{sub}") for key, label, sub in MODEL_NAV]
    return ctx


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
        z, [f"H{h}" for h in range(cfg.n_heads)], [f"L{layer}" for layer in range(cfg.n_layers)],
        title=f"{label} score per head (click a head to open it)", x_title="head", y_title="layer", signed=signed,
        zmax=1.0, customdata=names, hover="%{customdata}<br>" + label + " %{z:.3f}", links=links, colorbar=label,
        text_in_cells=cfg.n_layers * cfg.n_heads <= 64, height=max(220, 70 * cfg.n_layers + 120),
    )


async def composition_partners(loaded: LoadedModel, name: str, top: int = 6) -> list[dict[str, Any]]:
    """The heads this head composes with most (Q, K, V; score minus baseline), from the composition views."""
    if loaded.model.cfg.n_layers < 2:
        return []
    rows = []
    for kind in ("Q", "K", "V"):
        view, _ = await attempt(build_composition_view, loaded, kind, key=cache_key(loaded, "composition", kind))
        if view is None:
            continue
        for i, src in enumerate(view.sources):
            for j, dst in enumerate(view.targets):
                value = view.minus_baseline[i][j]
                if value is not None and name in (src, dst):
                    rows.append({"kind": kind, "source": src, "target": dst, "score": view.scores[i][j], "minus_baseline": value,
                                 "partner": dst if src == name else src, "role": "writes to" if src == name else "reads from"})
    return sorted(rows, key=lambda r: -r["minus_baseline"])[:top]


def training_curve(card: dict[str, Any] | None) -> dict[str, Any] | None:
    """The model card's evaluation history as loss curves (train and validation loss against the step)."""
    history = (card or {}).get("history")
    if not isinstance(history, list) or not all(isinstance(r, dict) and "step" in r for r in history) or len(history) < 2:
        return None
    series = {name: [r.get(key) for r in history] for key, name in (("train_loss", "train loss"), ("val_loss", "validation loss"))
              if any(isinstance(r.get(key), (int, float)) for r in history)}
    if not series:
        return None
    return charts.lines([r["step"] for r in history], series, title="training curve (model card history)", x_title="step",
                        y_title="loss (nats)")


def head_charts(view: HeadView) -> dict[str, Any]:
    figs: dict[str, Any] = {
        "ov_eig": charts.complex_scatter([(c.re, c.im) for c in view.ov_eigenvalues],
                                         title=f"OV eigenvalues of W_E W_OV W_U · copying {view.scores.ov_copying:+.3f}"
                                         if view.scores.ov_copying is not None else "OV eigenvalues"),
        "qk_eig": charts.complex_scatter([(c.re, c.im) for c in view.qk_eigenvalues],
                                         title=f"QK eigenvalues of W_E W_QK W_E^T · {view.scores.qk_copying:+.3f}"
                                         if view.scores.qk_copying is not None else "QK eigenvalues"),
        "svals": charts.grouped_bars([str(i) for i in range(len(view.ov_singular_values))],
                                     {"W_OV": view.ov_singular_values, "W_QK": view.qk_singular_values},
                                     title="singular values of W_OV and W_QK", x_title="index"),
    }
    if view.positional is not None:
        n = min(view.positional.n_positions, POSITIONAL_SHOWN)
        figs["positional"] = charts.heatmap(
            [row[:n] for row in view.positional.pattern[:n]], [str(i) for i in range(n)], [str(i) for i in range(n)], digits=3,
            title="softmax(W_pos W_QK W_pos^T / √d_head), causal", x_title="key position", y_title="query position",
            signed=False, zmax=1.0, hover="query %{y} → key %{x}<br>%{z:.3f}", colorbar="attention",
        )
    return figs


def build_router(settings: Settings) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    p = Params(settings.limits)

    @router.get("/")
    async def models_page(request: Request, registry: RegistryDep) -> Response:
        view = await compute(build_models_view, registry)
        ctx = await page_context(request, registry, "Models", f"{API}/models")
        return render(request, "models.html", {**ctx, "view": view})

    @router.get("/go")
    async def go(model: str = Query(..., max_length=128), view: str = Query("overview", max_length=32)) -> Response:
        """The model picker (a GET form): to the same view of the chosen model."""
        sub = dict((k, s) for k, _, s in MODEL_NAV).get(view, "")
        return RedirectResponse(f"/models/{model}{sub}", status_code=303)

    @router.get("/models/{model}")
    async def overview_page(request: Request, registry: RegistryDep, loaded: LoadedModelDep, entry: ModelEntryDep, limits: LimitsDep,
                            score: str = Query("induction", pattern="^(" + "|".join(SCORES) + ")$")) -> Response:
        summary = build_model_view(loaded, entry)
        heads: HeadsView = await compute(build_heads_view, loaded, key=cache_key(loaded, "heads"))
        ctx = await page_context(request, registry, entry.id, f"{API}/models/{entry.id}/heads", entry.id, "overview")
        fig = heads_grid(loaded, heads.heads, score, entry.id) if heads.heads else None
        scatter = None
        if loaded.model.cfg.n_layers >= 2 and not is_fragment(request):
            data, _ = await attempt(lambda: positivity_scatter(loaded, limits)[0], key=cache_key(loaded, "positivity"))
            if data:
                pts = data["points"]
                scatter = charts.scatter(
                    [p["ov_copying"] or 0.0 for p in pts], [p["k_composition_positivity"] for p in pts], [p["head"] for p in pts],
                    title=f"OV copying vs K-composition positivity with previous-token head {data['previous_token_head']}",
                    x_title="OV copying score (Σλ/Σ|λ|)", y_title="K-composition positivity", links=[f"/models/{entry.id}/heads/{p['head']}" for p in pts])
        return render(request, "overview.html", {**ctx, "summary": summary, "heads": heads, "score": score, "scores": SCORES,
                                                 "fig": fig, "scatter": scatter, "card_fig": training_curve(summary.card)},
                      blocks=("heads_panel",))

    @router.get("/models/{model}/heads/{head}")
    async def head_page(request: Request, registry: RegistryDep, loaded: LoadedModelDep, limits: LimitsDep, model: str, head: str,
                        token: str | None = p.token(), k: int = p.k(10), min_count: str | None = min_count_query()) -> Response:
        cfg = loaded.model.cfg
        mc = parse_min_count(min_count)
        layer, h = parse_head(head, cfg)
        name = head_name(layer, h)
        token = token if token not in ("", None) else None
        fragment_only = is_fragment(request) and request.headers.get("HX-Target") == "circuits"
        view: HeadView | None = None
        if not fragment_only:
            view = await compute(build_head_view, loaded, name, key=cache_key(loaded, "head", name))
        ov: CircuitTopView = await compute(build_ov_view, loaded, name, token, k, limits, mc, key=cache_key(loaded, "ov", name, token, k, mc))
        qk_q: CircuitTopView = await compute(build_qk_view, loaded, name, token, k, limits, "query", mc,
                                             key=cache_key(loaded, "qk", name, token, k, "query", mc))
        qk_k = None
        if token is not None:
            qk_k = await compute(build_qk_view, loaded, name, token, k, limits, "key", mc, key=cache_key(loaded, "qk", name, token, k, "key", mc))
        skip = await compute(build_skip_trigrams_view, loaded, name, token, k, limits, mc, key=cache_key(loaded, "skip", name, token, k, mc))
        partners = await composition_partners(loaded, name) if view is not None else []
        all_heads = [head_name(a, b) for a in range(cfg.n_layers) for b in range(cfg.n_heads)]
        i = all_heads.index(name)
        ctx = await page_context(request, registry, f"{name} · {model}", f"{API}/models/{model}/heads/{name}", model, "overview")
        return render(request, "head.html", {
            **ctx, "head": name, "view": view, "ov": ov, "qk_q": qk_q, "qk_k": qk_k, "skip": skip, "token": token, "k": k,
            "figs": head_charts(view) if view is not None else {}, "max_k": limits.max_k, "partners": partners,
            "prev_head": all_heads[i - 1] if i > 0 else None, "next_head": all_heads[i + 1] if i + 1 < len(all_heads) else None,
            "base_url": f"/models/{model}/heads/{name}", "min_count": mc, "has_counts": has_token_counts(loaded),
            "min_count_choices": MIN_COUNT_CHOICES,
        }, blocks=("circuits",))

    @router.get("/models/{model}/direct")
    async def direct_page(request: Request, registry: RegistryDep, loaded: LoadedModelDep, limits: LimitsDep, model: str,
                          token: str | None = p.token(), k: int = p.k(20), min_count: str | None = min_count_query()) -> Response:
        token = token or None
        mc = parse_min_count(min_count)
        view = await compute(build_direct_view, loaded, token, k, limits, mc, key=cache_key(loaded, "direct", token, k, mc))
        json_url = url(f"{API}/models/{model}/direct", token=token, k=k, min_count=mc)
        ctx = await page_context(request, registry, f"Direct path · {model}", json_url, model, "direct")
        fig = None
        if view.token is not None:
            fig = charts.bars([charts.visible(e.col.text) for e in view.entries], [e.value for e in view.entries], horizontal=True,
                              title=f"top next tokens after {charts.visible(view.token.text)} (W_E W_U row)",
                              height=max(260, 22 * len(view.entries) + 80))
        return render(request, "direct.html", {**ctx, "view": view, "token": token, "k": k, "fig": fig, "max_k": limits.max_k,
                                               "min_count": mc, "has_counts": has_token_counts(loaded), "min_count_choices": MIN_COUNT_CHOICES},
                      blocks=("direct_panel",))

    @router.get("/models/{model}/detectors")
    async def detectors_page(request: Request, registry: RegistryDep, loaded: LoadedModelDep, limits: LimitsDep, model: str,
                             seq_len: int | None = Query(None, ge=1, le=settings.limits.max_seq_len,
                                                         description="length T of the random segment r in BOS + r + r"),
                             batch: int = p.batch(), seed: int = p.seed(),
                             prompt: str | None = p.prompt(), heads: str | None = p.heads()) -> Response:
        prompt = prompt or None
        if seq_len is None:  # the standard input, shortened to fit the model's context (BOS + r + r)
            seq_len = max(1, min(50, limits.max_seq_len, (loaded.model.cfg.n_ctx - 1) // 2))
        args = (loaded, limits, seq_len, batch, seed, prompt, None, split_heads(heads))
        view = await compute(build_detectors_view, *args, key=cache_key(loaded, "detectors", seq_len, batch, seed, prompt, None, heads))
        json_url = url(f"{API}/models/{model}/detectors", seq_len=seq_len, batch=batch, seed=seed, prompt=prompt, heads=heads)
        ctx = await page_context(request, registry, f"Detectors · {model}", json_url, model, "detectors")
        figs = detector_charts(view, model)
        return render(request, "detectors.html", {**ctx, "view": view, "figs": figs, "seq_len": seq_len, "batch": batch,
                                                  "seed": seed, "prompt": prompt, "heads": heads, "limits": limits},
                      blocks=("detectors_panel",))

    from app.routers import pages_analyses, pages_tour  # they import this module's helpers

    router.include_router(pages_analyses.build_router(settings))
    router.include_router(pages_tour.build_router(settings))
    return router


def detector_charts(view: Any, model_id: str) -> dict[str, Any]:
    """Per-head detector scores, the per-position loss and the attention pattern of each selected head."""
    names = [s.head for s in view.heads]
    series = {SCORES[k][0]: [getattr(s, k) or 0.0 for s in view.heads] for k in
              ("previous_token", "duplicate_token", "induction", "current_token", "first_token")}
    figs: dict[str, Any] = {"scores": charts.grouped_bars(names, series, title="detector scores per head", y_title="score")}
    labels = charts.unique_labels([charts.visible(t.text) for t in view.tokens])
    positions = list(range(len(view.loss.loss)))
    seg = view.detector_input.seq_len
    marks = [seg + (view.detector_input.bos is not None) - 0.5] if seg else []
    figs["loss"] = charts.lines(positions, {"loss (nats)": view.loss.loss}, title="next-token loss by position (mean over the batch)",
                                x_title="position", y_title="loss", vlines=marks)
    figs["patterns"] = [
        (hp.head, charts.heatmap(hp.pattern, labels, labels, title=f"{hp.head} attention (first sequence)", x_title="key",
                                 y_title="query", signed=False, zmax=1.0, hover="query %{y}<br>key %{x}<br>%{z:.3f}",
                                 colorbar="attention", height=420, digits=3))
        for hp in view.patterns
    ]
    return figs

