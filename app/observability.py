"""Serving a public demo: request ids, JSON logs, Prometheus metrics, health and readiness, the compute service.
The pieces live in app/logs.py, app/serving_middleware.py, app/readiness.py and app/scheduling/; this module
installs them and the operations routes.

`install_serving(app, settings)` (called once by create_app) adds:

- the app's ComputeService (app/scheduling/: bounded slots, result cache, single-flight, stop flags) and the
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

import logging
from typing import Any, Literal

import anyio.to_thread
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field

from app.errors import ProblemKind, problem_response, render_fragment
from app.etag import ETagMiddleware, HeadMiddleware
from app.logs import configure_logging
from app.metrics import Metrics
from app.pricing import Budgets
from app.ratelimit import RateLimiter
from app.readiness import Health, Readiness, ReadinessReport
from app.registry import ModelRegistry
from app.scheduling.flights import BusyError, JobPending
from app.scheduling.service import ComputeService
from app.scheduling.slots import default_torch_threads
from app.serving_middleware import ServingMiddleware, client_address, in_networks, proxy_networks
from app.settings import Settings
from app.store import StoreTier, key_file, open_store, store_key
from circuits_core.errors import NotFoundError

log = logging.getLogger("qkov.serving")
BUSY = ProblemKind(503, "busy", "Server busy")
RUNNING = ProblemKind(202, "running", "Computing")


class JobState(BaseModel):
    """A long computation's public state (app/scheduling/flights.py Job.public)."""

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
        if metrics_networks is not None and not in_networks(peer, metrics_networks):
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
