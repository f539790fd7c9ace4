"""QK symmetry per head (circuits_core/circuits/qk_symmetry.py) against the dense float64 W_QK = W_Q[h] W_K[g]^T,
formed d_model x d_model head by head, on toy-2l, a grouped-query model and a Gemma-3-shaped model (QK-norm gains,
multi-query); heads planted symmetric, antisymmetric and zero; the price against the held peak (docs/maths.md §5.11)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from circuits_core.circuits import qk_symmetry
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Block, Transformer, random_model
from tests.core.rotary_models import CASES, rotary_model
from tests.held_bytes import HeldBytes

TOY_2L = Path(__file__).resolve().parents[2] / "checkpoints" / "toy-2l"
GQA = ModelConfig(
    n_layers=2, n_heads=6, n_key_value_heads=2, d_model=24, d_head=8, d_vocab=40, n_ctx=16, attn_only=True
)


def dense_symmetries(model: Transformer) -> torch.Tensor:
    """[L, H]: trace(W_QK @ W_QK) / ||W_QK||_F^2 of the formed W_QK, with S and A its symmetric and antisymmetric
    parts also checked: the same ratio is (|S|^2 - |A|^2) / (|S|^2 + |A|^2). QK-norm gains multiply W_Q's and W_K's
    columns (query head h's and key/value head g's gains)."""
    cfg = model.cfg
    out = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)
    for layer in range(cfg.n_layers):
        block = model.blocks[layer]
        assert isinstance(block, Block)
        W_K = block.attn.grouped("W_K").double()  # [n_kv, d_model, d_head] as stored
        for h in range(cfg.n_heads):
            g = h * cfg.n_kv_heads // cfg.n_heads
            W_Q_h, W_K_g = block.attn.W_Q[h].double(), W_K[g]
            if cfg.qk_norm is not None:
                W_Q_h, W_K_g = W_Q_h * block.attn.q_norm.gain()[h], W_K_g * block.attn.k_norm.gain()[g]
            W_QK = W_Q_h @ W_K_g.T  # [d_model, d_model]
            S, A = (W_QK + W_QK.T) / 2, (W_QK - W_QK.T) / 2
            s2, a2 = S.square().sum(), A.square().sum()
            ratio = torch.trace(W_QK @ W_QK) / W_QK.square().sum()
            torch.testing.assert_close(ratio, (s2 - a2) / (s2 + a2), rtol=1e-10, atol=1e-12)
            out[layer, h] = ratio
    return out


def test_toy_2l_matches_the_dense_product() -> None:
    model = load_checkpoint(TOY_2L, dtype=torch.float64).model
    s = qk_symmetry.qk_symmetries(model)
    assert s.shape == (2, 8) and s.dtype == torch.float64
    torch.testing.assert_close(s, dense_symmetries(model), rtol=1e-10, atol=1e-12)
    assert bool((s.abs() <= 1).all()) and float(s.std()) > 0.01  # in [-1, 1], and the heads differ


def test_grouped_query_model_reads_each_heads_group() -> None:
    model = random_model(GQA, seed=5, dtype=torch.float64)
    s = qk_symmetry.qk_symmetries(model)
    torch.testing.assert_close(s, dense_symmetries(model), rtol=1e-10, atol=1e-12)


def test_qk_norm_gains_are_folded_on_a_gemma3_shaped_model() -> None:
    model = rotary_model(**CASES["gemma3"])  # gamma_q, gamma_k random, one key/value head for 4 query heads
    s = qk_symmetry.qk_symmetries(model)
    torch.testing.assert_close(s, dense_symmetries(model), rtol=1e-10, atol=1e-12)


def test_planted_heads_give_their_symmetry() -> None:
    """W_K = W_Q: W_QK = W_Q W_Q^T, symmetric (1); W_Q = [e0, e1], W_K = [e1, -e0]: e0 e1^T - e1 e0^T, antisymmetric
    (-1); W_Q = [e0, 2 e2], W_K = [e1, e2]: e0 e1^T + 2 e2 e2^T, a known mix (0.8); a zero W_Q: 0, not NaN."""
    cfg = ModelConfig(n_layers=1, n_heads=4, d_model=10, d_head=3, d_vocab=30, n_ctx=8, attn_only=True)
    model = random_model(cfg, seed=1, dtype=torch.float64)
    attn = model.blocks[0].attn
    e = torch.eye(10, dtype=torch.float64)
    with torch.no_grad():
        attn.W_K[0].copy_(attn.W_Q[0])
        attn.W_Q[1].copy_(torch.stack([e[0], e[1], torch.zeros(10)], 1))
        attn.W_K[1].copy_(torch.stack([e[1], -e[0], torch.zeros(10)], 1))
        # W_QK = e0 e1^T + 2 e2 e2^T: |S|^2 = 1/2 + 4, |A|^2 = 1/2 -> (4.5 - 0.5) / 5 = 0.8
        attn.W_Q[2].copy_(torch.stack([e[0], 2 * e[2], torch.zeros(10)], 1))
        attn.W_K[2].copy_(torch.stack([e[1], e[2], torch.zeros(10)], 1))
        attn.W_Q[3].zero_()
    s = qk_symmetry.qk_symmetries(model)[0]
    torch.testing.assert_close(s, torch.tensor([1.0, -1.0, 0.8, 0.0], dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_price_covers_the_measured_peak(dtype: torch.dtype) -> None:
    """The bytes qk_symmetries holds (tensors it makes, the model's weights excluded) stay within the price, and the
    price is not far above them."""
    for model in (random_model(GQA, seed=0, dtype=dtype), rotary_model(**CASES["gemma3"]).to(dtype)):
        with torch.no_grad(), HeldBytes([*model.parameters(), *model.buffers()]) as held:
            qk_symmetry.qk_symmetries(model)
        priced = qk_symmetry.cost(model)
        assert 0 < held.peak <= priced.peak_bytes <= 2 * held.peak, (held.peak, priced.peak_bytes)
        cfg = model.cfg
        assert priced.flops >= cfg.n_layers * cfg.n_heads * 2 * cfg.d_model * cfg.d_head**2  # M = W_K^T W_Q
