"""OV top singular share per head (circuits_core/circuits/ov_top_singular_share.py) against a dense float64 SVD of the
formed d_model x d_model W_V[g] W_O[h], on toy-2l, on a grouped-query model and on a Gemma-3-shaped model (output-norm
gain, multi-query) and against the OV formed through the latent on DeepSeek-V3 and V2-Lite-shaped checkpoints; and
on heads planted with known singular values (docs/maths.md §5.14)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from circuits_core.circuits import ov_effective_rank, ov_top_singular_share
from circuits_core.circuits.latent_circuits import latent_head
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, random_model
from tests.core.formed_circuits import assert_priced_within_twice_the_held_peak, per_head_of_formed_ov, plant_ov_spectra
from tests.core.hf_families import save
from tests.core.rotary_models import CASES, rotary_model
from tests.core.test_deepseek_hf import deepseek_model

TOY_2L = Path(__file__).resolve().parents[2] / "checkpoints" / "toy-2l"
GQA = ModelConfig(
    n_layers=2, n_heads=6, n_key_value_heads=2, d_model=24, d_head=8, d_vocab=40, n_ctx=16, attn_only=True
)


def top_share(sigma: torch.Tensor) -> float:
    return float(sigma.max().square() / sigma.square().sum())


def dense_shares(model: Transformer) -> torch.Tensor:
    """[L, H]: sigma_1^2 / sum sigma^2 over all d_model singular values of the formed W_V[h * n_kv // H] W_O[h] (the
    output norm's gain, if any, multiplying W_O's columns)."""
    return per_head_of_formed_ov(model, lambda W_OV: top_share(torch.linalg.svdvals(W_OV)))


def assert_matches_the_dense_svd(model: Transformer) -> torch.Tensor:
    shares = ov_top_singular_share.ov_top_singular_shares(model)
    assert shares.shape == (model.cfg.n_layers, model.cfg.n_heads) and shares.dtype == torch.float64
    torch.testing.assert_close(shares, dense_shares(model), rtol=1e-10, atol=0)
    # the stable rank 1 / share is never above the participation ratio: sum sigma^4 <= sigma_1^2 sum sigma^2
    assert bool((shares * ov_effective_rank.ov_effective_ranks(model) >= 1 - 1e-12).all())
    return shares


def test_toy_2l_matches_the_dense_svd() -> None:
    model = load_checkpoint(TOY_2L, dtype=torch.float64).model
    shares = assert_matches_the_dense_svd(model)
    assert bool((shares >= 1 / model.cfg.d_head).all() and (shares <= 1).all())  # the page's claim: 1/d_head to 1
    assert float(shares.std()) > 0.01 * float(shares.mean())  # the heads differ


def test_grouped_query_model_reads_each_heads_group() -> None:
    shares = assert_matches_the_dense_svd(random_model(GQA, seed=5, dtype=torch.float64))
    assert not torch.allclose(shares[:, 0], shares[:, 1])  # heads of one group share W_V, not W_O


def test_output_norm_gain_is_folded_on_a_gemma3_shaped_model() -> None:
    assert_matches_the_dense_svd(rotary_model(**CASES["gemma3"]))  # gamma_post random, one key/value head for 4


@pytest.mark.parametrize("name", ["v3", "v2-lite-grouped"])
def test_latent_attention_matches_the_ov_formed_through_the_latent(name: str, tmp_path: Path) -> None:
    """On DeepSeek checkpoints that transformers writes: against the dense SVD of each head's OV formed through the
    latent by latent_circuits.latent_head (checked against transformers' own weights in test_latent_circuits.py)."""
    model = load_checkpoint(save(deepseek_model(name, seed=11), tmp_path / name), dtype=torch.float64).model
    cfg = model.cfg
    formed = [[top_share(torch.linalg.svdvals(latent_head(model, layer, h).ov.AB)) for h in range(cfg.n_heads)]
              for layer in range(cfg.n_layers)]  # fmt: skip
    shares = ov_top_singular_share.ov_top_singular_shares(model)
    torch.testing.assert_close(shares, torch.tensor(formed, dtype=torch.float64), rtol=1e-10, atol=0)


def test_planted_singular_values_give_their_share() -> None:
    """W_V = Q1, W_O = diag(s) Q2^T (Q1, Q2 orthonormal columns) has singular values s exactly; so has W_V = Q1 diag(s),
    W_O = Q2^T, whose singular W_V has no Cholesky root (gram_root's eigen-decomposition fallback)."""
    cfg = ModelConfig(n_layers=1, n_heads=4, d_model=20, d_head=5, d_vocab=30, n_ctx=8, attn_only=True)
    model = random_model(cfg, seed=1, dtype=torch.float64)
    mixed = torch.tensor([4.0, 2.0, 1.0, 0.5, 0.0], dtype=torch.float64)
    plant_ov_spectra(model, [torch.tensor([3.0, 0, 0, 0, 0]), torch.ones(5), mixed, mixed], values_side=(3,))
    attn = model.blocks[0].attn
    shares = ov_top_singular_share.ov_top_singular_shares(model)[0]
    expected = [1.0, 1 / 5, 16 / (16 + 4 + 1 + 0.25), 16 / (16 + 4 + 1 + 0.25)]
    torch.testing.assert_close(shares, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        attn.W_O[0].zero_()
    assert ov_top_singular_share.ov_top_singular_shares(model)[0, 0].item() == 0.0  # a zero circuit: 0, not NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_price_covers_the_measured_peak(dtype: torch.dtype) -> None:
    """The bytes ov_top_singular_shares holds (tensors it makes, the model's weights excluded) stay within the price,
    and the price is not far above them."""
    for model in (random_model(GQA, seed=0, dtype=dtype), rotary_model(**CASES["gemma3"]).to(dtype)):
        priced = assert_priced_within_twice_the_held_peak(
            model, ov_top_singular_share.ov_top_singular_shares, ov_top_singular_share.cost
        )
        cfg = model.cfg
        assert priced.flops >= cfg.n_layers * cfg.n_heads * 2 * cfg.d_model * cfg.d_head**2  # each head's G_O
