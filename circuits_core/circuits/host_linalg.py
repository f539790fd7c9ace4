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

from circuits_core.schedule import side_by_side

HOST_MAX_SIZE = 512  # rows of the largest matrix sent to the host (a d_head, or a factored matrix's inner rank)


def eigvals(M: Tensor) -> Tensor:
    """torch.linalg.eigvals(M) [..., n] (complex), computed on the host for small matrices on another device, and
    returned on M's device."""
    if M.device.type == "cpu":
        return host_eigvals(M)
    if M.shape[-1] > HOST_MAX_SIZE:
        return torch.linalg.eigvals(M)
    return host_eigvals(M.cpu()).to(M.device)


def host_eigvals(M: Tensor) -> Tensor:
    """torch.linalg.eigvals(M) [..., n] of a CPU tensor, one LAPACK thread per matrix: a batch is split between two
    threads (schedule.side_by_side, when the caller's torch threads leave a core for it), each solving its half on one
    torch thread. geev on a small matrix gains little from a second thread and loses much when its team shares busy
    cores: 16 float64 matrices of 256 x 256 (Gemma-3 270M's d_head) took 1.45 s on one thread and 30.2 s on two at
    load average 5 on this 2-core machine."""
    threads = torch.get_num_threads()
    if threads == 1:
        return torch.linalg.eigvals(M)
    flat = M.reshape(-1, *M.shape[-2:])  # [b, n, n]
    half = (flat.shape[0] + 1) // 2
    torch.set_num_threads(1)  # process-wide (see formats.llama.one_thread); side_by_side's helper inherits it
    try:
        first, second = side_by_side(
            lambda: torch.linalg.eigvals(flat[:half]), lambda: torch.linalg.eigvals(flat[half:]), "qkov-eigvals"
        )
    finally:
        torch.set_num_threads(threads)
    return torch.cat([first, second]).reshape(M.shape[:-1])
