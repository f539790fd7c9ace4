"""Serve qkov with uvicorn, hardened for a public demo: `python -m app.serve [--host H] [--port P] [--workers N]`.

What plain `uvicorn app.main:app` lacks, added here (settings in app/settings.py, `QKOV_` environment):

- **Header-read timeout** (`QKOV_HEADER_TIMEOUT_S`, default 10 s): a connection that has not sent a whole
  request head that long after it opened, or after it started its next request, is closed (uvicorn only
  times out idle keep-alive connections; a client trickling header bytes would hold a connection forever).
- **Head size**: a connection that sends more than MAX_HEAD_BYTES (64 KiB) without completing a request
  head gets 431 and is closed (uvicorn's httptools parser, its default, buffers heads of any size).
- **Drain within `QKOV_SHUTDOWN_DRAIN_S`** (default 8 s, under Docker's 10 s stop timeout): on SIGTERM,
  uvicorn stops accepting, closes idle connections and lets in-flight requests finish for that long
  (`timeout_graceful_shutdown`), then cancels them. A computation still running in a compute thread cannot be
  interrupted and would keep the interpreter from exiting, so the process exits 0.5 s after the drain ends
  (with `--workers N` each worker drains as uvicorn does, without that last cut).
- **Forwarded addresses**: uvicorn's proxy-header rewrite is off (by default it believes X-Forwarded-For
  from any local client); the app reads it only from `QKOV_TRUSTED_PROXIES` (app/serving_middleware.py).

Host, port and workers default to `HOST`, `PORT` and `UVICORN_WORKERS` (the Dockerfile sets them).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import sys
import threading
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.supervisors import Multiprocess

from app.serving_middleware import DRAINING
from app.settings import Settings

log = logging.getLogger("qkov.serve")
EXIT_GRACE_S = 0.5  # after the drain, how long the interpreter gets to exit by itself
MAX_HEAD_BYTES = 64 * 1024  # a request head larger than this is refused (httptools alone sets no bound)
TOO_LARGE = b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class HeaderTimeout:
    """Mixin for a uvicorn HTTP protocol: close a connection whose request head is not complete in time, or
    that has sent more than MAX_HEAD_BYTES without completing one (431).

    The clock starts when the connection opens and again when data arrives with no request in progress;
    it stops when a new request cycle exists (the protocol parsed a whole head).
    """

    header_timeout_s: float = Settings().header_timeout_s
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_cycle = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._arm()

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is self._head_cycle and not self.transport.is_closing():
            log.info("closing a connection that sent no complete request head in %g s", self.header_timeout_s)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._arm()
        self._head_bytes += len(data)
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not self._head_cycle:  # a whole request head was parsed
            self._head_cycle = self.cycle
            self._disarm()
        elif self._head_timer is not None and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
            self.transport.write(TOO_LARGE)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]


class H11WithHeaderTimeout(HeaderTimeout, H11Protocol):
    pass


if importlib.util.find_spec("httptools") is not None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HttpToolsWithHeaderTimeout(HeaderTimeout, HttpToolsProtocol):
        pass


def http_protocol(choice: str = "auto") -> type:
    """httptools when installed (uvicorn's "auto" choice), else h11; both with the header timeout."""
    if choice == "h11" or (choice == "auto" and importlib.util.find_spec("httptools") is None):
        return H11WithHeaderTimeout
    return HttpToolsWithHeaderTimeout


class DrainingServer(uvicorn.Server):
    """uvicorn's server, plus a hard exit EXIT_GRACE_S after the graceful drain has run out."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        DRAINING.set()  # requests cut at the end of the drain are told why (app/serving_middleware.py)
        if not self.should_exit:
            drain = float(self.config.timeout_graceful_shutdown or 0)
            timer = threading.Timer(drain + EXIT_GRACE_S, _hard_exit)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


def _hard_exit() -> None:
    log.warning("drain time over with work still running: exiting")
    logging.shutdown()
    os._exit(0)


def config(
    host: str,
    port: int,
    workers: int,
    settings: Settings,
    app: str = "app.main:app",
    factory: bool = False,
    http: str = "auto",
) -> uvicorn.Config:
    HeaderTimeout.header_timeout_s = settings.header_timeout_s
    return uvicorn.Config(
        app,
        factory=factory,
        host=host,
        port=port,
        workers=workers,
        http=http_protocol(http),
        proxy_headers=False,
        timeout_graceful_shutdown=max(1, round(settings.shutdown_drain_s)),
        access_log=False,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--workers", type=int, default=int(os.environ.get("UVICORN_WORKERS", "1")))
    parser.add_argument("--app", default="app.main:app", help="ASGI app import string (default app.main:app)")
    parser.add_argument("--factory", action="store_true", help="--app names a function returning the app")
    parser.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto", help="HTTP parser")
    args = parser.parse_args(argv)
    cfg = config(args.host, args.port, args.workers, Settings(), args.app, args.factory, args.http)
    server = DrainingServer(cfg)
    if cfg.workers > 1:
        Multiprocess(cfg, sockets=[cfg.bind_socket()]).run()  # workers drain as uvicorn does (no hard exit)
    else:
        server.run()
    sys.exit(0)


if __name__ == "__main__":
    main()
