"""A real qkov server process on a free loopback port, for tests over real HTTP (no TestClient).

`free_port()` picks a port; `start(args, env)` runs `python <args>` (e.g. `-m app.serve --port P ...`) in the
repository with the QKOV_* variables given and waits until GET /healthz answers 200 (or fails with the
server's stderr if it exits first). The caller stops it (`proc.send_signal`, `proc.kill`).

`QKOV_TEST_SERVER_CHECKOUT=/path/to/another/checkout` runs the server from that checkout's code instead (the test
itself still runs from this one): how a regression test over real HTTP is checked against older code, e.g. a
`git worktree add --detach ../old <commit>` of the commit before a fix.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

from app.settings import REPO_ROOT

SERVER_CHECKOUT = os.environ.get("QKOV_TEST_SERVER_CHECKOUT", str(REPO_ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    args: list[str], port: int, env: dict[str, str], timeout_s: float = 60.0, quiet: bool = False
) -> subprocess.Popen[bytes]:
    """`python *args` with `env` added to the environment; returns once http://127.0.0.1:port/healthz is 200.
    `quiet` discards the server's stderr: for servers answering many requests, whose access lines would fill a
    pipe nobody reads (the price is no stderr in the error when it dies at start)."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=SERVER_CHECKOUT,
        env={**os.environ, "PYTHONPATH": SERVER_CHECKOUT, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL if quiet else subprocess.PIPE,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode() if proc.stderr else "the server exited")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not answer /healthz within {timeout_s:g} s")
        time.sleep(0.1)
