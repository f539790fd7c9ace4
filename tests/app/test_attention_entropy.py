"""Attention entropy per head (circuits_core/prompt/attention_entropy.py, declared in app/views/attention_entropy.py):
the engine against a brute-force loop over hook_pattern in float64, the API and the page against the same loop."""

from __future__ import annotations

import math

import pytest
import torch
from fastapi.testclient import TestClient

from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from circuits_core.prompt import attention_entropy
from tests.app.conftest import assert_problem


def brute_force(model, tokens: list[int]) -> list[list[list[float]]]:
    """[layer][head][i]: -sum_j p log p over the causal keys of hook_pattern, one Python float at a time."""
    _, cache = model.run(torch.tensor([tokens]), names=lambda n: n.endswith("hook_pattern"))
    out = []
    for layer in range(model.cfg.n_layers):
        A = cache[f"blocks.{layer}.attn.hook_pattern"][0].double().tolist()  # [H][n][n]
        out.append([[-sum(p * math.log(p) for p in row[: i + 1] if p > 0) for i, row in enumerate(head)] for head in A])
    return out


@pytest.mark.parametrize("positional", ["standard", "shortformer"])
def test_engine_matches_brute_force_float64(positional: str) -> None:
    cfg = ModelConfig(
        n_layers=2,
        n_heads=3,
        d_model=24,
        d_head=8,
        d_vocab=50,
        n_ctx=16,
        attn_only=True,
        positional_embedding_type=positional,
    )
    model = random_model(cfg, seed=3, dtype=torch.float64, std_embed=1.0)  # large embeddings: peaked and flat heads
    tokens = [0, 7, 3, 3, 41, 7, 3, 9, 12, 3]
    H = attention_entropy.head_entropies(model, torch.tensor(tokens))
    assert H.shape == (2, 3, len(tokens))
    torch.testing.assert_close(H, torch.tensor(brute_force(model, tokens), dtype=torch.float64), rtol=0, atol=1e-12)
    assert float(H.std()) > 0.05  # the heads differ: the comparison is not between constants


def test_uniform_and_one_hot_patterns() -> None:
    n = 6
    uniform = torch.tril(torch.ones(n, n, dtype=torch.float64))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    one_hot = torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(
        attention_entropy.entropy(uniform), torch.tensor([math.log(i + 1) for i in range(n)], dtype=torch.float64)
    )
    assert attention_entropy.entropy(one_hot).abs().max() == 0
    torch.testing.assert_close(
        attention_entropy.normalised(attention_entropy.entropy(uniform)), torch.ones(n - 1, dtype=torch.float64)
    )


def test_cost_grows_with_the_prompt_and_counts_the_patterns() -> None:
    cfg = ModelConfig(n_layers=2, n_heads=4, d_model=32, d_head=8, d_vocab=100, n_ctx=512, attn_only=True)
    model = random_model(cfg, dtype=torch.float32)
    small, big = attention_entropy.cost(model, 16), attention_entropy.cost(model, 256)
    assert big.peak_bytes > small.peak_bytes and big.answer_bytes > small.answer_bytes
    assert big.peak_bytes >= cfg.n_layers * cfg.n_heads * 256 * 256 * (
        4 + 8
    )  # the kept patterns and their float64 copies


def test_api_answer_is_the_brute_force_entropy(client: TestClient, tiny: LoadedModel) -> None:
    tokens = [0, 5, 9, 5, 9, 5, 9, 11]
    body = client.get("/api/v1/models/tiny-2l/attention-entropy", params={"tokens": ",".join(map(str, tokens))}).json()
    expected = brute_force(tiny.model, tokens)
    assert [t["id"] for t in body["tokens"]] == tokens and body["text_source"] == "tokens"
    for layer, heads in enumerate(expected):
        for h, per_pos in enumerate(heads):
            assert body["per_position"][layer][h] == pytest.approx(per_pos, abs=1e-12)
            assert body["mean"][layer][h] == pytest.approx(sum(per_pos) / len(per_pos), abs=1e-12)
            norm = [per_pos[i] / math.log(i + 1) for i in range(1, len(per_pos))]
            assert body["normalised"][layer][h] == pytest.approx(sum(norm) / len(norm), abs=1e-12)


def test_default_text_page_and_refusals(client: TestClient) -> None:
    api = client.get("/api/v1/models/tiny-2l/attention-entropy").json()
    assert api["text_source"] in ("card", "builtin") and len(api["tokens"]) >= 2
    page = client.get("/models/tiny-2l/attention-entropy", params={"prompt": "def add(self"})
    assert (
        page.status_code == 200 and 'href="/api/v1/models/tiny-2l/attention-entropy?prompt=def+add%28self"' in page.text
    )
    assert 'href="/models/tiny-2l/heads/L1H0"' in page.text and "data-plotly" in page.text
    assert 'href="/models/tiny-2l/attention-entropy"' in client.get("/models/tiny-2l").text  # in the model's navigation
    assert_problem(client.get("/api/v1/models/tiny-2l/attention-entropy", params={"tokens": "1,x"}), 422, "tokens")
    assert_problem(
        client.get("/api/v1/models/tiny-2l/attention-entropy", params={"prompt": "a", "tokens": "1"}),
        422,
        "exactly one",
    )
    assert client.get("/models/tiny-2l/attention-entropy", params={"tokens": "1,x"}).status_code == 422
