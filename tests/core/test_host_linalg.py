"""Small eigenvalue problems split among the caller's torch threads (circuits/host_linalg.py, schedule.per_thread):
each matrix's eigenvalues are LAPACK's for that matrix alone, in the batch's order, whatever the split."""

from __future__ import annotations

import threading

import pytest
import torch

from circuits_core.circuits import host_linalg


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_split_batch_gives_each_matrixs_own_eigenvalues(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(3, 5, 6, 6, generator=gen, dtype=torch.float64)  # [3, 5, n, n], 15 general matrices
    one_by_one = torch.stack([torch.linalg.eigvals(m) for m in M.reshape(-1, 6, 6)]).reshape(3, 5, 6)
    solved_by: list[tuple[str, int]] = []
    eigvals = torch.linalg.eigvals

    def recorded(batch: torch.Tensor) -> torch.Tensor:
        solved_by.append((threading.current_thread().name, batch.numel() // 36))  # matrices of 6 x 6
        return eigvals(batch)

    monkeypatch.setattr(torch.linalg, "eigvals", recorded)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = host_linalg.eigvals(M)
    finally:
        torch.set_num_threads(previous)
    assert got.shape == (3, 5, 6) and got.dtype == torch.complex128
    torch.testing.assert_close(got, one_by_one, rtol=1e-12, atol=1e-12)
    assert sum(n for _, n in solved_by) == 15 and len(solved_by) == threads  # one part per torch thread
    if threads > 1:
        assert all(name.startswith("qkov-eigvals") for name, _ in solved_by)
    # and the sums the copying scores read: sum(lambda) is the trace, for every matrix
    torch.testing.assert_close(got.sum(-1).real, M.diagonal(dim1=-2, dim2=-1).sum(-1), rtol=1e-12, atol=1e-12)
