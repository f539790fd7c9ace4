"""The global top-k of a large factored matrix A @ B by Cauchy-Schwarz in its balanced singular basis.

The norm bound of global_topk (|A_i . B_:,j| <= ||A_i|| ||B_:,j||) prunes little on real OV circuits: on Gemma-3
270M's L5H1 its 100th value (24,109) is 0.3 of the largest norm product, and 26 % of the 262,144^2 pairs have a norm
product above it. The same bound taken after a change of basis is far tighter: with A' = A M and B' = N B,
N = M^-1, and M chosen so that A' B' is the circuit's SVD split evenly between both sides (U_k sqrt(s_k) and
sqrt(s_k) V_k^T), an entry is a'_i . b'_j <= ||a'_i|| ||b'_j||, and that product is at least the 100th value for
2e-4 of the pairs. Rows sorted by ||a'_i|| and columns by ||b'_j||, the pairs left form a staircase (row i needs the
first J_i columns, J_i falling with i): row blocks are multiplied exactly, from A and B themselves, in column chunks
that each take only the block's rows whose bound reaches the chunk's first column, and the k-th value found so far
shortens the staircase as it rises.

Each bound carries margins for M N != I and for every rounding (the change of basis, the norms, and the dense
product's own), so the answer is the exact top-k of A @ B as the dense product computes it (docs/maths.md §5.13).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from circuits_core.cost import check_stop

# Used on matrices of at least MIN_ENTRIES entries and MIN_INNER inner dimension. Not on the 8,192 x 8,192 (2^26)
# tables of a large vocabulary's default token set, where the norm-ordered tiles of global_topk were measured faster
# with the earlier version of this search; on whole vocabularies (Gemma-3's 262,144^2) this one is far faster.
MIN_ENTRIES, MIN_INNER = 2**27, 64
GRAM_ROWS = 8192  # rows (columns) of A (B) sampled for the basis: it only needs to be good, not exact
CHUNK = 32768  # rows (columns) changed to the basis at once: [CHUNK, m]
SQUARES = 2048  # columns squared and summed at once (a temporary [m, SQUARES] that stays in cache)
SEED = 256  # the exact seed block: the first SEED rows x columns in bound order give the first k-th value
# The staircase is multiplied out in row blocks of at most ROWS_MAX rows, each in column chunks of at most COLS columns
# and CHUNK_ENTRIES entries (4 MiB in float32): a chunk is read back from cache, and only the block's rows that reach
# its first column are multiplied. On 49,152^2 products with inner dimension 64 (where no bound prunes), chunks of
# 1024 x 1024 took 0.4x the time of one 85 x 49,152 block per 2^22 entries.
CHUNK_ENTRIES, COLS, ROWS_MAX = 2**20, 1024, 16384
# What the staircase costs per entry it multiplies out, against what global_topk's norm-ordered tiles cost per entry of
# theirs (staircase_is_cheaper), screened in bfloat16 or not. Measured on random 49,152^2 products of inner dimension
# 64, where neither bound prunes (AVX-512/AMX CPU, 2 cores): screened 0.95-1.06 s against 0.56-0.59 s for the tiles,
# in float32 1.61 s against 2.22-2.32 s.
STAIRCASE_ENTRY_COST = {True: 1.7, False: 0.7}
NORM_SAMPLE = 4096  # rows and columns (strided) on which the tiles' count is taken: sorting all norms took 3 ms of 6


def usable(A: Tensor, B: Tensor) -> bool:
    """Whether A [l, m] @ B [m, r] is large enough for this search, its factors finite floats, and float32 products
    computed in float32 (the margins assume each product rounds in the factors' own precision)."""
    ldim, mdim = A.shape
    return (
        ldim * B.shape[1] >= MIN_ENTRIES
        and mdim >= MIN_INNER
        and A.dtype in (torch.float32, torch.float64)
        and (A.dtype == torch.float64 or torch.get_float32_matmul_precision() == "highest")
        and bool(torch.isfinite(A.sum()))  # a non-finite entry (or an overflow) makes the sum non-finite
        and bool(torch.isfinite(B.sum()))
    )


def bounded_flops(ldim: int, mdim: int, rdim: int) -> int:
    """Matrix-product FLOPs of topk_bounded at most: the sampled Grams, the two changes of basis and every entry exact
    (none bounded out)."""
    grams = 2 * (min(ldim, GRAM_ROWS) + min(rdim, GRAM_ROWS)) * mdim * mdim
    return grams + 2 * (ldim + rdim) * mdim * mdim + 2 * ldim * rdim * mdim


def bounded_peak_bytes(ldim: int, mdim: int, rdim: int, element_size: int) -> int:
    """Most extra bytes topk_bounded holds at once: a chunk in the basis, four float64 bounds and an order per row and
    column (and their sorted copies), the columns the staircase reads (at most all of B), one row block's rows, its
    chunk buffer, the rows of a chunk that may enter and the chunk's comparison with the k-th value."""
    per_index = 4 * 8 + 2 * 8
    return (
        CHUNK * mdim * element_size
        + (ldim + rdim) * per_index
        + mdim * rdim * element_size
        + (2 * CHUNK_ENTRIES + min(ldim, ROWS_MAX) * mdim) * element_size
        + CHUNK_ENTRIES
        + 2 * mdim * mdim * 8
    )


def balanced_basis(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """M, N ~ M^-1 [m, m] (A's dtype) putting A @ B in its balanced singular basis (the identity when the sampled Grams
    are singular). The Grams come from a strided sample: any invertible M is correct, the margins of topk_bounded
    measure how far M N is from I."""
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
    except RuntimeError:  # a rank-deficient sample: the plain basis (the norm bound)
        M = N = eye
    if not (bool(torch.isfinite(M).all()) and bool(torch.isfinite(N).all())):
        M = N = eye
    return M.to(A.dtype), N.to(A.dtype)


def basis_defect(M: Tensor, N: Tensor) -> float:
    """An upper bound on ||M N - I||_2 for M, N [m, m] (N ~ M^-1): M N in float64 rounds by at most
    m u64 ||M||_F ||N||_F (the products of float32 entries are exact in float64)."""
    Md, Nd = M.double(), N.double()
    eye = torch.eye(M.shape[0], dtype=torch.float64, device=M.device)
    u64 = torch.finfo(torch.float64).eps
    return float(torch.linalg.matrix_norm(Md @ Nd - eye, 2)) + M.shape[0] * u64 * float(Md.norm() * Nd.norm())


def rounding(mdim: int, dtype: torch.dtype) -> float:
    """gamma_(m+2) = (m+2) u / (1 - (m+2) u): the relative error bound of an inner product of length m in `dtype`
    (Higham's gamma), with room for the square root and the division of a norm."""
    u = torch.finfo(dtype).eps / 2
    return (mdim + 2) * u / (1 - (mdim + 2) * u)


def _norm_bounds(
    X: Tensor, T: Tensor, abs_T: float, gamma: float, should_stop: Callable[[], bool] | None, columns: bool = False
) -> tuple[Tensor, Tensor]:
    """Upper bounds (float64) on ||x T|| and ||x|| for the rows x of X [n, m], T [m, m] in X's dtype; with `columns`,
    on ||T x|| and ||x|| for the columns x of X [m, n] (read in place: no transposed copy).

    y = fl(x T) is within gamma |x| |T| of x T entrywise, so ||x T|| <= ||y|| + gamma ||x|| || |T| ||_2 (abs_T);
    each computed norm is within a factor (1 + gamma) of the norm it rounds."""
    n = X.shape[1] if columns else X.shape[0]
    rot = torch.empty(n, dtype=torch.float64, device=X.device)
    norm = torch.empty(n, dtype=torch.float64, device=X.device)
    # one buffer for every chunk's product: a fresh [CHUNK, m] each time is mapped and zeroed anew by the system
    buf = torch.empty(min(n, CHUNK), T.shape[1], dtype=X.dtype, device=X.device)
    for s in range(0, n, CHUNK):
        check_stop(should_stop, "global top-k")
        if columns:  # reductions over the leading dimension are ~7x slower in torch: products and sums in rows
            x = X[:, s : s + CHUNK]  # [m, <=CHUNK]
            y = torch.matmul(x.T, T.T, out=buf[: x.shape[1]])  # [<=CHUNK, m]: (T x)^T
            rot[s : s + CHUNK] = torch.linalg.vector_norm(y, dim=1)
            squares = [x[:, j : j + SQUARES].square().sum(0) for j in range(0, x.shape[1], SQUARES)]
            norm[s : s + CHUNK] = torch.cat(squares).sqrt()
        else:
            x = X[s : s + CHUNK]  # [<=CHUNK, m]
            rot[s : s + CHUNK] = torch.linalg.vector_norm(torch.matmul(x, T, out=buf[: x.shape[0]]), dim=1)
            norm[s : s + CHUNK] = torch.linalg.vector_norm(x, dim=1)
    norm *= 1 + 2 * gamma
    rot *= 1 + 2 * gamma
    return rot + gamma * abs_T * norm, norm


class Bounds(NamedTuple):
    """Upper bounds (float64, >= 0): p [l], q [r] of _bound_factors, and the plain norms ||A_i|| [l], ||B_:,j|| [r]."""

    p: Tensor
    q: Tensor
    norm_a: Tensor
    norm_b: Tensor


def _bound_factors(A: Tensor, B: Tensor, should_stop: Callable[[], bool] | None) -> Bounds | None:
    """p [l], q [r] (float64, >= 0) with fl(A_i . B_:,j) <= p_i q_j for every entry as the dense product rounds it, with
    the bounds on ||A_i|| and ||B_:,j|| they are made from, or None when a bound is not finite.

    A_i . B_j = (A_i M)(N B_j) + A_i (I - M N) B_j, so with D = ||M N - I||_2 and the product's own rounding gamma,
    fl(A_i . B_j) <= ||A_i M|| ||N B_j|| + (D + gamma) ||A_i|| ||B_j|| <= p_i q_j with p_i = ||A_i M|| + c ||A_i||,
    q_j = ||N B_j|| + c ||B_j||, c = sqrt(D + gamma) (the cross terms are >= 0)."""
    mdim = A.shape[1]
    M, N = balanced_basis(A, B)
    gamma = rounding(mdim, A.dtype)
    Md, Nd = M.double(), N.double()
    u64 = torch.finfo(torch.float64).eps
    D = basis_defect(M, N)
    abs_M = float(torch.linalg.matrix_norm(Md.abs(), 2)) * (1 + 1e-10)
    abs_N = float(torch.linalg.matrix_norm(Nd.abs(), 2)) * (1 + 1e-10)
    rot_a, norm_a = _norm_bounds(A, M, abs_M, gamma, should_stop)
    if B.T.is_contiguous():  # columns stored contiguously (a transposed [r, m] factor): rows of B^T, ||B_j^T N^T||
        rot_b, norm_b = _norm_bounds(B.T, N.T, abs_N, gamma, should_stop)
    else:
        rot_b, norm_b = _norm_bounds(B, N, abs_N, gamma, should_stop, columns=True)
    c = math.sqrt(D + gamma)
    p = (rot_a + c * norm_a) * (1 + 16 * u64)  # the float64 arithmetic of the bound itself
    q = (rot_b + c * norm_b) * (1 + 16 * u64)
    if not (bool(torch.isfinite(p).all()) and bool(torch.isfinite(q).all())):
        return None
    return Bounds(p, q, norm_a, norm_b)


def topk_bounded(
    A: Tensor,
    B: Tensor,
    k: int,
    should_stop: Callable[[], bool] | None = None,
    screen: tuple[torch.dtype, float] | None = None,
    or_tiles: bool = False,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """The k largest entries of A [l, m] @ B [m, r]: (values [k] descending, rows [k], columns [k]), or None when the
    bounds are not finite (an overflow), or, with `or_tiles`, when global_topk's norm-ordered tiles are estimated to
    cost less once the seed is known (staircase_is_cheaper): then the caller searches without them.

    `screen` = (dtype, margin): the staircase's products are first computed in that dtype (global_topk's bfloat16
    screen, where the device multiplies it fast), each within margin ||A_i|| ||B_:,j|| of the entry; entries within
    that of the k-th value are recomputed exactly, so the answer is the same."""
    bounds = _bound_factors(A, B, should_stop)
    if bounds is None:
        return None
    (p, row_order), (q, col_order) = bounds.p.sort(descending=True), bounds.q.sort(descending=True)
    exact = lambda rows, cols: A[rows] @ B[:, cols]  # noqa: E731 - the products are the entries
    seeded = seed(row_order, col_order, k, exact)
    if or_tiles and not staircase_is_cheaper(bounds, p, q, float(seeded.values[-1]), screen is not None):
        return None
    if screen is None:
        return staircase(A, B, p, row_order, q, col_order, k, exact, should_stop=should_stop, seeded=seeded)
    dtype, relative = screen
    # the bounds on ||A_i|| and ||B_:,j||, in bound order, for the margin of each chunk of the staircase
    norm_a, norm_b = bounds.norm_a[row_order], bounds.norm_b[col_order]  # [l], [r]

    def margin(i0: int, i1: int, c0: int, c1: int) -> float:
        return relative * float(norm_a[i0:i1].max()) * float(norm_b[c0:c1].max())

    return staircase(A, B, p, row_order, q, col_order, k, exact, margin, should_stop, dtype, seeded)


def pairs_reaching(x: Tensor, y: Tensor, tau: float) -> int:
    """How many pairs (i, j) have x_i y_j >= tau, for x [l] and y [r] (float64, >= 0), y sorted in descending order."""
    if tau <= 0:
        return x.numel() * y.numel()
    return int(torch.searchsorted(-y, -tau / x, right=True).sum())  # (x_i = 0: -inf, no column)


def staircase_is_cheaper(bounds: Bounds, p: Tensor, q: Tensor, tau: float, screened: bool) -> bool:
    """Whether the staircase is estimated to cost less than global_topk's norm-ordered tiles, given a lower bound tau
    of the k-th value (the seed's) and the sorted bounds p [l], q [r].

    Each search multiplies out the entries its bound cannot rule out against the k-th value: the staircase those with
    p_i q_j >= tau, the tiles those with ||A_i|| ||B_:,j|| >= tau (counted entry by entry, from the norms' bounds, on
    NORM_SAMPLE strided rows and columns). Their work is taken as these shares of the entries at the seed's k-th value,
    weighted by STAIRCASE_ENTRY_COST. On circuits of trained models the basis prunes far more (real SmolLM2-135M's QK
    at offset 5 and formed OV: 3-25 % of the entries against 26-100 % for the norms; Gemma-3 270M's L5H1 OV 0.04 %
    against 31 %); on random weights neither prunes (both 99.99 %), and the tiles' bfloat16 screen is the faster per
    entry."""
    norm_a = bounds.norm_a[:: max(1, p.numel() // NORM_SAMPLE)]  # [< 2 NORM_SAMPLE]
    norm_b = bounds.norm_b[:: max(1, q.numel() // NORM_SAMPLE)].sort(descending=True).values
    tiles = pairs_reaching(norm_a, norm_b, tau) / (norm_a.numel() * norm_b.numel())
    return STAIRCASE_ENTRY_COST[screened] * pairs_reaching(p, q, tau) / (p.numel() * q.numel()) < tiles


Margin = Callable[[int, int, int, int], float]


class Seed(NamedTuple):
    """The k largest entries (values [k] descending, rows [k], columns [k]) of the seed block: the first n_rows rows x
    n_cols columns in bound order, exact. Its k-th value is a lower bound of the answer's."""

    values: Tensor
    rows: Tensor
    cols: Tensor
    n_rows: int
    n_cols: int


def seed(row_order: Tensor, col_order: Tensor, k: int, exact_block: Callable[[Tensor, Tensor], Tensor]) -> Seed:
    """The seed block of staircase's matrix (row_order [l], col_order [r]: rows and columns in bound order), at least
    SEED x SEED and k entries, multiplied out by exact_block."""
    ldim, rdim = row_order.numel(), col_order.numel()
    seed_c = min(rdim, max(SEED, math.ceil(k / min(ldim, SEED))))
    seed_r = min(ldim, max(SEED, math.ceil(k / seed_c)))  # seed_r * seed_c >= k (k <= ldim * rdim)
    block = exact_block(row_order[:seed_r], col_order[:seed_c])  # [seed_r, seed_c]
    values, flat = block.flatten().topk(k)
    return Seed(values, row_order[flat // seed_c], col_order[flat % seed_c], seed_r, seed_c)


def staircase(
    A: Tensor,
    B: Tensor,
    p: Tensor,
    row_order: Tensor,
    q: Tensor,
    col_order: Tensor,
    k: int,
    exact_block: Callable[[Tensor, Tensor], Tensor],
    margin: Margin | None = None,
    should_stop: Callable[[], bool] | None = None,
    products: torch.dtype | None = None,
    seeded: Seed | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The k largest entries of a matrix C [l, r] whose entries are bounded by C_ij <= p_i q_j, multiplied out
    from A [l, m] @ B [m, r]: the entries themselves (margin None) or approximations of them within
    margin(i0, i1, c0, c1) on rows i0:i1 and columns c0:c1 in bound order. p [l] and q [r] (float64, >= 0) come
    sorted in descending order, row_order and col_order the rows and columns they belong to. exact_block(rows, cols)
    gives C[rows][:, cols] as the answer must hold it: the seed block, and the entries an approximation leaves within
    its margin of the k-th value. `products`: the dtype the approximations are multiplied in (the rows and columns
    the staircase reads are converted as they are gathered), default the factors' own. `seeded`: the seed, when the
    caller has already multiplied it out (default: seed)."""
    ldim = A.shape[0]
    seeded = seeded if seeded is not None else seed(row_order, col_order, k, exact_block)
    best_v, best_r, best_c, seed_r, seed_c = seeded

    neg_p, neg_q = -p, -q  # ascending, for searchsorted

    def reach(bounds: Tensor, neg_bounds: Tensor, bound: float, tau: float) -> int:
        """How many of the sorted `bounds` (p or q) reach tau with the other factor `bound`: bounds * bound >= tau."""
        if tau <= 0:
            return int((bounds * bound >= tau).sum())
        return 0 if bound <= 0 else int(torch.searchsorted(neg_bounds, -tau / bound, right=True))

    tau = float(best_v[-1])
    reached = col_order[: reach(q, neg_q, float(p[0]), tau)]  # every column any row may need, in bound order
    # [m, J]: B's columns gathered as they are stored (a contiguous column stays one, and a chunk of them is read as
    # the transposed operand of each product: 0.1-0.2 s less on Gemma-3's L5H1 than a row-major copy)
    B_reach = B.T[reached].T if B.T.is_contiguous() else B[:, reached].contiguous()
    if products is not None:
        B_reach = B_reach.to(products)
    buf = torch.empty(CHUNK_ENTRIES, dtype=products or torch.result_type(A, B), device=A.device)
    i0 = 0
    while i0 < ldim:
        J = reach(q, neg_q, float(p[i0]), tau)  # the block's first row reaches the most columns
        if J == 0:
            break  # rows come in descending bound: no later row reaches a column either
        cols = min(J, COLS)
        i1 = min(ldim, i0 + max(1, min(ROWS_MAX, CHUNK_ENTRIES // cols)))
        A_rows = A[row_order[i0:i1]] if products is None else A[row_order[i0:i1]].to(products)  # [b, m]
        for c0 in range(0, J, cols):  # column chunks: each product [n, <= cols] stays in cache while it is read
            check_stop(should_stop, "global top-k")
            n = min(i1, reach(p, neg_p, float(q[c0]), tau)) - i0  # the block's rows whose bound reaches c0
            if n <= 0:
                break  # later chunks' columns have smaller bounds still
            c1 = min(J, c0 + cols)
            block = torch.matmul(A_rows[:n], B_reach[:, c0:c1], out=buf[: n * (c1 - c0)].view(n, c1 - c0))
            if i0 < seed_r and c0 < seed_c:
                block[: seed_r - i0, : seed_c - c0] = -math.inf  # the seed's entries are candidates already
            floor = tau
            if margin is not None:  # (less a rounding of the threshold to the block's dtype, which may raise it)
                floor = tau - margin(i0, i0 + n, c0, c1)
                floor -= abs(floor) * torch.finfo(block.dtype).eps
            live = (block.amax(dim=1) >= floor).nonzero()[:, 0]  # [h]: the rows with an entry that may enter
            if live.numel() == 0:
                continue
            hit = (block[live] >= floor).nonzero()  # [h', 2]
            rows, cols_hit = row_order[i0 + live[hit[:, 0]]], col_order[c0 + hit[:, 1]]  # [h'] each
            if margin is None:  # the products are the entries
                values = block[live[hit[:, 0]], hit[:, 1]]
            else:  # the entries themselves, from the hits' rows and columns
                (u_r, i_r), (u_c, i_c) = (x.unique(return_inverse=True) for x in (rows, cols_hit))
                values = exact_block(u_r, u_c)[i_r, i_c]
            cand_v = torch.cat([best_v, values])
            cand_r = torch.cat([best_r, rows])
            cand_c = torch.cat([best_c, cols_hit])
            best_v, pick = cand_v.topk(k)
            best_r, best_c = cand_r[pick], cand_c[pick]
            tau = float(best_v[-1])
        i0 = i1
    return best_v, best_r, best_c
