"""ALiBi (Press et al. 2021, "Train Short, Test Long"): no positions in the residual stream; head h adds a linear
penalty to its scores,

    s_ij = x̂_i W_Q W_Kᵀ x̂_jᵀ / scale − m_h · (i − j),

so the QK circuit is one position-free content circuit plus an exactly linear positional kernel −m_h δ.
transformers adds m_h · j (BLOOM) or m_h · (j − n + 1) (MPT) instead: they differ from −m_h (i − j) by a constant
per row, which the softmax ignores, so the patterns are the same; qkov's hook_attn_scores carry −m_h (i − j).

Slopes: with H a power of two both rules give m_h = 2^(−8h/H), h = 1..H. Otherwise
- BLOOM: the H' = 2^⌊log2 H⌋ slopes of H', then every other slope (odd powers) of 2H' for the H − H' heads left;
- MPT: the 2^⌈log2 H⌉ slopes 2^(−b h / 2^⌈log2 H⌉) (b = alibi_bias_max), odd positions first then even, cut to H.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from circuits_core.model.config import ModelConfig


def alibi_slopes(cfg: ModelConfig) -> Tensor:
    """m_h [n_heads] (float64) by the config's rule (module docstring)."""
    H = cfg.n_heads
    if cfg.alibi == "mpt":
        n2 = 2 ** math.ceil(math.log2(H))
        slopes = 1.0 / 2.0 ** (torch.arange(1, n2 + 1, dtype=torch.float64) * (cfg.alibi_bias_max / n2))
        return torch.cat([slopes[1::2], slopes[::2]])[:H] if n2 != H else slopes
    p = 2 ** math.floor(math.log2(H))
    slopes = (2.0 ** (-(2.0 ** -(math.log2(p) - 3)))) ** torch.arange(1, p + 1, dtype=torch.float64)
    if p != H:
        extra = (2.0 ** (-(2.0 ** -(math.log2(2 * p) - 3)))) ** torch.arange(
            1, 1 + 2 * min(p, H - p), 2, dtype=torch.float64
        )
        slopes = torch.cat([slopes, extra])
    return slopes


def alibi_kernel(cfg: ModelConfig, n: int, device: torch.device | None = None) -> Tensor:
    """−m_h (i − j) [n_heads, n (query), n (key)] (float64): the positional term of every head's scores."""
    pos = torch.arange(n, dtype=torch.float64, device=device)
    return -alibi_slopes(cfg).to(device)[:, None, None] * (pos[:, None] - pos[None, :])
