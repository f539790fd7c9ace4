"""The formed d_model x d_model OV circuits of a model, in float64: the dense reference the per-head engine
functions are tested against (tests/core/test_ov_effective_rank.py, test_ov_trace.py), OV circuits planted with a
chosen spectrum, and the check of a per-head function's price against the bytes it holds."""

from __future__ import annotations

from collections.abc import Callable

import torch

from circuits_core.cost import Cost
from circuits_core.model.transformer import Block, Transformer
from tests.held_bytes import HeldBytes


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


def plant_ov_spectra(model: Transformer, spectra: list[torch.Tensor], values_side: tuple[int, ...] = ()) -> None:
    """Layer 0's head h gets an OV circuit whose singular values are spectra[h] exactly (an attention-only float64
    model with d_head-long spectra): W_V = Q1, W_O = diag(s) Q2^T with orthonormal Q1 [d_model, d_head], Q2; for the
    heads in `values_side`, W_V = Q1 diag(s), W_O = Q2^T (a singular W_V where s has zeros)."""
    attn = model.blocks[0].attn
    gen = torch.Generator().manual_seed(2)
    d_model, d_head = model.cfg.d_model, model.cfg.d_head
    with torch.no_grad():
        for h, s in enumerate(spectra):
            Q1 = torch.linalg.qr(torch.randn(d_model, d_head, generator=gen, dtype=torch.float64))[0]
            Q2 = torch.linalg.qr(torch.randn(d_model, d_head, generator=gen, dtype=torch.float64))[0]
            attn.W_V[h].copy_(Q1 * s.double() if h in values_side else Q1)
            attn.W_O[h].copy_(Q2.T if h in values_side else s.double()[:, None] * Q2.T)


def assert_priced_within_twice_the_held_peak(
    model: Transformer, statistic: Callable[[Transformer], torch.Tensor], cost: Callable[[Transformer], Cost]
) -> Cost:
    """statistic(model) holds (tensors it makes, the model's weights excluded) at most cost(model)'s peak, and the
    price is not above twice that; the price, for the caller's further checks."""
    with torch.no_grad(), HeldBytes([*model.parameters(), *model.buffers()]) as held:
        statistic(model)
    priced = cost(model)
    assert 0 < held.peak <= priced.peak_bytes <= 2 * held.peak, (held.peak, priced.peak_bytes)
    return priced
