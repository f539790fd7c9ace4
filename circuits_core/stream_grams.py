"""Residual-stream Gram matrices of every writer and reader, and their inner products for all pairs at once.

Paper section: "The Residual Stream as a Communication Channel" (Elhage et al. 2021; paper-math 2.1).
Row-vector convention. How much a reader W_r [d, n_out] reads of a writer W_w [n_in, d] depends only on the two
d_model x d_model Gram matrices G_w = W_w^T W_w and H_r = W_r W_r^T:
    ||W_w W_r||_F^2 = <G_w, H_r>_F;   for orthonormal bases, ||U_1^T U_2||_F^2 = <U_1 U_1^T, U_2 U_2^T>_F.
A side is kept as factors G = F^T F2 (F, F2 [N, r, d]; r = d_head for heads, d_mlp for MLPs, a subspace's
dimension for projectors) or, for the vocabulary sides, as the d x d Gram itself. `inner_products` forms each
Gram one column block at a time for all sides at once and multiplies the blocks of every left side with the
same blocks of every right side: the upper block triangle only (the Grams are symmetric, off-diagonal blocks
count twice; composition.py's blocks), so no Gram is ever held whole and no d x d product is formed per pair.
The blocks are read from views of the factors (no copies), and a right side that only needs a prefix of the
left sides (a reader sees only the writers before it) multiplies only that prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.composition import block_pairs, gram_block_size
from circuits_core.cost import check_stop


@dataclass
class GramSide:
    """N symmetric d x d matrices: G_i = F_i^T F2_i (F, F2 [N, r, d]), or given whole (G [N, d, d])."""

    F: Tensor | None = None
    F2: Tensor | None = None
    G: Tensor | None = None

    @property
    def n(self) -> int:
        M = self.G if self.G is not None else self.F
        assert M is not None
        return int(M.shape[0])

    def traces(self) -> Tensor:
        """tr(G_i) [N] (= ||W_i||_F^2 for a Gram, the dimension for a projector)."""
        if self.G is not None:
            return self.G.diagonal(dim1=-2, dim2=-1).sum(-1)
        assert self.F is not None and self.F2 is not None
        return (self.F * self.F2).sum((-2, -1))


def factors(F: Tensor, F2: Tensor | None = None) -> GramSide:
    return GramSide(F=F, F2=F if F2 is None else F2)


def whole(G: Tensor) -> GramSide:
    return GramSide(G=G)


def _block(side: GramSide, a: int, b: int, s: int) -> Tensor:
    """Block (a, b) [N, s, s] of every Gram of a side: F[:, :, a]^T F2[:, :, b] from column slices (views, no
    copies: a transposed factor such as W_U^T slices rows of W_U)."""
    if side.G is not None:
        return side.G[:, a * s : (a + 1) * s, b * s : (b + 1) * s]
    assert side.F is not None and side.F2 is not None
    return side.F[..., a * s : (a + 1) * s].transpose(-2, -1) @ side.F2[..., b * s : (b + 1) * s]


def inner_products(left: list[GramSide], right: list[GramSide], should_stop: Callable[[], bool] | None = None,
                   what: str = "Gram inner products", limits: list[int] | None = None) -> Tensor:
    """<G_i, H_j>_F for every left Gram i and right Gram j: [sum of left N, sum of right N].

    limits (optional, one per right row, non-decreasing): right row j needs only the first limits[j] left rows
    (a reader only sees the writers before it); the other entries are left 0.
    """
    ref = next(s.G if s.G is not None else s.F for s in left + right)
    assert ref is not None
    d = int(ref.shape[-1])
    size = gram_block_size(d)
    pairs, weights = block_pairs(d, size)
    NL, NR = sum(s.n for s in left), sum(s.n for s in right)
    lim = torch.tensor(limits if limits is not None else [NL] * NR)
    if lim.numel() != NR or (lim[1:] < lim[:-1]).any():
        raise ValueError("limits must give one non-decreasing count per right row")
    starts = [0] + [j for j in range(1, NR) if lim[j] != lim[j - 1]] + [NR]  # runs of equal limits
    out = ref.new_zeros(NL, NR)
    for p, (a, b) in enumerate(pairs):
        check_stop(should_stop, what)
        S = torch.cat([_block(x, a, b, size).reshape(x.n, size * size) for x in left])  # [NL, s^2]
        T = torch.cat([_block(x, a, b, size).reshape(x.n, size * size) for x in right])  # [NR, s^2]
        for j0, j1 in zip(starts[:-1], starts[1:], strict=True):
            n = int(lim[j0])
            if n:
                out[:n, j0:j1].addmm_(S[:n], T[j0:j1].T, alpha=float(weights[p]))
    return out
