"""Where every heavy computation runs (design.md, "Cheap work and heavy work"): one engine estimate decides how a
request runs, then a bounded pool of compute slots, jobs, an encoded-answer cache, single-flight and stop flags.

`await compute(fn, *args, key=..., cost=..., lower=..., **kwargs)` runs `fn(*args, **kwargs)` in a worker thread
and returns its result; `await compute_json(...)` (same arguments) returns the answer's encoded JSON bytes.

- **Priced before it runs** (app/pricing.py): `cost` (a circuits_core.cost.Cost, the engine's own estimate) is
  compared with the budgets before a slot is taken: peak working memory, the encoded answer, and its time (the
  engine-counted FLOPs at `settings.compute_flops_per_s`). The time decides how it runs (`Budgets.mode`):
  inline under `inline_budget_s`, as a polled job under `job_budget_s`, refused beyond (LimitExceededError,
  HTTP 422, naming the size, the limit and the parameter to lower).
- **Jobs**: a cacheable request priced over the inline budget (or whose computation already runs as a job) raises
  `JobPending` at once: the API answers 202 with the job's status URL, a page shows a progress bar that polls it
  (`GET /api/v1/jobs/{id}`, `GET /jobs/{id}`). A job's progress comes from the engine (`report_progress`) or, when
  a loop says nothing, from the time spent against the estimate; it is shared by every reader asking for the
  same key (single flight), and stopped when no reader has polled it for `job_abandon_s`. Its answer goes to the
  cache and store, where the next request for the URL finds it.
- **Bounded**: at most `settings.compute_slots` computations run at once (`Slots`), each on its own thread. A call
  waits at most `settings.slot_wait_s` for a slot, then raises `BusyError` (HTTP 503 with Retry-After). The
  answer is encoded to JSON inside the slot, and its real size checked against `limits.max_answer_bytes` there.
- **Loading is not computing**: `load(fn, ...)` (model loads: deps.get_model, the listing) runs in a loader
  thread of its own, never behind the compute slots that user requests hold.
- **Cached**: with a `key` (a string, or a tuple joined with "|") the encoded answer is kept in the byte-budgeted
  LRU cache (app/cache.py) and the store; a hit costs no slot. Concurrent calls with the same key share one
  computation (single-flight).
- **Stoppable**: each computation has a stop flag, set when every request (or job) waiting for it has gone. The
  flag is ambient (circuits_core.cost.stopping) in the worker thread, so every engine loop's `check_stop` raises
  CancelledError within one step and the slot is freed.
- **Cheap work** (`await cheap(fn, *args)`): listings, summaries and lookups run in a plain worker thread. Compute
  threads run COMPUTE_NICE steps nicer, so the event loop and cheap work get a core first.

The slot is released when the worker thread returns, not when the awaiting request gives up. Keyword names `key`,
`cost`, `lower`, `view` and `dense_bytes` are reserved (not passed to `fn`). The service of the current app is
found through a context variable that app/observability.py's middleware sets per request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import hashlib
import inspect
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import anyio.to_thread
import torch
from pydantic import BaseModel

from app.cache import ResultCache
from app.pricing import (
    Answer,
    Budgets,
    Key,
    check_answer,
    check_cost,
    check_dense_bytes,
    check_request_time,
    encode,
    key_text,
    view_type,
)
from app.store import StoreTier
from circuits_core.cost import Cost, ambient_should_stop, progressing, stopping
from circuits_core.errors import CancelledError, LimitExceededError
from circuits_core.schedule import available_cores

log = logging.getLogger("qkov.compute")

T = TypeVar("T")
V = TypeVar("V", bound=BaseModel)
POLL_S = 0.05  # how often a waiting request checks its client and deadline


class BusyError(Exception):
    """Every compute slot stayed busy for the whole wait: HTTP 503 with `Retry-After: retry_after`."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class JobPending(Exception):
    """The request runs as a job (priced over the inline budget): the API answers 202 with `job` (its public
    state, app/scheduling.Job.public), a page shows a progress bar polling it."""

    def __init__(self, job: dict[str, Any]):
        super().__init__(f"{job['what']} runs as a job: poll {job['status_url']}")
        self.job = job


# -- the compute slots ---------------------------------------------------------------------------------------
class Slots:
    """A FIFO counting semaphore awaitable from any event loop and released from any thread (a worker thread
    releases its slot when its computation returns, not when the awaiting request gives up)."""

    def __init__(self, n: int):
        self.n = n
        self.in_use = 0
        self._lock = threading.Lock()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, timeout: float) -> None:
        """Take a slot, waiting at most `timeout` seconds (TimeoutError)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.in_use < self.n and not self._waiters:
                self.in_use += 1
                return
            entry = (loop, loop.create_future())
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(entry[1], timeout)
        except BaseException:
            with self._lock:
                granted = entry not in self._waiters
                if not granted:
                    self._waiters.remove(entry)
            if granted:  # the slot was handed over as we gave up: pass it on
                self.release()
            raise

    def release(self) -> None:
        with self._lock:
            while self._waiters:
                loop, fut = self._waiters.popleft()
                try:  # hand the slot over directly (in_use unchanged)
                    loop.call_soon_threadsafe(_grant, fut)
                    return
                except RuntimeError:  # that waiter's loop is closed
                    continue
            self.in_use -= 1


def _grant(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# -- per-request context -----------------------------------------------------------------------------------
@dataclass
class RequestContext:
    """What compute needs to know about the request it serves: is it still wanted?"""

    is_disconnected: Callable[[], Awaitable[bool]] | None = None
    deadline: float | None = None  # time.monotonic() after which the request gives up
    timeout_s: float | None = None

    async def abandoned(self) -> str | None:
        """Why the request no longer wants its result (None while it does)."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            return (
                f"the request took longer than its deadline of {self.timeout_s:g} s; "
                "try a smaller request or retry later"
            )
        if self.is_disconnected is not None and await self.is_disconnected():
            return "the client disconnected"
        return None


_SERVICE: contextvars.ContextVar[ComputeService | None] = contextvars.ContextVar("qkov_compute_service", default=None)
_REQUEST: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("qkov_request_context", default=None)


def bind(service: ComputeService, request: RequestContext | None) -> None:
    """Make `compute` use this service and request context in the current task (called by middleware)."""
    _SERVICE.set(service)
    _REQUEST.set(request)


def current_should_stop() -> Callable[[], bool]:
    """The stop flag of the computation running in this thread (never set outside one)."""
    return ambient_should_stop() or _never


def _never() -> bool:
    return False


# -- flights -----------------------------------------------------------------------------------------------
@dataclass(eq=False)  # identity: a flight is one computation (kept in sets)
class Flight:
    """One computation and the requests waiting for it."""

    key: str | None
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    stop: threading.Event = field(default_factory=threading.Event)
    interest: int = 0
    launcher: asyncio.Task[None] | None = None
    progress: float | None = None  # fraction done, as the engine reports it (None: it says nothing)
    started: float | None = None  # time.monotonic() when it took its slot
    job: Job | None = None  # the job it runs as, when it runs as one

    def should_stop(self) -> bool:
        return self.stop.is_set()

    def report(self, fraction: float) -> None:
        self.progress = fraction


@dataclass
class Job:
    """A computation a reader polls instead of waiting for it in its request."""

    id: str
    flight: Flight
    what: str
    estimate_s: float  # the engine's price in seconds
    created: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)  # the last poll (or request) of a reader
    finished: float | None = None

    def state(self) -> str:
        if not self.flight.future.done():
            return "running" if self.flight.started is not None else "queued"
        if self.flight.future.cancelled() or isinstance(self.flight.future.exception(), CancelledError):
            return "cancelled"
        return "failed" if self.flight.future.exception() is not None else "done"

    def public(self) -> dict[str, Any]:
        """What a reader sees: state, fraction done, seconds spent and left (from the engine's progress when it
        reports one, else from the estimate), and where to poll."""
        now = time.monotonic()
        started = self.flight.started
        spent = now - started if started is not None else 0.0
        fraction = self.flight.progress
        if self.state() == "done":
            fraction, left = 1.0, 0.0
        elif fraction is not None and fraction > 0.02 and spent > 0.5:
            left = spent * (1 - fraction) / fraction
        else:
            fraction = min(0.95, spent / self.estimate_s) if self.estimate_s > 0 else 0.0
            left = max(1.0, self.estimate_s - spent)
        error = self.flight.future.exception() if self.flight.future.done() else None
        return {
            "id": self.id,
            "what": self.what,
            "state": self.state(),
            "progress": round(fraction, 4),
            "elapsed_s": round(spent, 2),
            "eta_s": round(left, 1),
            "estimate_s": round(self.estimate_s, 1),
            "status_url": f"/api/v1/jobs/{self.id}",
            "error": str(error) if error is not None else None,
        }


@dataclass
class Stats:
    completed: int = 0
    failed: int = 0
    cancelled: int = 0  # stopped by their stop flag, or abandoned before they started
    rejected_busy: int = 0
    shared: int = 0  # requests that joined a computation already running
    compute_seconds: float = 0.0
    ewma_seconds: float = 0.5  # recent duration of one computation (for Retry-After)


def _takes_should_stop(fn: Callable[..., Any]) -> bool:
    try:
        return "should_stop" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def default_torch_threads(slots: int) -> int:
    return max(1, available_cores() // slots)


# Compute threads run this much nicer than the rest of the process (Linux nice is per thread and inherited by the
# torch intra-op threads a compute thread starts), so the event loop and cheap work get a core when they need one.
COMPUTE_NICE = 10


def lower_thread_priority(nice: int) -> None:
    """Make the calling thread (and the threads it starts later) `nice` steps nicer, up to 19; no-op off Linux."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # not permitted here: run at the normal priority
        log.warning("could not lower the compute thread's priority: %s", exc)


class ComputeService:
    """The bounded pool, encoded-answer cache and in-flight table of one app."""

    def __init__(
        self,
        slots: int = 2,
        slot_wait_s: float = 30.0,
        cache_bytes: int = 0,
        request_timeout_s: float | None = None,
        dense_budget_bytes: int | None = None,
        budgets: Budgets | None = None,
        store: StoreTier | None = None,
        torch_threads: int | None = None,
        nice: int = COMPUTE_NICE,
        job_abandon_s: float = 15.0,
        loaders: int = 2,
    ):
        self.slots = Slots(slots)
        self.torch_threads = torch_threads  # None: each computation gets the cores // computations running
        self.store = store  # the second level behind the cache (app/store.py): disk or Redis, shared by processes
        self.slot_wait_s = slot_wait_s
        self.request_timeout_s = request_timeout_s
        self.dense_budget_bytes = dense_budget_bytes
        self.budgets = budgets if budgets is not None else Budgets(seconds=request_timeout_s)
        self.cache = ResultCache(cache_bytes)
        self.stats = Stats()
        self._flights: dict[str, Flight] = {}
        self._lock = threading.Lock()
        self._live: set[Flight] = set()  # every flight not yet settled, keyed or not (close() stops them)
        self._building: dict[str, threading.Lock] = {}  # cached_build's key -> the lock its one builder holds
        self.nice = nice
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=slots, thread_name_prefix="qkov-compute", initializer=lower_thread_priority, initargs=(nice,)
        )
        # model loads: threads of their own, so a load never waits behind the computations holding the slots
        self._loader = concurrent.futures.ThreadPoolExecutor(max_workers=loaders, thread_name_prefix="qkov-load")
        self.job_abandon_s = job_abandon_s
        self._jobs: dict[str, Job] = {}

    def stop_all(self) -> None:
        """Tell every computation to stop (the app is shutting down: a worker thread would otherwise compute on after
        it, unseen); the pools stay usable, as a restarted lifespan of the same app needs them."""
        with self._lock:
            live = list(self._live)
        for flight in live:
            flight.stop.set()

    def close(self) -> None:
        """Stop every computation, then the pools."""
        self.stop_all()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)

    async def load(self, fn: Callable[..., T], *args: Any) -> T:
        """A model load (or a listing that loads models) in a loader thread: never behind a compute slot. The
        request gives up when it is abandoned; the load itself finishes (the registry keeps the model)."""
        future = asyncio.wrap_future(self._loader.submit(contextvars.copy_context().run, fn, *args))
        request = _REQUEST.get()
        while True:
            done, _ = await asyncio.wait({future}, timeout=POLL_S)
            if done:
                return future.result()
            reason = await request.abandoned() if request is not None else None
            if reason is not None:
                raise CancelledError(f"model load abandoned: {reason}")

    # -- jobs ----------------------------------------------------------------------------------------------
    def job(self, job_id: str) -> Job | None:
        """A job by id (a reader polling it: it stays wanted), None when unknown or long finished."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.last_seen = time.monotonic()
        return job

    def _as_job(self, flight: Flight, what: str, estimate_s: float) -> Job:
        """The flight's job, made (with its watcher) when the flight has none yet."""
        with self._lock:
            if flight.job is None:
                digest = hashlib.sha256((flight.key or str(id(flight))).encode()).hexdigest()[:24]
                flight.job = Job(id=digest, flight=flight, what=what, estimate_s=estimate_s)
                flight.interest += 1  # the job's own interest: withdrawn when its readers stop polling
                self._prune_jobs()
                self._jobs[flight.job.id] = flight.job
                asyncio.get_running_loop().create_task(self._watch(flight.job))
            flight.job.last_seen = time.monotonic()
            return flight.job

    def _prune_jobs(self) -> None:
        """Forget jobs finished more than a minute ago (their answers are in the cache and store)."""
        now = time.monotonic()
        for job_id in [j.id for j in self._jobs.values() if j.finished is not None and now - j.finished > 60]:
            del self._jobs[job_id]

    async def _watch(self, job: Job) -> None:
        """Stop the job once no reader has polled it for job_abandon_s (they left)."""
        waiting = asyncio.wrap_future(job.flight.future)
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=min(1.0, self.job_abandon_s / 4))
            if done:
                job.finished = time.monotonic()
                return
            if time.monotonic() - job.last_seen > self.job_abandon_s:
                log.info("job %s (%s): no reader polled it for %g s, stopping it", job.id, job.what, self.job_abandon_s)
                self._withdraw(job.flight)
                job.finished = time.monotonic()
                return

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead of it times the recent duration per slot."""
        ahead = self.slots.waiting + self.slots.in_use
        return int(min(60, max(1, math.ceil(self.stats.ewma_seconds * ahead / self.slots.n))))

    # -- the public entry points ---------------------------------------------------------------------------
    async def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: Key | None,
        dense_bytes: int | None = None,
        cost: Cost | None = None,
        lower: str = "",
        view: type[BaseModel] | None = None,
        want: Literal["value", "json"] = "value",
    ) -> Any:
        if dense_bytes is not None and self.dense_budget_bytes is not None:
            check_dense_bytes(dense_bytes, self.dense_budget_bytes)
        what = _what(fn)
        if cost is not None:
            check_cost(cost, self.budgets, lower, what)  # memory, answer, time over the job budget: 422
        text = key_text(key) if key is not None else None
        if text is not None:
            body = self.cache.get(text)
            if body is not None:
                answer = Answer(None, body)
                return answer.as_json() if want == "json" else answer.as_value(view or view_type(fn))
            if self.store is not None and (body := await self.store.get(text)) is not None:
                self.cache.put(text, body)
                answer = Answer(None, body)
                return answer.as_json() if want == "json" else answer.as_value(view or view_type(fn))
        # A computation is stopped only once no request waits for it, so a waiter never sees another's stop.
        as_job = cost is not None and self.budgets.mode(cost) == "job"
        if as_job and text is None and cost is not None:  # not kept, so not a job: it must fit the request
            check_request_time(cost, self.budgets, self.request_timeout_s, lower, what)
            as_job = False
        flight = self._join(fn, args, kwargs, text, lower, what)
        if (
            as_job or flight.job is not None
        ) and not flight.future.done():  # over the inline budget, or already a job: poll it, do not wait
            seconds = self.budgets.estimated_seconds(cost) if cost is not None else None
            job = self._as_job(flight, what, seconds or self.stats.ewma_seconds)
            self._withdraw(flight)  # this request's interest: the job's own keeps it running
            raise JobPending(job.public())
        answer = await self._wait(flight, _REQUEST.get(), what)
        return answer.as_json() if want == "json" else answer.as_value(view or view_type(fn))

    def admits(self, cost: Cost, kept: bool) -> bool:
        """Whether a request of this price runs (inline or as a job) rather than being refused: within the memory,
        answer and job budgets, and, when its answer is not kept (so it cannot be a job), the request deadline."""
        try:
            check_cost(cost, self.budgets)
            if not kept and self.budgets.mode(cost) == "job":
                check_request_time(cost, self.budgets, self.request_timeout_s)
        except LimitExceededError:
            return False
        return True

    def cached(self, key: Key, view: type[V]) -> V | None:
        """Inside a computation: another answer from the cache when there, else None (nothing is built)."""
        body = self.cache.get(key_text(key))
        return None if body is None else view.model_validate_json(body)

    def cached_build(self, key: Key, view: type[V], build: Callable[[], V]) -> V:
        """Inside a computation: another answer from the cache when there, else built here, encoded and kept."""
        hit = self.cached(key, view)
        if hit is not None:
            return hit
        text = key_text(key)
        with self._lock:
            building = self._building.setdefault(text, threading.Lock())
        with building:  # two computations that need the same part: one builds it, the other waits and reads it
            hit = self.cached(key, view)
            if hit is not None:
                return hit
            value = build()
            encoded = encode(value)
            if encoded is not None:
                self.cache.put(text, encoded)
        with self._lock:
            self._building.pop(text, None)
        return value

    # -- internals -----------------------------------------------------------------------------------------
    def _join(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: str | None,
        lower: str,
        what: str,
    ) -> Flight:
        with self._lock:
            flight = self._flights.get(key) if key is not None else None
            if flight is None and key is not None:
                body = self.cache.peek(key)  # finished between the cache check and now
                if body is not None:
                    flight = Flight(key=None, interest=1)
                    flight.future.set_result(Answer(None, body))
                    return flight
            if flight is not None and not flight.stop.is_set():
                flight.interest += 1
                self.stats.shared += 1
                return flight
            flight = Flight(key=key, interest=1)
            if key is not None:
                self._flights[key] = flight
            self._live.add(flight)
        flight.launcher = asyncio.get_running_loop().create_task(self._launch(flight, fn, args, kwargs, lower, what))
        return flight

    def _withdraw(self, flight: Flight) -> None:
        """One waiting request is gone; the last one out sets the stop flag."""
        with self._lock:
            flight.interest -= 1
            last = flight.interest <= 0
            if last:
                flight.stop.set()
                if flight.key is not None and self._flights.get(flight.key) is flight:
                    del self._flights[flight.key]
        if last and flight.launcher is not None and not flight.launcher.done():
            flight.launcher.cancel()  # still queued for a slot: leave the queue

    async def _wait(self, flight: Flight, request: RequestContext | None, what: str = "") -> Answer:
        """The flight's answer. A kept computation still queued for a slot after slot_wait_s becomes a job (the
        request answers with its progress, 202) instead of a 503: other users' computations never make it fail."""
        waiting = asyncio.wrap_future(flight.future)
        queued_until = time.monotonic() + self.slot_wait_s
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=POLL_S)
                if done:
                    return waiting.result()  # type: ignore[no-any-return]
                if flight.key is not None and flight.started is None and time.monotonic() > queued_until:
                    job = self._as_job(flight, what, self.stats.ewma_seconds)
                    self._withdraw(flight)
                    raise JobPending(job.public())
                reason = await request.abandoned() if request is not None else None
                if reason is not None:
                    self._withdraw(flight)
                    raise CancelledError(f"computation abandoned: {reason}")
        except asyncio.CancelledError:
            self._withdraw(flight)
            raise

    async def _launch(
        self,
        flight: Flight,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        lower: str,
        what: str,
    ) -> None:
        if flight.key is not None and self.store is not None:  # one computation per key across processes
            body = await self.store.claim_or_wait(flight.key, flight.stop.is_set)
            if body is not None:
                self.cache.put(flight.key, body)
                self._settle(flight, value=Answer(None, body))
                return
        try:
            while True:
                try:
                    await self.slots.acquire(self.slot_wait_s)
                    break
                except TimeoutError:
                    if flight.key is None or flight.stop.is_set():  # a kept one becomes a job: it waits on
                        raise
        except TimeoutError:
            self.stats.rejected_busy += 1
            self._settle(
                flight,
                exc=BusyError(
                    f"all {self.slots.n} compute slots stayed busy for {self.slot_wait_s:g} s; retry later",
                    self.retry_after(),
                ),
            )
            return
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            self._settle(flight, exc=CancelledError("computation abandoned before it started"))
            raise
        if flight.stop.is_set():
            self.slots.release()
            self.stats.cancelled += 1
            self._settle(flight, exc=CancelledError("computation abandoned before it started"))
            return
        if "should_stop" not in kwargs and _takes_should_stop(fn):
            kwargs = {**kwargs, "should_stop": flight.should_stop}
        ctx = contextvars.copy_context()
        try:
            self._executor.submit(ctx.run, self._call, flight, fn, args, kwargs, lower, what)
        except RuntimeError as exc:  # executor shut down
            self.slots.release()
            self._settle(flight, exc=BusyError(f"the server is shutting down: {exc}", 5))

    def _call(
        self,
        flight: Flight,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        lower: str,
        what: str,
    ) -> None:
        """In a worker thread, holding a slot: run fn, encode and check its answer, cache it, release, settle."""
        # torch's intra-op thread count is per thread: a computation running alone gets every core, two share them
        torch.set_num_threads(self.torch_threads or max(1, available_cores() // max(1, self.slots.in_use)))
        start = time.perf_counter()
        flight.started = time.monotonic()
        try:
            with stopping(flight.should_stop), progressing(flight.report):
                value = fn(*args, **kwargs)
                body = encode(value)  # inside the slot: encoding is part of the bounded work
            if body is not None:
                check_answer(len(body), self.budgets, lower, what)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting requests
            self.slots.release()
            if isinstance(exc, CancelledError):
                self.stats.cancelled += 1
            else:
                self.stats.failed += 1
            self._settle(flight, exc=exc)
            return
        elapsed = time.perf_counter() - start
        self.stats.completed += 1
        self.stats.compute_seconds += elapsed
        self.stats.ewma_seconds = 0.8 * self.stats.ewma_seconds + 0.2 * elapsed
        if flight.key is not None and body is not None:
            self.cache.put(flight.key, body)
        if flight.key is not None and self.store is not None:  # keep the answer (if JSON) and free the claim
            if body is not None:
                self.store.save(flight.key, body)
            else:
                self.store.release(flight.key)
        self.slots.release()
        self._settle(flight, value=Answer(value, body))

    def _settle(self, flight: Flight, value: Answer | None = None, exc: BaseException | None = None) -> None:
        if exc is not None and flight.key is not None and self.store is not None:
            self.store.release(flight.key)  # no answer: let another process claim the key
        with self._lock:
            if flight.key is not None and self._flights.get(flight.key) is flight:
                del self._flights[flight.key]
            self._live.discard(flight)
        if flight.future.done():
            return
        if exc is not None:
            flight.future.set_exception(exc)
        else:
            flight.future.set_result(value)


def _what(fn: Callable[..., Any]) -> str:
    """How a refusal names the computation: 'build_qk_paths_view' -> 'qk paths'."""
    name = getattr(fn, "__name__", "this request")
    name = name.removeprefix("build_").removesuffix("_view").replace("_", " ")
    return f"the {name} request" if name else "this request"


_default: ComputeService | None = None
_default_lock = threading.Lock()


def current_service() -> ComputeService:
    """The service of the app serving this request, else a process default (2 slots, no cache)."""
    service = _SERVICE.get()
    if service is not None:
        return service
    global _default
    with _default_lock:
        if _default is None:
            _default = ComputeService()
        return _default


async def compute(
    fn: Callable[..., T],
    *args: Any,
    key: Key | None = None,
    dense_bytes: int | None = None,
    cost: Cost | None = None,
    lower: str = "",
    view: type[BaseModel] | None = None,
    **kwargs: Any,
) -> T:
    """Price, then run `fn(*args, **kwargs)` on a compute slot; cached and shared under `key` (None: not
    cached). Returns fn's value (decoded from the cache's JSON on a hit, with `view` or fn's return type)."""
    return await current_service().run(fn, args, kwargs, key, dense_bytes, cost, lower, view, "value")  # type: ignore[no-any-return]


async def compute_json(
    fn: Callable[..., BaseModel],
    *args: Any,
    key: Key | None = None,
    cost: Cost | None = None,
    lower: str = "",
    **kwargs: Any,
) -> bytes:
    """Like compute, but the answer's JSON bytes, encoded inside the slot (a cache hit is returned as is)."""
    return await current_service().run(fn, args, kwargs, key, None, cost, lower, None, "json")  # type: ignore[no-any-return]


def cached(key: Key, view: type[V]) -> V | None:
    """Inside a computation: another analysis's answer from the cache, else None."""
    return current_service().cached(key, view)


def is_cached(key: Key) -> bool:
    """Whether an answer is in this process's result cache now (a price may leave out work a cached answer saves)."""
    return current_service().cache.peek(key_text(key)) is not None


def cached_build(key: Key, view: type[V], build: Callable[[], V]) -> V:
    """Inside a computation: another analysis's answer from the cache, else `build()` (encoded and kept)."""
    return current_service().cached_build(key, view, build)


async def load(fn: Callable[..., T], *args: Any) -> T:
    """A model load (registry.get, or a listing that loads) in a loader thread, never behind a compute slot."""
    return await current_service().load(fn, *args)


async def cheap(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Cheap work (listings, summaries, lookups of loaded models) in a worker thread, without a compute slot."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
