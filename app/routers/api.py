"""JSON API under /api/v1: parse and validate parameters, call a view builder through `compute`, return it.

No math here: every route is a few lines. Limits come from Settings and appear as constraints in the
OpenAPI schema. Routes are grouped: models, heads & circuits, detectors. Other analyses add their own
app/routers/api_<analysis>.py (see app/routers/__init__.py) using the shared parameters below.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from app import schemas
from app.compute import compute
from app.deps import HEAD_PATH, LimitsDep, LoadedModelDep, ModelEntryDep, RegistryDep
from app.settings import Limits, Settings
from app.views.circuits import build_direct_view, build_ov_view, build_qk_view, build_skip_trigrams_view
from app.views.detectors import build_detectors_view
from app.views.heads import build_copying_view, build_head_view, build_heads_view
from app.views.models import build_model_view, build_models_view, build_tokenize_view
from circuits_core.weights import LoadedModel

PREFIX = "/api/v1"
TOKEN_DOC = "a token id (e.g. 464) or a single-token string (e.g. ' the'); a numeral meant as text goes in double quotes"

HeadName = Annotated[str, HEAD_PATH]


def cache_key(loaded: LoadedModel, view: str, *params: Hashable) -> tuple[Hashable, ...]:
    """The compute-cache key of a weight-derived result: checkpoint digest, view name, parameters."""
    return (str(loaded.digest), view, *params)


class Params:
    """Query parameters whose constraints come from the configured limits (shared by the api_* routers).

    Each method returns a fresh `Query(...)` to use as a parameter default: `k: int = p.k()`.
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self.prompt_chars = limits.max_prompt_tokens * 64

    def token(self) -> Any:
        return Query(None, description=TOKEN_DOC, max_length=256)

    def k(self, default: int = 20) -> Any:
        lim = self.limits.max_k
        return Query(min(default, lim), ge=1, le=lim, description=f"how many entries (at most {lim})")

    def prompt(self) -> Any:
        return Query(
            None,
            max_length=self.prompt_chars,
            description="text, tokenised with the model's tokenizer, BOS prepended (at most "
            f"min(n_ctx, {self.limits.max_prompt_tokens}) tokens)",
        )

    def tokens(self) -> Any:
        return Query(None, max_length=self.prompt_chars, description="comma-separated token ids, used as given (instead of prompt)")

    def heads(self) -> Any:
        lim = self.limits.max_heads
        return Query(None, max_length=lim * 12, description=f"comma-separated head names L{{layer}}H{{head}}, at most {lim}")

    def seq_len(self, default: int = 50) -> Any:
        lim = self.limits.max_seq_len
        return Query(min(default, lim), ge=1, le=lim, description="length T of the random segment r in BOS + r + r")

    def batch(self, default: int = 10) -> Any:
        lim = self.limits.max_batch
        return Query(min(default, lim), ge=1, le=lim, description="number of random sequences")

    def min_count(self) -> Any:
        return Query(
            None, ge=1, le=10**9,
            description="frequent tokens only: keep tokens seen at least this often in training (the model folder's "
            "token_counts.npy; 422 for a model without it). Without it every token is ranked",
        )

    def seed(self) -> Any:
        return Query(0, ge=0, le=2**31 - 1, description="seed of the random tokens")


def split_heads(heads: str | None) -> list[str] | None:
    return [h.strip() for h in heads.split(",") if h.strip()] if heads else None


def build_router(settings: Settings) -> APIRouter:
    router = APIRouter(prefix=PREFIX)
    p = Params(settings.limits)

    # -- models ------------------------------------------------------------------------------------------
    @router.get("/models", response_model=list[schemas.ModelSummary], tags=["models"], summary="List the models")
    async def list_models(registry: RegistryDep) -> list[schemas.ModelSummary]:
        return (await compute(build_models_view, registry)).models

    @router.get(
        "/unavailable-models", response_model=list[schemas.UnavailableModel], tags=["models"],
        summary="Folders in the models directories that hold no loadable checkpoint, with the reason",
    )
    async def list_unavailable(registry: RegistryDep) -> list[schemas.UnavailableModel]:
        return (await compute(build_models_view, registry)).unavailable

    @router.get("/models/{model}", response_model=schemas.ModelSummary, tags=["models"], summary="One model and its card")
    async def get_model(loaded: LoadedModelDep, entry: ModelEntryDep) -> schemas.ModelSummary:
        return build_model_view(loaded, entry)

    @router.get("/models/{model}/tokenize", response_model=schemas.TokenizeView, tags=["models"], summary="Tokenise a prompt")
    async def tokenize(loaded: LoadedModelDep, limits: LimitsDep, prompt: str | None = p.prompt(), tokens: str | None = p.tokens()) -> schemas.TokenizeView:
        return await compute(build_tokenize_view, loaded, prompt, tokens, limits)

    # -- heads and their circuits ------------------------------------------------------------------------
    @router.get("/models/{model}/heads", response_model=schemas.HeadsView, tags=["heads"], summary="Scores of every head")
    async def heads(loaded: LoadedModelDep) -> schemas.HeadsView:
        return await compute(build_heads_view, loaded, key=cache_key(loaded, "heads"))

    @router.get("/models/{model}/heads/{head}", response_model=schemas.HeadView, tags=["heads"], summary="One head: spectra, positional pattern")
    async def head(loaded: LoadedModelDep, head: HeadName) -> schemas.HeadView:
        table = await compute(build_heads_view, loaded, key=cache_key(loaded, "heads"))
        return await compute(build_head_view, loaded, head, table, key=cache_key(loaded, "head", head))

    @router.get("/models/{model}/heads/{head}/copying", response_model=schemas.CopyingMetricsView, tags=["heads"], summary="Copying metrics of the full OV circuit")
    async def copying(loaded: LoadedModelDep, limits: LimitsDep, head: HeadName, k: int = p.k(5)) -> schemas.CopyingMetricsView:
        return await compute(build_copying_view, loaded, head, k, limits, key=cache_key(loaded, "copying", head, k))

    @router.get("/models/{model}/heads/{head}/ov", response_model=schemas.CircuitTopView, tags=["circuits"], summary="Top entries of the full OV circuit")
    async def ov(
        loaded: LoadedModelDep, limits: LimitsDep, head: HeadName, token: str | None = p.token(), k: int = p.k(), min_count: int | None = p.min_count()
    ) -> schemas.CircuitTopView:
        return await compute(build_ov_view, loaded, head, token, k, limits, min_count, key=cache_key(loaded, "ov", head, token, k, min_count))

    @router.get("/models/{model}/heads/{head}/qk", response_model=schemas.CircuitTopView, tags=["circuits"], summary="Top entries of the full QK circuit")
    async def qk(
        loaded: LoadedModelDep,
        limits: LimitsDep,
        head: HeadName,
        token: str | None = p.token(),
        k: int = p.k(),
        side: Literal["query", "key"] = Query("query", description="whether token is the query (its row) or the key (its column)"),
        min_count: int | None = p.min_count(),
    ) -> schemas.CircuitTopView:
        key = cache_key(loaded, "qk", head, token, k, side, min_count)
        return await compute(build_qk_view, loaded, head, token, k, limits, side, min_count, key=key)

    @router.get("/models/{model}/heads/{head}/skip-trigrams", response_model=schemas.SkipTrigramView, tags=["circuits"], summary="Skip-trigrams of a source token")
    async def skip_trigrams(
        loaded: LoadedModelDep, limits: LimitsDep, head: HeadName, token: str | None = p.token(), k: int = p.k(10), min_count: int | None = p.min_count()
    ) -> schemas.SkipTrigramView:
        key = cache_key(loaded, "skip", head, token, k, min_count)
        return await compute(build_skip_trigrams_view, loaded, head, token, k, limits, min_count, key=key)

    @router.get("/models/{model}/direct", response_model=schemas.CircuitTopView, tags=["circuits"], summary="Direct path (bigram table)")
    async def direct(
        loaded: LoadedModelDep, limits: LimitsDep, token: str | None = p.token(), k: int = p.k(), min_count: int | None = p.min_count()
    ) -> schemas.CircuitTopView:
        return await compute(build_direct_view, loaded, token, k, limits, min_count, key=cache_key(loaded, "direct", token, k, min_count))

    # -- detectors ---------------------------------------------------------------------------------------
    @router.get("/models/{model}/detectors", response_model=schemas.DetectorsView, tags=["detectors"], summary="Head detectors on repeated random tokens")
    async def detectors(
        loaded: LoadedModelDep,
        limits: LimitsDep,
        seq_len: int = p.seq_len(),
        batch: int = p.batch(),
        seed: int = p.seed(),
        prompt: str | None = p.prompt(),
        tokens: str | None = p.tokens(),
        heads: str | None = p.heads(),
    ) -> schemas.DetectorsView:
        args = (loaded, limits, seq_len, batch, seed, prompt, tokens, split_heads(heads))
        return await compute(build_detectors_view, *args, key=cache_key(loaded, "detectors", *args[2:7], heads))

    return router
