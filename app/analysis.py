"""One declaration per analysis; the API route, the page route, the OpenAPI constraints, the cache key and the
JSON-twin link are all derived from it (docs/design.md §2).

An analysis is declared once, beside its builder in app/views/<topic>.py (app/views/attention_entropy.py):

    class EntropyParams(AnalysisParams):
        prompt: Prompt = None
        tokens: Tokens = None

    ATTENTION_ENTROPY = Analysis(
        name="attention-entropy", path="attention-entropy", params=EntropyParams, view=EntropyView,
        build=build_entropy_view,        # (loaded, params, limits) -> view: calls the engine
        cost=entropy_cost,               # (loaded, params, limits) -> Cost: the engine's own estimate
        summary="Attention entropy of every head", tags=["prompts"],
        needs_layers=1,                  # a model with fewer attention layers leaves its page out of the navigation
        page=OwnPage(template="attention_entropy.html", nav=100),  # its page (app/page_spec.py; None: API only)
    )

and app/catalog.py finds it there (every declaration in a module of app/views). From it come:
- `GET /api/v1/models/{model}/<path>`: one query (or path, when `{name}` is in `path`) parameter per field of the
  params model, with the field's type, description and bounds in the OpenAPI schema;
- its page `GET /models/{model}/<path>`, full or htmx fragment, from its `page` (app/page_spec.py: a template of its
  own, or the shared page of one number per head), made a `Page` by app/routers/declared_pages.py (a page with a
  context of its own is a `Page(...)` in app/routers/pages.py PAGES; the one way to make a page: rendering.py);
- bounds from the settings: a field annotated with `Limit("max_k")` gets `le=settings.limits.max_k` (see
  `bounded`), applied once per app in create_app, so every limit is visible in the schema;
- the cache key (`cache_key`): model id, the digest of every answer-changing file (`loaded.digest`: weights,
  tokenizer, token counts, qkov.json), analysis name and the normalised params as canonical JSON;
- the price check: `cost(loaded, params, limits)` runs before a compute slot is taken (app/scheduling/ compares it
  with the budget);
- the JSON-twin link of the page (`json_url`).

Params are normalised once (`AnalysisParams.normalised`: head names canonical, e.g. "l1h04" -> "L1H4") before
they reach the cache key, the builder and the JSON link, so the copies cannot drift.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Generic, Literal, Self, TypeVar
from urllib.parse import quote, urlencode

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from starlette.concurrency import run_in_threadpool

from app.page_spec import PageSpec
from app.refusal_advice import refused_on_nonfinite, with_advice
from app.registry import ModelRegistry
from app.scheduling import cached_build, compute, compute_json, current_service
from app.settings import Limits
from circuits_core.cost import Cost
from circuits_core.errors import LimitExceededError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.formats.lazy_mlp import check_deferred_load
from circuits_core.model.head_names import head_name, parse_head

API = "/api/v1"


@dataclass(frozen=True)
class Limit:
    """Marks a field bound by the settings: `Annotated[int, Limit("max_k")]` -> `le=limits.max_k`.

    `constraint` is the pydantic constraint set ("le", "lt", "ge", "max_length"); its value is
    `getattr(limits, attr) * scale`."""

    attr: str
    constraint: Literal["le", "lt", "ge", "max_length"] = "le"
    scale: int = 1

    def value(self, limits: Limits) -> int:
        return int(getattr(limits, self.attr)) * self.scale


class HeadField:
    """Marks a str field holding one head name (normalised to L{layer}H{head} against the model)."""


class HeadsField:
    """Marks a str field holding comma-separated head names (each normalised; order kept)."""


class AnalysisParams(BaseModel):
    """Base of every analysis's parameters. Fields are query (or path) parameters of the same name."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    def normalised(self, loaded: LoadedModel) -> Self:
        """The same params with head names canonical (NotFoundError / InvalidInputError on a bad head)."""
        cfg = loaded.model.cfg
        update: dict[str, Any] = {}
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if not isinstance(value, str):
                continue
            if any(isinstance(m, HeadField) for m in info.metadata):
                update[name] = head_name(*parse_head(value, cfg))
            elif any(isinstance(m, HeadsField) for m in info.metadata):
                update[name] = ",".join(head_name(*parse_head(h, cfg)) for h in split_heads(value))
        return self.model_copy(update=update) if update else self


def split_heads(heads: str | None) -> list[str]:
    """ "L0H1, L1H2" -> ["L0H1", "L1H2"] (empty items dropped)."""
    return [h.strip() for h in heads.split(",") if h.strip()] if heads else []


P = TypeVar("P", bound=AnalysisParams)
V = TypeVar("V", bound=BaseModel)


@dataclass(frozen=True, kw_only=True)
class Declared(Generic[P, V]):
    """What every declaration has (see the module docstring): a model's `Analysis`, or the one `ServerAnalysis`."""

    scope: ClassVar[Literal["model", "server"]]
    name: str  # unique; part of the cache key
    path: str  # below /models/{model} ("heads/{head}/ov"); absolute ("/tour") for a ServerAnalysis
    params: type[P]
    view: type[V]
    summary: str
    tags: list[str]
    cache: bool | Callable[[P], bool] = True  # keep answers in the result cache (per params when callable)
    description: str | None = None
    # "copy as Python" (app/snippets/): (params, view) -> the circuits_core calls, after the model's load, that leave
    # the panel's numbers in `result`, keyed like the view's JSON fields; every page that runs the analysis offers it
    # (None from the function: no snippet for these params, e.g. an input only the server has)
    snippet: Callable[[P, V], str | None] | None = None

    @property
    def api_path(self) -> str:
        return API + self.page_path

    @property
    def page_path(self) -> str:
        return self.path if self.scope == "server" else f"/models/{{model}}/{self.path}".rstrip("/")

    def path_fields(self) -> list[str]:
        return [n for n in self.params.model_fields if "{" + n + "}" in self.path]

    def cached(self, params: P) -> bool:
        return self.cache(params) if callable(self.cache) else self.cache

    def built(self, subject: Any, params: P, limits: Limits) -> V:
        """build(subject, params, limits): subject is the loaded model, or the registry of a ServerAnalysis."""
        raise NotImplementedError

    def priced(self, subject: Any, params: P, limits: Limits) -> Cost:
        """cost(subject, params, limits)."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class Analysis(Declared[P, V]):
    """One analysis of one model. `build` and `cost` take the params class declared in `params` (or a base of it) and
    `build` returns `view`: mypy rejects a declaration whose builder or cost takes other params."""

    scope: ClassVar[Literal["model", "server"]] = "model"
    build: Callable[[LoadedModel, P, Limits], V]  # calls the engine
    cost: Callable[[LoadedModel, P, Limits], Cost]  # the engine's estimate, priced before a slot is taken
    # the model's attention layers the analysis needs: a model with fewer leaves its page out of the navigation and
    # says why (app/routers/navigation.py nav_note)
    needs_layers: int = 0
    # reads an MLP (a writer's table): an attention-only model leaves its page out of the navigation and says why
    needs_mlp: bool = False
    # "attention": reads only the attention, norm, embedding and unembedding weights (never a deferred MLP weight,
    # formats/lazy_mlp.py; checked by tests/app/test_lazy_weights.py); "all": priced with the MLP weights it would load
    weights: Literal["attention", "all"] = "all"
    page: PageSpec | None = None  # its page and navigation entry (app/page_spec.py); None: the API alone

    def built(self, subject: LoadedModel, params: P, limits: Limits) -> V:
        return self.build(subject, params, limits)

    def priced(self, subject: LoadedModel, params: P, limits: Limits) -> Cost:
        if self.weights == "all":
            check_deferred_load(subject.model)  # the MLP weights it would read first: refused before they are
        return self.cost(subject, params, limits)


@dataclass(frozen=True, kw_only=True)
class ServerAnalysis(Declared[P, V]):
    """An analysis over the server's models (the tour): built from the registry, keyed by the models it reads."""

    scope: ClassVar[Literal["model", "server"]] = "server"
    build: Callable[[ModelRegistry, P, Limits], V]
    cost: Callable[[ModelRegistry, P, Limits], Cost]  # loads the models it reads, as the build does
    # (registry, params) -> the digests of the models the answer reads, part of its cache key (so a model whose files
    # change, or that appears or goes, never gets another version's answer)
    reads: Callable[[ModelRegistry, P], tuple[str, ...]]

    def built(self, subject: ModelRegistry, params: P, limits: Limits) -> V:
        return self.build(subject, params, limits)

    def priced(self, subject: ModelRegistry, params: P, limits: Limits) -> Cost:
        return self.cost(subject, params, limits)


SAID = {"le": "at most {}", "lt": "below {}", "ge": "at least {}", "max_length": "max length {}"}


def bounded(params: type[P], limits: Limits) -> type[P]:
    """`params` with every `Limit` turned into its constraint from `limits` (defaults clipped to the bound)."""
    overrides: dict[str, Any] = {}
    for name, info in params.model_fields.items():
        marks = [m for m in info.metadata if isinstance(m, Limit)]
        if not marks:
            continue
        bounds = {m.constraint: m.value(limits) for m in marks}
        default = info.default
        if "le" in bounds and isinstance(default, int) and not isinstance(default, bool):
            default = min(default, bounds["le"])
        said = ", ".join(SAID[c].format(v) for c, v in bounds.items())
        description = f"{with_limits(info.description or name, limits)} [server limit: {said}]"
        kept = [m for m in info.metadata if not isinstance(m, Limit)]
        annotation = Annotated[(info.annotation, *kept, Field(description=description, **bounds))]  # type: ignore[valid-type,name-defined]
        overrides[name] = (annotation, ... if info.is_required() else default)
    if not overrides:
        return params
    model: type[P] = create_model(params.__name__, __base__=params, __module__=params.__module__, **overrides)
    return model


def with_limits(text: str, limits: Limits) -> str:
    """`text` with each `{limit_name}` replaced by the limit's value (other braces, e.g. L{layer}H{head}, kept)."""
    for limit, value in limits.model_dump().items():
        text = text.replace("{" + limit + "}", str(value))
    return text


def validate(params: type[P], raw: dict[str, Any]) -> P:
    """Parse raw values (query strings...) into `params`; errors raise FastAPI's RequestValidationError (422)."""
    try:
        return params.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("query", *e["loc"])} for e in exc.errors(include_url=False)]
        ) from exc


# -- derived: cache key, JSON link, running ------------------------------------------------------------------
def canonical(params: AnalysisParams) -> str:
    """The normalised params as canonical JSON (sorted keys, every field, defaults included)."""
    return json.dumps(params.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def cache_key(
    analysis: Declared[Any, Any], model_id: str, loaded: LoadedModel, params: AnalysisParams
) -> tuple[str, ...]:
    """Model id, digest of every answer-changing file, analysis name, normalised params."""
    return (model_id, str(loaded.digest), analysis.name, canonical(params))


def server_key(analysis: ServerAnalysis[P, Any], registry: ModelRegistry, params: P) -> tuple[str, ...]:
    """A server-wide analysis: its name, the digests of the models it reads, normalised params."""
    return (analysis.name, *analysis.reads(registry, params), canonical(params))


def json_url(analysis: Declared[Any, Any], model_id: str | None, params: AnalysisParams) -> str:
    """The API twin of a page: path parameters filled in, the set query parameters (None and '' left out)."""
    values = params.model_dump(mode="json")
    path = analysis.api_path.replace("{model}", quote(model_id or "", safe=""))
    for name in analysis.path_fields():
        path = path.replace("{" + name + "}", quote(str(values.pop(name)), safe=""))
    query = {
        k: ("true" if v is True else "false" if v is False else v)
        for k, v in values.items()
        if v is not None and v != ""
    }
    return f"{path}?{urlencode(query)}" if query else path


def lower_hint(analysis: Declared[Any, Any]) -> str:
    """What to lower when a request is over budget: the params bounded by the limits."""
    names = [n for n, info in analysis.params.model_fields.items() if any(isinstance(m, Limit) for m in info.metadata)]
    return f"lower {', '.join(names)}" if names else ""


def _priced(analysis: Declared[P, V], subject: Any, model_id: str | None, params: P, limits: Limits) -> dict[str, Any]:
    """The keyword arguments of compute: the cost (the engine's estimate), the cache key, what to lower.

    An answer the analysis does not keep (a prompt of the reader's own) is still keyed when its price is over the
    inline budget: a job is polled by its key, so a long custom-prompt request runs as a job instead of being refused
    for the request deadline (its answer is then kept like any other)."""
    cost = analysis.priced(subject, params, limits)
    key: tuple[str, ...] | None = None
    if analysis.cached(params) or current_service().budgets.mode(cost) == "job":
        key = (
            server_key(analysis, subject, params)
            if isinstance(analysis, ServerAnalysis)
            else cache_key(analysis, model_id or "", subject, params)
        )
    return {"cost": cost, "key": key, "lower": lower_hint(analysis)}


async def _price(
    analysis: Declared[P, V], subject: Any, model_id: str | None, params: P, limits: Limits
) -> dict[str, Any]:
    """`_priced`; a server-wide analysis in a thread, since its price and key load the models it reads (a model
    load must never hold the event loop that answers health checks and cached pages)."""
    if analysis.scope == "server":
        return await run_in_threadpool(_priced, analysis, subject, model_id, params, limits)
    return _priced(analysis, subject, model_id, params, limits)


async def run(analysis: Declared[P, V], subject: Any, model_id: str | None, params: P, limits: Limits) -> V:
    """Price, then build through a compute slot (cached under `cache_key` when the analysis says so): the view."""
    kw = await _price(analysis, subject, model_id, params, limits)
    try:
        with refused_on_nonfinite(subject):
            return await compute(analysis.built, subject, params, limits, view=analysis.view, **kw)
    except LimitExceededError as exc:
        raise with_advice(exc, analysis.path, lambda q: analysis.priced(subject, q, limits), params, kw) from None


async def run_json(analysis: Declared[P, V], subject: Any, model_id: str | None, params: P, limits: Limits) -> bytes:
    """Like `run`, the answer encoded as JSON inside the slot (the API's answer)."""
    kw = await _price(analysis, subject, model_id, params, limits)
    try:
        with refused_on_nonfinite(subject):
            return await compute_json(analysis.built, subject, params, limits, **kw)
    except LimitExceededError as exc:
        raise with_advice(exc, analysis.path, lambda q: analysis.priced(subject, q, limits), params, kw) from None


def build_cached(analysis: Analysis[P, V], loaded: LoadedModel, model_id: str, params: P, limits: Limits) -> V:
    """Inside a computation (a worker thread): another analysis's answer, from the result cache when there,
    else built here and kept (e.g. the head view reuses the heads table)."""
    key = cache_key(analysis, model_id, loaded, params)
    return cached_build(key, analysis.view, lambda: analysis.build(loaded, params, limits))


@dataclass
class BoundAnalyses:
    """The declared analyses of an app, with their params bound to the app's limits (made once in create_app)."""

    analyses: list[Declared[Any, Any]]
    limits: Limits
    params: dict[str, type[AnalysisParams]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [a.name for a in self.analyses]
        if len(set(names)) != len(names):
            raise ValueError(f"analysis names must be unique: {names}")
        self.params = {a.name: bounded(a.params, self.limits) for a in self.analyses}

    def bound(self, analysis: Declared[Any, Any]) -> type[AnalysisParams]:
        return self.params[analysis.name]

    def bound_params(self, params: type[AnalysisParams]) -> type[AnalysisParams]:
        """Another params model (a page's) bound to the same limits."""
        return bounded(params, self.limits)
