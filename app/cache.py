"""A byte-budgeted LRU cache of weight-derived results (circuits, scores, composition matrices).

Keys are (checkpoint digest, view name, parameters...), so a changed checkpoint never hits an old entry.
Sizes are estimated: a pydantic model by the length of its JSON, a tensor by its bytes, containers by their
items. An entry over the whole budget is not kept; older entries are evicted until the new one fits.
Thread-safe: worker threads store, request handlers read. Each process (worker, replica) has its own cache.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch
from pydantic import BaseModel

OVERHEAD = 64  # bytes charged per entry and per container item besides its payload


def nbytes(obj: Any) -> int:
    """An estimate of the memory held by a cached result."""
    if isinstance(obj, BaseModel):
        return len(obj.model_dump_json()) + OVERHEAD
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() + OVERHEAD
    if isinstance(obj, bytes | str):
        return len(obj) + OVERHEAD
    if isinstance(obj, dict):
        return OVERHEAD + sum(nbytes(k) + nbytes(v) for k, v in obj.items())
    if isinstance(obj, list | tuple | set | frozenset):
        return OVERHEAD + sum(nbytes(v) for v in obj)
    return sys.getsizeof(obj)


class ResultCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> tuple[bool, Any]:
        """(True, value) on a hit (counted, refreshed), (False, None) on a miss (counted)."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return False, None
            self._items.move_to_end(key)
            self.hits += 1
            return True, item[0]

    def peek(self, key: Hashable) -> tuple[bool, Any]:
        """Like get, without counting."""
        with self._lock:
            item = self._items.get(key)
            return (False, None) if item is None else (True, item[0])

    def put(self, key: Hashable, value: Any) -> bool:
        """Keep value under key; False when it is bigger than the whole budget (not kept)."""
        size = nbytes(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size > self.budget_bytes:
                return False
            while self._items and self.bytes + size > self.budget_bytes:
                _, (_, freed) = self._items.popitem(last=False)
                self.bytes -= freed
                self.evictions += 1
            self._items[key] = (value, size)
            self.bytes += size
            return True

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
