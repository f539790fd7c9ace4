"""QK symmetry per head: how symmetric the bilinear form W_QK = W_Q W_K^T of a head is (docs/maths.md §2.19).

For head h of a layer, with W_Q[h] [d_model, d_head] and W_K[g] [d_model, d_head] of its key/value group
g = h // group_size, the symmetry of the d_model x d_model W_QK = W_Q[h] W_K[g]^T is
    s = trace(W_QK W_QK) / ||W_QK||_F^2 = (||S||_F^2 - ||A||_F^2) / (||S||_F^2 + ||A||_F^2)
with S, A its symmetric and antisymmetric parts: 1 for a symmetric form (x^T W_QK y == y^T W_QK x: the score of a
query x on a key y is that of y on x), -1 for an antisymmetric one, 0 for a zero head. W_QK is never formed: with
M = W_K^T W_Q [d_head, d_head],
    trace(W_Q W_K^T W_Q W_K^T) = trace(M M) = sum(M * M^T),  ||W_Q W_K^T||_F^2 = sum((W_Q^T W_Q) * (W_K^T W_K)).
Each group's W_K broadcasts over its query heads. The weights are the circuits' weights (circuits/folded.py: QK-norm
gains folded in), in float64; on rotary models this is the form at relative offset 0 (query and key at one position).
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits.folded import circuit_weight
from circuits_core.cost import Cost, check_stop, float64_copy_size, itemsize
from circuits_core.model.transformer import Transformer


def qk_symmetries(model: Transformer) -> Tensor:
    """[n_layers, n_heads] float64: trace(W_QK W_QK) / ||W_QK||_F^2 of W_QK = W_Q[h] W_K[h // group_size]^T."""
    cfg = model.cfg
    out = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)  # [L, H]
    with torch.no_grad():
        for layer in range(cfg.n_layers):
            check_stop(what="QK symmetries")
            W_Q = circuit_weight(model, layer, "W_Q").double().unflatten(0, (cfg.n_kv_heads, cfg.group_size))
            W_K = circuit_weight(model, layer, "W_K").double()[:, None]  # [n_kv, 1, d_model, d_head]
            M = W_K.transpose(-1, -2) @ W_Q  # [n_kv, group, d_head, d_head]: W_K^T W_Q
            trace_square = (M * M.transpose(-1, -2)).sum((-1, -2)).flatten()  # [H]: trace(W_QK W_QK)
            gram_Q, gram_K = W_Q.transpose(-1, -2) @ W_Q, W_K.transpose(-1, -2) @ W_K  # [n_kv, group | 1, dh, dh]
            norm2 = (gram_Q * gram_K).sum((-1, -2)).flatten()  # [H]: ||W_QK||_F^2
            out[layer] = torch.where(norm2 > 0, trace_square / norm2, torch.zeros_like(norm2)).cpu()
    return out


def cost(model: Transformer) -> Cost:
    """qk_symmetries, one layer at a time: its W_Q, W_K as read (model dtype: copies where gains fold), their float64
    copies (none for a float64 model), W_K broadcast over each group's query heads by the batched product, then M,
    its product with its transpose, the Grams and their product (d_head x d_head per query head) and the [H] traces,
    norms and ratios beside the [L, H] answer; answer: one ratio per head, labelled."""
    cfg = model.cfg
    d, dh, H, G = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_kv_heads
    doubled = float64_copy_size(model.dtype)
    weights = (H + G) * d * dh * (itemsize(model.dtype) + doubled) + H * d * dh * 8
    small = (4 * H + G) * dh * dh * 8 + (cfg.n_layers + 4) * H * 8
    flops = cfg.n_layers * 2 * (2 * H + G) * d * dh * dh
    heads = cfg.n_layers * H
    return Cost(weights + small, flops=flops).with_answer(numbers=heads, labels=heads)
