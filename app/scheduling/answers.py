"""The answers one service keeps: the in-memory cache (app/cache.py) in front of the result store (app/store.py),
both under the same key text, and the parts that one computation builds for another (`cached_build`: built once
however many computations ask at the same time)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from app.cache import ResultCache
from app.pricing import Key, encode, key_text
from app.store import StoreTier

V = TypeVar("V", bound=BaseModel)


class KeptAnswers:
    """Encoded answers by key: memory first, then the store shared by processes (disk or Redis)."""

    def __init__(self, cache: ResultCache, store: StoreTier | None):
        self.cache = cache
        self.store = store
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}  # cached_build's key -> the lock its one builder holds

    async def find(self, text: str) -> bytes | None:
        """A kept answer's JSON: from memory, else from the store (and then kept in memory too); None if neither."""
        body = self.cache.get(text)
        if body is None and self.store is not None and (body := await self.store.get(text)) is not None:
            self.cache.put(text, body)
        return body

    def keep(self, text: str, body: bytes | None) -> None:
        """A finished computation's answer, in memory and in the store; without a JSON body (an answer that is not
        a view) only the store's claim on the key is freed."""
        if body is not None:
            self.cache.put(text, body)
        if self.store is not None:
            if body is not None:
                self.store.save(text, body)
            else:
                self.store.release(text)

    def cached(self, key: Key, view: type[V]) -> V | None:
        """Inside a computation: another answer from the cache when there, else None (nothing is built)."""
        body = self.cache.get(key_text(key))
        return None if body is None else view.model_validate_json(body)

    def cached_build(self, key: Key, view: type[V], build: Callable[[], V]) -> V:
        """Inside a computation: another answer from the cache when there, else built here, encoded and kept."""
        hit = self.cached(key, view)
        if hit is not None:
            return hit
        text = key_text(key)
        with self._lock:
            building = self._building.setdefault(text, threading.Lock())
        with building:  # two computations that need the same part: one builds it, the other waits and reads it
            hit = self.cached(key, view)
            if hit is not None:
                return hit
            value = build()
            encoded = encode(value)
            if encoded is not None:
                self.cache.put(text, encoded)
        with self._lock:
            self._building.pop(text, None)
        return value
