"""Optional per-client rate limit: at most `settings.rate_limit` requests per moving `rate_window_s` window.

Off unless configured. The counting is the `limits` library's moving window, so one code path serves one
process (memory storage) and many (Redis storage, the same `QKOV_STORE_URL` as the result store): with Redis
the limit is global across workers and replicas. A refused request gets 429 with `Retry-After`; every
metered answer carries the IETF RateLimit header fields `RateLimit-Limit`, `RateLimit-Remaining` and
`RateLimit-Reset` (seconds until a slot frees).

Memory is bounded: in memory storage at most `max_clients` clients are remembered (least recently seen
dropped first). When Redis is unreachable the limiter counts in memory until it is back; it never fails a
request because of its storage.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict

import limits
import limits.storage
import limits.strategies

log = logging.getLogger("qkov.ratelimit")

MAX_CLIENTS = 100_000  # clients remembered by the in-memory storage before the least recently seen is dropped


class RateLimiter:
    def __init__(self, limit: int, window_s: float, storage_url: str = "memory://", max_clients: int = MAX_CLIENTS):
        self.limit = limit
        self.window_s = window_s
        self.max_clients = max_clients
        self.item = limits.RateLimitItemPerSecond(limit, max(1, math.ceil(window_s)))
        self._memory = limits.storage.MemoryStorage()
        self._local = limits.strategies.MovingWindowRateLimiter(self._memory)
        self._shared: limits.strategies.MovingWindowRateLimiter | None = None
        if not storage_url.startswith("memory"):
            shared = limits.storage.storage_from_string(storage_url, socket_timeout=0.5, socket_connect_timeout=0.5)
            self._shared = limits.strategies.MovingWindowRateLimiter(shared)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._shared_down_since: float | None = None

    @property
    def backend(self) -> str:
        return "memory" if self._shared is None or self._shared_down_since is not None else "redis"

    def _remember(self, client: str) -> None:
        """Bound the in-memory storage: forget the least recently seen client past max_clients."""
        with self._lock:
            self._seen[client] = None
            self._seen.move_to_end(client)
            while len(self._seen) > self.max_clients:
                old, _ = self._seen.popitem(last=False)
                self._memory.clear(self.item.key_for(old))

    def _strategy(self) -> limits.strategies.MovingWindowRateLimiter:
        if self._shared is not None:
            down = self._shared_down_since
            if down is None or time.monotonic() - down >= 5.0:
                return self._shared
        return self._local

    def stalled(self) -> None:
        """The shared storage did not answer within the caller's timeout (a frozen Redis): count in this process
        for the next RETRY_S, as after an error, instead of waiting on it again for every request."""
        if self._shared is not None and self._shared_down_since is None:
            log.warning("rate-limit storage stalled: counting per process")
        self._shared_down_since = time.monotonic()

    def hit(self, client: str) -> tuple[bool, int, int]:
        """Count one request: (allowed, remaining in the window, seconds until a request is allowed again)."""
        strategy = self._strategy()
        try:
            allowed = strategy.hit(self.item, client)
            stats = strategy.get_window_stats(self.item, client)
            if strategy is self._shared and self._shared_down_since is not None:
                log.warning("rate-limit storage reachable again")
                self._shared_down_since = None
        except Exception as exc:  # the shared storage failed (Redis down): count locally, never fail the request
            if self._shared_down_since is None:
                log.warning("rate-limit storage unreachable (%s): counting per process", type(exc).__name__)
            self._shared_down_since = time.monotonic()
            strategy = self._local
            allowed = strategy.hit(self.item, client)
            stats = strategy.get_window_stats(self.item, client)
        if strategy is self._local:
            self._remember(client)
        reset = max(1, math.ceil(stats.reset_time - time.time()))
        return allowed, max(0, stats.remaining), reset
