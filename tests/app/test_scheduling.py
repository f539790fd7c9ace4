"""The scheduling module's decisions (app/scheduling/): one engine price decides whether a request runs inline,
as a polled job or not at all; jobs report progress, are shared by every reader and stop when nobody polls them;
model loads and the listing never wait behind the compute slots that user requests hold.

Test-only routes price a stoppable function with a stated FLOP count; the server's rate (compute_flops_per_s) turns
it into seconds, so each decision is reached on purpose, and each assertion is against what the function really
did (how often it ran, whether it was stopped), not against the scheduler's own bookkeeping alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from app.main import create_app
from app.scheduling import compute
from app.scheduling.service import ComputeService
from app.scheduling.slots import COMPUTE_NICE, JOB_NICE
from app.settings import Settings
from circuits_core.cost import Cost, check_stop, report_progress
from circuits_core.schedule import available_cores, shared_chunks, side_by_side
from tests.app.conftest import assert_problem

RATE = 1e9  # FLOP/s: a price of x GFLOP is x seconds


class Slept(BaseModel):
    tag: str
    steps: int


def add_routes(app: FastAPI, ran: list[str], stopped: list[str]) -> None:
    @app.get("/api/v1/test/priced-work")
    async def priced_work(tag: str, gflop: float, seconds: float = 0.2) -> Slept:
        def work() -> Slept:
            ran.append(tag)
            steps = max(1, int(seconds / 0.02))
            for i in range(steps):
                try:
                    check_stop(what="test work")
                except Exception:
                    stopped.append(tag)
                    raise
                report_progress(i, steps)
                time.sleep(0.02)
            return Slept(tag=tag, steps=steps)

        return await compute(
            work, key=("priced-work", tag, seconds), cost=Cost(0, flops=int(gflop * 1e9)), lower="gflop"
        )


def app_with(settings: Settings, ran: list[str], stopped: list[str], **update: Any) -> FastAPI:
    base = {
        "store_url": "off",
        "compute_flops_per_s": RATE,
        "inline_budget_s": 1.0,
        "job_budget_s": 100.0,
        "job_abandon_s": 0.6,
    }
    app = create_app(settings.model_copy(update={**base, **update}))
    add_routes(app, ran, stopped)
    return app


def service(app: FastAPI) -> ComputeService:
    svc: ComputeService = app.state.compute
    return svc


@contextmanager
def slot_held(c: TestClient, app: FastAPI, seconds: float) -> Iterator[None]:
    """The app's one compute slot held by a request that works `seconds` (tag "hog") while the body runs."""
    hold = threading.Thread(
        target=lambda: c.get("/api/v1/test/priced-work", params={"tag": "hog", "gflop": 1, "seconds": seconds})
    )
    hold.start()
    end = time.monotonic() + 5
    while service(app).slots.in_use < 1 and time.monotonic() < end:
        time.sleep(0.01)
    assert service(app).slots.in_use == 1
    yield
    hold.join()


def poll(c: TestClient, url: str, until: Callable[[dict[str, Any]], bool], timeout: float = 20.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        state = c.get(url).json()
        if until(state):
            return state
        assert time.monotonic() < end, f"job never reached the state asked: {state}"
        time.sleep(0.05)


def test_the_price_decides_inline_job_or_refusal(settings: Settings) -> None:
    ran: list[str] = []
    with TestClient(app_with(settings, ran, [])) as c:
        inline = c.get("/api/v1/test/priced-work", params={"tag": "small", "gflop": 0.5})
        assert inline.status_code == 200 and inline.json() == {"tag": "small", "steps": 10}

        first = c.get("/api/v1/test/priced-work", params={"tag": "long", "gflop": 30, "seconds": 1.0})
        assert first.status_code == 202, first.text  # 30 s priced: over the 1 s inline budget, under the 100 s job one
        job = first.json()
        assert first.headers["Location"] == job["status_url"] == f"/api/v1/jobs/{job['id']}"
        assert job["estimate_s"] == pytest.approx(30, abs=0.1) and job["state"] in ("queued", "running")
        assert job["result_url"].startswith("/api/v1/test/priced-work?")
        seen = []
        done = poll(c, job["status_url"], lambda s: seen.append(s["progress"]) or s["state"] == "done")
        assert done["progress"] == 1.0 and done["eta_s"] == 0.0
        assert any(0 < p < 1 for p in seen)  # the engine's progress reached the reader on the way
        answer = c.get(job["result_url"])
        assert answer.status_code == 200 and answer.json() == {"tag": "long", "steps": 50}
        assert ran == ["small", "long"]  # the job's answer was kept: asking again did not compute again

        refused = c.get("/api/v1/test/priced-work", params={"tag": "huge", "gflop": 500})
        assert_problem(refused, 422, "500 s", "job_budget_s", "100 s", "lower gflop")
        assert "huge" not in ran  # refused before it ran


def test_a_job_is_shared_by_every_reader(settings: Settings) -> None:
    ran: list[str] = []
    with TestClient(app_with(settings, ran, [])) as c:
        params = {"tag": "shared", "gflop": 20, "seconds": 0.8}
        ids = [c.get("/api/v1/test/priced-work", params=params).json()["id"] for _ in range(3)]
        assert len(set(ids)) == 1
        poll(c, f"/api/v1/jobs/{ids[0]}", lambda s: s["state"] == "done")
        assert c.get("/api/v1/test/priced-work", params=params).status_code == 200
        assert ran == ["shared"]


def test_a_job_nobody_polls_is_stopped(settings: Settings) -> None:
    ran: list[str] = []
    stopped: list[str] = []
    app = app_with(settings, ran, stopped)
    with TestClient(app) as c:
        job = c.get("/api/v1/test/priced-work", params={"tag": "left", "gflop": 20, "seconds": 20}).json()
        end = time.monotonic() + 10
        while not stopped and time.monotonic() < end:
            time.sleep(0.05)  # nobody polls: after job_abandon_s (0.6 s) the job is stopped
        assert stopped == ["left"]
        assert service(app).slots.in_use == 0
        state = c.get(f"/api/v1/jobs/{job['id']}").json()
        assert state["state"] == "cancelled"


def test_polling_keeps_a_job_alive(settings: Settings) -> None:
    ran: list[str] = []
    stopped: list[str] = []
    with TestClient(app_with(settings, ran, stopped)) as c:
        job = c.get("/api/v1/test/priced-work", params={"tag": "kept", "gflop": 20, "seconds": 1.5}).json()
        poll(c, job["status_url"], lambda s: s["state"] == "done")  # polled every 50 ms: never stopped
        assert stopped == [] and ran == ["kept"]


def test_the_page_shows_the_progress_and_polls(settings: Settings) -> None:
    """An htmx page panel over the inline budget: a progress bar that polls /jobs/{id}; done, the poll reloads."""
    ran: list[str] = []
    with TestClient(app_with(settings, ran, [])) as c:
        job = c.get("/api/v1/test/priced-work", params={"tag": "bar", "gflop": 20, "seconds": 0.5}).json()
        bar = c.get(f"/jobs/{job['id']}")
        assert bar.status_code == 200 and "<progress" in bar.text and f'hx-get="/jobs/{job["id"]}"' in bar.text
        poll(c, job["status_url"], lambda s: s["state"] == "done")
        assert c.get(f"/jobs/{job['id']}").headers.get("HX-Refresh") == "true"


def test_loading_never_waits_behind_the_compute_slots(settings: Settings) -> None:
    """Both compute slots held by long user requests: a model not loaded yet still loads (its card, the listing, a
    page whose analysis is cheap). Before, loading took a compute slot and answered 503 after slot_wait_s."""
    ran: list[str] = []
    app = app_with(settings, ran, [], compute_slots=1, slot_wait_s=0.3, inline_budget_s=100.0)
    with TestClient(app) as c, slot_held(c, app, seconds=4):
        start = time.monotonic()
        assert c.get("/api/v1/models/tiny-ln").status_code == 200  # loads tiny-ln now
        assert c.get("/api/v1/models").status_code == 200
        assert time.monotonic() - start < 3.5 and service(app).slots.in_use == 1  # the slot still held by the hog


def test_a_kept_computation_queued_too_long_becomes_a_job_not_a_503(settings: Settings) -> None:
    """The slot is held: a kept (cacheable) request waits slot_wait_s, then answers 202 with a job that runs once
    the slot is free, where it used to answer 503."""
    ran: list[str] = []
    app = app_with(settings, ran, [], compute_slots=1, slot_wait_s=0.3, inline_budget_s=100.0)
    with TestClient(app) as c:
        with slot_held(c, app, seconds=2):
            queued = c.get("/api/v1/test/priced-work", params={"tag": "patient", "gflop": 0.1})
            assert queued.status_code == 202, queued.text
            poll(c, queued.json()["status_url"], lambda s: s["state"] == "done")
            assert c.get(queued.json()["result_url"]).json()["tag"] == "patient"
        assert ran == ["hog", "patient"]


def test_the_overview_shows_the_model_at_once_and_its_heads_tables_progress(settings: Settings) -> None:
    """A heads table priced over the inline budget: the overview answers at once (202, not kept) with the model's
    facts and the job's progress bar; once the job is done the same URL is the full page (200)."""
    rate = {"compute_flops_per_s": 1e6, "inline_budget_s": 0.5, "job_budget_s": 1e6}
    app = create_app(settings.model_copy(update={"store_url": "off", **rate}))
    with TestClient(app) as c:
        first = c.get("/models/tiny-2l")
        assert first.status_code == 202, first.text[:300]
        assert "d_model 32" in first.text and 'data-job="' in first.text and "<progress" in first.text
        job_id = first.text.split('data-job="')[1].split('"')[0]
        poll(c, f"/api/v1/jobs/{job_id}", lambda s: s["state"] == "done")
        full = c.get("/models/tiny-2l")
        assert full.status_code == 200 and 'id="heads-table"' in full.text and "data-job" not in full.text


def test_a_part_two_computations_need_at_once_is_built_once() -> None:
    """cached_build is single-flight per key: the second computation waits for the first one's part and reads it from
    the cache instead of building it again (precompute's head panels all need the same random baseline rows)."""

    class Part(BaseModel):
        value: int

    service = ComputeService(cache_bytes=1 << 20)
    builds: list[int] = []
    started = threading.Event()

    def build() -> Part:
        builds.append(1)
        started.set()
        time.sleep(0.3)  # long enough that the second caller arrives while this one builds
        return Part(value=7)

    got: list[Part] = []
    first = threading.Thread(target=lambda: got.append(service.answers.cached_build(("part", 1), Part, build)))
    first.start()
    assert started.wait(5)
    second = service.answers.cached_build(("part", 1), Part, build)
    first.join(5)
    assert len(builds) == 1
    assert second == got[0] == Part(value=7)
    service.close()


def test_closing_the_service_stops_its_running_computations() -> None:
    """A computation still running when the app shuts down (a job nobody polls any more, a request cut off) is told
    to stop: its worker thread must not run on unseen after the app (it did, and a later test's counters saw it)."""
    import asyncio
    import threading

    from circuits_core.errors import CancelledError

    started, stopped = threading.Event(), threading.Event()

    def forever() -> None:
        try:
            while True:
                check_stop(what="a long loop")
                started.set()
                time.sleep(0.01)
        except CancelledError:
            stopped.set()
            raise

    async def scenario() -> None:
        service = ComputeService(slots=1)
        asyncio.get_running_loop().create_task(service.run(forever, (), {}, key=("forever",)))
        assert await asyncio.to_thread(started.wait, 5)
        service.close()
        assert await asyncio.to_thread(stopped.wait, 5)

    asyncio.run(scenario())


def test_the_app_stops_its_computations_when_it_shuts_down(settings: Settings) -> None:
    """The lifespan's end closes the compute service: a job still running when the app stops is told to stop, and
    its worker thread ends instead of computing on after the app."""
    ran: list[str] = []
    stopped: list[str] = []
    app = app_with(settings, ran, stopped, job_abandon_s=60.0)
    with TestClient(app) as c:
        job = c.get("/api/v1/test/priced-work", params={"tag": "long", "gflop": 5, "seconds": 30})
        assert job.status_code == 202
        poll(c, job.json()["status_url"], lambda s: s["state"] == "running")
    end = time.monotonic() + 5
    while not stopped and time.monotonic() < end:
        time.sleep(0.05)
    assert stopped == ["long"]


def test_a_page_priced_inline_never_waits_behind_jobs(settings: Settings) -> None:
    """Two slots, three long jobs asked for (a reader who opened three heavy pages): the jobs hold one slot between
    them, so a request priced inline runs at once beside them instead of queuing behind them for slot_wait_s; the jobs
    run on threads nicer than the inline one's."""
    import os

    ran: list[str] = []
    app = app_with(settings, ran, [], compute_slots=2, slot_wait_s=5.0, job_abandon_s=60.0)
    nice: dict[str, int] = {}

    @app.get("/api/v1/test/niceness")
    async def niceness(tag: str, gflop: float) -> Slept:
        def work() -> Slept:
            nice[tag] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            time.sleep(0.5 if gflop > 1 else 0.01)
            return Slept(tag=tag, steps=1)

        return await compute(work, key=("niceness", tag), cost=Cost(0, flops=int(gflop * 1e9)))

    with TestClient(app) as c:
        jobs = [
            c.get("/api/v1/test/priced-work", params={"tag": f"job{i}", "gflop": 20, "seconds": 3.0}) for i in range(3)
        ]
        assert [j.status_code for j in jobs] == [202, 202, 202]
        poll(c, jobs[0].json()["status_url"], lambda s: s["state"] == "running")
        start = time.monotonic()
        inline = c.get("/api/v1/test/priced-work", params={"tag": "page", "gflop": 0.1, "seconds": 0.1})
        assert inline.status_code == 200 and time.monotonic() - start < 2.0  # not after a 3 s job
        assert "job1" not in ran and "job2" not in ran  # the other jobs wait for the job slot
        assert service(app).slots.in_use == 1 and service(app).job_slots.in_use == 1
        assert c.get("/api/v1/test/niceness", params={"tag": "inline", "gflop": 0.1}).status_code == 200
        background = c.get("/api/v1/test/niceness", params={"tag": "job", "gflop": 5})
        assert background.status_code == 202
        poll(c, background.json()["status_url"], lambda s: s["state"] == "done", timeout=30)
        base = os.getpriority(os.PRIO_PROCESS, 0)  # this process's own niceness (a test run under `nice`)
        assert nice["inline"] == min(19, base + COMPUTE_NICE)
        assert nice["job"] == min(19, base + COMPUTE_NICE + JOB_NICE) > base + COMPUTE_NICE or base + COMPUTE_NICE >= 19


@pytest.mark.skipif(available_cores() < 2, reason="a job's helper thread needs a second core")
def test_a_jobs_helper_thread_gives_its_core_back_while_a_page_computes_inline(settings: Settings) -> None:
    """A job splitting a chunked loop over two threads (schedule.side_by_side, shared_chunks) stops its helper taking
    chunks while a computation priced inline runs (the core is the page's), and the job still takes every chunk once."""
    app = app_with(settings, [], [], compute_slots=2, slot_wait_s=5.0, job_abandon_s=60.0)
    chunks: list[tuple[float, bool, int]] = []  # (when, taken by the helper, chunk)
    inline_ran: list[float] = []

    @app.get("/api/v1/test/chunked-job")
    async def chunked_job() -> Slept:
        def work() -> Slept:
            take = shared_chunks(80, 1)

            def loop() -> None:
                while (s := take()) is not None:
                    chunks.append(
                        (time.monotonic(), threading.current_thread().name.startswith("qkov-job-side"), s.start)
                    )
                    time.sleep(0.04)

            side_by_side(loop, loop, "qkov-job-side")
            return Slept(tag="chunked", steps=len(chunks))

        return await compute(work, key=("chunked-job",), cost=Cost(0, flops=int(5e9)))

    @app.get("/api/v1/test/inline-sleep")
    async def inline_sleep() -> Slept:
        def work() -> Slept:
            inline_ran.append(time.monotonic())
            time.sleep(0.8)
            inline_ran.append(time.monotonic())
            return Slept(tag="inline", steps=1)

        return await compute(work, cost=Cost(0, flops=int(0.1e9)))

    with TestClient(app) as c:
        job = c.get("/api/v1/test/chunked-job")
        assert job.status_code == 202
        poll(c, job.json()["status_url"], lambda s: sum(h for _, h, _ in chunks) >= 3)  # the helper is taking chunks
        assert c.get("/api/v1/test/inline-sleep").status_code == 200
        poll(c, job.json()["status_url"], lambda s: s["state"] == "done", timeout=30)
    start, end = inline_ran
    during = [i for when, helper, i in chunks if helper and start + 0.1 < when < end]
    assert during == []  # the helper took no chunk while the page computed
    assert any(helper and when >= end for when, helper, _ in chunks)  # and took chunks again after it
    assert sorted(i for _, _, i in chunks) == list(range(80))  # every chunk once


def test_a_freed_slot_goes_to_a_watched_waiter_first() -> None:
    """A job a reader polls is not queued behind jobs whose pages were left (unpolled: they hold their place until
    job_abandon_s stops them); among waiters nobody watches, or all watched, the order is first come first served."""
    import asyncio

    from app.scheduling.slots import Slots

    async def order(watched: list[bool]) -> list[int]:
        slots, granted = Slots(1), []
        await slots.acquire(1.0)  # held: every waiter below queues

        async def wait(i: int) -> None:
            await slots.acquire(5.0, lambda: watched[i])
            granted.append(i)
            slots.release()

        tasks = [asyncio.create_task(wait(i)) for i in range(len(watched))]
        while slots.waiting < len(watched):
            await asyncio.sleep(0.01)
        slots.release()
        await asyncio.gather(*tasks)
        return granted

    assert asyncio.run(order([False, False, True, False])) == [2, 0, 1, 3]
    assert asyncio.run(order([False, False, False])) == [0, 1, 2]
    assert asyncio.run(order([True, True, True])) == [0, 1, 2]
