"""Direct path with its corpus column: model probabilities and held-out bigram statistics on toy-0l,
against a dense float64 softmax and counts taken straight from checkpoints/eval_data.npz."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.formats.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"


@pytest.fixture(scope="module")
def conf_client(settings):
    """The conftest app (tiny models, float64)."""
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def client():
    torch.set_num_threads(1)
    with TestClient(create_app(Settings(store_url="off"))) as c:
        yield c


@pytest.mark.parametrize("params", [{"k": 8, "min_count": 50}, {"token": " self", "k": 8}])
def test_direct_entries_carry_model_and_held_out_probabilities(client, params):
    body = client.get("/api/v1/models/toy-0l/direct", params=params).json()
    m = load_checkpoint(ROOT / "toy-0l", dtype=torch.float64, process=False).model
    data = np.load(ROOT / "eval_data.npz")
    val, eot = data["val"].astype(np.int64), int(data["eot"])
    a, b = val[:-1], val[1:]
    assert body["basis"] == "raw weights, as stored" and body["corpus"].startswith("held-out")
    for e in body["entries"]:
        x, y = e["row"]["id"], e["col"]["id"]
        probs = torch.softmax(m.W_E[x] @ m.W_U, -1)
        assert e["prob"] == pytest.approx(float(probs[y]), abs=1e-6)
        rows = int(((a == x) & (a != eot)).sum())
        count = int(((a == x) & (b == y) & (a != eot)).sum())
        assert e["corpus_count"] == count
        assert e["corpus_prob"] == (pytest.approx(count / rows, abs=1e-12) if rows else None)
    page = client.get("/models/toy-0l/direct", params=params)
    assert page.status_code == 200 and "held-out P(next | current)" in page.text and "Basis: raw weights" in page.text


def test_ov_view_names_its_basis(client):
    assert (
        client.get("/api/v1/models/toy-1l/heads/L0H0/ov", params={"k": 3}).json()["basis"] == "raw weights, as stored"
    )
    page = client.get("/models/toy-1l/heads/L0H0", params={"k": 3})
    assert "Basis: raw weights, as stored" in page.text and "/models/toy-1l/copying" in page.text


def test_raw_basis_on_a_processed_model(conf_client, model_dirs):
    """tiny-ln is served processed (LayerNorm folded, writers and W_U centred); basis=raw serves the stored weights:
    its OV entries equal a dense float64 LN(W_E) W_V W_O W_U from the raw checkpoint, and the two bases differ."""
    url = "/api/v1/models/tiny-ln/heads/L0H1/ov"
    served = conf_client.get(url, params={"k": 5}).json()
    raw = conf_client.get(url, params={"k": 5, "basis": "raw"}).json()
    assert served["basis"].startswith("processed weights") and "unembedding centred" in served["basis"]
    assert raw["basis"] == "raw weights, as stored"
    m = load_checkpoint(model_dirs[1] / "tiny-ln", dtype=torch.float64, process=False).model
    ln = m.blocks[0].ln1
    x = m.W_E - m.W_E.mean(-1, keepdim=True)
    E = x / (x.pow(2).mean(-1, keepdim=True) + m.cfg.eps).sqrt() * ln.w + ln.b  # LN of each W_E row
    M = E @ m.W_V[0, 1] @ m.W_O[0, 1] @ m.W_U  # [V, V]
    assert [e["value"] for e in raw["entries"]] == pytest.approx(M.flatten().topk(5).values.tolist(), abs=1e-9)
    assert [e["value"] for e in raw["entries"]] != pytest.approx([e["value"] for e in served["entries"]], abs=1e-6)
    assert conf_client.get(url, params={"basis": "stored"}).status_code == 422
