"""The copying overview (API + page) on the shipped toy-1l against dense float64 [V, V] circuits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.weights import load_checkpoint

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
        assert row["topk"] == pytest.approx(float((M.topk(5, dim=1).indices == own[:, None]).any(1).double().mean()), abs=1e-9)
        assert row["diagonal_positive"] == pytest.approx(float((M.diagonal() > 0).double().mean()), abs=1e-9)
        eig = torch.linalg.eigvals(m.W_V[0, h] @ m.W_O[0, h] @ m.W_U @ m.W_E)
        eig = eig[eig.abs().argsort(descending=True)[:16]]
        assert row["ov_copying"] == pytest.approx(float(eig.sum().real / eig.abs().sum()), abs=1e-4)
    base = body["baseline"]
    assert base["n_samples"] == 20 and -1 <= base["ov_copying_min"] <= base["ov_copying_mean"] <= base["ov_copying_max"] <= 1


def test_copying_page_and_refusals(client):
    page = client.get("/models/toy-1l/copying", params={"samples": 10})
    assert page.status_code == 200 and 'id="copying-table"' in page.text and "random weights" in page.text
    assert client.get("/api/v1/models/toy-0l/copying").status_code == 422  # no attention layer
    assert client.get("/api/v1/models/toy-1l/copying", params={"samples": 1}).status_code == 422
