"""Large vocabularies: a global OV/QK/direct table and the default skip-trigram source rank a stated
token set by default -- the DEFAULT_VOCAB most frequent tokens (token_counts.npy) or else the lowest ids -- and
`vocab=all` ranks every token; each global table is computed once and shared by every k up to SHARED_K.

DEFAULT_VOCAB is lowered to 256 here so a 700-token model is "large" and a dense float64 reference is cheap. The
references are products of the weights read straight from the safetensors file (processing off), ranked by
torch.topk on the dense [V, V] matrix restricted to the expected ids (which are computed here with numpy).
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

import app.routers.pages as pages
import app.routers.pages_heads as pages_heads
import app.views.circuits as views
import app.views.shared.token_sets as token_sets
from app.main import create_app
from app.params import OVParams
from app.settings import Limits, Settings
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from circuits_core.prompt.phenomena import TOKEN_COUNTS_FILE
from tests.app.snippet_runner import run, snippets_in

V, SMALL = 700, 256
API = "/api/v1/models"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """wide: 700 tokens, no counts; counted: the same weights with token_counts.npy (distinct counts); deep: two
    layers, no counts."""
    root = tmp_path_factory.mktemp("wide-models")
    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=4, d_vocab=V, n_ctx=16)
    model = random_model(cfg, seed=3, dtype=torch.float64, std_embed=0.5)
    for name in ("wide", "counted"):
        save_checkpoint(model, root / name)
        (root / name / "qkov.json").write_text(json.dumps({"processing": False}))
    np.save(root / "counted" / TOKEN_COUNTS_FILE, np.random.default_rng(1).permutation(V) * 3 + 1)
    deep_cfg = ModelConfig(n_layers=2, d_model=16, n_heads=2, d_head=4, d_vocab=V, n_ctx=16)
    deep = random_model(deep_cfg, seed=4, dtype=torch.float64, std_embed=0.5)
    save_checkpoint(deep, root / "deep")  # two layers: a composition pair
    (root / "deep" / "qkov.json").write_text(json.dumps({"processing": False}))
    return root


@pytest.fixture(scope="module")
def client(models: Path) -> Iterator[TestClient]:
    patch = pytest.MonkeyPatch()
    patch.setattr(token_sets, "DEFAULT_VOCAB", SMALL)
    patch.setattr(pages, "DEFAULT_VOCAB", SMALL)
    patch.setattr(pages_heads, "DEFAULT_VOCAB", SMALL)
    settings = Settings(
        shipped_dir=models / "none",
        models_dir=models,
        dtype="float64",
        store_url="off",
        limits=Limits(max_k=50, matrix_budget_bytes=64 * 1024),
    )
    with TestClient(create_app(settings)) as c:
        yield c
    patch.undo()


def weights(models: Path) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in load_file(str(models / "wide" / "model.safetensors")).items()}


def dense(models: Path, circuit: str, head: int) -> torch.Tensor:
    """[V, V] float64: W_E W_V W_O W_U (ov) or W_E W_Q W_K^T W_E^T / sqrt(d_head) (qk) of layer 0."""
    w = weights(models)
    W_E, a = w["embed.W_E"], "blocks.0.attn."
    if circuit == "ov":
        return W_E @ w[a + "W_V"][head] @ w[a + "W_O"][head] @ w["unembed.W_U"]
    return W_E @ w[a + "W_Q"][head] @ w[a + "W_K"][head].T @ W_E.T / 2.0  # sqrt(d_head = 4)


def expected_ids(models: Path, name: str) -> np.ndarray:
    """The default set, computed independently: the SMALL largest counts, or ids 0..SMALL-1."""
    if name == "wide":
        return np.arange(SMALL)
    counts = np.load(models / "counted" / TOKEN_COUNTS_FILE)
    return np.sort(np.argsort(counts)[::-1][:SMALL])  # counts are distinct: no tie to break


def dense_top(M: torch.Tensor, ids: np.ndarray | None, k: int) -> list[tuple[int, int, float]]:
    if ids is not None:
        keep = torch.zeros(M.shape[0], dtype=torch.bool)
        keep[torch.from_numpy(ids)] = True
        M = M.masked_fill(~(keep[:, None] & keep[None, :]), float("-inf"))
    values, flat = M.flatten().topk(k)
    return [(int(i) // M.shape[1], int(i) % M.shape[1], float(v)) for v, i in zip(values, flat, strict=True)]


def entries(body: dict) -> list[tuple[int, int, float]]:
    return [(e["row"]["id"], e["col"]["id"], e["value"]) for e in body["entries"]]


def assert_same(got: list[tuple[int, int, float]], want: list[tuple[int, int, float]]) -> None:
    assert [(r, c) for r, c, _ in got] == [(r, c) for r, c, _ in want]
    assert [v for *_, v in got] == pytest.approx([v for *_, v in want], rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("name", ["wide", "counted"])
@pytest.mark.parametrize("circuit", ["ov", "qk"])
def test_the_default_global_table_ranks_the_stated_set(
    client: TestClient, models: Path, name: str, circuit: str
) -> None:
    body = client.get(f"{API}/{name}/heads/L0H1/{circuit}", params={"k": 7}).json()
    ids = expected_ids(models, name)
    assert_same(entries(body), dense_top(dense(models, circuit, 1), ids, 7))
    assert body["n_tokens"] == SMALL
    assert body["token_ids"] == ids.tolist()  # the set itself, for a notebook to rank the same tokens
    said = "most frequent" if name == "counted" else "lowest ids"
    assert f"the {SMALL} {said} of the {V} tokens" in body["token_set"]
    # the whole vocabulary is one parameter away, and differs here (the top entry lies outside the set)
    every = client.get(f"{API}/{name}/heads/L0H1/{circuit}", params={"k": 7, "vocab": "all"}).json()
    assert_same(entries(every), dense_top(dense(models, circuit, 1), None, 7))
    assert every["token_set"] is None and every["n_tokens"] is None and every["token_ids"] is None


@pytest.mark.parametrize("query", [{}, {"min_count": "1500"}, {"token": "5", "min_count": "1500"}], ids=str)
def test_the_head_pages_ov_snippet_ranks_the_tables_token_set(
    client: TestClient, models: Path, query: dict[str, str]
) -> None:
    """The OV table's "copy as Python" ranks the token set the table ranked (the view's token_ids, not a second
    ranking of the page's): run, it gives the JSON's entries, which are the dense product's top entries over the set
    computed here with numpy."""
    page = client.get("/models/counted/heads/L0H1", params=query).text
    result = run(snippets_in(page)["ov-python"])
    body = client.get(f"{API}/counted/heads/L0H1/ov", params={"k": 10, **query}).json()
    counts = np.load(models / "counted" / TOKEN_COUNTS_FILE)
    ids = expected_ids(models, "counted") if not query else np.flatnonzero(counts >= 1500)
    assert body["token_ids"] == ids.tolist()
    assert_same(result["entries"], entries(body))
    if "token" not in query:
        assert_same(entries(body), dense_top(dense(models, "ov", 1), ids, 10))


def test_whole_vocabulary_differs_from_the_default_on_this_model(models: Path) -> None:
    """Guards the test above: the default set must change the answer, or it checks nothing."""
    M = dense(models, "ov", 1)
    assert dense_top(M, None, 7) != dense_top(M, expected_ids(models, "wide"), 7)


def test_a_tokens_row_ranks_every_token(client: TestClient, models: Path) -> None:
    body = client.get(f"{API}/wide/heads/L0H0/ov", params={"token": 5, "k": 6}).json()
    row = dense(models, "ov", 0)[5]
    assert [e["col"]["id"] for e in body["entries"]] == row.topk(6).indices.tolist()  # over all 700 columns
    assert body["token_set"] is None


def test_min_count_chooses_the_tokens_instead(client: TestClient, models: Path) -> None:
    counts = np.load(models / "counted" / TOKEN_COUNTS_FILE)
    body = client.get(f"{API}/counted/heads/L0H0/ov", params={"k": 4, "min_count": 1500}).json()
    ids = np.flatnonzero(counts >= 1500)
    assert body["n_tokens"] == len(ids) and "seen at least 1,500 times" in body["token_set"]
    assert_same(entries(body), dense_top(dense(models, "ov", 0), ids, 4))


@pytest.mark.parametrize("vocab", ["default", "all"])
def test_the_default_skip_trigram_source_is_the_largest_ov_entry_of_the_set(
    client: TestClient, models: Path, vocab: str
) -> None:
    body = client.get(f"{API}/wide/heads/L0H1/skip-trigrams", params={"vocab": vocab}).json()
    ids = expected_ids(models, "wide") if vocab == "default" else None
    assert body["source"]["id"] == dense_top(dense(models, "ov", 1), ids, 1)[0][0]
    assert (body["token_set"] is None) == (vocab == "all")


def test_each_global_table_is_computed_once_for_every_k_up_to_the_shared_one(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(token_sets, "DEFAULT_VOCAB", SMALL)
    monkeypatch.setattr(pages, "DEFAULT_VOCAB", SMALL)
    monkeypatch.setattr(pages_heads, "DEFAULT_VOCAB", SMALL)
    searches: list[int] = []
    inner = FactoredMatrix.topk_global

    def counted(self: FactoredMatrix, k: int, *args: object, **kwargs: object) -> object:
        if kwargs.get("rows") is None:  # the search itself (a call with rows= recurses once, without)
            searches.append(k)
        return inner(self, k, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(FactoredMatrix, "topk_global", counted)
    settings = Settings(shipped_dir=models / "none", models_dir=models, dtype="float64", store_url="off")
    with TestClient(create_app(settings)) as c:
        page = c.get("/models/wide/heads/L0H1")  # OV and QK at k=10, the skip-trigram source (OV top 1)
        assert page.status_code == 200
        ov = c.get(f"{API}/wide/heads/L0H1/ov").json()  # k=20: the API's default
        qk = c.get(f"{API}/wide/heads/L0H1/qk", params={"k": 3}).json()
        c.get(f"{API}/wide/heads/L0H1/skip-trigrams")
        assert searches == [20, 20]  # one OV and one QK table, at the shared k
        assert_same(entries(ov), dense_top(dense(models, "ov", 1), expected_ids(models, "wide"), 20))
        assert_same(entries(qk), dense_top(dense(models, "qk", 1), expected_ids(models, "wide"), 3))
        c.get(f"{API}/wide/heads/L0H1/ov", params={"k": 30})  # beyond the shared k: a table of its own
        assert searches == [20, 20, 30]


def test_the_page_names_the_set_and_links_the_whole_vocabulary(client: TestClient) -> None:
    html = client.get("/models/wide/heads/L0H1").text
    note = re.search(r'<p class="note" id="token-set">(.*?)</p>', html, re.S)
    assert note is not None and f"the {SMALL} lowest ids of the {V} tokens" in note[1]
    assert "vocab=all" in note[1] and f"Rank all {V} tokens" in note[1]
    every = client.get("/models/wide/heads/L0H1", params={"vocab": "all"}).text
    assert '<input type="hidden" name="vocab" value="all">' in every  # kept in the URL state by the form
    assert f"Ranked: all {V} tokens" in every
    table = re.search(r'id="ov-table".*?</table>', every, re.S)
    assert table is not None and "vocab=all" in table[0]  # row links keep it too
    direct = client.get("/models/wide/direct").text
    assert f"the {SMALL} lowest ids of the {V} tokens" in direct and "vocab=all" in direct


def test_the_whole_vocabulary_is_priced_higher(models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_sets, "DEFAULT_VOCAB", SMALL)
    loaded = load_checkpoint(models / "wide", dtype=torch.float64)
    limits = Limits(matrix_budget_bytes=1 << 30)
    default = views.top_cost(loaded, OVParams(head="L0H1"), limits)
    every = views.top_cost(loaded, OVParams(head="L0H1", vocab="all"), limits)
    assert every.peak_bytes > default.peak_bytes


def test_vocab_is_in_the_openapi_schema(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    params = {p["name"]: p for p in spec["paths"]["/api/v1/models/{model}/heads/{head}/ov"]["get"]["parameters"]}
    schema = params["vocab"]["schema"]
    assert schema.get("enum", schema.get("anyOf")) is not None and schema["default"] == "default"
    assert "most frequent" in params["vocab"]["description"]


def test_precompute_full_also_stores_the_whole_vocabulary_tables(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import app.precompute as precompute

    for module in (token_sets, pages, precompute):
        monkeypatch.setattr(module, "DEFAULT_VOCAB", SMALL)
    env = {
        "QKOV_STORE_URL": "disk",
        "QKOV_STORE_DIR": str(tmp_path / "store"),
        "QKOV_SHIPPED_DIR": str(models / "none"),
        "QKOV_MODELS_DIR": str(models),
        "QKOV_DTYPE": "float64",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    urls = [
        f"{API}/wide/heads/L0H1/ov?vocab=all",
        f"{API}/wide/heads/L0H1/qk?vocab=all",
        "/models/wide/heads/L0H1?vocab=all",
    ]

    def computed_after(args: list[str]) -> int:
        assert precompute.main(["wide", "--heads", "L0H1", *args]) == 0
        app = create_app(Settings())
        with TestClient(app) as c:
            c.get(f"{API}/wide")  # loads the model
            before = app.state.compute.stats.completed
            for url in urls:
                assert c.get(url).status_code == 200, url
            return app.state.compute.stats.completed - before

    assert computed_after([]) > 0  # the default run leaves the whole-vocabulary tables to the first visitor
    assert computed_after(["--full"]) == 0  # --full stored them


def test_a_composition_pair_ranks_the_stated_set(client: TestClient, models: Path) -> None:
    """The pair page's two token circuits (the K-composition circuit and the virtual OV circuit) rank the default set
    of a large vocabulary, as the OV tables do, and say so; vocab=all ranks every token. References: the dense [V, V]
    products of the weights in the file, restricted to ids 0..SMALL-1."""
    w = {k: v.double() for k, v in load_file(str(models / "deep" / "model.safetensors")).items()}
    W_E, W_U, a0, a1 = w["embed.W_E"], w["unembed.W_U"], "blocks.0.attn.", "blocks.1.attn."
    ov0 = w[a0 + "W_V"][1] @ w[a0 + "W_O"][1]  # source L0H1
    k_circuit = W_E @ w[a1 + "W_Q"][0] @ w[a1 + "W_K"][0].T @ (W_E @ ov0).T / 2.0  # target L1H0, sqrt(d_head = 4)
    virtual = W_E @ ov0 @ w[a1 + "W_V"][0] @ w[a1 + "W_O"][0] @ W_U
    body = client.get(f"{API}/deep/composition/L0H1/L1H0", params={"k": 6}).json()
    assert body["token_set"].startswith(f"the {SMALL:,} lowest ids of the {V:,} tokens")
    ids = np.arange(SMALL)
    assert_same(entries(body["k_composition"]), dense_top(k_circuit, ids, 6))
    assert_same(entries(body["virtual_head"]["ov"]), dense_top(virtual, ids, 6))
    page = client.get("/models/deep/composition/L0H1/L1H0", params={"k": 6}).text
    assert 'id="token-set"' in page and body["token_set"] in html.unescape(page)
    every = client.get(f"{API}/deep/composition/L0H1/L1H0", params={"k": 6, "vocab": "all"}).json()
    assert every["token_set"] is None
    assert_same(entries(every["k_composition"]), dense_top(k_circuit, None, 6))
    assert_same(entries(every["virtual_head"]["ov"]), dense_top(virtual, None, 6))


def test_the_copying_metrics_rank_the_stated_set(client: TestClient, models: Path) -> None:
    """A head's copying metrics (diagonal sign, top-1 and top-k self-copy) over the default set of a large vocabulary,
    and over every token with vocab=all, against the dense OV circuit restricted to those tokens."""
    M = dense(models, "ov", 1)
    for vocab, n in (("default", SMALL), ("all", V)):
        body = client.get(f"{API}/wide/heads/L0H1/copying", params={"k": 3, "vocab": vocab}).json()
        sub = M[:n, :n]  # the default set is ids 0..SMALL-1 (no counts)
        own = torch.arange(n)
        top = sub.topk(3, dim=1).indices
        assert body["n_tokens"] == n and (body["token_set"] is None) == (vocab == "all")
        assert body["top1"] == pytest.approx(float((top[:, 0] == own).double().mean()), abs=1e-12)
        assert body["topk"] == pytest.approx(float((top == own[:, None]).any(1).double().mean()), abs=1e-12)
        assert body["diagonal_positive"] == pytest.approx(float((sub.diagonal() > 0).double().mean()), abs=1e-12)
