"""Sliding windows: on a local layer (cfg.layer_window) query i sees key j only when 0 <= i - j < window.

Gemma 2 alternates 4096-token local layers with global ones, Gemma 3 has 5 local layers (window 512 or 1024)
per global one, Mistral v0.1 slides at 4096 on every layer (ModelConfig.window_size, attn_types). The QK circuit at
an offset Omega_h(delta) is unchanged on a local layer but defined only for delta < window: positional kernels and
composition profiles stop there (`defined_offsets`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.model.config import ModelConfig


def visible(n: int, window: int | None, device: torch.device | str | None = None) -> Tensor:
    """[n (query), n (key)] bool: the keys each query sees (causal, and within the window when one is given)."""
    i = torch.arange(n, device=device)
    delta = i[:, None] - i[None, :]
    keep = delta >= 0
    return keep & (delta < window) if window is not None else keep


def defined_offsets(cfg: ModelConfig, layer: int, deltas: Tensor) -> Tensor:
    """bool per offset delta >= 0: whether layer `layer` attends at that offset (delta < its window, if any)."""
    window = cfg.layer_window(layer)
    return deltas >= 0 if window is None else (deltas >= 0) & (deltas < window)


def at_window_edge(cfg: ModelConfig, layer: int, peak_offset: int) -> bool:
    """Whether a profile's maximum over the offsets a layer attends (a kernel, a composition or copying profile) lies
    at its window's edge, δ = window - 1: the last offset a sliding layer sees, so the maximum is where the window
    cuts the profile, not a place the head prefers. Always False on a global layer. The flat/edge reading of
    profiles (profile_shape) marks such a maximum as an edge."""
    window = cfg.layer_window(layer)
    return window is not None and peak_offset == window - 1
