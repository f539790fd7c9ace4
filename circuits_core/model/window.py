"""Sliding windows: on a local layer (cfg.layer_window) query i sees key j only when 0 <= i - j < window.

Gemma 2 alternates 4096-token local layers with global ones, Gemma 3 has 5 local layers (window 512 or 1024)
per global one, Mistral v0.1 slides at 4096 on every layer (ModelConfig.window_size, attn_types). The QK circuit at
an offset Omega_h(delta) is unchanged on a local layer but defined only for delta < window: positional kernels and
composition profiles stop there (`defined_offsets`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.errors import InvalidInputError
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


def check_attended(cfg: ModelConfig, layer: int, offset: int) -> None:
    """Refuse an offset δ that layer `layer` never attends: δ >= its window on a sliding layer (the QK circuit at an
    offset is defined there only for δ < window)."""
    window = cfg.layer_window(layer)
    if window is not None and offset >= window:
        raise InvalidInputError(
            f"layer {layer} is a sliding layer with a {window}-token window: it attends no key at δ = {offset} "
            f"(only δ = 0..{window - 1})"
        )


def last_attended(cfg: ModelConfig, layer: int, last: int) -> int:
    """The largest offset up to `last` that layer `layer` attends: `last`, or window - 1 on a sliding layer."""
    window = cfg.layer_window(layer)
    return last if window is None else min(last, window - 1)
