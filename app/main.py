"""The FastAPI application: `create_app(settings)`; `uvicorn app.main:app` serves the default settings.

Models are discovered per listing and loaded lazily (once, under a per-model lock) by the ModelRegistry,
or all at start-up with `QKOV_PRELOAD=true`. Routes: the listings (app/routers/api.py), one API route and
page per declared analysis (app/catalog.py -> app/routers/analyses.py, params bound to this app's limits),
the self-contained API docs at /docs; /openapi.json is FastAPI's schema. No page loads anything from a CDN.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from fastapi import FastAPI
from fastapi.middleware.gzip import GZipMiddleware

from app.analysis import BoundAnalyses
from app.catalog import ANALYSES
from app.errors import install_error_handlers
from app.observability import install_serving
from app.registry import ModelRegistry
from app.routers import analyses, api, docs, pages
from app.routers.pages import PAGES, CachedStaticFiles
from app.settings import REPO_ROOT, Settings

log = logging.getLogger("qkov")

API_DESCRIPTION = """Attention circuits of transformer language models (Elhage et al. 2021, *A Mathematical
Framework for Transformer Circuits*): direct path, QK and OV circuits, skip-trigrams, copying scores and
head detectors, computed on demand from the weights. Heads are named `L{layer}H{head}`. Errors are
RFC 9457 `application/problem+json`. Limits appear as constraints on the parameters."""


def build_route_tables(routes: list[Any]) -> None:
    """FastAPI 0.16x builds each included router's table of effective routes on the first request that reaches it
    (~100 ms for the page routers: the first page of a fresh process took 100 ms where the next took 4 ms from the
    store). Built here at start-up instead; a FastAPI without these tables skips it."""
    for route in routes:
        if hasattr(route, "effective_candidates") and hasattr(route, "effective_low_priority_routes"):
            route.effective_low_priority_routes()
            build_route_tables(route.effective_candidates())


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = (settings if settings is not None else Settings()).on_device()  # budgets of the device computing
    registry = ModelRegistry(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.preload:
            await anyio.to_thread.run_sync(registry.preload)
        build_route_tables(app.router.routes)
        # The ~250k objects of the imports (torch, fastapi, pydantic) and the preloaded models live as long as the
        # process: frozen, a full collection no longer walks them (it paused every thread for 0.1-0.4 s under load).
        gc.collect()
        gc.freeze()
        yield
        app.state.compute.stop_all()  # the computations still running stop (their threads would outlive the app)

    app = FastAPI(
        title="qkov",
        version="1.0.0",
        description=API_DESCRIPTION,
        docs_url=None,  # the default docs load Swagger UI from a CDN; /docs is served by app/routers/docs.py
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.registry = registry
    install_error_handlers(app)
    install_serving(app, settings)  # compute pool + cache, request ids, metrics, ETags, /healthz /readyz /metrics
    # Compression runs on the event loop: level 4 took 19 ms for a 365 KB answer where the default 9 took 131 ms
    # (3 % larger output), time every other request waited.
    app.add_middleware(GZipMiddleware, minimum_size=1024, compresslevel=4)
    static = REPO_ROOT / "static"
    if static.is_dir():
        app.mount("/static", CachedStaticFiles(directory=static), name="static")
    declared = BoundAnalyses(ANALYSES, settings.limits)  # every analysis's params, bound to this app's limits
    app.state.analyses = declared
    app.include_router(api.router)  # listings
    app.include_router(analyses.api_router(declared))  # one route per declared analysis
    app.include_router(docs.router)
    app.state.pages = PAGES  # every page, in the navigation's order (app/routers/navigation.py model_nav)
    app.include_router(pages.router)  # the models listing and the model picker
    app.include_router(analyses.page_router(declared, PAGES))  # one route per page
    return app


app = create_app()
