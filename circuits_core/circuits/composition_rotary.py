"""Q- and K-composition of rotary models as profiles over the query-key offset δ; V-composition unchanged.

Paper section: "Composition" (Elhage et al. 2021; docs/maths.md §2.9) with the QK circuit at an offset of
rotary.py: Ω_B(δ) = W_Q^B R(δ) W_K^{gT}. Row-vector convention, as composition.py. For an earlier head A
(W_OV^A = W_V^A W_O^A) and a later head B:
    C_Q(δ) = ||W_OV^A Ω_B(δ)||_F   / (||W_OV^A||_F ||Ω_B(δ)||_F)
    C_K(δ) = ||W_OV^A Ω_B(δ)^T||_F / (||W_OV^A||_F ||Ω_B(δ)||_F)
    C_V    = composition.py's V-composition (rotation does not touch values)
At δ = 0 these are composition.py's scores (TransformerLens's QK is Ω(0)).

Exactly through d_head x d_head Gram matrices, ||X R Y||^2 = <X^T X, R (Y^T Y) R^T>: with F_A = R_V^A W_O^A
(R_V^A the R factor of W_V^A's QR, so ||W_OV^A Z|| = ||F_A Z||), P = F_A W_Q^B and P' = F_A W_K^g [d_head, d_head]:
    num_Q(δ)^2 = <P^T P, R(δ) G_K^g R(δ)^T>       num_K(δ)^2 = <P'^T P', R(δ)^T G_Q^B R(δ)>
    ||Ω_B(δ)||^2 = <G_Q^B, R(δ) G_K^g R(δ)^T>      (G_Q = W_Q^T W_Q, G_K = W_K^T W_K)
so a whole profile costs one d_head x d_model x d_head product per pair (per key/value group for K), a d_head^3
Gram and 3/4 d_head^2 per offset (the symmetric Grams packed); the rotated Grams of all offsets come from a four-term
form (rotated_grams.py). The offset window is PROFILE_OFFSETS (δ = 0..64) unless given.

Random baseline: rotary_baseline.random_baseline (rotation-invariant: one value for every δ; under GQA one key
factor shared by the group's query heads).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from circuits_core.circuits.composition import layer_scores, layers_per_chunk, model_weight, scores_numbers
from circuits_core.circuits.composition_factors import CompositionKind, LayerWeight, source_factor
from circuits_core.circuits.folded import head_weights
from circuits_core.circuits.rotary import KERNEL_WINDOW, check_offsets, check_rotary, rotation
from circuits_core.circuits.rotary_baseline import baseline_cost, random_baseline
from circuits_core.circuits.rotated_grams import packed, pair_order, rotated_tables, swap_signs, term_weights
from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model.head_names import head_name, parse_head
from circuits_core.model.transformer import Transformer
from circuits_core.model.window import defined_offsets
from circuits_core.schedule import shared_tasks, side_by_side

PROFILE_OFFSETS = tuple(range(KERNEL_WINDOW + 1))  # δ = 0..64
# Source heads per product F W_T: P [96 d_head, (H + G) d_head] and its Grams stay in cache (~33 MB per worker on
# SmolLM2's shape), and the product is still a large matmul.
SOURCE_CHUNK = 96


@dataclass
class CompositionProfiles:
    """Every (earlier head, later head) pair's Q and K profiles over `offsets`, and V-composition.

    q, k: [L, H (earlier), L, H (later), n_offsets]; v: [L, H, L, H]; 0 unless layer1 < layer2. On a sliding-window
    target layer the offsets at or beyond its window are computed but never attended (`defined`); peaks skip them.
    Under QK-norm the later head's Ω is the weight-level form W_Q Γ_q R Γ_k W_K^T (qk_forms.py: "bilinear").
    """

    offsets: Tensor  # [n]
    q: Tensor
    k: Tensor
    v: Tensor
    baseline: float  # sampled mean score of random factors (rotation-invariant: one value for every δ)
    baseline_std: float
    mask: Tensor  # [L, H, L, H] bool: layer1 < layer2
    defined: Tensor | None = None  # [L (later layer), n_offsets] bool: offsets the later layer attends at

    def peak(self, kind: str) -> tuple[Tensor, Tensor]:
        """(max over the defined offsets [L, H, L, H], the offset where it is reached [L, H, L, H]) for kind q or k."""
        scores = self.profile(kind)
        if self.defined is not None:
            scores = scores.masked_fill(~self.defined[None, None, :, None, :].to(scores.device), float("-inf"))
        values, where = scores.max(dim=-1)
        return values, self.offsets.to(where.device)[where]

    def profile(self, kind: str) -> Tensor:
        if kind not in ("q", "k"):
            raise InvalidInputError(f"composition profiles are for kind q or k, got {kind!r}")
        return self.q if kind == "q" else self.k


class _Workspace:
    """One worker's reusable buffers: fresh 10-50 MB products per target layer would each cost their page faults."""

    def __init__(self, like: Tensor) -> None:
        self.like, self.buffers = like, dict[str, Tensor]()

    def take(self, name: str, *shape: int) -> Tensor:
        size = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < size:
            buffer = self.buffers[name] = self.like.new_empty(size)
        return buffer[:size].view(*shape)


@dataclass
class _Factors:
    """The pieces every target layer reads: the source factors and the rotation's d_head-sized tables."""

    weight: (
        LayerWeight  # composition.model_weight: one layer's W_Q [H, d, dh], W_K [G, d, dh], ... in the compute dtype
    )
    F: Tensor  # [L H, k, d] source factors R_V W_O (composition_factors.source_factor, k = min(d, dh)), layer-major
    src: Tensor  # [L H] ||W_OV||_F = ||F||_F
    order: Tensor  # [dh] pair_order
    weights: tuple[Tensor, Tensor]  # term_weights
    swap: Tensor  # [dh] swap_signs
    local_weights: tuple[Tensor, Tensor] | None = None  # term_weights of the local layers' own rope, when it differs

    def weights_of(self, model: Transformer, layer: int) -> tuple[Tensor, Tensor]:
        """The term weights target layer `layer` rotates with."""
        local = self.local_weights is not None and model.cfg.layer_window(layer) is not None
        return self.local_weights if local and self.local_weights is not None else self.weights


def _factors(model: Transformer, delta: Tensor, dtype: torch.dtype) -> _Factors:
    weight = model_weight(model, dtype)
    sources = range(max(1, model.cfg.n_layers - 1))  # every layer but the last (layer 0 of a 1-layer model: no pairs)
    mid = len(sources) // 2

    def factors_of(layers: range) -> list[Tensor]:
        return [source_factor(weight, layer, model.cfg.group_size) for layer in layers]

    first, second = side_by_side(lambda: factors_of(sources[:mid]), lambda: factors_of(sources[mid:]), "qkov-profiles")
    F = torch.cat(first + second)
    return _Factors(
        weight,
        F,
        F.pow(2).sum((-2, -1)).sqrt(),
        pair_order(model),
        term_weights(model, delta, dtype),
        swap_signs(model, dtype),
        _local_term_weights(model, delta, dtype),
    )


def _local_term_weights(model: Transformer, delta: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
    """term_weights of the local layers (their own rope base: ModelConfig.rotary_base_local), None when they rotate as
    the global layers do."""
    local = [layer for layer in range(model.cfg.n_layers) if model.cfg.layer_window(layer) is not None]
    if model.cfg.rotary_base_local is None or not local:
        return None
    return term_weights(model, delta, dtype, local[0])


def _target_layer(model: Transformer, f: _Factors, l2: int, q: Tensor, k: Tensor, ws: _Workspace, chunk: int) -> None:
    """q[:l2, :, l2], k[:l2, :, l2]: the profiles of every pair (source in layers < l2, target in l2), sources in
    chunks of `chunk` heads: P = F W_T [chunk k, (H + G) dh] in one product, the packed Grams of its d_head x d_head
    blocks (P^T P for each query head and key/value group), their inner products with the rotated Grams."""
    check_stop(what="composition profiles")
    cfg = model.cfg
    H, G, gs, dh, d = cfg.n_heads, cfg.n_kv_heads, cfg.group_size, cfg.d_head, cfg.d_model
    weights = f.weights_of(model, l2)
    C, h, n, rows = H + G, dh // 2, weights[0].shape[-1], f.F.shape[1]
    E = (h * dh, (dh - h) ** 2)  # packed sizes
    W_Qt = f.weight(l2, "W_Q").transpose(-2, -1)[:, f.order]  # [H, dh, d], rows in the pair order
    W_Kt = f.weight(l2, "W_K").transpose(-2, -1)[:, f.order]  # [G, dh, d]
    W_T = torch.cat([W_Qt, W_Kt]).view(C * dh, d)  # every query head, then every key/value group
    G_Q, G_K = W_Qt @ W_Qt.transpose(-2, -1), W_Kt @ W_Kt.transpose(-2, -1)  # [H | G, dh, dh]
    X_Q = rotated_tables(G_K, weights, f.swap, -1)  # [G, E, n]: R G_K R^T, shared by the group's heads
    X_K = [
        X.view(G, gs, e, n).transpose(1, 2).reshape(G, e, gs * n)  # [G, E, gs n]: R^T G_Q R of each head
        for X, e in zip(rotated_tables(G_Q, weights, f.swap, 1), E, strict=True)
    ]
    omega_sq = sum(torch.bmm(g.view(G, gs, e), X) for g, X, e in zip(packed(G_Q), X_Q, E, strict=True))
    omega = omega_sq.view(H, n).clamp_min(0).sqrt()  # type: ignore[union-attr]  # [H, n] ||Ω_B(δ)||_F
    q_rows, k_rows = q.view(-1, *q.shape[2:]), k.view(-1, *k.shape[2:])  # [L H (sources), L, H, n]
    for a0 in range(0, l2 * H, chunk):
        a1 = min(a0 + chunk, l2 * H)
        A = a1 - a0
        P = ws.take("P", A * rows, C * dh)
        torch.mm(f.F[a0:a1].view(A * rows, d), W_T.T, out=P)
        blocks = P.view(A, rows, C, dh)
        M = (ws.take("M0", C, A, h, dh), ws.take("M1", C, A, dh - h, dh - h))  # packed Grams (packed)
        for c in range(C):
            Pc = blocks[:, :, c]  # [A, k, dh]
            torch.bmm(Pc[..., :h].transpose(1, 2), Pc, out=M[0][c])
            torch.bmm(Pc[..., h:].transpose(1, 2), Pc[..., h:], out=M[1][c])
        num_q = sum(torch.bmm(m[:H].view(G, gs * A, e), X) for m, X, e in zip(M, X_Q, E, strict=True))
        num_k = sum(torch.bmm(m[H:].view(G, A, e), X) for m, X, e in zip(M, X_K, E, strict=True))
        num_q = num_q.view(H, A, n)  # type: ignore[union-attr]
        num_k = num_k.view(G, A, gs, n).transpose(1, 2).reshape(H, A, n)  # type: ignore[union-attr]
        den = f.src[a0:a1, None] * omega[:, None]  # [H, A, n]
        q_rows[a0:a1, l2] = (num_q.clamp_min(0).sqrt() / den).transpose(0, 1)
        k_rows[a0:a1, l2] = (num_k.clamp_min(0).sqrt() / den).transpose(0, 1)


def composition_profiles(
    model: Transformer,
    offsets: Sequence[int] | Tensor = PROFILE_OFFSETS,
    n_samples: int = 200,
    seed: int = 0,
    source_chunk: int = SOURCE_CHUNK,
) -> CompositionProfiles:
    """All pairs' Q/K profiles over the offsets and V-composition, exactly from d_head x d_head Grams.

    The work goes in tasks from one queue, longest first (V-composition, then the target layers from the last, the
    random baseline once half of the pairs are queued: the two largest holders of memory, V-composition and the
    baseline, do not run at once unless V outlasts half of the layers): two workers take them side by side
    (schedule.shared_tasks: in parallel when the caller's torch threads leave a core idle, in turn otherwise)."""
    check_rotary(model)
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    delta = check_offsets(model, offsets)
    dtype = model.compute_dtype
    q = torch.zeros(L, H, L, H, delta.numel(), dtype=dtype, device=model.device)
    k = torch.zeros_like(q)
    found: dict[str, Any] = {}
    with torch.no_grad():
        f = _factors(model, delta, dtype)

        def v_composition(ws: _Workspace) -> None:
            shape = (L, H, cfg.group_size, cfg.d_model, cfg.d_head)
            found["v"] = layer_scores(f.weight, shape, q, kinds=("v",), sources=f.F)[
                0
            ]  # [L, H, L, H], composition.py's

        def baseline(ws: _Workspace) -> None:
            found["baseline"] = random_baseline(cfg.d_model, cfg.d_head, cfg.group_size, n_samples=n_samples, seed=seed)

        def layer(l2: int) -> Callable[[_Workspace], None]:
            return lambda ws: _target_layer(model, f, l2, q, k, ws, max(1, source_chunk))

        layers = [layer(l2) for l2 in range(L - 1, 0, -1)]  # sources: l2 H heads each
        half = 1 + sum(2 * done < L * (L - 1) // 2 for done in itertools.accumulate(range(L - 1, 0, -1)))
        tasks = [v_composition, *layers[:half], baseline, *layers[half:]]
        shared_tasks(tasks, lambda: _Workspace(q), "qkov-profiles")
    layer_ = torch.arange(L, device=model.device)
    mask = (layer_[:, None, None, None] < layer_[None, None, :, None]).expand(L, H, L, H)
    mean, std = found["baseline"]
    defined = torch.stack([defined_offsets(cfg, layer, delta.to(model.device)) for layer in range(L)])
    return CompositionProfiles(delta, q, k, found["v"], mean, std, mask, defined)


def pair_profile(
    model: Transformer, source: str, target: str, kind: str, offsets: Sequence[int] | Tensor = PROFILE_OFFSETS
) -> Tensor:
    """One pair's profile [n_offsets] (kind q or k), source head earlier than target head."""
    check_rotary(model)
    (l1, h1), (l2, h2) = parse_head(source, model.cfg), parse_head(target, model.cfg)
    if l1 >= l2:
        raise InvalidInputError(f"{head_name(l1, h1)} must be in an earlier layer than {head_name(l2, h2)}")
    if kind not in ("q", "k"):
        raise InvalidInputError(f"composition profiles are for kind q or k, got {kind!r}")
    dtype = model.compute_dtype
    with torch.no_grad():
        F = source_factor(model_weight(model, dtype), l1, model.cfg.group_size)[h1]  # [k, d]
        W_Q, W_K = (W.to(dtype) for W in head_weights(model, l2, h2)[:2])  # [d, dh] each, QK-norm gains folded
        R = rotation(model, offsets, dtype=dtype, layer=l2)  # [n, dh, dh]
        G_Q, G_K = W_Q.T @ W_Q, W_K.T @ W_K
        P = F @ (W_Q if kind == "q" else W_K)  # [dh, dh]
        X = R @ G_K @ R.transpose(-2, -1) if kind == "q" else R.transpose(-2, -1) @ G_Q @ R  # [n, dh, dh]
        num_sq = ((P.T @ P)[None] * X).sum((-2, -1))  # [n]
        omega_sq = (G_Q[None] * (R @ G_K @ R.transpose(-2, -1))).sum((-2, -1))  # [n]
        return num_sq.clamp_min(0).sqrt() / (F.norm() * omega_sq.clamp_min(0).sqrt())


def composition_at(model: Transformer, kind: str, offset: int, budget_bytes: int | None = None) -> Tensor:
    """All pairs' Q- or K-composition at one offset [L, H, L, H]: composition.py's layer-by-layer Gram computation
    (layer_scores) with W_Q^B R(δ) in place of W_Q^B (its Q target W_Q W_K^T becomes Ω_B(δ), its K target Ω_B(δ)^T),
    W_K and W_V read per key/value group, the target layers in the fewest chunks whose price fits `budget_bytes`."""
    check_rotary(model)
    if kind not in ("q", "k"):
        raise InvalidInputError(f"composition at an offset is for kind q or k, got {kind!r}")
    cfg, dtype = model.cfg, model.compute_dtype
    with torch.no_grad():
        weight = model_weight(model, dtype)

        def rotated(layer: int, name: str) -> Tensor:  # W_Q [H, d, dh] of the layer turned by its own R(δ)
            R = rotation(model, [offset], dtype=dtype, layer=layer)[0]  # [dh, dh]
            return weight(layer, name) @ R if name == "W_Q" else weight(layer, name)

        kinds: tuple[CompositionKind, ...] = (kind,)  # type: ignore[assignment]
        shape = (cfg.n_layers, cfg.n_heads, cfg.group_size, cfg.d_model, cfg.d_head)
        like = torch.empty((), dtype=dtype, device=model.device)
        return layer_scores(rotated, shape, like, kinds, layers_per_chunk=layers_per_chunk(model, kinds, budget_bytes))[
            0
        ]


# -- costs (circuits_core.cost) ------------------------------------------------------------------------
def profiles_cost(model: Transformer, n_offsets: int, source_chunk: int = SOURCE_CHUNK, n_samples: int = 200) -> Cost:
    """composition_profiles, from its steps: the q and k results, the source factors and the offset weights held
    throughout, plus every task at once (two workers take them in any order, each keeping its buffers between its
    tasks, and freed memory is not always returned at once): two target layers (_target_layer: the layer's rows of
    W_Q and W_K and their Grams, the rotated tables, one source chunk's product P, its packed Grams and the
    [H, chunk, n] sums), V-composition (composition.scores_numbers) and the random baseline (baseline_cost)."""
    cfg = model.cfg
    L, H, G, dh, d, n = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_model, n_offsets
    C, k, h = H + G, min(d, dh), dh // 2
    E = h * dh + (dh - h) ** 2  # packed Gram entries
    chunk = max(1, min(source_chunk, (L - 1) * H))
    size = itemsize(model.compute_dtype)
    held = 2 * (L * H) ** 2 * n + (L - 1) * H * (k * d + 1) + 4 * E * n + 2 * n * dh
    weights_formed = 8 * n * dh * dh  # term_weights' [4, n, dh, dh] terms and their permuted copy, before any task
    layer = 2 * C * dh * d + C * dh * dh + 6 * H * dh * dh + (G + 2 * H) * E * n  # weights, Grams, tables
    worker = layer + chunk * k * C * dh + C * chunk * E + 10 * H * chunk * n
    tasks = (2 * worker + scores_numbers(model, ("v",), None)) * size + baseline_cost(
        d, dh, cfg.group_size, n_samples
    ).peak_bytes
    pairs = L * H * L * H // 2
    flops = 2 * sum(l2 * H * (k * d * C * dh + C * k * E + 2 * H * E * n) for l2 in range(1, L))
    return Cost(held * size + max(weights_formed * size, tasks), flops=flops).with_answer(
        numbers=pairs * (2 * n_offsets + 1), labels=L * H
    )


def pair_profile_cost(model: Transformer, n_offsets: int) -> Cost:
    """pair_profile: the d_head x d_head products per offset and the source layer's factors; FLOPs: the source
    layer's R_V W_O with R_V from each key/value head's Gram W_V^T W_V (gram_root; its Cholesky factorisation is not
    a matrix product, nor is the QR it keeps when d_model < d_head), P = F W, the two Grams, and per offset R G R^T
    twice (the numerator's and Ω's) and their d_head^3 products."""
    cfg = model.cfg
    d, dh, k = cfg.d_model, cfg.d_head, min(cfg.d_model, cfg.d_head)
    flops = 2 * cfg.n_heads * k * dh * d + 2 * k * d * dh + 2 * 2 * d * dh * dh + 2 * dh * k * dh
    flops += 2 * cfg.n_kv_heads * d * dh * dh if d >= dh else 0  # gram_root's W_V^T W_V
    flops += n_offsets * 4 * 2 * dh**3
    return Cost((3 * n_offsets * dh * dh + 4 * d * dh) * 8, flops=flops).with_answer(numbers=3 * n_offsets + 1)


def composition_at_cost(model: Transformer, kind: str, budget_bytes: int | None = None) -> Cost:
    """composition_at: layer_scores in the chunks `budget_bytes` chooses (composition.scores_numbers), one layer's
    rotated W_Q [H, d, dh] beside it while that layer's target factors form, and R(δ)."""
    cfg = model.cfg
    kinds: tuple[CompositionKind, ...] = (kind,)  # type: ignore[assignment]
    chunk = layers_per_chunk(model, kinds, budget_bytes)
    numbers = scores_numbers(model, kinds, chunk) + cfg.n_heads * cfg.d_model * cfg.d_head + cfg.d_head**2
    return Cost(numbers * itemsize(model.compute_dtype))
