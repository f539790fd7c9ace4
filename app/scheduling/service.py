"""ComputeService: one app's bounded pool of compute slots, kept answers (answers.py), in-flight table (single
flight, stop flags) and job table. `run` prices a request (app/pricing.py) and decides whether it runs inline, as a
polled job, or is refused. The overview is in app/scheduling/__init__.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import hashlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

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
from app.scheduling.answers import KeptAnswers
from app.scheduling.flights import (
    BusyError,
    Flight,
    Job,
    JobPending,
    JobTable,
    Stats,
    computation_name,
    takes_should_stop,
    watched,
)
from app.scheduling.requests import RequestContext, current_request
from app.scheduling.slots import COMPUTE_NICE, JOB_NICE, Slots, lower_thread_priority
from app.store import StoreTier
from circuits_core.cost import Cost, progressing, stopping
from circuits_core.errors import CancelledError, LimitExceededError
from circuits_core.schedule import available_cores, yielding

T = TypeVar("T")
POLL_S = 0.05  # how often a waiting request checks its client and deadline


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
        # jobs hold at most all slots but one: a request priced inline always finds a slot that no job holds
        self.job_slots = Slots(max(1, slots - 1))
        self.torch_threads = torch_threads  # None: each computation gets the cores // computations running
        self.store = store  # the second level behind the cache (app/store.py): disk or Redis, shared by processes
        self.slot_wait_s = slot_wait_s
        self.request_timeout_s = request_timeout_s
        self.dense_budget_bytes = dense_budget_bytes
        self.budgets = budgets if budgets is not None else Budgets(seconds=request_timeout_s)
        self.cache = ResultCache(cache_bytes)
        self.answers = KeptAnswers(self.cache, store)
        self.stats = Stats()
        self._flights: dict[str, Flight] = {}
        self._lock = threading.Lock()
        self._live: set[Flight] = set()  # every flight not yet settled, keyed or not (close() stops them)
        self.nice = nice
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=slots, thread_name_prefix="qkov-compute", initializer=lower_thread_priority, initargs=(nice,)
        )
        self._job_executor = concurrent.futures.ThreadPoolExecutor(  # jobs' threads: nicer (slots.JOB_NICE)
            max_workers=slots,
            thread_name_prefix="qkov-job",
            initializer=lower_thread_priority,
            initargs=(nice + JOB_NICE,),
        )
        # model loads: threads of their own, so a load never waits behind the computations holding the slots
        self._loader = concurrent.futures.ThreadPoolExecutor(max_workers=loaders, thread_name_prefix="qkov-load")
        self.jobs = JobTable(job_abandon_s, self._withdraw)

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
        self._job_executor.shutdown(wait=False, cancel_futures=True)
        self._loader.shutdown(wait=False, cancel_futures=True)

    async def load(self, fn: Callable[..., T], *args: Any) -> T:
        """A model load (or a listing that loads models) in a loader thread: never behind a compute slot. The
        request gives up when it is abandoned; the load itself finishes (the registry keeps the model)."""
        future = asyncio.wrap_future(self._loader.submit(contextvars.copy_context().run, fn, *args))
        request = current_request()
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
        return self.jobs.get(job_id)

    def _as_job(self, flight: Flight, what: str, estimate_s: float) -> Job:
        """The flight's job, made (with its watcher) when the flight has none yet."""
        with self._lock:
            if flight.job is None:
                digest = hashlib.sha256((flight.key or str(id(flight))).encode()).hexdigest()[:24]
                flight.job = Job(id=digest, flight=flight, what=what, estimate_s=estimate_s)
                flight.interest += 1  # the job's own interest: withdrawn when its readers stop polling
                self.jobs.add(flight.job)
            flight.job.last_seen = time.monotonic()
            return flight.job

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
        what = computation_name(fn)
        if cost is not None:
            check_cost(cost, self.budgets, lower, what)  # memory, answer, time over the job budget: 422
        text = key_text(key) if key is not None else None
        if text is not None and (body := await self.answers.find(text)) is not None:
            answer = Answer(None, body)
            return answer.as_json() if want == "json" else answer.as_value(view or view_type(fn))
        # A computation is stopped only once no request waits for it, so a waiter never sees another's stop.
        as_job = cost is not None and self.budgets.mode(cost) == "job"
        if as_job and text is None and cost is not None:  # not kept, so not a job: it must fit the request
            check_request_time(cost, self.budgets, self.request_timeout_s, lower, what)
            as_job = False
        flight = self._join(fn, args, kwargs, text, lower, what, background=as_job)
        if (
            as_job or flight.job is not None
        ) and not flight.future.done():  # over the inline budget, or already a job: poll it, do not wait
            seconds = self.budgets.estimated_seconds(cost) if cost is not None else None
            job = self._as_job(flight, what, seconds or self.stats.ewma_seconds)
            self._withdraw(flight)  # this request's interest: the job's own keeps it running
            raise JobPending(job.public())
        answer = await self._wait(flight, current_request(), what)
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

    # -- internals -----------------------------------------------------------------------------------------
    def _join(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: str | None,
        lower: str,
        what: str,
        background: bool = False,
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
            flight = Flight(key=key, interest=1, background=background)
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
            for pool in (self.job_slots, self.slots) if flight.background else (self.slots,):
                while True:
                    try:
                        await pool.acquire(self.slot_wait_s, functools.partial(watched, flight))
                        break
                    except TimeoutError:
                        if flight.key is None or flight.stop.is_set():  # a kept one becomes a job: it waits on
                            if pool is self.slots and flight.background:
                                self.job_slots.release()
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
            self._release(flight)
            self.stats.cancelled += 1
            self._settle(flight, exc=CancelledError("computation abandoned before it started"))
            return
        if "should_stop" not in kwargs and takes_should_stop(fn):
            kwargs = {**kwargs, "should_stop": flight.should_stop}
        ctx = contextvars.copy_context()
        try:
            executor = self._job_executor if flight.background else self._executor
            executor.submit(ctx.run, self._call, flight, fn, args, kwargs, lower, what)
        except RuntimeError as exc:  # executor shut down
            self._release(flight)
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
            # a job gives its helper core back while a computation priced inline runs or waits (schedule.yielding)
            gives_way = yielding(self.inline_wanted) if flight.background else contextlib.nullcontext()
            with stopping(flight.should_stop), progressing(flight.report), gives_way:
                value = fn(*args, **kwargs)
                body = encode(value)  # inside the slot: encoding is part of the bounded work
            if body is not None:
                check_answer(len(body), self.budgets, lower, what)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting requests
            self._release(flight)
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
        if flight.key is not None:  # keep the answer (if JSON) and free the store's claim
            self.answers.keep(flight.key, body)
        self._release(flight)
        self._settle(flight, value=Answer(value, body))

    def inline_wanted(self) -> bool:
        """Whether a computation that is not a job holds a compute slot or waits for one (jobs hold a job slot too)."""
        return self.slots.in_use > self.job_slots.in_use or self.slots.waiting > 0

    def _release(self, flight: Flight) -> None:
        """The flight's compute slot, and its job slot when it took one."""
        self.slots.release()
        if flight.background:
            self.job_slots.release()

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
