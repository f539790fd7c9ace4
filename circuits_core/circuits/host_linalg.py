"""Small eigenvalue problems on the host CPU, wherever the model lives.

The copying scores take the eigenvalues of one d_head x d_head (or rank-sized) matrix per head: small, general
(non-symmetric) and often ill-conditioned, so they are solved in float64 by LAPACK's geev, one matrix at a time. On a
GPU the same batch is slower, not faster: torch.linalg.eigvals took 2.35 s on an H200 for 512 float64 matrices of
64 x 64, against 0.45 s on its host's CPU. So a matrix (or batch) of at most HOST_MAX_SIZE rows on a GPU is copied to
the host, solved there and its eigenvalues copied back to the matrix's device (d_head^2 numbers per head each way);
on the CPU nothing changes.
"""

from __future__ import annotations

import torch
from torch import Tensor

HOST_MAX_SIZE = 512  # rows of the largest matrix sent to the host (a d_head, or a factored matrix's inner rank)


def eigvals(M: Tensor) -> Tensor:
    """torch.linalg.eigvals(M) [..., n] (complex), computed on the host for small matrices on another device, and
    returned on M's device."""
    if M.device.type == "cpu" or M.shape[-1] > HOST_MAX_SIZE:
        return torch.linalg.eigvals(M)
    return torch.linalg.eigvals(M.cpu()).to(M.device)
