"""Where every heavy computation runs: priced first, then a bounded pool of compute slots, an encoded-answer
cache, single-flight and stop flags (design.md, "Cheap work and heavy work").

`await compute(fn, *args, key=..., cost=..., lower=..., **kwargs)` runs `fn(*args, **kwargs)` in a worker thread
and returns its result; `await compute_json(...)` (same arguments) returns the answer's encoded JSON bytes:

- **Priced before it runs** (app/pricing.py): `cost` (a circuits_core.cost.Cost from the engine's own estimate) is compared with
  the budgets before a slot is taken: peak working memory with `limits.peak_bytes`, the encoded answer with
  `limits.max_answer_bytes`, the estimated seconds with the request deadline. Over budget: LimitExceededError
  (HTTP 422) naming the size, the limit and `lower`, the parameters to lower.
- **Bounded**: at most `settings.compute_slots` calls run at once (app/slots.py), each on its own thread. A call waits at most
  `settings.slot_wait_s` for a slot, then raises `BusyError` (HTTP 503 with Retry-After). The answer (a pydantic
  model) is encoded to JSON inside the slot, so encoding is part of the bounded work, and its real size is
  checked against `limits.max_answer_bytes` there too.
- **Cached**: with a `key` (a string, or a tuple joined with "|": model id, digest, analysis, parameters) the
  encoded answer is kept in the byte-budgeted LRU cache (app/cache.py: bytes only, so its accounting is real);
  a hit costs no slot. Concurrent calls with the same key share one computation (single-flight).
- **Stoppable**: each computation has a stop flag, set when every request waiting for it has gone (the client
  disconnected, or the request passed its deadline `settings.request_timeout_s`). The flag is made ambient
  (circuits_core.cost.stopping) for the worker thread, so every engine loop's `check_stop` sees it and raises
  CancelledError within one step; the slot is then free. A function that takes `should_stop` also gets it.
- **Cheap work** (`await cheap(fn, *args)`): listings, summaries and lookups run in a plain worker thread,
  never waiting for a compute slot. Compute threads run COMPUTE_NICE steps nicer (lower_thread_priority, inherited
  by their torch intra-op threads), so the event loop and cheap work get a core first: with two computations
  holding both cores, cheap requests' median went from ~130 ms to ~15 ms in bench/load.py (shared machine).

The slot is released when the worker thread returns, not when the awaiting request gives up, so the number of
running torch computations never exceeds the slots. Keyword names `key`, `cost`, `lower`, `view` and
`dense_bytes` are reserved (not passed to `fn`). The service of the current app is found through a context
variable that app/observability.py's middleware sets per request; outside a request a default service is used.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import anyio.to_thread
import torch
from pydantic import BaseModel

from app.cache import ResultCache
from app.pricing import Answer, Budgets, Key, check_answer, check_cost, check_dense_bytes, encode, key_text, view_type
from app.slots import Slots
from app.store import StoreTier
from circuits_core.cost import Cost, ambient_should_stop, available_cores, stopping
from circuits_core.errors import CancelledError

log = logging.getLogger("qkov.compute")

T = TypeVar("T")
V = TypeVar("V", bound=BaseModel)
POLL_S = 0.05  # how often a waiting request checks its client and deadline


class BusyError(Exception):
    """Every compute slot stayed busy for the whole wait: HTTP 503 with `Retry-After: retry_after`."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


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
@dataclass
class Flight:
    """One computation and the requests waiting for it."""

    key: str | None
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
        self.nice = nice
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=slots, thread_name_prefix="qkov-compute", initializer=lower_thread_priority, initargs=(nice,)
        )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

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
            check_cost(cost, self.budgets, lower, what)
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
        flight = self._join(fn, args, kwargs, text, lower, what)
        answer = await self._wait(flight, _REQUEST.get())
        return answer.as_json() if want == "json" else answer.as_value(view or view_type(fn))

    def cached(self, key: Key, view: type[V]) -> V | None:
        """Inside a computation: another answer from the cache when there, else None (nothing is built)."""
        body = self.cache.get(key_text(key))
        return None if body is None else view.model_validate_json(body)

    def cached_build(self, key: Key, view: type[V], build: Callable[[], V]) -> V:
        """Inside a computation: another answer from the cache when there, else built here, encoded and kept."""
        hit = self.cached(key, view)
        if hit is not None:
            return hit
        value = build()
        encoded = encode(value)
        if encoded is not None:
            self.cache.put(key_text(key), encoded)
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

    async def _wait(self, flight: Flight, request: RequestContext | None) -> Answer:
        waiting = asyncio.wrap_future(flight.future)
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=POLL_S)
                if done:
                    return waiting.result()  # type: ignore[no-any-return]
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
            await self.slots.acquire(self.slot_wait_s)
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
        try:
            with stopping(flight.should_stop):
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


def cached_build(key: Key, view: type[V], build: Callable[[], V]) -> V:
    """Inside a computation: another analysis's answer from the cache, else `build()` (encoded and kept)."""
    return current_service().cached_build(key, view, build)


async def cheap(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Cheap work (listings, summaries, lookups of loaded models) in a worker thread, without a compute slot."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
