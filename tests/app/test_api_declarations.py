"""What every analysis derives from its one declaration (app/analysis.py): its route in the OpenAPI schema with a
cost, every server limit visible as a bound there, the cache key and the JSON-twin link."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
from fastapi.testclient import TestClient

from app.analysis import Limit, cache_key, canonical, json_url
from app.catalog import ANALYSES
from app.params import CompositionPairParams, OVParams
from circuits_core.cost import Cost
from circuits_core.errors import QkovError
from circuits_core.formats.checkpoint import LoadedModel
from tests.app.conftest import LIMITS

LISTINGS = {"/api/v1/models", "/api/v1/unavailable-models", "/api/v1/models/{model}", "/api/v1/jobs/{job_id}"}
BY_NAME = {a.name: a for a in ANALYSES}
# Values for required fields by name, and per analysis (the others run on their defaults).
BY_FIELD = {
    "head": "L1H0",
    "heads": "L0H1,L1H0",
    "source": "L0H1",
    "target": "L1H0",
    "tokens": "0,5,9,5,9",
    "writer": "L0H1",
    "reader": "unembed",
}
# analyses tiny-2l (shortformer positions) cannot answer: refused while pricing, a 422 before any compute; they are
# priced on a rotary model in test_api_rotary.py and test_hostile_rotary_residual_endpoints.py
ROTARY_ONLY = {"positional", "rotary-bands", "composition-profile", "qk-copying-offset"}
# analyses of MLP writers: tiny-2l is attention-only; priced against their answers in tests/app/test_families_app.py
NEEDS_AN_MLP = {"expert-ov"}
REQUIRED: dict[str, dict[str, Any]] = {
    "head": {"head": "L1H0"},
    "copying": {"head": "L1H0"},
    "ov": {"head": "L1H0"},
    "qk": {"head": "L1H0"},
    "skip-trigrams": {"head": "L1H0"},
    "composition-pair": {"source": "L0H1", "target": "L1H0"},
    "path": {"heads": "L0H1,L1H0", "tokens": "0,5,9,5,9"},
    "qk-paths": {"head": "L1H0", "tokens": "0,5,9,5,9"},
    "prompt": {"tokens": "0,5,9,5,9"},
    "paths": {"tokens": "0,5,9,5,9"},
    "tokenize": {"tokens": "0,5,9"},
    "detectors": {"seq_len": 5, "batch": 2},
}


@pytest.fixture(scope="module")
def spec(client: TestClient) -> dict[str, Any]:
    return client.get("/openapi.json").json()


def test_every_api_route_is_a_listing_or_a_declared_analysis_with_a_cost(
    spec: dict[str, Any], tiny: LoadedModel
) -> None:
    declared, priced, refused, model_scope = set(), set(), set(), set()
    for path, item in spec["paths"].items():
        op = item["get"]
        if not path.startswith("/api/v1/"):  # health checks
            continue
        if path in LISTINGS:
            assert "x-qkov-analysis" not in op
            continue
        analysis = BY_NAME[op["x-qkov-analysis"]]  # KeyError: a route that is neither
        assert analysis.api_path == path
        declared.add(analysis.name)
        if analysis.scope == "model":  # priced by the engine's estimate, on this model, before any slot
            assert callable(analysis.cost), analysis.name
            model_scope.add(analysis.name)
            required = {n: BY_FIELD.get(n) for n, f in analysis.params.model_fields.items() if f.is_required()}
            assert None not in required.values() or analysis.name in REQUIRED, f"give {analysis.name}'s fields a value"
            try:
                params = analysis.params.model_validate({**required, **REQUIRED.get(analysis.name, {})}).normalised(
                    tiny
                )
                cost = analysis.cost(tiny, params, LIMITS)
            except QkovError:  # an analysis this model cannot answer is refused while pricing: a 422 before compute
                refused.add(analysis.name)
                continue
            assert isinstance(cost, Cost) and cost.answer_bytes > 0, analysis.name
            priced.add(analysis.name)
    assert declared == set(BY_NAME)  # and every declaration has its route
    assert {
        "heads",
        "head",
        "ov",
        "detectors",
        "composition",
        "paths",
        "term-importance",
        "attention-entropy",
    } <= priced
    assert refused <= ROTARY_ONLY | NEEDS_AN_MLP and priced | refused == model_scope, (
        refused,
        model_scope - priced,
    )  # none unpriced


def test_every_limit_is_a_bound_in_the_schema(spec: dict[str, Any]) -> None:
    checked = 0
    for analysis in ANALYSES:
        params = {p["name"]: p["schema"] for p in spec["paths"][analysis.api_path]["get"].get("parameters", [])}
        for name, info in analysis.params.model_fields.items():
            for mark in (m for m in info.metadata if isinstance(m, Limit)):
                schema = params[name]
                options = schema.get("anyOf", [schema])
                key = {"le": "maximum", "lt": "exclusiveMaximum", "ge": "minimum", "max_length": "maxLength"}[
                    mark.constraint
                ]
                assert any(o.get(key) == mark.value(LIMITS) for o in options), (analysis.name, name, schema)
                checked += 1
    assert checked >= 20  # k, prompt, tokens, heads, seq_len, batch, max_order, position... on many routes


def test_limits_are_enforced_with_the_bound_named(client: TestClient) -> None:
    r = client.get("/api/v1/models/tiny-2l/heads/L1H0/ov", params={"k": LIMITS.max_k + 1})
    assert r.status_code == 422 and str(LIMITS.max_k) in r.text
    r = client.get("/api/v1/models/tiny-2l/detectors", params={"batch": LIMITS.max_batch + 1})
    assert r.status_code == 422 and str(LIMITS.max_batch) in r.text


def test_cache_key_uses_model_digest_and_normalised_params(tiny: LoadedModel) -> None:
    ov = BY_NAME["ov"]
    lower, canon = OVParams(head="L01H00", k=3).normalised(tiny), OVParams(head="L1H0", k=3)
    assert lower.head == "L1H0" and cache_key(ov, "tiny-2l", tiny, lower) == cache_key(ov, "tiny-2l", tiny, canon)
    key = cache_key(ov, "tiny-2l", tiny, canon)
    assert key[0] == "tiny-2l" and key[1] == tiny.digest and key[2] == "ov"
    assert cache_key(ov, "twin", tiny, canon) != key  # another folder never shares an answer
    assert cache_key(ov, "tiny-2l", tiny, OVParams(head="L1H0", k=4)) != key
    assert canonical(OVParams(head="L1H0")) == canonical(OVParams(head="L1H0", k=20, token=None))  # defaults explicit


def test_api_normalises_head_names(client: TestClient) -> None:
    a = client.get("/api/v1/models/tiny-2l/heads/L01H00/ov", params={"k": 3}).json()
    b = client.get("/api/v1/models/tiny-2l/heads/L1H0/ov", params={"k": 3}).json()
    assert a == b and a["head"] == "L1H0"


@pytest.mark.parametrize("name", ["ov", "qk", "direct", "composition-pair", "paths", "detectors", "attention-entropy"])
def test_json_link_round_trips_to_the_same_answer(client: TestClient, tiny: LoadedModel, name: str) -> None:
    analysis = BY_NAME[name]
    raw = {**REQUIRED.get(name, {}), **({"k": 4} if "k" in analysis.params.model_fields else {})}
    if "head" in raw:
        raw["head"] = "L01H0"  # normalised to L1H0 in the link
    params = analysis.params.model_validate(raw).normalised(tiny)
    link = json_url(analysis, "tiny-2l", params)
    parts = urlsplit(link)
    back = analysis.params.model_validate({**dict(parse_qsl(parts.query)), **REQUIRED.get(name, {})})
    assert canonical(back.normalised(tiny)) == canonical(params)
    assert client.get(link).status_code == 200


def test_pair_path_parameters_fill_the_link(tiny: LoadedModel) -> None:
    link = json_url(
        BY_NAME["composition-pair"], "tiny-2l", CompositionPairParams(source="L00H01", target="L1H0").normalised(tiny)
    )
    assert link == "/api/v1/models/tiny-2l/composition/L0H1/L1H0?k=10&basis=served&vocab=default"


def test_the_page_links_its_json_twin(client: TestClient) -> None:
    html = client.get("/models/tiny-2l/direct", params={"k": 7}).text
    # every param, defaults too (the direct page ranks frequent tokens by default where the model has counts)
    assert 'href="/api/v1/models/tiny-2l/direct?k=7&amp;basis=served&amp;min_count=50&amp;vocab=default"' in html
    html = client.get("/models/tiny-2l/composition/L00H1/L1H0", params={"k": 5}).text
    assert 'href="/api/v1/models/tiny-2l/composition/L0H1/L1H0?k=5&amp;basis=served&amp;vocab=default"' in html


def test_the_tour_cache_key_names_the_digest_of_each_model_it_reads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A server-wide answer (the tour) is keyed by what it reads: a toy whose files change, or that appears, gets a
    new key, so a stored tour of other weights is never served (the model-scope key's digest rule, server-wide)."""
    import shutil

    import numpy as np

    from app.analysis import server_key
    from app.params import TourParams
    from app.registry import ModelRegistry
    from app.settings import Settings
    from circuits_core.formats.checkpoint import load_checkpoint

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    shutil.copytree("checkpoints/toy-2l", shipped / "toy-2l")
    registry = ModelRegistry(Settings(shipped_dir=shipped, models_dir=None, dtype="float64", limits=LIMITS))
    tour = BY_NAME["tour"]
    key = server_key(tour, registry, TourParams())
    digest = load_checkpoint(shipped / "toy-2l", dtype=__import__("torch").float64).digest  # computed independently
    assert f"toy-2l={digest}" in key and "toy-0l=-" in key and "toy-1l=-" in key
    counts = np.load(shipped / "toy-2l" / "token_counts.npy")
    np.save(shipped / "toy-2l" / "token_counts.npy", counts + 1)  # an answer-changing file (frequent tokens)
    changed = server_key(tour, registry, TourParams())
    assert changed != key and f"toy-2l={digest}" not in changed
    shutil.copytree("checkpoints/toy-0l", shipped / "toy-0l")
    assert "toy-0l=-" not in server_key(tour, registry, TourParams())
    assert server_key(tour, registry, TourParams(chapter="smollm2")) == (
        "tour",
        "smollm2-135m=-",
        canonical(TourParams(chapter="smollm2")),
    )
