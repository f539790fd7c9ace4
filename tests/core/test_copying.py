"""Self-copy shares, diagonal statistics and the random-weights baseline against dense float64 [V, V] circuits."""

from __future__ import annotations

import pytest
import torch

from circuits_core.circuits import copying
from circuits_core.errors import InvalidInputError
from tests.core.test_circuits import dense_embed, make_model

VOCAB = torch.tensor([3, 0, 17, 36, 8, 21, 5, 30, 12, 25])  # a subset, not sorted


def dense_stats(M: torch.Tensor, k: int) -> torch.Tensor:
    """[top1, topk, diag > 0, diag median] of a dense square circuit, row by row."""
    own = torch.arange(M.shape[0])
    top = M.topk(k, dim=1).indices
    diag = M.diagonal()
    return torch.tensor(
        [
            float((M.argmax(1) == own).double().mean()),
            float((top == own[:, None]).any(1).double().mean()),
            float((diag > 0).double().mean()),
            float(diag.median()) if diag.numel() % 2 else float(diag.quantile(0.5)),
        ],
        dtype=torch.float64,
    )


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
            have = torch.stack(
                [got.top1[layer, h], got.topk[layer, h], got.diagonal_positive[layer, h], got.diagonal_median[layer, h]]
            )
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
            assert [float(base.top1[i]), float(base.topk[i]), float(base.diagonal_positive[i])] == pytest.approx(
                want[:3].tolist(), abs=1e-12
            )
    assert base.ov_copying.abs().max() < 1  # random circuits are not +1 copiers


def test_errors():
    model = make_model(n_layers=1)
    with pytest.raises(InvalidInputError, match="k must be"):
        copying.self_copy(model, k=11, vocab=VOCAB)
    with pytest.raises(InvalidInputError, match="vocab"):
        copying.self_copy(model, k=1, vocab=torch.tensor([0, 99]))
    with pytest.raises(InvalidInputError, match="n_top_samples"):
        copying.random_baseline(model, n_samples=2, n_top_samples=3)


@pytest.mark.parametrize("vocab", [None, VOCAB], ids=["all", "subset"])
def test_sampled_rows_equal_dense_rows(vocab):
    """rows=r: the shares over r seeded source rows, each ranked against every (ranked) column, against the dense
    [V, V] circuit's rows picked by the same documented draw (torch.randperm from manual_seed(seed), first r)."""
    model = make_model(n_layers=2, norm="LN")
    k, r, seed = 3, 7, 5
    n = 37 if vocab is None else 10
    got = copying.self_copy(model, k=k, vocab=vocab, rows=r, seed=seed, budget_bytes=3 * 37 * 8, heads=[(1, 0), (0, 1)])
    picked = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:r]
    E = dense_embed(model)
    for layer, h in [(1, 0), (0, 1)]:
        M = E @ model.W_V[layer, h] @ model.W_O[layer, h] @ model.W_U  # [V, V]
        if vocab is not None:
            M = M[vocab][:, vocab]
        rows = M[picked]  # [r, n]: row i belongs to token picked[i]
        top = rows.topk(k, dim=1).indices
        diag = rows[torch.arange(r), picked]
        want = [
            float((top[:, 0] == picked).double().mean()),
            float((top == picked[:, None]).any(1).double().mean()),
            float((diag > 0).double().mean()),
            float(diag.quantile(0.5)),
        ]
        have = [float(t[layer, h]) for t in (got.top1, got.topk, got.diagonal_positive, got.diagonal_median)]
        assert have == pytest.approx(want, abs=1e-12)
    assert torch.isnan(got.top1[0, 0]) and torch.isnan(got.top1[1, 1])  # heads not asked for are not measured
    assert (got.n_rows, got.n_tokens, got.seed) == (r, n, seed)
    full = copying.self_copy(model, k=k, vocab=vocab, rows=n + 5)  # more rows than tokens: every row, no seed
    assert full.n_rows == n and full.seed is None


def test_sampled_baseline_uses_the_same_rows():
    model = make_model(n_layers=1, norm="LN")
    base = copying.random_baseline(model, n_samples=3, n_top_samples=1, k=2, seed=4, rows=9)
    gen = torch.Generator().manual_seed(4)
    W_V = torch.randn(3, 16, 4, generator=gen, dtype=torch.float64)
    W_O = torch.randn(3, 4, 16, generator=gen, dtype=torch.float64)
    picked = torch.randperm(37, generator=torch.Generator().manual_seed(4))[:9]
    rows = (dense_embed(model) @ W_V[0] @ W_O[0] @ model.W_U)[picked]  # [9, V]
    top = rows.topk(2, dim=1).indices
    assert float(base.top1[0]) == pytest.approx(float((top[:, 0] == picked).double().mean()), abs=1e-12)
    assert float(base.topk[0]) == pytest.approx(float((top == picked[:, None]).any(1).double().mean()), abs=1e-12)
    assert base.n_rows == 9


def test_sample_order():
    s = copying.sample_order(100, 30, seed=1).sort().values  # the distinct positions drawn, sorted
    assert s.tolist() == sorted(set(s.tolist())) and len(s) == 30 and 0 <= int(s.min()) and int(s.max()) < 100
    assert copying.sample_order(100, 30, seed=2).sort().values.tolist() != s.tolist()
    assert copying.sample_order(10, None).tolist() == list(range(10)) == copying.sample_order(10, 10).tolist()
    with pytest.raises(InvalidInputError, match="rows"):
        copying.sample_order(10, 0)


def test_a_smaller_sample_is_the_first_rows_of_a_larger_one():
    """sample_order(n, r) is the first r of sample_order(n, R) (r < R < n), so RowRanks.first(r) of the larger draw
    equals the rows measured on the smaller one; both against the dense rows of the documented draw."""
    model = make_model(n_layers=1, norm="LN")
    n, r, R, k, seed = 37, 9, 20, 3, 2
    assert copying.sample_order(n, R, seed)[:r].tolist() == copying.sample_order(n, r, seed).tolist()
    W_V, W_O = model.W_V[0, 1], model.W_O[0, 1]
    big = copying.row_ranks(model, W_V, W_O, k, copying.sample_order(n, R, seed), budget_bytes=4 * n * 8).first(r)
    small = copying.row_ranks(model, W_V, W_O, k, copying.sample_order(n, r, seed))
    picked = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:r]
    M = (dense_embed(model) @ W_V @ W_O @ model.W_U)[picked]  # [r, V]
    above = (M > M[torch.arange(r), picked][:, None]).sum(1).clamp_max(k)
    for got in (big, small):
        assert got.above.tolist() == above.tolist()
        torch.testing.assert_close(got.diag, M[torch.arange(r), picked], atol=1e-12, rtol=0)
