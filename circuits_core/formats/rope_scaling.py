"""Rope scaling fields of a Hugging Face config.json, read into ModelConfig fields (the types qkov implements).

One rope parameter object at a time (`rope_parameters` of transformers >= 5, or `rope_scaling` + `rope_theta` of
older files; per layer type where a family has several): types default, linear, llama3 and yarn; any other type is
refused, naming the field. YaRN multiplies cos and sin by an attention factor (the section's `attention_factor`,
else inferred from factor, mscale and mscale_all_dim as transformers does, rope.yarn_attention_factor); q and k
both carry it, so it becomes attn_scale = sqrt(d_head) / factor². The factor is a config-wide score scale, so
YaRN is read only where the caller passes d_head (one rope for every layer).
"""

from __future__ import annotations

import math
from typing import Any

from circuits_core.errors import CheckpointError
from circuits_core.model.config_reader import ConfigReader
from circuits_core.model.rope import yarn_attention_factor

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_section(r: ConfigReader) -> ConfigReader:
    """The rope parameter object of a config: `rope_parameters`, else `rope_scaling` (absent: empty)."""
    return r.section("rope_parameters") if r.has("rope_parameters") else r.section("rope_scaling")


def rope_fields(
    r: ConfigReader, rope: ConfigReader, default_base: float = 10000.0, d_head: int | None = None
) -> dict[str, Any]:
    """rotary_base and the scaling fields from one rope parameter object `rope` (a section of config `r`, whose
    top-level rope_theta and partial_rotary_factor apply where the section has none); YaRN (with d_head) also
    sets attn_scale; types not implemented and partial rotary are refused, naming the field."""
    where = f"{r.source}: {rope.prefix}"
    kind = rope.text("rope_type", default=None) or rope.text("type", default="default")
    supported = ROPE_TYPES if d_head is not None else ROPE_TYPES[:-1]
    if kind not in supported:
        raise CheckpointError(
            f"{where}rope_type: rope scaling type {kind!r} is not supported; supported: {', '.join(supported)}"
        )
    base = rope.number("rope_theta", default=None, gt=0) or r.number("rope_theta", default=default_base, gt=0)
    fields: dict[str, Any] = {"rotary_base": base, "rope_type": kind}
    if kind in ("linear", "llama3"):
        fields["rope_factor"] = rope.number("factor", gt=0)
    if kind == "llama3":
        fields["rope_low_freq_factor"] = rope.number("low_freq_factor", gt=0)
        fields["rope_high_freq_factor"] = rope.number("high_freq_factor", gt=0)
        fields["rope_original_max_position_embeddings"] = rope.integer("original_max_position_embeddings", ge=1)
    if kind == "yarn":
        assert d_head is not None
        fields.update(_yarn(r, rope, d_head))
    factor = rope.number("partial_rotary_factor", default=None, gt=0) or r.number(
        "partial_rotary_factor", default=1.0, gt=0
    )
    if factor != 1.0:
        raise CheckpointError(f"{where}partial_rotary_factor={factor} is not supported for Llama-layout files")
    return fields


def _yarn(r: ConfigReader, rope: ConfigReader, d_head: int) -> dict[str, Any]:
    original = rope.integer("original_max_position_embeddings", ge=1)
    factor = rope.number("factor", default=None, gt=0)
    if factor is None:  # transformers: the ratio of the extended context to the original one
        factor = r.integer("max_position_embeddings", ge=1) / original
    attention = rope.number("attention_factor", default=None, gt=0)
    if attention is None:
        mscale, all_dim = rope.number("mscale", default=None, gt=0), rope.number("mscale_all_dim", default=None, gt=0)
        attention = yarn_attention_factor(factor, mscale, all_dim)
    return {
        "rope_factor": factor,
        "rope_original_max_position_embeddings": original,
        "rope_beta_fast": rope.number("beta_fast", default=None, gt=0) or 32.0,
        "rope_beta_slow": rope.number("beta_slow", default=None, gt=0) or 1.0,
        "rope_truncate": rope.flag("truncate", default=True),
        "attn_scale": math.sqrt(d_head) / attention**2,
    }
