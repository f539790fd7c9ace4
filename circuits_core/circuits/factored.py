"""Factored matrices: `A @ B` kept as its two low-rank factors, never materialised.

Paper section: "Summarizing OV/QK Matrices" -- W_QK = W_Q^T W_K and W_OV = W_O W_V have rank <= d_head,
and the full circuits W_E W_QK W_E^T, W_E W_OV W_U are [d_vocab, d_vocab] matrices of rank <= d_head.
Everything (SVD, norms, eigenvalues, rows, top-k) comes from the small factors; nonzero eigenvalues of AB
equal those of BA.

Convention: row vectors as in TransformerLens. A: [..., ldim, mdim], B: [..., mdim, rdim]; leading
(batch) dimensions such as [n_layers, n_heads] broadcast.

Large matrices (a full OV circuit of GPT-2 is 50257 x 50257 = 10 GB in fp32) are only ever read through
rows, columns, the diagonal, or dense row blocks sized by a byte budget (`rows_per_block`, `topk_global`,
whose norm-bounded search is global_topk.py).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from functools import cached_property

import torch
from torch import Tensor

from circuits_core.circuits import global_topk
from circuits_core.circuits.host_linalg import eigvals
from circuits_core.circuits.product_factor import ProductFactor
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError, LimitExceededError
from circuits_core.ranking import by_value_then_indices

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


def _ranked(values: Tensor, rows: Tensor, cols: Tensor, largest: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A top-k's entries [..., k] by value, equal values by row, then column (a search lists them as it meets them)."""
    order = by_value_then_indices(values, (rows, cols), largest)
    return values.gather(-1, order), rows.gather(-1, order), cols.gather(-1, order)


def svd_cost(n_A: int, n_B: int, n: int, ldim: int, mdim: int, rdim: int, itemsize: int) -> Cost:
    """The Cost of `FactoredMatrix(A, B).svd()` (and `.S`, `.norm()`): A [..., ldim, mdim] with n_A matrices in its
    batch dimensions, B [..., mdim, rdim] with n_B, n = the broadcast batch's; `itemsize` the working dtype's. Held:
    each factor's thin SVD (U, S, V^T), the mdim x mdim core and its SVD (4 such tensors with S), the kept U
    [n, ldim, mdim] and V [n, rdim, mdim]. FLOPs: 4 m r^2 + 22 r^3 per thin SVD of an m x r matrix, and the
    products (the core, U = Ua Um, V = Vb Vm)."""
    r = mdim
    factors = n_A * (ldim * r + r * r + r) + n_B * (rdim * r + r * r + r)
    core = 4 * n * (r * r + r)
    kept = n * (ldim + rdim) * r
    svds = n_A * (4 * ldim * r * r + 22 * r**3) + n_B * (4 * rdim * r * r + 22 * r**3) + n * 22 * r**3
    products = n * (2 * r**3 + 2 * (ldim + rdim) * r * r)
    return Cost((factors + core + kept) * itemsize, flops=svds + products)


class FactoredMatrix:
    """The matrix `A @ B` [..., ldim, rdim] stored as A [..., ldim, mdim] and B [..., mdim, rdim]."""

    def __init__(self, A: Tensor, B: Tensor):
        if A.dim() < 2 or B.dim() < 2:
            raise InvalidInputError(f"factors must be at least 2-D, got {tuple(A.shape)} and {tuple(B.shape)}")
        if A.shape[-1] != B.shape[-2]:
            raise InvalidInputError(f"inner dimensions differ: A {tuple(A.shape)} @ B {tuple(B.shape)}")
        self._A: Tensor | None = A
        self._B: Tensor | None = B
        self.products: tuple[ProductFactor, ProductFactor] | None = None
        self.batch_shape = batch_broadcast(A.shape[:-2], B.shape[:-2])
        self._dims = (A.shape[-2], A.shape[-1], B.shape[-1])

    @classmethod
    def of_products(cls, left: ProductFactor, right: ProductFactor) -> FactoredMatrix:
        """A @ B with A = left [l, m] and B = right^T [m, r] kept unformed: each is formed the first time it is read
        (bit for bit as left.form() and right.form().T), and topk_global reads the products without forming them."""
        if left.shape[1] != right.shape[1]:
            raise InvalidInputError(f"inner dimensions differ: {tuple(left.shape)} and {tuple(right.shape)}^T")
        fm = cls.__new__(cls)
        fm._A = fm._B = None
        fm.products = (left, right)
        fm.batch_shape = torch.Size(())
        fm._dims = (left.shape[0], left.shape[1], right.shape[0])
        return fm

    @property
    def A(self) -> Tensor:
        """The left factor [..., ldim, mdim] (formed on first read when kept as a product)."""
        if self._A is None:
            assert self.products is not None
            self._A = self.products[0].form()
        return self._A

    @property
    def B(self) -> Tensor:
        """The right factor [..., mdim, rdim] (formed on first read when kept as a product)."""
        if self._B is None:
            assert self.products is not None
            self._B = self.products[1].form().T
        return self._B

    @property
    def _like(self) -> Tensor:
        """A tensor with the factors' device and dtype, without forming one."""
        return self.products[0].X if self._A is None and self.products is not None else self.A

    # -- shape ---------------------------------------------------------------------------------------
    @property
    def ldim(self) -> int:
        return self._dims[0]

    @property
    def mdim(self) -> int:
        return self._dims[1]

    @property
    def rdim(self) -> int:
        return self._dims[2]

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
        return eigvals(BA)

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
        device = self._like.device
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
        per_row = self.rdim * batch * self._like.element_size() * copies
        rows = int(budget_bytes) // per_row
        if rows < 1:
            raise LimitExceededError(
                f"one row block of {per_row} bytes ({copies} x {batch} x {self.rdim} values) does not fit "
                f"the memory budget of {int(budget_bytes)} bytes"
            )
        return min(rows, self.ldim)

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

        Returns (values [..., k] sorted, row indices [..., k], column indices [..., k]); equal values by row, then
        column, the lower first (docs/maths.md §1.7; which of several entries equal to the k-th value are listed is
        the search's: it keeps the first it meets). The product is
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
            return _ranked(values, row_idx[r], col_idx[c], largest)
        self._check_k(k, self.ldim * self.rdim)
        if self.products is not None:  # the products themselves, the basis folded into their small factors
            found = global_topk.topk_products(*self.products, k, largest, should_stop)
            if found is not None:
                return _ranked(*found, largest)
        # One matrix at a time, in tiles of global_topk.TILE_COLS columns; a tile lives in up to 4 buffers (fp32
        # product,
        # bf16 screen, exact recomputation, selected rows).
        per_row = 4 * min(global_topk.TILE_COLS, self.rdim) * self._like.element_size()
        step = int(budget_bytes) // per_row
        if step < 1:
            raise LimitExceededError(
                f"one row of a {min(global_topk.TILE_COLS, self.rdim)}-column tile in 4 working buffers needs "
                f"{per_row} bytes, more than the memory budget of {int(budget_bytes)} bytes"
            )
        # Broadcast factors are indexed as views, never copied per batch entry.
        A = self.A.expand(*self.batch_shape, *self.A.shape[-2:])
        B = self.B.expand(*self.batch_shape, *self.B.shape[-2:])
        batch = itertools.product(*(range(n) for n in self.batch_shape))
        results = [global_topk.topk_global_2d(A[idx], B[idx], k, step, largest, should_stop) for idx in batch]
        values, rows, cols = (torch.stack([r[n] for r in results]) for n in range(3))
        shape = (*self.batch_shape, k)
        return _ranked(values.reshape(shape), rows.reshape(shape), cols.reshape(shape), largest)

    def topk_global_cost(
        self, k: int, budget_bytes: int = DEFAULT_BUDGET_BYTES, rows: int | None = None, cols: int | None = None
    ) -> Cost:
        """The Cost of topk_global(k, budget_bytes) on `rows` x `cols` of this matrix (default all)."""
        return global_topk.topk_global_cost(
            self.ldim if rows is None else rows,
            self.mdim,
            self.rdim if cols is None else cols,
            k,
            budget_bytes,
            self._like.element_size(),
            math.prod(self.batch_shape),
        )
