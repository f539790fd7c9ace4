"""Attention heads (Elhage et al. 2021, "Attention Heads are Independent and Additive"), row-vector convention:
q = x W_Q, k = x W_K, v = x W_V per head, pattern = softmax(q kᵀ / √d_head) (causal), out = Σ_h pattern v W_O.

Grouped-query attention stores K/V per key/value head, as TransformerLens 3.9's GroupedQueryAttention; rotary
models rotate q and k by position (rope.py, each layer with its own rope: ModelConfig.layer_rope) before the scores.
The newest attention: QK-norm before the rotation (qk_norm.py), soft-capped scores (soft_cap.py; hook_attn_scores
holds the capped scores the softmax sees, hook_attn_scores_uncapped the scores before the cap) and sliding windows
on local layers (window.py). Learned sinks (gpt-oss) add one logit per head to every softmax row (`sink_softmax`);
ALiBi (alibi.py) adds
-m_h (i - j) to the scores.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from circuits_core.errors import InvalidInputError
from circuits_core.model.alibi import alibi_kernel
from circuits_core.model.config import ModelConfig
from circuits_core.model.hooks import Frozen, Recorder
from circuits_core.model.linear import affine
from circuits_core.model.qk_norm import QKNorm
from circuits_core.model.rope import rotate
from circuits_core.model.soft_cap import soft_cap
from circuits_core.model.window import visible


def attn_param(cfg: ModelConfig, name: str) -> str:
    """The stored name of an attention parameter: "_W_K", "_W_V", "_b_K", "_b_V" under grouped-query attention
    (n_key_value_heads set, as TransformerLens's GroupedQueryAttention), else the name itself."""
    if cfg.n_key_value_heads is not None and name in ("W_K", "W_V", "b_K", "b_V"):
        return "_" + name
    return name


def sink_softmax(scores: Tensor, sinks: Tensor) -> Tensor:
    """softmax over [s_i1 .. s_in, b_h] without the sink's column: scores [batch, heads, q, k], sinks [heads] ->
    pattern [batch, heads, q, k] whose rows sum to sigma(LSE_j s_ij - b_h) < 1 (the missing mass is the sink's)."""
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)  # [batch, heads, q, 1]
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


class Attention(nn.Module):
    """Attention heads. Under grouped-query attention the stored K/V weights are per key/value head
    (`_W_K`, `_W_V` [n_kv, d_model, d_head], `_b_K`, `_b_V` [n_kv, d_head]) and `W_K`, `W_V`, `b_K`, `b_V`
    are per query head (repeated over each group), as in TransformerLens."""

    # Per query head (stored parameters, or under GQA computed by __getattr__ from the grouped ones).
    W_K: Tensor
    W_V: Tensor
    b_K: Tensor
    b_V: Tensor

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h, g, d, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_model, cfg.d_head
        self.W_Q = nn.Parameter(torch.empty(h, d, dh))
        self.register_parameter(attn_param(cfg, "W_K"), nn.Parameter(torch.empty(g, d, dh)))
        self.register_parameter(attn_param(cfg, "W_V"), nn.Parameter(torch.empty(g, d, dh)))
        self.W_O = nn.Parameter(torch.empty(h, dh, d))
        if cfg.use_bias:
            self.b_Q = nn.Parameter(torch.zeros(h, dh))
            self.register_parameter(attn_param(cfg, "b_K"), nn.Parameter(torch.zeros(g, dh)))
            self.register_parameter(attn_param(cfg, "b_V"), nn.Parameter(torch.zeros(g, dh)))
            self.b_O = nn.Parameter(torch.zeros(d))
        if cfg.qk_norm is not None:
            self.q_norm = QKNorm(cfg, f"blocks.{layer}.attn.q_norm", h)
            self.k_norm = QKNorm(cfg, f"blocks.{layer}.attn.k_norm", g)
        if cfg.attn_sinks:
            self.sinks = nn.Parameter(torch.zeros(h))  # b_h: one sink logit per query head

    def grouped(self, name: str) -> Tensor:
        """W_K, W_V [n_kv, d_model, d_head] or b_K, b_V [n_kv, d_head] as stored (per key/value head)."""
        value = getattr(self, attn_param(self.cfg, name)) if name[0] == "W" or self.cfg.use_bias else None
        if not isinstance(value, Tensor):
            raise InvalidInputError(f"the model has no {name}")
        return value

    def per_head(self, value: Tensor, dim: int = 0) -> Tensor:
        """Repeat a per-key/value-head tensor over its group of query heads along `dim` (a no-op without GQA)."""
        return value if self.cfg.group_size == 1 else value.repeat_interleave(self.cfg.group_size, dim=dim)

    def __getattr__(self, name: str) -> Tensor | nn.Module:
        # W_K, W_V, b_K, b_V per query head under grouped-query attention (nn.Module keeps parameters in a dict,
        # so this is only reached for names that are not stored).
        if name in ("W_K", "W_V", "b_K", "b_V") and self.cfg.n_key_value_heads is not None:
            return self.per_head(self.grouped(name))
        return super().__getattr__(name)

    def bias(self, name: str) -> Tensor | None:
        return getattr(self, name) if self.cfg.use_bias else None

    def project(self, x: Tensor, name: str) -> Tensor:
        """x W + b per stored head: x [batch, pos, d_model], name "W_Q", "W_K" or "W_V" -> [batch, pos, heads, d_head]
        (n_kv heads for K and V under GQA), all heads as one product with the bias added inside it (linear.affine)."""
        W = self.grouped(name) if name != "W_Q" else self.W_Q  # [heads, d_model, d_head]
        heads, d, dh = W.shape
        b = (self.grouped("b" + name[1:]) if name != "W_Q" else self.b_Q).reshape(-1) if self.cfg.use_bias else None
        return affine(x, W.permute(1, 0, 2).reshape(d, heads * dh), b).view(*x.shape[:-1], heads, dh)

    def queries_keys(self, q_in: Tensor, k_in: Tensor, rec: Recorder, frozen: Frozen | None) -> tuple[Tensor, Tensor]:
        """q [batch, pos, n_heads, d_head] and k [batch, pos, n_kv, d_head] before the rotation (after QK-norm)."""
        q, k = self.project(q_in, "W_Q"), self.project(k_in, "W_K")
        if self.cfg.qk_norm is not None:
            q, k = self.q_norm(q, rec, frozen), self.k_norm(k, rec, frozen)
        return q, k

    def values(self, v_in: Tensor, rec: Recorder, frozen: Frozen | None) -> Tensor:
        """v [batch, pos, n_kv, d_head]."""
        return self.project(v_in, "W_V")

    def forward(self, q_in: Tensor, k_in: Tensor, v_in: Tensor, rec: Recorder, frozen: Frozen | None) -> Tensor:
        # q_in, k_in, v_in: [batch, pos, d_model] -> attn_out [batch, pos, d_model]
        cfg, prefix = self.cfg, f"blocks.{self.layer}.attn"
        n = q_in.shape[1]
        pattern_key = f"{prefix}.hook_pattern"
        frozen_pattern = frozen.patterns.get(pattern_key) if frozen is not None else None
        # queries and keys only where they are used: a frozen pattern needs neither unless their hooks are asked for
        if frozen_pattern is None or rec.wants(f"{prefix}.hook_q") or rec.wants(f"{prefix}.hook_k"):
            q, k = self.queries_keys(q_in, k_in, rec, frozen)  # [batch, pos, n_heads or n_kv, d_head]
            if cfg.positional_embedding_type == "rotary":
                positions = torch.arange(n, device=q.device)[:, None]  # [pos, 1]
                rope = cfg.layer_rope(self.layer)
                q, k = rotate(rope, q, positions), rotate(rope, k, positions)
            k = self.per_head(k, dim=2)  # [batch, pos, n_heads, d_head]
            rec(f"{prefix}.hook_q", q), rec(f"{prefix}.hook_k", k)
        if frozen_pattern is not None:
            pattern = frozen_pattern  # [batch, n_heads, q_pos, k_pos]
            if pattern.shape[-1] != n:
                raise InvalidInputError(
                    f"frozen pattern for layer {self.layer} has {pattern.shape[-1]} positions, input has {n}"
                )
        else:
            scores = torch.einsum("bqhe,bkhe->bhqk", q, k).div_(cfg.scale)  # [batch, n_heads, q_pos, k_pos], fresh
            if cfg.attn_scores_soft_cap is not None:
                rec(f"{prefix}.hook_attn_scores_uncapped", scores.clone())
                scores = soft_cap(scores, cfg.attn_scores_soft_cap)
            if cfg.alibi is not None:  # the linear positional kernel -m_h (i - j) (alibi.py)
                scores = scores + alibi_kernel(cfg, n, scores.device).to(scores.dtype)
            seen = visible(n, cfg.layer_window(self.layer), q.device)  # causal (and within the window)
            scores.masked_fill_(~seen, float("-inf"))
            rec(f"{prefix}.hook_attn_scores", scores)
            pattern = sink_softmax(scores, self.sinks) if cfg.attn_sinks else scores.softmax(dim=-1)
        rec(pattern_key, pattern)
        # values after the pattern: a run that stops at the last layer's pattern (heads.detector_scores) skips them
        v = self.per_head(self.values(v_in, rec, frozen), dim=2)  # [batch, pos, n_heads, d_head]
        rec(f"{prefix}.hook_v", v)
        z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)  # [batch, pos, n_heads, d_head]
        rec(f"{prefix}.hook_z", z)
        result_key = f"{prefix}.hook_result"
        if rec.wants(result_key):
            result = rec(result_key, torch.einsum("bqhe,hed->bqhd", z, self.W_O))  # [batch, pos, n_heads, d_model]
            out = result.sum(2)
            return out + self.b_O if cfg.use_bias else out
        W_O = self.W_O.reshape(-1, self.W_O.shape[-1])  # [n_heads d_head, d_model]
        return affine(z.reshape(*z.shape[:2], -1), W_O, self.bias("b_O"))  # [batch, pos, d_model]
