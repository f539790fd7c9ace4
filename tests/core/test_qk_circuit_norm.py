"""QK circuit norm per head (circuits_core/circuits/qk_circuit_norm.py) against the dense float64 product
||W_Q[h] W_K[g]^T||_F, formed d_model x d_model head by head, on toy-2l and on a grouped-query random model."""

from __future__ import annotations

from pathlib import Path

import torch

from circuits_core.circuits import qk_circuit_norm
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, random_model

TOY_2L = Path(__file__).resolve().parents[2] / "checkpoints" / "toy-2l"


def dense_norms(model: Transformer, n_kv: int) -> torch.Tensor:
    """[L, H]: the Frobenius norm of the formed [d_model, d_model] W_Q[h] W_K[g]^T, g = h * n_kv // n_heads."""
    cfg = model.cfg
    W_K = model.W_K_groups.double()  # [L, n_kv, d_model, d_head] as stored
    out = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)
    for layer in range(cfg.n_layers):
        for h in range(cfg.n_heads):
            W_QK = model.W_Q[layer, h].double() @ W_K[layer, h * n_kv // cfg.n_heads].T  # [d_model, d_model]
            out[layer, h] = torch.linalg.matrix_norm(W_QK, "fro")
    return out


def test_toy_2l_matches_the_dense_product() -> None:
    model = load_checkpoint(TOY_2L, dtype=torch.float64).model
    norms = qk_circuit_norm.qk_circuit_norms(model)
    assert norms.shape == (2, 8) and norms.dtype == torch.float64
    torch.testing.assert_close(norms, dense_norms(model, model.cfg.n_heads), rtol=1e-12, atol=0)
    assert float(norms.std()) > 0.01 * float(norms.mean())  # the heads differ


def test_grouped_query_model_reads_each_heads_group() -> None:
    cfg = ModelConfig(
        n_layers=2,
        n_heads=6,
        n_key_value_heads=2,
        d_model=24,
        d_head=8,
        d_vocab=40,
        n_ctx=16,
        attn_only=True,
    )
    model = random_model(cfg, seed=5, dtype=torch.float64)
    norms = qk_circuit_norm.qk_circuit_norms(model)
    torch.testing.assert_close(norms, dense_norms(model, 2), rtol=1e-12, atol=0)
    # heads of one group share W_K but not W_Q, so their norms differ; a wrong group gives different norms
    assert not torch.allclose(norms[:, 0], norms[:, 1])


def test_cost_grows_with_the_model() -> None:
    small = ModelConfig(n_layers=1, n_heads=4, d_model=32, d_head=8, d_vocab=50, n_ctx=16, attn_only=True)
    big = ModelConfig(n_layers=4, n_heads=8, d_model=128, d_head=16, d_vocab=50, n_ctx=16, attn_only=True)
    c_small = qk_circuit_norm.cost(random_model(small))
    c_big = qk_circuit_norm.cost(random_model(big))
    assert c_big.peak_bytes > c_small.peak_bytes and c_big.flops > c_small.flops
    assert c_big.answer_bytes > c_small.answer_bytes
    assert c_big.peak_bytes >= 2 * 8 * 128 * 16 * 8  # one layer's W_Q and W_K in float64
