"""QK circuit norm per head: the Frobenius norm of the paper's W_QK = W_Q W_K^T (docs/maths.md §2.17).

For head h of a layer, with W_Q[h] [d_model, d_head] and W_K[g] [d_model, d_head] of its key/value group
g = h // (n_heads / n_key_value_heads) (g = h without grouped-query attention), the d_model x d_model matrix
W_Q[h] W_K[g]^T is never formed:
    ||W_Q W_K^T||_F^2 = trace(W_K W_Q^T W_Q W_K^T) = trace((W_Q^T W_Q)(W_K^T W_K)) = sum((W_Q^T W_Q) * (W_K^T W_K))
(both Gram matrices [d_head, d_head] are symmetric, so the trace of the product is the sum of their elementwise
product). The weights are the circuits' weights (circuits/folded.py: QK-norm gains folded in), in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits.folded import circuit_weight, float64_weights_bytes
from circuits_core.cost import Cost, check_stop
from circuits_core.model.transformer import Transformer


def qk_circuit_norms(model: Transformer) -> Tensor:
    """[n_layers, n_heads] float64: ||W_Q[h] W_K[h // group_size]^T||_F of every head, from d_head x d_head Grams."""
    cfg = model.cfg
    norms = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)  # [L, H]
    with torch.no_grad():
        for layer in range(cfg.n_layers):
            check_stop(what="QK circuit norms")
            norms[layer] = _layer_norms(model, layer).cpu()
    return norms


def _layer_norms(model: Transformer, layer: int) -> Tensor:
    """[n_heads] the QK circuit norms of one layer's heads (its float64 weights freed on return, before the next
    layer's are made)."""
    W_Q = circuit_weight(model, layer, "W_Q").double()  # [H, d_model, d_head]
    W_K = circuit_weight(model, layer, "W_K").double()  # [n_kv, d_model, d_head]
    gram_Q = W_Q.transpose(-1, -2) @ W_Q  # [H, d_head, d_head]: W_Q^T W_Q
    gram_K = (W_K.transpose(-1, -2) @ W_K).repeat_interleave(model.cfg.group_size, dim=0)  # [H, d_head, d_head]
    squared = (gram_Q * gram_K).sum((-1, -2))  # [H]: trace((W_Q^T W_Q)(W_K^T W_K))
    return squared.clamp(min=0).sqrt()


def cost(model: Transformer) -> Cost:
    """qk_circuit_norms, per layer: its W_Q, W_K as read and in float64 (folded.float64_weights_bytes), W_Q's Grams [H],
    W_K's [n_kv] and their repeat per query head [H], and the elementwise product [H] (d_head x d_head each, float64);
    answer: one norm per head, labelled."""
    cfg = model.cfg
    d, dh, H, G = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.n_kv_heads
    weights = float64_weights_bytes(model, "W_Q", "W_K")
    grams = (G + 3 * H) * dh * dh * 8
    flops = cfg.n_layers * (2 * (H + G) * d * dh * dh + 2 * H * dh * dh)
    heads = cfg.n_layers * H
    return Cost(weights + grams, flops=flops).with_answer(numbers=heads, labels=heads)
