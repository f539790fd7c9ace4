"""host_eigvals splits a batch of small eigenvalue problems between two one-thread solvers: each matrix's eigenvalues
must come back in its own place, equal to numpy's LAPACK on that matrix alone, whatever the batch's shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from circuits_core.circuits.host_linalg import eigvals, host_eigvals


def _sorted(values: np.ndarray) -> np.ndarray:
    return np.sort_complex(np.round(values, 9))


@pytest.mark.parametrize("shape", [(3, 4, 6, 6), (5, 6, 6), (1, 6, 6), (6, 6)], ids=["LxH", "odd", "one", "single"])
def test_each_matrix_gets_its_own_eigenvalues(shape: tuple[int, ...]) -> None:
    M = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)), dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split path: two one-thread halves side by side (or in turn on one core)
    try:
        got = host_eigvals(M)
        assert torch.get_num_threads() == 2  # the caller's thread count is restored
    finally:
        torch.set_num_threads(threads)
    assert got.shape == shape[:-1] and eigvals(M).shape == shape[:-1]
    flat_got = got.reshape(-1, shape[-1]).numpy()
    for mine, matrix in zip(flat_got, M.reshape(-1, shape[-1], shape[-1]).numpy(), strict=True):
        expected = np.linalg.eigvals(matrix)  # numpy's own geev, one matrix
        assert np.allclose(_sorted(mine), _sorted(expected), atol=1e-9)
