"""The serving middleware every request passes: its id (`X-Request-ID` in, echoed out; a fresh one otherwise),
its binding to compute (client-disconnect polling, deadline), the optional per-client rate limit (app/ratelimit.py)
counted against the client's address (behind trusted proxies, the right-most untrusted X-Forwarded-For hop; an
IPv6 client's /64), Retry-After on every 503, a 503 for requests cut by the shutdown drain, the security headers,
request metrics by route template, and one access-log line each (logger `qkov.access`)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import threading
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

from fastapi import Request
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ProblemKind, problem_response
from app.logs import REQUEST_ID
from app.metrics import Metrics
from app.ratelimit import RateLimiter
from app.scheduling import bind
from app.scheduling.requests import RequestContext
from app.scheduling.service import ComputeService

access_log = logging.getLogger("qkov.access")

REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
UNMETERED = ("/healthz", "/readyz", "/metrics", "/static/")
RATE_LIMITED = ProblemKind(429, "rate-limited", "Too many requests")
LIMITER_STALLED = ProblemKind(503, "rate-limiter-unavailable", "Rate limiter unavailable")
SHUTTING_DOWN = ProblemKind(503, "shutting-down", "Server shutting down")
DRAINING = threading.Event()  # set by app/serve.py when SIGTERM starts the shutdown drain


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def proxy_networks(trusted: list[str]) -> list[Network]:
    """settings.trusted_proxies (addresses or CIDR networks) parsed; a bad entry is a start-up error."""
    return [ipaddress.ip_network(t.strip(), strict=False) for t in trusted]


def in_networks(address: str, networks: list[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return False
    return any(ip in net for net in networks)


def client_address(scope: Scope, trusted: list[Network]) -> str:
    """The client a request is counted against: the connection's peer, unless that peer is a configured
    proxy; then the right-most X-Forwarded-For address that is not itself a trusted proxy (a client can
    prepend anything to the header, so only what trusted proxies appended counts)."""
    peer = (scope.get("client") or ("unknown", 0))[0]
    if not trusted or not in_networks(peer, trusted):
        return str(peer)
    hops: list[str] = []
    for name, value in scope.get("headers") or []:
        if name == b"x-forwarded-for":
            hops.extend(h.strip() for h in value.decode("latin-1").split(","))
    for hop in reversed(hops):
        if hop and not in_networks(hop, trusted):
            return hop[:64]
    return str(peer)


def _route_template(scope: Scope) -> str:
    """The route's path template (`/api/v1/models/{model}`): bounded label values, never a raw URL."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    if scope.get("path", "").startswith("/static/"):
        return "/static"
    app = scope.get("app")
    plain = {getattr(r, "path", "") for r in getattr(app, "routes", ())}
    return scope["path"] if scope.get("path") in plain and "{" not in scope["path"] else "unmatched"


class ServingMiddleware:
    """Request id, compute binding (disconnect + deadline), rate limit, Retry-After on 503, metrics, access log."""

    def __init__(
        self,
        app: ASGIApp,
        service: ComputeService,
        metrics: Metrics,
        limiter: RateLimiter | None,
        request_timeout_s: float | None,
        trusted_proxies: list[Network] | None = None,
        limiter_timeout_s: float = 0.1,
        limiter_fail_open: bool = True,
    ):
        self.limiter_timeout_s = limiter_timeout_s
        self.limiter_fail_open = limiter_fail_open
        self.app = app
        self.trusted_proxies = trusted_proxies or []
        self.service = service
        self.metrics = metrics
        self.limiter = limiter
        self.request_timeout_s = request_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given if REQUEST_ID_RE.match(given) else uuid.uuid4().hex
        REQUEST_ID.set(rid)
        start = time.perf_counter()
        method, path = scope["method"], scope.get("path", "")
        request = Request(scope, receive)
        ctx = RequestContext(
            is_disconnected=request.is_disconnected if method in ("GET", "HEAD") else None,
            deadline=time.monotonic() + self.request_timeout_s if self.request_timeout_s else None,
            timeout_s=self.request_timeout_s,
        )
        bind(self.service, ctx)
        status = 500
        limit_headers: dict[str, str] = {}
        metered = not path.startswith(UNMETERED)

        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers["X-Request-ID"] = rid
                for k, v in limit_headers.items():
                    headers[k] = v
                protect(headers)
                if status == 503 and "retry-after" not in headers:
                    headers["Retry-After"] = str(self.service.retry_after())
            await send(message)

        try:
            if self.limiter is not None and metered:
                client = rate_key(client_address(scope, self.trusted_proxies))
                try:  # off the event loop, and bounded: a stalled Redis never stalls the other requests
                    allowed, remaining, reset = await asyncio.wait_for(
                        asyncio.to_thread(self.limiter.hit, client), self.limiter_timeout_s
                    )
                except TimeoutError:
                    self.limiter.stalled()
                    if not self.limiter_fail_open:
                        detail = "the rate limiter's storage did not answer in time; retry shortly"
                        response = problem_response(request, LIMITER_STALLED, detail)
                        response.headers["Retry-After"] = "1"
                        await response(scope, receive, send_wrapper)
                        return
                    allowed, remaining, reset = True, self.limiter.limit, 1
                limit_headers = {
                    "RateLimit-Limit": str(self.limiter.limit),
                    "RateLimit-Remaining": str(remaining),
                    "RateLimit-Reset": str(reset),
                }
                if not allowed:
                    limit_headers["Retry-After"] = str(reset)
                    detail = (
                        f"more than {self.limiter.limit} requests in {self.limiter.window_s:g} s from this client; "
                        f"retry in {reset} s"
                    )
                    response = problem_response(request, RATE_LIMITED, detail)
                    await response(scope, receive, send_wrapper)
                    return
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running when the shutdown drain runs out (app/serve.py): they
            # get a 503 saying so instead of uvicorn's bare 500, and the task ends normally. Any other
            # cancellation (not draining) is left as it was.
            if started or not DRAINING.is_set():
                raise
            detail = "the server is shutting down and this request did not finish in time; retry it"
            response = problem_response(request, SHUTTING_DOWN, detail)
            response.headers["Retry-After"] = "1"
            await response(scope, receive, send_wrapper)
        except Exception:
            status = 500
            raise
        finally:
            elapsed = time.perf_counter() - start
            route = _route_template(scope)
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(elapsed)
            if metered:
                access_log.info(
                    "%s %s %d",
                    method,
                    path,
                    status,
                    extra={
                        "request_id": rid,
                        "fields": {
                            "method": method,
                            "path": path,
                            "route": route,
                            "status": status,
                            "duration_ms": round(elapsed * 1000, 2),
                            "client": client_address(scope, self.trusted_proxies),
                        },
                    },
                )


CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "font-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)  # style-src 'unsafe-inline': plotly and htmx set style attributes; every script is a same-origin file


def protect(headers: MutableHeaders) -> None:
    """Security headers of every answer: nosniff and no referrer across origins; pages (HTML) also get the CSP
    (scripts only from this origin, never framed). A redirect's Location to this server is made relative, so it
    never carries a host the client sent."""
    headers["X-Content-Type-Options"] = "nosniff"
    headers["Referrer-Policy"] = "same-origin"
    if headers.get("content-type", "").startswith("text/html"):
        headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        headers["X-Frame-Options"] = "DENY"
    location = headers.get("location")
    if location:
        parts = urlsplit(location)
        if parts.scheme or parts.netloc:  # our own redirects only ever point at this server
            headers["Location"] = urlunsplit(("", "", parts.path or "/", parts.query, parts.fragment))


def rate_key(address: str) -> str:
    """Who a request is counted against: an IPv4 address, or an IPv6 address's /64 (one subscriber's network:
    an ISP hands out a whole /64, so per address a single client would have 2^64 quotas)."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)
