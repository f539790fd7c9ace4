"""Where computed answers outlive a process: an embedded store on disk, or Redis shared by replicas.

The in-process cache (app/cache.py) stays in front; this is its second level, keyed by the same string the
pipeline derives for every analysis (model id, digest of every answer-changing file, normalised parameters).

- `DiskStore` (the default, `QKOV_STORE_URL=disk`): a diskcache (SQLite + files) folder, shared by the
  workers of one machine and kept across restarts, with a byte budget and least-recently-used eviction.
- `RedisStore` (`QKOV_STORE_URL=redis://host:port/db`): shared by every replica; answers expire after
  `store_ttl_s`. When Redis cannot be reached it falls back to its local DiskStore, logs the change once,
  reports it in `status()` (shown by /readyz) and tries Redis again after `RETRY_S`; it never raises.
- `QKOV_STORE_URL=off`: no second level.

A value is always the encoded JSON answer, zlib-compressed: bytes in, bytes out. Nothing is unpickled from a
shared store: `RawDisk` refuses any row diskcache would unpickle, so a hostile row cannot run code.

Authentication (the store is a trust boundary: docs/serving.md): every row carries an HMAC-SHA256 over its key and
body (`StoreTier`), under QKOV_STORE_SECRET when it is set. Without it rows are still never served unauthenticated:
a disk store uses a key drawn once and kept in a file beside the store folder, never in it (`store_key`: the
workers of one machine and its restarts share it), and a Redis store is not used at all (it is shared with other
machines, which would need the same secret): the server keeps to the disk fallback and says so.

Single-flight across processes: `claim(key)` is an atomic "set if absent, with expiry" lock (diskcache `add`,
Redis `SET NX PX`). The process that gets it computes and `put`s; the others wait for the answer to appear
(`StoreTier.claim_or_wait`), and compute themselves only if the lock expires first (its holder died).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Any, Protocol

import diskcache
import redis

log = logging.getLogger("qkov.store")

RETRY_S = 5.0  # how long a RedisStore stays on its fallback before trying Redis again
LOCK_PREFIX = "qkov:lock:"
KEY_PREFIX = "qkov:answer:"
ZLIB_LEVEL = 6


def compress(body: bytes) -> bytes:
    return zlib.compress(body, ZLIB_LEVEL)


def decompress(blob: bytes) -> bytes:
    return zlib.decompress(blob)


class ResultStore(Protocol):
    name: str

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, body: bytes) -> None: ...

    def claim(self, key: str, ttl_s: float) -> bool: ...

    def release(self, key: str) -> None: ...

    def status(self) -> dict[str, Any]: ...


STORE_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")  # the names diskcache's Disk.filename makes


class RawDisk(diskcache.Disk):
    """diskcache's Disk that never unpickles (only bytes and str rows are read back) and never acts on a file name
    it did not make: a row's file name is a column of cache.db, so whoever can write the folder could name
    '/etc/passwd' or '../x' (os.path.join keeps an absolute name), and removing the row would delete that file
    and its parent folders. Only names of diskcache's own shape are read or removed."""

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        if mode == diskcache.core.MODE_PICKLE:
            raise ValueError("refusing a pickled row in the result store")
        if filename is not None and not STORE_FILE.fullmatch(filename):
            raise ValueError("refusing a store row whose file name diskcache did not make")
        return super().fetch(mode, filename, value, read)

    def remove(self, file_path: str) -> None:
        if STORE_FILE.fullmatch(file_path):
            super().remove(file_path)
        else:
            log.warning("result store: not removing %r, a file name diskcache did not make", file_path[:200])


class DiskStore:
    """A byte-budgeted diskcache folder shared by the processes of one machine."""

    name = "disk"

    def __init__(self, directory: Path, budget_bytes: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.budget_bytes = budget_bytes
        self._cache = diskcache.Cache(
            str(directory),
            size_limit=budget_bytes,
            eviction_policy="least-recently-used",
            disk=RawDisk,
            cull_limit=10,
            statistics=False,
        )
        self._owner = f"{os.getpid()}-{uuid.uuid4().hex}"

    def get(self, key: str) -> bytes | None:
        try:
            blob = self._cache.get(KEY_PREFIX + key)
        except ValueError:  # a pickled row planted in the folder: treat as absent and drop it
            self._cache.delete(KEY_PREFIX + key)
            return None
        if not isinstance(blob, bytes):
            return None
        return decompress(blob)

    def put(self, key: str, body: bytes) -> None:
        self._cache.set(KEY_PREFIX + key, compress(body))

    def claim(self, key: str, ttl_s: float) -> bool:
        return bool(self._cache.add(LOCK_PREFIX + key, self._owner, expire=ttl_s))

    def release(self, key: str) -> None:
        with self._cache.transact():
            if self._cache.get(LOCK_PREFIX + key) == self._owner:
                self._cache.delete(LOCK_PREFIX + key)

    @property
    def bytes(self) -> int:
        return int(self._cache.volume())

    def status(self) -> dict[str, Any]:
        return {"store": self.name, "directory_bytes": self.bytes, "budget_bytes": self.budget_bytes, "ok": True}

    def close(self) -> None:
        self._cache.close()


class RedisStore:
    """Answers in Redis, shared by replicas; a local DiskStore takes over while Redis is unreachable."""

    name = "redis"

    def __init__(self, url: str, fallback: DiskStore | None, ttl_s: float, timeout_s: float = 0.5):
        self.url = url
        self.fallback = fallback
        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._down_since: float | None = None
        self._last_error = ""
        self._guard = threading.Lock()
        self._owner = f"{os.getpid()}-{uuid.uuid4().hex}"

    # -- availability ----------------------------------------------------------------------------------
    def _usable(self) -> bool:
        with self._guard:
            return self._down_since is None or time.monotonic() - self._down_since >= RETRY_S

    def _failed(self, exc: Exception) -> None:
        with self._guard:
            if self._down_since is None:
                log.warning(
                    "redis store unreachable (%s): answers go to the local store until it is back", type(exc).__name__
                )
            self._down_since = time.monotonic()
            self._last_error = f"{type(exc).__name__}: {exc}"[:200]

    def _recovered(self) -> None:
        with self._guard:
            if self._down_since is not None:
                log.warning("redis store reachable again")
            self._down_since = None

    def _call(self, op: str, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """(True, result) when Redis answered, (False, None) when it is down (the caller falls back)."""
        if not self._usable():
            return False, None
        try:
            result = getattr(self._redis, op)(*args, **kwargs)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            self._failed(exc)
            return False, None
        self._recovered()
        return True, result

    # -- the store -------------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        ok, blob = self._call("get", KEY_PREFIX + key)
        if not ok:
            return self.fallback.get(key) if self.fallback else None
        return decompress(blob) if isinstance(blob, bytes) else None

    def put(self, key: str, body: bytes) -> None:
        ok, _ = self._call("set", KEY_PREFIX + key, compress(body), px=int(self.ttl_s * 1000))
        if not ok and self.fallback:
            self.fallback.put(key, body)

    def claim(self, key: str, ttl_s: float) -> bool:
        ok, got = self._call("set", LOCK_PREFIX + key, self._owner, nx=True, px=max(1, int(ttl_s * 1000)))
        if not ok:
            return self.fallback.claim(key, ttl_s) if self.fallback else True
        return bool(got)

    def release(self, key: str) -> None:
        # delete the lock only if this process still holds it (compare-and-delete in one script)
        ok, _ = self._call("eval", _RELEASE_LUA, 1, LOCK_PREFIX + key, self._owner)
        if not ok and self.fallback:
            self.fallback.release(key)

    def status(self) -> dict[str, Any]:
        up = self._call("ping")[0]
        out: dict[str, Any] = {"store": self.name, "ok": up}
        if not up:
            out["detail"] = (
                f"redis unreachable ({self._last_error}); using the local store"
                if self.fallback
                else "redis unreachable"
            )
        return out


_RELEASE_LUA = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


REPO_ROOT = Path(__file__).resolve().parent.parent
CODE_ROOTS = ("app", "circuits_core", "templates", "static")
CODE_SUFFIXES = (".py", ".html", ".js", ".css")


def code_version(root: Path = REPO_ROOT) -> str:
    """A digest of the code and templates that compute and render answers (16 hex digits)."""
    digest = hashlib.sha256()
    for top in CODE_ROOTS:
        for path in sorted((root / top).rglob("*")):
            if path.suffix in CODE_SUFFIXES and path.is_file():
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


KEY_BYTES = 32


def key_file(directory: Path) -> Path:
    """Where a disk store keeps its key when no secret is set: beside the store folder (`.store` -> `.store.key`)."""
    return directory.with_name(directory.name + ".key")


def store_key(directory: Path) -> bytes:
    """The disk store's key when no secret is set: 32 random bytes in `key_file(directory)`, drawn on first use
    (created exclusively, readable by this account only) and read after; OSError when it cannot be made or read,
    or the file is not a key (then the store is not used)."""
    path = key_file(directory)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) != KEY_BYTES:
            raise OSError(f"{path.name} holds {len(key)} bytes, not a {KEY_BYTES}-byte key") from None
        return key
    key = os.urandom(KEY_BYTES)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key)
    return key


def open_store(url: str, directory: Path, budget_bytes: int, ttl_s: float) -> ResultStore | None:
    """The store a Settings names: "off", "disk" or a redis:// URL (with the disk store as its fallback, or none
    when the disk store cannot be opened). Raises what opening the disk store raised for "disk"."""
    if url == "off":
        return None
    if url == "disk":
        return DiskStore(directory, budget_bytes)
    if url.startswith(("redis://", "rediss://", "unix://")):
        try:
            fallback: DiskStore | None = DiskStore(directory, budget_bytes)
        except Exception as exc:  # an unwritable folder, a corrupt cache.db: Redis alone, no local fallback
            log.error("disk fallback of the Redis store not opened (%s: %s)", type(exc).__name__, str(exc)[:200])
            fallback = None
        return RedisStore(url, fallback=fallback, ttl_s=ttl_s)
    raise ValueError(f"store URL {url!r} is not 'off', 'disk' or a redis:// URL")


class StoreTier:
    """The store as the compute service uses it: never raises, never blocks the event loop.

    Counters (read by /metrics): `hits` answers found in the store, `waited` answers another process computed
    while this one waited for its claim, `puts` answers written, `errors` store operations that failed.
    """

    def __init__(
        self,
        store: ResultStore,
        claim_ttl_s: float,
        poll_s: float = 0.05,
        code: str | None = None,
        secret: bytes | None = None,
        key_source: str = "secret",
        note: str | None = None,
    ):
        """`key_source` says on /readyz where `secret` came from (QKOV_STORE_SECRET, or the disk store's key file);
        `note` why the store in use is not the one the settings name."""
        self.key_source, self.note = key_source, note
        self.store = store
        self.claim_ttl_s = claim_ttl_s
        self.poll_s = poll_s
        self.code = code_version() if code is None else code
        self.secret = secret
        self.hits = self.waited = self.puts = self.errors = self.rejected = 0

    def _seal(self, key: str, body: bytes) -> bytes:
        """With a secret: HMAC-SHA256 over (key, body) in front of the body, so a row written by anyone without
        the secret, or moved to another key, fails the check."""
        if self.secret is None:
            return body
        return hmac.new(self.secret, key.encode() + b"\0" + body, hashlib.sha256).digest() + body

    def _opened(self, key: str, row: bytes | None) -> bytes | None:
        """The body of a row that passes the check; None (recomputed) for one that does not."""
        if row is None or self.secret is None:
            return row
        mac, body = row[:32], row[32:]
        if len(row) < 32 or not hmac.compare_digest(mac, self._seal(key, body)[:32]):
            self.rejected += 1
            log.warning("result store: a row failed its authentication check and is recomputed")
            return None
        return body

    def _key(self, key: str) -> str:
        """Keys outlive the process: the code that computed an answer is part of its key (a deploy changes it)."""
        return f"{self.code}|{key}"

    def _safe(self, op: Any, *args: Any) -> Any:
        try:
            return op(*args)
        except Exception as exc:  # a full disk, a locked SQLite file, a broken row: the answer is computed instead
            self.errors += 1
            log.warning("result store %s failed: %s", getattr(op, "__name__", "operation"), type(exc).__name__)
            return None

    async def get(self, key: str) -> bytes | None:
        row = await asyncio.to_thread(self._safe, self.store.get, self._key(key))
        body = self._opened(self._key(key), row)
        if body is not None:
            self.hits += 1
        return body  # type: ignore[no-any-return]

    async def claim_or_wait(self, key: str, stopped: Any) -> bytes | None:
        """None when this process holds the claim and should compute; else the answer another process put."""
        while True:
            claimed = await asyncio.to_thread(self._safe, self.store.claim, self._key(key), self.claim_ttl_s)
            row = await asyncio.to_thread(self._safe, self.store.get, self._key(key))
            body = self._opened(self._key(key), row)
            if body is not None:  # put by another process, perhaps just before it released its claim
                if claimed:
                    await asyncio.to_thread(self.release, key)
                self.waited += 1
                return body  # type: ignore[no-any-return]
            if claimed is None or claimed:  # claimed, or the store failed: compute here
                return None
            if stopped():
                return None
            await asyncio.sleep(self.poll_s)

    async def put(self, key: str, body: bytes) -> None:
        """Keep an answer computed outside the compute pool (a rendered page): no claim to free."""
        await asyncio.to_thread(self._safe, self.store.put, self._key(key), self._seal(self._key(key), body))
        self.puts += 1

    def save(self, key: str, body: bytes) -> None:
        """In the worker thread, after computing: keep the answer, then free the claim."""
        self._safe(self.store.put, self._key(key), self._seal(self._key(key), body))
        self.puts += 1
        self._safe(self.store.release, self._key(key))

    def release(self, key: str) -> None:
        self._safe(self.store.release, self._key(key))

    def status(self) -> dict[str, Any]:
        out = self._safe(self.store.status) or {"store": self.store.name, "ok": False, "detail": "status failed"}
        out = {**out, "authenticated": self.secret is not None, "rejected_rows": self.rejected}
        if self.secret is not None:
            out["key"] = self.key_source
        return {**out, "note": self.note} if self.note is not None else out
