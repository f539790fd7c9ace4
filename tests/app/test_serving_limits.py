"""Serving: every limit refused before compute, as problem+json (peak and answer bytes, each request limit, in the
OpenAPI schema too), ETag/304, the rate limit's 429, request ids and JSON logs, Prometheus metrics, health and
readiness.

Apps are built on the session's tiny models (tests/app/conftest.py) with serving settings changed per test, with the
test-only routes of tests/app/serving_routes.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from app.logs import JsonFormatter
from app.main import create_app
from app.settings import Settings
from tests.app.conftest import assert_problem
from tests.app.serving_routes import run, service, serving_app

PROMPT_41 = ",".join(["5"] * 41)  # one token over the max_prompt_tokens=40 of the test limits


# -- pricing: refused before a slot, answer bounded inside it -------------------------------------------------
def test_a_request_over_the_peak_or_answer_budget_is_refused_before_compute(settings: Settings) -> None:
    calls: list[str] = []
    limits = settings.limits.model_copy(update={"peak_bytes": 2**20, "max_answer_bytes": 4096})
    app = serving_app(settings, calls, limits=limits)

    async def scenario(ac: httpx.AsyncClient) -> None:
        over_peak = await ac.get("/api/v1/test/priced", params={"peak": 3 * 2**20, "answer": 10})
        assert_problem(
            over_peak, 422, "3145728 bytes (3.0 MiB) of working memory", "peak_bytes", "1.0 MiB", "lower n or peak"
        )
        over_answer = await ac.get("/api/v1/test/priced", params={"peak": 10, "answer": 50_000})
        assert_problem(over_answer, 422, "(48.8 KiB) of JSON", "max_answer_bytes", "4096 bytes", "lower n or peak")
        assert calls == [] and service(app).stats.completed == 0  # nothing ran
        # under-priced: the real encoded answer is checked inside the slot and refused all the same
        big = await ac.get("/api/v1/test/priced", params={"peak": 10, "answer": 10, "n": 1000})
        assert_problem(big, 422, "answered", "of JSON", "max_answer_bytes", "lower n or peak")
        assert calls == ["priced 1000"] and service(app).slots.in_use == 0 and len(service(app).cache) == 0
        ok = await ac.get("/api/v1/test/priced", params={"peak": 10, "answer": 10, "n": 3})
        assert ok.status_code == 200 and ok.json() == {"values": [0.123456789] * 3}

    run(scenario, app)


# -- refusals of every limit --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "needles"),
    [
        (f"/api/v1/models/tiny-2l/tokenize?tokens={PROMPT_41}", ("41 tokens", "at most 40")),
        ("/api/v1/models/tiny-2l/direct?k=51", ("k",)),
        ("/api/v1/models/tiny-2l/detectors?heads=L0H0,L0H1,L0H2,L0H3,L1H0", ("5 heads", "at most 4")),
        ("/api/v1/models/tiny-2l/paths?tokens=0,5,6&max_order=4", ("max_order",)),
        ("/api/v1/models/tiny-2l/detectors?batch=9", ("batch",)),
        ("/api/v1/test/dense?nbytes=1000000000", ("1000000000 bytes", "65536 bytes")),
        ("/api/v1/test/priced?peak=100000000000&answer=1", ("93.1 GiB", "peak_bytes")),
    ],
)
def test_each_limit_is_refused_with_problem_json(client: TestClient, url: str, needles: tuple[str, ...]) -> None:
    if url.startswith("/api/v1/test/"):
        app = serving_app(client.app.state.settings)  # type: ignore[attr-defined]
        with TestClient(app) as c:
            assert_problem(c.get(url), 422, *needles)
            assert service(app).slots.in_use == 0 and service(app).stats.completed == 0  # refused before compute
        return
    assert_problem(client.get(url), 422, *needles)
    assert client.get("/api/v1/models/tiny-2l/direct?k=3").status_code == 200  # nothing else broke


@pytest.mark.parametrize(
    ("url", "needles"),
    [
        (
            f"/api/v1/models/tiny-2l/term-importance?tokens={','.join(['5'] * 40)}",
            ("MiB) of working memory", "peak_bytes"),
        ),
        (f"/api/v1/models/tiny-2l/qk-paths?head=L1H0&k=50&tokens={','.join(['5'] * 40)}", ("peak_bytes", "lower", "k")),
        (f"/api/v1/models/tiny-2l/prompt?tokens={','.join(['5'] * 40)}", ("KiB) of JSON", "max_answer_bytes", "lower")),
    ],
)
def test_real_analyses_over_budget_are_refused_before_a_slot(
    settings: Settings, url: str, needles: tuple[str, ...]
) -> None:
    """The engine's own cost of these requests (term importance on 40 tokens: about 1.04 MiB; the QK terms of 50
    pairs: 1.5 MiB; 4 patterns of 40 x 40: 140 KiB of JSON) is over a 1 MiB / 64 KiB budget."""
    limits = settings.limits.model_copy(update={"peak_bytes": 2**20, "max_answer_bytes": 64 * 1024})
    app = serving_app(settings, limits=limits)
    with TestClient(app) as c:
        assert c.get("/api/v1/models/tiny-2l/tokenize?tokens=5").status_code == 200  # the model is loaded
        done = service(app).stats.completed
        assert_problem(c.get(url), 422, *needles)
        assert service(app).stats.completed == done and service(app).slots.in_use == 0  # refused before a slot
        small = url.replace(",".join(["5"] * 40), "5,6,7").replace("k=50", "k=2")
        assert c.get(small).status_code == 200, c.get(small).text  # the same analysis, smaller, is answered


def test_limits_are_written_into_the_openapi_schema(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()

    def param(path: str, name: str) -> dict[str, Any]:
        return next(p for p in spec["paths"][path]["get"]["parameters"] if p["name"] == name)

    assert param("/api/v1/models/{model}/direct", "k")["schema"]["maximum"] == 50
    assert param("/api/v1/models/{model}/paths", "max_order")["schema"]["maximum"] == 3
    assert "max length 48" in param("/api/v1/models/{model}/detectors", "heads")["description"]  # 4 heads x 12
    assert "max length 2560" in param("/api/v1/models/{model}/tokenize", "prompt")["description"]  # 40 tokens x 64
    assert {"/healthz", "/readyz"} <= spec["paths"].keys()


# -- HTTP caching -----------------------------------------------------------------------------------------
def test_weak_etag_and_304(client: TestClient) -> None:
    url = "/api/v1/models/tiny-2l/heads"
    first = client.get(url)
    etag = first.headers["ETag"]  # weak: the same JSON goes out gzip-coded or plain
    assert first.status_code == 200 and etag.startswith('W/"')
    assert first.headers["Cache-Control"] == "public, max-age=60"
    again = client.get(url, headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b"" and again.headers["ETag"] == etag
    assert client.get(url, headers={"If-None-Match": f'"other", {etag.removeprefix("W/")}'}).status_code == 304
    assert client.get(url, headers={"If-None-Match": '"other"'}).status_code == 200
    assert client.get("/api/v1/models/tiny-2l/heads/L0H1").headers["ETag"] != etag
    assert client.get("/api/v1/models").headers["Cache-Control"] == "no-cache"
    assert "ETag" not in client.get("/api/v1/models/nope").headers  # errors are not tagged


# -- rate limit -------------------------------------------------------------------------------------------
def test_rate_limit_429_with_standard_headers(settings: Settings) -> None:
    with TestClient(serving_app(settings, rate_limit=3, rate_window_s=60)) as c:
        remaining = [c.get("/api/v1/models").headers["RateLimit-Remaining"] for _ in range(3)]
        assert remaining == ["2", "1", "0"]
        refused = c.get("/api/v1/models/tiny-2l")
        assert_problem(refused, 429, "more than 3 requests")
        assert refused.headers["RateLimit-Limit"] == "3" and refused.headers["RateLimit-Remaining"] == "0"
        assert (
            1 <= int(refused.headers["Retry-After"]) <= 60
            and refused.headers["RateLimit-Reset"] == refused.headers["Retry-After"]
        )
        page = c.get("/")
        assert page.status_code == 429 and page.headers["content-type"].startswith("text/html")
        assert c.get("/healthz").status_code == 200  # probes are not limited


def test_no_rate_limit_headers_when_not_configured(client: TestClient) -> None:
    assert "RateLimit-Limit" not in client.get("/api/v1/models").headers


# -- request ids, logs, metrics ---------------------------------------------------------------------------
def test_request_id_in_out_and_in_json_logs(client: TestClient) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("qkov.access")
    logger.addHandler(handler)
    try:
        given = client.get("/api/v1/models", headers={"X-Request-ID": "abc-123"})
        made = client.get("/api/v1/models", headers={"X-Request-ID": "bad id <script>"})
    finally:
        logger.removeHandler(handler)
    assert given.headers["X-Request-ID"] == "abc-123"
    assert made.headers["X-Request-ID"] != "bad id <script>" and len(made.headers["X-Request-ID"]) == 32
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x["request_id"], x["status"], x["route"]) for x in lines] == [
        ("abc-123", 200, "/api/v1/models"),
        (made.headers["X-Request-ID"], 200, "/api/v1/models"),
    ]


def test_prometheus_metrics(settings: Settings) -> None:
    with TestClient(serving_app(settings)) as c:
        for _ in range(2):
            c.get("/api/v1/models/tiny-2l/heads")
        c.get("/api/v1/models/nope/heads")
        text = c.get("/metrics").text
    assert 'qkov_http_requests_total{method="GET",route="/api/v1/models/{model}/heads",status="200"} 2.0' in text
    assert 'route="/api/v1/models/{model}/heads",status="404"} 1.0' in text
    assert "qkov_http_request_duration_seconds_bucket" in text
    for name in (
        "qkov_compute_slots_in_use",
        "qkov_cache_bytes",
        "qkov_cache_hit_ratio",
        "qkov_cache_hits_total",
        "process_resident_memory_bytes",
    ):
        assert name in text
    hits = next(line for line in text.splitlines() if line.startswith("qkov_cache_hits_total"))
    assert float(hits.split()[-1]) >= 1


# -- health and readiness ---------------------------------------------------------------------------------
def test_healthz_and_readyz(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    report = ready.json()
    assert report["status"] == "ready" and report["models"]["tiny-2l"] == "ok"
    assert report["models"]["broken"].startswith("error")  # a broken user model does not make the server unready


def test_not_ready_without_models_or_with_a_broken_shipped_model(settings: Settings, tmp_path: Any) -> None:
    empty = Settings(shipped_dir=tmp_path / "none", models_dir=None)
    with TestClient(create_app(empty)) as c:
        answer = c.get("/readyz")
        assert answer.status_code == 503 and answer.json()["status"] == "not ready" and "Retry-After" in answer.headers
        assert c.get("/healthz").status_code == 200
    assert settings.models_dir is not None
    broken_shipped = Settings(shipped_dir=settings.models_dir, models_dir=settings.shipped_dir)  # 'broken' now shipped
    with TestClient(create_app(broken_shipped)) as c:
        assert c.get("/readyz").status_code == 503


def test_concurrent_first_requests_load_a_model_once(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    import app.registry as registry_module

    loads: list[str] = []
    real = registry_module.load_checkpoint

    def counting(path: Any, **kwargs: Any) -> Any:
        loads.append(path.name)
        time.sleep(0.2)  # widen the window in which the other requests arrive
        return real(path, **kwargs)

    monkeypatch.setattr(registry_module, "load_checkpoint", counting)
    app = serving_app(settings, compute_slots=4)

    async def scenario(ac: httpx.AsyncClient) -> None:
        answers = await asyncio.gather(*(ac.get("/api/v1/models/tiny-ln") for _ in range(4)))
        assert {a.status_code for a in answers} == {200}

    run(scenario, app)
    assert loads == ["tiny-ln"]
