"""A factor of a circuit kept unformed, as the product that forms it: diag(scale) X Y.

Paper section: "Summarizing OV/QK Matrices" (Elhage et al. 2021): a full OV circuit W_E W_OV W_U is
(W_E_eff W_V) (W_O W_U), two [d_vocab, d_head] factors that each take a [d_vocab, d_model] x [d_model, d_head]
product to form (86 GFLOP apiece on Gemma-3's 262,144 tokens). Kept as X [n, d] and Y [d, m], such a factor can be
formed whole (as the eager code forms it, bit for bit), row by row, or times a small [m, m] matrix folded into Y
(X (Y T) instead of (X Y) T: no [n, m] product formed twice). FactoredMatrix.of_products holds two of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Row gathers are multiplied at least MIN_ROWS at a time: the BLAS rounds products of fewer rows (1-7 measured, MKL,
# inner dimension 640) in another order than the whole product, so fewer rows are padded with repeats.
MIN_ROWS = 16


@dataclass(frozen=True)
class ProductFactor:
    """The [n, m] factor fl(fl(X @ Y) * scale[:, None]) (scale None: fl(X @ Y)); X [n, d], Y [d, m], scale [n]."""

    X: Tensor
    Y: Tensor
    scale: Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.X.shape[0], self.Y.shape[1]))

    def form(self, Y: Tensor | None = None) -> Tensor:
        """The whole factor [n, m] (with Y [d, m'] in place of self.Y: [n, m'])."""
        out = self.X @ (self.Y if Y is None else Y)  # [n, m]
        if self.scale is not None:
            out *= self.scale[:, None]
        return out

    def rows(self, index: Tensor) -> Tensor:
        """Rows [len(index), m] of the whole factor, bit for bit as form() holds them."""
        n = index.numel()
        padded = index if n >= MIN_ROWS or n == 0 else torch.cat([index, index[:1].expand(MIN_ROWS - n)])
        X = self.X.T[:, padded].T if self.X.T.is_contiguous() else self.X[padded]  # [>= MIN_ROWS, d], stored as X is
        out = X @ self.Y  # [>= MIN_ROWS, m]
        if self.scale is not None:
            out *= self.scale[padded, None]
        return out[:n]

    def negated(self) -> ProductFactor:
        """The factor times -1 (exactly: a sign flip is exact and commutes with every rounding)."""
        return ProductFactor(self.X, -self.Y, self.scale)
