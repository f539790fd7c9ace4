"""The app's routers. Each router module exposes `build_router(settings: Settings) -> APIRouter`
(a factory, so that configured limits appear as constraints in the OpenAPI schema).

To add routes: write app/routers/<name>.py with `build_router`, and list "<name>" in ROUTER_MODULES.
API modules (api, api_<analysis>) mount under /api/v1; `pages` is the HTML side; `docs` the API docs page.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

from fastapi import APIRouter

from app.settings import Settings

RouterFactory = Callable[[Settings], APIRouter]

# Included in this order; a module not written yet (pages, api_<x> of another helper) is skipped.
ROUTER_MODULES: tuple[str, ...] = ("api", "api_analyses", "docs", "pages")


def router_factories() -> list[RouterFactory]:
    factories = []
    for name in ROUTER_MODULES:
        if importlib.util.find_spec(f"app.routers.{name}") is None:
            continue
        module = importlib.import_module(f"app.routers.{name}")
        factories.append(module.build_router)
    return factories
