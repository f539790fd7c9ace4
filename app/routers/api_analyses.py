"""JSON API of the engine-2 analyses under /api/v1: composition, path expansions, prompts, chains of heads,
QK paths, term importance and the paper tour. Parse, call a builder through `compute`, return it; no math.
Limits (settings.limits) appear as constraints in the OpenAPI schema; refusals are problem+json (app/errors.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from app.compute import compute
from app.deps import LimitsDep, LoadedModelDep, RegistryDep
from app.routers.api import PREFIX, TOKEN_DOC, Params, cache_key, split_heads
from app.schemas.analyses import (
    ChainView,
    CompositionKindName,
    CompositionPairView,
    CompositionView,
    PathsView,
    PromptView,
    QKPathsView,
    TermImportanceView,
    TourView,
)
from app.settings import Settings
from app.views.composition import build_composition_pair_view, build_composition_view
from app.views.path import build_path_view
from app.views.prompt import build_paths_view, build_prompt_view
from app.views.qk_paths import build_qk_paths_view
from app.views.term_importance import build_term_importance_view
from app.views.tour import build_tour_view

HEAD_DOC = "head name L{layer}H{head}, e.g. L1H4"


def build_router(settings: Settings) -> APIRouter:
    router = APIRouter(prefix=PREFIX)
    p = Params(settings.limits)
    lim = settings.limits

    def target_token(what: str) -> Any:
        return Query(None, max_length=256, description=f"{what}: {TOKEN_DOC}")

    def max_order(default: int = 2) -> Any:
        return Query(min(default, lim.max_order), ge=0, le=lim.max_order, description=f"highest path order listed explicitly (at most {lim.max_order}); the rest is the remainder term")

    # -- composition ------------------------------------------------------------------------------------
    @router.get("/models/{model}/composition", response_model=CompositionView, tags=["composition"], summary="Q/K/V composition scores of every head pair")
    async def composition(
        loaded: LoadedModelDep,
        kind: Annotated[CompositionKindName, Query(description="Q, K or V composition (paper-math 2.9)")] = "K",
    ) -> CompositionView:
        return await compute(build_composition_view, loaded, kind, key=cache_key(loaded, "composition", kind))

    @router.get("/models/{model}/composition/{source}/{target}", response_model=CompositionPairView, tags=["composition"], summary="One head pair: K-composition circuit and virtual head")
    async def composition_pair(
        loaded: LoadedModelDep,
        limits: LimitsDep,
        source: Annotated[str, Path(description=f"the earlier {HEAD_DOC}")],
        target: Annotated[str, Path(description=f"the later {HEAD_DOC}")],
        k: int = p.k(10),
    ) -> CompositionPairView:
        return await compute(build_composition_pair_view, loaded, source, target, k, limits, key=cache_key(loaded, "composition-pair", source, target, k))

    # -- prompts: patterns, logit paths, chains of heads, QK paths --------------------------------------------
    @router.get("/models/{model}/prompt", response_model=PromptView, tags=["prompts"], summary="Tokens and attention patterns of chosen heads")
    async def prompt_view(
        loaded: LoadedModelDep,
        limits: LimitsDep,
        prompt: str | None = p.prompt(),
        tokens: str | None = p.tokens(),
        heads: str | None = p.heads(),
        weighted: bool = Query(False, description="value-weighted patterns A[i, j] ||v_j|| (paper-math 2.16)"),
    ) -> PromptView:
        return await compute(build_prompt_view, loaded, limits, prompt, tokens, split_heads(heads), weighted)

    @router.get("/models/{model}/paths", response_model=PathsView, tags=["prompts"], summary="Path expansion of a logit on a prompt")
    async def paths(
        loaded: LoadedModelDep,
        limits: LimitsDep,
        prompt: str | None = p.prompt(),
        tokens: str | None = p.tokens(),
        position: int | None = Query(None, ge=-lim.max_prompt_tokens, lt=lim.max_prompt_tokens, description="destination position (default: the last; negative counts from the end)"),
        target: str | None = target_token("the logit to expand (default: the model's top prediction at position)"),
        contrast: str | None = target_token("subtract this token's logit (logit difference)"),
        max_order: int = max_order(),
        by_source: bool = Query(False, description="split each listed term over source positions"),
        k: int = p.k(30),
    ) -> PathsView:
        return await compute(build_paths_view, loaded, limits, prompt, tokens, position, target, contrast, max_order, by_source, k)

    @router.get("/models/{model}/path", response_model=ChainView, tags=["prompts"], summary="A chain of heads (virtual head) on a prompt")
    async def path(
        loaded: LoadedModelDep,
        limits: LimitsDep,
        heads: str = Query(..., max_length=lim.max_heads * 12, description=f"comma-separated heads in increasing layers, at most {lim.max_heads}"),
        prompt: str | None = p.prompt(),
        tokens: str | None = p.tokens(),
        target: str | None = target_token("the logit the contribution is measured on (default: top prediction at the last position)"),
        k: int = p.k(20),
    ) -> ChainView:
        return await compute(build_path_view, loaded, limits, split_heads(heads) or [], prompt, tokens, target, k)

    @router.get("/models/{model}/qk-paths", response_model=QKPathsView, tags=["prompts"], summary="Decomposition of a head's attention scores")
    async def qk_paths(
        loaded: LoadedModelDep,
        limits: LimitsDep,
        head: str = Query(..., max_length=16, description=f"{HEAD_DOC}, in layer >= 1"),
        prompt: str | None = p.prompt(),
        tokens: str | None = p.tokens(),
        k: int = p.k(6),
    ) -> QKPathsView:
        return await compute(build_qk_paths_view, loaded, limits, head, prompt, tokens, k)

    # -- term importance and the tour ------------------------------------------------------------------------
    @router.get("/models/{model}/term-importance", response_model=TermImportanceView, tags=["ablation"], summary="Loss by path order and per-head ablations")
    async def term_importance(
        loaded: LoadedModelDep,
        limits: LimitsDep,
        prompt: str | None = p.prompt(),
        tokens: str | None = p.tokens(),
    ) -> TermImportanceView:
        key = cache_key(loaded, "term-importance") if prompt is None and tokens is None else None
        return await compute(build_term_importance_view, loaded, limits, prompt, tokens, key=key)

    @router.get("/tour", response_model=TourView, tags=["tour"], summary="The paper's figures on the shipped models")
    async def tour(registry: RegistryDep, limits: LimitsDep) -> TourView:
        return await compute(build_tour_view, registry, limits, key=("tour",))

    return router
