"""Hostile pass over the token-set, sampling, offset and basis parameters (tests/app/hostile_folders.py): every new
request is priced before it runs (a server with 1 KiB of working memory refuses each by its price, pages and lazy
panels too) and its answer stays within its price; the OpenAPI schema carries each new bound; bad page parameters
are a 4xx page; each page's JSON links answer 200 with its parameters, and its lazy panels answer for the same model
and head."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.precompute import lazy_panels
from tests.app.conftest import LIMITS, assert_problem
from tests.app.hostile_folders import (
    API,
)

# -- 5. priced before it runs, and the answer within its price ---------------------------------------------------
PRICED = ["rope/heads/L0H0/qk-copying", "rope/heads/L0H0/qk-copying?offset=5&max_offset=4096",
          "two/copying?heads=L0H0&rows=1", "two/copying?heads=L1H1", "wide/heads/L0H0/ov?vocab=all",
          "wide/heads/L0H0/qk?vocab=all", "wide/direct?vocab=all", "wide/heads/L0H0/skip-trigrams?vocab=all",
          "wide/heads/L0H0/ov", "ln/composition?basis=raw", "ln/composition/L0H0/L1H1?basis=raw",
          "rope/composition?basis=raw&offset=2", "two/detectors", "ctx3/detectors"]  # fmt: skip


@pytest.mark.parametrize("path", PRICED)
def test_every_new_request_is_priced_before_it_runs(poor: TestClient, path: str) -> None:
    body = assert_problem(poor.get(f"{API}/{path}"), 422, "peak_bytes")
    assert body["type"].endswith("limit-exceeded")


@pytest.mark.parametrize(
    "page",
    [
        "/models/two/copying?heads=L0H0",
        "/models/two/copying",
        "/models/ln/composition?basis=raw",
        "/models/rope/heads/L0H0?offset=3",
    ],
)
def test_pages_and_lazy_panels_are_priced_too(poor: TestClient, page: str) -> None:
    """A page (or the panel htmx asks for) past the budget is a 4xx page naming the budget, not a computation."""
    for headers in ({}, {"HX-Request": "true", "HX-Target": "copying-lazy"}):
        answer = poor.get(page, headers=headers)
        assert answer.status_code == 422 and answer.headers["content-type"].startswith("text/html"), (
            page,
            answer.status_code,
        )
        assert "peak_bytes" in answer.text, page


def test_qk_copying_on_a_shortformer_model_is_refused_for_its_positions_not_its_price(poor: TestClient) -> None:
    assert_problem(poor.get(f"{API}/two/heads/L0H0/qk-copying"), 422, "rotary")


@pytest.mark.parametrize("path", [p for p in PRICED if "?" in p or "detectors" in p])
def test_the_priced_answer_bounds_the_real_one(app_client: tuple[Any, TestClient], path: str) -> None:
    app, client = app_client
    answer = client.get(f"{API}/{path}")
    assert answer.status_code == 200, answer.text
    route, _, query = path.partition("?")
    model, _, rest = route.partition("/")
    analyses = app.state.analyses
    analysis = next(
        a
        for a in analyses.analyses
        if a.api_path != a.page_path
        and re.fullmatch(re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(a.api_path)), f"{API}/{route}")
    )
    values = dict(kv.split("=") for kv in query.split("&") if kv)
    names = re.findall(r"\{(\w+)\}", analysis.api_path)
    values |= {n: v for n, v in zip(names, [model, *re.findall(r"L\d+H\d+", rest)], strict=False) if n != "model"}
    loaded = app.state.registry.get(model)
    params = analyses.bound(analysis).model_validate(values).normalised(loaded)
    cost = analysis.cost(loaded, params, app.state.settings.limits)
    assert len(answer.content) <= cost.answer_bytes, (
        f"{path}: answered {len(answer.content)} bytes, priced {cost.answer_bytes}"
    )


# -- 6. every new bound is in the OpenAPI schema ------------------------------------------------------------------
def _param(schema: dict[str, Any], path: str, name: str) -> dict[str, Any]:
    op = schema["paths"][f"{API}/{{model}}/{path}"]["get"]
    found = next(p["schema"] for p in op["parameters"] if p["name"] == name)
    alternatives = found.get("anyOf", [found])
    return next(a for a in alternatives if a.get("type") != "null")


def test_openapi_carries_every_new_bound(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    for path in ("heads/{head}/ov", "heads/{head}/qk", "direct", "heads/{head}/skip-trigrams"):
        assert _param(schema, path, "vocab")["enum"] == ["default", "all"], path
    for path in ("composition", "composition/{source}/{target}"):
        assert _param(schema, path, "basis")["enum"] == ["served", "raw"], path
    rows = _param(schema, "copying", "rows")
    assert rows["minimum"] == 1 and rows["maximum"] == 10**7
    assert _param(schema, "copying", "heads")["maxLength"] == LIMITS.max_heads * 12
    offset, max_offset = (
        _param(schema, "heads/{head}/qk-copying", "offset"),
        _param(schema, "heads/{head}/qk-copying", "max_offset"),
    )
    assert (offset["minimum"], offset["maximum"], max_offset["minimum"], max_offset["maximum"]) == (0, 10**6, 1, 4096)
    seq_len = _param(schema, "detectors", "seq_len")
    assert seq_len["minimum"] == 1 and seq_len["maximum"] == LIMITS.max_seq_len
    assert _param(schema, "direct", "min_count")["maximum"] == 10**9


# -- 7. pages: min_count=all, JSON twins, the lazy copying panels --------------------------------------------------
BAD_PAGES = ["/models/two/direct?min_count=ALL", "/models/two/direct?min_count=0", "/models/two/direct?min_count=-1",
             "/models/two/direct?min_count=1e3", "/models/two/direct?vocab=x", "/models/two/heads/L0H0?vocab=ALL",
             "/models/two/heads/L0H0?basis=RAW", "/models/ln/composition?basis=x", "/models/ln/composition/L0H0/L1H1?basis=processed",  # noqa: E501 (a table kept on one line)
             "/models/two/copying?rows=0", "/models/two/copying?heads=l0h0", "/models/rope/heads/L0H0?offset=32",
             "/models/ln/direct?min_count=50"]  # fmt: skip


@pytest.mark.parametrize("url", BAD_PAGES)
def test_bad_page_parameters_are_a_4xx_page(client: TestClient, url: str) -> None:
    answer = client.get(url)
    assert 400 <= answer.status_code < 500 and answer.headers["content-type"].startswith("text/html"), (
        url,
        answer.status_code,
    )


GOOD_PAGES = ["/models/two/direct?min_count=all", "/models/two/direct", "/models/two/direct?min_count=5",
              "/models/wide/direct?min_count=all", "/models/wide/direct?vocab=all", "/models/wide/heads/L0H1?vocab=all",
              "/models/ln/heads/L0H0?basis=raw", "/models/ln/composition?basis=raw", "/models/ln/composition/L0H0/L1H1?basis=raw",  # noqa: E501 (a table kept on one line)
              "/models/ln/direct?basis=raw&min_count=all", "/models/two/copying?heads=L0H1&rows=5&samples=2",
              "/models/rope/heads/L0H0?offset=3", "/models/ctx3/detectors", "/models/two/detectors?seq_len=4"]  # fmt: skip  # noqa: E501


@pytest.mark.parametrize("url", GOOD_PAGES)
def test_each_pages_json_links_answer_and_keep_its_parameters(client: TestClient, url: str) -> None:
    """Every /api/v1 link on the page (its JSON twin, each panel's JSON button) answers 200, and each new parameter of
    the page's URL travels in at least one of them."""
    page = client.get(url)
    assert page.status_code == 200, (url, page.text[:300])
    links = sorted({h.replace("&amp;", "&") for h in re.findall(r'href="(/api/v1/[^"]+)"', page.text)})
    assert links and re.search(r'id="json-link"', page.text), url
    for link in links:
        answer = client.get(link)
        assert answer.status_code == 200, (url, link, answer.text[:300])
    for name, value in re.findall(r"[?&](vocab|basis|rows|heads|seq_len)=([^&]+)", url):
        assert any(f"{name}={value}" in link for link in links), (url, name, links)


@pytest.mark.parametrize(
    "page",
    [
        "/models/two",
        "/models/two/heads/L0H1",
        "/models/two/heads/L01H001",
        "/models/wide",
        "/models/rope/heads/L1H3",
        "/models/zero",
        "/models/ln/heads/L1H0?basis=raw",
    ],
)
def test_lazy_panels_answer_for_the_same_model_and_head(client: TestClient, page: str) -> None:
    answer = client.get(page)
    assert answer.status_code < 500, (page, answer.status_code)
    if answer.status_code != 200:
        return
    model = page.split("/")[2]
    panels = lazy_panels(answer.text)
    if model != "zero" and "/heads/" in page or page in ("/models/two", "/models/wide"):
        assert panels, f"{page} names no lazy panel"
    for src, target in panels:
        assert src.startswith(f"/models/{model}/"), (page, src)
        if "/heads/" in page:
            head = page.split("/heads/")[1].split("?")[0]
            normal = "L{}H{}".format(*(int(x) for x in re.findall(r"\d+", head)))
            assert f"heads={normal}" in src, (page, src)
        for headers in ({"HX-Request": "true", "HX-Target": target}, {}):
            panel = client.get(src, headers=headers)
            assert panel.status_code == 200, (page, src, panel.status_code, panel.text[:300])
            assert f'id="{target}"' in panel.text or "hx-select" in answer.text, (page, src)
