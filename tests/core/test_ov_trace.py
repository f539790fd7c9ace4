"""OV trace per head (circuits_core/circuits/ov_trace.py) against the dense float64 trace and Frobenius norm of the
formed d_model x d_model W_V[g] W_O[h], on toy-2l, on a grouped-query model and on a Gemma-3-shaped model (output-norm
gain, multi-query); and on heads planted with a known answer (docs/maths.md §5.12)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from circuits_core.circuits import ov_trace
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Block, Transformer, random_model
from tests.core.formed_circuits import assert_priced_within_twice_the_held_peak, per_head_of_formed_ov
from tests.core.rotary_models import CASES, rotary_model

TOY_2L = Path(__file__).resolve().parents[2] / "checkpoints" / "toy-2l"
GQA = ModelConfig(
    n_layers=2, n_heads=6, n_key_value_heads=2, d_model=24, d_head=8, d_vocab=40, n_ctx=16, attn_only=True
)


def dense_traces(model: Transformer) -> torch.Tensor:
    """[L, H]: trace / Frobenius norm of the formed W_V[h * n_kv // H] W_O[h] (the output norm's gain, if any,
    multiplying W_O's columns)."""
    return per_head_of_formed_ov(model, lambda W_OV: torch.trace(W_OV) / torch.linalg.matrix_norm(W_OV, "fro"))


def test_toy_2l_matches_the_dense_circuit() -> None:
    model = load_checkpoint(TOY_2L, dtype=torch.float64).model
    traces = ov_trace.ov_traces(model)
    assert traces.shape == (2, 8) and traces.dtype == torch.float64
    torch.testing.assert_close(traces, dense_traces(model), rtol=1e-10, atol=1e-12)
    assert bool((traces.abs() <= math.sqrt(model.cfg.d_head)).all())  # the page's bound
    assert float(traces.std()) > 0.01 * float(traces.abs().mean())  # the heads differ


def test_grouped_query_model_reads_each_heads_group() -> None:
    model = random_model(GQA, seed=5, dtype=torch.float64)
    traces = ov_trace.ov_traces(model)
    torch.testing.assert_close(traces, dense_traces(model), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(traces[:, 0], traces[:, 1])  # heads of one group share W_V, not W_O


def test_output_norm_gain_is_folded_on_a_gemma3_shaped_model() -> None:
    model = rotary_model(**CASES["gemma3"])  # gamma_post random, one key/value head for 4 query heads
    torch.testing.assert_close(ov_trace.ov_traces(model), dense_traces(model), rtol=1e-10, atol=1e-12)


def test_planted_heads_give_their_known_ratio() -> None:
    """W_V = Q (orthonormal columns): W_O = Q^T is the projection onto Q's span, tr = d_head, ||.||_F = sqrt(d_head);
    W_O = -Q^T inverts it; W_O = Q2^T with Q2 orthogonal to Q has trace 0; a zero W_O gives 0, not NaN."""
    cfg = ModelConfig(n_layers=1, n_heads=4, d_model=20, d_head=5, d_vocab=30, n_ctx=8, attn_only=True)
    model = random_model(cfg, seed=1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)
    Q = torch.linalg.qr(torch.randn(20, 10, generator=gen, dtype=torch.float64))[0]  # [d_model, 2 d_head]
    Q1, Q2 = Q[:, :5], Q[:, 5:]
    block = model.blocks[0]
    assert isinstance(block, Block)
    attn = block.attn
    with torch.no_grad():
        for h, W_O in enumerate([Q1.T, -3 * Q1.T, Q2.T, torch.zeros(5, 20, dtype=torch.float64)]):
            attn.W_V[h].copy_(Q1)
            attn.W_O[h].copy_(W_O)
    expected = torch.tensor([math.sqrt(5), -math.sqrt(5), 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(ov_trace.ov_traces(model)[0], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_price_covers_the_measured_peak(dtype: torch.dtype) -> None:
    """The bytes ov_traces holds (tensors it makes, the model's weights excluded) stay within the price, and the price
    is not far above them."""
    for model in (random_model(GQA, seed=0, dtype=dtype), rotary_model(**CASES["gemma3"]).to(dtype)):
        assert_priced_within_twice_the_held_peak(model, ov_trace.ov_traces, ov_trace.cost)
