"""Composition scores: how much a later head's query, key or value reads what an earlier head wrote.

Paper section: "Composition" (Elhage et al. 2021; paper-math 2.9). Row-vector (TransformerLens) convention,
W_OV = W_V W_O and W_QK = W_Q W_K^T, both [d_model, d_model] of rank <= d_head. For h1 in an earlier layer
than h2:
    Q-composition  ||W_OV^{h1} W_QK^{h2}||_F   / (||W_OV^{h1}||_F ||W_QK^{h2}||_F)
    K-composition  ||W_OV^{h1} W_QK^{h2 T}||_F / (||W_OV^{h1}||_F ||W_QK^{h2}||_F)
    V-composition  ||W_OV^{h1} W_OV^{h2}||_F   / (||W_OV^{h1}||_F ||W_OV^{h2}||_F)
(identical to the paper's column-convention formulas). Scores are in [0, 1]; same-layer and backward pairs
are 0, as in TransformerLens's `all_composition_scores`.

Cheap computation (the collapse trick of TL, in QR form): for a factored product A1 B1 A2 B2 with A1, A2
[d_model, d_head] and B1, B2 [d_head, d_model], write A1 = Q1 R1 and B2^T = Q2 R2 (thin QR, Q orthonormal).
Then ||A1 B1 A2 B2||_F = ||(R1 B1)(A2 R2^T)||_F: every pair costs one [d_head, d_model] @ [d_model, d_head]
product, and all pairs of one earlier layer with all later layers are a single matmul. Nothing of size
d_model x d_model is ever formed per pair.

Random baseline: for independent random rank-d_head factors E||AB||^2 = ||A||^2 ||B||^2 / d_model, so the
expected score is about 1/sqrt(d_model) (the paper subtracts "the empirical expected amount for random
matrices of the same shapes"). `random_baseline` samples it with ARENA's generator (kaiming-uniform
[d_model, d_head] factors, U(-1/sqrt(d_head), 1/sqrt(d_head))) as a check.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from circuits_core.errors import CancelledError, InvalidInputError
from circuits_core.model import Transformer

CompositionKind = Literal["q", "k", "v"]
KINDS: tuple[CompositionKind, ...] = ("q", "k", "v")


@dataclass
class CompositionScores:
    """All pairs of a model. Tensors are [n_layers, n_heads (earlier), n_layers, n_heads (later)]."""

    raw: dict[CompositionKind, Tensor]  # {"q"|"k"|"v": [L, H, L, H]}, 0 where layer1 >= layer2
    minus_baseline: dict[CompositionKind, Tensor]  # raw - baseline on earlier->later pairs, 0 elsewhere
    baseline: float  # analytic 1/sqrt(d_model), the one subtracted
    sampled_baseline: float  # mean of ARENA's random generator (check of the analytic value)
    sampled_std: float
    mask: Tensor  # [L, H, L, H] bool: layer1 < layer2


def _check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise CancelledError("composition scores cancelled")


def _r_factor(M: Tensor) -> Tensor:
    """R of the thin QR of M [..., d_model, d_head] -> [..., d_head, d_head], so that ||M X|| = ||R X||."""
    return torch.linalg.qr(M, mode="r")[1]


def left_collapsed(A: Tensor, B: Tensor) -> Tensor:
    """The earlier head's W_OV = A B (A [..., d, k], B [..., k, d]) as R_A B [..., k, d] (same Gram, same norms)."""
    return _r_factor(A) @ B


def right_collapsed(A: Tensor, B: Tensor) -> Tensor:
    """The later head's matrix A B as A R_{B^T}^T [..., d, k]: ||X A B|| = ||X A R^T|| for any X."""
    return A @ _r_factor(B.transpose(-2, -1)).transpose(-2, -1)


def pair_scores(left: Tensor, right: Tensor) -> Tensor:
    """Scores for every (left, right) pair: left [N1, k1, d] (collapsed), right [N2, d, k2] -> [N1, N2].

    score = ||left_i @ right_j||_F / (||left_i||_F ||right_j||_F), one matmul for all pairs.
    """
    n1, k1, d = left.shape
    n2, _, k2 = right.shape
    core = left.reshape(n1 * k1, d) @ right.permute(1, 0, 2).reshape(d, n2 * k2)  # [N1*k1, N2*k2]
    num = core.reshape(n1, k1, n2, k2).pow(2).sum(dim=(1, 3)).sqrt()  # [N1, N2]
    den = left.flatten(1).norm(dim=1)[:, None] * right.flatten(1).norm(dim=1)[None, :]
    return num / den


def right_factors(model: Transformer, kind: CompositionKind) -> tuple[Tensor, Tensor]:
    """(A, B) with A B the later head's matrix for `kind`: [L, H, d, d_head], [L, H, d_head, d]."""
    if kind == "q":  # W_QK = W_Q W_K^T
        return model.W_Q, model.W_K.transpose(-2, -1)
    if kind == "k":  # W_QK^T = W_K W_Q^T
        return model.W_K, model.W_Q.transpose(-2, -1)
    if kind == "v":  # W_OV = W_V W_O
        return model.W_V, model.W_O
    raise InvalidInputError(f"composition kind must be one of {KINDS}, got {kind!r}")


def composition_scores(
    model: Transformer,
    kinds: tuple[CompositionKind, ...] = KINDS,
    n_samples: int = 300,
    seed: int = 0,
    should_stop: Callable[[], bool] | None = None,
) -> CompositionScores:
    """Q-, K- and V-composition scores of every (earlier head, later head) pair, with the random baseline."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    dtype = torch.float32 if model.dtype in (torch.float16, torch.bfloat16) else model.dtype
    with torch.no_grad():
        left = left_collapsed(model.W_V.to(dtype), model.W_O.to(dtype))  # [L, H, dh, d]
        rights = [right_collapsed(*(w.to(dtype) for w in right_factors(model, kind))) for kind in kinds]  # [L, H, d, dh]
        right_all = torch.stack(rights)  # [K, L, H, d, dh]
        raw = torch.zeros(len(kinds), L, H, L, H, dtype=dtype, device=model.device)
        for l1 in range(L - 1):
            _check_stop(should_stop)
            later = right_all[:, l1 + 1 :].reshape(-1, cfg.d_model, right_all.shape[-1])  # [K*(L-l1-1)*H, d, dh]
            scores = pair_scores(left[l1], later)  # [H, K*(L-l1-1)*H]
            raw[:, l1, :, l1 + 1 :, :] = scores.reshape(H, len(kinds), L - l1 - 1, H).permute(1, 0, 2, 3)
    layer = torch.arange(L, device=model.device)
    mask = (layer[:, None, None, None] < layer[None, None, :, None]).expand(L, H, L, H)
    baseline = 1.0 / math.sqrt(cfg.d_model)
    sampled, std = random_baseline(cfg.d_model, cfg.d_head, n_samples=n_samples, seed=seed)
    raw_d = {kind: raw[i] for i, kind in enumerate(kinds)}
    minus = {kind: torch.where(mask, s - baseline, torch.zeros_like(s)) for kind, s in raw_d.items()}
    return CompositionScores(raw_d, minus, baseline, sampled, std, mask)


def random_baseline(d_model: int, d_head: int, n_samples: int = 300, seed: int = 0) -> tuple[float, float]:
    """(mean, std) of the composition score of random matrices with ARENA's generator.

    ARENA `generate_single_random_comp_score`: four [d_model, d_head] matrices with
    kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(d_head), 1/sqrt(d_head)); W_A = A_l A_r^T, W_B = B_l B_r^T.
    """
    if n_samples < 1:
        raise InvalidInputError(f"n_samples must be >= 1, got {n_samples}")
    gen = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(d_head)
    chunks = []
    for start in range(0, n_samples, 32):  # chunks keep the memory at 4 x 32 x d_model x d_head
        size = min(32, n_samples - start)
        W = (torch.rand(4, size, d_model, d_head, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        A_l, A_r, B_l, B_r = W
        left = left_collapsed(A_l, A_r.transpose(-2, -1))  # [S, dh, d]
        right = right_collapsed(B_l, B_r.transpose(-2, -1))  # [S, d, dh]
        num = (left @ right).flatten(1).norm(dim=1)
        chunks.append(num / (left.flatten(1).norm(dim=1) * right.flatten(1).norm(dim=1)))
    scores = torch.cat(chunks)
    return float(scores.mean()), float(scores.std()) if n_samples > 1 else 0.0
