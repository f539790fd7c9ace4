"""The branch and bound of global_topk_bounds returns the dense product's top k.

Each case is checked against torch's topk of the dense A @ B, on matrices shaped like circuits (a decaying spectrum,
a few large-norm rows and columns) and on unstructured ones; the search's size thresholds and leaves are made small
so that small matrices take it, and a basis that is not the singular one (M N != I, ill-conditioned) must give the same
answer: the margins, not the basis, make it exact."""

from __future__ import annotations

import pytest
import torch

from circuits_core.circuits import global_topk, global_topk_bounds
from circuits_core.circuits.factored import FactoredMatrix


@pytest.fixture(autouse=True)
def small_search(monkeypatch):
    monkeypatch.setattr(global_topk_bounds, "MIN_ENTRIES", 1000)
    monkeypatch.setattr(global_topk_bounds, "MIN_INNER", 20)
    monkeypatch.setattr(global_topk_bounds, "LEAF", 8)
    monkeypatch.setattr(global_topk_bounds, "GRAM_ROWS", 50)
    monkeypatch.setattr(global_topk_bounds, "TILE_BATCH", 16)


def circuit_like(ldim, mdim, rdim, seed, dtype=torch.float64):
    """Factors whose product has a decaying spectrum, with a few large-norm rows and columns."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, -2, mdim, dtype=dtype)
    A = torch.randn(ldim, mdim, generator=gen, dtype=dtype) * scale
    B = torch.randn(mdim, rdim, generator=gen, dtype=dtype) * scale[:, None]
    A[:5] *= 4
    B[:, -3:] *= 3
    return A, B


def dense_topk(M, k):
    v, i = M.flatten().topk(k)
    return v, i // M.shape[1], i % M.shape[1]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [1, 10, 300])
def test_bounded_search_matches_the_dense_topk(seed, dtype, k):
    A, B = circuit_like(300, 24, 260, seed, dtype)
    assert global_topk_bounds.usable(A, B)
    v, r, c = global_topk_bounds.topk_bounded(A, B, k)
    ref_v, ref_r, ref_c = dense_topk(A @ B, k)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(v, ref_v, rtol=tol, atol=tol)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)  # random data: no ties


def test_unstructured_factors_and_non_multiple_sizes():
    gen = torch.Generator().manual_seed(5)
    A, B = (
        torch.randn(131, 21, generator=gen, dtype=torch.float64),
        torch.randn(21, 77, generator=gen, dtype=torch.float64),
    )
    v, r, c = global_topk_bounds.topk_bounded(A, B, 40)
    ref_v, ref_r, ref_c = dense_topk(A @ B, 40)
    torch.testing.assert_close(v, ref_v, rtol=1e-12, atol=1e-12)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)


def test_any_invertible_basis_gives_the_same_answer(monkeypatch):
    """A poor basis with N only approximately M^-1: the margin eta (measured on M N - I) keeps the answer exact."""
    A, B = circuit_like(200, 24, 150, 3)
    gen = torch.Generator().manual_seed(4)
    M = torch.randn(24, 24, generator=gen, dtype=torch.float64) * torch.logspace(0, 2, 24, dtype=torch.float64)
    N = torch.linalg.inv(M) + 1e-4 * torch.randn(24, 24, generator=gen, dtype=torch.float64)
    real = global_topk_bounds.balanced_basis

    def poor_basis(A, B):
        _, _, _ = real(A, B)
        u = torch.finfo(A.dtype).eps / 2
        gamma = 24 * u / (1 - 24 * u)
        eye = torch.eye(24, dtype=torch.float64)
        eta = float(torch.linalg.matrix_norm(M @ N - eye, 2)) + 3 * gamma * float(M.norm() * N.norm()) + gamma
        return M, N, eta

    monkeypatch.setattr(global_topk_bounds, "balanced_basis", poor_basis)
    v, r, c = global_topk_bounds.topk_bounded(A, B, 25)
    ref_v, ref_r, ref_c = dense_topk(A @ B, 25)
    torch.testing.assert_close(v, ref_v, rtol=1e-12, atol=1e-12)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)


def test_the_search_prunes_and_serves_topk_global(monkeypatch):
    """On circuit-like factors fewer entries are computed exactly than the matrix holds, and FactoredMatrix.topk_global
    (largest and smallest, a batch) takes this search and matches dense."""
    A, B = circuit_like(400, 24, 400, 7)
    exact = []
    real_matmul = torch.Tensor.__matmul__

    def counting(x, y):
        out = real_matmul(x, y)
        if x.shape[-1] == 24 and y.shape[0] == 24 and y.shape[-1] != 24 and x.shape[0] != 24:
            exact.append(out.numel())
        return out

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "__matmul__", counting)
        v, r, c = global_topk_bounds.topk_bounded(A, B, 10)
    assert 0 < sum(exact) < 400 * 400 / 4
    ref_v, ref_r, ref_c = dense_topk(A @ B, 10)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)
    called = []
    real_search = global_topk_bounds.topk_bounded
    monkeypatch.setattr(global_topk_bounds, "topk_bounded", lambda *a: called.append(1) or real_search(*a))
    As = torch.stack([A, A.flip(0)])
    fm = FactoredMatrix(As, B)
    for largest in (True, False):
        v, r, c = fm.topk_global(12, largest=largest)
        for i in range(2):
            M = As[i] @ B
            ref = (M if largest else -M).flatten().topk(12)
            torch.testing.assert_close(v[i], ref.values if largest else -ref.values, rtol=1e-12, atol=1e-12)
            assert torch.equal(r[i] * 400 + c[i], ref.indices)
    assert len(called) == 4
    assert global_topk.topk_global_flops(400, 24, 400) >= global_topk_bounds.bounded_flops(400, 24, 400)
