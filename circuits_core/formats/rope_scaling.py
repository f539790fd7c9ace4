"""Rope scaling fields of a Hugging Face config.json, read into ModelConfig fields (the types qkov implements).

`rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta` (older files); types default, linear,
llama3 and yarn; any other type is refused, naming it. YaRN multiplies cos and sin by an attention factor (the
config's `attention_factor`, else inferred from factor, mscale and mscale_all_dim as transformers does,
rope.yarn_attention_factor); q and k both carry it, so it becomes attn_scale = sqrt(d_head) / factor².
"""

from __future__ import annotations

import math
from typing import Any

from circuits_core.errors import CheckpointError
from circuits_core.model.config import ConfigReader
from circuits_core.model.rope import yarn_attention_factor

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_section(r: ConfigReader) -> ConfigReader:
    return r.section("rope_parameters") if r.has("rope_parameters") else r.section("rope_scaling")


def rope_fields(r: ConfigReader, name: str, d_head: int, allow_partial: bool = False) -> dict[str, Any]:
    """ModelConfig rope fields (rotary_base, rope_type, its parameters and, under YaRN, attn_scale)."""
    rope = rope_section(r)
    kind = rope.text("rope_type", default=None) or rope.text("type", default="default")
    if kind not in ROPE_TYPES:
        raise CheckpointError(
            f"{name}: rope scaling type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    base = rope.number("rope_theta", default=None, gt=0) or r.number("rope_theta", default=10000.0, gt=0)
    fields: dict[str, Any] = {"rotary_base": base, "rope_type": kind}
    if kind in ("linear", "llama3"):
        fields["rope_factor"] = rope.number("factor", gt=0)
    if kind == "llama3":
        fields["rope_low_freq_factor"] = rope.number("low_freq_factor", gt=0)
        fields["rope_high_freq_factor"] = rope.number("high_freq_factor", gt=0)
        fields["rope_original_max_position_embeddings"] = rope.integer("original_max_position_embeddings", ge=1)
    if kind == "yarn":
        original = rope.integer("original_max_position_embeddings", ge=1)
        factor = rope.number("factor", default=None, gt=0)
        if factor is None:  # transformers: the ratio of the extended context to the original one
            factor = r.integer("max_position_embeddings", ge=1) / original
        attention = rope.number("attention_factor", default=None, gt=0)
        if attention is None:
            mscale = rope.number("mscale", default=None, gt=0)
            attention = yarn_attention_factor(factor, mscale, rope.number("mscale_all_dim", default=None, gt=0))
        fields.update(
            rope_factor=factor, rope_original_max_position_embeddings=original,
            rope_beta_fast=rope.number("beta_fast", default=None, gt=0) or 32.0,
            rope_beta_slow=rope.number("beta_slow", default=None, gt=0) or 1.0,
            rope_truncate=rope.flag("truncate", default=True), attn_scale=math.sqrt(d_head) / attention**2,
        )  # fmt: skip
    factor = rope.number("partial_rotary_factor", default=None, gt=0) or r.number(
        "partial_rotary_factor", default=1.0, gt=0
    )
    if factor != 1.0 and not allow_partial:
        raise CheckpointError(f"{name}: partial_rotary_factor={factor} is not supported for this family")
    return fields
