"""Load test of the served app (section `load` of `make bench`): a real uvicorn on 127.0.0.1 and asyncio clients.

1. Starts `uvicorn app.main:app` on 127.0.0.1 (a free port) with the shipped models (checkpoints/toy-*, else
   any model folder in checkpoints/, else a seeded random 2-layer model written to a temporary folder).
2. Engine figures through the HTTP API: for a few weight-derived endpoints, the first (cold: computed) and
   the median of repeated (cached) answer times.
3. A mix of page and API requests (mostly repeated URLs, which the result cache answers, plus OV rows of
   random tokens, which it does not) from CLIENTS concurrent httpx.AsyncClient clients for DURATION_S
   seconds, at most MAX_REQUESTS requests: requests/s, p50 / p99 latency, the count of each status, and the
   server's peak RSS (psutil, else /proc), RSS after warm-up vs at the end.

Only 127.0.0.1 is ever a target. `QKOV_BENCH_LOAD_S` shortens or lengthens the load phase (default 60 s).
The machine is shared, so figures are indicative; the load average is printed alongside.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
CLIENTS = 16
DURATION_S = float(os.environ.get("QKOV_BENCH_LOAD_S", "60"))
MAX_REQUESTS = 200_000
HOST = "127.0.0.1"


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

    from circuits_core.config import ModelConfig
    from circuits_core.model import random_model
    from circuits_core.weights import save_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="qkov-bench-"))
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_vocab=2048, n_ctx=256,
                      positional_embedding_type="shortformer")
    with torch.no_grad():
        save_checkpoint(random_model(cfg, seed=0, std_embed=0.5), tmp / "random-2l")
    return tmp, "no shipped models yet: a seeded random 2-layer model (d_vocab 2048)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def start_server(models: Path, port: int, **settings: str) -> subprocess.Popen[bytes]:
    """uvicorn app.main:app on 127.0.0.1:port serving `models`; `settings` become QKOV_<NAME> variables."""
    env = {**os.environ, "QKOV_SHIPPED_DIR": str(models), "QKOV_LOG_FORMAT": "text", "QKOV_STORE_URL": "off",
           **{f"QKOV_{k.upper()}": v for k, v in settings.items()}}
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app.main:app", "--host", HOST, "--port", str(port), "--no-access-log",
         "--log-level", "warning"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


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


async def wait_ready(base: str, proc: subprocess.Popen[bytes]) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=5) as c:
        end = time.monotonic() + 120
        while True:
            try:
                if (await c.get("/healthz")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("uvicorn did not start")
            await asyncio.sleep(0.2)


# -- the requests ------------------------------------------------------------------------------------------
def mix(model: str, d_vocab: int, heads: list[str]) -> list[tuple[str, Callable[[], str]]]:
    """(kind, url maker) pairs; repeated URLs hit the cache, `ov_row` does not (random token rows)."""
    head = heads[-1]
    m = f"/api/v1/models/{model}"
    fixed = [
        ("api", f"{m}"), ("api", f"{m}/heads"), ("api", f"{m}/heads/{head}"), ("api", f"{m}/heads/{head}/ov?k=20"),
        ("api", f"{m}/heads/{head}/qk?k=20"), ("api", f"{m}/direct?k=20"), ("api", f"{m}/detectors"),
        ("api", f"{m}/composition"), ("api", "/api/v1/models"),
        ("page", "/"), ("page", f"/models/{model}"), ("page", f"/models/{model}/heads/{head}"),
        ("page", f"/models/{model}/direct"), ("page", f"/models/{model}/detectors"),
    ]
    out: list[tuple[str, Callable[[], str]]] = [(kind, (lambda u=url: u)) for kind, url in fixed]
    out.append(("api-uncached", lambda: f"{m}/heads/{head}/ov?k=10&token={random.randrange(d_vocab)}"))
    return out


async def engine_figures(base: str, model: str, heads: list[str]) -> None:
    head = heads[-1]
    m = f"/api/v1/models/{model}"
    urls = [f"{m}/heads", f"{m}/heads/{head}", f"{m}/heads/{head}/ov?k=50", f"{m}/heads/{head}/qk?k=50",
            f"{m}/direct?k=50", f"{m}/detectors", f"{m}/composition"]
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
            print(f"    {url.removeprefix(m) or '/':34s} {r.status_code}  cold {cold * 1e3:8.1f} ms   cached {statistics.median(warm) * 1e3:7.2f} ms")


async def client_loop(base: str, urls: list[tuple[str, Callable[[], str]]], end: float, budget: list[int],
                      results: list[tuple[str, int, float]], seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        while time.monotonic() < end and budget[0] > 0:
            budget[0] -= 1
            kind, make = urls[rng.randrange(len(urls))]
            t0 = time.perf_counter()
            try:
                status = (await c.get(make())).status_code
            except httpx.HTTPError:
                status = 0
            results.append((kind, status, time.perf_counter() - t0))


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
    results: list[tuple[str, int, float]] = []
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
    print(f"    latency p50 {pct(lat, 0.5) * 1e3:.1f} ms, p99 {pct(lat, 0.99) * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms")
    for kind in ("api", "page", "api-uncached"):
        ks = [r[2] for r in results if r[0] == kind]
        if ks:
            print(f"    {kind:13s} n={len(ks):6d}  p50 {pct(ks, 0.5) * 1e3:7.1f} ms  p99 {pct(ks, 0.99) * 1e3:7.1f} ms")
    print(f"    statuses: {', '.join(f'{s}: {n}' for s, n in sorted(statuses.items()))}")
    mib = 1024 * 1024
    print(f"    server RSS: after warm-up {rss_warm / mib:.0f} MiB, end {rss_end / mib:.0f} MiB, peak {max(sampler.peak, rss_end) / mib:.0f} MiB")
    async with httpx.AsyncClient(base_url=base, timeout=10) as c:
        metrics = (await c.get("/metrics")).text
    wanted = ("qkov_cache_hit_ratio", "qkov_cache_bytes", "qkov_compute_rejected_total", "qkov_compute_shared_total")
    for line in metrics.splitlines():
        if line.startswith(wanted):
            print(f"    {line}")


def load() -> None:
    models, origin = model_root()
    print(f"  serving {origin}")
    port = free_port()
    proc = start_server(models, port)
    try:
        base = f"http://{HOST}:{port}"
        asyncio.run(wait_ready(base, proc))
        asyncio.run(run_load(base, proc.pid))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


SECTIONS = {"load": load}
