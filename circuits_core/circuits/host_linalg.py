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

from circuits_core.schedule import per_thread, shared_chunks

HOST_MAX_SIZE = 512  # rows of the largest matrix sent to the host (a d_head, or a factored matrix's inner rank)
# Matrices per torch thread in a chunk an EigenQueue hands out: two d_head = 256 problems are ~40 ms, so two threads
# draining one queue finish within about that of each other
EIGEN_CHUNK = 2


def eigen_chunk(threads: int) -> int:
    """Matrices per chunk an EigenQueue hands to a thread that has `threads` torch threads."""
    return EIGEN_CHUNK * max(1, threads)


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


class EigenBatch:
    """The eigenvalues of a batch of square matrices M [..., n, n], in float64 (the spectra's precision), solved a
    chunk at a time by whichever thread takes the chunk (EigenQueue). A chunk holds EIGEN_CHUNK matrices for each
    torch thread of the thread that formed the batch, and is split among them (eigvals): on one thread per branch (two
    cores) two matrices, on a 16-core GPU host's two branches of 8 threads, 16 each, so all its cores solve at once
    instead of the branches' two (4,032 problems of 128 x 128: 5.6 s of eigvals on an H200's host). M is kept as
    given (float32 for a float32 model: half the bytes of a float64 copy) and each chunk converted when it is solved."""

    def __init__(self, M: Tensor) -> None:
        n = M.shape[-1]
        self._matrices = M.reshape(-1, n, n)  # [b, n, n]
        self.values = torch.empty(M.shape[:-1], dtype=torch.complex128, device=M.device)  # [..., n], once solved
        self._take = shared_chunks(len(self._matrices), eigen_chunk(torch.get_num_threads()))

    def solve_chunk(self) -> bool:
        """Solve the next chunk not taken yet; False when every chunk was taken (by this thread or another)."""
        part = self._take()
        if part is None:
            return False
        self.values.view(-1, self.values.shape[-1])[part] = eigvals(self._matrices[part].double())
        return True


class EigenQueue:
    """Batches of eigenproblems that two threads (schedule.side_by_side's branches) add and solve together: each
    thread adds its batches as it forms them, then solves chunks of every batch added so far until none is left, so
    the two finish within a chunk of each other whatever each one formed. Each batch is solved once all threads
    that added batches have returned from solve()."""

    def __init__(self) -> None:
        self._batches: list[EigenBatch] = []

    def add(self, M: Tensor) -> EigenBatch:
        """A batch for M [..., n, n], to be solved by solve() (its values are complete once every adder's solve()
        returned)."""
        batch = EigenBatch(M)
        self._batches.append(batch)  # (one append under the GIL: the other thread sees it whole or not yet)
        return batch

    def solve(self) -> None:
        """Solve chunks of the batches added so far (this thread's and the other's) until none is left to take."""
        while any([batch.solve_chunk() for batch in list(self._batches)]):
            pass
