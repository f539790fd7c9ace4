"""The compute slots: a FIFO counting semaphore awaitable from any event loop and released from any thread
(a worker thread releases its slot when its computation returns, not when the awaiting request gives up)."""

from __future__ import annotations

import asyncio
import threading
from collections import deque


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
