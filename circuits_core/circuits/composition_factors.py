"""The collapsed factors of composition: each head's d_model x d_model matrix of rank <= d_head as d_head rows.

Paper section: "Composition" (Elhage et al. 2021; docs/maths.md §2.9). A composition score reads only Frobenius
norms of products, and ||X A B||_F depends on A B only through its Gram (A B)(A B)^T. So the earlier head's W_OV
= A B keeps its norms and Gram as R_A B [k, d_model], and the later head's matrix A B as A R_{B^T}^T [d_model, k],
where R^T R is the d_head Gram of the outer factor (the thin QR's R, or gram_root.py's Cholesky factor) and
k = min(d_model, d_head). `pair_scores` scores every pair of collapsed factors with one matmul (TransformerLens's
QR trick), the independent per-pair reference; `source_factor` and `target_factor` form one layer's factors as
composition.py's all-pairs Gram route reads them, W_K and W_V per key/value group as stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from circuits_core.circuits.gram_root import gram_root
from circuits_core.errors import InvalidInputError

CompositionKind = Literal["q", "k", "v"]
KINDS: tuple[CompositionKind, ...] = ("q", "k", "v")


def _r_factor(M: Tensor) -> Tensor:
    """R of the thin QR of M [..., d_model, d_head] -> [..., d_head, d_head], so that ||M X|| = ||R X||."""
    return torch.linalg.qr(M, mode="r")[1]


def left_collapsed(A: Tensor, B: Tensor, root: Callable[[Tensor], Tensor] = _r_factor) -> Tensor:
    """The earlier head's W_OV = A B (A [..., d, k], B [..., k, d]) as R_A B [..., k, d] (same Gram, same norms);
    R_A^T R_A = A^T A from `root` (QR's R, or gram_root.py's Cholesky factor)."""
    return root(A) @ B


def right_collapsed(A: Tensor, B: Tensor, root: Callable[[Tensor], Tensor] = _r_factor) -> Tensor:
    """The later head's matrix A B as A R_{B^T}^T [..., d, k]: ||X A B|| = ||X A R^T|| for any X."""
    return A @ root(B.transpose(-2, -1)).transpose(-2, -1)


def pair_scores(left: Tensor, right: Tensor) -> Tensor:
    """Scores for every (left, right) pair: left [N1, k1, d] (collapsed), right [N2, d, k2] -> [N1, N2].

    score = ||left_i @ right_j||_F / (||left_i||_F ||right_j||_F), one matmul for all pairs (the QR form;
    composition.py's all-pairs computation uses Gram matrices instead, this is the independent per-pair reference).
    """
    n1, k1, d = left.shape
    n2, _, k2 = right.shape
    core = left.reshape(n1 * k1, d) @ right.permute(1, 0, 2).reshape(d, n2 * k2)  # [N1*k1, N2*k2]
    num = core.reshape(n1, k1, n2, k2).pow(2).sum(dim=(1, 3)).sqrt()  # [N1, N2]
    den = left.flatten(1).norm(dim=1)[:, None] * right.flatten(1).norm(dim=1)[None, :]
    return num / den


# Weights of one layer, as the computation reads them: name (W_Q, W_O per query head; W_K, W_V per key/value
# group) -> [heads or groups, d, dh] ([H, dh, d] for W_O), in the compute dtype.
LayerWeight = Callable[[int, str], Tensor]


def source_factor(weight: LayerWeight, layer: int, group_size: int) -> Tensor:
    """F = R_V W_O [H, k, d] of every head of `layer` (left_collapsed; R_V of its key/value group's W_V, k = min(d,
    dh)), so that F^T F = W_O^T W_V^T W_V W_O = W_OV^T W_OV, the source Gram."""
    W_O = weight(layer, "W_O")  # [H, dh, d]
    H, dh, d = W_O.shape
    return left_collapsed(weight(layer, "W_V")[:, None], W_O.view(-1, group_size, dh, d), gram_root).view(H, -1, d)


def target_factor(weight: LayerWeight, layer: int, kind: CompositionKind, group_size: int) -> Tensor:
    """P = A R_{B^T}^T [H, d, k] of the later matrix A B of every head of `layer` (right_collapsed
    of the (A, B) below), so that P P^T = A B B^T A^T = M M^T, the target Gram; W_K, W_V per key/value group
    [G, 1, ...], broadcast against W_Q, W_O per query head [G, group_size, ...]."""

    def per_head(name: str) -> Tensor:  # [G, gs, d, dh] or [G, gs, dh, d]
        W = weight(layer, name)
        return W.view(-1, group_size, *W.shape[1:])

    if kind == "q":  # A = W_Q, B = W_K^T
        P = right_collapsed(per_head("W_Q"), weight(layer, "W_K")[:, None].transpose(-2, -1), gram_root)
    elif kind == "k":  # A = W_K, B = W_Q^T
        P = right_collapsed(weight(layer, "W_K")[:, None], per_head("W_Q").transpose(-2, -1), gram_root)
    elif kind == "v":  # A = W_V, B = W_O
        P = right_collapsed(weight(layer, "W_V")[:, None], per_head("W_O"), gram_root)
    else:
        raise InvalidInputError(f"composition kind must be one of {KINDS}, got {kind!r}")
    return P.flatten(0, 1)  # [H, d, k]
