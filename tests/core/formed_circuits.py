"""The formed d_model x d_model OV circuits of a model, in float64: the dense reference the per-head engine
functions are tested against (tests/core/test_ov_effective_rank.py, test_ov_trace.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from circuits_core.model.transformer import Block, Transformer


def per_head_of_formed_ov(model: Transformer, statistic: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """[L, H] float64: statistic(W_OV) of each head's formed W_V[h * n_kv // H] W_O[h] [d_model, d_model] (the output
    norm's gain, if any, multiplying W_O's columns)."""
    cfg = model.cfg
    out = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64)
    for layer in range(cfg.n_layers):
        block = model.blocks[layer]
        assert isinstance(block, Block)
        W_V = block.attn.grouped("W_V").double()  # [n_kv, d_model, d_head] as stored
        gain = block.ln1_post.w.double() if cfg.post_norms else torch.ones(cfg.d_model, dtype=torch.float64)
        for h in range(cfg.n_heads):
            W_OV = W_V[h * cfg.n_kv_heads // cfg.n_heads] @ (block.attn.W_O[h].double() * gain)  # [d_model, d_model]
            out[layer, h] = statistic(W_OV)
    return out
