"""Hostile pass over the token-set, sampling, offset and basis parameters: `vocab=default|all` on the
OV/QK/direct/skip-trigram tables, `rows=` and `heads=` on /copying, /heads/{head}/qk-copying?offset=&max_offset=,
`basis=raw|served` on /composition and its pair route, `min_count=all` on the direct page, the detectors' default
seq_len (fitted to n_ctx) and the lazily loaded copying panels. Precompute's command line, real HTTP (uvicorn) and
the page sentences on SmolLM2's measured scores: test_hostile_precompute_and_http.py, on the same folders.

Every bad value must be a 4xx problem+json whose detail names the field -- never a 5xx, another model's answer, or
an answer larger than priced; a server with 1 KiB of working memory must refuse each new request by its price; the
OpenAPI schema must carry each new bound; the JSON links of each page with a new parameter must answer 200.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

import app.routers.pages as pages
import app.routers.pages_heads as pages_heads
import app.views.shared.token_sets as token_sets
from app.main import create_app
from app.params import DetectorParams
from app.precompute import lazy_panels
from app.settings import Settings
from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from circuits_core.prompt.phenomena import TOKEN_COUNTS_FILE
from tests.app.conftest import LIMITS, assert_problem, save_qkov, train_tokenizer

API = "/api/v1/models"
WIDE_V, SMALL_DEFAULT = 700, 256  # the "wide" model is a large vocabulary once DEFAULT_VOCAB is lowered to 256


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_folders(tmp_path_factory.mktemp("hostile-s3"))


def build_folders(root: Path) -> tuple[Path, Path]:
    """shipped/two (shortformer, token counts), user/: twin (two's files under another id), ln (standard positions,
    LayerNorm: served processed), rope (rotary, RMS, GQA), ctx2/ctx3 (n_ctx 2 and 3), zero (no layers), wide
    (700 tokens, token counts, processing off); float-counts, short-counts, object-counts (wide with a malformed
    token_counts.npy: floats, 10 entries, a pickled object array)."""
    tok = train_tokenizer()
    V = tok.get_vocab_size()
    shipped, user = root / "shipped", root / "user"
    two = ModelConfig(
        n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=V, n_ctx=32, positional_embedding_type="shortformer"
    )
    for folder in (shipped / "two", user / "twin"):
        save_qkov(folder, two, tok, seed=1)
        np.save(folder / TOKEN_COUNTS_FILE, np.random.default_rng(0).integers(0, 100, V))
    save_qkov(
        user / "ln",
        ModelConfig(
            n_layers=2,
            d_model=16,
            n_heads=2,
            d_head=8,
            d_vocab=V,
            n_ctx=32,
            positional_embedding_type="standard",
            normalization_type="LN",
        ),
        tok,
        seed=2,
    )
    save_qkov(
        user / "rope",
        ModelConfig(
            n_layers=2,
            d_model=16,
            n_heads=4,
            d_head=8,
            d_vocab=V,
            n_ctx=32,
            normalization_type="RMS",
            positional_embedding_type="rotary",
            n_key_value_heads=2,
        ),
        tok,
        seed=3,
    )
    for n in (2, 3):
        save_qkov(
            user / f"ctx{n}", ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=8, d_vocab=V, n_ctx=n), tok, seed=4
        )
    save_qkov(user / "zero", ModelConfig(n_layers=0, d_model=16, n_heads=2, d_head=8, d_vocab=V, n_ctx=32), tok, seed=5)
    wide = random_model(
        ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=4, d_vocab=WIDE_V, n_ctx=16),
        seed=6,
        dtype=torch.float64,
        std_embed=0.5,
    )
    save_checkpoint(wide, user / "wide")
    (user / "wide" / "qkov.json").write_text(json.dumps({"processing": False}))
    np.save(user / "wide" / TOKEN_COUNTS_FILE, np.random.default_rng(1).permutation(WIDE_V) * 3 + 1)
    for name, counts in {"float-counts": np.random.default_rng(2).random(WIDE_V), "short-counts": np.arange(10),
                         "object-counts": np.array([{"a": 1}] * WIDE_V, dtype=object)}.items():  # fmt: skip
        save_checkpoint(wide, user / name)
        (user / name / "qkov.json").write_text(json.dumps({"processing": False}))
        np.save(user / name / TOKEN_COUNTS_FILE, counts, allow_pickle=True)
    return shipped, user


def _settings(folders: tuple[Path, Path], **limits: int) -> Settings:
    return Settings(shipped_dir=folders[0], models_dir=folders[1], dtype="float64", store_url="off",
                    limits=LIMITS.model_copy(update=limits), max_model_bytes=10**9)  # fmt: skip


@pytest.fixture(scope="module")
def small_default() -> Iterator[None]:
    patch = pytest.MonkeyPatch()
    patch.setattr(token_sets, "DEFAULT_VOCAB", SMALL_DEFAULT)
    patch.setattr(pages, "DEFAULT_VOCAB", SMALL_DEFAULT)
    patch.setattr(pages_heads, "DEFAULT_VOCAB", SMALL_DEFAULT)  # the head page's (app/routers/pages_heads.py)
    yield
    patch.undo()


@pytest.fixture(scope="module")
def app_client(folders: tuple[Path, Path], small_default: None) -> Iterator[tuple[Any, TestClient]]:
    app = create_app(_settings(folders))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield app, c


@pytest.fixture(scope="module")
def client(app_client: tuple[Any, TestClient]) -> TestClient:
    return app_client[1]


@pytest.fixture(scope="module")
def poor(folders: tuple[Path, Path], small_default: None) -> Iterator[TestClient]:
    """The same models with 1 KiB of working memory per request: every computation is refused by its price."""
    with TestClient(
        create_app(_settings(folders, peak_bytes=1024, matrix_budget_bytes=1024)), raise_server_exceptions=False
    ) as c:
        yield c


def no_5xx(response: Any) -> None:
    assert response.status_code < 500, (str(response.request.url), response.status_code, response.text[:300])
    if response.status_code >= 400 and response.request.url.path.startswith("/api/"):
        assert response.headers["content-type"].startswith("application/problem+json"), response.text[:300]
        assert response.json()["detail"]


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
