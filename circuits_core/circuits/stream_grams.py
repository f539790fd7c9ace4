"""Residual-stream Gram matrices of every writer and reader, and their inner products for all pairs at once.

Paper section: "The Residual Stream as a Communication Channel" (Elhage et al. 2021; docs/maths.md §2.1).
Row-vector convention. How much a reader W_r [d, n_out] reads of a writer W_w [n_in, d] depends only on the two
d_model x d_model Gram matrices G_w = W_w^T W_w and H_r = W_r W_r^T:
    ||W_w W_r||_F^2 = <G_w, H_r>_F;   for orthonormal bases, ||U_1^T U_2||_F^2 = <U_1 U_1^T, U_2 U_2^T>_F.
A side is kept as factors G = F^T F2 (F, F2 [N, r, d]; r = d_head for heads, d_mlp for MLPs, d_vocab for the
embedding and unembedding, a subspace's dimension for projectors). `inner_products` forms each
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

from circuits_core.circuits.gram_pair_sums import GRAM_BLOCK, block_pairs, gram_block_size
from circuits_core.cost import check_stop
from circuits_core.schedule import give_way

# Column block on a GPU: the blocked loop below launches one small product per side and block pair, and at
# Llama-3.1-8B shape with GRAM_BLOCK (528 block pairs, 119,328 products) the H200 run spent its time launching them
# (bench/RESULTS.md); 256 makes 136 pairs, with block buffers of (writers + readers) x 256^2 numbers (1.1 GiB).
DEVICE_GRAM_BLOCK = 256


def block_for(device: torch.device) -> int:
    """The Gram column block inner_products uses on `device`: GRAM_BLOCK on the CPU (cache-sized), else
    DEVICE_GRAM_BLOCK."""
    return GRAM_BLOCK if device.type == "cpu" else DEVICE_GRAM_BLOCK


@dataclass
class GramSide:
    """N symmetric d x d matrices G_i = F_i^T F2_i, kept as their factors F, F2 [N, r, d] (views allowed)."""

    F: Tensor
    F2: Tensor

    @property
    def n(self) -> int:
        return int(self.F.shape[0])


def factors(F: Tensor, F2: Tensor | None = None) -> GramSide:
    """The Grams F^T F2 (F^T F when F2 is None) of F [N, r, d]."""
    return GramSide(F, F if F2 is None else F2)


def _block_into(side: GramSide, a: int, b: int, s: int, out: Tensor) -> None:
    """Block (a, b) [N, s, s] of every Gram of a side into `out`: F[:, :, a]^T F2[:, :, b] from column slices
    (views, no copies: a transposed factor such as W_U^T slices rows of W_U)."""
    torch.bmm(side.F[..., a * s : (a + 1) * s].transpose(-2, -1), side.F2[..., b * s : (b + 1) * s], out=out)


def inner_products(
    left: list[GramSide],
    right: list[GramSide],
    should_stop: Callable[[], bool] | None = None,
    what: str = "Gram inner products",
    limits: list[int] | None = None,
    block: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(<G_i, H_j>_F [sum of left N, sum of right N], tr(G_i) [left N], tr(H_j) [right N]).

    The traces come from the diagonal blocks on the way. limits (optional, one per right row, non-decreasing):
    right row j needs only the first limits[j] left rows (a reader only sees the writers before it); the other
    entries are left 0. block: the Gram column block (default: block_for the factors' device).
    """
    ref = (left + right)[0].F
    d = int(ref.shape[-1])
    size = gram_block_size(d, block or block_for(ref.device))
    pairs, weights = block_pairs(d, size)
    NL, NR = sum(s.n for s in left), sum(s.n for s in right)
    lim = torch.tensor(limits if limits is not None else [NL] * NR)
    if lim.numel() != NR or (lim[1:] < lim[:-1]).any():
        raise ValueError("limits must give one non-decreasing count per right row")
    starts = [0] + [j for j in range(1, NR) if lim[j] != lim[j - 1]] + [NR]  # runs of equal limits
    out = ref.new_zeros(NL, NR)
    S = ref.new_empty(NL, size, size)  # block (a, b) of every left Gram
    T = ref.new_empty(NR, size, size)
    traces = ref.new_zeros(NL + NR)
    for p, (a, b) in enumerate(pairs):
        check_stop(should_stop, what)
        give_way()  # a background job's helper pauses here while a request wants its core
        for sides, M in ((left, S), (right, T)):
            i = 0
            for x in sides:
                _block_into(x, a, b, size, M[i : i + x.n])
                i += x.n
        if a == b:
            traces += torch.cat([S, T]).diagonal(dim1=-2, dim2=-1).sum(-1)
        Sf, Tf = S.view(NL, size * size), T.view(NR, size * size)
        for j0, j1 in zip(starts[:-1], starts[1:], strict=True):
            n = int(lim[j0])
            if n:
                out[:n, j0:j1].addmm_(Sf[:n], Tf[j0:j1].T, alpha=float(weights[p]))
    return out, traces[:NL], traces[NL:]


def inner_products_flops(d: int, ranks: list[int], limits: list[int], block: int = GRAM_BLOCK) -> int:
    """FLOPs of inner_products over sides whose Grams G = F^T F2 have inner dimensions `ranks` (one per Gram, left and
    right sides together: r of each F [r, d]), and `limits` (one per right row: the left rows it multiplies), in
    column blocks of `block`: per block pair, each Gram's block [s, r] @ [r, s] and each right row's products with
    its left rows' blocks."""
    size = gram_block_size(d, block)
    pairs = len(block_pairs(d, size)[0])
    return 2 * pairs * size * size * (sum(ranks) + sum(limits))
