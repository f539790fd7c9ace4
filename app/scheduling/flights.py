"""One computation and the requests waiting for it (a flight), the job it runs as when a reader polls it
instead of waiting, and the two ways a request is answered before the computation ends (BusyError, JobPending)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from circuits_core.errors import CancelledError

log = logging.getLogger("qkov.compute")


class BusyError(Exception):
    """Every compute slot stayed busy for the whole wait: HTTP 503 with `Retry-After: retry_after`."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class JobPending(Exception):
    """The request runs as a job (priced over the inline budget): the API answers 202 with `job` (its public
    state, app/scheduling/flights.py Job.public), a page shows a progress bar polling it."""

    def __init__(self, job: dict[str, Any]):
        super().__init__(f"{job['what']} runs as a job: poll {job['status_url']}")
        self.job = job


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
    background: bool = False  # priced over the inline budget: takes a job slot first, runs on the nicer threads

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


WATCHED_S = 3.0  # a job polled this recently has a reader waiting for it (a page polls its job every second)


def watched(flight: Flight) -> bool:
    """Whether someone waits for the flight now: a request (no job yet), or a reader who polled its job within
    WATCHED_S. A page left after its first answer (a 202 and its progress bar) polls no more."""
    job = flight.job
    return job is None or time.monotonic() - job.last_seen < WATCHED_S


@dataclass
class Stats:
    completed: int = 0
    failed: int = 0
    cancelled: int = 0  # stopped by their stop flag, or abandoned before they started
    rejected_busy: int = 0
    shared: int = 0  # requests that joined a computation already running
    compute_seconds: float = 0.0
    ewma_seconds: float = 0.5  # recent duration of one computation (for Retry-After)


class JobTable:
    """The jobs of one service by id, each with a watcher that stops it once no reader has polled it for
    `abandon_s` (`withdraw` takes the job's own interest back from its flight)."""

    def __init__(self, abandon_s: float, withdraw: Callable[[Flight], None]):
        self.abandon_s = abandon_s
        self._withdraw = withdraw
        self._jobs: dict[str, Job] = {}

    def get(self, job_id: str) -> Job | None:
        """A job by id (a reader polling it: it stays wanted), None when unknown or long finished."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.last_seen = time.monotonic()
        return job

    def add(self, job: Job) -> None:
        """Keep a new job and start its watcher (on the running event loop)."""
        self._prune()
        self._jobs[job.id] = job
        asyncio.get_running_loop().create_task(self._watch(job))

    def _prune(self) -> None:
        """Forget jobs finished more than a minute ago (their answers are in the cache and store)."""
        now = time.monotonic()
        for job_id in [j.id for j in self._jobs.values() if j.finished is not None and now - j.finished > 60]:
            del self._jobs[job_id]

    async def _watch(self, job: Job) -> None:
        """Stop the job once no reader has polled it for abandon_s (they left)."""
        waiting = asyncio.wrap_future(job.flight.future)
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=min(1.0, self.abandon_s / 4))
            if done:
                job.finished = time.monotonic()
                return
            if time.monotonic() - job.last_seen > self.abandon_s:
                log.info("job %s (%s): no reader polled it for %g s, stopping it", job.id, job.what, self.abandon_s)
                self._withdraw(job.flight)
                job.finished = time.monotonic()
                return


def takes_should_stop(fn: Callable[..., Any]) -> bool:
    """Whether a computation takes a `should_stop` callback (then the service passes its flight's)."""
    try:
        return "should_stop" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def computation_name(fn: Callable[..., Any]) -> str:
    """How a refusal names the computation: 'build_qk_paths_view' -> 'qk paths'."""
    name = getattr(fn, "__name__", "this request")
    name = name.removeprefix("build_").removesuffix("_view").replace("_", " ")
    return f"the {name} request" if name else "this request"
