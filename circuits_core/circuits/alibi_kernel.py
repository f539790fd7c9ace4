"""The positional kernel of an ALiBi head (model/alibi.py): its QK circuit is one position-free content circuit
W_Q W_Kᵀ plus the exactly linear term −m_h δ, so the score a typical query gives a typical key δ positions back is

    f_h(δ) = μ_l W_Q^h (W_K^g)ᵀ μ_lᵀ / scale − m_h δ

(μ_l the mean normalised residual entering layer l on a reference text, as for rotary heads in rotary.py): a
constant content part and a line of slope −m_h. It peaks at δ = 0 for every head, whatever the weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from circuits_core.errors import InvalidInputError
from circuits_core.model.alibi import alibi_slopes
from circuits_core.model.transformer import Transformer


def positional_kernel(model: Transformer, means: Tensor, offsets: Sequence[int] | Tensor) -> Tensor:
    """f_h(δ) for every head and offset: [n_layers, n_heads, n_offsets] (float64)."""
    cfg = model.cfg
    if cfg.alibi is None:
        raise InvalidInputError("the model has no ALiBi positions")
    if means.shape != (cfg.n_layers, cfg.d_model):
        raise InvalidInputError(
            f"means must be [n_layers, d_model] = [{cfg.n_layers}, {cfg.d_model}], got {tuple(means.shape)}"
        )
    delta = torch.as_tensor(offsets, dtype=torch.float64, device=model.device)  # [n]
    if delta.numel() and (delta.min() < 0 or delta.max() >= cfg.n_ctx):
        raise InvalidInputError(f"offsets must be in [0, {cfg.n_ctx}), got {delta.min():.0f}..{delta.max():.0f}")
    mu = means.double()
    q = (mu[:, None, None, :] @ model.W_Q.double())[:, :, 0]  # [L, H, dh]
    k = (mu[:, None, None, :] @ model.W_K_groups.double())[:, :, 0].repeat_interleave(cfg.group_size, dim=1)
    content = (q * k).sum(-1) / cfg.scale  # [L, H]: no rotation, the same at every offset
    return content[:, :, None] - alibi_slopes(cfg).to(model.device)[None, :, None] * delta  # [L, H, n]
