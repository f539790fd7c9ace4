"""Load test of the served app (section `load` of `make bench`): a real uvicorn on 127.0.0.1 and asyncio clients.

1. Starts `uvicorn app.main:app` on 127.0.0.1 (a free port) with the shipped models (checkpoints/toy-*, else
   any model folder in checkpoints/, else a seeded random 2-layer model written to a temporary folder).
2. Engine figures through the HTTP API: for a few weight-derived endpoints, the first (cold: computed) and
   the median of repeated (cached) answer times.
3. A mix of cheap requests (health, listings, summaries, static files, pages whose panels are cached), cached
   API answers and heavy fresh computations (random detector seeds, path expansions of random tokens, random
   OV rows) from CLIENTS concurrent httpx.AsyncClient clients for DURATION_S seconds, at most MAX_REQUESTS
   requests: requests/s, p50 / p99 latency per kind (cheap work's p99 is the issue's < 100 ms goal), the
   count of each status, and the server's peak RSS (psutil, else /proc), RSS after warm-up vs at the end.

Only 127.0.0.1 is ever a target. `QKOV_BENCH_LOAD_S` shortens or lengthens the load phase (default 60 s; 2 s in
bench's small mode).
The machine is shared, so figures are indicative; the load average is printed alongside.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

from bench import sized
from bench.server import REPO, serving

CLIENTS = 16
DURATION_S = float(os.environ.get("QKOV_BENCH_LOAD_S", sized("60", "2")))
MAX_REQUESTS = 200_000


# -- the server --------------------------------------------------------------------------------------------
def model_root() -> tuple[Path, str]:
    """A folder of models to serve, and where it came from."""
    ckpt = REPO / "checkpoints"
    toys = sorted(p for p in ckpt.glob("toy-*") if (p / "config.json").is_file()) if ckpt.is_dir() else []
    if toys:
        return ckpt, f"shipped: {', '.join(p.name for p in toys)}"
    others = sorted(p for p in ckpt.glob("*") if (p / "config.json").is_file()) if ckpt.is_dir() else []
    if others:
        return ckpt, f"checkpoints/: {', '.join(p.name for p in others)}"
    import torch

    from circuits_core.formats.qkov_format import save_checkpoint
    from circuits_core.model.config import ModelConfig
    from circuits_core.model.transformer import random_model

    tmp = Path(tempfile.mkdtemp(prefix="qkov-bench-"))
    cfg = ModelConfig(
        n_layers=2, d_model=64, n_heads=4, d_head=16, d_vocab=2048, n_ctx=256, positional_embedding_type="shortformer"
    )
    with torch.no_grad():
        save_checkpoint(random_model(cfg, seed=0, std_embed=0.5), tmp / "random-2l")
    return tmp, "no shipped models yet: a seeded random 2-layer model (d_vocab 2048)"


def rss_bytes(pid: int) -> int:
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb * 1024


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every_s: float = 0.25):
        super().__init__(daemon=True)
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except (OSError, StopIteration):
                return
            self.stopped.wait(self.every_s)


# -- the requests ------------------------------------------------------------------------------------------
def mix(model: str, d_vocab: int, heads: list[str]) -> list[tuple[str, Callable[[], str]]]:
    """(kind, url maker) pairs. `cheap`: health, listings, the model summary, static files and pages whose panels
    are cached -- none may wait for a compute slot; `cached`: API answers the result cache holds; `heavy`: fresh
    computations (detectors on a random seed, a path expansion on random tokens, random OV rows) keeping the
    slots busy."""
    head = heads[-1]
    m = f"/api/v1/models/{model}"
    cheap = [
        ("cheap", "/healthz"),
        ("cheap", "/api/v1/models"),
        ("cheap", f"{m}"),
        ("cheap", "/static/qkov.css"),
        ("cheap", "/"),
        ("cheap", f"/models/{model}"),
        ("cheap", f"/models/{model}/heads/{head}"),
        ("cheap", f"/models/{model}/direct"),
    ]
    cached = [
        ("cached", f"{m}/heads"),
        ("cached", f"{m}/heads/{head}"),
        ("cached", f"{m}/heads/{head}/ov?k=20"),
        ("cached", f"{m}/heads/{head}/qk?k=20"),
        ("cached", f"{m}/direct?k=20"),
        ("cached", f"{m}/detectors"),
        ("cached", f"{m}/composition"),
    ]
    out: list[tuple[str, Callable[[], str]]] = [(kind, (lambda u=url: u)) for kind, url in cheap + cached]

    def tokens() -> str:
        return ",".join(str(random.randrange(d_vocab)) for _ in range(24))

    out += [
        ("heavy", lambda: f"{m}/heads/{head}/ov?k=10&token={random.randrange(d_vocab)}"),
        ("heavy", lambda: f"{m}/detectors?seed={random.randrange(10**9)}"),
        ("heavy", lambda: f"{m}/paths?max_order=2&tokens={tokens()}"),
    ]
    return out


async def engine_figures(base: str, model: str, heads: list[str]) -> None:
    head = heads[-1]
    m = f"/api/v1/models/{model}"
    urls = [
        f"{m}/heads",
        f"{m}/heads/{head}",
        f"{m}/heads/{head}/ov?k=50",
        f"{m}/heads/{head}/qk?k=50",
        f"{m}/direct?k=50",
        f"{m}/detectors",
        f"{m}/composition",
    ]
    print(f"  engine figures through HTTP ({model}, {head}): cold = first answer, cached = median of 5")
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        for url in urls:
            t0 = time.perf_counter()
            r = await c.get(url)
            cold = time.perf_counter() - t0
            warm = []
            for _ in range(5):
                t0 = time.perf_counter()
                await c.get(url)
                warm.append(time.perf_counter() - t0)
            print(
                f"    {url.removeprefix(m) or '/':34s} {r.status_code}  cold {cold * 1e3:8.1f} ms   cached "
                f"{statistics.median(warm) * 1e3:7.2f} ms"
            )


async def client_loop(
    base: str,
    urls: list[tuple[str, Callable[[], str]]],
    end: float,
    budget: list[int],
    results: list[tuple[str, int, float, str]],
    seed: int,
) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        while time.monotonic() < end and budget[0] > 0:
            budget[0] -= 1
            kind, make = urls[rng.randrange(len(urls))]
            url = make()
            t0 = time.perf_counter()
            try:
                status = (await c.get(url)).status_code
            except httpx.HTTPError:
                status = 0
            results.append((kind, status, time.perf_counter() - t0, url))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run_load(base: str, pid: int) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:
        listing = (await c.get("/api/v1/models")).json()
    model = max(listing, key=lambda m: m["n_layers"])  # the deepest model: every analysis applies to it
    print(f"  model {model['id']}: {model['n_layers']} layers x {model['n_heads']} heads, d_vocab {model['d_vocab']}")
    await engine_figures(base, model["id"], model["heads"])
    urls = mix(model["id"], model["d_vocab"], model["heads"])
    async with httpx.AsyncClient(base_url=base, timeout=120) as c:  # warm-up: every fixed URL once
        for _, make in urls:
            await c.get(make())
    rss_warm = rss_bytes(pid)
    sampler = RssSampler(pid)
    sampler.start()
    results: list[tuple[str, int, float, str]] = []
    budget = [MAX_REQUESTS]
    t0 = time.monotonic()
    await asyncio.gather(*(client_loop(base, urls, t0 + DURATION_S, budget, results, seed) for seed in range(CLIENTS)))
    elapsed = time.monotonic() - t0
    sampler.stopped.set()
    sampler.join()
    rss_end = rss_bytes(pid)
    lat = [r[2] for r in results]
    statuses = Counter(r[1] for r in results)
    print(f"  load: {CLIENTS} clients, {elapsed:.1f} s, {len(results)} requests -> {len(results) / elapsed:.1f} req/s")
    print(
        f"    latency p50 {pct(lat, 0.5) * 1e3:.1f} ms, p99 {pct(lat, 0.99) * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms"
    )
    for kind in ("cheap", "cached", "heavy"):
        ks = [r[2] for r in results if r[0] == kind]
        goal = "  (goal p99 < 100 ms: never waits for a compute slot)" if kind == "cheap" else ""
        if ks:
            print(
                f"    {kind:7s} n={len(ks):6d}  p50 {pct(ks, 0.5) * 1e3:7.1f} ms  p99 {pct(ks, 0.99) * 1e3:7.1f} "
                f"ms{goal}"
            )
    cheap_urls = sorted({r[3] for r in results if r[0] == "cheap"})
    for url in cheap_urls:
        ks = [r[2] for r in results if r[3] == url]
        print(
            f"      cheap {url:44s} n={len(ks):5d}  p50 {pct(ks, 0.5) * 1e3:7.1f} ms  p99 {pct(ks, 0.99) * 1e3:7.1f} ms"
        )
    print(f"    statuses: {', '.join(f'{s}: {n}' for s, n in sorted(statuses.items()))}")
    mib = 1024 * 1024
    print(
        f"    server RSS: after warm-up {rss_warm / mib:.0f} MiB, end {rss_end / mib:.0f} MiB, peak "
        f"{max(sampler.peak, rss_end) / mib:.0f} MiB"
    )
    async with httpx.AsyncClient(base_url=base, timeout=10) as c:
        metrics = (await c.get("/metrics")).text
    wanted = ("qkov_cache_hit_ratio", "qkov_cache_bytes", "qkov_compute_rejected_total", "qkov_compute_shared_total")
    for line in metrics.splitlines():
        if line.startswith(wanted):
            print(f"    {line}")


def load() -> None:
    models, origin = model_root()
    print(f"  serving {origin}")
    with serving(models, ready="/healthz", within_s=120) as server:
        asyncio.run(run_load(server.base, server.pid))


SECTIONS = {"load": load}
