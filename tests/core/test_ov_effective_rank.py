"""OV effective rank per head (circuits_core/circuits/ov_effective_rank.py) against a dense float64 SVD of the formed
d_model x d_model W_V[g] W_O[h], on toy-2l, on a grouped-query model and on a Gemma-3-shaped model (output-norm gain,
multi-query); and on heads planted with known singular values (docs/maths.md §5.9)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from circuits_core.circuits import ov_effective_rank
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, random_model
from tests.core.formed_circuits import assert_priced_within_twice_the_held_peak, per_head_of_formed_ov, plant_ov_spectra
from tests.core.rotary_models import CASES, rotary_model

TOY_2L = Path(__file__).resolve().parents[2] / "checkpoints" / "toy-2l"
GQA = ModelConfig(
    n_layers=2, n_heads=6, n_key_value_heads=2, d_model=24, d_head=8, d_vocab=40, n_ctx=16, attn_only=True
)


def participation_ratio(sigma: torch.Tensor) -> float:
    return float(sigma.pow(2).sum() ** 2 / sigma.pow(4).sum())


def dense_ranks(model: Transformer) -> torch.Tensor:
    """[L, H]: the participation ratio of all d_model singular values of the formed W_V[h * n_kv // H] W_O[h] (the
    output norm's gain, if any, multiplying W_O's columns)."""
    return per_head_of_formed_ov(model, lambda W_OV: participation_ratio(torch.linalg.svdvals(W_OV)))


def test_toy_2l_matches_the_dense_svd() -> None:
    model = load_checkpoint(TOY_2L, dtype=torch.float64).model
    ranks = ov_effective_rank.ov_effective_ranks(model)
    assert ranks.shape == (2, 8) and ranks.dtype == torch.float64
    torch.testing.assert_close(ranks, dense_ranks(model), rtol=1e-10, atol=0)
    assert bool((ranks >= 1).all() and (ranks <= model.cfg.d_head).all())  # the page's claim: 1 to d_head
    assert float(ranks.std()) > 0.01 * float(ranks.mean())  # the heads differ


def test_grouped_query_model_reads_each_heads_group() -> None:
    model = random_model(GQA, seed=5, dtype=torch.float64)
    ranks = ov_effective_rank.ov_effective_ranks(model)
    torch.testing.assert_close(ranks, dense_ranks(model), rtol=1e-10, atol=0)
    assert not torch.allclose(ranks[:, 0], ranks[:, 1])  # heads of one group share W_V, not W_O


def test_output_norm_gain_is_folded_on_a_gemma3_shaped_model() -> None:
    model = rotary_model(**CASES["gemma3"])  # gamma_post random, one key/value head for 4 query heads
    ranks = ov_effective_rank.ov_effective_ranks(model)
    torch.testing.assert_close(ranks, dense_ranks(model), rtol=1e-10, atol=0)


def test_planted_singular_values_give_their_ratio() -> None:
    """W_V = Q1, W_O = diag(s) Q2^T (Q1, Q2 orthonormal columns) has singular values s exactly."""
    cfg = ModelConfig(n_layers=1, n_heads=3, d_model=20, d_head=5, d_vocab=30, n_ctx=8, attn_only=True)
    model = random_model(cfg, seed=1, dtype=torch.float64)
    spectra = [torch.tensor([3.0, 0, 0, 0, 0]), torch.ones(5), torch.tensor([4.0, 2.0, 1.0, 0.5, 0.0])]
    plant_ov_spectra(model, spectra)
    attn = model.blocks[0].attn
    ranks = ov_effective_rank.ov_effective_ranks(model)[0]
    expected = [1.0, 5.0, (16 + 4 + 1 + 0.25) ** 2 / (256 + 16 + 1 + 0.0625)]
    torch.testing.assert_close(ranks, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        attn.W_O[0].zero_()
    assert ov_effective_rank.ov_effective_ranks(model)[0, 0].item() == 0.0  # a zero circuit: 0, not NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_price_covers_the_measured_peak(dtype: torch.dtype) -> None:
    """The bytes ov_effective_ranks holds (tensors it makes, the model's weights excluded) stay within the price, and
    the price is not far above them."""
    for model in (random_model(GQA, seed=0, dtype=dtype), rotary_model(**CASES["gemma3"]).to(dtype)):
        priced = assert_priced_within_twice_the_held_peak(
            model, ov_effective_rank.ov_effective_ranks, ov_effective_rank.cost
        )
        cfg = model.cfg
        assert priced.flops >= cfg.n_layers * cfg.n_heads * 2 * cfg.d_model * cfg.d_head**2  # each head's G_O
