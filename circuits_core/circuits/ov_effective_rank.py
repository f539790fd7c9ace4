"""OV effective rank per head: the participation ratio of the singular values of W_V W_O (docs/maths.md §2.18).

For head h of a layer, with W_V[g] [d_model, d_head] of its key/value group g = h // group_size and W_O[h]
[d_head, d_model], the OV circuit W_V[g] W_O[h] [d_model, d_model] has rank <= d_head and singular values
sigma_1..sigma_d_head. Its effective rank is the participation ratio
    (sum_i sigma_i^2)^2 / sum_i sigma_i^4
in [1, d_head] (1: one direction carries everything; d_head: all equal), 0 for a head whose W_OV is zero. Both sums are
traces of d_head x d_head products, so no singular value is computed and the d_model x d_model product is never
formed: with the Grams G_V = W_V[g]^T W_V[g] and G_O = W_O[h] W_O[h]^T and P = G_V G_O,
    sum sigma^2 = ||W_V W_O||_F^2 = tr(P),    sum sigma^4 = ||(W_V W_O)^T W_V W_O||_F^2 = tr(P P).
Each group's G_V is formed once, broadcast over its query heads. The weights are the circuits' weights
(circuits/folded.py: an output norm's gain folded into W_O), in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits.folded import circuit_weight, float64_weights_bytes
from circuits_core.cost import Cost, check_stop
from circuits_core.model.transformer import Transformer


def ov_effective_ranks(model: Transformer) -> Tensor:
    """[n_layers, n_heads] float64: (sum sigma^2)^2 / sum sigma^4 of each head's W_V[h // group_size] W_O[h]."""
    cfg = model.cfg
    ranks = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)  # [L, H]
    with torch.no_grad():
        for layer in range(cfg.n_layers):
            check_stop(what="OV effective ranks")
            ranks[layer] = _layer_ranks(model, layer).cpu()
    return ranks


def _layer_ranks(model: Transformer, layer: int) -> Tensor:
    """[n_heads] the effective ranks of one layer's heads (its float64 weights freed on return, before the next
    layer's are made)."""
    cfg = model.cfg
    W_V = circuit_weight(model, layer, "W_V").double()  # [n_kv, d_model, d_head]
    W_O = circuit_weight(model, layer, "W_O").double()  # [H, d_head, d_model]
    G_V = W_V.transpose(-2, -1) @ W_V  # [n_kv, d_head, d_head]
    G_O = W_O @ W_O.transpose(-2, -1)  # [H, d_head, d_head]
    P = (G_V[:, None] @ G_O.unflatten(0, (cfg.n_kv_heads, cfg.group_size))).flatten(0, 1)  # [H, dh, dh]
    total = P.diagonal(dim1=-2, dim2=-1).sum(-1)  # [H]: tr(P) = sum sigma^2
    fourth = (P * P.transpose(-2, -1)).sum((-2, -1))  # [H]: tr(P P) = sum sigma^4
    return torch.where(fourth > 0, total.square() / fourth, torch.zeros_like(total))


def cost(model: Transformer) -> Cost:
    """ov_effective_ranks, per layer: its W_V, W_O as read and in float64 (folded.float64_weights_bytes), the Grams G_V
    [n_kv] (and its copy per query head that the batched product makes) and G_O [H], P [H] and the elementwise P * P^T
    [H] (d_head x d_head each, float64), the ranks and one layer's traces; FLOPs: the Grams (2 d_model d_head^2 each)
    and P (2 d_head^3 per head); answer: one ratio per head, labelled."""
    cfg = model.cfg
    d, dh, H, G = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_kv_heads
    weights = float64_weights_bytes(model, "W_V", "W_O")
    grams = (G + 4 * H) * dh * dh * 8  # G_V, its copy per query head (the batched product), G_O, P and P * P^T
    vectors = (cfg.n_layers * H + 4 * H) * 8  # the ranks [L, H]; tr(P), tr(P P), their ratio, the zeros [H]
    flops = 2 * (G + H) * d * dh * dh + 2 * H * dh**3
    heads = cfg.n_layers * H
    return Cost(weights + grams + vectors, flops=cfg.n_layers * flops).with_answer(numbers=heads, labels=heads)
