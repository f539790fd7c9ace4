"""OV top singular share per head: sigma_1^2 / sum_i sigma_i^2 of W_V W_O, how close to rank one a head's OV map is
(docs/maths.md §2.21).

For head h of a layer, with W_V[g] [d_model, d_head] of its key/value group g = h // group_size and W_O[h]
[d_head, d_model], the OV circuit W_OV = W_V[g] W_O[h] [d_model, d_model] has rank <= d_head and singular values
sigma_1 >= ... >= sigma_d_head. The share of its squared Frobenius norm in its top singular value is
    ||W_OV||_2^2 / ||W_OV||_F^2 = sigma_1^2 / sum_i sigma_i^2
in [1 / d_head, 1] (1: rank one; 1 / d_head: all directions equally strong), 0 for a head whose W_OV is zero; its
inverse is the stable rank. The d_model x d_model product is never formed: with R [d_head, d_head] a root of the
group's Gram, R^T R = W_V^T W_V (circuits/gram_root.py), W_OV^T W_OV = W_O^T R^T R W_O, so the sigma_i^2 are the
eigenvalues of the symmetric d_head x d_head matrix R G_O R^T with G_O = W_O W_O^T. Each group's root is taken once.
The weights are the circuits' weights (circuits/folded.py: an output norm's gain folded into W_O), in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits.folded import circuit_weight, float64_weights_bytes
from circuits_core.circuits.gram_root import gram_root
from circuits_core.cost import Cost, check_stop
from circuits_core.model.transformer import Transformer


def ov_top_singular_shares(model: Transformer) -> Tensor:
    """[n_layers, n_heads] float64: sigma_1^2 / sum sigma^2 of each head's W_V[h // group_size] W_O[h]."""
    cfg = model.cfg
    shares = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)  # [L, H]
    with torch.no_grad():
        for layer in range(cfg.n_layers):
            check_stop(what="OV top singular shares")
            shares[layer] = _layer_shares(model, layer).cpu()
    return shares


def _layer_shares(model: Transformer, layer: int) -> Tensor:
    """[n_heads] the top singular shares of one layer's heads (its float64 weights freed on return, before the next
    layer's are made)."""
    W_V = circuit_weight(model, layer, "W_V").double()  # [n_kv, d_model, d_head]
    W_O = circuit_weight(model, layer, "W_O").double()  # [H, d_head, d_model]
    R = gram_root(W_V).repeat_interleave(model.cfg.group_size, 0)  # [H, d_head, d_head]: R^T R = W_V^T W_V
    G_O = W_O @ W_O.transpose(-2, -1)  # [H, d_head, d_head]
    sigma2 = torch.linalg.eigvalsh(R @ G_O @ R.transpose(-2, -1))  # [H, d_head] ascending: sigma_i^2
    total = sigma2.sum(-1)  # [H]: ||W_OV||_F^2
    return torch.where(total > 0, sigma2[:, -1] / total, torch.zeros_like(total))


def cost(model: Transformer) -> Cost:
    """ov_top_singular_shares, per layer: its W_V, W_O as read and in float64 (folded.float64_weights_bytes); then
    d_head x d_head float64 matrices, at most 4 per head at once (the root per query head, G_O, R G_O R^T and eigvalsh's
    working copy; before them the groups' Grams and roots, 2 per group); the shares and one layer's eigenvalues; FLOPs:
    the Grams (2 d_model d_head^2 each), the roots' Cholesky, R G_O R^T and its eigenvalues (about 8 d_head^3 per head);
    answer: one share per head, labelled."""
    cfg = model.cfg
    d, dh, H, G = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_kv_heads
    weights = float64_weights_bytes(model, "W_V", "W_O")
    squares = 4 * H * dh * dh * 8  # R per head, G_O, R G_O R^T, eigvalsh's copy (more than the 2 per group before)
    vectors = (cfg.n_layers * H + 4 * H + H * dh) * 8  # the shares [L, H]; the eigenvalues [H, dh]; total, ratio
    flops = 2 * (G + H) * d * dh * dh + (G + 8 * H) * dh**3
    heads = cfg.n_layers * H
    return Cost(weights + squares + vectors, flops=cfg.n_layers * flops).with_answer(numbers=heads, labels=heads)
