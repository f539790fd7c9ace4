"""The pair sums of all-pairs composition: <F_i^T F_i, P_j P_j^T>_F for every (source i, target j) pair, by block.

Paper section: "Composition" (Elhage et al. 2021; docs/maths.md §2.9); composition.py forms the collapsed factors
(F [k, d] of each earlier head's W_OV, P [d, k] of each later head's matrix) and divides by the norms. The squared
numerator ||W_OV^{h1} M^{h2}||_F^2 = <F^T F, P P^T>_F is summed over the upper block triangle of the two d x d Grams
(block (a, b), a <= b, weighted 2 off the diagonal): per block pair, block (a, b) of every source Gram S [ns, s, s]
and of every target Gram T [nt, s, s] (two batched products), then one product S_flat T_flat^T per group of target
columns against the source rows that group needs (composition.target_groups: a later head only reads earlier ones).

Two workers, one torch thread each, take the block pairs in turn from one queue (schedule.shared_tasks), each with
its own S, T and sums. On a 2-core machine shared with other work an OpenMP team of two threads waits at the end of
every product for a thread that lost its core; two workers that never wait for each other keep whatever share of
the machine they get (all-pairs K-composition at Llama-3.1-8B shape: 528 block pairs of ~26 GFLOP each).
With more than two torch threads (a larger host) or on a GPU, one worker uses them all.

Exactness: each block pair's contribution is a fresh product in the compute dtype (no running sum in it), added to a
float64 sum, so the result does not depend on which worker took which block pair beyond the rounding of float64
(~1e-16, far below the float32 products' own ~1e-7): the same weights give the same scores, in float32 to the last
bit except in the rare case where a float64 sum lies within ~1e-16 of a float32 rounding boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.cost import check_stop
from circuits_core.schedule import available_cores, on_workspaces

GRAM_BLOCK = 128  # column block of the d x d Gram matrices (upper block triangle: 21 of 36 blocks for d 768)

# (rows, c0, c1): target columns c0:c1 need the first `rows` source rows (the rest of their rows are left 0)
ColumnGroup = tuple[int, int, int]


def gram_block_size(d: int, target: int = GRAM_BLOCK) -> int:
    """Largest divisor of d that is <= target; d itself (one block, the full Gram) when that divisor is tiny."""
    size = max(s for s in range(1, min(d, target) + 1) if d % s == 0)
    return size if size * 4 >= min(d, target) else d


def block_pairs(d: int, size: int) -> tuple[list[tuple[int, int]], Tensor]:
    """Blocks (a, b), a <= b, of the d x d matrices (row-major) and their weights [Pb]: 1 on, 2 off the diagonal."""
    nb = d // size
    pairs = [(a, b) for a in range(nb) for b in range(a, nb)]
    return pairs, torch.tensor([1.0 if a == b else 2.0 for a, b in pairs], dtype=torch.float64)


def column_blocks(M: Tensor, size: int) -> Tensor:
    """M [N, r, d] as its d / size column blocks [nb, N, r, size] (a view; copied once into a block buffer)."""
    n, r, d = M.shape
    return M.view(n, r, d // size, size).permute(2, 0, 1, 3)


def row_blocks(M: Tensor, size: int) -> Tensor:
    """M [N, d, r] as its d / size row blocks [nb, N, size, r] (a view)."""
    n, d, r = M.shape
    return M.view(n, d // size, size, r).transpose(0, 1)


@dataclass
class Workspace:
    """One worker's buffers: a block of every source and target Gram, one block pair's products, and its sums."""

    S: Tensor  # [ns, s, s] compute dtype
    T: Tensor  # [nt, s, s]
    part: Tensor  # [ns, nt] one block pair's products
    sums: Tensor  # [ns, nt] float64


def workers(device: torch.device) -> int:
    """Workers pair_sums runs on `device`: two on a CPU whose caller has at most two torch threads and that has two
    cores (each worker then runs one torch thread), else one (a GPU, or a host with more threads: one team)."""
    return 2 if device.type == "cpu" and torch.get_num_threads() <= 2 and available_cores() >= 2 else 1


def pair_sums(
    F: Tensor,
    P: Tensor,
    pairs: list[tuple[int, int]],
    weights: list[float],
    groups: list[ColumnGroup],
    should_stop: Callable[[], bool] | None = None,
) -> Tensor:
    """sum over block pairs p = (a, b) of weights[p] <F_i[:, a]^T F_i[:, b], P_j[a] P_j[b]^T> -> [ns, nt] float64.

    F [nb, ns, k, s]: the source factors as column blocks; P [nb, nt, s, k]: the target factors as row blocks;
    entry (i, j) is summed for the groups (rows, c0, c1) with i < rows and c0 <= j < c1, 0 elsewhere. The workspaces
    are allocated here, before the workers start (one per worker, `workers`)."""
    _, ns, _, s = F.shape
    nt = P.shape[1]
    spaces = [
        Workspace(
            F.new_empty(ns, s, s), F.new_empty(nt, s, s), F.new_empty(ns, nt), F.new_zeros(ns, nt, dtype=torch.float64)
        )
        for _ in range(workers(F.device))
    ]

    def block_pair(p: int, ws: Workspace) -> None:
        check_stop(should_stop, "composition scores")
        a, b = pairs[p]
        torch.bmm(F[a].transpose(-2, -1), F[b], out=ws.S)  # block (a, b) of F^T F
        torch.bmm(P[a], P[b].transpose(-2, -1), out=ws.T)  # block (a, b) of P P^T
        S_flat, T_flat = ws.S.view(ns, s * s), ws.T.view(nt, s * s)
        for rows, c0, c1 in groups:
            part = ws.part[:rows, c0:c1]
            part.addmm_(S_flat[:rows], T_flat[c0:c1].T, beta=0, alpha=weights[p])
            ws.sums[:rows, c0:c1].add_(part)

    tasks = [lambda ws, p=p: block_pair(p, ws) for p in range(len(pairs))]
    on_workspaces(tasks, spaces)
    sums = spaces[0].sums
    for ws in spaces[1:]:
        sums.add_(ws.sums)
    return sums


def pair_sums_numbers(ns: int, nt: int, s: int, device: torch.device, itemsize: int) -> int:
    """Numbers (of `itemsize` bytes) pair_sums holds on `device`: per worker S, T and one block pair's products, and
    its float64 sums; two workers on any device but a GPU (the most `workers` gives: a price is made before the
    computation's thread count is known, and on the meta device for the host)."""
    return (1 if device.type == "cuda" else 2) * ((ns + nt) * s * s + ns * nt + ns * nt * 8 // itemsize)


def pair_sums_flops(ns: int, nt: int, s: int, k: int, n_pairs: int, groups: list[ColumnGroup]) -> int:
    """FLOPs of pair_sums: per block pair the two Gram blocks ([s, k] @ [k, s] per head) and the groups' products."""
    return n_pairs * (2 * (ns + nt) * s * s * k + sum(2 * rows * (c1 - c0) * s * s for rows, c0, c1 in groups))
