"""Hostile pass over the token-set, sampling, offset and basis parameters: `vocab=default|all` on the
OV/QK/direct/skip-trigram tables, `rows=` and `heads=` on /copying, /heads/{head}/qk-copying?offset=&max_offset=,
`basis=raw|served` on /composition and its pair route, `min_count=all` on the direct page, the detectors' default
seq_len (fitted to n_ctx) and the lazily loaded copying panels. Precompute's command line, real HTTP (uvicorn) and
the page sentences on SmolLM2's measured scores: test_hostile_precompute_and_http.py, on the same folders.

Every bad value must be a 4xx problem+json whose detail names the field -- never a 5xx, another model's answer or
another token set's answer. Prices, the OpenAPI schema and the pages: test_hostile_prices_schema_pages.py; the
folders: tests/app/hostile_folders.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.params import DetectorParams
from circuits_core.prompt.phenomena import TOKEN_COUNTS_FILE
from tests.app.conftest import assert_problem
from tests.app.hostile_folders import (
    API,
    SMALL_DEFAULT,
    WIDE_V,
    no_5xx,
)

# -- 1. every bad value of a new parameter is a 422 naming the field ---------------------------------------------
BAD_VOCAB = ["ALL", "all ", "", "none", "Default", "all\x00", "1", "x" * 5000]


VOCAB_ROUTES = ["two/heads/L0H0/ov", "two/heads/L0H0/qk", "two/direct", "two/heads/L0H0/skip-trigrams", "wide/direct"]


BAD_FIELDS: list[tuple[str, str, list[str]]] = [  # (route under /api/v1/models, field, values)
    *((route, "vocab", BAD_VOCAB) for route in VOCAB_ROUTES),
    ("two/copying", "rows", ["0", "-1", "", "abc", "1e3", "1.5", "10000001", "99999999999999999999999"]),
    ("two/copying", "heads", ["l0h0", "L0H0;L1H0", "x" * 100, "L0H0," * 5, "L0H0.5"]),
    ("rope/heads/L0H0/qk-copying", "offset", ["-1", "1.5", "abc", "", "1000001", "32", "99999999999999999999999"]),
    ("rope/heads/L0H0/qk-copying", "max_offset", ["0", "-1", "4097", "", "abc", "2.5"]),
    ("ln/composition", "basis", ["RAW", "", "stored", "served ", "raw\x00"]),
    ("ln/composition/L0H0/L1H1", "basis", ["RAW", "", "processed"]),
    ("two/detectors", "seq_len", ["0", "-1", "", "null", "None", "16", "61", "abc"]),
    ("two/direct", "min_count", ["all", "ALL", "0", "-1", "", "1e3", "1000000001"]),
]


@pytest.mark.parametrize(("route", "field", "values"), BAD_FIELDS, ids=[f"{r}-{f}" for r, f, _ in BAD_FIELDS])
def test_bad_values_are_422_naming_the_field(client: TestClient, route: str, field: str, values: list[str]) -> None:
    for value in values:
        answer = client.get(f"{API}/{route}", params={field: value})
        body = assert_problem(answer, answer.status_code)
        assert answer.status_code in (404, 422), (value, answer.status_code)
        needle = "head" if field == "heads" else field
        # the field's name, or (values that parse but the model cannot take) the model bound they break
        assert needle in body["detail"] or "n_ctx" in body["detail"] or "context" in body["detail"], (
            value,
            body["detail"],
        )


def test_huge_head_lists_are_refused_by_the_limit(client: TestClient) -> None:
    assert_problem(client.get(f"{API}/two/copying", params={"heads": "L0H0,L0H1,L1H0,L1H1,L0H0"}), 422, "at most 4")
    assert_problem(client.get(f"{API}/two/copying", params={"heads": "L9H0"}), 404, "L9H0")
    assert_problem(client.get(f"{API}/zero/copying", params={"heads": "L0H0"}), 404, "0 layers")


@pytest.mark.parametrize("model", ["two", "ln", "ctx2", "zero", "wide"])
def test_qk_copying_off_rotary_models_says_rotary_or_names_the_head(client: TestClient, model: str) -> None:
    answer = client.get(f"{API}/{model}/heads/L0H0/qk-copying", params={"offset": 0})
    assert_problem(answer, answer.status_code, "0 layers" if model == "zero" else "rotary")


@pytest.mark.parametrize("head", ["L2H0", "L0H4", "x", "L-1H0", "L0H0x", "L" + "9" * 30 + "H0", "%00"])
def test_qk_copying_bad_heads_are_refused(client: TestClient, head: str) -> None:
    answer = client.get(f"{API}/rope/heads/{head}/qk-copying")
    assert answer.status_code in (404, 422), answer.text
    assert_problem(answer, answer.status_code)


# -- 2. edge models never get a server error -----------------------------------------------------------------------
EDGE_MODELS = ["two", "ln", "rope", "ctx2", "ctx3", "wide", "nope", "zero"]


NEW_REQUESTS = ["heads/L0H0/qk-copying", "heads/L0H0/qk-copying?offset=1&max_offset=4096", "copying?heads=L0H0&rows=1&samples=2",  # noqa: E501 (a table kept on one line)
                "copying?rows=10000000&samples=2", "heads/L0H0/ov?vocab=all", "heads/L0H0/qk?vocab=all&side=key",
                "heads/L0H0/skip-trigrams?vocab=all", "direct?vocab=all", "direct?vocab=all&min_count=5",
                "composition?basis=raw", "composition?basis=raw&kind=Q&offset=3", "composition/L0H0/L1H1?basis=raw",
                "detectors", "detectors?heads=L0H0", "detectors?seq_len=1"]  # fmt: skip


@pytest.mark.parametrize("model", EDGE_MODELS)
def test_new_requests_never_get_a_server_error(client: TestClient, model: str) -> None:
    for request in NEW_REQUESTS:
        if model != "zero" or not request.startswith("detectors"):  # zero's: test_detectors_on_a_model_without_layers
            no_5xx(client.get(f"{API}/{model}/{request}"))


@pytest.mark.parametrize(
    "url", [f"{API}/zero/detectors", f"{API}/zero/detectors?prompt=the%20cat", "/models/zero/detectors"]
)
def test_detectors_on_a_model_without_layers(client: TestClient, url: str) -> None:
    answer = client.get(url)
    assert answer.status_code in (200, 422), (answer.status_code, answer.text[:200])


# -- 3. the detectors' default seq_len ---------------------------------------------------------------------------
def test_default_seq_len_fits_tiny_contexts_or_says_why(client: TestClient) -> None:
    assert_problem(client.get(f"{API}/ctx2/detectors"), 422, "seq_len", "context is 2")  # BOS + r + r needs 3 tokens
    fitted = client.get(f"{API}/ctx3/detectors")
    assert fitted.status_code == 200 and fitted.json()["detector_input"]["seq_len"] == 1
    page = client.get("/models/ctx2/detectors")
    assert page.status_code == 422 and "context" in page.text


def test_default_seq_len_is_the_fitted_one_and_an_explicit_one_is_kept(app_client: tuple[Any, TestClient]) -> None:
    """n_ctx 32 with BOS: the standard T = 50 shortened to (32 - 1) // 2 = 15, the same answer as seq_len=15 asked;
    an explicit 14 is never changed, and an explicit 16 (33 tokens) is refused, not shortened."""
    app, client = app_client
    default, asked = client.get(f"{API}/two/detectors").json(), client.get(f"{API}/two/detectors?seq_len=15").json()
    assert default["detector_input"]["seq_len"] == 15 and default == asked
    assert client.get(f"{API}/two/detectors?seq_len=14").json()["detector_input"]["seq_len"] == 14
    assert_problem(client.get(f"{API}/two/detectors?seq_len=16"), 422, "seq_len=16", "32")
    loaded = app.state.registry.get("two")
    assert DetectorParams(seq_len=None).normalised(loaded).seq_len == 15  # independent of the route


# -- 4. another model's answer, another basis's answer, another token set's answer -------------------------------
def test_a_model_with_the_same_files_under_another_id_gets_its_own_id(client: TestClient) -> None:
    for request in (
        "copying?heads=L1H1&rows=3&samples=2",
        "heads/L0H0/ov?vocab=all",
        "detectors",
        "composition?basis=raw",
    ):
        a, b = client.get(f"{API}/two/{request}").json(), client.get(f"{API}/twin/{request}").json()
        assert a["model"]["id"] == "two" and b["model"]["id"] == "twin", request
        assert {k: v for k, v in a.items() if k != "model"} == {k: v for k, v in b.items() if k != "model"}, request


@pytest.mark.parametrize("route", ["composition", "composition/L0H0/L1H1", "heads/L0H0/ov", "direct"])
def test_raw_and_served_never_share_an_answer(client: TestClient, route: str) -> None:
    """ln is served processed (folded LayerNorm, centred weights): raw asked first must not be served as the
    processed answer (nor the reverse), and each names its basis."""
    raw = client.get(f"{API}/ln/{route}", params={"basis": "raw"}).json()
    served = client.get(f"{API}/ln/{route}", params={"basis": "served"}).json()
    again = client.get(f"{API}/ln/{route}", params={"basis": "raw"}).json()
    assert raw["basis"].startswith("raw") and served["basis"].startswith("processed"), (raw["basis"], served["basis"])
    assert raw == again
    numbers = lambda v: re.findall(
        r"-?\d+\.\d{6,}", json.dumps({k: x for k, x in v.items() if k not in ("basis", "model")})
    )  # noqa: E731
    assert numbers(raw) != numbers(served)


def test_vocab_all_and_default_are_different_tables_on_a_large_vocabulary(client: TestClient) -> None:
    """Lowered DEFAULT_VOCAB (256 of 700): default ranks the 256 most frequent tokens, all ranks 700; asking one first
    must not serve it for the other, and every default entry's tokens lie in the frequent set."""
    counts = np.load(client.app.state.registry.get("wide").path / TOKEN_COUNTS_FILE)  # type: ignore[attr-defined]
    frequent = set(np.argsort(-counts, kind="stable")[:SMALL_DEFAULT].tolist())
    for route in ("heads/L0H1/ov", "heads/L0H1/qk", "direct"):
        every = client.get(f"{API}/wide/{route}", params={"vocab": "all", "k": 50}).json()
        default = client.get(f"{API}/wide/{route}", params={"k": 50}).json()
        assert every["token_set"] is None and every["n_tokens"] is None, route
        assert default["n_tokens"] == SMALL_DEFAULT and "most frequent" in default["token_set"], route
        assert all(e["row"]["id"] in frequent and e["col"]["id"] in frequent for e in default["entries"]), route
        top_all, top_default = every["entries"][0]["value"], default["entries"][0]["value"]
        assert top_all >= top_default, route  # a superset's maximum
        outside = [e for e in every["entries"] if e["row"]["id"] not in frequent or e["col"]["id"] not in frequent]
        assert outside, (
            f"{route}: every top-50 entry over 700 tokens lies in the 256 frequent ones; this check proves nothing"
        )


def test_min_count_wins_over_vocab(client: TestClient) -> None:
    a = client.get(f"{API}/wide/heads/L0H0/ov", params={"min_count": 1500, "vocab": "all"}).json()
    b = client.get(f"{API}/wide/heads/L0H0/ov", params={"min_count": 1500}).json()
    assert a["entries"] == b["entries"] and a["n_tokens"] == b["n_tokens"] < WIDE_V


def test_copying_answers_exactly_the_heads_and_rows_asked(client: TestClient) -> None:
    body = client.get(f"{API}/two/copying", params={"heads": "L01H001,L0H0", "rows": 7, "samples": 2}).json()
    assert [h["head"] for h in body["heads"]] == ["L1H1", "L0H0"] and body["n_rows"] == 7
    every = client.get(f"{API}/two/copying", params={"rows": 7, "samples": 2}).json()
    by_head = {h["head"]: h for h in every["heads"]}
    for h in body["heads"]:  # the same seeded rows: a head's shares do not depend on which other heads were asked
        assert h == by_head[h["head"]]


def test_copying_lists_a_repeated_head_once(client: TestClient) -> None:
    body = client.get(f"{API}/two/copying", params={"heads": "L0H0,L0H0", "samples": 2}).json()
    assert [h["head"] for h in body["heads"]] == ["L0H0"]


@pytest.mark.parametrize("model", ["float-counts", "short-counts", "object-counts"])
def test_a_malformed_counts_file_refuses_the_default_token_set_by_name(client: TestClient, model: str) -> None:
    """Over DEFAULT_VOCAB the default set is read from token_counts.npy: a malformed file is a 422 naming it (never
    unpickled, never a 500), and vocab=all, which does not read it, still answers."""
    for request in ("heads/L0H0/ov", "heads/L0H0/qk?side=key", "direct", "heads/L0H0/skip-trigrams"):
        assert_problem(client.get(f"{API}/{model}/{request}"), 422, TOKEN_COUNTS_FILE)
    assert client.get(f"{API}/{model}/heads/L0H0/ov", params={"vocab": "all"}).status_code == 200
    page = client.get(f"/models/{model}/direct")
    assert page.status_code == 422 and TOKEN_COUNTS_FILE in page.text
