"""A real uvicorn process on 127.0.0.1 (one per module; the SIGTERM test runs last): SIGTERM lets an in-flight request
finish with 200, and a client that disconnects mid-computation sets the stop flag (found by polling
`request.is_disconnected()`), freeing the slot.

`make_app` is the uvicorn factory: the app of `Settings()` (configured through QKOV_* variables, as in
production) plus one test route that holds a compute slot for `seconds` unless stopped.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from app.main import create_app
from app.scheduling import compute
from app.settings import Settings
from bench.server import free_port
from tests.app.live_server import start
from tests.app.serving_routes import slow


def make_app() -> FastAPI:
    app = create_app(Settings())

    @app.get("/api/v1/test/slow")
    async def slow_route(seconds: float) -> dict[str, float]:
        return await compute(slow, seconds)

    return app


pytestmark = pytest.mark.xdist_group("uvicorn")  # one server for the module, on one worker, tests in file order


@pytest.fixture(scope="module")
def server(model_dirs: tuple[Path, Path]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    env = {
        "QKOV_SHIPPED_DIR": str(model_dirs[0]),
        "QKOV_COMPUTE_SLOTS": "1",
        "QKOV_SLOT_WAIT_S": "10",
        "QKOV_TORCH_THREADS": "1",
    }
    proc = start(
        [
            "-m",
            "uvicorn",
            "--factory",
            "tests.app.test_serving_uvicorn:make_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
        ],
        port,
        env,
    )
    base = f"http://127.0.0.1:{port}"
    yield proc, base
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def slots_in_use(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("qkov_compute_slots_in_use"))
    return float(line.split()[-1])


def wait_until_busy(base: str) -> None:
    end = time.monotonic() + 20
    while slots_in_use(base) < 1:
        assert time.monotonic() < end, "the slow request never took its slot"
        time.sleep(0.02)


def test_client_disconnect_stops_the_computation_and_frees_the_slot(
    server: tuple[subprocess.Popen[bytes], str],
) -> None:
    _, base = server
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"GET /api/v1/test/slow?seconds=120 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        wait_until_busy(base)
    # the only slot is held by a 120 s computation unless the disconnect stopped it; the wait is 10 s
    answer = httpx.get(f"{base}/api/v1/test/slow", params={"seconds": 0.01}, timeout=30)
    assert answer.status_code == 200
    metrics = httpx.get(f"{base}/metrics", timeout=5).text
    cancelled = next(x for x in metrics.splitlines() if x.startswith("qkov_compute_cancelled_total"))
    assert float(cancelled.split()[-1]) == 1


def test_sigterm_lets_the_in_flight_request_finish(server: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, base = server
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.get, f"{base}/api/v1/test/slow", params={"seconds": 1.5}, timeout=30)
        wait_until_busy(base)
        proc.send_signal(signal.SIGTERM)
        answer = pending.result()
    assert answer.status_code == 200 and answer.json() == {"slept": 1.5}
    assert proc.wait(20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a graceful exit
