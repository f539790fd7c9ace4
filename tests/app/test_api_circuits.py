"""API: OV / QK / direct-path top entries and skip-trigrams against dense float64 circuits of the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.prompt.phenomena import load_token_counts
from tests.app.conftest import assert_problem
from tests.app.test_api_heads import full_ov_dense, full_qk_dense


def _check_entries(body: dict, M: torch.Tensor, k: int, row: int | None = None) -> None:
    """The entries are the k largest of M (or of its row `row`), each at the position it claims."""
    values = [e["value"] for e in body["entries"]]
    assert len(values) == k and values == sorted(values, reverse=True)
    searched = M if row is None else M[row]
    assert values == pytest.approx(searched.flatten().topk(k).values.tolist(), abs=1e-9)
    for e in body["entries"]:
        assert e["value"] == pytest.approx(float(M[e["row"]["id"], e["col"]["id"]]), abs=1e-9)


def test_ov_row_and_global(client: TestClient, tiny: LoadedModel) -> None:
    M = full_ov_dense(tiny.model, 1, 0)
    tok = tiny.tokenizer
    t = tok.lookup(" cat") if len(tok.encode(" cat", prepend_bos=False)) == 1 else 300
    body = client.get("/api/v1/models/tiny-2l/heads/L1H0/ov", params={"token": str(t), "k": 7}).json()
    assert body["circuit"] == "ov" and body["side"] == "row" and body["token"]["id"] == t
    _check_entries(body, M, 7, row=t)
    assert all(e["row"]["id"] == t for e in body["entries"])
    assert (
        body["diagonal"] == pytest.approx(float(M[t, t])) and body["diagonal_rank"] == int((M[t] > M[t, t]).sum()) + 1
    )
    glob = client.get("/api/v1/models/tiny-2l/heads/L1H0/ov", params={"k": 30}).json()
    assert glob["token"] is None
    _check_entries(glob, M, 30)


def test_qk_query_and_key_sides(client: TestClient, tiny: LoadedModel) -> None:
    M = full_qk_dense(tiny.model, 0, 3)
    q = client.get("/api/v1/models/tiny-2l/heads/L0H3/qk", params={"token": "12", "k": 5}).json()
    _check_entries(q, M, 5, row=12)
    key = client.get("/api/v1/models/tiny-2l/heads/L0H3/qk", params={"token": "12", "k": 5, "side": "key"}).json()
    assert key["side"] == "column" and all(e["col"]["id"] == 12 for e in key["entries"])
    assert [e["value"] for e in key["entries"]] == pytest.approx(M[:, 12].topk(5).values.tolist(), abs=1e-9)
    _check_entries(client.get("/api/v1/models/tiny-2l/heads/L0H3/qk", params={"k": 9}).json(), M, 9)
    assert_problem(client.get("/api/v1/models/tiny-2l/heads/L0H3/qk", params={"side": "both"}), 422, "side")


def test_direct_path_bigram_table(client: TestClient, tiny: LoadedModel) -> None:
    D = tiny.model.W_E @ tiny.model.W_U  # [V, V], no LayerNorm in tiny-2l
    bos = tiny.tokenizer.bos_token_id
    body = client.get("/api/v1/models/tiny-2l/direct", params={"token": str(bos), "k": 4}).json()
    assert body["head"] is None and body["row_label"] == "current token"
    _check_entries(body, D, 4, row=bos)
    _check_entries(client.get("/api/v1/models/tiny-2l/direct", params={"k": 50}).json(), D, 50)


def test_token_strings_resolve(client: TestClient, tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    single = next(i for i in range(257, tok.vocab_size) if len(tok.encode(tok.token_str(i), prepend_bos=False)) == 1)
    text = tok.token_str(single)
    body = client.get("/api/v1/models/tiny-2l/direct", params={"token": text, "k": 3}).json()
    assert body["token"] == {"id": single, "text": text}


def test_token_refusals(client: TestClient) -> None:
    url = "/api/v1/models/tiny-2l/heads/L0H0/ov"
    assert_problem(client.get(url, params={"token": "99999"}), 422, "99999", "vocabulary")
    assert_problem(client.get(url, params={"token": "the cat sat on"}), 422, "not a single token")
    assert_problem(client.get(url, params={"k": 0}), 422, "k")
    assert_problem(client.get(url, params={"k": 51}), 422, "less than or equal to 50")


def test_skip_trigrams(client: TestClient, tiny: LoadedModel) -> None:
    OV, QK = full_ov_dense(tiny.model, 0, 2), full_qk_dense(tiny.model, 0, 2)
    body = client.get("/api/v1/models/tiny-2l/heads/L0H2/skip-trigrams", params={"token": "40", "k": 6}).json()
    assert body["source"]["id"] == 40 and body["k"] == 6
    assert [d["value"] for d in body["destinations"]] == pytest.approx(QK[:, 40].topk(6).values.tolist(), abs=1e-9)
    assert [o["value"] for o in body["outs"]] == pytest.approx(OV[40].topk(6).values.tolist(), abs=1e-9)
    assert len(body["trigrams"]) == 6
    for tri in body["trigrams"]:
        b, c = tri["destination"]["id"], tri["out"]["id"]
        assert tri["qk"] == pytest.approx(float(QK[b, 40])) and tri["ov"] == pytest.approx(float(OV[40, c]))
        assert tri["joint"] == pytest.approx(tri["qk"] * tri["ov"])
    joints = [t["joint"] for t in body["trigrams"]]
    assert joints == sorted(joints, reverse=True)
    assert body["copying"] == (40 in OV[40].topk(6).indices.tolist())
    default = client.get("/api/v1/models/tiny-2l/heads/L0H2/skip-trigrams").json()
    assert default["source"]["id"] == int(OV.argmax()) // OV.shape[1]


MIN_COUNT = 500  # about half of tiny-2l's random counts in [0, 1000)


def _frequent(tiny: LoadedModel) -> torch.Tensor:
    counts = load_token_counts(tiny.path, tiny.model.cfg.d_vocab)
    assert counts is not None
    return torch.from_numpy(np.flatnonzero(counts >= MIN_COUNT))


def _masked(M: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """M with every entry outside keep x keep set to -inf (dense, float64: the reference)."""
    inside = torch.zeros_like(M, dtype=torch.bool)
    inside[keep[:, None], keep[None, :]] = True
    return M.masked_fill(~inside, float("-inf"))


def test_min_count_keeps_frequent_tokens_only(client: TestClient, tiny: LoadedModel) -> None:
    keep = _frequent(tiny)
    assert 0 < keep.numel() < tiny.model.cfg.d_vocab
    cases = [
        ("heads/L1H0/ov", {}, full_ov_dense(tiny.model, 1, 0)),
        ("heads/L0H3/qk", {}, full_qk_dense(tiny.model, 0, 3)),
        ("direct", {}, tiny.model.W_E @ tiny.model.W_U),
    ]
    for path, extra, M in cases:
        body = client.get(f"/api/v1/models/tiny-2l/{path}", params={"k": 25, "min_count": MIN_COUNT, **extra}).json()
        assert body["min_count"] == MIN_COUNT and body["n_tokens"] == keep.numel()
        _check_entries(body, _masked(M, keep), 25)
        plain = client.get(f"/api/v1/models/tiny-2l/{path}", params={"k": 25}).json()
        assert plain["min_count"] is None and plain["n_tokens"] is None  # default: every token
    # A token's row lists frequent tokens only; its rank counts only those above it.
    M = full_ov_dense(tiny.model, 1, 0)
    t = int(keep[3])
    body = client.get(
        "/api/v1/models/tiny-2l/heads/L1H0/ov", params={"token": str(t), "k": 6, "min_count": MIN_COUNT}
    ).json()
    ref = M[t, keep].topk(6)
    assert [e["col"]["id"] for e in body["entries"]] == keep[ref.indices].tolist()
    assert [e["value"] for e in body["entries"]] == pytest.approx(ref.values.tolist(), abs=1e-9)
    assert body["diagonal_rank"] == int((M[t, keep] > M[t, t]).sum()) + 1
    # Skip-trigrams: default source = row of the largest frequent OV entry; destinations and outs frequent.
    skip = client.get("/api/v1/models/tiny-2l/heads/L1H0/skip-trigrams", params={"k": 4, "min_count": MIN_COUNT}).json()
    masked = _masked(M, keep)
    assert skip["source"]["id"] == int(masked.flatten().argmax()) // M.shape[1]
    assert [o["token"]["id"] for o in skip["outs"]] == keep[M[skip["source"]["id"], keep].topk(4).indices].tolist()
    assert all(d["token"]["id"] in set(keep.tolist()) for d in skip["destinations"])


def test_min_count_refused_without_counts_or_frequent_tokens(client: TestClient) -> None:
    for path in ("heads/L0H1/ov", "heads/L0H1/qk", "heads/L0H1/skip-trigrams", "direct"):
        assert_problem(client.get(f"/api/v1/models/tiny-ln/{path}", params={"min_count": 5}), 422, "no token counts")
        assert client.get(f"/api/v1/models/tiny-ln/{path}").status_code == 200  # the default needs no counts
    assert_problem(client.get("/api/v1/models/tiny-2l/direct", params={"min_count": 10**6}), 422, "min_count=1000000")
    assert_problem(client.get("/api/v1/models/tiny-2l/direct", params={"min_count": 0}), 422, "min_count")
