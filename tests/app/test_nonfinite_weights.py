"""A checkpoint with NaN and inf weights: it loads, its model page warns and names the tensors, and every analysis of
the API (and the pages that failed on it: head, residual usage, copying) either answers or refuses with a 422 that names
a non-finite tensor; none gives a 5xx (linalg.svd's convergence error was a 500 on /heads/{head}, /residual/usage and
/copying)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from app.main import create_app
from app.settings import Settings
from circuits_core.model.config import ModelConfig
from tests.app.conftest import LIMITS, save_qkov, train_tokenizer

API = "/api/v1/models/nan"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    root = tmp_path_factory.mktemp("nonfinite")
    cfg = ModelConfig(
        n_layers=2, d_model=32, n_heads=4, d_head=8, d_vocab=320, n_ctx=64, attn_only=False, d_mlp=64, act_fn="gelu"
    )
    save_qkov(root / "user" / "nan", cfg, train_tokenizer(), seed=5)
    path = root / "user" / "nan" / "model.safetensors"
    state = load_file(str(path))
    state["blocks.0.attn.W_V"][1, 3, 2] = float("nan")
    state["blocks.1.mlp.W_out"][5, 7] = float("inf")
    save_file(state, str(path))
    (root / "shipped").mkdir()
    settings = Settings(shipped_dir=root / "shipped", models_dir=root / "user", dtype="float32", limits=LIMITS)
    with TestClient(create_app(settings)) as c:
        yield c


def _paths(client: TestClient) -> list[str]:
    """Every GET path of the model API with its path parameters filled in (a head, a writer, a reader)."""
    fill = {"model": "nan", "head": "L1H0", "source": "L0H1", "target": "L1H0", "writer": "L0H1", "reader": "L1H0.K"}
    out = []
    for path, ops in client.get("/openapi.json").json()["paths"].items():
        if "get" not in ops or not path.startswith("/api/v1/models/{model}"):
            continue
        names = re.findall(r"{(\w+)}", path)
        if all(n in fill for n in names):
            out.append(path.format(**fill))
    return out


def test_the_model_page_warns_and_names_the_tensors(client):
    summary = client.get(API).json()
    assert summary["nonfinite_weights"] == [
        "blocks.0.attn.W_V (1 NaN, 0 inf of 1024)",
        "blocks.1.mlp.W_out (0 NaN, 1 inf of 2048)",
    ]
    page = client.get("/models/nan").text
    assert "non-finite weights" in page and "blocks.0.attn.W_V" in page and "blocks.1.mlp.W_out" in page


def test_no_analysis_gives_a_5xx(client):
    paths = _paths(client)
    assert {f"{API}/heads/L1H0", f"{API}/residual/usage", f"{API}/copying"} <= set(paths)
    refused = []
    for path in paths:
        r = client.get(path)
        assert r.status_code < 500, (path, r.status_code, r.text[:300])
        if r.status_code == 422 and "non-finite" in r.text:
            assert "blocks.0.attn.W_V" in r.json()["detail"]
            refused.append(path)
    assert f"{API}/heads/L1H0" in refused or client.get(f"{API}/heads/L1H0").status_code == 200


@pytest.mark.parametrize("page", ["/models/nan/heads/L1H0", "/models/nan/residual/usage", "/models/nan/copying"])
def test_pages_do_not_give_a_5xx(client, page):
    assert client.get(page).status_code < 500
