"""The result store across real processes: two uvicorn replicas sharing a real redis-server, a Redis killed
mid-test, and the embedded disk store surviving a restart. Computations are counted through /metrics
(`qkov_compute_completed`), the way an operator would see them."""

from __future__ import annotations

import random
import re
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from app.settings import REPO_ROOT
from bench.server import free_port
from tests.app.live_server import start
from tests.app.redis_server import RedisServer, running_redis

pytestmark = pytest.mark.xdist_group("uvicorn")
SECRET = "replicas-share-this-secret-of-32+chars"  # without one, a replica does not use Redis (docs/serving.md)
MODEL = "toy-2l"


@contextmanager
def replica(env_extra: dict[str, str]) -> Iterator[str]:
    port = free_port()
    env = {
        "QKOV_SHIPPED_DIR": str(REPO_ROOT / "checkpoints"),
        "QKOV_COMPUTE_SLOTS": "1",
        "QKOV_TORCH_THREADS": "1",
        **env_extra,
    }
    proc = start(
        ["-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port), "--no-access-log"],
        port,
        env,
        quiet=True,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:_total)?\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M))


def warm(*bases: str) -> float:
    """Load the model on each replica (its load is a computation too); the computations counted so far."""
    for base in bases:
        assert httpx.get(f"{base}/api/v1/models/{MODEL}", timeout=60).status_code == 200
    return sum(metric(base, "qkov_compute_completed") for base in bases)


def ov_row(token: int) -> str:
    return f"/api/v1/models/{MODEL}/heads/L1H2/ov?token={token}&k=5"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path) as server:
        yield server


def test_a_key_computed_by_one_replica_is_served_by_the_other(redis_server: RedisServer, tmp_path: Path) -> None:
    env = {"QKOV_STORE_URL": redis_server.url, "QKOV_STORE_SECRET": SECRET}
    with (
        replica({**env, "QKOV_STORE_DIR": str(tmp_path / "a")}) as a,
        replica({**env, "QKOV_STORE_DIR": str(tmp_path / "b")}) as b,
    ):
        url = f"/api/v1/models/{MODEL}/composition?kind=K"
        a0, b0 = warm(a), warm(b)
        first = httpx.get(a + url, timeout=60)
        assert first.status_code == 200
        assert metric(a, "qkov_compute_completed") == a0 + 1
        second = httpx.get(b + url, timeout=60)
        assert second.status_code == 200
        assert second.json() == first.json()
        assert metric(b, "qkov_compute_completed") == b0  # served from Redis, not recomputed
        assert metric(b, "qkov_store_hits") == 1


def test_sixteen_clients_on_two_replicas_compute_each_key_once(redis_server: RedisServer, tmp_path: Path) -> None:
    env = {"QKOV_STORE_URL": redis_server.url, "QKOV_STORE_SECRET": SECRET}
    with (
        replica({**env, "QKOV_STORE_DIR": str(tmp_path / "a")}) as a,
        replica({**env, "QKOV_STORE_DIR": str(tmp_path / "b")}) as b,
    ):
        keys = [ov_row(t) for t in range(100, 124)]  # 24 distinct answers
        rng = random.Random(0)
        jobs = [(rng.choice([a, b]), rng.choice(keys)) for _ in range(16 * 12)]  # every key asked ~8 times
        before = warm(a, b)

        def get(job: tuple[str, str]) -> tuple[int, str, str]:
            base, path = job
            r = httpx.get(base + path, timeout=60)
            return r.status_code, path, r.text

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(get, jobs))
        assert {status for status, _, _ in answers} == {200}
        by_key: dict[str, set[str]] = {}
        for _, path, text in answers:
            by_key.setdefault(path, set()).add(text)
        assert all(len(texts) == 1 for texts in by_key.values())  # both replicas gave the same answer per key
        computed = metric(a, "qkov_compute_completed") + metric(b, "qkov_compute_completed") - before
        assert computed == len(by_key)


def test_a_killed_redis_gives_no_5xx_and_readyz_says_so(redis_server: RedisServer, tmp_path: Path) -> None:
    with replica(
        {"QKOV_STORE_URL": redis_server.url, "QKOV_STORE_SECRET": SECRET, "QKOV_STORE_DIR": str(tmp_path / "a")}
    ) as a:
        assert httpx.get(a + ov_row(5), timeout=60).status_code == 200
        redis_server.kill()
        statuses = [httpx.get(a + ov_row(t), timeout=60).status_code for t in (5, 6, 7, 6)]
        assert statuses == [200, 200, 200, 200]
        ready = httpx.get(a + "/readyz", timeout=60).json()
        assert ready["store"]["ok"] is False
        assert "local store" in ready["store"]["detail"]
        assert metric(a, "qkov_store_errors") == 0  # a down Redis is a fallback, not an error


def test_the_embedded_store_survives_a_restart(tmp_path: Path) -> None:
    env = {"QKOV_STORE_URL": "disk", "QKOV_STORE_DIR": str(tmp_path / "store")}
    url = f"/api/v1/models/{MODEL}/composition?kind=Q"
    with replica(env) as first:
        before = warm(first)
        body = httpx.get(first + url, timeout=60).json()
        assert metric(first, "qkov_compute_completed") == before + 1
    with replica(env) as again:
        before = warm(again)
        assert httpx.get(again + url, timeout=60).json() == body
        assert metric(again, "qkov_compute_completed") == before
        assert metric(again, "qkov_store_hits") == 1
