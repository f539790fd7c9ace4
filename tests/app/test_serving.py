"""Serving: bounded compute slots (503 + Retry-After), stop flags, single-flight + result cache, the threads and
priority computations run with. Limits, HTTP caching, rate limits, logs, metrics and readiness:
test_serving_limits.py.

Apps are built on the session's tiny models (tests/app/conftest.py) with serving settings changed per test;
test-only routes (tests/app/serving_routes.py) call `compute` with a slow, stoppable function so that slots can be
held on purpose.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from app.cache import ENTRY_OVERHEAD, ResultCache
from app.scheduling import cheap
from app.scheduling.service import ComputeService
from app.settings import Settings
from tests.app.conftest import assert_problem
from tests.app.serving_routes import run, service, serving_app, wait_for


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
