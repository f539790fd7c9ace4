"""The listing routes of the JSON API under /api/v1: the models, the unavailable folders, one model's card.
Every analysis route is derived from its declaration (app/routers/analyses.py, app/catalog.py)."""

from __future__ import annotations

from fastapi import APIRouter

from app import schemas
from app.analysis import API
from app.deps import LoadedModelDep, ModelEntryDep, RegistryDep
from app.registry import ModelRegistry
from app.scheduling import cheap, load
from app.views.models import build_model_view, build_models_view

router = APIRouter(prefix=API)


async def models_view(registry: ModelRegistry) -> schemas.ModelListView:
    """The listing in a plain worker thread when every model is loaded or known broken (registry.settled); else
    in a loader thread (never behind the compute slots that user requests hold)."""
    deadline = registry.deadline()  # one listing wait for the folders' detection and their loads together
    entries = await cheap(registry.entries, deadline)
    if all(registry.settled(e) for e in entries):  # loaded, or known broken: nothing to load
        return await cheap(build_models_view, registry, deadline)
    return await load(build_models_view, registry, deadline)


@router.get("/models", response_model=list[schemas.ModelSummary], tags=["models"], summary="List the models")
async def list_models(registry: RegistryDep) -> list[schemas.ModelSummary]:
    return (await models_view(registry)).models


@router.get(
    "/unavailable-models",
    response_model=list[schemas.UnavailableModel],
    tags=["models"],
    summary="Folders in the models directories that hold no loadable checkpoint, with the reason",
)
async def list_unavailable(registry: RegistryDep) -> list[schemas.UnavailableModel]:
    return (await models_view(registry)).unavailable


@router.get("/models/{model}", response_model=schemas.ModelSummary, tags=["models"], summary="One model and its card")
async def get_model(loaded: LoadedModelDep, entry: ModelEntryDep) -> schemas.ModelSummary:
    return build_model_view(loaded, entry)
