"""QK-norm: queries and keys RMS-normalised after projection, before the rotation (Qwen3, Gemma 3, OLMo 2/3).

q = x W_Q / rho_q(x) * gamma_q (and k likewise), with rho the RMS of the projection as the model computes it,
rho = sqrt(mean(q^2) + eps): per head over d_head (cfg.qk_norm "head": Qwen3, Gemma 3; gains [d_head]) or over
all heads of the layer at once (cfg.qk_norm "layer": OLMo 2/3; gains [heads * d_head], so one rho per token
couples the layer's heads). The score is then one fixed bilinear form W_Q Gamma_q R Gamma_k W_K^T read through the
per-token scalars 1 / (rho_q(i) rho_k(j)) (circuits/qk_forms.py, docs/maths.md §7.1). Folding gamma into W_Q changes
the RMS it divides by, so the forward pass keeps gamma apart; the circuits fold it (labelled so).

Hooks: `blocks.{l}.attn.q_norm.hook_scale` / `k_norm.hook_scale` [batch, pos, heads, 1] per head, [batch, pos,
1, 1] per layer (rho); `hook_normalized` the normalised projection before the rotation. A frozen run may
replace the scales (hooks.Frozen.ln_scales, keyed by these hook names), as the path expansions do.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from circuits_core.model.config import ModelConfig
from circuits_core.model.hooks import Frozen, Recorder


class QKNorm(nn.Module):
    """RMSNorm of a projection [batch, pos, heads, d_head], per head or over the layer's heads (cfg.qk_norm)."""

    def __init__(self, cfg: ModelConfig, name: str, heads: int):
        super().__init__()
        self.cfg, self.name, self.heads = cfg, name, heads
        self.per_head = cfg.qk_norm == "head"
        self.w = nn.Parameter(torch.ones(cfg.d_head if self.per_head else heads * cfg.d_head))

    def gain(self) -> Tensor:
        """gamma as [heads, d_head] (per head: the one gain repeated over the heads)."""
        dh = self.cfg.d_head
        return self.w.expand(self.heads, dh) if self.per_head else self.w.view(self.heads, dh)

    def forward(self, x: Tensor, rec: Recorder, frozen: Frozen | None) -> Tensor:
        # x [batch, pos, heads, d_head] -> the same shape, normalised and scaled by gamma
        key = f"{self.name}.hook_scale"
        if frozen is not None and key in frozen.ln_scales:
            scale = frozen.ln_scales[key]
        else:
            dims = (-1,) if self.per_head else (-2, -1)
            scale = (x.pow(2).mean(dims, keepdim=True) + self.cfg.eps).sqrt()  # [b, pos, heads or 1, 1]
        rec(key, scale)
        return rec(f"{self.name}.hook_normalized", x / scale * self.gain())


def qk_scale(x: Tensor, cfg: ModelConfig) -> Tensor:
    """rho of projections x [..., heads, d_head] as QKNorm measures it: [..., heads, 1] per head, [..., 1, 1]
    per layer (the circuits measure token-level normalisations with it)."""
    dims = (-1,) if cfg.qk_norm == "head" else (-2, -1)
    return (x.pow(2).mean(dims, keepdim=True) + cfg.eps).sqrt()
