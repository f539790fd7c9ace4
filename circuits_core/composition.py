"""Composition scores: how much a later head's query, key or value reads what an earlier head wrote.

Paper section: "Composition" (Elhage et al. 2021; paper-math 2.9). Row-vector (TransformerLens) convention,
W_OV = W_V W_O and W_QK = W_Q W_K^T, both [d_model, d_model] of rank <= d_head. For h1 in an earlier layer
than h2:
    Q-composition  ||W_OV^{h1} W_QK^{h2}||_F   / (||W_OV^{h1}||_F ||W_QK^{h2}||_F)
    K-composition  ||W_OV^{h1} W_QK^{h2 T}||_F / (||W_OV^{h1}||_F ||W_QK^{h2}||_F)
    V-composition  ||W_OV^{h1} W_OV^{h2}||_F   / (||W_OV^{h1}||_F ||W_OV^{h2}||_F)
(identical to the paper's column-convention formulas). Scores are in [0, 1]; same-layer and backward pairs
are 0, as in TransformerLens's `all_composition_scores`.

All pairs through Gram matrices: ||W_1 W_2||_F^2 = <W_1^T W_1, W_2 W_2^T>_F. Every head gets one d_model x
d_model Gram per role (source W_OV^T W_OV = W_O^T (W_V^T W_V) W_O, targets A (B B^T) A^T for the later matrix
A B), and the squared numerators of all (source, target) pairs are one matmul over the flattened Grams:
d_model^2 multiply-adds per pair instead of d_head^2 d_model for the product of the collapsed factors (5x fewer
for GPT-2). The Grams are symmetric, so only their upper block triangle is formed and multiplied (off-diagonal
blocks counted twice), one block of all heads at a time, which bounds the memory to the factors plus one block.
The per-pair QR collapse (TL's trick: A1 = Q1 R1, B2^T = Q2 R2, ||A1 B1 A2 B2|| = ||(R1 B1)(A2 R2^T)||) stays as
`pair_scores`, the independent reference.

Random baseline: for independent random rank-d_head factors E||AB||^2 = ||A||^2 ||B||^2 / d_model, so the
expected score is about 1/sqrt(d_model) (the paper subtracts "the empirical expected amount for random
matrices of the same shapes"). `random_baseline` samples it with ARENA's generator (kaiming-uniform
[d_model, d_head] factors, U(-1/sqrt(d_head), 1/sqrt(d_head))) as a check.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from circuits_core.cost import Cost, check_stop, itemsize, side_by_side
from circuits_core.errors import InvalidInputError
from circuits_core.model import Transformer

CompositionKind = Literal["q", "k", "v"]
KINDS: tuple[CompositionKind, ...] = ("q", "k", "v")
GRAM_BLOCK = 128  # column block of the d x d Gram matrices (upper block triangle: 21 of 36 blocks for d 768)
# Draws of the sampled random baseline. The scores of random matrices concentrate (std ~1 % of the mean at GPT-2
# small's shapes), so 64 draws fix the mean to ~0.15 %; sampling them is a cold request's cost (the uniform
# stream alone took ~1.5 s for 300 draws at d_model 768), cached per shape afterwards.
BASELINE_SAMPLES = 64


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
    check_stop(should_stop, "composition scores")


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

    score = ||left_i @ right_j||_F / (||left_i||_F ||right_j||_F), one matmul for all pairs (the QR form; the
    all-pairs computation below uses Gram matrices instead, this is the independent per-pair reference).
    """
    n1, k1, d = left.shape
    n2, _, k2 = right.shape
    core = left.reshape(n1 * k1, d) @ right.permute(1, 0, 2).reshape(d, n2 * k2)  # [N1*k1, N2*k2]
    num = core.reshape(n1, k1, n2, k2).pow(2).sum(dim=(1, 3)).sqrt()  # [N1, N2]
    den = left.flatten(1).norm(dim=1)[:, None] * right.flatten(1).norm(dim=1)[None, :]
    return num / den


def right_factors(model: Transformer, kind: CompositionKind) -> tuple[Tensor, Tensor]:
    """(A, B) with A B the later head's matrix for `kind`: [L, H, d, d_head], [L, H, d_head, d]."""
    return _right_factors(model.W_Q, model.W_K, model.W_V, model.W_O, kind)


def _right_factors(W_Q: Tensor, W_K: Tensor, W_V: Tensor, W_O: Tensor, kind: CompositionKind) -> tuple[Tensor, Tensor]:
    if kind == "q":  # W_QK = W_Q W_K^T
        return W_Q, W_K.transpose(-2, -1)
    if kind == "k":  # W_QK^T = W_K W_Q^T
        return W_K, W_Q.transpose(-2, -1)
    if kind == "v":  # W_OV = W_V W_O
        return W_V, W_O
    raise InvalidInputError(f"composition kind must be one of {KINDS}, got {kind!r}")


def gram_block_size(d: int, target: int = GRAM_BLOCK) -> int:
    """Largest divisor of d that is <= target; d itself (one block, the full Gram) when that divisor is tiny."""
    size = max(s for s in range(1, min(d, target) + 1) if d % s == 0)
    return size if size * 4 >= min(d, target) else d


def block_pairs(d: int, size: int) -> tuple[list[tuple[int, int]], Tensor]:
    """Blocks (a, b), a <= b, of the d x d matrices (row-major) and their weights [Pb]: 1 on, 2 off the diagonal."""
    nb = d // size
    pairs = [(a, b) for a in range(nb) for b in range(a, nb)]
    return pairs, torch.tensor([1.0 if a == b else 2.0 for a, b in pairs], dtype=torch.float64)


def _column_blocks(M: Tensor, size: int, transpose: bool) -> Tensor:
    """M [..., k, d] split into its d / size column blocks: [nb, ..., k, size], or [nb, ..., size, k] transposed."""
    *lead, k, d = M.shape
    blocks = M.reshape(*lead, k, d // size, size).movedim(-2, 0)  # [nb, ..., k, size]
    return (blocks.transpose(-2, -1) if transpose else blocks).contiguous()


def raw_composition_scores(
    W_Q: Tensor,
    W_K: Tensor,
    W_V: Tensor,
    W_O: Tensor,
    kinds: tuple[CompositionKind, ...] = KINDS,
    should_stop: Callable[[], bool] | None = None,
    block: int = GRAM_BLOCK,
) -> Tensor:
    """[K, L, H, L, H] scores from stacked weights (W_Q/K/V [L, H, d, dh], W_O [L, H, dh, d]); 0 unless l1 < l2.

    num^2 = ||W_OV^{h1} M^{h2}||_F^2 = <W_OV^{h1 T} W_OV^{h1}, M^{h2} M^{h2 T}>_F: with the d x d Gram matrices of
    every head as rows, all (earlier layers, target layer l2) pairs of all kinds are one matmul. The Grams are
    symmetric, so only their upper block triangle is formed ((a, b) blocks with a <= b, off-diagonal ones counted
    twice), one block (a, b) of all heads at a time: the memory is the d x d_head factors plus one block.
    """
    L, H, d = W_V.shape[0], W_V.shape[1], W_V.shape[2]
    K = len(kinds)
    raw = W_V.new_zeros(K, L, H, L, H)
    if L < 2:
        return raw
    size = gram_block_size(d, block)
    pairs, weights = block_pairs(d, size)
    nb, dh = d // size, W_V.shape[-1]
    # The four d_head x d_head Grams; kind -> (A, A^T A, B B^T) of its later-head matrix A B (_right_factors).
    QQ, KK = W_Q.transpose(-2, -1) @ W_Q, W_K.transpose(-2, -1) @ W_K  # [L, H, dh, dh]
    VV, OO = W_V.transpose(-2, -1) @ W_V, W_O @ W_O.transpose(-2, -1)
    rights = [{"q": (W_Q, QQ, KK), "k": (W_K, KK, QQ), "v": (W_V, VV, OO)}[kind] for kind in kinds]
    src_sq = (VV * OO).sum((-2, -1))  # [L, H]: ||W_OV||_F^2 = <W_V^T W_V, W_O W_O^T>
    tgt_sq = torch.stack([(AtA * BBt).sum((-2, -1)) for _, AtA, BBt in rights])  # [K, L, H]
    # Source Grams W_OV^T W_OV = W_O^T (W_V^T W_V) W_O, heads of layers 0..L-2, as column blocks of both factors.
    src_F = _column_blocks(W_O[:-1].flatten(0, 1), size, transpose=True)  # [nb, Ns, s, dh]
    src_G = _column_blocks((VV[:-1] @ W_O[:-1]).flatten(0, 1), size, transpose=False)  # [nb, Ns, dh, s]
    # Target Grams M M^T = A (B B^T) A^T, heads of layers 1..L-1, rows ordered (layer, kind, head).
    tgt_F = W_V.new_empty(nb, L - 1, K, H, size, dh)
    tgt_G = W_V.new_empty(nb, L - 1, K, H, dh, size)
    for i, (A, _, BBt) in enumerate(rights):
        tgt_F[:, :, i] = A[1:].reshape(L - 1, H, nb, size, dh).movedim(2, 0)
        tgt_G[:, :, i] = (BBt[1:] @ A[1:].transpose(-2, -1)).reshape(L - 1, H, dh, nb, size).movedim(3, 0)
    tgt_F, tgt_G = tgt_F.flatten(1, 3), tgt_G.flatten(1, 3)  # [nb, Nt, s, dh], [nb, Nt, dh, s]
    Ns, Nt = src_F.shape[1], tgt_F.shape[1]
    S = W_V.new_empty(Ns, size, size)  # one block of every source Gram
    T = W_V.new_empty(Nt, size, size)  # the same block of every target Gram
    # All source x target pairs per block: one large matmul is faster than skipping the l1 >= l2 pairs.
    num_sq = W_V.new_zeros(Ns, Nt)
    for p, (a, b) in enumerate(pairs):
        _check_stop(should_stop)
        torch.bmm(src_F[a], src_G[b], out=S)
        torch.bmm(tgt_F[a], tgt_G[b], out=T)
        num_sq.addmm_(S.view(Ns, size * size), T.view(Nt, size * size).T, alpha=float(weights[p]))
    num_sq = num_sq.view(L - 1, H, L - 1, K, H)  # [l1 = 0..L-2, h1, l2 = 1..L-1, kind, h2]
    den = src_sq[:-1, :, None, None, None].sqrt() * tgt_sq[:, 1:].sqrt().permute(1, 0, 2)[None, None]
    layer = torch.arange(L - 1, device=W_V.device)
    later = (layer[:, None] < layer[None, :] + 1)[:, None, :, None, None]  # l1 < l2
    scores = torch.where(later, num_sq.clamp_min(0).sqrt() / den, torch.zeros((), dtype=W_V.dtype, device=W_V.device))
    raw[:, :-1, :, 1:, :] = scores.permute(3, 0, 1, 2, 4)
    return raw


def composition_scores(
    model: Transformer,
    kinds: tuple[CompositionKind, ...] = KINDS,
    n_samples: int = BASELINE_SAMPLES,
    seed: int = 0,
    should_stop: Callable[[], bool] | None = None,
) -> CompositionScores:
    """Q-, K- and V-composition scores of every (earlier head, later head) pair, with the random baseline."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    dtype = torch.float32 if model.dtype in (torch.float16, torch.bfloat16) else model.dtype
    with torch.no_grad():
        W_Q, W_K, W_V, W_O = (w.to(dtype) for w in (model.W_Q, model.W_K, model.W_V, model.W_O))
        raw, (sampled, std) = side_by_side(  # the sampled baseline (model-independent) beside the scores
            lambda: raw_composition_scores(W_Q, W_K, W_V, W_O, kinds=kinds, should_stop=should_stop),  # [K, L, H, L, H]
            lambda: random_baseline(cfg.d_model, cfg.d_head, n_samples=n_samples, seed=seed), "qkov-baseline")
    layer = torch.arange(L, device=model.device)
    mask = (layer[:, None, None, None] < layer[None, None, :, None]).expand(L, H, L, H)
    baseline = 1.0 / math.sqrt(cfg.d_model)
    raw_d = {kind: raw[i] for i, kind in enumerate(kinds)}
    minus = {kind: torch.where(mask, s - baseline, torch.zeros_like(s)) for kind, s in raw_d.items()}
    return CompositionScores(raw_d, minus, baseline, sampled, std, mask)


@functools.lru_cache(maxsize=16)
def random_baseline(d_model: int, d_head: int, n_samples: int = BASELINE_SAMPLES, seed: int = 0) -> tuple[float, float]:
    """(mean, std) of the composition score of random matrices with ARENA's generator (cached per arguments).

    ARENA `generate_single_random_comp_score`: four [d_model, d_head] matrices with
    kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(d_head), 1/sqrt(d_head)); W_A = A_l A_r^T, W_B = B_l B_r^T.
    Each score through d_head x d_head matrices (no QR): with G_x = X^T X and M = A_r^T B_l,
    ||W_A W_B||^2 = <G_Al M, M G_Br>, ||W_A||^2 = <G_Al, G_Ar>, ||W_B||^2 = <G_Bl, G_Br>.
    """
    if n_samples < 1:
        raise InvalidInputError(f"n_samples must be >= 1, got {n_samples}")
    gen = torch.Generator().manual_seed(seed)
    chunks = []
    for start in range(0, n_samples, 32):  # chunks keep the memory at 4 x 32 x d_model x d_head
        size = min(32, n_samples - start)
        # U(-bound, bound) = 2 bound (U(0, 1) - 1/2); the score does not depend on the common factor 2 bound
        W = torch.rand(4, size, d_model, d_head, generator=gen, dtype=torch.float64).sub_(0.5)
        G_Al, G_Ar, G_Bl, G_Br = W.transpose(-2, -1) @ W  # [S, dh, dh] each
        M = W[1].transpose(-2, -1) @ W[2]  # A_r^T B_l [S, dh, dh]
        num_sq = ((G_Al @ M) * (M @ G_Br)).sum((-2, -1))
        den_sq = (G_Al * G_Ar).sum((-2, -1)) * (G_Bl * G_Br).sum((-2, -1))
        chunks.append((num_sq.clamp_min(0) / den_sq).sqrt())
    scores = torch.cat(chunks)
    return float(scores.mean()), float(scores.std()) if n_samples > 1 else 0.0


def cost(model: Transformer, kinds: tuple[CompositionKind, ...] = KINDS) -> Cost:
    """composition_scores for `kinds`: the stacked W_Q, W_K, W_V, W_O [L, H, ...] the model builds (per query head,
    so repeated under GQA), the d_head Grams, the column blocks of the source and target factors with their
    temporaries, one Gram block of every source and target head, the pair sums and the [K, L, H, L, H] scores;
    answer: two [sources x targets] tables (raw, minus baseline) and the top pairs, per kind."""
    cfg = model.cfg
    L, H, d, dh, K = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, len(kinds)
    size = gram_block_size(d)
    Ns, Nt = max(0, L - 1) * H, max(0, L - 1) * K * H
    stacked = 4 * L * H * d * dh
    factors = 3 * Ns * d * dh + 3 * Nt * d * dh  # column blocks of both factors and the products they come from
    numbers = stacked + 4 * L * H * dh * dh + factors + (Ns + Nt) * size * size + Ns * Nt + 2 * K * (L * H) ** 2
    per_kind = 2 * Ns * (Ns if L > 1 else 0) + 30
    scores = Cost(numbers * itemsize(torch.float32 if model.dtype in (torch.float16, torch.bfloat16) else model.dtype))
    return (scores + random_baseline_cost(d, dh)).with_answer(  # the baseline may be sampled beside the scores
        numbers=K * per_kind, labels=K * (2 * Ns + 20))


def random_baseline_cost(d_model: int, d_head: int) -> Cost:
    """random_baseline's working memory (float64): one chunk of 4 x 32 [d_model, d_head] draws, their four
    d_head Grams, M and the two products of the score."""
    return Cost(8 * (4 * 32 * d_model * d_head + 7 * 32 * d_head * d_head))
