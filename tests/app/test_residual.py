"""Residual stream pages and API (app/views/residual.py): answers against dense float64 products written from
the served weights (tests/core/test_virtual_weights.py's references), on an attention-only shortformer toy, a
GPT-2-like LayerNorm MLP model and a Llama-like gated GQA rotary model; pages, JSON twins and refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.circuits import stream_components as sc
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.model.config import ModelConfig
from tests.app.conftest import LIMITS, assert_problem, save_qkov, train_tokenizer
from tests.core.test_virtual_weights import dense_reader, dense_writer


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("residual-models")
    tok = train_tokenizer()
    V = tok.get_vocab_size()
    save_qkov(
        root / "gpt2ish",
        ModelConfig(
            n_layers=2,
            d_model=16,
            n_heads=2,
            d_head=8,
            d_vocab=V,
            n_ctx=32,
            attn_only=False,
            d_mlp=32,
            act_fn="gelu_new",
            normalization_type="LN",
            positional_embedding_type="standard",
            use_bias=True,
        ),
        tok,
        seed=5,
    )
    save_qkov(
        root / "llamaish",
        ModelConfig(
            n_layers=2,
            d_model=16,
            n_heads=4,
            d_head=4,
            d_vocab=V,
            n_ctx=32,
            attn_only=False,
            d_mlp=24,
            act_fn="silu",
            gated_mlp=True,
            n_key_value_heads=2,
            normalization_type="RMS",
            positional_embedding_type="rotary",
        ),
        tok,
        seed=6,
    )
    return root


@pytest.fixture(scope="module")
def rclient(folders: Path) -> Iterator[TestClient]:
    settings = Settings(shipped_dir=folders, models_dir=folders / "none", dtype="float64", limits=LIMITS)
    with TestClient(create_app(settings)) as c:
        yield c


def _served(folders: Path, name: str) -> LoadedModel:
    return load_checkpoint(folders / name, dtype=torch.float64)


def _check_scores(body: dict, model) -> int:  # type: ignore[no-untyped-def]
    checked = 0
    for i, w in enumerate(body["writers"]):
        for j, r in enumerate(body["readers"]):
            got = body["scores"][i][j]
            writer, reader = sc.parse_writer(model, w), sc.parse_reader(model, r)
            if not sc.reaches(model, writer, reader):
                assert got is None and body["minus_baseline"][i][j] is None
                continue
            W, R = dense_writer(model, writer), dense_reader(model, reader)
            assert got == pytest.approx(float((W @ R).norm() / (W.norm() * R.norm())), rel=1e-9)
            assert body["minus_baseline"][i][j] == pytest.approx(got - body["baseline"], abs=1e-12)
            checked += 1
    return checked


@pytest.mark.parametrize("name", ["gpt2ish", "llamaish"])
def test_every_cell_is_the_dense_score(rclient: TestClient, folders: Path, name: str) -> None:
    model = _served(folders, name).model
    body = rclient.get(f"/api/v1/models/{name}/residual").json()
    assert body["baseline"] == pytest.approx(model.cfg.d_model**-0.5)
    assert _check_scores(body, model) > 50
    readers = body["readers"]
    if name == "llamaish":
        assert "L0.mlp.gate" in readers and "L0.mlp.up" in readers and "pos" not in body["writers"]
    else:
        assert "L0.mlp.in" in readers and body["writers"][:2] == ["embed", "pos"] and "unembed" == readers[-1]


def test_shortformer_toy_positions_reach_only_queries_and_keys(client: TestClient, tiny: LoadedModel) -> None:
    body = client.get("/api/v1/models/tiny-2l/residual").json()
    pos = body["writers"].index("pos")
    for j, r in enumerate(body["readers"]):
        assert (body["scores"][pos][j] is not None) == r.endswith((".Q", ".K"))
    assert _check_scores(body, tiny.model) > 20
    assert "no norm between layers" in body["ignored"]


def test_rotary_offset_changes_query_key_cells_only(rclient: TestClient, folders: Path) -> None:
    model = _served(folders, "llamaish").model
    at0 = rclient.get("/api/v1/models/llamaish/residual").json()
    at5 = rclient.get("/api/v1/models/llamaish/residual", params={"offset": 5}).json()
    j = at0["readers"].index("L1H2.Q")
    i = at0["writers"].index("L0H1")
    assert at5["scores"][i][j] != pytest.approx(at0["scores"][i][j], rel=1e-6)
    W = dense_writer(model, sc.Writer("head", 0, 1))
    R = dense_reader(model, sc.Reader("Q", 1, 2), offset=5)
    assert at5["scores"][i][j] == pytest.approx(float((W @ R).norm() / (W.norm() * R.norm())), rel=1e-9)
    v = at0["readers"].index("L1H2.V")
    assert at5["scores"][i][v] == at0["scores"][i][v]
    assert_problem(rclient.get("/api/v1/models/gpt2ish/residual", params={"offset": 2}), 422, "rotary")
    assert_problem(rclient.get("/api/v1/models/llamaish/residual", params={"offset": 99}), 422, "offset")


def test_pair_answer_is_the_dense_virtual_weight(rclient: TestClient, folders: Path) -> None:
    loaded = _served(folders, "gpt2ish")
    model = loaded.model
    body = rclient.get("/api/v1/models/gpt2ish/residual/embed/unembed", params={"k": 3, "n_top": 4}).json()
    dense = dense_writer(model, sc.Writer("embed")) @ model.unembed.W_U
    U, S, Vh = torch.linalg.svd(dense)
    assert body["input_space"] == body["output_space"] == "tokens"
    assert body["singular_values"][:5] == pytest.approx(S[:5].tolist(), rel=1e-8)
    first = body["directions"][0]
    sign = 1.0 if U[first["input_top"][0]["index"], 0] > 0 else -1.0
    assert [e["index"] for e in first["input_top"]] == (sign * U[:, 0]).topk(4).indices.tolist()
    assert [e["index"] for e in first["output_top"]] == (sign * Vh[0]).topk(4).indices.tolist()
    assert first["input_top"][0]["token"]["text"] == loaded.tokenizer.decode([first["input_top"][0]["index"]])
    pair = rclient.get("/api/v1/models/gpt2ish/residual/L0H1/L1H0.K").json()
    assert pair["links"]["composition pair"] == "/models/gpt2ish/composition/L0H1/L1H0"
    assert pair["input_space"] == "d_model" and pair["directions"][0]["input_top"] is None
    neurons = rclient.get("/api/v1/models/gpt2ish/residual/L0.mlp[2,7]/unembed", params={"k": 1, "n_top": 2}).json()
    assert {e["index"] for e in neurons["directions"][0]["input_top"]} <= {2, 7}


@pytest.mark.parametrize(
    "path,status,needle",
    [
        ("residual/L1H0/L0H0.Q", 422, "does not read"),
        ("residual/L9H0/unembed", 404, "layers"),
        ("residual/embed/L0H0.X", 422, "reader"),
        ("residual/L0.mlp/L1.mlp.gate", 404, "MLP inputs"),
        ("residual/embed/unembed?k=0", 422, "k"),
        ("residual/usage?energy=0", 422, "energy"),
    ],
)
def test_refusals(rclient: TestClient, path: str, status: int, needle: str) -> None:
    assert_problem(rclient.get(f"/api/v1/models/gpt2ish/{path}"), status, needle)


def test_usage_ranks_and_overlaps_from_dense_singular_values(rclient: TestClient, folders: Path) -> None:
    model = _served(folders, "gpt2ish").model
    body = rclient.get("/api/v1/models/gpt2ish/residual/usage", params={"energy": 0.8}).json()
    for name in ("embed", "L0H1", "L1.mlp"):
        s2 = torch.linalg.svdvals(dense_writer(model, sc.parse_writer(model, name))).pow(2)
        assert body["effective_rank"][name] == pytest.approx(float(s2.sum() ** 2 / s2.pow(2).sum()), rel=1e-8)
        k = int((s2.cumsum(0) / s2.sum() < 0.8 - 1e-12).sum()) + 1
        assert body["dims"][name] == k
    n = len(body["writers"])
    assert all(body["overlap"][i][i] == pytest.approx(1.0) for i in range(n))
    assert body["total_dims"] == sum(body["dims"][w] for w in body["writers"])
    assert sum(body["load"]) == pytest.approx(body["total_dims"])
    assert body["erasure_max_z"] is not None and body["erasure_threshold_z"] == 5.0


def test_usage_pages_of_rows_make_up_the_whole_table(rclient: TestClient) -> None:
    """The overlap tables come a page of writer rows at a time (writers_from, writers_shown): the pages, followed by
    next_writers_from, are the rows of one answer holding every row, and each says which rows it holds."""
    url = "/api/v1/models/gpt2ish/residual/usage"
    whole = rclient.get(url, params={"energy": 0.8, "writers_shown": 4096}).json()
    n = len(whole["writers"])
    assert whole["rows"] == whole["writers"] and whole["next_writers_from"] is None and n > 3
    rows, overlap, excess, start = [], [], [], 0
    while start is not None:
        page = rclient.get(url, params={"energy": 0.8, "writers_shown": 3, "writers_from": start}).json()
        assert len(page["rows"]) == min(3, n - start) and f"{start + 1}-" in page["page"]
        rows += page["rows"]
        overlap += page["overlap"]
        excess += page["overlap_excess"]
        start = page["next_writers_from"]
    assert rows == whole["writers"] and overlap == whole["overlap"] and excess == whole["overlap_excess"]
    assert_problem(rclient.get(url, params={"writers_from": n}), 422, "writers_from", f"{n} writers")


def test_pages_and_json_twins(rclient: TestClient) -> None:
    page = rclient.get("/models/gpt2ish/residual")
    assert page.status_code == 200 and "data-plotly" in page.text
    assert 'href="/api/v1/models/gpt2ish/residual?offset=0&amp;basis=served"' in page.text
    assert "LayerNorm between layers is ignored" in page.text and "folded" in page.text
    assert "/models/gpt2ish/residual/L0H0/L1H1.Q" in page.text  # a cell's link to its virtual weight
    assert 'hx-get="/models/gpt2ish/residual/usage"' in page.text
    usage = rclient.get("/models/gpt2ish/residual/usage", headers={"HX-Request": "true"})
    assert usage.status_code == 200 and 'id="bandwidth"' in usage.text and "<html" not in usage.text
    pair = rclient.get("/models/gpt2ish/residual/embed/L1H0.V")
    assert pair.status_code == 200 and 'class="tok"' in pair.text and "/models/gpt2ish/heads/L1H0" in pair.text
    assert 'href="/api/v1/models/gpt2ish/residual/embed/L1H0.V' in pair.text
    assert rclient.get("/models/gpt2ish/residual/L1H0/L0H0.Q").status_code == 422
    llama = rclient.get("/models/llamaish/residual", params={"offset": 3})
    assert llama.status_code == 200 and "RMSNorm between layers is ignored" in llama.text and "offset 3" in llama.text


@pytest.mark.parametrize("query", [{}, {"token": "5", "k": "6"}, {"mlp": "L0.mlp", "basis": "raw"}], ids=str)
def test_expert_table_snippet(rclient: TestClient, query: dict[str, str]) -> None:
    """The expert page's "copy as Python" on a dense MLP writer, run as a notebook would, gives the entries and
    router weights of its JSON twin."""
    from tests.app.test_snippets import json_twin, run, same, snippets_in

    page = rclient.get("/models/gpt2ish/expert-ov", params=query)
    assert page.status_code == 200, page.text
    result = run(snippets_in(page.text)["expert-ov-python"])
    answer = rclient.get(json_twin(page.text, "expert-ov", "gpt2ish")).json()
    assert result["entries"] and set(result) <= set(answer)
    same(result, answer)
