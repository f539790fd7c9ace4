"""The compute slots (a FIFO semaphore released from worker threads) and the compute threads' share of the
machine: their niceness and their torch intra-op thread count."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import deque
from collections.abc import Callable

from circuits_core.schedule import available_cores

log = logging.getLogger("qkov.compute")


def _always() -> bool:
    return True


class Slots:
    """A FIFO counting semaphore awaitable from any event loop and released from any thread (a worker thread
    releases its slot when its computation returns, not when the awaiting request gives up). A waiter may say
    whether someone watches it now (`watched`: a job whose progress a reader polls): a freed slot goes to the first
    waiter watched, else to the first in line, so a job a page is waiting for never queues behind jobs whose pages
    were left (they are stopped once nobody has polled them for job_abandon_s, but hold their place until then)."""

    def __init__(self, n: int):
        self.n = n
        self.in_use = 0
        self._lock = threading.Lock()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None], Callable[[], bool]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, timeout: float, watched: Callable[[], bool] = _always) -> None:
        """Take a slot, waiting at most `timeout` seconds (TimeoutError)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.in_use < self.n and not self._waiters:
                self.in_use += 1
                return
            entry = (loop, loop.create_future(), watched)
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
                entry = next((e for e in self._waiters if e[2]()), self._waiters[0])  # the first watched, else first
                self._waiters.remove(entry)
                loop, fut, _ = entry
                try:  # hand the slot over directly (in_use unchanged)
                    loop.call_soon_threadsafe(_grant, fut)
                    return
                except RuntimeError:  # that waiter's loop is closed
                    continue
            self.in_use -= 1


def _grant(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def default_torch_threads(slots: int) -> int:
    return max(1, available_cores() // slots)


# Compute threads run this much nicer than the rest of the process (Linux nice is per thread and inherited by the
# torch intra-op threads a compute thread starts), so the event loop and cheap work get a core when they need one.
COMPUTE_NICE = 10
# Jobs (priced over the inline budget) run a little nicer still, at 12: a page's inline computation beside a job gets
# the larger share of the cores (CFS weights 110 against 70). Not 19: beside other processes of the machine (at nice 0)
# jobs at 19 (weight 15) took 1.5-3x as long in `bench real` under load (the residual usage panel 112 -> 176 s).
JOB_NICE = 2


def lower_thread_priority(nice: int) -> None:
    """Make the calling thread (and the threads it starts later) `nice` steps nicer, up to 19; no-op off Linux."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # not permitted here: run at the normal priority
        log.warning("could not lower the compute thread's priority: %s", exc)
