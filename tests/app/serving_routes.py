"""Test-only routes for the serving tests: `compute` called with a slow, stoppable function (so that compute slots
can be held on purpose), a counted one, a priced one, a plain-JSON one, and a client that runs them in-process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import torch
from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel

from app.main import create_app
from app.scheduling import compute, compute_json
from app.scheduling.service import ComputeService
from app.settings import Settings
from circuits_core.cost import Cost
from circuits_core.errors import CancelledError


def slow(seconds: float, should_stop: Callable[[], bool]) -> dict[str, float]:
    """Sleep in small steps, giving up (CancelledError) as soon as the stop flag is set."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if should_stop():
            raise CancelledError(f"slow({seconds}) stopped")
        time.sleep(0.01)
    return {"slept": seconds}


class Tagged(BaseModel):
    tag: str


class Numbers(BaseModel):
    values: list[float]


def add_test_routes(app: FastAPI, calls: list[str] | None = None) -> None:
    calls = calls if calls is not None else []

    @app.get("/api/v1/test/slow")
    async def slow_route(seconds: float) -> dict[str, float]:
        return await compute(slow, seconds)

    @app.get("/api/v1/test/counted")
    async def counted_route(tag: str) -> Tagged:
        def work() -> Tagged:
            calls.append(tag)
            time.sleep(0.3)
            return Tagged(tag=tag)

        return await compute(work, key=("counted", tag))

    @app.get("/api/v1/test/priced")
    async def priced_route(peak: int, answer: int, n: int = 3) -> Response:
        """Priced at (peak, answer) bytes; actually answers n numbers."""

        def work() -> Numbers:
            calls.append(f"priced {n}")
            return Numbers(values=[0.123456789] * n)

        body = await compute_json(work, key=("priced", peak, answer, n), cost=Cost(peak, answer), lower="n or peak")
        return Response(body, media_type="application/json")

    @app.get("/api/v1/test/plain")
    async def plain_route(tag: str) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            calls.append(f"plain {tag}")
            return {"tag": tag, "points": [{"x": 0.5, "y": [1, 2]}]}

        return await compute(work, key=("plain", tag))

    @app.get("/api/v1/test/threads")
    async def threads_route() -> dict[str, int]:
        return await compute(lambda: {"threads": torch.get_num_threads()})

    @app.get("/api/v1/test/dense")
    async def dense_route(nbytes: int) -> dict[str, str]:
        return await compute(lambda: {"ran": "yes"}, dense_bytes=nbytes)


def serving_app(settings: Settings, calls: list[str] | None = None, **update: Any) -> FastAPI:
    app = create_app(settings.model_copy(update=update))
    add_test_routes(app, calls)
    return app


def run(coro_fn: Callable[[httpx.AsyncClient], Any], app: FastAPI) -> Any:
    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as ac:
            return await coro_fn(ac)

    return asyncio.run(main())


def service(app: FastAPI) -> ComputeService:
    svc: ComputeService = app.state.compute
    return svc


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)
