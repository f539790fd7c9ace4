"""A square root of a tall matrix's Gram: R [k, k] with R^T R = M^T M for M [d, k], so that ||M X||_F = ||R X||_F.

The composition scores collapse each head's d_model x d_head factor to d_head rows this way (composition.py). The R
of a QR decomposition is one such root; the Cholesky factor of the d_head x d_head Gram M^T M is another, and at the
Llama-3.1-8B shape forming it is a batched GEMM (d k^2 multiply-adds per head, at BLAS speed) where Householder QR
took 178 s for the 2,016 factors of all-pairs K-composition on this 2-core machine (load ~7).

Precision: what the scores use is R^T R itself. The Gram is formed in M's dtype, so R^T R = M^T M + E with ||E|| of
order eps ||M||^2, the same as the R^T R of a QR in that dtype; the Cholesky factorisation runs in float64 (backward
stable: it adds order 1e-16 ||M^T M||). A Gram that is singular (rank-deficient M: a zeroed head, d < k) or made
slightly indefinite by rounding has no Cholesky factor; its root comes from its eigen-decomposition, Lambda^(1/2)
V^T with the eigenvalues rounding made negative clamped to 0 (they are of order eps ||M||^2). d < k (fewer rows
than columns, so the Gram is singular by construction) keeps the QR's R [d, k], which has d rows, not k.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gram_root(M: Tensor) -> Tensor:
    """R [..., k, k] in M's dtype with R^T R = M^T M (up to rounding) for M [..., d, k]; QR's R [..., d, k] if d < k."""
    d, k = M.shape[-2:]
    if d < k:
        return torch.linalg.qr(M, mode="r")[1]
    G = (M.transpose(-2, -1) @ M).to(torch.float64)  # [..., k, k]
    lower, info = torch.linalg.cholesky_ex(G)
    R = lower.transpose(-2, -1)
    singular = info != 0
    if bool(singular.any()):
        values, vectors = torch.linalg.eigh(G[singular])  # G = V diag(values) V^T
        R[singular] = values.clamp_min(0).sqrt()[..., :, None] * vectors.transpose(-2, -1)
    return R.to(M.dtype)
