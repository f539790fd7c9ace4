"""A byte-budgeted LRU cache of encoded answers: `get(key) -> bytes | None`, `put(key, bytes)`.

Values are the answers' JSON bytes (encoded inside the compute slot that built them), so `len(value)` is what
the entry holds and the accounting is real: an entry is charged its length plus its key and a fixed
per-entry overhead (the dict slot, the bytes and str headers). Keys are plain strings (model id, digest of
every answer-changing file, analysis, normalised parameters), the same key a persistent store (app/store.py)
sits behind. An entry over the whole budget is not kept; the least recently used ones are evicted until a
new one fits. Thread-safe: worker threads store, request handlers read. Each process has its own cache.

Memory you can plan for: a serving process holds its loaded models, at most `cache_bytes` of answers, one
request's priced working memory per compute slot while it runs (`limits.peak_bytes`, refused before it runs
when over), and a fixed overhead. Measured by tests/app/test_serving_load.py on a real uvicorn: 2,000 distinct
prompts filling an 8 MiB cache grew RSS by 9.8 MiB; the bound asserted there is cache_bytes + 64 MiB.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

# bytes + str object headers and the OrderedDict's entry (hash slot, linked-list node, tuple of value and size)
ENTRY_OVERHEAD = sys.getsizeof(b"") + sys.getsizeof("") + 200


def entry_bytes(key: str, value: bytes) -> int:
    """What an entry holds: the value, its key and ENTRY_OVERHEAD."""
    return len(value) + len(key.encode()) + ENTRY_OVERHEAD


class ResultCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._items: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> bytes | None:
        """The value on a hit (counted, refreshed), None on a miss (counted)."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def peek(self, key: str) -> bytes | None:
        """Like get, without counting or refreshing."""
        with self._lock:
            item = self._items.get(key)
            return None if item is None else item[0]

    def put(self, key: str, value: bytes) -> bool:
        """Keep value under key; False when it is bigger than the whole budget (not kept)."""
        if not isinstance(value, bytes):
            raise TypeError(f"the cache holds encoded answers (bytes), got {type(value).__name__}")
        size = entry_bytes(key, value)
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
