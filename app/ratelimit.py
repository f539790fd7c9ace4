"""Optional per-client rate limit: a fixed window of `settings.rate_limit` requests per `rate_window_s`.

Off unless configured. A refused request gets 429 with `Retry-After`; every metered answer carries the
IETF RateLimit header fields `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset` (seconds until
the window resets). The client is the connection's address; behind a proxy run uvicorn with
`--proxy-headers --forwarded-allow-ips=<proxy>` so that it is the real client. Counts are per process:
with N workers or replicas a client gets up to N x the limit (use the load balancer's limiter for a
global one).
"""

from __future__ import annotations

import math
import threading
import time

MAX_CLIENTS = 100_000  # windows remembered before old ones are dropped


class RateLimiter:
    def __init__(self, limit: int, window_s: float):
        self.limit = limit
        self.window_s = window_s
        self._windows: dict[str, tuple[float, int]] = {}  # client -> (window start, count)
        self._lock = threading.Lock()

    def hit(self, client: str, now: float | None = None) -> tuple[bool, int, int]:
        """Count one request: (allowed, remaining in this window, seconds until it resets)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            start, count = self._windows.get(client, (now, 0))
            if now - start >= self.window_s:
                start, count = now, 0
            allowed = count < self.limit
            if allowed:
                count += 1
            self._windows[client] = (start, count)
            if len(self._windows) > MAX_CLIENTS:
                self._windows = {c: w for c, w in self._windows.items() if now - w[0] < self.window_s}
        reset = max(1, math.ceil(start + self.window_s - now))
        return allowed, self.limit - count, reset
