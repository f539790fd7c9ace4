"""Self-copy shares, diagonal statistics and the random-weights baseline against dense float64 [V, V] circuits."""

from __future__ import annotations

import pytest
import torch

from circuits_core import copying
from circuits_core.errors import InvalidInputError
from tests.core.test_circuits import dense_embed, make_model

VOCAB = torch.tensor([3, 0, 17, 36, 8, 21, 5, 30, 12, 25])  # a subset, not sorted


def dense_stats(M: torch.Tensor, k: int) -> torch.Tensor:
    """[top1, topk, diag > 0, diag median] of a dense square circuit, row by row."""
    own = torch.arange(M.shape[0])
    top = M.topk(k, dim=1).indices
    diag = M.diagonal()
    return torch.tensor([float((M.argmax(1) == own).double().mean()), float((top == own[:, None]).any(1).double().mean()),
                         float((diag > 0).double().mean()), float(diag.median()) if diag.numel() % 2 else float(diag.quantile(0.5))], dtype=torch.float64)


@pytest.mark.parametrize("norm", [None, "LN"])
@pytest.mark.parametrize("vocab", [None, VOCAB], ids=["all", "subset"])
def test_self_copy_equals_dense(norm, vocab):
    model = make_model(n_layers=2, norm=norm)
    k = 3
    got = copying.self_copy(model, k=k, vocab=vocab, budget_bytes=5 * 37 * 8)  # several row blocks
    E = dense_embed(model)
    for layer in range(2):
        for h in range(model.cfg.n_heads):
            M = E @ model.W_V[layer, h] @ model.W_O[layer, h] @ model.W_U  # [V, V]
            if vocab is not None:
                M = M[vocab][:, vocab]
            want = dense_stats(M, k)
            have = torch.stack([got.top1[layer, h], got.topk[layer, h], got.diagonal_positive[layer, h], got.diagonal_median[layer, h]])
            torch.testing.assert_close(have.double(), want, atol=1e-12, rtol=0)
    assert got.n_tokens == (37 if vocab is None else 10)


def test_random_baseline_equals_dense():
    model = make_model(n_layers=1, norm="LN")
    base = copying.random_baseline(model, n_samples=6, n_top_samples=2, k=4, seed=3)
    gen = torch.Generator().manual_seed(3)  # the documented stream: all W_V, then all W_O, standard normal
    W_V = torch.randn(6, 16, 4, generator=gen, dtype=torch.float64)
    W_O = torch.randn(6, 4, 16, generator=gen, dtype=torch.float64)
    E = dense_embed(model)
    for i in range(6):
        M = E @ W_V[i] @ W_O[i] @ model.W_U  # [V, V], rank d_head
        eig = torch.linalg.eigvals(M)  # all V eigenvalues (the V - d_head others are ~0)
        assert float(base.ov_copying[i]) == pytest.approx(float(eig.sum().real / eig.abs().sum()), abs=1e-8)
        if i < 2:
            want = dense_stats(M, 4)
            assert [float(base.top1[i]), float(base.topk[i]), float(base.diagonal_positive[i])] == pytest.approx(want[:3].tolist(), abs=1e-12)
    assert base.ov_copying.abs().max() < 1  # random circuits are not +1 copiers


def test_errors():
    model = make_model(n_layers=1)
    with pytest.raises(InvalidInputError, match="k must be"):
        copying.self_copy(model, k=11, vocab=VOCAB)
    with pytest.raises(InvalidInputError, match="vocab"):
        copying.self_copy(model, k=1, vocab=torch.tensor([0, 99]))
    with pytest.raises(InvalidInputError, match="n_top_samples"):
        copying.random_baseline(model, n_samples=2, n_top_samples=3)
