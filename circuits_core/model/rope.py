"""Rotary position embedding (RoPE): q and k are rotated by an angle proportional to their position.

Paper context: the Llama family replaces learned positions with rotations (Su et al. 2021, "RoFormer"), so
positions never enter the residual stream; the QK circuit between positions i and j depends on i - j only
(docs/maths.md §6). Row-vector convention: `rotate(cfg, x, p)` is x R(p).

Pair k (k < K = rotary_dim / 2) turns by p * theta_k with theta_k = rotary_base^(-2k / rotary_dim), rescaled
by the config's rope type (linear, llama3, yarn). Two layouts pair the dims differently (`rotary_pairs`): Hugging Face
files rotate halves, (k, k + K); GGUF files adjacent pairs, (2k, 2k + 1). Using the wrong layout still runs,
only wrongly. Dims from rotary_dim on are not rotated (partial rotary).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from circuits_core.errors import InvalidInputError
from circuits_core.model.config import ModelConfig


def rotary_inv_freq(cfg: ModelConfig) -> Tensor:
    """theta_k [rotary_dim / 2] (float64): the angle per position of pair k, after the config's rope scaling.

    default: theta_k = base^(-2k / rotary_dim); linear: theta_k / factor; llama3 (Llama 3.1): wavelengths
    2 pi / theta_k longer than original_max / low_freq_factor are divided by factor, shorter than
    original_max / high_freq_factor kept, and the ones between interpolated smoothly.
    """
    rd = cfg.rotary_dim or cfg.d_head
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    if cfg.rope_type == "linear":
        return inv_freq / cfg.rope_factor
    if cfg.rope_type == "llama3":
        old, low, high = cfg.rope_original_max_position_embeddings, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old / low, inv_freq / cfg.rope_factor, inv_freq)
        mid = (1 - smooth) * inv_freq / cfg.rope_factor + smooth * inv_freq
        return torch.where((wavelen <= old / low) & (wavelen >= old / high), mid, scaled)
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(cfg, inv_freq, rd)
    if cfg.rope_type != "default":  # the config refuses other types; this guards a bypassed check
        raise InvalidInputError(f"rope scaling type {cfg.rope_type!r} is not supported")
    return inv_freq


def _yarn_inv_freq(cfg: ModelConfig, inv_freq: Tensor, rd: int) -> Tensor:
    """YaRN (Peng et al. 2023) as transformers computes it: pair k keeps theta_k (extrapolation) below the
    correction range, takes theta_k / factor (interpolation) above it, and a linear ramp in k between. The range is
    where pair k turns beta_fast (resp. beta_slow) times over the original context; truncate floors / ceils it."""
    base, old = cfg.rotary_base, cfg.rope_original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (rd * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rd - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(rd // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # weight of the unscaled frequency
    return inv_freq / cfg.rope_factor * (1 - extrapolation) + inv_freq * extrapolation


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's cos/sin multiplier as transformers infers it (no explicit attention_factor): 0.1 ln(factor) + 1, or
    the ratio of that with mscale and with mscale_all_dim when both are given (DeepSeek). Both q and k carry it,
    so the scores are scaled by its square."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def rotary_angles(cfg: ModelConfig, positions: Tensor) -> Tensor:
    """p * theta_k [..., rotary_dim / 2] (float64) for positions [...] (any integers, negative too)."""
    return positions.to(torch.float64)[..., None] * rotary_inv_freq(cfg).to(positions.device)


def rotary_pairs(cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """(first [K], second [K]): the d_head indices of each rotated pair k, K = rotary_dim / 2.

    Rotate-half (Hugging Face files): (k, k + K); adjacent pairs (GGUF files): (2k, 2k + 1). Dims from
    rotary_dim on are not rotated (partial rotary)."""
    K = (cfg.rotary_dim or cfg.d_head) // 2
    k = torch.arange(K)
    return (2 * k, 2 * k + 1) if cfg.rotary_adjacent_pairs else (k, k + K)


def rotate(cfg: ModelConfig, x: Tensor, positions: Tensor) -> Tensor:
    """x R(p): rotate x [..., d_head] (row vectors) by position p in the model's layout.

    positions broadcasts against x.shape[:-1] (e.g. [pos, 1] for x [batch, pos, heads, d_head]); any integer
    (negative too: R(a) R(b)^T = R(a - b), so rotate(x, -d) applies R(d)^T). With (i, j) = rotary_pairs(cfg)[k]
    and a = p theta_k (rotary_angles): x_i' = x_i cos a - x_j sin a, x_j' = x_j cos a + x_i sin a. The
    rotation matrix for row vectors is rotate(cfg, eye(d_head), p). Angles are computed in float64.
    """
    angles = rotary_angles(cfg, positions.to(x.device))  # [..., K]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    K = angles.shape[-1]
    # the pairs of rotary_pairs as views (strided or sliced), not gathered copies: the forward pass rotates q and k
    # of every layer, and the gathers and scatters were most of its cost
    if cfg.rotary_adjacent_pairs:
        pairs = x[..., : 2 * K].unflatten(-1, (K, 2))  # [..., K, 2]: (2k, 2k + 1)
        a, b = pairs[..., 0], pairs[..., 1]  # [..., K]
        rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)  # [..., 2K]
    else:
        a, b = x[..., :K], x[..., K : 2 * K]  # (k, k + K)
        rotated = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)  # [..., 2K]
    if 2 * K == x.shape[-1]:
        return rotated
    return torch.cat([rotated, x[..., 2 * K :].expand(*rotated.shape[:-1], -1)], dim=-1)  # partial rotary
