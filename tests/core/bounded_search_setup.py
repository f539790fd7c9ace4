"""The bounded global top-k's test setup, shared by the tests of the formed search and of the folded search on
unformed factors: its sizes shrunk to the test matrices' (a few hundred rows and columns, inner dimension 20-40), so
every path of the search (the seed, the staircase's row blocks and column chunks, the sampled basis, the norms sampled
to choose it) runs on them; and a poor change of basis in place of the balanced one."""

from __future__ import annotations

import pytest
import torch

from circuits_core.circuits import global_topk_bounds

SMALL_SIZES = {
    "MIN_ENTRIES": 1000,
    "MIN_INNER": 20,
    "GRAM_ROWS": 50,
    "CHUNK": 64,
    "SEED": 8,
    "CHUNK_ENTRIES": 512,
    "COLS": 16,
    "ROWS_MAX": 96,
    "NORM_SAMPLE": 64,
}


def shrink_search(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SMALL_SIZES.items():
        monkeypatch.setattr(global_topk_bounds, name, value)


def poor_basis(monkeypatch: pytest.MonkeyPatch, mdim: int, noise: float, decades: float) -> None:
    """A basis far from the singular one (M's columns scaled over `decades` powers of ten), N only approximately M^-1
    (a relative error `noise`)."""
    gen = torch.Generator().manual_seed(4)
    M = torch.randn(mdim, mdim, generator=gen, dtype=torch.float64)
    M = M * torch.logspace(0, decades, mdim, dtype=torch.float64)
    N = torch.linalg.inv(M)
    N = N + noise * N.abs().mean() * torch.randn(mdim, mdim, generator=gen, dtype=torch.float64)
    monkeypatch.setattr(global_topk_bounds, "balanced_basis", lambda A, B: (M.to(A.dtype), N.to(A.dtype)))
