"""Where every heavy computation runs (docs/design.md §3, "Cheap work and heavy work"): one engine estimate decides
how a request runs, then a bounded pool of compute slots, jobs, an encoded-answer cache, single-flight and stop flags.

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
  Jobs hold at most all slots but one (`job_slots`) and run on nicer threads (slots.JOB_NICE): a page priced inline
  never queues behind other pages' jobs, and gets most of the cores while they run.
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
found through a context variable that app/serving_middleware.py sets per request.

The package: slots.py (the compute slots, the compute threads' priority and torch threads), flights.py (one
computation, the requests waiting for it, the job it may run as), requests.py (the request a computation serves),
answers.py (the kept answers: the memory cache in front of the store, and parts built once for several
computations), service.py (ComputeService: the pricing decision, the in-flight table, the job table); here, `bind`
(the service and request this task uses) and the entry points views and routers call.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.to_thread
from pydantic import BaseModel

from app.pricing import Key, key_text
from app.scheduling.requests import RequestContext, set_request
from app.scheduling.service import ComputeService
from circuits_core.cost import Cost

T = TypeVar("T")
V = TypeVar("V", bound=BaseModel)

_SERVICE: contextvars.ContextVar[ComputeService | None] = contextvars.ContextVar("qkov_compute_service", default=None)


def bind(service: ComputeService, request: RequestContext | None) -> None:
    """Make `compute` use this service and request context in the current task (called by middleware)."""
    _SERVICE.set(service)
    set_request(request)


def bound_service() -> ComputeService | None:
    """The service `bind` set for this task, None outside a request."""
    return _SERVICE.get()


_default: ComputeService | None = None
_default_lock = threading.Lock()


def current_service() -> ComputeService:
    """The service of the app serving this request, else a process default (2 slots, no cache)."""
    service = bound_service()
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
    return current_service().answers.cached(key, view)


def is_cached(key: Key) -> bool:
    """Whether an answer is in this process's result cache now (a price may leave out work a cached answer saves)."""
    return current_service().cache.peek(key_text(key)) is not None


def cached_build(key: Key, view: type[V], build: Callable[[], V]) -> V:
    """Inside a computation: another analysis's answer from the cache, else `build()` (encoded and kept)."""
    return current_service().answers.cached_build(key, view, build)


async def load(fn: Callable[..., T], *args: Any) -> T:
    """A model load (registry.get, or a listing that loads) in a loader thread, never behind a compute slot."""
    return await current_service().load(fn, *args)


async def cheap(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Cheap work (listings, summaries, lookups of loaded models) in a worker thread, without a compute slot."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
