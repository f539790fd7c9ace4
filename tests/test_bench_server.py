"""The benchmarks' server (bench/server.py): a server that stops or does not answer says why, with what it wrote to
stderr, instead of a bare "did not start" (its stderr used to go to /dev/null); and it is stopped however the block
ends."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from bench.server import Server, serving

pytestmark = pytest.mark.xdist_group("uvicorn")


def test_a_server_that_stops_at_start_says_why_with_its_stderr(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)the server stopped \(exit [1-9]\d*\); its stderr:.*dtype"):
        with serving(tmp_path, within_s=120, dtype="float13"):  # not a dtype: the settings refuse it at start
            pass


def test_a_server_that_does_not_answer_in_time_says_so_and_is_stopped(tmp_path: Path) -> None:
    server = Server(tmp_path)
    try:
        with pytest.raises(RuntimeError, match=r"did not answer .*/no-such-page within 0.5 s"):
            server.wait_ready("/no-such-page", 0.5)  # a 404, never 200
    finally:
        server.stop()
    assert server.proc.returncode is not None and not server.log.exists()


def test_serving_answers_inside_the_block_and_stops_after_it(tmp_path: Path) -> None:
    with serving(tmp_path, ready="/healthz", within_s=120) as server:
        assert httpx.get(server.base + "/api/v1/models", timeout=30).status_code == 200
    assert server.proc.returncode is not None and not server.log.exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.base + "/healthz", timeout=5)
