"""One head's composition with every other head: the row and column of the all-pairs scores that name it.

Paper section: "Composition" (Elhage et al. 2021; docs/maths.md §2.9); the scores are composition.py's (Q, K and V
composition, normalised Frobenius norms of W_OV^{h1} times the later head's matrix), computed here only for the pairs
that have this head on one side: the earlier heads it reads from and the later heads it writes to. That is 2 (L H)
pairs instead of (L H)^2: what a head's page shows (its strongest partners), at the cost of one head's view. Each
pair through d_head-sized collapsed factors (composition_factors.pair_scores, the per-pair reference of the Gram form).
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits.composition import model_weight
from circuits_core.circuits.composition_factors import (
    KINDS,
    CompositionKind,
    left_collapsed,
    pair_scores,
    right_collapsed,
    source_factor,
    target_factor,
)
from circuits_core.circuits.folded import stacked_weights
from circuits_core.errors import InvalidInputError
from circuits_core.model.transformer import Transformer


def right_factors(weights: dict[str, Tensor], kind: CompositionKind) -> tuple[Tensor, Tensor]:
    """(A, B) with A B the later head's matrix for `kind`, from the stacked circuit weights (folded.stacked_weights):
    [L, H, d, d_head], [L, H, d_head, d]."""
    if kind == "q":  # W_QK = W_Q W_K^T
        return weights["W_Q"], weights["W_K"].transpose(-2, -1)
    if kind == "k":  # W_QK^T = W_K W_Q^T
        return weights["W_K"], weights["W_Q"].transpose(-2, -1)
    if kind == "v":  # W_OV = W_V W_O
        return weights["W_V"], weights["W_O"]
    raise InvalidInputError(f"composition kind must be one of q, k, v, got {kind!r}")


def head_compositions(
    model: Transformer, layer: int, head: int, kinds: tuple[CompositionKind, ...] = KINDS
) -> dict[CompositionKind, tuple[Tensor, Tensor]]:
    """For each kind, (reads [layer, H]: each earlier head's composition into this one, writes [L - layer - 1, H]: this
    head's into each later head), the raw scores of composition.composition_scores for those pairs. The circuit
    weights are stacked once (gains folded) and the W_OV side's collapsed factors formed once, for every kind."""
    cfg = model.cfg
    H = cfg.n_heads
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:  # refused before any work
        raise InvalidInputError(f"composition kind must be one of q, k, v, got {unknown[0]!r}")
    names = {"W_V", "W_O"} | ({"W_Q", "W_K"} if set(kinds) & {"q", "k"} else set())
    out: dict[CompositionKind, tuple[Tensor, Tensor]] = {}
    with torch.no_grad():
        weights = {name: stacked_weights(model, name) for name in sorted(names)}  # [L, H, ...] each
        W_V, W_O = weights["W_V"], weights["W_O"]  # [L, H, d, dh], [L, H, dh, d]
        earlier = left_collapsed(W_V[:layer].flatten(0, 1), W_O[:layer].flatten(0, 1))  # [layer H, d_head, d]
        own = left_collapsed(W_V[layer, head][None], W_O[layer, head][None])  # [1, d_head, d]
        n_later = cfg.n_layers - layer - 1
        for kind in kinds:
            A, B = right_factors(weights, kind)  # the later head's matrix A B
            mine = right_collapsed(A[layer, head][None], B[layer, head][None])  # [1, d, d_head]
            reads = pair_scores(earlier, mine)[:, 0].reshape(layer, H) if layer else A.new_zeros(0, H)
            later = right_collapsed(A[layer + 1 :].flatten(0, 1), B[layer + 1 :].flatten(0, 1))  # [N, d, d_head]
            writes = pair_scores(own, later)[0].reshape(n_later, H) if n_later else A.new_zeros(0, H)
            out[kind] = (reads, writes)
    return out


def pair_composition(
    model: Transformer, source: tuple[int, int], target: tuple[int, int], kinds: tuple[CompositionKind, ...] = KINDS
) -> dict[CompositionKind, float]:
    """The raw scores of one (source, target) pair, composition.composition_scores's entries for it, from the two
    layers' collapsed factors alone (what the pair page shows, instead of every pair): 0 unless source's layer is
    earlier."""
    (l1, h1), (l2, h2) = source, target
    if l1 >= l2:
        return dict.fromkeys(kinds, 0.0)
    weight, gs = model_weight(model, model.compute_dtype), model.cfg.group_size
    with torch.no_grad():
        left = source_factor(weight, l1, gs)[h1][None]  # [1, k, d]: F with F^T F = W_OV^T W_OV
        return {kind: float(pair_scores(left, target_factor(weight, l2, kind, gs)[h2][None])[0, 0]) for kind in kinds}


def pair_composition_flops(model: Transformer, kinds: tuple[CompositionKind, ...] = KINDS) -> int:
    """pair_composition's matrix products: the source layer's R_V W_O, each kind's target layer A R^T (every head of
    the layer, as the all-pairs computation forms them), the pair's [k, d] x [d, k] product, and the d_head Grams
    whose Cholesky factors are the R's (gram_root.py: one per key/value group of W_V, and per kind one per group of
    W_K (q) or per head of W_Q (k) or W_O (v); QRs instead, uncounted, when d_model < d_head)."""
    cfg = model.cfg
    H, G, d, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_model, cfg.d_head
    k = min(d, dh)
    grams = G + sum(G if kind == "q" else H for kind in kinds) if d >= dh else 0
    return 2 * H * k * dh * d + len(kinds) * (2 * H * d * dh * k + 2 * k * d * k) + grams * 2 * d * dh * dh
