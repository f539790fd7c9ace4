"""Soft-capping (Gemma 2): s -> c tanh(s / c), on the scaled attention scores (c = cfg.attn_scores_soft_cap) and on
the logits (c = cfg.output_logits_soft_cap).

The cap is monotone, so rankings and top-k are unchanged; only values are capped. For decompositions write
c tanh(s / c) = s g(s) with the cap factor g(s) = c tanh(s / c) / s (g(0) = 1): path terms of s multiplied by the
frozen g of their entry sum exactly to the capped value, as path terms through a frozen norm scale do.
"""

from __future__ import annotations

import torch
from torch import Tensor


def soft_cap(s: Tensor, cap: float | None) -> Tensor:
    """c tanh(s / c) (s itself when cap is None)."""
    return s if cap is None else torch.tanh(s / cap) * cap


def cap_factor(s: Tensor, cap: float | None) -> Tensor:
    """g(s) = c tanh(s / c) / s elementwise (1 where s = 0, or everywhere when cap is None)."""
    if cap is None:
        return torch.ones_like(s)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    return torch.where(s == 0, torch.ones_like(s), soft_cap(safe, cap) / safe)


def share_beyond_cap(s: Tensor, cap: float | None) -> float:
    """The share of entries of s with |s| > c (0 without a cap; NaN for an empty tensor)."""
    if cap is None:
        return 0.0
    finite = s[torch.isfinite(s)]
    return float((finite.abs() > cap).double().mean()) if finite.numel() else float("nan")
