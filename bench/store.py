"""The result store (section `store` of `make bench`): cold against precomputed page times, the
precompute time of the GPT-2-small-shaped checkpoint, and the hit ratio of two replicas sharing Redis.

1. toy-2l: `python -m app.precompute toy-2l` into a fresh disk store (timed), then a fresh uvicorn (empty
   in-memory cache) on that store answers every page of the model once, over one kept-alive connection as a
   browser's (a new httpx client per request spends ~30 ms on its own set-up); the same pages on a fresh
   uvicorn with the store off are the cold figures; then the panels the overview and the head page load after
   themselves (asked with htmx's headers). Goal: every precomputed page under 50 ms.
2. The GPT-2-small-shaped random checkpoint (bench.http's, TransformerLens format, no token counts): precompute
   time, goal under 2 minutes on this 2-core machine (the head pages' global tables rank the 8,192 lowest ids, the
   default on a vocabulary over 8,192 tokens), with each phase's time and the CPU seconds it used (user + system:
   on a loaded machine the wall time says more about the neighbours); then `--full` (the whole-vocabulary tables,
   vocab=all) for FULL_HEADS heads into the same store, extrapolated per head to all 144 (an upper bound: the direct
   path's whole-vocabulary table is counted once in the three heads' time).
3. Two uvicorn replicas on one real redis-server (Debian's, started here on loopback), 16 threads asking 24
   distinct OV rows 192 times at random replicas: computations counted by /metrics, store hits, hit ratio.
Only 127.0.0.1 is a target. The machine is shared: the load average is printed by `python -m bench`.
"""

from __future__ import annotations

import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench import fmt_time, sized
from bench.http import MODEL_ID as GPT2_ID
from bench.http import write_tl_checkpoint
from bench.server import REPO, Server, serving

MODEL = "toy-2l"
TOY_HEADS = sized((), ("--heads", "L1H2"))  # precompute's heads on toy-2l (small mode: the head page timed only)
FULL_HEADS = sized(("L0H0", "L6H6", "L11H11"), ("L0H0", "L1H3"))  # heads of bench.engine's model


def precompute(model: str, env: dict[str, str], *args: str) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, its summary line)."""
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, "-m", "app.precompute", model, *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return time.perf_counter() - start, cpu, out.strip().splitlines()[0]


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:_total)?\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M))


def page_times(models: Path, store: dict[str, str], urls: list[tuple[str, dict[str, str]]]) -> list[float]:
    """Seconds of each (url, headers) on a fresh server; a lazy panel is asked with htmx's headers."""
    # one kept-alive connection, as a browser's
    with serving(models, **store) as server, httpx.Client(base_url=server.base, timeout=300) as client:
        client.get(f"/api/v1/models/{MODEL}")  # load the model: not a page's time
        times = []
        for url, headers in urls:
            t0 = time.perf_counter()
            status = client.get(url, headers=headers).status_code  # gzip accepted, as by a browser
            times.append(time.perf_counter() - t0)
            if status != 200:
                print(f"    {url}: HTTP {status}")
    return times


def store_figures() -> None:
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.precompute import lazy_panels, page_urls
    from app.settings import Settings

    tmp = Path(tempfile.mkdtemp(prefix="qkov-bench-store-"))
    disk = {"store_url": "disk", "store_dir": str(tmp / "toy")}
    took, cpu, said = precompute(
        MODEL, {"QKOV_STORE_URL": "disk", "QKOV_STORE_DIR": disk["store_dir"], "QKOV_LOG_FORMAT": "text"}, *TOY_HEADS
    )
    print(f"  precompute {MODEL}: {fmt_time(took)}, {cpu:.0f} CPU s ({said})")
    app = create_app(Settings(store_url="off"))
    wide, per_head = page_urls(app, MODEL)
    pages = [u for u in wide] + [u.replace("{head}", "L1H2") for u in per_head if u.startswith("/models/")]
    with TestClient(app) as client:  # the panels the overview and the head page load after themselves
        panels = [
            (src, {"HX-Request": "true", "HX-Target": target})
            for page in (pages[0], pages[-1])
            for src, target in lazy_panels(client.get(page).text)
        ]
    urls: list[tuple[str, dict[str, str]]] = [(u, {}) for u in pages] + panels
    cold = page_times(REPO / "checkpoints", {"store_url": "off"}, urls)
    warm = page_times(REPO / "checkpoints", disk, urls)
    print(f"  {'page':<54} {'cold':>9} {'precomputed':>12}")
    for (url, headers), c, w in zip(urls, cold, warm, strict=True):
        label = url + (" (panel)" if headers else "")
        print(f"  {label:<54} {fmt_time(c):>9} {fmt_time(w):>12}{'' if w < 0.05 else '  (over 50 ms)'}")
    print(
        f"  median over {len(urls)} pages and panels: cold {fmt_time(statistics.median(cold))}, precomputed "
        f"{fmt_time(statistics.median(warm))}; slowest precomputed {fmt_time(max(warm))} (goal < 50 ms each)"
    )

    gpt2 = tmp / "gpt2"
    write_tl_checkpoint(gpt2)
    env = {
        "QKOV_STORE_URL": "disk",
        "QKOV_STORE_DIR": str(tmp / "gpt2-store"),
        "QKOV_MODELS_DIR": str(gpt2),
        "QKOV_LOG_FORMAT": "text",
    }
    took, cpu, said = precompute(GPT2_ID, env)
    print(
        f"  precompute {GPT2_ID} (12 x 12 heads, vocab 50,257): {fmt_time(took)}, {cpu:.0f} CPU s (goal < 2 min; "
        f"{said})"
    )
    took, cpu, said = precompute(GPT2_ID, env, "--full", "--heads", ",".join(FULL_HEADS))
    a_head = took / len(FULL_HEADS)  # the direct path's vocab=all table is in it once: an upper bound per head
    print(
        f"  then --full (vocab=all tables) for {len(FULL_HEADS)} heads: {fmt_time(took)}, {cpu:.0f} CPU s; at most "
        f"{fmt_time(a_head)} a head, so at most ~{fmt_time(a_head * 144)} for all 144 (extrapolated; answers already "
        f"in the store should be the default run's, else the code changed in between: {said})"
    )

    replicas()


def replicas() -> None:
    from tests.app.redis_server import running_redis

    tmp = Path(tempfile.mkdtemp(prefix="qkov-bench-redis-"))
    with running_redis(tmp) as redis:
        servers = [  # both start at once, then each is waited for
            Server(REPO / "checkpoints", store_url=redis.url, store_dir=str(tmp / name), compute_slots="1",
                   torch_threads="1")
            for name in ("a", "b")
        ]  # fmt: skip
        bases = [server.base for server in servers]
        try:
            for server in servers:
                server.wait_ready("/readyz", 300)
                httpx.get(f"{server.base}/api/v1/models/{MODEL}", timeout=120)
            before = sum(metric(b, "qkov_compute_completed") for b in bases)
            keys = [f"/api/v1/models/{MODEL}/heads/L1H2/ov?token={t}&k=5" for t in range(200, 224)]
            rng = random.Random(0)
            jobs = [(rng.choice(bases), rng.choice(keys)) for _ in range(16 * 12)]
            with ThreadPoolExecutor(16) as pool:
                statuses = list(pool.map(lambda j: httpx.get(j[0] + j[1], timeout=120).status_code, jobs))
            computed = sum(metric(b, "qkov_compute_completed") for b in bases) - before
            hits = sum(metric(b, "qkov_store_hits") + metric(b, "qkov_store_waited") for b in bases)
            memory = sum(metric(b, "qkov_cache_hits") for b in bases)
            print(
                f"  two replicas on Redis, 16 clients, {len(jobs)} requests for {len(keys)} keys: {computed:.0f} "
                f"computations, {hits:.0f} answers from the other replica via Redis, {memory:.0f} from memory; "
                f"statuses {sorted(set(statuses))}; cross-replica hit ratio {1 - computed / len(jobs):.2f}"
            )
        finally:
            for server in servers:
                server.stop()


SECTIONS = {"store": store_figures}
