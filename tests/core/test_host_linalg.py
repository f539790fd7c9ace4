"""Small eigenvalue problems split among the caller's torch threads (circuits/host_linalg.py, schedule.per_thread):
each matrix's eigenvalues are LAPACK's for that matrix alone, in the batch's order, whatever the split."""

from __future__ import annotations

import threading
import time

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


def test_an_eigen_queue_drained_by_two_threads_gives_each_matrixs_own_eigenvalues() -> None:
    """Two threads each add batches to one EigenQueue and solve until nothing is left: every matrix's eigenvalues are
    LAPACK's for that matrix alone, in each batch's shape, and the thread that adds only a small batch solves chunks
    of the other's large one (the queue balances them)."""
    from circuits_core.schedule import side_by_side

    gen = torch.Generator().manual_seed(1)
    big = torch.randn(4, 6, 8, 8, generator=gen, dtype=torch.float32)  # [4, 6, n, n]: 24 matrices, float32 as formed
    small = torch.randn(1, 2, 8, 8, generator=gen, dtype=torch.float64)
    queue = host_linalg.EigenQueue()
    solved_by: list[tuple[str, int]] = []
    eigvals = torch.linalg.eigvals

    def recorded(batch: torch.Tensor) -> torch.Tensor:
        solved_by.append((threading.current_thread().name, batch.shape[0]))
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.05)  # this thread slow: the helper, done with its own batch, must take chunks of this one
        return eigvals(batch)

    added = threading.Event()  # the helper adds its batch once this thread has added its own

    def adds(M: torch.Tensor, first: bool) -> host_linalg.EigenBatch:
        if not first:
            added.wait(10)
        batch = queue.add(M)
        added.set()
        queue.solve()
        return batch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.linalg, "eigvals", recorded)
            patch.setattr("circuits_core.schedule.available_cores", lambda: 2)
            got_big, got_small = side_by_side(lambda: adds(big, True), lambda: adds(small, False), "qkov-queue-test")
    finally:
        torch.set_num_threads(previous)
    for M, got in ((big, got_big.values), (small, got_small.values)):
        want = torch.stack([eigvals(m) for m in M.double().reshape(-1, 8, 8)]).reshape(*M.shape[:-1])
        assert got.shape == M.shape[:-1] and got.dtype == torch.complex128
        assert torch.equal(got, want)  # each matrix's own LAPACK call: bitwise
    assert sum(n for _, n in solved_by) == 26
    helper = {name for name, _ in solved_by if name.startswith("qkov-queue-test")}
    assert helper and sum(n for name, n in solved_by if name in helper) > 2  # the helper took chunks of the big batch


@pytest.mark.parametrize("threads", [1, 3])
def test_an_eigen_queue_chunk_is_split_among_its_threads_torch_threads(threads: int) -> None:
    """A batch formed by a thread with `threads` torch threads is handed out EIGEN_CHUNK matrices per torch thread at a
    time, and each chunk is solved by that many threads at once (a GPU host's many cores, not the branches' two):
    every matrix's eigenvalues are still LAPACK's for that matrix alone."""
    gen = torch.Generator().manual_seed(2)
    M = torch.randn(5, 3, 7, 7, generator=gen, dtype=torch.float32)  # [5, 3, n, n]: 15 matrices
    calls: list[tuple[str, int]] = []  # (thread, matrices) of each LAPACK call
    eigvals = torch.linalg.eigvals

    def recorded(batch: torch.Tensor) -> torch.Tensor:
        calls.append((threading.current_thread().name, batch.shape[0]))
        return eigvals(batch)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.linalg, "eigvals", recorded)
            queue = host_linalg.EigenQueue()
            batch = queue.add(M)
            queue.solve()
    finally:
        torch.set_num_threads(previous)
    want = torch.stack([eigvals(m) for m in M.double().reshape(-1, 7, 7)]).reshape(5, 3, 7)
    assert torch.equal(batch.values, want)  # each matrix's own LAPACK call: bitwise
    chunk = host_linalg.EIGEN_CHUNK * threads
    chunks = [min(chunk, 15 - start) for start in range(0, 15, chunk)]  # the chunks handed out, in order
    per_call = []  # each chunk split into min(threads, its size) parts, the first ones a matrix larger (tensor_split)
    for c in chunks:
        parts = min(threads, c)
        per_call += [c // parts + (i < c % parts) for i in range(parts)]
    assert sorted(n for _, n in calls) == sorted(per_call)
    if threads > 1:
        assert all(name.startswith("qkov-eigvals") for name, _ in calls)  # solved by the chunk's own threads
