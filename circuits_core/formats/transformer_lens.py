"""TransformerLens folders: a HookedTransformerConfig config.json and a TransformerLens state dict.

The weights are one .safetensors, .pth or .pt file (pickles only through torch.load(weights_only=True)); the
buffers TransformerLens saves beside the weights (blocks.{l}.attn.mask / IGNORE, rotary_sin / rotary_cos) are
dropped. The config's fields are TransformerLens's, so they become a ModelConfig as they are, after
`_tl_check_supported` has refused every HookedTransformerConfig feature this model does not implement (before any
weight is read) and `_tl_config` has translated TransformerLens's "unset" markers and rope scalings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError
from circuits_core.formats.statedict import (
    PICKLE_SUFFIXES,
    folder_file,
    folder_listing,
    model_config,
    read_weight_files,
)
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader

TL_BUFFERS = (".attn.mask", ".attn.IGNORE", ".attn.rotary_sin", ".attn.rotary_cos")


def _positive(value: Any) -> bool:
    """A TransformerLens soft cap is on when it is a number > 0 (the default is -1.0)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _tl_check_supported(data: dict[str, Any], path: Path) -> None:
    """Refuse HookedTransformerConfig features this model does not implement (before reading any weights)."""
    unsupported = {
        "normalization_type": data.get("normalization_type") not in ("LN", "LNPre", "RMS", "RMSPre", None),
        "positional_embedding_type": data.get("positional_embedding_type", "standard")
        not in ("standard", "shortformer", "rotary"),
        # An RMS final norm after LayerNorm blocks (the norm family is one per model here).
        "final_rms": bool(data.get("final_rms")) and data.get("normalization_type") in ("LN", "LNPre"),
        "scale_attn_by_inverse_layer_idx": bool(data.get("scale_attn_by_inverse_layer_idx")),
        "use_local_attn": bool(data.get("use_local_attn")),
        "d_vocab_out": data.get("d_vocab_out", -1) not in (-1, None, data.get("d_vocab")),
        # Same weights, different computation: loading these would silently give other logits.
        "attention_dir": data.get("attention_dir", "causal") not in ("causal", None),
        "attn_scores_soft_cap": _positive(data.get("attn_scores_soft_cap")),
        "output_logits_soft_cap": _positive(data.get("output_logits_soft_cap")),
        "clip_qkv": data.get("clip_qkv") is not None,
        "use_logn_attn": bool(data.get("use_logn_attn")),
        "use_dynamic_ntk_rope": bool(data.get("use_dynamic_ntk_rope")),
        "use_yarn_rope": bool(data.get("use_yarn_rope")),
        # A rope scaling named on a model without rotary positions (TL would ignore it: the config is inconsistent).
        "use_NTK_by_parts_rope": bool(data.get("use_NTK_by_parts_rope"))
        and data.get("positional_embedding_type") != "rotary",
        "rotary_scaling_factor": data.get("positional_embedding_type") == "rotary"
        and data.get("rotary_scaling_factor", 1.0) not in (1, None)
        and bool(data.get("use_NTK_by_parts_rope")),
        # Extra modules (their keys would also be refused by the state-dict check, this says why).
        "use_qk_norm": bool(data.get("use_qk_norm")),
        "post_embedding_ln": bool(data.get("post_embedding_ln")),
        "use_normalization_before_and_after": bool(data.get("use_normalization_before_and_after")),
        "use_attention_sinks": bool(data.get("use_attention_sinks")),
        "num_experts": data.get("num_experts") not in (None, 0, 1),
        "load_in_4bit": bool(data.get("load_in_4bit")),
    }
    bad = [f"{k}={data.get(k)!r}" for k, flag in unsupported.items() if flag]
    if bad:
        raise CheckpointError(f"{path.name}: TransformerLens features not supported here: {', '.join(bad)}")


# TransformerLens config fields it writes as None or -1.0 to mean "unset" (absent means the same), and the value
# qkov's field then takes: one expert per token (a dense model), no soft cap, the default 1/sqrt(d_head) scale.
TL_UNSET: dict[str, tuple[tuple[Any, ...], Any]] = {
    "experts_per_token": ((None,), 1),
    "attn_scores_soft_cap": ((None, -1.0), None),
    "output_logits_soft_cap": ((None, -1.0), None),
    "attn_scale": ((None, -1.0), None),
}


def _tl_config(data: dict[str, Any], path: Path, has_bias: bool) -> ModelConfig:
    """HookedTransformerConfig fields -> ModelConfig (TL state dicts always carry biases: use_bias=True)."""
    overrides: dict[str, Any] = {"use_bias": has_bias}
    overrides.update({name: value for name, (unset, value) in TL_UNSET.items() if data.get(name) in unset})
    if data.get("use_attn_scale") is False:  # TL's switch for no scaling at all
        overrides["attn_scale"] = 1.0
    if data.get("attn_only") or not data.get("d_mlp"):
        overrides.update(attn_only=True, act_fn=None)
    if data.get("positional_embedding_type") == "rotary":  # TL's rope scalings -> rope_type (llama3, linear)
        r = ConfigReader(data, path.name)
        if r.flag("use_NTK_by_parts_rope", default=False):
            overrides.update(
                rope_type="llama3", rope_factor=r.number("NTK_by_parts_factor", gt=0),
                rope_low_freq_factor=r.number("NTK_by_parts_low_freq_factor", gt=0),
                rope_high_freq_factor=r.number("NTK_by_parts_high_freq_factor", gt=0),
                rope_original_max_position_embeddings=r.integer("NTK_original_ctx_len", ge=1),
            )  # fmt: skip
        elif r.number("rotary_scaling_factor", default=1.0, gt=0) != 1.0:
            overrides.update(rope_type="linear", rope_factor=r.number("rotary_scaling_factor", gt=0))
    return model_config(data, path, **overrides)


def _tl_weight_files(folder: Path) -> list[Path]:
    if folder_file(folder, "model.safetensors").is_file():
        return [folder_file(folder, "model.safetensors")]
    for suffixes in ((".safetensors",), PICKLE_SUFFIXES):
        found = sorted(folder_file(folder, p.name) for p in folder.iterdir() if p.suffix in suffixes and p.is_file())
        if len(found) == 1:
            return found
        if len(found) > 1:
            raise CheckpointError(f"several weight files, which one? {', '.join(p.name for p in found)}")
    raise CheckpointError(f"no .safetensors, .pth or .pt weight file (found: {folder_listing(folder)})")


def load_transformer_lens(
    folder: Path, data: dict[str, Any], dtype: torch.dtype
) -> tuple[ModelConfig, dict[str, Tensor], dict[str, str], list[Path]]:
    _tl_check_supported(data, folder / "config.json")
    files = _tl_weight_files(folder)
    state, origin = read_weight_files(files)
    state = {k: v for k, v in state.items() if not k.endswith(TL_BUFFERS)}
    has_bias = "unembed.b_U" in state or "blocks.0.attn.b_Q" in state
    return _tl_config(data, folder / "config.json", has_bias), state, origin, files
