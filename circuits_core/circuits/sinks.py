"""Learned attention sinks (gpt-oss) as a threshold on the QK circuit.

A head with sink logit b_h normalises each row over [s_i1 .. s_in, b_h] (attention.sink_softmax): with one
candidate key a query attends to it with probability sigma(s - b_h), so a token pair "beats the sink" when its
score s > b_h, and a row keeps sigma(LSE_j s_ij - b_h) of its mass on the keys (the rest is the sink's, never
renormalised). On the direct path (the residual stream = the token's embedding through ln1, exactly what layer 0
reads) the score of query token q against key token k at offset δ, biases included, is

    s(q, k, δ) = (ê_q W_Q + b_Q) R(δ) (ê_k W_K + b_K)ᵀ / scale        (ê = W_E_eff rows, R = I without rotary)

The token table of the QK circuit (head_circuits, rotary) leaves b_Q, b_K out, as TransformerLens does; the
threshold is compared with the full score above, so it is exact for layer-0 heads and the direct-path reading of
later ones.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits.embedding import embed_eff_rows
from circuits_core.circuits.head_circuits import check_head
from circuits_core.errors import InvalidInputError
from circuits_core.model.transformer import Attention, Transformer


def has_sinks(model: Transformer) -> bool:
    return model.cfg.attn_sinks


def sink_logit(model: Transformer, layer: int, head: int) -> float:
    """b_h of head (layer, head); InvalidInputError for a model without learned sinks."""
    check_head(model, layer, head)
    if not has_sinks(model):
        raise InvalidInputError("the model has no learned attention sinks")
    attn = model.blocks[layer].attn
    assert isinstance(attn, Attention)
    return float(attn.sinks[head])


def direct_scores(model: Transformer, layer: int, head: int, queries: Tensor, keys: Tensor, offset: int = 0) -> Tensor:
    """s(q, k, δ) [m] for token pairs (queries [m], keys [m]) at query-key offset δ (module docstring); -inf beyond
    a local layer's window."""
    check_head(model, layer, head)
    cfg = model.cfg
    window = cfg.layer_window(layer)
    if window is not None and offset >= window:  # a local layer never shows the pair: it cannot beat the sink
        return torch.full(queries.shape, float("-inf"), dtype=model.compute_dtype, device=model.device)
    if cfg.qk_norm is not None or cfg.attn_scores_soft_cap is not None:
        raise InvalidInputError("direct-path sink thresholds are defined here for heads without QK-norm or caps")
    attn = model.blocks[layer].attn
    assert isinstance(attn, Attention)
    dt = model.compute_dtype
    W_Q, W_K = attn.W_Q[head].to(dt), attn.grouped("W_K")[head // cfg.group_size].to(dt)  # [d, dh]
    q = embed_eff_rows(model, queries).to(dt) @ W_Q  # [m, dh]
    k = embed_eff_rows(model, keys).to(dt) @ W_K
    if cfg.use_bias:
        q = q + attn.b_Q[head].to(dt)
        k = k + attn.grouped("b_K")[head // cfg.group_size].to(dt)
    if cfg.positional_embedding_type == "rotary":  # q R(i) . k R(j) = q R(i - j) . k
        q = model.rotate(q, torch.tensor(offset, device=q.device), layer=layer)
    elif offset:
        raise InvalidInputError("offset applies to rotary models only")
    return (q * k).sum(-1) / cfg.scale


def attends_alone(model: Transformer, layer: int, head: int, scores: Tensor) -> Tensor:
    """sigma(s - b_h): the probability with which a query attends to a key that is its only candidate."""
    return torch.sigmoid(scores - sink_logit(model, layer, head))


def sink_mass(pattern: Tensor) -> Tensor:
    """1 - row sum [..., q] of a pattern [..., q, k] (a sink's share; 0 without sinks up to rounding)."""
    return 1 - pattern.sum(-1)
