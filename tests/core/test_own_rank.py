"""The screened count of columns above each row's own entry (own_rank.count_above) against the dense float64 count
of every column, on circuits where some rows copy (their own entry among the largest: scanned whole) and most do
not (settled by the probe or early in the scan), and on a model whose vocabulary is larger than the probe."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from circuits_core.circuits import copying
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.own_rank import PROBE, count_above, probe_columns
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model


def dense_above(M: torch.Tensor, own: torch.Tensor, k: int) -> torch.Tensor:
    """Every column of every row compared with the row's own entry, its own column left out, capped at k."""
    mine = M.gather(1, own[:, None])
    above = M > mine
    above[torch.arange(len(own)), own] = False
    return above.sum(1).clamp_max(k)


def mixed_circuit(r: int, n: int, dh: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Factors A [r, dh], B [dh, n] and the rows' own columns [r]: the first third of the rows copy (their own column
    made to score high, some at the very top, some just below a few others), the rest are random."""
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(r, dh, generator=gen, dtype=torch.float64)
    B = torch.randn(dh, n, generator=gen, dtype=torch.float64)
    own = torch.randperm(n, generator=gen)[:r]
    copiers = r // 3
    scale = torch.linspace(0.5, 3.0, copiers, dtype=torch.float64)  # from among the top few to clearly the top
    B[:, own[:copiers]] = A[:copiers].T * scale / A[:copiers].norm(dim=1) * B.norm(dim=0).mean()
    return A, B, own


@pytest.mark.parametrize("k", [1, 5, 40])
@pytest.mark.parametrize("probe", [True, False], ids=["probed", "scan-only"])
def test_count_above_equals_the_dense_count(k: int, probe: bool) -> None:
    r, n = 300, 3000
    A, B, own = mixed_circuit(r, n, 8, seed=k)
    M = A @ B
    want = dense_above(M, own, k)
    assert 0 < int((want < k).sum()) < r  # some rows copy, some do not: both paths are taken
    asked: list[int] = []

    def logits(rows: torch.Tensor, columns: torch.Tensor | slice) -> torch.Tensor:
        block = A[rows] @ B[:, columns]
        asked.append(block.numel())
        return block

    got = count_above(
        logits, M.gather(1, own[:, None])[:, 0], own, n, k, block_bytes=20_000, first_block=64,
        probe=probe_columns(n, seed=3) if probe else None,
    )  # fmt: skip
    assert torch.equal(got, want)
    assert len(asked) > 3  # several blocks
    assert sum(asked) < r * n  # rows settled early were not formed whole


def test_ties_and_the_own_column_are_not_counted() -> None:
    """An entry equal to the row's own is not above it; the own column itself never counts."""
    M = torch.tensor([[1.0, 1.0, 0.0, 2.0], [0.0, 5.0, 5.0, 5.0]], dtype=torch.float64)
    own = torch.tensor([0, 1])
    got = count_above(lambda rows, cols: M[rows][:, cols], M[[0, 1], [0, 1]], own, 4, 3, block_bytes=64, first_block=1)
    assert got.tolist() == [1, 0]


def test_row_ranks_on_a_vocabulary_larger_than_the_probe() -> None:
    """copying.row_ranks (probe, then the scan, each block by the cheaper route) equals the dense full OV circuit's
    count on a model with a vocabulary of 3 x PROBE tokens, where one head copies and another does not."""
    cfg = ModelConfig(n_layers=1, d_model=24, n_heads=2, d_head=6, d_vocab=3 * PROBE, n_ctx=8, attn_only=True)
    model = random_model(cfg, seed=0, dtype=torch.float64, std_embed=1.0)
    with torch.no_grad():  # head 0 copies: W_U = W_E^T and W_OV a projection (M = W_E P W_E^T, positive semidefinite)
        model.W_U.copy_(model.W_E.T)
        model.blocks[0].attn.W_O[0].copy_(model.blocks[0].attn.W_V[0].T)
    k, order = 10, copying.sample_order(cfg.d_vocab, 400, seed=1)
    shares = []
    for h in (0, 1):
        W_V, W_O = model.W_V[0, h], model.W_O[0, h]
        M = model.W_E[order] @ W_V @ W_O @ model.W_U  # [r, V] the rows of the full OV circuit (no LayerNorm)
        want = dense_above(M, order, k)
        with FlopCounterMode(display=False) as counter:
            got = copying.row_ranks(model, W_V, W_O, k, order, budget_bytes=50_000)
        price = copying.row_ranks_flops(cfg.d_model, cfg.d_head, cfg.d_vocab, len(order))
        assert 0 < counter.get_total_flops() <= price  # priced at most (every row probed, then scanned whole)
        assert torch.equal(got.above, want)
        torch.testing.assert_close(got.diag, M.gather(1, order[:, None])[:, 0], rtol=1e-12, atol=1e-12)
        shares.append(float((want < k).double().mean()))
    assert shares[0] > 2 * shares[1]  # the copying head's rows are mostly scanned whole, the other's settled early


def test_copying_metrics_on_a_token_circuit_larger_than_the_probe() -> None:
    """copying_metrics's top-1 and top-k shares (the head page's panel) equal the dense circuit's ranks."""
    A, B, own = mixed_circuit(2 * PROBE, 2 * PROBE, 8, seed=7)
    perm = torch.argsort(own)  # a square circuit whose row i's own column is i
    A = A[perm]
    B = B[:, own[perm]]
    M = A @ B
    n = M.shape[0]
    m = copying.copying_metrics(FactoredMatrix(A, B), k=5, budget_bytes=40_000)
    above = dense_above(M, torch.arange(n), 5)
    assert m.top1 == float((above == 0).double().mean()) and m.topk == float((above < 5).double().mean())
    assert 0 < m.topk < 1


def test_circuits_ranked_together_equal_each_dense_circuit(monkeypatch: pytest.MonkeyPatch) -> None:
    """copying.rows_ranks on every head at once (the overview's batches): the heads whose probe leaves few rows open
    are scanned in one stack of their rows, the others alone until few of their rows are open, those rows then
    finished in the stack from the column reached; every head's counts and diagonal equal its dense float64
    circuit's."""
    from circuits_core.circuits import ov_row_ranks

    cfg = ModelConfig(n_layers=2, d_model=24, n_heads=4, d_head=6, d_vocab=3 * PROBE, n_ctx=8, attn_only=True)
    model = random_model(cfg, seed=2, dtype=torch.float64, std_embed=1.0)
    with torch.no_grad():  # W_U = W_E^T; in each layer head 0 copies (W_OV a projection), head 1 half copies (some
        model.W_U.copy_(model.W_E.T)  # rows rank near the top: scanned alone, then the last few in the stack)
        for layer in range(cfg.n_layers):
            attn = model.blocks[layer].attn
            attn.W_O[0].copy_(attn.W_V[0].T)
            attn.W_O[1].add_(0.5 * attn.W_V[1].T * attn.W_O[1].norm() / attn.W_V[1].norm())
    scanned: list[int] = []  # rows of each scan: a circuit's own, or the stack of several circuits' rows
    begins: list[torch.Tensor] = []  # the stack's first column per row: 0 after the probe, later after a handoff
    inner = ov_row_ranks.scan

    def spy(*a: object, **kw: object) -> object:
        scanned.append(len(a[3]))  # type: ignore[arg-type]
        if kw.get("begin") is not None:
            begins.append(kw["begin"])  # type: ignore[arg-type]
        return inner(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ov_row_ranks, "scan", spy)
    k, order = 3, copying.sample_order(cfg.d_vocab, 400, seed=4)
    heads = [(layer, h) for layer in range(cfg.n_layers) for h in range(cfg.n_heads)]
    circuits = [(model.W_V[layer, h], model.W_O[layer, h]) for layer, h in heads]
    got = copying.rows_ranks(model, circuits, k, order, budget_bytes=50_000)
    for (W_V, W_O), ranks in zip(circuits, got, strict=True):
        M = model.W_E[order] @ W_V @ W_O @ model.W_U  # [r, V] the rows of the full OV circuit (no LayerNorm)
        assert torch.equal(ranks.above, dense_above(M, order, k))
        torch.testing.assert_close(ranks.diag, M.gather(1, order[:, None])[:, 0], rtol=1e-12, atol=1e-12)
    alone, stack = scanned[:-1], scanned[-1]
    assert len(alone) >= cfg.n_layers  # the copying heads, scanned on their own
    one = max(o for o in range(400) if ov_row_ranks.pooled(cfg.d_model, cfg.d_head, o))  # most one circuit stacks
    assert stack > one  # the stack holds several circuits' rows
    (begin,) = begins
    assert (begin == 0).any() and (begin > 0).any()  # rows stacked after the probe, and rows handed off mid-scan
