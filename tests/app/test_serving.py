"""Serving: bounded compute slots (503 + Retry-After), stop flags, single-flight + result cache, refusals of every
limit, ETag/304, rate limit 429, request ids and JSON logs, metrics, health and readiness.

Apps are built on the session's tiny models (tests/app/conftest.py) with serving settings changed per test;
test-only routes call `compute` with a slow, stoppable function so that slots can be held on purpose.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import Response
from fastapi.testclient import TestClient
from pydantic import BaseModel

from app.cache import ENTRY_OVERHEAD, ResultCache
from app.logs import JsonFormatter
from app.main import create_app
from app.scheduling import cheap, compute, compute_json
from app.scheduling.service import ComputeService
from app.settings import Settings
from circuits_core.cost import Cost
from circuits_core.errors import CancelledError
from tests.app.conftest import assert_problem

PROMPT_41 = ",".join(["5"] * 41)  # one token over the max_prompt_tokens=40 of the test limits


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


# -- bounded pool -----------------------------------------------------------------------------------------
def test_all_slots_busy_past_the_wait_gives_503_with_retry_after(settings: Settings) -> None:
    app = serving_app(settings, compute_slots=1, slot_wait_s=0.2)

    async def scenario(ac: httpx.AsyncClient) -> None:
        first = asyncio.create_task(ac.get("/api/v1/test/slow", params={"seconds": 0.8}))
        await wait_for(lambda: service(app).slots.in_use == 1)
        busy = await ac.get("/api/v1/test/slow", params={"seconds": 0.01})
        body = assert_problem(busy, 503, "compute slots", "busy")
        assert body["type"].endswith(":busy")
        assert int(busy.headers["Retry-After"]) >= 1
        assert (await first).status_code == 200
        assert (await ac.get("/api/v1/test/slow", params={"seconds": 0.01})).status_code == 200  # nothing broke
        assert service(app).slots.in_use == 0 and service(app).stats.rejected_busy == 1

    run(scenario, app)


def test_cheap_work_never_waits_for_a_slot(settings: Settings) -> None:
    """With every slot held by a long computation and a 0.2 s slot wait, anything that needed a slot would get
    503: listings, the model summary, health, static files, cached API answers and pages whose panels are cached."""
    app = serving_app(settings, compute_slots=2, slot_wait_s=0.2)
    m = "/api/v1/models/tiny-2l"
    cheap = [
        "/healthz",
        "/api/v1/models",
        "/api/v1/unavailable-models",
        m,
        "/static/qkov.css",
        f"{m}/heads",
        f"{m}/heads/L1H0/ov?k=5",
        "/models/tiny-2l/heads/L1H0",
        "/",
        "/models/tiny-2l/direct",
    ]

    async def scenario(ac: httpx.AsyncClient) -> None:
        for url in cheap:  # warm: models loaded (or known broken), answers cached
            await ac.get(url)
        held = [asyncio.create_task(ac.get("/api/v1/test/slow", params={"seconds": 30})) for _ in range(2)]
        await wait_for(lambda: service(app).slots.in_use == 2)
        answers = {url: (await ac.get(url)).status_code for url in cheap}
        assert answers == {url: 200 for url in cheap}
        assert service(app).stats.rejected_busy == 0
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)

    run(scenario, app)


def test_deadline_sets_the_stop_flag_and_frees_the_slot(settings: Settings) -> None:
    app = serving_app(settings, compute_slots=1, slot_wait_s=5.0, request_timeout_s=0.3)

    async def scenario(ac: httpx.AsyncClient) -> None:
        late = await ac.get("/api/v1/test/slow", params={"seconds": 60})
        assert_problem(late, 503, "deadline")
        assert "Retry-After" in late.headers
        # the 60 s computation stopped, so its only slot is free well within the 5 s wait
        assert (await ac.get("/api/v1/test/slow", params={"seconds": 0.01})).status_code == 200
        assert service(app).stats.cancelled == 1

    run(scenario, app)


def test_abandoned_request_stops_its_computation(settings: Settings) -> None:
    app = serving_app(settings, compute_slots=1, slot_wait_s=5.0)

    async def scenario(ac: httpx.AsyncClient) -> None:
        gone = asyncio.create_task(ac.get("/api/v1/test/slow", params={"seconds": 60}))
        await wait_for(lambda: service(app).slots.in_use == 1)
        gone.cancel()  # the client goes away: the request's task is cancelled (what it answers nobody reads)
        await asyncio.gather(gone, return_exceptions=True)
        await wait_for(lambda: service(app).slots.in_use == 0)
        assert service(app).stats.cancelled == 1
        assert (await ac.get("/api/v1/test/slow", params={"seconds": 0.01})).status_code == 200

    run(scenario, app)


def test_identical_requests_compute_once_then_hit_the_cache(settings: Settings) -> None:
    calls: list[str] = []
    app = serving_app(settings, calls, compute_slots=2)

    async def scenario(ac: httpx.AsyncClient) -> None:
        answers = await asyncio.gather(*(ac.get("/api/v1/test/counted", params={"tag": "a"}) for _ in range(6)))
        assert [a.json() for a in answers] == [{"tag": "a"}] * 6
        assert calls == ["a"]  # single flight
        assert service(app).stats.shared >= 1
        again = await ac.get("/api/v1/test/counted", params={"tag": "a"})
        assert again.json() == {"tag": "a"} and calls == ["a"]  # cached
        await ac.get("/api/v1/test/counted", params={"tag": "b"})
        assert calls == ["a", "b"]
        cache = service(app).cache
        assert cache.hits >= 1 and cache.bytes > 0 and len(cache) == 2

    run(scenario, app)


def test_result_cache_keeps_within_its_byte_budget() -> None:
    entry = 150 + len("k0") + ENTRY_OVERHEAD  # what one entry holds: its bytes, its key, the fixed overhead
    cache = ResultCache(budget_bytes=2 * entry + 10)
    for i in range(4):
        assert cache.put(f"k{i}", b"x" * 150)
    assert cache.bytes == 2 * entry and len(cache) == 2 and cache.evictions == 2
    assert cache.get("k0") is None
    assert cache.get("k3") == b"x" * 150
    assert not cache.put("huge", b"x" * 1000) and cache.peek("huge") is None
    assert cache.hit_rate == 0.5
    with pytest.raises(TypeError, match="bytes"):
        cache.put("object", {"not": "encoded"})  # type: ignore[arg-type]


def test_plain_json_data_is_cached_too(settings: Settings) -> None:
    calls: list[str] = []
    app = serving_app(settings, calls)
    with TestClient(app) as c:
        first, again = (c.get("/api/v1/test/plain", params={"tag": "p"}).json() for _ in range(2))
    assert first == again == {"tag": "p", "points": [{"x": 0.5, "y": [1, 2]}]} and calls == ["plain p"]
    assert service(app).cache.peek("plain|p") == b'{"tag":"p","points":[{"x":0.5,"y":[1,2]}]}'


def test_cached_answers_are_their_json_bytes(settings: Settings) -> None:
    calls: list[str] = []
    app = serving_app(settings, calls)

    async def scenario(ac: httpx.AsyncClient) -> None:
        first = await ac.get("/api/v1/test/counted", params={"tag": "z"})
        key = "counted|z"
        body = service(app).cache.peek(key)
        assert body is not None and first.json() == json.loads(body)
        assert service(app).cache.bytes == len(body) + len(key) + ENTRY_OVERHEAD
        priced = await ac.get("/api/v1/test/priced", params={"peak": 1, "answer": 1, "n": 4})
        cached = service(app).cache.peek("priced|1|1|4")
        assert priced.content == cached and priced.json() == {"values": [0.123456789] * 4}

    run(scenario, app)


def test_each_computation_runs_with_the_configured_threads(settings: Settings) -> None:
    from app.scheduling.service import ComputeService
    from app.scheduling.slots import default_torch_threads
    from circuits_core.schedule import available_cores

    with TestClient(serving_app(settings, compute_slots=2)) as c:  # default: cores // slots, set in the worker
        assert c.get("/api/v1/test/threads").json() == {"threads": default_torch_threads(2)}
    with TestClient(serving_app(settings, compute_slots=2, torch_threads=3)) as c:
        assert c.get("/api/v1/test/threads").json() == {"threads": 3}

    async def alone() -> int:  # without a fixed count: cores // computations running (here one)
        return await ComputeService(slots=2, torch_threads=None).run(torch.get_num_threads, (), {}, None)

    assert asyncio.run(alone()) == available_cores()


def thread_nice(tid: int) -> int:
    """A thread's nice value from /proc (field 19 of its stat line), independent of os.getpriority."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


@pytest.mark.skipif(not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"), reason="Linux only")
def test_computations_run_nicer_than_cheap_work_and_their_torch_threads_too() -> None:
    """Compute threads (and the torch intra-op threads they start) run `nice` steps nicer than the process, so
    the event loop and cheap work get a core first; cheap work keeps the process's priority."""
    import threading

    base = thread_nice(threading.get_native_id())

    def heavy() -> dict[str, Any]:
        before = set(os.listdir("/proc/self/task"))
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        (a @ a).sum()  # starts this thread's intra-op workers, if it has none yet
        started = set(os.listdir("/proc/self/task")) - before
        return {"self": thread_nice(threading.get_native_id()), "started": [thread_nice(int(t)) for t in started]}

    async def scenario() -> tuple[dict[str, Any], int]:
        service = ComputeService(slots=1, nice=7)
        try:
            got = await service.run(heavy, (), {}, None)
            return got, await cheap(lambda: thread_nice(threading.get_native_id()))
        finally:
            service.close()

    got, cheap_nice = asyncio.run(scenario())
    assert got["self"] == min(19, base + 7)
    assert all(n == min(19, base + 7) for n in got["started"]), got
    assert cheap_nice == base
    assert thread_nice(threading.get_native_id()) == base  # the caller is untouched


def test_startup_freezes_the_long_lived_heap_and_gzip_runs_below_its_slowest_level(settings: Settings) -> None:
    """After start-up the import-time objects are frozen (full collections skip them); a gzip answer is the same
    JSON, compressed below level 9 (gzip's XFL header byte: 2 marks the slowest level, 0 the middle ones)."""
    import gc
    import gzip

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with TestClient(serving_app(settings)) as c:
        assert gc.get_freeze_count() > 10_000
        url = "/api/v1/models/tiny-2l/composition?kind=K"
        plain = c.get(url, headers={"Accept-Encoding": "identity"})
        with c.stream("GET", url, headers={"Accept-Encoding": "gzip"}) as r:
            raw = b"".join(r.iter_raw())
            assert r.headers["content-encoding"] == "gzip"
    assert raw[:2] == b"\x1f\x8b" and raw[8] == 0
    assert json.loads(gzip.decompress(raw)) == plain.json()


# -- pricing: refused before a slot, answer bounded inside it -------------------------------------------------
def test_a_request_over_the_peak_or_answer_budget_is_refused_before_compute(settings: Settings) -> None:
    calls: list[str] = []
    limits = settings.limits.model_copy(update={"peak_bytes": 2**20, "max_answer_bytes": 4096})
    app = serving_app(settings, calls, limits=limits)

    async def scenario(ac: httpx.AsyncClient) -> None:
        over_peak = await ac.get("/api/v1/test/priced", params={"peak": 3 * 2**20, "answer": 10})
        assert_problem(
            over_peak, 422, "3145728 bytes (3.0 MiB) of working memory", "peak_bytes", "1.0 MiB", "lower n or peak"
        )
        over_answer = await ac.get("/api/v1/test/priced", params={"peak": 10, "answer": 50_000})
        assert_problem(over_answer, 422, "(48.8 KiB) of JSON", "max_answer_bytes", "4096 bytes", "lower n or peak")
        assert calls == [] and service(app).stats.completed == 0  # nothing ran
        # under-priced: the real encoded answer is checked inside the slot and refused all the same
        big = await ac.get("/api/v1/test/priced", params={"peak": 10, "answer": 10, "n": 1000})
        assert_problem(big, 422, "answered", "of JSON", "max_answer_bytes", "lower n or peak")
        assert calls == ["priced 1000"] and service(app).slots.in_use == 0 and len(service(app).cache) == 0
        ok = await ac.get("/api/v1/test/priced", params={"peak": 10, "answer": 10, "n": 3})
        assert ok.status_code == 200 and ok.json() == {"values": [0.123456789] * 3}

    run(scenario, app)


# -- refusals of every limit --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "needles"),
    [
        (f"/api/v1/models/tiny-2l/tokenize?tokens={PROMPT_41}", ("41 tokens", "at most 40")),
        ("/api/v1/models/tiny-2l/direct?k=51", ("k",)),
        ("/api/v1/models/tiny-2l/detectors?heads=L0H0,L0H1,L0H2,L0H3,L1H0", ("5 heads", "at most 4")),
        ("/api/v1/models/tiny-2l/paths?tokens=0,5,6&max_order=4", ("max_order",)),
        ("/api/v1/models/tiny-2l/detectors?batch=9", ("batch",)),
        ("/api/v1/test/dense?nbytes=1000000000", ("1000000000 bytes", "65536 bytes")),
        ("/api/v1/test/priced?peak=100000000000&answer=1", ("93.1 GiB", "peak_bytes")),
    ],
)
def test_each_limit_is_refused_with_problem_json(client: TestClient, url: str, needles: tuple[str, ...]) -> None:
    if url.startswith("/api/v1/test/"):
        app = serving_app(client.app.state.settings)  # type: ignore[attr-defined]
        with TestClient(app) as c:
            assert_problem(c.get(url), 422, *needles)
            assert service(app).slots.in_use == 0 and service(app).stats.completed == 0  # refused before compute
        return
    assert_problem(client.get(url), 422, *needles)
    assert client.get("/api/v1/models/tiny-2l/direct?k=3").status_code == 200  # nothing else broke


@pytest.mark.parametrize(
    ("url", "needles"),
    [
        (
            f"/api/v1/models/tiny-2l/term-importance?tokens={','.join(['5'] * 40)}",
            ("MiB) of working memory", "peak_bytes"),
        ),
        (f"/api/v1/models/tiny-2l/qk-paths?head=L1H0&k=50&tokens={','.join(['5'] * 40)}", ("peak_bytes", "lower", "k")),
        (f"/api/v1/models/tiny-2l/prompt?tokens={','.join(['5'] * 40)}", ("KiB) of JSON", "max_answer_bytes", "lower")),
    ],
)
def test_real_analyses_over_budget_are_refused_before_a_slot(
    settings: Settings, url: str, needles: tuple[str, ...]
) -> None:
    """The engine's own cost of these requests (term importance on 40 tokens: about 1.04 MiB; the QK terms of 50
    pairs: 1.5 MiB; 4 patterns of 40 x 40: 140 KiB of JSON) is over a 1 MiB / 64 KiB budget."""
    limits = settings.limits.model_copy(update={"peak_bytes": 2**20, "max_answer_bytes": 64 * 1024})
    app = serving_app(settings, limits=limits)
    with TestClient(app) as c:
        assert c.get("/api/v1/models/tiny-2l/tokenize?tokens=5").status_code == 200  # the model is loaded
        done = service(app).stats.completed
        assert_problem(c.get(url), 422, *needles)
        assert service(app).stats.completed == done and service(app).slots.in_use == 0  # refused before a slot
        small = url.replace(",".join(["5"] * 40), "5,6,7").replace("k=50", "k=2")
        assert c.get(small).status_code == 200, c.get(small).text  # the same analysis, smaller, is answered


def test_limits_are_written_into_the_openapi_schema(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()

    def param(path: str, name: str) -> dict[str, Any]:
        return next(p for p in spec["paths"][path]["get"]["parameters"] if p["name"] == name)

    assert param("/api/v1/models/{model}/direct", "k")["schema"]["maximum"] == 50
    assert param("/api/v1/models/{model}/paths", "max_order")["schema"]["maximum"] == 3
    assert "max length 48" in param("/api/v1/models/{model}/detectors", "heads")["description"]  # 4 heads x 12
    assert "max length 2560" in param("/api/v1/models/{model}/tokenize", "prompt")["description"]  # 40 tokens x 64
    assert {"/healthz", "/readyz"} <= spec["paths"].keys()


# -- HTTP caching -----------------------------------------------------------------------------------------
def test_weak_etag_and_304(client: TestClient) -> None:
    url = "/api/v1/models/tiny-2l/heads"
    first = client.get(url)
    etag = first.headers["ETag"]  # weak: the same JSON goes out gzip-coded or plain
    assert first.status_code == 200 and etag.startswith('W/"')
    assert first.headers["Cache-Control"] == "public, max-age=60"
    again = client.get(url, headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b"" and again.headers["ETag"] == etag
    assert client.get(url, headers={"If-None-Match": f'"other", {etag.removeprefix("W/")}'}).status_code == 304
    assert client.get(url, headers={"If-None-Match": '"other"'}).status_code == 200
    assert client.get("/api/v1/models/tiny-2l/heads/L0H1").headers["ETag"] != etag
    assert client.get("/api/v1/models").headers["Cache-Control"] == "no-cache"
    assert "ETag" not in client.get("/api/v1/models/nope").headers  # errors are not tagged


# -- rate limit -------------------------------------------------------------------------------------------
def test_rate_limit_429_with_standard_headers(settings: Settings) -> None:
    with TestClient(serving_app(settings, rate_limit=3, rate_window_s=60)) as c:
        remaining = [c.get("/api/v1/models").headers["RateLimit-Remaining"] for _ in range(3)]
        assert remaining == ["2", "1", "0"]
        refused = c.get("/api/v1/models/tiny-2l")
        assert_problem(refused, 429, "more than 3 requests")
        assert refused.headers["RateLimit-Limit"] == "3" and refused.headers["RateLimit-Remaining"] == "0"
        assert (
            1 <= int(refused.headers["Retry-After"]) <= 60
            and refused.headers["RateLimit-Reset"] == refused.headers["Retry-After"]
        )
        page = c.get("/")
        assert page.status_code == 429 and page.headers["content-type"].startswith("text/html")
        assert c.get("/healthz").status_code == 200  # probes are not limited


def test_no_rate_limit_headers_when_not_configured(client: TestClient) -> None:
    assert "RateLimit-Limit" not in client.get("/api/v1/models").headers


# -- request ids, logs, metrics ---------------------------------------------------------------------------
def test_request_id_in_out_and_in_json_logs(client: TestClient) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("qkov.access")
    logger.addHandler(handler)
    try:
        given = client.get("/api/v1/models", headers={"X-Request-ID": "abc-123"})
        made = client.get("/api/v1/models", headers={"X-Request-ID": "bad id <script>"})
    finally:
        logger.removeHandler(handler)
    assert given.headers["X-Request-ID"] == "abc-123"
    assert made.headers["X-Request-ID"] != "bad id <script>" and len(made.headers["X-Request-ID"]) == 32
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x["request_id"], x["status"], x["route"]) for x in lines] == [
        ("abc-123", 200, "/api/v1/models"),
        (made.headers["X-Request-ID"], 200, "/api/v1/models"),
    ]


def test_prometheus_metrics(settings: Settings) -> None:
    with TestClient(serving_app(settings)) as c:
        for _ in range(2):
            c.get("/api/v1/models/tiny-2l/heads")
        c.get("/api/v1/models/nope/heads")
        text = c.get("/metrics").text
    assert 'qkov_http_requests_total{method="GET",route="/api/v1/models/{model}/heads",status="200"} 2.0' in text
    assert 'route="/api/v1/models/{model}/heads",status="404"} 1.0' in text
    assert "qkov_http_request_duration_seconds_bucket" in text
    for name in (
        "qkov_compute_slots_in_use",
        "qkov_cache_bytes",
        "qkov_cache_hit_ratio",
        "qkov_cache_hits_total",
        "process_resident_memory_bytes",
    ):
        assert name in text
    hits = next(line for line in text.splitlines() if line.startswith("qkov_cache_hits_total"))
    assert float(hits.split()[-1]) >= 1


# -- health and readiness ---------------------------------------------------------------------------------
def test_healthz_and_readyz(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    report = ready.json()
    assert report["status"] == "ready" and report["models"]["tiny-2l"] == "ok"
    assert report["models"]["broken"].startswith("error")  # a broken user model does not make the server unready


def test_not_ready_without_models_or_with_a_broken_shipped_model(settings: Settings, tmp_path: Any) -> None:
    empty = Settings(shipped_dir=tmp_path / "none", models_dir=None)
    with TestClient(create_app(empty)) as c:
        answer = c.get("/readyz")
        assert answer.status_code == 503 and answer.json()["status"] == "not ready" and "Retry-After" in answer.headers
        assert c.get("/healthz").status_code == 200
    assert settings.models_dir is not None
    broken_shipped = Settings(shipped_dir=settings.models_dir, models_dir=settings.shipped_dir)  # 'broken' now shipped
    with TestClient(create_app(broken_shipped)) as c:
        assert c.get("/readyz").status_code == 503


def test_concurrent_first_requests_load_a_model_once(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    import app.registry as registry_module

    loads: list[str] = []
    real = registry_module.load_checkpoint

    def counting(path: Any, **kwargs: Any) -> Any:
        loads.append(path.name)
        time.sleep(0.2)  # widen the window in which the other requests arrive
        return real(path, **kwargs)

    monkeypatch.setattr(registry_module, "load_checkpoint", counting)
    app = serving_app(settings, compute_slots=4)

    async def scenario(ac: httpx.AsyncClient) -> None:
        answers = await asyncio.gather(*(ac.get("/api/v1/models/tiny-ln") for _ in range(4)))
        assert {a.status_code for a in answers} == {200}

    run(scenario, app)
    assert loads == ["tiny-ln"]
