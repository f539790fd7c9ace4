"""The routes derived from the analysis declarations (app/analysis.py): one API route per analysis under
/api/v1, one page route per page. Nothing here knows any particular analysis.

API route `GET /api/v1/models/{model}/<path>`: its parameters are the fields of the analysis's params model
bound to the app's limits (names, types, descriptions and bounds in the OpenAPI schema); the handler
validates them into the params object, normalises it against the model, prices it and builds it through a
compute slot (app.analysis.run). Page route `GET /models/{model}/<path>`: the same params model parsed from
the query string (an empty form field counts as absent), then the page's context and template
(app/routers/rendering.py).
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response

from app.analysis import AnalysisParams, BoundAnalyses, Declared, HeadField, HeadsField, Limit, run_json, validate
from app.deps import MODEL_PATH, LimitsDep, LoadedModelDep, RegistryDep
from app.routers.rendering import Page, serve_page

MARKERS = (Limit, HeadField, HeadsField)


def _signature(
    analysis: Declared[Any, Any], params: type[AnalysisParams], context: list[inspect.Parameter]
) -> inspect.Signature:
    """The endpoint's signature: the context dependencies, then one parameter per params field."""
    fields = []
    path_fields = analysis.path_fields()
    for name, info in params.model_fields.items():
        metadata = [m for m in info.metadata if not isinstance(m, MARKERS)]
        where = Path(description=info.description) if name in path_fields else Query(description=info.description)
        annotation = Annotated[(info.annotation, *metadata, where)]  # type: ignore[valid-type,name-defined]
        default = inspect.Parameter.empty if info.is_required() else info.default
        fields.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default))
    return inspect.Signature([*context, *fields])


def _context(analysis: Declared[Any, Any]) -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    ctx = [inspect.Parameter("limits", kw, annotation=LimitsDep)]
    if analysis.scope == "server":
        return [*ctx, inspect.Parameter("registry", kw, annotation=RegistryDep)]
    return [
        *ctx,
        inspect.Parameter("model", kw, annotation=Annotated[str, MODEL_PATH]),
        inspect.Parameter("loaded", kw, annotation=LoadedModelDep),
    ]


def api_endpoint(analysis: Declared[Any, Any], params: type[AnalysisParams]) -> Any:
    """The API handler of one analysis (its signature generated from the bound params model)."""

    async def endpoint(**kw: Any) -> Any:
        limits, model = kw.pop("limits"), kw.pop("model", None)
        subject = kw.pop("registry") if analysis.scope == "server" else kw.pop("loaded")
        typed = validate(params, kw)
        if analysis.scope == "model":
            typed = typed.normalised(subject)
        return Response(await run_json(analysis, subject, model, typed, limits), media_type="application/json")

    endpoint.__signature__ = _signature(analysis, params, _context(analysis))  # type: ignore[attr-defined]
    endpoint.__name__ = endpoint.__qualname__ = analysis.name.replace("-", "_")
    endpoint.__doc__ = analysis.description
    return endpoint


def api_router(declared: BoundAnalyses) -> APIRouter:
    """GET /api/v1/... for every declared analysis."""
    router = APIRouter()
    for analysis in declared.analyses:
        router.add_api_route(
            analysis.api_path,
            api_endpoint(analysis, declared.bound(analysis)),
            methods=["GET"],
            response_model=analysis.view,
            tags=list(analysis.tags),
            summary=analysis.summary,
            name=analysis.name,
            openapi_extra={"x-qkov-analysis": analysis.name},
        )
    return router


def page_endpoint(page: Page[Any], params: type[AnalysisParams]) -> Any:
    async def endpoint(request: Request, registry: RegistryDep, limits: LimitsDep) -> Response:
        return await serve_page(page, params, request, registry, limits)

    endpoint.__name__ = endpoint.__qualname__ = f"page_{page.analysis.name.replace('-', '_')}"
    return endpoint


def page_router(declared: BoundAnalyses, pages: list[Page[Any]]) -> APIRouter:
    """GET /models/{model}/... (and the tour) for every page."""
    router = APIRouter(include_in_schema=False)
    for page in pages:
        params = declared.bound(page.analysis) if page.params is None else declared.bound_params(page.params)
        router.add_api_route(page.route, page_endpoint(page, params), methods=["GET"], name=f"page:{page.route}")
    return router
