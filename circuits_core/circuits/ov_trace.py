"""OV trace per head: tr(W_OV) / ||W_OV||_F of each head's OV circuit W_OV = W_V W_O (docs/maths.md §2.20).

For head h of a layer, with W_V[g] [d_model, d_head] of its key/value group g = h // group_size and W_O[h]
[d_head, d_model], W_OV = W_V[g] W_O[h] [d_model, d_model] (row vectors: a residual direction x is written as x W_OV).
The ratio measures how much the circuit maps a direction back onto itself: positive when it copies it, negative when
it inverts it, in [-sqrt(d_head), sqrt(d_head)] (rank <= d_head), 0 for a zero circuit. Neither factor product
d_model x d_model is formed (the trace is cyclic):
    tr(W_V W_O) = tr(W_O W_V) = sum(W_O ⊙ W_V^T),    ||W_V W_O||_F^2 = tr(G_V G_O) = sum(G_V ⊙ G_O)
with the d_head x d_head Grams G_V = W_V^T W_V and G_O = W_O W_O^T (both symmetric). Each group's W_V and G_V serve
its query heads by broadcasting. The weights are the circuits' weights (circuits/folded.py: an output norm's gain
folded into W_O), in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits.folded import circuit_weight
from circuits_core.cost import Cost, check_stop, float64_copy_size, itemsize
from circuits_core.model.transformer import Transformer


def ov_traces(model: Transformer) -> Tensor:
    """[n_layers, n_heads] float64: tr(W_OV) / ||W_OV||_F of each head's W_V[h // group_size] W_O[h]."""
    cfg = model.cfg
    ratios = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)  # [L, H]
    with torch.no_grad():
        for layer in range(cfg.n_layers):
            check_stop(what="OV traces")
            W_V = circuit_weight(model, layer, "W_V").double()  # [n_kv, d_model, d_head]
            W_O = circuit_weight(model, layer, "W_O").double()  # [H, d_head, d_model]
            W_O_g = W_O.unflatten(0, (cfg.n_kv_heads, cfg.group_size))  # [n_kv, group, d_head, d_model]
            trace = (W_O_g * W_V.transpose(-2, -1)[:, None]).sum((-2, -1)).flatten()  # [H]: tr(W_O W_V)
            G_V = W_V.transpose(-2, -1) @ W_V  # [n_kv, d_head, d_head]
            G_O = (W_O @ W_O.transpose(-2, -1)).unflatten(0, (cfg.n_kv_heads, cfg.group_size))  # [n_kv, group, dh, dh]
            norm = (G_V[:, None] * G_O).sum((-2, -1)).flatten().clamp_min(0).sqrt()  # [H]: ||W_V W_O||_F
            ratios[layer] = torch.where(norm > 0, trace / norm, torch.zeros_like(trace)).cpu()
    return ratios


def cost(model: Transformer) -> Cost:
    """ov_traces, per layer: W_O with the output norm's gain folded (model dtype; a view of the weight without one),
    W_V and W_O in float64 (unless they are float64 already: no copy), the elementwise W_O ⊙ W_V^T
    [H, d_head, d_model] (float64), the Grams G_V [n_kv] and G_O [H] and G_V ⊙ G_O [H] (d_head x d_head each,
    float64), the ratios and one layer's vectors; FLOPs: the Grams (2 d_model d_head^2 each) and the two elementwise
    sums; answer: one ratio per head, labelled."""
    cfg = model.cfg
    d, dh, H, G = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_kv_heads
    wide = float64_copy_size(model.dtype)
    folded = H * dh * d * itemsize(model.dtype) if cfg.post_norms else 0  # W_O * gamma_post (circuits/folded.py)
    weights = folded + (H + G) * d * dh * wide
    product = H * dh * d * 8  # W_O ⊙ W_V^T
    grams = (G + 2 * H) * dh * dh * 8  # G_V, G_O and G_V ⊙ G_O
    vectors = (cfg.n_layers * H + 5 * H) * 8  # the ratios [L, H]; the trace, the norm, its square, the ratio, zeros
    flops = 2 * (G + H) * d * dh * dh + 2 * H * d * dh + 2 * H * dh * dh
    heads = cfg.n_layers * H
    return Cost(weights + product + grams + vectors, flops=cfg.n_layers * flops).with_answer(
        numbers=heads, labels=heads
    )
