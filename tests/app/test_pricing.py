"""Every request is priced before it runs: a walk over the OpenAPI routes.

Each GET route under /api/v1 is either a declared analysis (app/catalog.py) whose cost comes from the engine,
or one of the listing routes that do no heavy work. For every analysis, the engine's estimate of the answer is
compared with the real answer on the test model: the encoded JSON must not be larger than priced (an
under-priced answer would slip past the pre-check, to be refused only after the work was done).
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.analysis import Analysis, BoundAnalyses
from app.main import create_app
from app.settings import Settings
from circuits_core.cost import Cost

# The /api/v1 GET routes that are not analyses: listings and one model's card, no weight-derived work.
LISTINGS = {"/api/v1/models", "/api/v1/unavailable-models", "/api/v1/models/{model}", "/api/v1/jobs/{job_id}"}
MODEL = "tiny-2l"
TOKENS = "5,6,7,8,5,6,7,8,9"
PATH_VALUES = {"model": MODEL, "head": "L1H0", "source": "L0H1", "target": "L1H2", "writer": "L0H1", "reader": "L1H0.K"}
QUERY_VALUES = {"tokens": TOKENS, "heads": "L0H1,L1H2", "head": "L1H0", "k": 7}
ROTARY_ONLY = {
    "positional",
    "rotary-bands",
    "composition-profile",
    "qk-copying-offset",
}  # 422 on this (learned-position) model
# 422 on this random model, which has no induction head; priced against its answer on toy-2l in test_page_claims
NEEDS_AN_INDUCTION_HEAD = {"positivity"}
# 422 on this attention-only model, which has no MLP; priced against its answers in tests/app/test_families_app.py
NEEDS_AN_MLP = {"expert-ov"}


@pytest.fixture(scope="module")
def app_and_client(settings: Settings) -> Any:
    app = create_app(settings)
    with TestClient(app) as c:
        yield app, c


def declared(app: Any) -> BoundAnalyses:
    registry: BoundAnalyses = app.state.analyses
    return registry


def test_every_api_route_is_a_priced_analysis_or_a_listing(app_and_client: Any) -> None:
    app, _ = app_and_client
    by_name = {a.name: a for a in declared(app).analyses}
    paths = app.openapi()["paths"]
    api = {path: ops["get"] for path, ops in paths.items() if path.startswith("/api/v1") and "get" in ops}
    named = set()
    for path, op in api.items():
        name = op.get("x-qkov-analysis")
        if name is None:
            assert path in LISTINGS, f"GET {path} is neither a declared analysis (with a cost) nor a listing"
            continue
        assert name in by_name and by_name[name].api_path == path, f"{path} names an unknown declaration {name!r}"
        assert callable(by_name[name].cost), f"analysis {name} has no cost"
        named.add(name)
    assert LISTINGS <= api.keys()
    assert named == {a.name for a in declared(app).analyses if a.api_path.startswith("/api/v1")}  # none left out


def _request(analysis: Analysis[Any, Any]) -> tuple[str, dict[str, Any]]:
    path = analysis.api_path
    missing = [n for n in analysis.path_fields() if n not in PATH_VALUES]
    assert not missing, f"add an example value for the path parameter(s) {missing} of {analysis.name} to PATH_VALUES"
    for name, value in PATH_VALUES.items():
        path = path.replace("{" + name + "}", value)
    fields = analysis.params.model_fields
    query = {k: v for k, v in QUERY_VALUES.items() if k in fields and "{" + k + "}" not in analysis.path}
    return path, query


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "analysis_name" in metafunc.fixturenames:
        from app.catalog import ANALYSES

        metafunc.parametrize("analysis_name", [a.name for a in ANALYSES if a.scope == "model"])


def test_the_priced_answer_bounds_the_real_one(app_and_client: Any, analysis_name: str) -> None:
    app, client = app_and_client
    analysis = next(a for a in declared(app).analyses if a.name == analysis_name)
    path, query = _request(analysis)
    answer = client.get(path, params=query)
    if analysis.name in ROTARY_ONLY | NEEDS_AN_INDUCTION_HEAD | NEEDS_AN_MLP:
        assert answer.status_code == 422, answer.text
        return
    assert answer.status_code == 200, answer.text
    registry = app.state.registry
    loaded = registry.get(MODEL)
    limits = app.state.settings.limits
    params = (
        declared(app)
        .bound(analysis)
        .model_validate({**query, **{k: v for k, v in PATH_VALUES.items() if k != "model"}})
    )
    cost = analysis.cost(loaded, params.normalised(loaded), limits)
    assert isinstance(cost, Cost) and cost.peak_bytes >= 0
    real = len(answer.content)
    assert real <= cost.answer_bytes, f"{analysis.name}: answered {real} bytes, priced {cost.answer_bytes}"
    # and not far above it: an answer priced many times its size is refused for bytes it would never send (the
    # residual usage page priced every erasure table it does not return: 32 MiB for a 3 MiB answer on SmolLM2)
    assert cost.answer_bytes <= 16 * real + 16384, f"{analysis.name}: priced {cost.answer_bytes}, answered {real}"
