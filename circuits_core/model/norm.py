"""The model's norms, with TransformerLens's `hook_scale`: LayerNorm and RMSNorm, before and after a layer.

Paper: "Handling Layer Normalization" appendix: everything but the division by the scale folds into adjacent
weights; the scale is a per-token scalar, frozen in path expansions (hooks.Frozen.ln_scales).

Kinds: "LN" (x - mean) / sigma * w + b; "LNPre" (x - mean) / sigma; "RMS" x / rms * w; "RMSPre" x / rms; None the
identity. sigma = sqrt(mean((x - mean)^2) + eps), rms = sqrt(mean(x^2) + eps). The input norms (ln1, ln2, ln_final)
take the config's normalization_type (None for ln1 / ln2 when cfg.pre_norms is False: OLMo 2's layers read the raw
stream); the output norms (ln1_post, ln2_post, cfg.post_norms: Gemma 2/3, OLMo 2/3) are always "RMS" with their
weights, since a gain applied after a norm cannot fold into the weights before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from circuits_core.model.config import ModelConfig, NormalizationType
from circuits_core.model.hooks import Frozen, Recorder


class LayerNorm(nn.Module):
    """One norm of the model (see the module docstring); `kind` defaults to the config's normalization_type."""

    def __init__(self, cfg: ModelConfig, name: str, kind: NormalizationType | str = "config"):
        super().__init__()
        self.cfg, self.name = cfg, name
        self.kind: NormalizationType = cfg.normalization_type if kind == "config" else kind  # type: ignore[assignment]
        self.centred = self.kind in ("LN", "LNPre")
        self.has_weights = self.kind in ("LN", "RMS")
        if self.has_weights:
            self.w = nn.Parameter(torch.ones(cfg.d_model))
        if self.kind == "LN":
            self.b = nn.Parameter(torch.zeros(cfg.d_model))

    def forward(self, x: Tensor, rec: Recorder, frozen: Frozen | None) -> Tensor:
        # x: [batch, pos, d_model]
        if self.kind is None:
            return x
        key = f"{self.name}.hook_scale"
        computed = frozen is None or key not in frozen.ln_scales
        w: Tensor | None = self.w if self.has_weights else None
        b: Tensor | None = self.b if self.kind == "LN" else None
        if w is not None and w.dtype != x.dtype:  # half-precision weights on rows in their compute dtype
            w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)
        if computed and not rec.wants(key) and not rec.wants(f"{self.name}.hook_normalized"):
            # Nothing to record or replace: the same maths as below, as torch's fused kernels.
            if self.centred:
                return F.layer_norm(x, x.shape[-1:], w, b, self.cfg.eps)
            return F.rms_norm(x, x.shape[-1:], w, self.cfg.eps)
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        if frozen is not None and key in frozen.ln_scales:
            scale = frozen.ln_scales[key]  # [batch, pos, 1]
        else:
            scale = (x.pow(2).mean(-1, keepdim=True) + self.cfg.eps).sqrt()
        rec(key, scale)
        x = x / scale
        if w is not None:
            x = x * w
        if b is not None:
            x = x + b
        return rec(f"{self.name}.hook_normalized", x)


def input_norm(cfg: ModelConfig, name: str) -> LayerNorm:
    """ln1 / ln2 of a layer: the config's norm, or the identity when the model has no input norms (OLMo 2)."""
    return LayerNorm(cfg, name, "config" if cfg.pre_norms else None)


def output_norm(cfg: ModelConfig, name: str) -> LayerNorm:
    """ln1_post / ln2_post: RMS with weights (never folded)."""
    return LayerNorm(cfg, name, "RMS")
