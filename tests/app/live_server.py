"""A real qkov server process on a free loopback port, for tests over real HTTP (no TestClient).

`start(args, port, env)` runs `python <args>` (e.g. `-m app.serve --port P ...`; a port from bench/server.py's
`free_port()`) in the repository with the QKOV_* variables given and waits until GET /healthz answers 200 (or fails
with the server's stderr if it exits first). The caller stops it (`proc.send_signal`, `proc.kill`).

`QKOV_TEST_SERVER_CHECKOUT=/path/to/another/checkout` runs the server from that checkout's code instead (the test
itself still runs from this one): how a regression test over real HTTP is checked against older code, e.g. a
`git worktree add --detach ../old <commit>` of the commit before a fix.
"""

from __future__ import annotations

import os
import subprocess
import sys

from app.settings import REPO_ROOT
from bench.server import wait_answering

SERVER_CHECKOUT = os.environ.get("QKOV_TEST_SERVER_CHECKOUT", str(REPO_ROOT))


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
    try:
        wait_answering(f"http://127.0.0.1:{port}/healthz", proc, timeout_s, lambda: stderr_after_exit(proc))
    except RuntimeError:
        proc.kill()
        raise
    return proc


def stderr_after_exit(proc: subprocess.Popen[bytes]) -> str:
    """The server's stderr once it has exited (a pipe read while it runs would block): what it wrote, or why not."""
    if proc.stderr is None:
        return "(discarded: quiet)"
    if proc.poll() is None:
        return "(still running: read once it exits)"
    return proc.stderr.read().decode(errors="replace")
