"""OV effective rank per head: the participation ratio of the singular values of W_V W_O (docs/maths.md §2.18).

For head h of a layer, with W_V[g] [d_model, d_head] of its key/value group g = h // group_size and W_O[h]
[d_head, d_model], the OV circuit W_V[g] W_O[h] [d_model, d_model] has rank <= d_head and singular values
sigma_1..sigma_d_head. Its effective rank is the participation ratio
    (sum_i sigma_i^2)^2 / sum_i sigma_i^4
in [1, d_head] (1: one direction carries everything; d_head: all equal), 0 for a head whose W_OV is zero. The singular
values come from the factored form (circuits/factored.py: the SVD of the two d_head-wide factors and of their
d_head x d_head core), never the d_model x d_model product; each group's W_V is decomposed once, broadcast over
its query heads. The weights are the circuits' weights (circuits/folded.py: an output norm's gain folded into W_O), in
float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits.factored import FactoredMatrix, svd_cost
from circuits_core.circuits.folded import circuit_weight
from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.model.transformer import Transformer


def ov_effective_ranks(model: Transformer) -> Tensor:
    """[n_layers, n_heads] float64: (sum sigma^2)^2 / sum sigma^4 of each head's W_V[h // group_size] W_O[h]."""
    cfg = model.cfg
    ranks = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)  # [L, H]
    with torch.no_grad():
        for layer in range(cfg.n_layers):
            check_stop(what="OV effective ranks")
            W_V = circuit_weight(model, layer, "W_V").double()[:, None]  # [n_kv, 1, d_model, d_head]
            W_O = circuit_weight(model, layer, "W_O").double()  # [H, d_head, d_model]
            W_OV = FactoredMatrix(W_V, W_O.unflatten(0, (cfg.n_kv_heads, cfg.group_size)))  # [n_kv, group, d, d]
            sigma2 = W_OV.S.flatten(0, 1).square()  # [H, d_head]: sigma_i^2, query heads in order
            total, fourth = sigma2.sum(-1), sigma2.square().sum(-1)  # [H], [H]
            ranks[layer] = torch.where(fourth > 0, total.square() / fourth, torch.zeros_like(total)).cpu()
    return ranks


def cost(model: Transformer) -> Cost:
    """ov_effective_ranks, per layer: its W_V, W_O as read (model dtype) and in float64, and the factored SVD in float64
    (factored.svd_cost: W_V's n_kv factors decomposed once, W_O's per query head); answer: one ratio per head,
    labelled."""
    cfg = model.cfg
    d, dh, H, G = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_kv_heads
    weights = (H + G) * d * dh * (itemsize(model.dtype) + 8)
    layer = Cost(weights) + svd_cost(G, H, H, d, dh, d, 8)  # held together, one layer at a time
    heads = cfg.n_layers * H
    return Cost(layer.peak_bytes, flops=cfg.n_layers * layer.flops).with_answer(numbers=heads, labels=heads)
