"""Load and memory on a real uvicorn on 127.0.0.1: heavy and cheap requests from 16 clients
give no 5xx, and the result cache's byte count is what the process holds.

Memory bound (stated): after the models are loaded and warmed up, the server's RSS grows by at most
`cache_bytes` (the result cache's budget: it holds encoded JSON bytes, counted exactly) plus FIXED_OVERHEAD
(allocator arenas, per-request buffers, Python and torch caches). Latency percentiles are not asserted here
(a timed assertion on a shared machine proves nothing): `make bench` (bench/load.py) prints the cheap
routes' p99 under the same kind of load.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.load import rss_bytes
from bench.server import free_port
from tests.app.live_server import start

pytestmark = pytest.mark.xdist_group("uvicorn")
MiB = 2**20
CACHE_BYTES = 8 * MiB
FIXED_OVERHEAD = 64 * MiB  # the stated fixed overhead above models + cache budget
CLIENTS = 16
PROMPTS = 2000
V = 300  # token ids below the test tokenizer's vocabulary size (320)


@pytest.fixture(scope="module")
def server(model_dirs: tuple[Path, Path]) -> Iterator[tuple[str, int]]:
    port = free_port()
    env = {
        "QKOV_SHIPPED_DIR": str(model_dirs[0]),
        "QKOV_MODELS_DIR": str(model_dirs[1]),
        "QKOV_CACHE_BYTES": str(CACHE_BYTES),
        "QKOV_STORE_URL": "off",
        "QKOV_PRELOAD": "true",
        "QKOV_SLOT_WAIT_S": "60",
    }
    # quiet: thousands of access-log lines would fill a stderr pipe nobody reads
    proc = start(
        ["-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port), "--no-access-log"],
        port,
        env,
        timeout_s=90,
        quiet=True,
    )
    base = f"http://127.0.0.1:{port}"
    yield base, proc.pid
    proc.kill()
    proc.wait(10)


async def fetch_all(base: str, urls: list[str], clients: int = CLIENTS) -> Counter[int]:
    """GET every url, `clients` at a time; the count of each status."""
    statuses: Counter[int] = Counter()
    queue = list(reversed(urls))

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            while queue:
                statuses[(await c.get(queue.pop())).status_code] += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    return statuses


def cache_gauge(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return float(next(x for x in text.splitlines() if x.startswith("qkov_cache_bytes")).split()[-1])


def test_two_thousand_distinct_prompts_stay_within_the_cache_budget(server: tuple[str, int]) -> None:
    base, pid = server
    m = "/api/v1/models/tiny-2l"

    def prompts(start: int, count: int) -> list[str]:  # distinct token sequences: distinct cache keys
        return [
            f"{m}/detectors?tokens={(i * 7) % V},{(i * 13) % V},{i % V},{(i // V) % V},{(i * 7) % V}"
            for i in range(start, start + count)
        ]

    # runs first in this module (an empty cache); warm-up, 10 answers kept: arenas, kernels, models
    asyncio.run(fetch_all(base, prompts(10_000, 10) * 20))
    before, kept = rss_bytes(pid), cache_gauge(base)
    statuses = asyncio.run(fetch_all(base, prompts(0, PROMPTS)))
    assert statuses == Counter({200: PROMPTS})
    after = rss_bytes(pid)
    counted = cache_gauge(base)
    assert kept < CACHE_BYTES / 4 and CACHE_BYTES * 0.9 < counted <= CACHE_BYTES  # filled up to its budget, not over
    grown = after - before
    print(
        f"RSS {before / MiB:.0f} -> {after / MiB:.0f} MiB (+{grown / MiB:.1f} MiB); cache counts {kept / MiB:.2f} -> "
        f"{counted / MiB:.1f} MiB"
    )
    assert grown <= CACHE_BYTES + FIXED_OVERHEAD, (
        f"RSS grew {grown / MiB:.1f} MiB over 2,000 prompts; bound: cache {CACHE_BYTES / MiB:.0f} MiB + fixed "
        f"{FIXED_OVERHEAD / MiB:.0f} MiB"
    )


def test_sixteen_clients_mixing_heavy_and_cheap_work_get_no_5xx(server: tuple[str, int]) -> None:
    base, _ = server
    m = "/api/v1/models/tiny-2l"
    cheap = ["/healthz", "/api/v1/models", f"{m}", "/", "/static/qkov.css", f"{m}/heads"]
    heavy = [f"{m}/heads/L1H{i % 4}/ov?k=20" for i in range(8)] + [
        f"{m}/detectors?seq_len=60&batch=8&seed={s}" for s in range(8)
    ]
    heavy += [f"{m}/paths?max_order=2&tokens={s},{s + 1},{s + 2},{s},{s + 1}" for s in range(8)]
    urls = (cheap * 20 + heavy) * 2
    statuses = asyncio.run(fetch_all(base, urls))
    assert sum(statuses.values()) == len(urls)
    assert not [s for s in statuses if s >= 500], statuses
    assert set(statuses) == {200}, statuses
