"""Where every view builder runs: off the event loop, in a worker thread.

All routers (API and pages) call builders through `compute`, so the bounded pool, the byte-budgeted cache
of weight-derived results and the stop flag live in this one place (helper F hardens it). `key` names the
result for the cache: (checkpoint digest, view name, parameters...); None means "do not cache".
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial
from typing import Any, TypeVar

import anyio.to_thread

T = TypeVar("T")


async def compute(fn: Callable[..., T], *args: Any, key: tuple[Hashable, ...] | None = None, **kwargs: Any) -> T:
    """Run `fn(*args, **kwargs)` in a worker thread and return its result."""
    return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs))
