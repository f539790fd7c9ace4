"""The copying overview (API + page) on the shipped toy-1l against dense float64 [V, V] circuits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.formats.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"


@pytest.fixture(scope="module")
def client():
    torch.set_num_threads(1)
    with TestClient(create_app(Settings(store_url="off"))) as c:
        yield c


def test_copying_overview_equals_dense(client):
    body = client.get("/api/v1/models/toy-1l/copying", params={"k": 5, "min_count": 50, "samples": 20}).json()
    m = load_checkpoint(ROOT / "toy-1l", dtype=torch.float64, process=False).model
    counts = torch.from_numpy(__import__("numpy").load(ROOT / "toy-1l" / "token_counts.npy"))
    vocab = (counts >= 50).nonzero().squeeze(1)
    assert body["n_tokens"] == len(vocab) and body["basis"] == "raw weights, as stored" and len(body["heads"]) == 8
    own = torch.arange(len(vocab))
    for h, row in enumerate(body["heads"]):
        M = (m.W_E @ m.W_V[0, h] @ m.W_O[0, h] @ m.W_U)[vocab][:, vocab]
        assert row["head"] == f"L0H{h}"
        assert row["top1"] == pytest.approx(float((M.argmax(1) == own).double().mean()), abs=1e-9)
        assert row["topk"] == pytest.approx(
            float((M.topk(5, dim=1).indices == own[:, None]).any(1).double().mean()), abs=1e-9
        )
        assert row["diagonal_positive"] == pytest.approx(float((M.diagonal() > 0).double().mean()), abs=1e-9)
        eig = torch.linalg.eigvals(m.W_V[0, h] @ m.W_O[0, h] @ m.W_U @ m.W_E)
        eig = eig[eig.abs().argsort(descending=True)[:16]]
        assert row["ov_copying"] == pytest.approx(float(eig.sum().real / eig.abs().sum()), abs=1e-4)
    base = body["baseline"]
    assert (
        base["n_samples"] == 20
        and -1 <= base["ov_copying_min"] <= base["ov_copying_mean"] <= base["ov_copying_max"] <= 1
    )


def test_copying_page_and_refusals(client):
    page = client.get("/models/toy-1l/copying", params={"samples": 10})
    assert page.status_code == 200 and 'id="copying-table"' in page.text and "random weights" in page.text
    assert client.get("/api/v1/models/toy-0l/copying").status_code == 422  # no attention layer
    assert client.get("/api/v1/models/toy-1l/copying", params={"samples": 1}).status_code == 422


def sampled_rows_dense(M: torch.Tensor, n_rows: int, seed: int, k: int) -> tuple[float, float, float]:
    """top-1, top-k and diagonal > 0 shares over the documented sample: torch.randperm(n,
    manual_seed(seed))[:n_rows]."""
    picked = torch.randperm(M.shape[0], generator=torch.Generator().manual_seed(seed))[:n_rows]
    rows = M[picked]
    top = rows.topk(k, dim=1).indices
    return (
        float((top[:, 0] == picked).double().mean()),
        float((top == picked[:, None]).any(1).double().mean()),
        float((rows[torch.arange(n_rows), picked] > 0).double().mean()),
    )


def test_one_head_on_sampled_rows_equals_dense(client):
    """The head page's panel: heads=one head, rows=a sample; each sampled row ranked against the whole vocabulary."""
    body = client.get(
        "/api/v1/models/toy-1l/copying", params={"k": 10, "heads": "L00H3", "rows": 300, "samples": 10}
    ).json()
    m = load_checkpoint(ROOT / "toy-1l", dtype=torch.float64, process=False).model
    M = m.W_E @ m.W_V[0, 3] @ m.W_O[0, 3] @ m.W_U  # [V, V]
    (row,) = body["heads"]
    assert row["head"] == "L0H3" and body["n_rows"] == 300 and body["n_tokens"] == m.cfg.d_vocab
    top1, topk, diag = sampled_rows_dense(M, 300, 0, 10)
    assert [row["top1"], row["topk"], row["diagonal_positive"]] == pytest.approx([top1, topk, diag], abs=1e-9)
    n = m.cfg.d_vocab
    assert 0 < topk < 1  # so the standard error below is not 0 by default
    assert row["topk_stderr"] == pytest.approx((topk * (1 - topk) / 300 * (n - 300) / (n - 1)) ** 0.5, rel=1e-9)
    assert "300 of the 4096 tokens as sources, drawn at random (seed 0)" in body["sample"]
    full = client.get("/api/v1/models/toy-1l/copying", params={"heads": "L0H3", "samples": 10}).json()
    assert (
        full["n_rows"] == 4096
        and full["heads"][0]["top1_stderr"] == 0
        and full["sample"].startswith("every one of the 4096")
    )


def test_big_vocabularies_are_sampled_by_default(tmp_path):
    """Over FULL_ROWS_MAX tokens the default measures a sample of rows (MAX_ROWS for one head; the answer says so),
    against dense rows."""
    from app.views.copying import FULL_ROWS_MAX, MAX_ROWS
    from circuits_core.model.config import ModelConfig
    from tests.app.conftest import save_qkov, train_tokenizer

    V = FULL_ROWS_MAX + 100
    cfg = ModelConfig(
        n_layers=1, d_model=8, n_heads=1, d_head=4, d_vocab=V, n_ctx=16, positional_embedding_type="shortformer"
    )
    save_qkov(tmp_path / "wide", cfg, train_tokenizer(), seed=3)
    with TestClient(create_app(Settings(shipped_dir=tmp_path, dtype="float64", store_url="off"))) as c:
        body = c.get("/api/v1/models/wide/copying", params={"k": 3, "samples": 4}).json()
    m = load_checkpoint(tmp_path / "wide", dtype=torch.float64).model
    M = m.W_E @ m.W_V[0, 0] @ m.W_O[0, 0] @ m.W_U
    assert body["n_rows"] == MAX_ROWS and body["n_tokens"] == V and f"{MAX_ROWS} of the {V} tokens" in body["sample"]
    row = body["heads"][0]
    assert [row["top1"], row["topk"], row["diagonal_positive"]] == pytest.approx(
        list(sampled_rows_dense(M, MAX_ROWS, 0, 3)), abs=1e-12
    )


def test_overview_and_head_pages_load_the_copying_panel(client):
    """The overview and head pages load /copying as a panel of its own (hx-get on load, never inside /heads); the
    fragment htmx receives holds the table whose cells are the API's numbers."""
    over = client.get("/models/toy-1l").text
    assert 'hx-get="/models/toy-1l/copying"' in over and 'hx-select="#copying"' in over and 'id="copying-lazy"' in over
    head = client.get("/models/toy-1l/heads/L0H3").text
    assert 'hx-get="/models/toy-1l/copying?heads=L0H3"' in head
    frag = client.get("/models/toy-1l/copying", params={"heads": "L0H3"}, headers={"HX-Request": "true"}).text
    api = client.get("/api/v1/models/toy-1l/copying", params={"heads": "L0H3"}).json()
    assert 'id="copying"' in frag and api["sample"] in frag
    row = api["heads"][0]
    for key in ("ov_copying", "top1", "topk", "diagonal_positive", "diagonal_median"):
        assert f'data-value="{row[key]}"' in frag, key
    assert 'id="copying-lazy"' not in client.get("/models/toy-0l").text  # no heads, no panel
