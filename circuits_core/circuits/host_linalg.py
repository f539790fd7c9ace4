"""Small eigenvalue problems on the host CPU, wherever the model lives.

The copying scores take the eigenvalues of one d_head x d_head (or rank-sized) matrix per head: small, general
(non-symmetric) and often ill-conditioned, so they are solved in float64 by LAPACK's geev, one matrix at a time. On a
GPU the same batch is slower, not faster: torch.linalg.eigvals took 2.35 s on an H200 for 512 float64 matrices of
64 x 64, against 0.45 s on its host's CPU. So a matrix (or batch) of at most HOST_MAX_SIZE rows on a GPU is copied to
the host, solved there and its eigenvalues copied back to the matrix's device (d_head^2 numbers per head each way);
on the CPU nothing changes.

Either way, a batch is split among the caller's torch threads (schedule.per_thread), each solving its part with one
torch thread: torch's batched geev solves one matrix after another, each with the whole OpenMP team, which on
128 x 128 matrices spends more time at the team's barriers than in LAPACK (1,024 of them: 5.5 s on an H200's
16-core host, bench/RESULTS.md). The eigenvalues are each matrix's own, whatever the split.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.schedule import per_thread

HOST_MAX_SIZE = 512  # rows of the largest matrix sent to the host (a d_head, or a factored matrix's inner rank)


def eigvals(M: Tensor) -> Tensor:
    """torch.linalg.eigvals(M) [..., n] (complex), computed on the host for small matrices on another device, and
    returned on M's device; a batch split among the caller's torch threads."""
    if M.device.type != "cpu" and M.shape[-1] > HOST_MAX_SIZE:
        return torch.linalg.eigvals(M)
    return _split_among_threads(M.cpu()).to(M.device)  # (both moves are no-ops on the CPU)


def _split_among_threads(M: Tensor) -> Tensor:
    """torch.linalg.eigvals of a host batch M [..., n, n], its matrices in up to torch.get_num_threads() parts."""
    n = M.shape[-1]
    batch = M.reshape(-1, n, n)  # [b, n, n]
    parts = min(torch.get_num_threads(), batch.shape[0])
    if parts < 2:
        return torch.linalg.eigvals(M)
    solved = per_thread(torch.linalg.eigvals, batch.tensor_split(parts), "qkov-eigvals")  # [b_i, n] each
    return torch.cat(solved).reshape(M.shape[:-1])
