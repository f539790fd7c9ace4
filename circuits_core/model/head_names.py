"""Head names: heads are named `L{layer}H{head}` everywhere (URLs, JSON keys, chart axes); `parse_head` reads one
back, checked against the model's shape."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from circuits_core.errors import InvalidInputError, NotFoundError

if TYPE_CHECKING:
    from circuits_core.model.config import ModelConfig

_HEAD_RE = re.compile(r"^L(\d{1,4})H(\d{1,4})$")


def head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


def all_heads(cfg: ModelConfig) -> list[tuple[int, int]]:
    """Every (layer, head) of the model, layer-major."""
    return [(layer, h) for layer in range(cfg.n_layers) for h in range(cfg.n_heads)]


def parse_head(name: str, cfg: ModelConfig) -> tuple[int, int]:
    """`"L1H4"` -> (1, 4), checked against the model's shape."""
    match = _HEAD_RE.match(name.strip()) if isinstance(name, str) else None
    if match is None:
        raise InvalidInputError(f"head name {name!r} is not of the form L<layer>H<head>, e.g. L0H3")
    layer, head = int(match.group(1)), int(match.group(2))
    if layer >= cfg.n_layers:
        raise NotFoundError(f"head {name} out of range: the model has {cfg.n_layers} layers")
    if head >= cfg.n_heads:
        raise NotFoundError(f"head {name} out of range: the model has {cfg.n_heads} heads per layer")
    return layer, head
