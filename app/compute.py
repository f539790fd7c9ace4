"""Where every view builder runs: a bounded pool of compute slots, a result cache, single-flight, stop flags.

`await compute(fn, *args, key=..., **kwargs)` runs `fn(*args, **kwargs)` in a worker thread:

- **Bounded**: at most `settings.compute_slots` calls run at once (a dedicated thread per slot; torch's
  intra-op threads are set so that slots x threads fit the cores). A call waits at most
  `settings.slot_wait_s` for a slot, then raises `BusyError` (HTTP 503 with Retry-After).
- **Cached**: with a `key` (checkpoint digest, view name, parameters...) a successful result is kept in a
  byte-budgeted LRU cache (app/cache.py); concurrent calls with the same key share one computation
  (single-flight). `key=None` means "do not cache" (e.g. user prompts).
- **Stoppable**: each computation has a stop flag, set when every request waiting for it has gone (the
  client disconnected, or the request passed its deadline `settings.request_timeout_s`). A function that
  takes a `should_stop: Callable[[], bool]` parameter gets the flag passed in; any code running inside a
  computation can also read it with `current_should_stop()`. Engine functions poll it and raise
  circuits_core.errors.CancelledError, so an abandoned computation frees its slot early.
- **Dense budget**: `dense_bytes=` (an estimate of the largest dense intermediate) is checked against
  `settings.limits.matrix_budget_bytes` before a slot is taken: LimitExceededError (422) saying both.

The slot is released when the worker thread returns, not when the awaiting request gives up, so the
number of running torch computations never exceeds the slots. Keyword names `key` and `dense_bytes` are
reserved (not passed to `fn`). The service of the current app is found through a context variable that
app/observability.py's middleware sets per request; outside a request a default service is used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.cache import ResultCache
from circuits_core.errors import CancelledError, LimitExceededError

log = logging.getLogger("qkov.compute")

T = TypeVar("T")
Key = tuple[Hashable, ...]
POLL_S = 0.05  # how often a waiting request checks its client and deadline


class BusyError(Exception):
    """Every compute slot stayed busy for the whole wait: HTTP 503 with `Retry-After: retry_after`."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def check_dense_bytes(needed: int, budget: int, what: str = "this request") -> None:
    """LimitExceededError (422) when a dense intermediate of `needed` bytes is over `budget`."""
    if needed > budget:
        raise LimitExceededError(
            f"{what} needs about {needed} bytes ({format_bytes(needed)}) of dense working memory; "
            f"the budget is {budget} bytes ({format_bytes(budget)}): ask for fewer tokens, sequences or heads"
        )


# -- slots -------------------------------------------------------------------------------------------------
class Slots:
    """A FIFO counting semaphore awaitable from any event loop and released from any thread."""

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
            return f"the request took longer than its deadline of {self.timeout_s:g} s; try a smaller request or retry later"
        if self.is_disconnected is not None and await self.is_disconnected():
            return "the client disconnected"
        return None


_SERVICE: contextvars.ContextVar[ComputeService | None] = contextvars.ContextVar("qkov_compute_service", default=None)
_REQUEST: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("qkov_request_context", default=None)
_STOP: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("qkov_should_stop", default=None)


def bind(service: ComputeService, request: RequestContext | None) -> None:
    """Make `compute` use this service and request context in the current task (called by middleware)."""
    _SERVICE.set(service)
    _REQUEST.set(request)


def current_should_stop() -> Callable[[], bool]:
    """The stop flag of the computation running in this thread (never set outside one)."""
    return _STOP.get() or _never


def _never() -> bool:
    return False


# -- flights -----------------------------------------------------------------------------------------------
@dataclass
class Flight:
    """One computation and the requests waiting for it."""

    key: Key | None
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)
    stop: threading.Event = field(default_factory=threading.Event)
    interest: int = 0
    launcher: asyncio.Task[None] | None = None

    def should_stop(self) -> bool:
        return self.stop.is_set()


@dataclass
class Stats:
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
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
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // slots)


class ComputeService:
    """The bounded pool, result cache and in-flight table of one app."""

    def __init__(self, slots: int = 2, slot_wait_s: float = 30.0, cache_bytes: int = 0,
                 request_timeout_s: float | None = None, dense_budget_bytes: int | None = None):
        self.slots = Slots(slots)
        self.slot_wait_s = slot_wait_s
        self.request_timeout_s = request_timeout_s
        self.dense_budget_bytes = dense_budget_bytes
        self.cache = ResultCache(cache_bytes)
        self.stats = Stats()
        self._flights: dict[Key, Flight] = {}
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=slots, thread_name_prefix="qkov-compute")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead of it times the recent duration per slot."""
        ahead = self.slots.waiting + self.slots.in_use
        return int(min(60, max(1, math.ceil(self.stats.ewma_seconds * ahead / self.slots.n))))

    # -- the public entry point ----------------------------------------------------------------------------
    async def run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any], key: Key | None,
                  dense_bytes: int | None = None) -> T:
        if dense_bytes is not None and self.dense_budget_bytes is not None:
            check_dense_bytes(dense_bytes, self.dense_budget_bytes)
        if key is not None:
            found, value = self.cache.get(key)
            if found:
                return value  # type: ignore[no-any-return]
        # A computation is stopped only once no request waits for it, so a waiter never sees another's stop.
        return await self._wait(self._join(fn, args, kwargs, key), _REQUEST.get())  # type: ignore[no-any-return]

    # -- internals -----------------------------------------------------------------------------------------
    def _join(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: Key | None) -> Flight:
        with self._lock:
            flight = self._flights.get(key) if key is not None else None
            if flight is None and key is not None:
                found, value = self.cache.peek(key)  # finished between the cache check and now
                if found:
                    flight = Flight(key=None, interest=1)
                    flight.future.set_result(value)
                    return flight
            if flight is not None and not flight.stop.is_set():
                flight.interest += 1
                self.stats.shared += 1
                return flight
            flight = Flight(key=key, interest=1)
            if key is not None:
                self._flights[key] = flight
        flight.launcher = asyncio.get_running_loop().create_task(self._launch(flight, fn, args, kwargs))
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

    async def _wait(self, flight: Flight, request: RequestContext | None) -> Any:
        waiting = asyncio.wrap_future(flight.future)
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=POLL_S)
                if done:
                    return waiting.result()
                reason = await request.abandoned() if request is not None else None
                if reason is not None:
                    self._withdraw(flight)
                    raise CancelledError(f"computation abandoned: {reason}")
        except asyncio.CancelledError:
            self._withdraw(flight)
            raise

    async def _launch(self, flight: Flight, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            await self.slots.acquire(self.slot_wait_s)
        except TimeoutError:
            self.stats.rejected_busy += 1
            self._settle(flight, exc=BusyError(
                f"all {self.slots.n} compute slots stayed busy for {self.slot_wait_s:g} s; retry later",
                self.retry_after(),
            ))
            return
        except asyncio.CancelledError:
            self._settle(flight, exc=CancelledError("computation abandoned before it started"))
            raise
        if flight.stop.is_set():
            self.slots.release()
            self._settle(flight, exc=CancelledError("computation abandoned before it started"))
            return
        if "should_stop" not in kwargs and _takes_should_stop(fn):
            kwargs = {**kwargs, "should_stop": flight.should_stop}
        ctx = contextvars.copy_context()
        try:
            self._executor.submit(ctx.run, self._call, flight, fn, args, kwargs)
        except RuntimeError as exc:  # executor shut down
            self.slots.release()
            self._settle(flight, exc=BusyError(f"the server is shutting down: {exc}", 5))

    def _call(self, flight: Flight, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """In a worker thread, holding a slot: run fn, cache the result, release the slot, settle."""
        _STOP.set(flight.should_stop)
        start = time.perf_counter()
        try:
            value = fn(*args, **kwargs)
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
        if flight.key is not None:
            self.cache.put(flight.key, value)
        self.slots.release()
        self._settle(flight, value=value)

    def _settle(self, flight: Flight, value: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            if flight.key is not None and self._flights.get(flight.key) is flight:
                del self._flights[flight.key]
        if flight.future.done():
            return
        if exc is not None:
            flight.future.set_exception(exc)
        else:
            flight.future.set_result(value)


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


async def compute(fn: Callable[..., T], *args: Any, key: Key | None = None, dense_bytes: int | None = None,
                  **kwargs: Any) -> T:
    """Run `fn(*args, **kwargs)` on a compute slot; cached and shared under `key` (None: not cached)."""
    return await current_service().run(fn, args, kwargs, key, dense_bytes)
