"""The global top-k of a factored matrix A @ B without forming it: norm-ordered tiles, a Cauchy-Schwarz bound, and a
bfloat16 screen with a proven error margin.

Paper section: "Summarizing OV/QK Matrices" (Elhage et al. 2021) reads a head's full circuits through their
largest entries ("head dumps"); a full OV circuit of GPT-2 is 50257 x 50257 = 10 GB in fp32, so the search only
ever holds tiles sized by a byte budget. Rows (by ||A_i||) and columns (by ||B_:,j||) are visited in descending
norm order; no entry of a tile exceeds ||A_i|| ||B_:,j|| in absolute value, so tiles bounded below the current
k-th value are skipped, and large tiles are screened in bfloat16 before the surviving rows are recomputed exactly.
The entry point is FactoredMatrix.topk_global (factored.py); this module is its search and its price.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from circuits_core.circuits import global_topk_bounds, global_topk_folded
from circuits_core.circuits.product_factor import ProductFactor
from circuits_core.cost import Cost, check_stop
from circuits_core.model.half_products import half_products_fast

# Tile of the product computed at once by topk_global (64 MiB in fp32): few large GEMM calls (small ones
# suffer most from thread contention), yet column tiles the norm bound can skip.
TILE_ROWS, TILE_COLS = 1024, 16384
# The first row block is only SEED_ROWS rows (computed exactly): it yields the k-th value that lets every later
# tile be screened (and bounded), instead of a whole exact TILE_ROWS block ranked row by row.
SEED_ROWS = 32
# Screening: once k values are known, tiles of matrices with at least SCREEN_MIN_ENTRIES entries are first
# computed in bfloat16 (about 3x faster on CPUs with bf16 GEMM). With bf16 inputs (unit roundoff u = 2^-9)
# and fp32 accumulation, |approx - exact| <= (3u + O(u^2)) ||A_i|| ||B_:,j|| (the output rounding included);
# SCREEN_MARGIN = 2^-6 = 8u leaves a factor > 2 of slack. Rows whose approximate maximum comes within the
# margin of the k-th value are recomputed exactly, so the result is exact. Screening is only used where a
# probe shows that bf16 products are accumulated in fp32, and where they are faster than float32 ones
# (half_products_fast: CPUs with AVX2 only emulate them, 28x slower).
SCREEN_DTYPE, SCREEN_MARGIN, SCREEN_MIN_ENTRIES = torch.bfloat16, 2.0**-6, 2**24
_screen_ok: dict[torch.device, bool] = {}


def topk_global_cost(
    ldim: int, mdim: int, rdim: int, k: int, budget_bytes: int, element_size: int, batch: int = 1
) -> Cost:
    """Cost of FactoredMatrix.topk_global on [batch] matrices [ldim, mdim] @ [mdim, rdim] (one at a time).

    Peak: the norm-sorted copy of A and the column tiles of B, their bfloat16 copies when screened, the 4
    tile buffers (at most budget_bytes) and the candidates, or on large matrices the larger of that and what the
    search of global_topk_bounds holds (global_topk_bounds.bounded_peak_bytes, its bfloat16 copies when screened, its
    seed and candidates); answer:
    batch x k (value, row, column); FLOPs: topk_global_flops per matrix.
    """
    tile_cols = min(TILE_COLS, rdim)
    step = max(1, int(budget_bytes) // (4 * tile_cols * element_size))
    tiles = 4 * min(step, TILE_ROWS, ldim) * tile_cols * element_size
    factors = (ldim * mdim + mdim * rdim) * element_size
    screened = ldim * rdim >= SCREEN_MIN_ENTRIES and element_size >= 4  # (float32 or float64 factors only)
    screen = (ldim * mdim + mdim * rdim) * 2 if screened else 0
    sorting = (ldim + rdim) * (element_size + 8)  # norms and orders
    candidates = 2 * k * (min(step, TILE_ROWS, ldim) + 1) * (element_size + 16)
    peak = factors + screen + tiles + sorting + candidates
    if _bounded(ldim, mdim, rdim):  # the tiles are the fallback when its bounds overflow
        seed = k * (element_size + 16) + global_topk_bounds.SEED * max(global_topk_bounds.SEED, k) * element_size
        # and, when screened, the bfloat16 copies of the rows and columns its staircase reads (at most A's and B's)
        peak = max(peak, global_topk_bounds.bounded_peak_bytes(ldim, mdim, rdim, element_size) + screen + 2 * seed)
    flops = batch * topk_global_flops(ldim, mdim, rdim)
    return Cost(peak, flops=flops).with_answer(numbers=3 * k * batch)


def _bounded(ldim: int, mdim: int, rdim: int) -> bool:
    """Whether topk_global_2d takes the search of global_topk_bounds on these sizes (given finite float factors)."""
    return ldim * rdim >= global_topk_bounds.MIN_ENTRIES and mdim >= global_topk_bounds.MIN_INNER


def topk_global_flops(ldim: int, mdim: int, rdim: int) -> int:
    """FLOPs of topk_global_2d on [ldim, mdim] @ [mdim, rdim] when every tile is computed once: 2 ldim mdim rdim.

    This is its count when no tile is bounded out and none is screened (tests/core/test_circuit_flops.py). Tiles
    bounded out (the usual case on real circuits: rows and columns are visited by norm) make it less; a screened
    tile is counted once, as the bfloat16 product that replaces its exact one (about 3x faster), so the exact
    recomputation of the few rows that pass the screen is within the price's slack. Matrices large enough for the
    branch and bound of global_topk_bounds are priced at its own bound when that is larger."""
    dense = 2 * ldim * mdim * rdim
    if _bounded(ldim, mdim, rdim):
        return max(dense, global_topk_bounds.bounded_flops(ldim, mdim, rdim))
    return dense


def _screening_accumulates_in_fp32(device: torch.device) -> bool:
    if device not in _screen_ok:
        # 1 + 63 * 2^-8 = 1.246 with fp32 accumulation (-> 1.25 in bf16); bf16 accumulation stays at 1.0.
        a = torch.tensor([[1.0] + [2.0**-8] * 63], device=device).to(SCREEN_DTYPE).expand(8, 64)
        b = torch.ones(64, 8, device=device, dtype=SCREEN_DTYPE)
        _screen_ok[device] = bool(((a @ b).float() > 1.2).all())
    return _screen_ok[device]


def _row_max(approx: Tensor, positive: bool) -> Tensor:
    """Row maxima [b] of a bfloat16 screen [b, c], read only against a threshold; `positive`: the threshold is > 0.

    Then the maxima are taken on the bits as int16 (~3.5x faster than a bfloat16 amax on CPUs): the int16 order of
    non-negative bfloat16 values is their order and every negative one is below them, so a row with a positive entry
    gets its true maximum and a row without one a value <= 0, below the threshold as its true maximum is."""
    if positive:
        return approx.view(torch.int16).amax(dim=1).view(SCREEN_DTYPE)
    return approx.amax(dim=1)


def topk_global_2d(
    A: Tensor, B: Tensor, k: int, step: int, largest: bool, should_stop: Callable[[], bool] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Global top-k of A [ldim, mdim] @ B [mdim, rdim] (see topk_global).

    Rows (by ||A_i||) and columns (by ||B_:,j||) are visited in descending norm order, in tiles of at most
    min(step, TILE_ROWS) x TILE_COLS entries. Every entry of a tile is bounded by ||A_first row|| * ||B_first col||, so
    once that falls below the current k-th value the rest of the row block (and, for the first tile of a
    block, all later blocks) is skipped. Inside a tile only rows whose maximum beats the k-th value are
    ranked, their maximum first estimated in bfloat16 for large matrices (see SCREEN_MARGIN). Matrices large enough
    for global_topk_bounds take its search instead, with the same screen on its products, where it is estimated to
    multiply out less (global_topk_bounds.staircase_is_cheaper: on circuits of trained models, not on random ones).
    """
    ldim, rdim = A.shape[0], B.shape[1]
    B = B if largest else -B  # smallest entries of AB = largest of A(-B)
    dtype = torch.result_type(A, B)
    screen = (
        SCREEN_DTYPE is not None
        and ldim * rdim >= SCREEN_MIN_ENTRIES
        and dtype in (torch.float32, torch.float64)
        and _screening_accumulates_in_fp32(A.device)
        and half_products_fast(A.device, SCREEN_DTYPE)
    )
    if global_topk_bounds.usable(A, B):  # large circuits: bounds in their singular basis prune far more, unless
        screened = (SCREEN_DTYPE, SCREEN_MARGIN) if screen else None  # they prune too little (random weights)
        found = global_topk_bounds.topk_bounded(A, B, k, should_stop, screened, or_tiles=True)
        if found is not None:
            values, rows, cols = found
            return (values if largest else -values), rows, cols
    row_norms, row_order = A.norm(dim=-1).sort(descending=True)  # [ldim]
    col_norms, col_order = B.norm(dim=0).sort(descending=True)  # [rdim]
    A = A[row_order]  # [ldim, mdim], rows in descending norm
    tile_cols = min(TILE_COLS, rdim)
    tiles = [B[:, col_order[j : j + tile_cols]] for j in range(0, rdim, tile_cols)]  # contiguous [mdim, <=tile_cols]
    tile_rows = min(step, TILE_ROWS)
    buf = torch.empty(min(tile_rows, ldim) * tile_cols, dtype=dtype, device=A.device)
    if screen:
        A_s, tiles_s = A.to(SCREEN_DTYPE), [t.to(SCREEN_DTYPE) for t in tiles]
        buf_s = torch.empty(buf.numel(), dtype=SCREEN_DTYPE, device=A.device)
    best_v = torch.empty(0, dtype=buf.dtype, device=A.device)  # [<= k], sorted descending
    best_r = torch.empty(0, dtype=torch.long, device=A.device)  # positions in row_order
    best_c = torch.empty(0, dtype=torch.long, device=A.device)  # positions in col_order
    seed = min(SEED_ROWS, tile_rows)
    for r0 in [0, *range(seed, ldim, tile_rows)]:
        r1 = min(r0 + (seed if r0 == 0 else tile_rows), ldim)
        for t, tile_B in enumerate(tiles):
            check_stop(should_stop, "global top-k")
            c0, tc = t * tile_cols, tile_B.shape[1]
            full = best_v.numel() == k
            if full and row_norms[r0] * col_norms[c0] < best_v[-1]:
                break  # no entry of this tile, or of the later (smaller-norm) tiles of this block, can enter
            rows = torch.arange(r0, r1, device=A.device)
            if full and screen:
                approx = torch.matmul(A_s[r0:r1], tiles_s[t], out=buf_s[: (r1 - r0) * tc].view(r1 - r0, tc))
                margin = SCREEN_MARGIN * row_norms[r0] * col_norms[c0]
                keep = _row_max(approx, positive=bool(best_v[-1] > margin)).to(dtype) + margin > best_v[-1]  # [b]
                if not bool(keep.any()):
                    continue
                rows = rows[keep]
                block = A[rows] @ tile_B  # [b', tc], exact
            else:
                block = torch.matmul(A[r0:r1], tile_B, out=buf[: (r1 - r0) * tc].view(r1 - r0, tc))  # [b, tc]
            if full:
                keep = block.amax(dim=1) > best_v[-1]  # [b]
                if not bool(keep.any()):
                    continue
                block, rows = block[keep], rows[keep]
            v, c = block.topk(min(k, tc), dim=1)  # [b', k']
            cand_v = torch.cat([best_v, v.reshape(-1)])
            cand_r = torch.cat([best_r, rows[:, None].expand_as(c).reshape(-1)])
            cand_c = torch.cat([best_c, (c + c0).reshape(-1)])
            best_v, pick = cand_v.topk(min(k, cand_v.numel()))
            best_r, best_c = cand_r[pick], cand_c[pick]
        else:
            continue
        if best_v.numel() == k and row_norms[r0] * col_norms[0] < best_v[-1]:
            break  # even the first tile of this block was bounded out: so are all later blocks
    return (best_v if largest else -best_v), row_order[best_r], col_order[best_c]


def topk_products(
    left: ProductFactor, right: ProductFactor, k: int, largest: bool, should_stop: Callable[[], bool] | None = None
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Global top-k of A @ B with A = left [l, m] and B = right^T [m, r] left unformed (global_topk_folded), or None
    where that search does not apply (small or non-finite factors, other dtypes): then the caller forms them."""
    right = right if largest else right.negated()  # smallest entries of AB = largest of A(-B)
    if not global_topk_folded.usable(left, right):
        return None
    found = global_topk_folded.topk_folded(left, right, k, should_stop)
    if found is None:
        return None
    values, rows, cols = found
    return (values if largest else -values), rows, cols
