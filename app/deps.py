"""FastAPI dependencies shared by the API and page routers: settings, registry, the loaded model.

`LoadedModelDep` turns the `{model}` path parameter into a loaded model (loading it in a worker thread on
first use); an unknown or malformed id is a 404, a broken checkpoint a 422, both via app/errors.py.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from app.registry import ModelEntry, ModelRegistry
from app.scheduling import cheap, load
from app.settings import Limits, Settings
from circuits_core.formats.checkpoint import LoadedModel

MODEL_PATH = Path(description="model id: the name of its checkpoint folder (see GET /api/v1/models)")


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_limits(request: Request) -> Limits:
    return get_settings(request).limits


def get_registry(request: Request) -> ModelRegistry:
    registry: ModelRegistry = request.app.state.registry
    return registry


LimitsDep = Annotated[Limits, Depends(get_limits)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]


async def get_model(model: Annotated[str, MODEL_PATH], registry: RegistryDep) -> LoadedModel:
    if registry.is_loaded(model):
        return registry.get(model)
    return await load(registry.get, model)  # a loader thread: never behind the compute slots


async def get_model_entry(model: Annotated[str, MODEL_PATH], registry: RegistryDep) -> ModelEntry:
    return await cheap(registry.entry, model)


LoadedModelDep = Annotated[LoadedModel, Depends(get_model)]
ModelEntryDep = Annotated[ModelEntry, Depends(get_model_entry)]
