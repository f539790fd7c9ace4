"""Safety of a public demo: model ids name only folders of the models directory (no traversal, no symlink
escape, no odd bytes), a malicious pickle in a models-dir folder is refused without running, token text with
markup is escaped on pages and served as JSON data by the API, and a new folder shows up without a restart.

Over a real server (`python -m app.serve`, the production launcher, on 127.0.0.1): a client that never
finishes its request head is cut off after QKOV_HEADER_TIMEOUT_S, and SIGTERM drains within
QKOV_SHUTDOWN_DRAIN_S even when a computation that cannot be stopped is still running.
"""

from __future__ import annotations

import json
import re
import select
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.main import create_app
from app.scheduling import compute
from app.settings import REPO_ROOT, Settings
from bench.server import free_port
from circuits_core.model.config import ModelConfig
from tests.app.conftest import LIMITS, assert_problem, save_qkov, train_tokenizer
from tests.app.live_server import start

XSS = "<script>alert(1)</script>"


class Payload:
    """Unpickling this writes a file: the proof that a pickle ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Path.write_text, (self.marker, "the payload ran"))


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory, model_dirs: tuple[Path, Path]) -> tuple[Path, Path, Path]:
    """models/ (xss, evil, a symlink escape), outside/ (a valid model reachable only through the symlink)."""
    base = tmp_path_factory.mktemp("serving-safety")
    shipped, models, outside = base / "shipped", base / "models", base / "outside"
    shutil.copytree(model_dirs[0] / "tiny-2l", shipped / "tiny-2l")
    tok = train_tokenizer()
    tok.add_tokens([XSS])
    cfg = ModelConfig(
        n_layers=1,
        d_model=16,
        n_heads=2,
        d_head=8,
        d_vocab=tok.get_vocab_size(),
        n_ctx=32,
        positional_embedding_type="standard",
    )
    save_qkov(models / "xss", cfg, tok, seed=5)
    save_qkov(outside / "secret", cfg, tok, seed=6)
    (models / "escape").symlink_to(outside / "secret", target_is_directory=True)
    evil = models / "evil"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps(cfg.to_dict()))
    torch.save({"embed.W_E": Payload(base / "pwned.txt")}, evil / "model.pth")
    return shipped, models, base


@pytest.fixture(scope="module")
def safe_client(roots: tuple[Path, Path, Path]) -> Iterator[TestClient]:
    shipped, models, _ = roots
    with TestClient(create_app(Settings(shipped_dir=shipped, models_dir=models, dtype="float64", limits=LIMITS))) as c:
        yield c


@pytest.mark.parametrize(
    "model_id",
    [
        "..",
        "%2e%2e",
        "..%2F..%2Fetc",
        "%2Fetc%2Fpasswd",
        "%2F",
        "escape",
        "secret",
        "a%00b",
        "caf%C3%A9",
        "tiny-2l%0A",
        "tiny-2l%20",
        ".hidden",
        "~root",
        "tiny-2l;ls",
        "%5C..%5Cx",
    ],
)
def test_model_ids_never_reach_outside_the_models_directory(safe_client: TestClient, model_id: str) -> None:
    api = safe_client.get(f"/api/v1/models/{model_id}/heads")
    assert api.status_code == 404, (model_id, api.status_code, api.text)
    assert api.headers["content-type"].startswith("application/problem+json")
    page = safe_client.get(f"/models/{model_id}")
    if page.request.url.raw_path.decode().startswith("/models/"):  # httpx itself resolves a bare '..' to '/'
        assert page.status_code == 404, (model_id, page.status_code)


def test_symlinked_folder_is_not_listed(safe_client: TestClient) -> None:
    ids = {m["id"] for m in safe_client.get("/api/v1/models").json()}
    ids |= {m["id"] for m in safe_client.get("/api/v1/unavailable-models").json()}
    assert "escape" not in ids and "secret" not in ids
    assert {"tiny-2l", "xss"} <= ids


def test_malicious_pickle_is_refused_and_never_runs(safe_client: TestClient, roots: tuple[Path, Path, Path]) -> None:
    marker = roots[2] / "pwned.txt"
    assert_problem(safe_client.get("/api/v1/models/evil"), 422, "evil")
    assert_problem(safe_client.get("/api/v1/models/evil/heads"), 422)
    page = safe_client.get("/models/evil")
    assert page.status_code == 422 and page.headers["content-type"].startswith("text/html")
    assert "evil" in {m["id"] for m in safe_client.get("/api/v1/unavailable-models").json()}
    assert not marker.exists()
    assert safe_client.get("/api/v1/models/tiny-2l").status_code == 200  # the server is fine


def test_token_markup_is_data_in_json_and_escaped_on_pages(safe_client: TestClient) -> None:
    api = safe_client.get("/api/v1/models/xss/tokenize", params={"prompt": f"the {XSS} cat"})
    assert api.status_code == 200 and api.headers["content-type"].startswith("application/json")
    assert XSS in [t["text"] for t in api.json()["tokens"]]  # the token itself, as JSON data
    page = safe_client.get("/models/xss/detectors", params={"prompt": f"the {XSS} cat"})
    assert page.status_code == 200, page.text
    assert "&lt;script&gt;" in page.text or "\\u003cscript" in page.text
    assert XSS not in page.text and "<script>alert" not in page.text
    for path, status in (
        (f"/models/{XSS}", 404),
        (f"/models/xss/heads/{XSS}", 404),
        (f"/models/xss/direct?token={XSS}", 200),
    ):
        answer = safe_client.get(path)  # unknown model, no such URL, the token as a query (its page)
        assert answer.status_code == status and "<script>alert" not in answer.text, path
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in answer.text


def test_a_new_folder_is_served_without_a_restart(
    safe_client: TestClient, roots: tuple[Path, Path, Path], model_dirs: tuple[Path, Path]
) -> None:
    models = roots[1]
    assert safe_client.get("/api/v1/models/fresh").status_code == 404
    shutil.copytree(model_dirs[1] / "tiny-ln", models / "fresh")
    try:
        assert safe_client.get("/api/v1/models/fresh").status_code == 200
        assert "fresh" in {m["id"] for m in safe_client.get("/api/v1/models").json()}
    finally:
        shutil.rmtree(models / "fresh")


# -- a real server: header timeout and drain ------------------------------------------------------------
def sleep_without_stopping(seconds: float) -> float:
    """A computation that never polls its stop flag (an engine loop without should_stop)."""
    time.sleep(seconds)
    return seconds


def make_slow_app() -> FastAPI:
    """The app of Settings() (QKOV_* variables) plus a route that holds a compute slot for `seconds`."""
    app = create_app(Settings())

    @app.get("/api/v1/test/sleep")
    async def sleep_route(seconds: float) -> dict[str, float]:
        return {"slept": await compute(sleep_without_stopping, seconds)}

    return app


def start_server(model_dirs: tuple[Path, Path], http: str) -> tuple[subprocess.Popen[bytes], int]:
    """`python -m app.serve` with a 1 s header timeout and a 2 s drain, two compute slots."""
    port = free_port()
    env = {
        "QKOV_SHIPPED_DIR": str(model_dirs[0]),
        "QKOV_COMPUTE_SLOTS": "2",
        "QKOV_TORCH_THREADS": "1",
        "QKOV_HEADER_TIMEOUT_S": "1",
        "QKOV_SHUTDOWN_DRAIN_S": "2",
        "QKOV_STORE_URL": "off",
    }
    args = [
        "-m",
        "app.serve",
        "--app",
        "tests.app.test_serving_safety:make_slow_app",
        "--factory",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http",
        http,
    ]
    return start(args, port, env), port


@pytest.fixture(scope="module", params=["httptools", "h11"])
def served(
    request: pytest.FixtureRequest, model_dirs: tuple[Path, Path]
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The launcher with either HTTP parser (the header timeout is a mixin on each)."""
    proc, port = start_server(model_dirs, request.param)
    yield proc, port
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def closed_by_server(conn: socket.socket, within_s: float, drip: bytes = b"") -> bool:
    """Whether the server closes `conn` within `within_s` (optionally while we send `drip` a byte at a time)."""
    end = time.monotonic() + within_s
    for i in range(10_000):
        if time.monotonic() > end:
            return False
        readable, _, _ = select.select([conn], [], [], 0.2)
        if readable:
            try:
                return conn.recv(4096) == b""
            except ConnectionError:
                return True
        if i < len(drip):
            try:
                conn.sendall(drip[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return True
    return False


@pytest.mark.xdist_group("uvicorn")
def test_header_timeout_cuts_off_clients_that_never_finish_their_headers(
    served: tuple[subprocess.Popen[bytes], int],
) -> None:
    _, port = served
    with socket.create_connection(("127.0.0.1", port)) as silent:  # connects, sends nothing
        assert closed_by_server(silent, within_s=8)
    with socket.create_connection(("127.0.0.1", port)) as partial:  # a head without its blank line
        partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert closed_by_server(partial, within_s=8)
    with socket.create_connection(("127.0.0.1", port)) as drip:  # slowloris: a header byte every 0.2 s
        slow_head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 100 + b"\r\n\r\n"
        assert closed_by_server(drip, within_s=8, drip=slow_head)
    with socket.create_connection(("127.0.0.1", port)) as huge:  # a complete head of 1 MiB: refused, never served
        answer = b""
        try:
            huge.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
            huge.settimeout(8)
            answer = huge.recv(4096)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert not answer.startswith(b"HTTP/1.1 200"), answer[:80]
    with socket.create_connection(("127.0.0.1", port)) as normal:  # a whole request is served, and kept alive
        for _ in range(2):
            normal.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while b'"ok"' not in answer:
                chunk = normal.recv(4096)
                assert chunk, "closed"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
        time.sleep(0.5)
        normal.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # idle 0.5 s < timeout: served
        assert normal.recv(4096).startswith(b"HTTP/1.1 200")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:  # HEAD over the real server, kept alive
        for path in ("/healthz", "/api/v1/models", "/models/tiny-2l"):
            head, full = client.head(path), client.get(path, headers={"Accept-Encoding": "identity"})
            assert head.status_code == full.status_code == 200 and head.content == b"", path
            assert head.headers["content-length"] == str(len(full.content)), path
        for bad in ("①", "--1", "9" * 5000):  # a 500 here reset the kept-alive connection
            refused = client.get("/api/v1/models/tiny-2l/direct", params={"token": bad})
            assert refused.status_code == 422 and client.get("/healthz").status_code == 200
        assert client.get("/api/v1/models/tiny-2l/direct", params={"token": "5"}).status_code == 200


@pytest.mark.xdist_group("uvicorn")
def test_sigterm_drains_within_the_setting_even_with_unstoppable_work(
    served: tuple[subprocess.Popen[bytes], int],
) -> None:
    proc, port = served
    base = f"http://127.0.0.1:{port}"
    with ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(httpx.get, f"{base}/api/v1/test/sleep", params={"seconds": 60}, timeout=90)
        short = pool.submit(httpx.get, f"{base}/api/v1/test/sleep", params={"seconds": 1}, timeout=90)
        end = time.monotonic() + 60  # generous: the machine may be loaded
        while not re.search(r"^qkov_compute_slots_in_use\S* 2", httpx.get(f"{base}/metrics").text, re.M):
            assert time.monotonic() < end, "the two requests never took their slots"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            code = proc.wait(30)  # without the cut, the 60 s sleep would keep the interpreter alive
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit within 30 s of SIGTERM")
        took = time.monotonic() - sent
        assert short.result().status_code == 200  # in-flight work shorter than the drain finishes
        cut = stuck.result()  # the 60 s one was cut off at the drain, and told so
        assert cut.status_code == 503 and cut.headers["Retry-After"] == "1" and "shutting down" in cut.json()["detail"]
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its shutdown; the cut exits 0
    assert took < 2 + 0.5 + 3  # drain + the exit grace + slack for a loaded machine (never the 60 s)


def test_docker_and_docs_agree_on_the_drain() -> None:
    """Docker's stop timeout is 10 s: the default drain (8 s) fits it, and the image and docs say so."""
    assert Settings().shutdown_drain_s == 8.0
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert "app.serve" in dockerfile and "QKOV_SHUTDOWN_DRAIN_S" in dockerfile
    docs = (REPO_ROOT / "docs" / "serving.md").read_text()
    assert "QKOV_SHUTDOWN_DRAIN_S" in docs and "8 s" in docs and "QKOV_HEADER_TIMEOUT_S" in docs
