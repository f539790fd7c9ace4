"""Serving a public demo: request ids, JSON logs, Prometheus metrics, health and readiness, the compute service.

`install_serving(app, settings)` (called once by create_app) adds:

- the app's ComputeService (app/scheduling.py: bounded slots, result cache, single-flight, stop flags) and the
  torch intra-op thread count of each computation, set in its worker thread (`settings.torch_threads`, default
  cores // compute_slots: on a machine shared with other processes, 2 threads per computation on 2 busy cores made
  the detector pass 2.8x slower than 1, so a lone computation does not take every core by default);
- a middleware that gives every request an id (`X-Request-ID` in, echoed out; a fresh one otherwise), binds
  the request to compute (client-disconnect polling, deadline `settings.request_timeout_s`), applies the
  optional per-client rate limit (app/ratelimit.py), adds `Retry-After` to every 503, counts requests by
  route template and status, times them, and writes one JSON access-log line each (logger `qkov.access`);
- strong ETags with `Cache-Control` on the JSON API and 304 answers to `If-None-Match` (app/etag.py);
- `GET /healthz` (the process answers), `GET /readyz` (every shipped model loads and runs one forward pass,
  and at least one model exists), `GET /metrics` (Prometheus text format).

Logs are JSON lines (`settings.log_format`) with the request id of the request that caused them, also from
compute threads. Metrics (app/metrics.py) live in a registry per app; with `uvicorn --workers N` each worker has
its own (a scrape sees one worker): set `PROMETHEUS_MULTIPROC_DIR` (an empty, writable folder) and
`QKOV_METRICS_MULTIPROCESS=true` to aggregate the request metrics of all workers; the compute and cache
gauges stay per process (labelled by pid).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import threading
import time
import uuid
from contextvars import ContextVar
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import anyio.to_thread
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ProblemKind, problem_response, render_fragment
from app.etag import ETagMiddleware, HeadMiddleware
from app.metrics import Metrics
from app.ratelimit import RateLimiter
from app.registry import ModelRegistry
from app.scheduling import Budgets, BusyError, ComputeService, JobPending, RequestContext, bind, default_torch_threads
from app.settings import Settings
from app.store import StoreTier, key_file, open_store, store_key
from circuits_core.errors import NotFoundError, QkovError

log = logging.getLogger("qkov.serving")
access_log = logging.getLogger("qkov.access")

REQUEST_ID: ContextVar[str | None] = ContextVar("qkov_request_id", default=None)
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
UNMETERED = ("/healthz", "/readyz", "/metrics", "/static/")
BUSY = ProblemKind(503, "busy", "Server busy")
RATE_LIMITED = ProblemKind(429, "rate-limited", "Too many requests")
LIMITER_STALLED = ProblemKind(503, "rate-limiter-unavailable", "Rate limiter unavailable")
RUNNING = ProblemKind(202, "running", "Computing")
SHUTTING_DOWN = ProblemKind(503, "shutting-down", "Server shutting down")
DRAINING = threading.Event()  # set by app/serve.py when SIGTERM starts the shutdown drain


# -- logs ------------------------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id, and any `extra={"fields": {...}}`."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        if rid:
            out["request_id"] = rid
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class OneLineFormatter(logging.Formatter):
    """Plain text, one line per record: CR and LF (from a request path's %0A, or a traceback) are written as \\r
    and \\n, so no client can forge a log line."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "\\r").replace("\n", "\\n")


def configure_logging(settings: Settings) -> None:
    """Give the `qkov` loggers one stderr handler (JSON lines or plain text), once per process."""
    root = logging.getLogger("qkov")
    root.setLevel(logging.INFO)
    formatter: logging.Formatter = (
        JsonFormatter()
        if settings.log_format == "json"
        else OneLineFormatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    for handler in root.handlers:
        if getattr(handler, "_qkov", False):
            handler.setFormatter(formatter)
            return
    handler = logging.StreamHandler()
    handler._qkov = True  # type: ignore[attr-defined]
    handler.setFormatter(formatter)
    root.addHandler(handler)


class Health(BaseModel):
    status: Literal["ok"]


class JobState(BaseModel):
    """A long computation's public state (app/scheduling.Job.public)."""

    id: str
    what: str
    state: Literal["queued", "running", "done", "failed", "cancelled"]
    progress: float = Field(
        description="fraction done: the engine's own count where it reports one, else time / estimate"
    )
    elapsed_s: float
    eta_s: float = Field(description="seconds left, from the progress (or the estimate)")
    estimate_s: float = Field(description="the engine's price in seconds (FLOPs at compute_flops_per_s)")
    status_url: str
    error: str | None = None


class ReadinessReport(BaseModel):
    status: Literal["ready", "not ready"]
    models: dict[str, str] = Field(
        description="model id -> 'ok', 'error: <why>' or 'loading' (a user folder whose load goes on)"
    )
    store: dict[str, Any] | None = Field(
        default=None, description="the result store: kind, ok, and why not (Redis down: the local store serves)"
    )


# -- readiness -------------------------------------------------------------------------------------------
class Readiness:
    """Load every model and run one forward pass of each (once per checkpoint digest)."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry
        self._verified: set[str] = set()
        self._lock = threading.Lock()

    def check(self) -> tuple[bool, dict[str, str]]:
        with self._lock:
            report: dict[str, str] = {}
            shipped_ok = True
            deadline = self.registry.deadline()  # a user folder still loading then: "loading"
            entries = self.registry.entries(deadline)
            states = self.registry.settle(entries, deadline)
            for entry in entries:
                state = states[entry.id]
                if state is None:
                    report[entry.id] = "loading"
                    continue
                try:
                    if isinstance(state, Exception):
                        raise state
                    loaded = state
                    digest = str(loaded.digest)
                    if digest not in self._verified:
                        n = max(1, min(4, loaded.model.cfg.n_ctx))
                        tokens = torch.zeros(1, n, dtype=torch.long, device=loaded.model.device)  # [1, n]
                        with torch.no_grad():
                            logits, _ = loaded.model.run(tokens, names=lambda name: False)  # [1, n, d_vocab]
                        if not bool(torch.isfinite(logits).all()):
                            raise QkovError("the forward pass gave non-finite logits")
                        self._verified.add(digest)
                    report[entry.id] = "ok"
                except Exception as exc:  # noqa: BLE001 - reported, not raised
                    report[entry.id] = f"error: {exc}"
                    shipped_ok = shipped_ok and not entry.shipped
            ready = shipped_ok and any(v == "ok" for v in report.values())
            return ready, report


# -- middleware ------------------------------------------------------------------------------------------
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def proxy_networks(trusted: list[str]) -> list[Network]:
    """settings.trusted_proxies (addresses or CIDR networks) parsed; a bad entry is a start-up error."""
    return [ipaddress.ip_network(t.strip(), strict=False) for t in trusted]


def _in(address: str, networks: list[Network]) -> bool:
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
    if not trusted or not _in(peer, trusted):
        return str(peer)
    hops: list[str] = []
    for name, value in scope.get("headers") or []:
        if name == b"x-forwarded-for":
            hops.extend(h.strip() for h in value.decode("latin-1").split(","))
    for hop in reversed(hops):
        if hop and not _in(hop, trusted):
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


async def job_pending(request: Request, exc: Exception) -> Response:
    """A request that runs as a job: 202 with the job's state and where to poll it (API), or its progress bar."""
    assert isinstance(exc, JobPending)
    job = {**exc.job, "result_url": str(request.url.path) + (f"?{request.url.query}" if request.url.query else "")}
    if request.url.path.startswith("/api/"):
        return JSONResponse(job, status_code=202, headers={"Location": job["status_url"], "Retry-After": "1"})
    return problem_response(request, RUNNING, f"{job['what']} is computing", job=job)


# -- install ---------------------------------------------------------------------------------------------
def open_store_tier(settings: Settings) -> tuple[StoreTier | None, dict[str, Any] | None]:
    """The second-level result store the settings name (app/store.py), or None when it is off or cannot be
    opened; then also what /readyz says about it. A store folder that cannot be created (a read-only root) or a
    corrupt cache.db never stops the server: it runs without the store and says so in the log and on /readyz."""
    url, note = settings.store_url, None
    if settings.store_secret is None and url.startswith(("redis", "unix")):
        url = "disk"  # a shared store needs a secret shared by the replicas: without one, the local disk store only
        note = "Redis not used: QKOV_STORE_SECRET is unset (rows shared with other machines need their secret)"
        log.error("result store: %s; using the disk store", note)
    try:
        store = open_store(url, settings.store_dir, settings.store_bytes, settings.store_ttl_s)
        if store is not None and settings.store_secret is None:
            secret: bytes | None = store_key(settings.store_dir)
        else:
            secret = settings.store_secret.get_secret_value().encode() if settings.store_secret is not None else None
    except ValueError:
        raise  # a malformed store URL is a configuration error, refused at start
    except Exception as exc:  # OSError, sqlite3.DatabaseError, diskcache's own errors
        detail = f"not opened ({type(exc).__name__}: {str(exc)[:200]}); running without the result store"
        log.error("result store at %s: %s", settings.store_dir, detail)
        return None, {"store": settings.store_url, "ok": False, "detail": detail}
    if store is None:
        return None, None
    if settings.store_secret is None:
        log.warning(
            "result store rows are authenticated with the key in %s (this machine only): set QKOV_STORE_SECRET to "
            "share them with other machines (docs/serving.md)",
            key_file(settings.store_dir).name,
        )
    key = "secret" if settings.store_secret is not None else f"key file {key_file(settings.store_dir).name}"
    tier = StoreTier(store, claim_ttl_s=settings.request_timeout_s or 120.0, secret=secret, key_source=key, note=note)
    return tier, None


def install_serving(app: FastAPI, settings: Settings) -> ComputeService:
    """Add the compute service, middleware and /healthz, /readyz, /metrics to an app (once, in create_app)."""
    registry: ModelRegistry = app.state.registry
    configure_logging(settings)
    store, store_problem = open_store_tier(settings)
    service = ComputeService(
        slots=settings.compute_slots,
        slot_wait_s=settings.slot_wait_s,
        cache_bytes=settings.cache_bytes,
        request_timeout_s=settings.request_timeout_s,
        dense_budget_bytes=settings.limits.matrix_budget_bytes,
        budgets=Budgets(
            settings.limits.peak_bytes,
            settings.limits.max_answer_bytes,
            settings.job_budget_s,
            settings.compute_flops_per_s,
            settings.inline_budget_s,
        ),
        job_abandon_s=settings.job_abandon_s,
        store=store,
        torch_threads=settings.torch_threads or default_torch_threads(settings.compute_slots),
    )
    torch.set_num_threads(settings.torch_threads or default_torch_threads(settings.compute_slots))
    metrics = Metrics(service, registry, settings.metrics_multiprocess)
    readiness = Readiness(registry)
    app.state.compute = service
    app.state.metrics = metrics

    async def busy(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BusyError)
        response = problem_response(request, BUSY, str(exc))
        response.headers["Retry-After"] = str(exc.retry_after)
        return response

    app.add_exception_handler(BusyError, busy)
    app.add_exception_handler(JobPending, job_pending)

    @app.get("/healthz", tags=["operations"], summary="Liveness: the process answers", response_model=Health)
    async def healthz() -> Health:
        return Health(status="ok")

    @app.get(
        "/readyz",
        tags=["operations"],
        summary="Readiness: models load and run a forward pass",
        response_model=ReadinessReport,
        responses={503: {"model": ReadinessReport, "description": "not ready: a shipped model fails, or no model"}},
    )
    async def readyz() -> JSONResponse:
        ready, report = await anyio.to_thread.run_sync(readiness.check)
        store = await anyio.to_thread.run_sync(service.store.status) if service.store is not None else store_problem
        body = ReadinessReport(status="ready" if ready else "not ready", models=report, store=store)
        return JSONResponse(
            body.model_dump(), status_code=200 if ready else 503, headers={} if ready else {"Retry-After": "5"}
        )

    @app.get(
        "/api/v1/jobs/{job_id}",
        tags=["operations"],
        summary="A long computation's state: progress, seconds spent and left; its answer is then at result_url",
        response_model=JobState,
    )
    async def job_state(job_id: str) -> JSONResponse:
        job = service.job(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r}: it finished over a minute ago (ask its URL again) or never ran")
        return JSONResponse(job.public())

    @app.get("/jobs/{job_id}", include_in_schema=False)
    async def job_progress(request: Request, job_id: str) -> Response:
        """The progress bar a page polls: itself again while the job runs, a page reload once it is done."""
        job = service.job(job_id)
        state = job.public() if job is not None else None
        if state is None or state["state"] == "done":
            return Response(status_code=200, headers={"HX-Refresh": "true"})
        if state["state"] in ("failed", "cancelled"):
            return render_fragment("_error.html", {"status": 422, "title": "Failed", "detail": state["error"]})
        return render_fragment("_job.html", {"job": state})

    metrics_networks = proxy_networks(settings.metrics_networks) if settings.metrics_networks is not None else None

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        peer = client_address(request.scope, proxy_networks(settings.trusted_proxies))
        if metrics_networks is not None and not _in(peer, metrics_networks):
            return Response(status_code=404)  # private: as if there were none
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    redis_url = settings.store_url if settings.store_url.startswith(("redis", "unix")) else "memory://"
    limiter = RateLimiter(settings.rate_limit, settings.rate_window_s, redis_url) if settings.rate_limit else None
    app.add_middleware(ETagMiddleware)
    app.add_middleware(
        ServingMiddleware,
        service=service,
        metrics=metrics,
        limiter=limiter,
        request_timeout_s=settings.request_timeout_s,
        trusted_proxies=proxy_networks(settings.trusted_proxies),
        limiter_timeout_s=settings.rate_limit_timeout_s,
        limiter_fail_open=settings.rate_limit_fail_open,
    )
    app.add_middleware(HeadMiddleware)  # outside the others: they all see a GET
    return service
