"""The global top-k of a large factored matrix A @ B by branch and bound in its balanced singular basis.

The norm bound of global_topk (|A_i . B_:,j| <= ||A_i|| ||B_:,j||) prunes little on real OV circuits: on Gemma-3
270M's L5H1 its 100th value (24,109) is 0.3 of the largest norm product, so a quarter of the 262,144^2 entries had to
be computed. Here the product is first rewritten as A' B' with A' = A M, B' = N B, N = M^-1 and M chosen so that
A' B' is the circuit's SVD split evenly between both sides (U_k sqrt(s_k) and sqrt(s_k) V_k^T): its first HEAD
coordinates carry the large singular values. An entry is then bounded by its head part plus Cauchy-Schwarz on the
rest (a'_H . b'_H + ||a'_T|| ||b'_T||), and whole tiles of rows x columns by boxes around their head coordinates:
rows and columns are grouped into leaves of a k-d split of those coordinates. Tiles, then rows of a tile, then
entries (with REFINE exact coordinates) are bounded against the current k-th value, and only the entries that survive
are computed exactly, from A and B themselves. Every bound carries a margin for M N != I and every rounding
(`basis_error`), so the answer is the exact top-k of A @ B as the dense product computes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from circuits_core.cost import check_stop

HEAD, REFINE, LEAF = 4, 16, 256  # coordinates boxed per leaf; coordinates computed per entry; rows per leaf
# Used on matrices of at least MIN_ENTRIES entries and MIN_INNER inner dimension. Not on the 8,192 x 8,192 (2^26) tables
# of a large vocabulary's default token set: there the norm-ordered tiles of global_topk were faster on SmolLM2-135M
# (one thread, load ~7.5: OV circuits 1.08 s against 1.56 s and 0.60 against 0.79 s, the dense L0 MLP's table 4.8 s
# against 7.5 s), while on whole vocabularies (Gemma-3's 262,144^2) this search is ~18x faster than the tiles.
MIN_ENTRIES, MIN_INNER = 2**27, 4 * REFINE
GRAM_ROWS = 32768  # rows (columns) of A (B) sampled for the basis: it only needs to be good, not exact
EVAL_MARGIN = 2.0**-12  # relative margin for the float evaluation of the bounds (their error is < 64 u of it)
TILE_BATCH = 8192  # tiles bounded per step, in descending order of their bound


def usable(A: Tensor, B: Tensor) -> bool:
    """Whether A [l, m] @ B [m, r] is large enough for this search (and its factors finite floats)."""
    ldim, mdim = A.shape
    return (
        ldim * B.shape[1] >= MIN_ENTRIES
        and mdim >= MIN_INNER
        and A.dtype in (torch.float32, torch.float64)
        and bool(torch.isfinite(A).all())
        and bool(torch.isfinite(B).all())
    )


def bounded_flops(ldim: int, mdim: int, rdim: int) -> int:
    """Matrix-product FLOPs of topk_bounded at most: the sampled Grams, the two changes of basis, every entry's REFINE
    coordinates and every entry exact (none bounded out)."""
    grams = 2 * (min(ldim, GRAM_ROWS) + min(rdim, GRAM_ROWS)) * mdim * mdim
    return grams + 2 * (ldim + rdim) * mdim * mdim + 2 * ldim * rdim * (REFINE + mdim)


def balanced_basis(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor, float]:
    """M, N = M^-1 [m, m] (A's dtype) putting A @ B in its balanced singular basis, and the relative error bound eta:
    |a M . N b - fl(a . b)| <= eta ||a|| ||b|| for the rows a of A and columns b of B (M N != I and the roundings of
    a M, N b and the exact product). The Grams come from a strided sample; any invertible M is correct."""
    ldim, mdim = A.shape
    GA = A[:: max(1, ldim // GRAM_ROWS)].double()
    GB = B[:, :: max(1, B.shape[1] // GRAM_ROWS)].double()
    GA, GB = GA.T @ GA, GB @ GB.T  # [m, m]
    eye = torch.eye(mdim, dtype=torch.float64, device=A.device)
    try:
        RA = torch.linalg.cholesky(GA + eye * GA.diagonal().mean() * 1e-10).mH  # GA = RA^T RA
        RB = torch.linalg.cholesky(GB + eye * GB.diagonal().mean() * 1e-10).mH
        U, S, _ = torch.linalg.svd(RA @ RB.mH)
        M = torch.linalg.solve_triangular(RA, U * S.sqrt(), upper=True)  # RA^-1 U sqrt(S)
        N = torch.linalg.inv(M)
    except RuntimeError:  # a rank-deficient sample: the plain basis (the norm bound with head coordinates)
        M = N = eye
    if not (bool(torch.isfinite(M).all()) and bool(torch.isfinite(N).all())):
        M = N = eye
    Mf, Nf = M.to(A.dtype), N.to(A.dtype)
    u = torch.finfo(A.dtype).eps / 2
    gamma = mdim * u / (1 - mdim * u)
    Md, Nd = Mf.double(), Nf.double()
    eta = float(torch.linalg.matrix_norm(Md @ Nd - eye, 2)) + 3 * gamma * float(Md.norm() * Nd.norm()) + gamma
    return Mf, Nf, eta


def _kd_leaves(X: Tensor, weight: Tensor) -> Tensor:
    """Leaves [L, S] of row indices of X [n, h] (padded with n): halves split at the median of the coordinate whose
    range (times `weight`) is widest, until leaves hold at most LEAF rows."""
    n = X.shape[0]
    levels = max(0, math.ceil(math.log2(n / LEAF)))
    L, S = 1, math.ceil(n / 2**levels) * 2**levels
    perm = torch.arange(S, device=X.device)
    X = torch.cat([X, X[-1:].expand(S - n, -1)])  # pads repeat the last row: boxes stay valid
    while L < 2**levels:
        Xs = X[perm].view(L, S // L, -1)  # [L, size, h]
        dim = ((Xs.amax(1) - Xs.amin(1)) * weight).argmax(1)  # [L]
        key = Xs.gather(2, dim[:, None, None].expand(L, S // L, 1))[..., 0]  # [L, size]
        perm = perm.view(L, -1).gather(1, key.argsort(dim=1)).view(-1)
        L *= 2
    perm[perm >= n] = n
    return perm.view(L, -1)


class _Side:
    """One factor in the basis: head and refine coordinates, tail norms, norms, and its k-d leaves' boxes."""

    def __init__(self, X: Tensor, T: Tensor) -> None:
        # X [n, m] rows of A (or columns of B); T [m, m] the change of basis (M, or N^T)
        n = X.shape[0]
        norms, rot_norms = X.norm(dim=1), torch.empty(n, dtype=X.dtype, device=X.device)
        refine = torch.empty(n, REFINE, dtype=X.dtype, device=X.device)
        tail_h, tail_r = torch.empty_like(rot_norms), torch.empty_like(rot_norms)
        for s in range(0, n, 65536):  # [<=65536, m] at a time
            Xp = X[s : s + 65536] @ T
            refine[s : s + 65536] = Xp[:, :REFINE]
            rot_norms[s : s + 65536] = Xp.norm(dim=1)
            tail_h[s : s + 65536] = Xp[:, HEAD:].norm(dim=1)
            tail_r[s : s + 65536] = Xp[:, REFINE:].norm(dim=1)
        pad = lambda t: torch.cat([t, torch.full_like(t[:1], float("nan"))])  # noqa: E731 - index n: a pad
        self.n, self.refine, self.norms, self.rot_norms = n, pad(refine), pad(norms), pad(rot_norms)
        self.tail_h, self.tail_r = pad(tail_h), pad(tail_r)
        self.head = self.refine[:, :HEAD]
        self.refine_tail = torch.cat([self.refine, self.tail_r[:, None]], 1)  # [n + 1, REFINE + 1]: one product
        # gives an entry's REFINE coordinates plus its tail's Cauchy-Schwarz bound

    def split(self, weight: Tensor) -> None:
        self.leaves = _kd_leaves(self.head[: self.n], weight)  # [L, S]
        H = self.head[self.leaves]  # [L, S, h] (pads repeat a real row's coordinates)
        self.lo, self.hi = H.nan_to_num(float("inf")).amin(1), H.nan_to_num(float("-inf")).amax(1)  # [L, h]
        self.max_tail = self.tail_h[self.leaves].nan_to_num(0.0).amax(1)  # [L]
        self.max_norm = self.norms[self.leaves].nan_to_num(0.0).amax(1)
        self.max_rot = self.rot_norms[self.leaves].nan_to_num(0.0).amax(1)


def topk_bounded(
    A: Tensor, B: Tensor, k: int, should_stop: Callable[[], bool] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The k largest entries of A [l, m] @ B [m, r]: (values [k] descending, rows [k], columns [k])."""
    M, N, eta = balanced_basis(A, B)
    rows, cols = _Side(A, M), _Side(B.T, N.T)
    rows.split(cols.head[: cols.n].abs().mean(0))  # a coordinate matters as much as the other side makes it
    cols.split(rows.head[: rows.n].abs().mean(0))
    eps = EVAL_MARGIN

    # every tile (row leaf x column leaf), bounded: head boxes, tail norms, margins
    LA, LB = rows.lo.shape[0], cols.lo.shape[0]
    tile = torch.zeros(LA, LB, dtype=A.dtype, device=A.device)
    for h in range(HEAD):
        a_lo, a_hi, b_lo, b_hi = rows.lo[:, h, None], rows.hi[:, h, None], cols.lo[None, :, h], cols.hi[None, :, h]
        tile += torch.maximum(torch.maximum(a_lo * b_lo, a_lo * b_hi), torch.maximum(a_hi * b_lo, a_hi * b_hi))
    tile += rows.max_tail[:, None] * cols.max_tail[None]
    tile += eta * rows.max_norm[:, None] * cols.max_norm[None] + eps * rows.max_rot[:, None] * cols.max_rot[None]
    bounds, order = tile.flatten().sort(descending=True)  # [LA * LB]

    best_v = torch.empty(0, dtype=A.dtype, device=A.device)
    best_r = torch.empty(0, dtype=torch.long, device=A.device)
    best_c = torch.empty(0, dtype=torch.long, device=A.device)

    def merge(v: Tensor, r: Tensor, c: Tensor) -> None:
        nonlocal best_v, best_r, best_c
        cand_v, cand_r, cand_c = torch.cat([best_v, v]), torch.cat([best_r, r]), torch.cat([best_c, c])
        best_v, pick = cand_v.topk(min(k, cand_v.numel()))
        best_r, best_c = cand_r[pick], cand_c[pick]

    def threshold() -> float:
        return float(best_v[-1]) if best_v.numel() == k else -math.inf

    # seed: the highest-bounded tiles computed whole, until they hold 4k entries
    seed = min(bounds.numel(), max(4, math.ceil(4 * k / LEAF**2)))
    for t in order[:seed].tolist():
        r_idx, c_idx = rows.leaves[t // LB], cols.leaves[t % LB]
        r_idx, c_idx = r_idx[r_idx < rows.n], c_idx[c_idx < cols.n]
        block = A[r_idx] @ B[:, c_idx]  # [<=S, <=S], exact
        v, flat = block.flatten().topk(min(k, block.numel()))
        merge(v, r_idx[flat // c_idx.numel()], c_idx[flat % c_idx.numel()])

    for b0 in range(seed, bounds.numel(), TILE_BATCH):
        check_stop(should_stop, "global top-k")
        tau = threshold()
        live = bounds[b0 : b0 + TILE_BATCH] >= tau
        if not bool(live.any()):
            break  # the tiles are in descending order of their bound
        tiles = order[b0 : b0 + TILE_BATCH][live]
        R, C = tiles // LB, tiles % LB  # [T]
        # rows of each live tile against its column leaf's box
        r_idx = rows.leaves[R]  # [T, S]
        a = rows.head[r_idx]  # [T, S, h]
        row_bound = (a.clamp(min=0) * cols.hi[C][:, None]).sum(-1) + (a.clamp(max=0) * cols.lo[C][:, None]).sum(-1)
        row_bound += rows.tail_h[r_idx] * cols.max_tail[C][:, None]
        row_bound += (
            eta * rows.norms[r_idx] * cols.max_norm[C][:, None] + eps * rows.rot_norms[r_idx] * cols.max_rot[C][:, None]
        )
        keep = (row_bound >= tau).nonzero()  # NaN (pads) never pass: [P, 2] (tile, row slot)
        pair_rows, pair_cols = r_idx[keep[:, 0], keep[:, 1]], C[keep[:, 0]]  # [P]
        by_leaf = pair_cols.argsort()
        leaves, counts = pair_cols[by_leaf].unique_consecutive(return_counts=True)
        for leaf, ri in zip(leaves.tolist(), pair_rows[by_leaf].split(counts.tolist()), strict=True):
            check_stop(should_stop, "global top-k")  # entries of the surviving rows [p], by column leaf
            tau = threshold()
            ci = cols.leaves[leaf]
            ci = ci[ci < cols.n]  # [c]
            entry = rows.refine_tail[ri] @ cols.refine_tail[ci].T  # [p, c]
            entry += (eta * rows.norms[ri] * cols.max_norm[leaf] + eps * rows.rot_norms[ri] * cols.max_rot[leaf])[
                :, None
            ]
            er = (entry >= tau).any(1).nonzero()[:, 0]  # [q]
            if er.numel() == 0:
                continue
            sub = ri[er]  # rows with a surviving entry: their exact block (one product, no gathers)
            block = A[sub] @ B[:, ci]  # [p', c]
            keep_e = (block >= tau).nonzero()
            merge(block[keep_e[:, 0], keep_e[:, 1]], sub[keep_e[:, 0]], ci[keep_e[:, 1]])
    return best_v, best_r, best_c
