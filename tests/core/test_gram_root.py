"""gram_root (the d_head factors of the all-pairs composition scores) against float64 Grams formed here: R^T R =
M^T M, so ||M X|| = ||R X||, for full-rank, rank-deficient and zero factors, wide ones (QR's R), and float32."""

from __future__ import annotations

import torch

from circuits_core.circuits.gram_root import gram_root


def _gram(M: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...ia,...ib->...ab", M.double(), M.double())


def test_the_root_of_full_rank_factors_has_their_gram_and_norms() -> None:
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(3, 5, 40, 8, generator=gen, dtype=torch.float64)  # [batch, heads, d_model, d_head]
    R = gram_root(M)
    assert R.shape == (3, 5, 8, 8) and R.dtype == torch.float64
    torch.testing.assert_close(R.mT @ R, _gram(M), rtol=1e-13, atol=1e-13)
    X = torch.randn(8, 7, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(torch.linalg.matrix_norm(R @ X), torch.linalg.matrix_norm(M @ X), rtol=1e-13, atol=0)


def test_rank_deficient_and_zero_factors_get_a_root_too() -> None:
    """No Cholesky factor exists for these Grams: the eigen-decomposition's root, beside full-rank ones in a batch."""
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(40, 8, generator=gen, dtype=torch.float64)
    low = torch.randn(40, 3, generator=gen, dtype=torch.float64) @ torch.randn(3, 8, generator=gen, dtype=torch.float64)
    M = torch.stack([full, low, torch.zeros(40, 8, dtype=torch.float64), full])
    R = gram_root(M)
    torch.testing.assert_close(R.mT @ R, _gram(M), rtol=0, atol=1e-12 * float(_gram(M).abs().max()))
    assert torch.equal(R[2], torch.zeros(8, 8, dtype=torch.float64))


def test_a_wide_factor_keeps_the_qr_root_and_float32_stays_within_its_rounding() -> None:
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(6, 8, generator=gen, dtype=torch.float64)  # d_model < d_head
    R = gram_root(wide)
    assert R.shape == (6, 8)
    torch.testing.assert_close(R.mT @ R, _gram(wide), rtol=1e-13, atol=1e-13)
    M = torch.randn(4, 512, 16, generator=gen)  # float32
    R = gram_root(M)
    assert R.dtype == torch.float32
    err = (R.double().mT @ R.double() - _gram(M)).abs().max() / _gram(M).abs().max()
    assert err < 1e-5
