"""Composition scores: how much a later head's query, key or value reads what an earlier head wrote.

Paper section: "Composition" (Elhage et al. 2021; docs/maths.md §2.9). Row-vector (TransformerLens) convention,
W_OV = W_V W_O and W_QK = W_Q W_K^T, both [d_model, d_model] of rank <= d_head. For h1 in an earlier layer
than h2:
    Q-composition  ||W_OV^{h1} W_QK^{h2}||_F   / (||W_OV^{h1}||_F ||W_QK^{h2}||_F)
    K-composition  ||W_OV^{h1} W_QK^{h2 T}||_F / (||W_OV^{h1}||_F ||W_QK^{h2}||_F)
    V-composition  ||W_OV^{h1} W_OV^{h2}||_F   / (||W_OV^{h1}||_F ||W_OV^{h2}||_F)
(identical to the paper's column-convention formulas). Scores are in [0, 1]; same-layer and backward pairs
are 0, as in TransformerLens's `all_composition_scores`.

All pairs through Gram matrices: ||W_1 W_2||_F^2 = <W_1^T W_1, W_2 W_2^T>_F. Every head gets one d_model x d_model Gram
per role, formed from a collapsed factor of d_head rows (composition_factors.py): source W_OV^T W_OV = F^T F with F =
R_V W_O (R_V^T R_V = W_V^T W_V: the Cholesky factor of the d_head Gram, gram_root.py), target M M^T = P P^T with P = A
R^T for the later matrix M = A B (R^T R = B B^T). The squared numerators of all (source, target) pairs are one matmul
over the flattened Grams: d_model^2 multiply-adds per pair instead of d_head^2 d_model for the product of the collapsed
factors (5x fewer for GPT-2). The Grams are symmetric, so only their upper block triangle is formed and multiplied
(off-diagonal blocks counted twice), one block of all heads at a time. The weights are read one layer at a time, W_K and
W_V per key/value group as stored (never repeated per query head), and the target heads go in chunks of layers, the
fewest whose working set fits the caller's byte budget (`cost` prices the same steps): on the Llama-3.2-1B shape one
kind fits the default 1 GiB in one chunk, all three in two. The per-pair QR collapse (TL's trick: A1 = Q1 R1, B2^T = Q2
R2, ||A1 B1 A2 B2|| = ||(R1 B1)(A2 R2^T)||) stays as composition_factors.py's `pair_scores`, the independent reference.
K- and V-composition of grouped-query models can instead go through the key/value weights each group shares
(grouped_composition.py: large products), where that pays (`grouped_route`).

The baseline subtracted from the scores is 1/sqrt(d_model), the expected score of random matrices; the sampled one
beside it is composition_baseline.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.composition_baseline import BASELINE_SAMPLES, random_baseline, random_baseline_cost
from circuits_core.circuits.composition_factors import KINDS, CompositionKind, LayerWeight, source_factor, target_factor
from circuits_core.circuits.folded import circuit_weight
from circuits_core.circuits.gram_pair_sums import (
    GRAM_BLOCK,
    ColumnGroup,
    block_pairs,
    column_blocks,
    gram_block_size,
    pair_sums,
    pair_sums_flops,
    pair_sums_numbers,
    row_blocks,
)
from circuits_core.circuits.grouped_composition import GROUPED_RATE, grouped_flops, grouped_numbers, grouped_scores
from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.model.transformer import Transformer
from circuits_core.schedule import side_by_side

# Large chunks sum each Gram block's pairs per group of target layers against only the earlier sources (target_groups):
# at Llama-3.1-8B shape groups of 4 layers (128 targets) compute 554k of the 992 x 992 pairs, groups of 8 615k, one
# product 984k (0.87, 0.93 and 1.36 s per Gram block of [rows, 16384] x [16384, targets]; load ~7). GPT-2's keep one.
CAUSAL_SPLIT_PAIRS, CAUSAL_GROUP_TARGETS = 500_000, 128


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


def chunk_bounds(n_layers: int, layers_per_chunk: int | None) -> list[tuple[int, int]]:
    """Target layers 1..L-1 in chunks of `layers_per_chunk` consecutive layers (all of them when None)."""
    m = max(1, n_layers - 1) if layers_per_chunk is None else max(1, layers_per_chunk)
    return [(t0, min(t0 + m, n_layers)) for t0 in range(1, n_layers, m)]


def layer_scores(
    weight: LayerWeight,
    shape: tuple[int, int, int, int, int],
    like: Tensor,
    kinds: tuple[CompositionKind, ...] = KINDS,
    should_stop: Callable[[], bool] | None = None,
    block: int = GRAM_BLOCK,
    layers_per_chunk: int | None = None,
    sources: Tensor | None = None,
) -> Tensor:
    """[K, L, H, L, H] scores reading the weights one layer at a time; shape = (L, H, group_size, d, dh), `like` a
    tensor of the compute dtype and device. 0 unless l1 < l2. `sources` [(L - 1) H, k, d]: the source factors of
    layers 0..L-2 (source_factor, layer-major) when the caller has formed them already.

    num^2 = ||W_OV^{h1} M^{h2}||_F^2 = <F^T F, P P^T>_F with the collapsed factors F [k, d] (source) and P [d, k]
    (target): all (source, target) pairs of all kinds are one matmul over the d x d Gram matrices. The Grams are
    symmetric, so only their upper block triangle is formed ((a, b) blocks with a <= b, off-diagonal ones counted
    twice), one block (a, b) of all heads at a time. The target heads go in chunks of consecutive layers: each
    chunk pairs with the sources of the layers before its last one, and re-forms their Gram blocks. Memory: the
    source factors, one chunk's target factors and one Gram block of each (`cost` prices the same steps).
    """
    L, H, gs, d, dh = shape
    K = len(kinds)
    if grouped_route(shape, kinds, block):  # K / V of grouped-query models: large products (grouped_composition)
        if sources is None:
            sources = like.new_empty((L - 1) * H, min(d, dh), d)
            for l1 in range(L - 1):
                _check_stop(should_stop)
                sources[l1 * H : (l1 + 1) * H] = source_factor(weight, l1, gs)
        return grouped_scores(sources, weight, shape, kinds, should_stop)
    raw = like.new_zeros(K, L, H, L, H)
    if L < 2:
        return raw
    size = gram_block_size(d, block)
    pairs, weights = block_pairs(d, size)
    nb, k, pair_weights = d // size, min(d, dh), weights.tolist()
    F = like.new_empty(nb, (L - 1) * H, k, size)  # source factors of layers 0..L-2 as column blocks
    src_sq = like.new_empty((L - 1) * H)  # ||W_OV||_F^2 = ||F||_F^2
    for l1 in range(L - 1):
        _check_stop(should_stop)
        F_l = source_factor(weight, l1, gs) if sources is None else sources[l1 * H : (l1 + 1) * H]  # [H, k, d]
        F[:, l1 * H : (l1 + 1) * H] = column_blocks(F_l, size)
        src_sq[l1 * H : (l1 + 1) * H] = torch.linalg.vector_norm(F_l, dim=(-2, -1)).square()
        del F_l
    for t0, t1 in chunk_bounds(L, layers_per_chunk):
        ns, nt = (t1 - 1) * H, (t1 - t0) * K * H  # sources: layers 0..t1-2; targets: layers t0..t1-1, all kinds
        P = like.new_empty(nb, nt, size, k)  # target factors as row blocks, rows ordered (layer, kind, head)
        tgt_sq = like.new_empty(nt)
        for j, (l2, kind) in enumerate((l2, kind) for l2 in range(t0, t1) for kind in kinds):
            _check_stop(should_stop)
            P_l = target_factor(weight, l2, kind, gs)  # [H, d, k]
            P[:, j * H : (j + 1) * H] = row_blocks(P_l, size)
            tgt_sq[j * H : (j + 1) * H] = torch.linalg.vector_norm(P_l, dim=(-2, -1)).square()
            del P_l
        num_sq = pair_sums(F[:, :ns], P, pairs, pair_weights, column_groups(t0, t1, H, K), should_stop).to(
            like.dtype
        )  # [ns, nt]
        del P
        num_sq = num_sq.view(t1 - 1, H, t1 - t0, K, H)  # [l1 = 0..t1-2, h1, l2 = t0..t1-1, kind, h2]
        den = src_sq[:ns].view(t1 - 1, H, 1, 1, 1).sqrt() * tgt_sq.view(1, 1, t1 - t0, K, H).sqrt()
        layer1, layer2 = torch.arange(t1 - 1, device=like.device), torch.arange(t0, t1, device=like.device)
        later = (layer1[:, None] < layer2[None, :])[:, None, :, None, None]  # l1 < l2
        scores = torch.where(later, num_sq.clamp_min_(0).sqrt_().div_(den), torch.zeros((), dtype=like.dtype))
        raw[:, : t1 - 1, :, t0:t1, :] = scores.permute(3, 0, 1, 2, 4)
        del num_sq, den, scores
    return raw


def column_groups(t0: int, t1: int, H: int, K: int) -> list[ColumnGroup]:
    """The chunk of target layers t0..t1-1 (K kinds of H heads each) as gram_pair_sums's column groups: each group of
    target_groups against the sources of the layers before its last one."""
    pairs = (t1 - 1) * H * (t1 - t0) * K * H
    return [((u1 - 1) * H, (u0 - t0) * K * H, (u1 - t0) * K * H) for u0, u1 in target_groups(t0, t1, K * H, pairs)]


def target_groups(t0: int, t1: int, per_layer: int, pairs: int) -> list[tuple[int, int]]:
    """Target layers t0..t1-1 in groups whose pair sums go in one product: all below CAUSAL_SPLIT_PAIRS pairs, else
    consecutive layers of at least CAUSAL_GROUP_TARGETS targets (`per_layer` each)."""
    if pairs < CAUSAL_SPLIT_PAIRS:
        return [(t0, t1)]
    step = max(1, -(-CAUSAL_GROUP_TARGETS // per_layer))
    return [(u, min(u + step, t1)) for u in range(t0, t1, step)]


def raw_composition_scores(
    W_Q: Tensor,
    W_K: Tensor,
    W_V: Tensor,
    W_O: Tensor,
    kinds: tuple[CompositionKind, ...] = KINDS,
    should_stop: Callable[[], bool] | None = None,
    block: int = GRAM_BLOCK,
    layers_per_chunk: int | None = None,
) -> Tensor:
    """[K, L, H, L, H] scores from stacked weights (W_Q/K/V [L, H, d, dh], W_O [L, H, dh, d], per query head); 0
    unless l1 < l2 (`layer_scores`, reading each layer as a view of the stacks)."""
    stacked = {"W_Q": W_Q, "W_K": W_K, "W_V": W_V, "W_O": W_O}
    L, H, d, dh = W_V.shape
    return layer_scores(
        lambda layer, name: stacked[name][layer], (L, H, 1, d, dh), W_V, kinds, should_stop, block, layers_per_chunk
    )


def model_weight(model: Transformer, dtype: torch.dtype) -> LayerWeight:
    """A layer's weights read from the model in `dtype` (W_K, W_V per key/value group as stored, no repeat), with the
    gains the forward pass keeps apart folded in (QK-norm, output norms: folded.py's weight-level form)."""

    def weight(layer: int, name: str) -> Tensor:
        return circuit_weight(model, layer, name).to(dtype)

    return weight


def composition_scores(
    model: Transformer,
    kinds: tuple[CompositionKind, ...] = KINDS,
    n_samples: int = BASELINE_SAMPLES,
    seed: int = 0,
    should_stop: Callable[[], bool] | None = None,
    budget_bytes: int | None = None,
) -> CompositionScores:
    """Q-, K- and V-composition scores of every (earlier head, later head) pair, with the random baseline. The
    target heads go in the fewest chunks of layers whose working set `cost` prices within `budget_bytes` (all at
    once when None)."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    dtype = model.compute_dtype
    chunk = layers_per_chunk(model, kinds, budget_bytes)
    shape = (L, H, cfg.group_size, cfg.d_model, cfg.d_head)
    like = torch.empty((), dtype=dtype, device=model.device)
    with torch.no_grad():
        raw, (sampled, std) = side_by_side(  # the sampled baseline (model-independent) beside the scores
            lambda: layer_scores(
                model_weight(model, dtype), shape, like, kinds, should_stop, layers_per_chunk=chunk
            ),  # [K, L, H, L, H]
            lambda: random_baseline(cfg.d_model, cfg.d_head, n_samples=n_samples, seed=seed),
            "qkov-baseline",
        )
    layer = torch.arange(L, device=model.device)
    mask = (layer[:, None, None, None] < layer[None, None, :, None]).expand(L, H, L, H)
    baseline = 1.0 / math.sqrt(cfg.d_model)
    raw_d = {kind: raw[i] for i, kind in enumerate(kinds)}
    minus = {kind: torch.where(mask, s - baseline, torch.zeros_like(s)) for kind, s in raw_d.items()}
    return CompositionScores(raw_d, minus, baseline, sampled, std, mask)


def scores_numbers(model: Transformer, kinds: tuple[CompositionKind, ...], layers_per_chunk: int | None) -> int:
    """Peak numbers (compute dtype) layer_scores holds beyond the model's weights, from the same steps: the scores,
    the source factors, then per chunk the larger of (a) its target factors while one layer's are formed (the
    layer's weights converted, a QR's copy of its input and R), (b) its target factors and one Gram block of each
    head and the pair sums per worker (gram_pair_sums), (c) the pair sums, denominators and scores; each source
    layer's formation before it."""
    cfg = model.cfg
    L, H, G, d, dh, K = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_model, cfg.d_head, len(kinds)
    out = K * (L * H) ** 2
    if L < 2:
        return out
    size, k = gram_block_size(d), min(d, dh)
    layer, group = H * d * dh, G * d * dh  # one layer's W_Q or W_O, W_K or W_V
    F = (L - 1) * H * (k * d + 1)  # source factors and norms
    source = layer + 2 * group + G * k * dh + H * k * d  # W_O, W_V and the QR's copy of it, R_V, F of one layer
    peak, n_pairs = out + F + source, len(block_pairs(d, size)[0])
    shape = (L, H, cfg.group_size, d, dh)
    if grouped_route(shape, kinds, GRAM_BLOCK):  # the scores, the factors, then grouped_composition's buffers
        return max(peak, out + F + grouped_numbers(shape, k, K, model.device))
    for t0, t1 in chunk_bounds(L, layers_per_chunk):
        ns, nt = (t1 - 1) * H, (t1 - t0) * K * H
        P = nt * (d * k + 1)
        forming = 3 * layer + H * k * dh + H * d * k  # A, B^T and the QR's copy of it, R, P of one layer
        blocks = pair_sums_numbers(ns, nt, size, model.device, itemsize(model.compute_dtype))
        small = 2 * (ns + nt) + n_pairs + 4 * L + 8  # norms' roots, block weights, masks
        peak = max(peak, out + F + P + max(forming, blocks) + small, out + F + 3 * ns * nt + small)
    return peak


def layers_per_chunk(model: Transformer, kinds: tuple[CompositionKind, ...], budget_bytes: int | None) -> int | None:
    """The most target layers per chunk (the fewest chunks) whose `cost` fits `budget_bytes`; one layer when none
    fits (then the price says so); None (all at once) without a budget."""
    if budget_bytes is None:
        return None
    for m in range(max(1, model.cfg.n_layers - 1), 1, -1):
        if _priced(model, kinds, m).peak_bytes <= budget_bytes:
            return m
    return 1


def cost(model: Transformer, kinds: tuple[CompositionKind, ...] = KINDS, budget_bytes: int | None = None) -> Cost:
    """composition_scores for `kinds` in the chunks it chooses for `budget_bytes` (`scores_numbers`), the
    baseline-subtracted copies and the mask, the random baseline sampled beside them; answer: two [sources x
    targets] tables (raw, minus baseline) and the top pairs, per kind."""
    cfg = model.cfg
    L, H, K = cfg.n_layers, cfg.n_heads, len(kinds)
    Ns = max(0, L - 1) * H
    per_kind = 2 * Ns * (Ns if L > 1 else 0) + 30
    return _priced(model, kinds, layers_per_chunk(model, kinds, budget_bytes)).with_answer(
        numbers=K * per_kind, labels=K * (2 * Ns + 20)
    )


def _priced(model: Transformer, kinds: tuple[CompositionKind, ...], layers_per_chunk: int | None) -> Cost:
    L, H, K = model.cfg.n_layers, model.cfg.n_heads, len(kinds)
    numbers = scores_numbers(model, kinds, layers_per_chunk) + 2 * K * (L * H) ** 2  # + minus baseline, mask
    flops = scores_flops(model, kinds, layers_per_chunk)
    return Cost(numbers * itemsize(model.compute_dtype), flops=flops) + random_baseline_cost(
        model.cfg.d_model, model.cfg.d_head
    )


def scores_flops(
    model: Transformer, kinds: tuple[CompositionKind, ...], layers_per_chunk: int | None, block: int = GRAM_BLOCK
) -> int:
    """FLOPs of layer_scores' products, from the same steps: each source layer's factor (the d_head Gram of W_V per
    key/value group, R_V W_O per head), then grouped_composition's products where layer_scores takes that route,
    else per chunk each target layer's factor per kind (the Gram of B^T, A R^T) and the chunk's pair sums
    (gram_pair_sums)."""
    cfg = model.cfg
    shape = (cfg.n_layers, cfg.n_heads, cfg.group_size, cfg.d_model, cfg.d_head)
    if grouped_route(shape, kinds, block):
        return _source_flops(shape) + grouped_flops(shape, min(cfg.d_model, cfg.d_head), len(kinds))
    return _gram_flops(shape, kinds, layers_per_chunk, block)


def grouped_route(shape: tuple[int, int, int, int, int], kinds: tuple[CompositionKind, ...], block: int) -> bool:
    """Whether layer_scores computes `kinds` through grouped_composition: K and V only, heads sharing their key/value
    weights, and its FLOPs within GROUPED_RATE of the Gram route's (both without chunks)."""
    L, _, gs, d, dh = shape
    if gs < 2 or L < 2 or not set(kinds) <= {"k", "v"}:
        return False
    grouped = _source_flops(shape) + grouped_flops(shape, min(d, dh), len(kinds))
    return grouped <= GROUPED_RATE * _gram_flops(shape, kinds, None, block)


def _source_flops(shape: tuple[int, int, int, int, int]) -> int:
    """FLOPs of the source factors of layers 0..L-2 (source_factor: W_V's d_head Grams per group, R_V W_O)."""
    L, H, gs, d, dh = shape
    gram = 2 * d * dh * dh if d >= dh else 0  # one d_head Gram (a QR below d_head rows: not a product)
    return (L - 1) * ((H // gs) * gram + 2 * H * min(d, dh) * dh * d)


def _gram_flops(
    shape: tuple[int, int, int, int, int], kinds: tuple[CompositionKind, ...], layers_per_chunk: int | None, block: int
) -> int:
    L, H, gs, d, dh = shape
    G, K = H // gs, len(kinds)
    if L < 2:
        return 0
    size, k = gram_block_size(d, block), min(d, dh)
    gram = 2 * d * dh * dh if d >= dh else 0
    target = {"q": G * gram, "k": H * gram, "v": H * gram}  # B^T's Grams: W_K per group, W_Q or W_O^T per head
    n_pairs, flops = len(block_pairs(d, size)[0]), _source_flops(shape)
    for t0, t1 in chunk_bounds(L, layers_per_chunk):
        flops += (t1 - t0) * sum(target[kind] + 2 * H * d * dh * k for kind in kinds)  # + A R^T per head
        flops += pair_sums_flops((t1 - 1) * H, (t1 - t0) * K * H, size, k, n_pairs, column_groups(t0, t1, H, K))
    return flops
