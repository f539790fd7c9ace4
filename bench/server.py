"""A qkov server for a benchmark section: `uvicorn app.main:app` in a fresh process on loopback, waited for until it
answers, and stopped (killed if it hangs) when the section is done, whatever happened.

The server's stderr goes to a file, not a pipe (a pipe nobody reads fills and stalls the server) and not /dev/null:
when a server stops or misses its start, the error says why with the tail of what it wrote.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"  # the only host a benchmark ever targets


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_answering(url: str, proc: subprocess.Popen[bytes], within_s: float, stderr: Callable[[], str]) -> None:
    """Until GET `url` answers 200. If the server process stops first, or `within_s` passes, a RuntimeError says so
    with `stderr()`: what the server wrote."""
    end = time.monotonic() + within_s
    while True:
        try:
            if httpx.get(url, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server stopped (exit {proc.returncode}); its stderr:\n{stderr()}")
        if time.monotonic() > end:
            raise RuntimeError(f"the server did not answer {url} within {within_s:g} s; its stderr so far:\n{stderr()}")
        time.sleep(0.1)


class Server:
    """One uvicorn process serving qkov on HOST:port; `settings` become QKOV_<NAME> variables, and `shipped` (when
    given) is the shipped-models folder."""

    def __init__(self, shipped: Path | None, **settings: str) -> None:
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        env = {**os.environ, "QKOV_LOG_FORMAT": "text", "QKOV_STORE_URL": "off"}
        if shipped is not None:
            env["QKOV_SHIPPED_DIR"] = str(shipped)
        env.update({f"QKOV_{k.upper()}": v for k, v in settings.items()})
        self.log = Path(tempfile.mkstemp(prefix="qkov-bench-server-", suffix=".log")[1])
        with self.log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "app.main:app", "--host", HOST, "--port", str(self.port),
                 "--no-access-log", "--log-level", "warning"],
                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def wait_ready(self, path: str, within_s: float) -> None:
        """Until GET `path` answers 200 (/healthz: the app answers; /readyz: its preloaded models are in memory)."""
        wait_answering(self.base + path, self.proc, within_s, self.stderr_tail)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:  # a stuck server is killed
            self.proc.kill()
            self.proc.wait()
        self.log.unlink(missing_ok=True)


@contextmanager
def serving(shipped: Path | None, ready: str = "/readyz", within_s: float = 300, **settings: str) -> Iterator[Server]:
    """A Server, ready (GET `ready` answered 200 within `within_s`), stopped when the block ends."""
    server = Server(shipped, **settings)
    try:
        server.wait_ready(ready, within_s)
        yield server
    finally:
        server.stop()
