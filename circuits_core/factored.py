"""Factored matrices: `A @ B` kept as its two low-rank factors, never materialised.

Paper section: "Summarizing OV/QK Matrices" -- W_QK = W_Q^T W_K and W_OV = W_O W_V have rank <= d_head,
and the full circuits W_E W_QK W_E^T, W_E W_OV W_U are [d_vocab, d_vocab] matrices of rank <= d_head.
Everything (SVD, norms, eigenvalues, rows, top-k) comes from the small factors; nonzero eigenvalues of AB
equal those of BA.

Convention: row vectors as in TransformerLens. A: [..., ldim, mdim], B: [..., mdim, rdim]; leading
(batch) dimensions such as [n_layers, n_heads] broadcast.
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor

from circuits_core.errors import InvalidInputError


class FactoredMatrix:
    """The matrix `A @ B` [..., ldim, rdim] stored as A [..., ldim, mdim] and B [..., mdim, rdim]."""

    def __init__(self, A: Tensor, B: Tensor):
        if A.dim() < 2 or B.dim() < 2:
            raise InvalidInputError(f"factors must be at least 2-D, got {tuple(A.shape)} and {tuple(B.shape)}")
        if A.shape[-1] != B.shape[-2]:
            raise InvalidInputError(f"inner dimensions differ: A {tuple(A.shape)} @ B {tuple(B.shape)}")
        self.A, self.B = A, B
        self.batch_shape = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])

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
