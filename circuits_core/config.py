"""Model configuration and head names.

Field names follow TransformerLens's HookedTransformerConfig where they exist, so a TransformerLens
`config.json` loads as it is. Heads are named `L{layer}H{head}` everywhere (URLs, JSON keys, chart axes).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from circuits_core.errors import InvalidInputError, NotFoundError

NormalizationType = Literal["LN", "LNPre"] | None
PositionalType = Literal["standard", "shortformer", "rotary", "none"]
ActFn = Literal["gelu", "gelu_new", "relu"]

NORMALIZATION_TYPES: tuple[str | None, ...] = ("LN", "LNPre", None)
POSITIONAL_TYPES: tuple[str, ...] = ("standard", "shortformer", "rotary", "none")
ACT_FNS: tuple[str, ...] = ("gelu", "gelu_new", "relu")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and architecture of a transformer (TransformerLens field names)."""

    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    d_vocab: int
    n_ctx: int
    d_mlp: int | None = None
    attn_only: bool = True
    normalization_type: NormalizationType = None
    positional_embedding_type: PositionalType = "shortformer"
    act_fn: ActFn | None = None
    eps: float = 1e-5
    # Biases: when False the model has no b_Q/b_K/b_V/b_O/b_in/b_out/b_U at all.
    use_bias: bool = False
    # GPT-NeoX style: attention and MLP both read resid_pre (with their own LayerNorms).
    parallel_attn_mlp: bool = False
    rotary_dim: int | None = None
    rotary_base: float = 10000.0
    # Divisor of q.k; defaults to sqrt(d_head) (TransformerLens `attn_scale`).
    attn_scale: float | None = None
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "d_head", "d_vocab", "n_ctx"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "n_layers" else 1):
                raise InvalidInputError(f"config field {name} must be a positive integer, got {value!r}")
        if self.normalization_type not in NORMALIZATION_TYPES:
            raise InvalidInputError(
                f"normalization_type must be one of {NORMALIZATION_TYPES}, got {self.normalization_type!r}"
            )
        if self.positional_embedding_type not in POSITIONAL_TYPES:
            raise InvalidInputError(
                f"positional_embedding_type must be one of {POSITIONAL_TYPES}, "
                f"got {self.positional_embedding_type!r}"
            )
        if not self.attn_only:
            if not self.d_mlp or self.d_mlp < 1:
                raise InvalidInputError("a model with MLPs (attn_only=false) needs d_mlp >= 1")
            if self.act_fn not in ACT_FNS:
                raise InvalidInputError(f"act_fn must be one of {ACT_FNS}, got {self.act_fn!r}")
        if self.positional_embedding_type == "rotary":
            rd = self.rotary_dim if self.rotary_dim is not None else self.d_head
            if rd < 2 or rd > self.d_head or rd % 2:
                raise InvalidInputError(f"rotary_dim must be even and in [2, d_head={self.d_head}], got {rd}")

    @property
    def scale(self) -> float:
        """The divisor applied to q.k (TransformerLens `attn_scale`)."""
        return float(self.attn_scale) if self.attn_scale is not None else math.sqrt(self.d_head)

    @property
    def head_names(self) -> list[str]:
        return [head_name(layer, h) for layer in range(self.n_layers) for h in range(self.n_heads)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict with TransformerLens field names; unknown fields are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if "attn_only" not in data and data.get("d_mlp"):
            kwargs["attn_only"] = False
        if kwargs.get("positional_embedding_type") is None and "positional_embedding_type" in kwargs:
            kwargs["positional_embedding_type"] = "none"
        missing = [n for n in ("n_layers", "d_model", "n_heads", "d_head", "d_vocab", "n_ctx") if n not in kwargs]
        if missing:
            raise InvalidInputError(f"config is missing required fields: {', '.join(missing)}")
        return cls(**kwargs)


_HEAD_RE = re.compile(r"^L(\d{1,4})H(\d{1,4})$")


def head_name(layer: int, head: int) -> str:
    return f"L{layer}H{head}"


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
