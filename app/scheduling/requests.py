"""The request a computation serves (is it still wanted?), set per request by app/serving_middleware.py (through
app/scheduling `bind`, with the service) and read through a context variable."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


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


_REQUEST: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("qkov_request_context", default=None)


def set_request(request: RequestContext | None) -> None:
    """The request the current task serves (`bind` sets it with the service)."""
    _REQUEST.set(request)


def current_request() -> RequestContext | None:
    """The request set for this task, None outside a request."""
    return _REQUEST.get()
