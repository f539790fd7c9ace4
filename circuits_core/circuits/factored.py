"""Factored matrices: `A @ B` kept as its two low-rank factors, never materialised.

Paper section: "Summarizing OV/QK Matrices" -- W_QK = W_Q^T W_K and W_OV = W_O W_V have rank <= d_head,
and the full circuits W_E W_QK W_E^T, W_E W_OV W_U are [d_vocab, d_vocab] matrices of rank <= d_head.
Everything (SVD, norms, eigenvalues, rows, top-k) comes from the small factors; nonzero eigenvalues of AB
equal those of BA.

Convention: row vectors as in TransformerLens. A: [..., ldim, mdim], B: [..., mdim, rdim]; leading
(batch) dimensions such as [n_layers, n_heads] broadcast.

Large matrices (a full OV circuit of GPT-2 is 50257 x 50257 = 10 GB in fp32) are only ever read through
rows, columns, the diagonal, or dense row blocks sized by a byte budget (`iter_row_blocks`, `topk_global`).
The global top-k visits tiles in descending row and column norm order and skips those that the
Cauchy-Schwarz bound |A_i . B_:,j| <= ||A_i|| ||B_:,j|| rules out; large tiles are screened in bfloat16
with a proven error margin and the surviving rows recomputed exactly.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterator
from functools import cached_property

import torch
from torch import Tensor

from circuits_core.cost import Cost, check_stop
from circuits_core.errors import InvalidInputError, LimitExceededError

# Default memory budget for streaming dense row blocks of a large circuit (bytes).
DEFAULT_BUDGET_BYTES = 256 * 2**20


def batch_broadcast(a: torch.Size, b: torch.Size) -> torch.Size:
    """NumPy broadcasting of two batch shapes, written out: torch.broadcast_shapes imports torch's symbolic-shape
    machinery (sympy) on first use, about 1 s on the first request of a process."""
    n = max(len(a), len(b))
    left, right = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(left, right, strict=True):
        if x != y and 1 not in (x, y):
            raise InvalidInputError(f"batch shapes {tuple(a)} and {tuple(b)} do not broadcast")
        out.append(y if x == 1 else x)
    return torch.Size(out)


class FactoredMatrix:
    """The matrix `A @ B` [..., ldim, rdim] stored as A [..., ldim, mdim] and B [..., mdim, rdim]."""

    def __init__(self, A: Tensor, B: Tensor):
        if A.dim() < 2 or B.dim() < 2:
            raise InvalidInputError(f"factors must be at least 2-D, got {tuple(A.shape)} and {tuple(B.shape)}")
        if A.shape[-1] != B.shape[-2]:
            raise InvalidInputError(f"inner dimensions differ: A {tuple(A.shape)} @ B {tuple(B.shape)}")
        self.A, self.B = A, B
        self.batch_shape = batch_broadcast(A.shape[:-2], B.shape[:-2])

    # -- shape ---------------------------------------------------------------------------------------
    @property
    def ldim(self) -> int:
        return self.A.shape[-2]

    @property
    def mdim(self) -> int:
        return self.A.shape[-1]

    @property
    def rdim(self) -> int:
        return self.B.shape[-1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.batch_shape, self.ldim, self.rdim))

    @property
    def T(self) -> FactoredMatrix:
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    def __repr__(self) -> str:
        return f"FactoredMatrix(shape={tuple(self.shape)}, mdim={self.mdim})"

    # -- dense views (small shapes, or slices) --------------------------------------------------------
    @property
    def AB(self) -> Tensor:
        """The dense matrix [..., ldim, rdim]. Only for small shapes: circuits use rows/top-k instead."""
        return self.A @ self.B

    @property
    def BA(self) -> Tensor:
        """B @ A [..., mdim, mdim] (square only): same nonzero eigenvalues as AB."""
        if self.ldim != self.rdim:
            raise InvalidInputError(f"BA needs a square matrix, got {self.ldim} x {self.rdim}")
        return self.B @ self.A

    def rows(self, index: Tensor | list[int] | slice) -> Tensor:
        """Dense rows [..., n_rows, rdim]."""
        return self.A[..., index, :] @ self.B

    def cols(self, index: Tensor | list[int] | slice) -> Tensor:
        """Dense columns, returned transposed: [..., n_cols, ldim]."""
        return (self.A @ self.B[..., :, index]).transpose(-2, -1)

    def __getitem__(self, idx: int | tuple[int, ...]) -> FactoredMatrix:
        """Index the leading (batch) dimensions, e.g. `fm[layer, head]`."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) > len(self.batch_shape):
            raise InvalidInputError(f"{len(idx)} indices for {len(self.batch_shape)} batch dimensions")
        A = self.A.expand(*self.batch_shape, *self.A.shape[-2:])
        B = self.B.expand(*self.batch_shape, *self.B.shape[-2:])
        return FactoredMatrix(A[idx], B[idx])

    # -- products that keep the smallest inner dimension ----------------------------------------------
    def __matmul__(self, other: Tensor | FactoredMatrix) -> FactoredMatrix:
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        if other.dim() < 2:
            raise InvalidInputError("multiply vectors with .rows()/.cols() or a [n, 1] matrix")
        if self.rdim > self.mdim:
            return FactoredMatrix(self.A, self.B @ other)
        return FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other: Tensor) -> FactoredMatrix:
        if other.dim() < 2:
            raise InvalidInputError("multiply vectors with .rows()/.cols() or a [1, n] matrix")
        if self.ldim > self.mdim:
            return FactoredMatrix(other @ self.A, self.B)
        return FactoredMatrix(other, self.AB)

    def __mul__(self, scalar: float) -> FactoredMatrix:
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    # -- spectra --------------------------------------------------------------------------------------
    @cached_property
    def _svd(self) -> tuple[Tensor, Tensor, Tensor]:
        Ua, Sa, Vha = torch.linalg.svd(self.A, full_matrices=False)  # A = Ua diag(Sa) Vha
        Ub, Sb, Vhb = torch.linalg.svd(self.B, full_matrices=False)  # B = Ub diag(Sb) Vhb
        middle = (Sa[..., :, None] * Vha) @ (Ub * Sb[..., None, :])  # [..., ra, rb]
        Um, Sm, Vhm = torch.linalg.svd(middle, full_matrices=False)
        U = Ua @ Um  # [..., ldim, r]
        V = Vhb.transpose(-2, -1) @ Vhm.transpose(-2, -1)  # [..., rdim, r]
        return U, Sm, V

    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """(U, S, V) with AB = U diag(S) V^T (V, not V^H, as TransformerLens)."""
        return self._svd

    @property
    def S(self) -> Tensor:
        return self._svd[1]

    def norm(self) -> Tensor:
        """Frobenius norm [...], from the singular values."""
        return self.S.pow(2).sum(-1).sqrt()

    @property
    def eigenvalues(self) -> Tensor:
        """The mdim eigenvalues of B @ A (complex): the nonzero eigenvalues of AB plus zeros."""
        BA = self.BA
        if BA.dtype in (torch.float16, torch.bfloat16):
            BA = BA.float()
        return torch.linalg.eigvals(BA)

    def collapse_l(self) -> Tensor:
        """diag(S) V^T [..., r, rdim]: AB = U @ collapse_l() with U orthonormal."""
        U, S, V = self._svd
        return S[..., :, None] * V.transpose(-2, -1)

    def collapse_r(self) -> Tensor:
        """U diag(S) [..., ldim, r]: AB = collapse_r() @ V^T with V orthonormal."""
        U, S, V = self._svd
        return U * S[..., None, :]

    # -- rows, columns and the diagonal, read from the factors ------------------------------------------
    def _check_index(self, i: int, size: int, what: str) -> int:
        try:
            i = operator.index(i)  # int, numpy or 0-d torch integers
        except TypeError:
            raise InvalidInputError(f"{what} index must be an integer, got {i!r}") from None
        if isinstance(i, bool):
            raise InvalidInputError(f"{what} index must be an integer, got {i!r}")
        if not -size <= i < size:
            raise InvalidInputError(f"{what} index {i} out of range for {size} {what}s")
        return i % size

    @staticmethod
    def _check_k(k: int, size: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidInputError(f"k must be a positive integer, got {k!r}")
        if k > size:
            raise InvalidInputError(f"k={k} is larger than the {size} entries available")

    def _check_subset(self, index: Tensor | None, size: int, what: str) -> Tensor:
        """A 1-D tensor of distinct indices in [0, size) on the factors' device (all of them when None)."""
        device = self.A.device
        if index is None:
            return torch.arange(size, device=device)
        if (
            not isinstance(index, Tensor)
            or index.dim() != 1
            or index.dtype.is_floating_point
            or index.dtype == torch.bool
        ):
            raise InvalidInputError(f"{what} subset must be a 1-D integer tensor of indices, got {index!r}")
        if index.numel() == 0:
            raise InvalidInputError(f"{what} subset is empty")
        if int(index.min()) < 0 or int(index.max()) >= size:
            raise InvalidInputError(
                f"{what} subset indices must be in [0, {size}), got [{int(index.min())}, {int(index.max())}]"
            )
        if index.unique().numel() != index.numel():
            raise InvalidInputError(f"{what} subset indices must be distinct")
        return index.to(device=device, dtype=torch.long)

    def diag(self) -> Tensor:
        """The diagonal [..., ldim] of a square AB, from the factors in O(ldim * mdim)."""
        if self.ldim != self.rdim:
            raise InvalidInputError(f"diag needs a square matrix, got {self.ldim} x {self.rdim}")
        return (self.A * self.B.transpose(-2, -1)).sum(-1)

    def topk_row(self, i: int, k: int, largest: bool = True) -> tuple[Tensor, Tensor]:
        """Top-k entries of row i: (values [..., k], column indices [..., k]), sorted."""
        i = self._check_index(i, self.ldim, "row")
        self._check_k(k, self.rdim)
        row = self.A[..., i, :].unsqueeze(-2) @ self.B  # [..., 1, rdim]
        return row.squeeze(-2).topk(k, dim=-1, largest=largest)

    def topk_col(self, j: int, k: int, largest: bool = True) -> tuple[Tensor, Tensor]:
        """Top-k entries of column j: (values [..., k], row indices [..., k]), sorted."""
        j = self._check_index(j, self.rdim, "column")
        self._check_k(k, self.ldim)
        col = self.A @ self.B[..., :, j].unsqueeze(-1)  # [..., ldim, 1]
        return col.squeeze(-1).topk(k, dim=-1, largest=largest)

    # -- streaming over row blocks under a byte budget --------------------------------------------------
    def rows_per_block(self, budget_bytes: int, copies: int = 1, batch: int | None = None) -> int:
        """How many dense rows (of `batch` matrices, default all, in `copies` buffers) fit in budget_bytes."""
        batch = math.prod(self.batch_shape) if batch is None else batch
        per_row = self.rdim * batch * self.A.element_size() * copies
        rows = int(budget_bytes) // per_row
        if rows < 1:
            raise LimitExceededError(
                f"one row block of {per_row} bytes ({copies} x {batch} x {self.rdim} values) does not fit "
                f"the memory budget of {int(budget_bytes)} bytes"
            )
        return min(rows, self.ldim)

    def iter_row_blocks(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> Iterator[tuple[slice, Tensor]]:
        """Yield (row slice, dense block [..., rows, rdim]) covering AB, each block within budget_bytes."""
        step = self.rows_per_block(budget_bytes)
        for start in range(0, self.ldim, step):
            rows = slice(start, min(start + step, self.ldim))
            yield rows, self.A[..., rows, :] @ self.B

    def topk_global(
        self,
        k: int,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        largest: bool = True,
        rows: Tensor | None = None,
        cols: Tensor | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The k largest (or smallest) entries of the whole matrix AB, without allocating ldim x rdim.

        `rows` / `cols` (1-D integer tensors of distinct indices, default all) restrict the search to the
        submatrix AB[rows][:, cols]: the factors are restricted (A[rows], B[:, cols]) and the indices returned
        are those of the full matrix.

        Returns (values [..., k] sorted, row indices [..., k], column indices [..., k]). The product is
        streamed in tiles whose working buffers (4 per tile) fit budget_bytes, rows in descending order of
        ||A_i|| and columns of ||B_:,j||; by Cauchy-Schwarz no entry exceeds ||A_i|| * ||B_:,j|| in absolute
        value, so tiles whose bound is below the current k-th value are skipped (for `largest=False` the
        same bound holds for -AB). Inside a tile, only rows whose maximum beats the k-th value are ranked.
        The stop flag (`should_stop`, or the ambient one of circuits_core.cost) is polled before each tile.
        """
        if rows is not None or cols is not None:
            row_idx = self._check_subset(rows, self.ldim, "row")  # [r]
            col_idx = self._check_subset(cols, self.rdim, "column")  # [c]
            sub = FactoredMatrix(self.A[..., row_idx, :], self.B[..., :, col_idx])  # [..., r, c]
            values, r, c = sub.topk_global(k, budget_bytes=budget_bytes, largest=largest, should_stop=should_stop)
            return values, row_idx[r], col_idx[c]
        self._check_k(k, self.ldim * self.rdim)
        # One matrix at a time, in tiles of TILE_COLS columns; a tile lives in up to 4 buffers (fp32 product,
        # bf16 screen, exact recomputation, selected rows).
        per_row = 4 * min(TILE_COLS, self.rdim) * self.A.element_size()
        step = int(budget_bytes) // per_row
        if step < 1:
            raise LimitExceededError(
                f"one row of a {min(TILE_COLS, self.rdim)}-column tile in 4 working buffers needs {per_row} "
                f"bytes, more than the memory budget of {int(budget_bytes)} bytes"
            )
        # Broadcast factors are indexed as views, never copied per batch entry.
        A = self.A.expand(*self.batch_shape, *self.A.shape[-2:])
        B = self.B.expand(*self.batch_shape, *self.B.shape[-2:])
        batch = itertools.product(*(range(n) for n in self.batch_shape))
        results = [_topk_global_2d(A[idx], B[idx], k, step, largest, should_stop) for idx in batch]
        values, rows, cols = (torch.stack([r[n] for r in results]) for n in range(3))
        shape = (*self.batch_shape, k)
        return values.reshape(shape), rows.reshape(shape), cols.reshape(shape)

    def topk_global_cost(
        self, k: int, budget_bytes: int = DEFAULT_BUDGET_BYTES, rows: int | None = None, cols: int | None = None
    ) -> Cost:
        """The Cost of topk_global(k, budget_bytes) on `rows` x `cols` of this matrix (default all)."""
        return topk_global_cost(
            self.ldim if rows is None else rows,
            self.mdim,
            self.rdim if cols is None else cols,
            k,
            budget_bytes,
            self.A.element_size(),
            math.prod(self.batch_shape),
        )


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
# probe shows that bf16 products are accumulated in fp32.
SCREEN_DTYPE, SCREEN_MARGIN, SCREEN_MIN_ENTRIES = torch.bfloat16, 2.0**-6, 2**24
_screen_ok: dict[torch.device, bool] = {}


def topk_global_cost(
    ldim: int, mdim: int, rdim: int, k: int, budget_bytes: int, element_size: int, batch: int = 1
) -> Cost:
    """Cost of FactoredMatrix.topk_global on [batch] matrices [ldim, mdim] @ [mdim, rdim] (one at a time).

    Peak: the norm-sorted copy of A and the column tiles of B, their bfloat16 copies when screened, the 4
    tile buffers (at most budget_bytes) and the candidates; answer: batch x k (value, row, column).
    """
    tile_cols = min(TILE_COLS, rdim)
    step = max(1, int(budget_bytes) // (4 * tile_cols * element_size))
    tiles = 4 * min(step, TILE_ROWS, ldim) * tile_cols * element_size
    factors = (ldim * mdim + mdim * rdim) * element_size
    screen = (ldim * mdim + mdim * rdim) * 2 if ldim * rdim >= SCREEN_MIN_ENTRIES else 0
    sorting = (ldim + rdim) * (element_size + 8)  # norms and orders
    candidates = 2 * k * (min(step, TILE_ROWS, ldim) + 1) * (element_size + 16)
    return Cost(factors + screen + tiles + sorting + candidates).with_answer(numbers=3 * k * batch)


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


def _topk_global_2d(
    A: Tensor, B: Tensor, k: int, step: int, largest: bool, should_stop: Callable[[], bool] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Global top-k of A [ldim, mdim] @ B [mdim, rdim] (see topk_global).

    Rows (by ||A_i||) and columns (by ||B_:,j||) are visited in descending norm order, in tiles of at most
    min(step, TILE_ROWS) x TILE_COLS entries. Every entry of a tile is bounded by ||A_first row|| * ||B_first col||, so
    once that falls below the current k-th value the rest of the row block (and, for the first tile of a
    block, all later blocks) is skipped. Inside a tile only rows whose maximum beats the k-th value are
    ranked, their maximum first estimated in bfloat16 for large matrices (see SCREEN_MARGIN).
    """
    ldim, rdim = A.shape[0], B.shape[1]
    B = B if largest else -B  # smallest entries of AB = largest of A(-B)
    row_norms, row_order = A.norm(dim=-1).sort(descending=True)  # [ldim]
    col_norms, col_order = B.norm(dim=0).sort(descending=True)  # [rdim]
    A = A[row_order]  # [ldim, mdim], rows in descending norm
    tile_cols = min(TILE_COLS, rdim)
    tiles = [B[:, col_order[j : j + tile_cols]] for j in range(0, rdim, tile_cols)]  # contiguous [mdim, <=tile_cols]
    tile_rows = min(step, TILE_ROWS)
    dtype = torch.result_type(A, B)
    buf = torch.empty(min(tile_rows, ldim) * tile_cols, dtype=dtype, device=A.device)
    screen = (
        SCREEN_DTYPE is not None
        and ldim * rdim >= SCREEN_MIN_ENTRIES
        and dtype in (torch.float32, torch.float64)
        and _screening_accumulates_in_fp32(A.device)
    )
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
