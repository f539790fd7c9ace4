"""The second-level result store and the rate limiter, against a real disk folder and a real redis-server."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import diskcache
import pytest

from app.ratelimit import RateLimiter
from app.scheduling import bind, compute
from app.scheduling.service import ComputeService
from app.store import DiskStore, RedisStore, StoreTier, code_version, open_store
from tests.app.redis_server import RedisServer, running_redis


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path) as server:
        yield server


def body(i: int, n: int = 2000) -> bytes:
    return (f'{{"i": {i}, "x": "' + os.urandom(n).hex() + '"}').encode()


# -- disk ------------------------------------------------------------------------------------------------
def test_disk_store_round_trip_and_survives_reopening(tmp_path: Path) -> None:
    first = DiskStore(tmp_path / "s", 64 * 2**20)
    first.put("toy-2l|abc|heads", b'{"heads": [1, 2]}')
    assert first.get("toy-2l|abc|heads") == b'{"heads": [1, 2]}'
    assert first.get("toy-2l|abc|other") is None
    first.close()
    again = DiskStore(tmp_path / "s", 64 * 2**20)  # a restarted process
    assert again.get("toy-2l|abc|heads") == b'{"heads": [1, 2]}'


def test_disk_store_keeps_to_its_byte_budget_and_evicts_the_least_recent(tmp_path: Path) -> None:
    budget = 2**20
    store = DiskStore(tmp_path / "s", budget)
    bodies = {f"k{i}": body(i, 20_000) for i in range(120)}  # ~40 KB each after hex, random: barely compresses
    for k, v in bodies.items():
        store.put(k, v)
    assert store.bytes <= budget * 1.1  # diskcache culls on writes, up to cull_limit rows at a time
    assert store.get("k119") == bodies["k119"]
    assert store.get("k0") is None


def test_disk_store_never_unpickles_a_planted_row(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "s", 2**24)
    marker = tmp_path / "pwned"
    planted = diskcache.Cache(str(tmp_path / "s"))  # default Disk: pickles non-bytes values
    planted.set("qkov:answer:k", _Payload(str(marker)))
    planted.close()
    assert store.get("k") is None
    assert not marker.exists()


class _Payload:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def test_disk_claim_is_a_lock_between_processes_with_expiry(tmp_path: Path) -> None:
    a, b = DiskStore(tmp_path / "s", 2**24), DiskStore(tmp_path / "s", 2**24)  # two workers, one folder
    assert a.claim("k", ttl_s=30)
    assert not b.claim("k", ttl_s=30)
    b.release("k")  # not b's lock: nothing happens
    assert not b.claim("k", ttl_s=30)
    a.release("k")
    assert b.claim("k", ttl_s=0.05)
    time.sleep(0.1)
    assert a.claim("k", ttl_s=30)  # b's lock expired


def test_claim_or_wait_returns_the_answer_another_process_puts(tmp_path: Path) -> None:
    a = StoreTier(DiskStore(tmp_path / "s", 2**24), claim_ttl_s=10, code="c")
    b = StoreTier(DiskStore(tmp_path / "s", 2**24), claim_ttl_s=10, code="c")  # another worker, same folder

    async def a_claims() -> bytes | None:
        return await a.claim_or_wait("k", stopped=lambda: False)

    assert asyncio.run(a_claims()) is None  # a holds the claim: it computes
    threading.Timer(0.2, a.save, ("k", b"done")).start()  # a's answer, then its claim freed
    assert asyncio.run(b.claim_or_wait("k", stopped=lambda: False)) == b"done"
    assert b.waited == 1


def test_a_keyed_answer_that_is_not_json_still_frees_its_claim(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "s", 2**24)
    service = ComputeService(slots=1, cache_bytes=2**20, store=StoreTier(store, claim_ttl_s=60))

    async def ask() -> int:
        bind(service, None)
        return await compute(lambda: 42, key=("k",))

    assert asyncio.run(ask()) == 42
    assert DiskStore(tmp_path / "s", 2**24).claim("k", 60)  # another process may compute it at once
    service.close()


def test_answers_of_other_code_are_not_served(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "s", 2**24)
    old, new = StoreTier(store, 60, code="old"), StoreTier(store, 60, code="new")

    async def put_then_get() -> tuple[bytes | None, bytes | None]:
        await old.put("k", b"computed by the old code")
        return await new.get("k"), await old.get("k")

    assert asyncio.run(put_then_get()) == (None, b"computed by the old code")


def test_the_code_version_follows_the_code(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "views.py").write_text("x = 1\n")
    (tmp_path / "app" / "notes.txt").write_text("not code")
    first = code_version(tmp_path)
    (tmp_path / "app" / "notes.txt").write_text("still not code")
    assert code_version(tmp_path) == first
    (tmp_path / "app" / "views.py").write_text("x = 2\n")
    assert code_version(tmp_path) != first
    assert code_version() != first  # the real tree


# -- redis -----------------------------------------------------------------------------------------------
def test_redis_store_is_shared_between_replicas(redis_server: RedisServer, tmp_path: Path) -> None:
    one = RedisStore(redis_server.url, fallback=DiskStore(tmp_path / "one", 2**24), ttl_s=60)
    two = RedisStore(redis_server.url, fallback=DiskStore(tmp_path / "two", 2**24), ttl_s=60)
    answer = body(1)
    one.put("k", answer)
    assert two.get("k") == answer
    assert one.claim("lock", 30) and not two.claim("lock", 30)
    two.release("lock")  # not its lock
    assert not two.claim("lock", 30)
    one.release("lock")
    assert two.claim("lock", 30)
    assert one.status()["ok"] is True


def test_redis_store_compresses_what_it_keeps(redis_server: RedisServer, tmp_path: Path) -> None:
    import redis

    store = RedisStore(redis_server.url, fallback=None, ttl_s=60)
    text = b'{"rows": [' + b", ".join(b'{"token": "self", "value": 1.0}' for _ in range(2000)) + b"]}"
    store.put("k", text)
    raw = redis.Redis.from_url(redis_server.url).get("qkov:answer:k")
    assert raw is not None and len(raw) < len(text) / 10
    assert store.get("k") == text


def test_a_killed_redis_falls_back_to_the_local_store_without_raising(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    store = RedisStore(redis_server.url, fallback=DiskStore(tmp_path / "local", 2**24), ttl_s=60)
    store.put("before", b"1")
    redis_server.kill()
    store.put("after", b"2")  # goes to the disk fallback
    assert store.get("after") == b"2"
    status = store.status()
    assert status["ok"] is False and "local store" in status["detail"]
    assert store.claim("k", 5) is True  # the local lock still works


def test_open_store_names(tmp_path: Path) -> None:
    assert open_store("off", tmp_path, 2**20, 60) is None
    assert isinstance(open_store("disk", tmp_path, 2**20, 60), DiskStore)
    assert isinstance(open_store("redis://127.0.0.1:1/0", tmp_path, 2**20, 60), RedisStore)
    with pytest.raises(ValueError, match="not 'off'"):
        open_store("ftp://x", tmp_path, 2**20, 60)


# -- rate limit --------------------------------------------------------------------------------------------
def test_rate_limiter_moving_window_in_memory() -> None:
    limiter = RateLimiter(3, 60)
    seen = [limiter.hit("1.2.3.4") for _ in range(4)]
    assert [s[0] for s in seen] == [True, True, True, False]
    assert [s[1] for s in seen[:3]] == [2, 1, 0]
    assert 1 <= seen[3][2] <= 60
    assert limiter.hit("5.6.7.8")[0]  # another client has its own window


def test_rate_limiter_memory_is_bounded() -> None:
    limiter = RateLimiter(2, 60, max_clients=50)
    for i in range(2000):
        limiter.hit(f"10.0.{i // 256}.{i % 256}")
    assert len(limiter._seen) == 50
    assert len(limiter._memory.events) <= 50
    assert limiter.hit("10.0.0.0")[0]  # forgotten long ago: a fresh window


def test_rate_limiter_is_global_across_replicas_with_redis(redis_server: RedisServer) -> None:
    one, two = RateLimiter(4, 60, redis_server.url), RateLimiter(4, 60, redis_server.url)
    allowed = [one.hit("c")[0], two.hit("c")[0], one.hit("c")[0], two.hit("c")[0], one.hit("c")[0]]
    assert allowed == [True, True, True, True, False]
    assert one.backend == "redis"


def test_rate_limiter_counts_locally_when_redis_dies(redis_server: RedisServer) -> None:
    limiter = RateLimiter(2, 60, redis_server.url)
    assert limiter.hit("c")[0]
    redis_server.kill()
    assert limiter.hit("c")[0] and limiter.hit("c")[0]  # a fresh local window
    assert not limiter.hit("c")[0]
    assert limiter.backend == "memory"
