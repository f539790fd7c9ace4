"""How a dashboard page is served: the templates, the full page or htmx fragment, the page frame (title,
JSON twin, model picker and navigation) and `Page`, the page of an analysis.

All state is in the URL: pickers are GET forms with hx-get + hx-push-url, so a pasted link, a reload and the
back button show the same screen. For an htmx request (`HX-Request: true`, not a history restore nor a
boosted link) only the swapped block is rendered: the block named like the request's `HX-Target` element id
when the page declares it, else the page's first block. Every answer sends `Vary: HX-Request`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NotRequired, TypedDict, TypeVar
from urllib.parse import urlencode

from fastapi import Request
from fastapi.responses import Response
from jinja2_fragments.fastapi import Jinja2Blocks

from app import charts, snippets
from app.analysis import API, AnalysisParams, Declared, P, V, cache_key, json_url, run, validate
from app.deps import get_model
from app.errors import kind_of
from app.figure_output import for_page
from app.glossary import term_anchors
from app.labels import visible
from app.registry import ModelRegistry
from app.routers.navigation import model_nav, nav_note
from app.routers.page_cache import cached_page, encode_page_key, html_page, keep_page
from app.scheduling import cheap, compute, current_service, is_cached
from app.scheduling.flights import JobPending
from app.settings import REPO_ROOT, Limits
from app.views.shared.basis import basis, changes_weights
from app.views.shared.inputs import max_prompt_tokens
from circuits_core.errors import QkovError
from circuits_core.formats.checkpoint import LoadedModel

PP = TypeVar("PP", bound=AnalysisParams)  # a page's params: its analysis's, or a page model extending them
# What a page's context hands its template: the names the template reads (a view, figures, refusals, form state).
PageContext = Mapping[str, object]


class Refusal(TypedDict):
    """A refusal shown inside a page's panel (status 4xx/5xx), or the progress of the job computing it (202)."""

    status: int
    title: str
    detail: str
    job: NotRequired[dict[str, Any]]


class PageFrame(TypedDict):
    """What base.html needs (page_context): the title, the JSON twin, the model and the navigation entry shown as
    current; on a full page (not an htmx fragment) the model picker, and on a model's page its navigation."""

    title: str
    json_url: str
    model_id: str | None
    nav: str | None
    models: NotRequired[list[str]]
    here: NotRequired[str]  # the current path: the model picker's script keeps it up to date when htmx pushes
    model_nav: NotRequired[list[tuple[str, str, str]]]  # (key, label, URL) of the pages that apply to the model
    nav_note: NotRequired[str | None]  # which pages this model has not, and why
    view_note: NotRequired[str | None]  # why the current page does not apply to this model


class AnalysisContext(TypedDict):
    """The context of a page showing one analysis (default_context): its view, or the refusal, and its params."""

    view: Any  # the analysis's view (its own BaseModel), None when refused
    error: Refusal | None
    params: AnalysisParams


class BasisContext(TypedDict):
    """The basis picker's state (basis_choice): the weights asked for (None: as served), whether raw ones differ from
    the served ones, and the served basis's name."""

    basis: str | None
    basis_differs: bool
    served_basis: str


templates = Jinja2Blocks(directory=str(REPO_ROOT / "templates"))
templates.env.policies["json.dumps_kwargs"] = {"separators": (",", ":")}  # compact figure JSON
templates.env.filters["visible"] = visible  # tokens shown with whitespace and control characters visible
templates.env.filters["for_page"] = for_page  # a figure escaped for plotly and height-capped
templates.env.globals["glossary_terms"] = term_anchors  # base.html embeds them for static/glossary.js
templates.env.globals["charts"] = charts  # a template may draw its view's charts itself
# The shared macros as a global `m`: a top-level {% import %} is not run when a single block is rendered.
templates.env.globals["m"] = templates.env.get_template("_macros.html").module


def url(path: str, **params: Any) -> str:
    """`path?query` with the parameters that are set (None and '' are left out)."""
    query = {k: v for k, v in params.items() if v is not None and v != ""}
    return f"{path}?{urlencode(query)}" if query else path


def is_fragment(request: Request) -> bool:
    h = request.headers
    return (
        h.get("HX-Request") == "true"
        and h.get("HX-History-Restore-Request") != "true"
        and h.get("HX-Boosted") != "true"
    )


async def model_ids(registry: ModelRegistry, request: Request | None = None) -> list[str]:
    """The models of the picker: one rescan of the folders per request (kept on `request.state`, since the page
    key and the page frame both need them)."""
    kept: list[str] | None = getattr(request.state, "model_ids", None) if request is not None else None
    if kept is None:
        kept = [e.id for e in await cheap(registry.entries)]
        if request is not None:
            request.state.model_ids = kept
    return kept


def refusal(exc: QkovError | JobPending) -> Refusal:
    """A refusal shown inside the page's panel (its form kept, so the input can be fixed), or the progress of
    the job computing it (status 202: the page is not kept, and polls the job)."""
    if isinstance(exc, JobPending):
        return {"status": 202, "title": "Computing", "detail": str(exc), "job": exc.job}
    kind = kind_of(exc)
    return {"status": kind.status, "title": kind.title, "detail": str(exc)}


async def attempt(fn: Any, *args: Any, key: Any = None) -> tuple[Any, Refusal | None]:
    """Run a function through `compute`: (value, None), or (None, refusal) for a QkovError."""
    try:
        return await compute(fn, *args, key=key), None
    except (QkovError, JobPending) as exc:
        return None, refusal(exc)


def render(request: Request, template: str, context: PageContext, blocks: Sequence[str] = ("main",)) -> Response:
    """The full page, or for htmx only the block the request targets (default: the first of `blocks`).
    Refusals in the context (keys ending in 'error') set the status; they are not pushed to history."""
    context = {"request": request, "API": API, "url": url, **context}
    errors: list[dict[str, Any]] = [v for k, v in context.items() if k.endswith("error") and isinstance(v, dict)]
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


async def page_context(
    request: Request,
    registry: ModelRegistry,
    title: str,
    json_link: str,
    model_id: str | None = None,
    nav: str | None = None,
) -> PageFrame:
    """What base.html needs: the title, the JSON twin, the model picker and the model's navigation."""
    ctx: PageFrame = {"title": title, "json_url": json_link, "model_id": model_id, "nav": nav}
    if not is_fragment(request):
        ctx["models"] = await model_ids(registry, request)
        ctx["here"] = request.url.path  # the model picker's script puts the current URL (htmx pushes) here
        if model_id:
            cfg = (await cheap(registry.get, model_id)).model.cfg  # loaded already by the page's route
            n_layers, attn_only = cfg.n_layers, cfg.attn_only
            views = model_nav(request)
            ctx["model_nav"] = [
                (e.key, e.label, f"/models/{model_id}{e.sub}") for e in views if e.applies(n_layers, attn_only)
            ]
            hidden = [e.label for e in views if not e.applies(n_layers)]
            no_mlp = [e.label for e in views if e.applies(n_layers) and not e.applies(n_layers, attn_only)]
            notes = [nav_note(model_id, n_layers, hidden), nav_note(model_id, n_layers, no_mlp, attn_only=True)]
            ctx["nav_note"] = " ".join(n for n in notes if n) or None
            current = [e for e in views if e.key == nav and not e.applies(n_layers, attn_only)]
            if current:
                ctx["view_note"] = nav_note(
                    model_id, n_layers, [e.label for e in current], attn_only=current[0].applies(n_layers)
                )
    return ctx


# -- the page of an analysis ---------------------------------------------------------------------------------
@dataclass
class PageCall(Generic[PP]):
    """One page request: its typed params, the model, and `run` for the analyses the page shows (typed: the view
    of the analysis it runs)."""

    page: Page[PP]
    request: Request
    registry: ModelRegistry
    limits: Limits
    model_id: str | None
    loaded: LoadedModel | None
    params: PP
    json_params: AnalysisParams | None = None  # the params of the JSON twin, when the page changed them
    title: str | None = None
    keep: bool = True  # False: a part failed only this time (busy, timeout), so the rendered page is not kept
    # analysis name -> its "copy as Python" script, for each analysis run that declares one (templates: `snippets`)
    snippets: dict[str, str] = field(default_factory=dict)

    @property
    def model(self) -> LoadedModel:
        """The loaded model of a model page."""
        if self.loaded is None:
            raise RuntimeError("a server-wide page has no model")
        return self.loaded

    async def run(self, analysis: Declared[P, V], params: P) -> V:
        """Another analysis's answer (priced, cached as its API route would be); errors propagate."""
        subject = self.registry if analysis.scope == "server" else self.loaded
        if analysis.scope == "model":
            params = params.normalised(self.loaded)  # type: ignore[arg-type]
        view = await run(analysis, subject, self.model_id, params, self.limits)
        if analysis.snippet is not None and self.loaded is not None:
            raw = getattr(params, "basis", "served") == "raw"
            dtype = str(self.registry.dtype).removeprefix("torch.")
            body = analysis.snippet(params, view)
            if body is not None:
                self.snippets[analysis.name] = snippets.script(self.loaded.path, dtype, body, raw=raw)
        return view

    def seconds_left(self, analysis: Declared[P, V], params: P) -> float:
        """How long `run` of a model's analysis would compute: 0 when this process keeps its answer already, else its
        price at the server's arithmetic rate (compute_flops_per_s); 0 when it cannot be priced (`run` refuses it)."""
        try:
            params = params.normalised(self.model)
            if analysis.cached(params) and is_cached(cache_key(analysis, self.model_id or "", self.model, params)):
                return 0.0
            return current_service().budgets.estimated_seconds(analysis.priced(self.model, params, self.limits)) or 0.0
        except QkovError:
            return 0.0

    async def attempt(self, analysis: Declared[P, V], params: P) -> tuple[V | None, Refusal | None]:
        """`run`, a refusal (QkovError) returned as the panel's error instead of raised."""
        try:
            return await self.run(analysis, params), None
        except (QkovError, JobPending) as exc:
            return None, refusal(exc)


async def default_context(call: PageCall[Any]) -> AnalysisContext:
    """The page of a simple analysis: its view (or the refusal) and its params."""
    view, error = await call.attempt(call.page.analysis, call.params)
    return {"view": view, "error": error, "params": call.params}


def basis_choice(call: PageCall[Any]) -> BasisContext:
    """The basis picker's state: the weights asked for (None: as served) and whether raw ones differ; every page whose
    params have a `basis` field gets it (serve_page)."""
    b = call.params.basis
    return {
        "basis": b if b != "served" else None,
        "basis_differs": changes_weights(call.model),
        "served_basis": basis(call.model),
    }


@dataclass(frozen=True)
class Page(Generic[PP]):
    """The page of an analysis, the one way to make a page: a template, and `context` (default: the analysis's
    view as `view`, its refusal as `error`, the params as `params`). An analysis's `page=` field makes its Page
    (app/routers/declared_pages.py); a page with a context of its own is listed in app/routers/pages.py PAGES. A
    labelled page is in a model's navigation, at its `order` (ascending: the navigation's order is declared).

    The template gets, beside the context: the frame (title, json_url, model_id, nav, and on full pages models,
    here, model_nav, nav_note, view_note), `limits`, `prompt_cut` (what a too-long prompt lost), `fragment`
    (an htmx block request), and where the params have a `basis` field the basis picker's state (basis,
    basis_differs, served_basis: basis_choice)."""

    analysis: Declared[Any, Any]
    template: str
    context: Callable[[PageCall[PP]], Awaitable[PageContext]] = default_context
    params: type[PP] | None = None  # page params (default: the analysis's); may add page-only fields
    blocks: tuple[str, ...] = ("main",)
    title: str = "{name} · {model}"
    nav: str | None = None  # the navigation entry shown as current (default: the analysis's name)
    path: str | None = None  # the page's route (default: the analysis's page path)
    label: str | None = None  # its entry in a model's navigation (None: not listed, e.g. one head's page)
    order: int | None = None  # its place in the navigation (ascending); given with a label, and only then

    def __post_init__(self) -> None:
        if (self.label is None) != (self.order is None):
            raise ValueError(f"page {self.route}: a navigation label and an order go together")

    @property
    def route(self) -> str:
        return self.path or self.analysis.page_path

    @property
    def key(self) -> str:
        return self.nav or self.analysis.name


async def serve_page(
    page: Page[Any], params: type[AnalysisParams], request: Request, registry: ModelRegistry, limits: Limits
) -> Response:
    """Parse the query (empty form fields are absent), normalise, build the page's context, render."""
    analysis = page.analysis
    query = request.query_params
    raw: dict[str, Any] = {k: v for k, v in query.items() if v != ""}
    fields = params.model_fields
    if "prompt" in fields and "seq_len" not in fields and query.get("prompt") == "" and not query.get("tokens"):
        raw["prompt"] = (
            ""  # refused in its panel, not replaced by the default text (with seq_len: random tokens instead)
        )
    raw.update({k: v for k, v in request.path_params.items() if k != "model"})
    model_id: str | None = request.path_params.get("model")
    loaded = None
    if analysis.scope == "model":  # the same loading (404 / 422) as the API's LoadedModelDep
        loaded = await get_model(model_id or "", registry)
    cut = None
    if loaded is not None and "prompt" in params.model_fields and raw.get("prompt"):
        raw["prompt"], cut = cut_prompt(loaded, raw["prompt"], limits)
        if cut is not None:
            cut["continue_url"] = url(request.url.path, **{**dict(query), "prompt": cut.pop("rest")})
    typed = validate(params, raw)
    if loaded is not None:
        typed = typed.normalised(loaded)
    key = await page_key(request, registry, loaded, page.route) if loaded is not None else None
    if key is not None and (body := await cached_page(request, key)) is not None:
        return html_page(body)
    call = PageCall(page, request, registry, limits, model_id, loaded, typed)
    picker: BasisContext | dict[str, object] = (
        basis_choice(call) if loaded is not None and "basis" in params.model_fields else {}
    )
    context = {**picker, **await page.context(call)}
    twin = call.json_params or analysis.params.model_validate(typed.model_dump())
    title = call.title or page.title.format(name=analysis.summary, model=model_id, **typed.model_dump())
    frame = await page_context(
        request, registry, title, json_url(analysis, model_id, twin), model_id, page.nav or analysis.name
    )
    response = render(
        request,
        page.template,
        {
            **frame,
            "limits": limits,
            "prompt_cut": cut,
            "fragment": is_fragment(request),
            "snippets": call.snippets,
            **context,
        },
        blocks=page.blocks,
    )
    if key is not None and response.status_code == 200 and call.keep:
        await keep_page(request, key, bytes(response.body))
    return response


CONTINUE_CHARS = 4000  # the next part of a cut prompt carried in the "continue" link (the URL stays short)


def cut_prompt(loaded: LoadedModel, prompt: str, limits: Limits) -> tuple[str, dict[str, Any] | None]:
    """A page's prompt cut to the tokens the model takes (min(n_ctx, max_prompt_tokens), BOS included), and
    what was cut (None when nothing was): the page shows the first part and offers to continue with the next,
    instead of refusing the whole prompt."""
    tok = loaded.tokenizer
    if tok is None:
        return prompt, None
    cap = max_prompt_tokens(loaded, limits)
    bos = tok.bos_token_id is not None
    text = prompt[: limits.max_prompt_tokens * 64]  # the Prompt field's own bound, far above cap tokens
    encoding = tok.hf.encode(text, add_special_tokens=False)
    if len(encoding.ids) + bos <= cap and len(text) == len(prompt):
        return prompt, None
    keep = max(1, cap - bos)  # prompt tokens kept
    end = encoding.offsets[min(keep, len(encoding.ids)) - 1][1]
    while end > 0 and len(tok.encode(text[:end], prepend_bos=bos)) > cap:  # re-tokenised, it must still fit
        end -= 1
    return prompt[:end], {
        "kept": len(tok.encode(prompt[:end], prepend_bos=bos)),
        "cap": cap,
        "n_tokens": len(encoding.ids) + bos,
        "more": len(text) < len(prompt),
        "rest": prompt[end : end + CONTINUE_CHARS],
    }


# -- rendered pages, kept like answers (page_cache.py) -----------------------------------------------------------
async def page_key(request: Request, registry: ModelRegistry, loaded: LoadedModel, route: str) -> str:
    """A rendered page depends on the model's files (digest), the URL (path and query), whether htmx asked for a
    block (and which), and the models in the picker; the same string keys it in the cache and the store."""
    return encode_page_key(
        str(loaded.digest),
        route,
        request.url.path,
        request.query_params.multi_items(),
        (request.headers.get("HX-Request", ""), request.headers.get("HX-Target", "")),
        await model_ids(registry, request),
    )
