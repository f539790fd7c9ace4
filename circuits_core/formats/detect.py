"""Checkpoint formats: which one a folder holds (`detect_format`), the loader that reads it (REGISTRY, keyed by
`Format`), and what a format tells before any tensor is read (CONFIG_READERS, weight_files_known_before_reading).

- "qkov": qkov's own: config.json (ModelConfig fields + "format": "qkov") + model.safetensors
  (+ tokenizer.json, model_card.json). Written by `save_checkpoint` (qkov_format.py).
- "transformer_lens": config.json with HookedTransformerConfig fields + a TransformerLens state dict as
  .safetensors, .pth or .pt (transformer_lens.py).
- "gpt2", "gpt_neox": Hugging Face folders (hf.py).
- "llama", "mistral", "qwen2": Hugging Face Llama-family folders, sharded safetensors (llama.py).
- "gemma2", "gemma3_text", "gemma3" (its text tower), "qwen3", "olmo2", "olmo3": the same layout with the newest
  attention (llama_variants.py: QK-norm, soft caps, sliding windows, sandwich and output norms).
- "gpt_oss": Hugging Face gpt-oss folders (sinks, mixture of experts, MXFP4 experts; gpt_oss.py).
- "mixtral", "qwen3_moe", "olmoe": the Llama layout with a mixture-of-experts MLP (moe_families.py).
- "bloom", "mpt": ALiBi models (alibi_families.py).
- "phi3": the Llama layout with fused qkv and gate/up projections, split on load (phi3.py).
- "deepseek_v2", "deepseek_v3": multi-head latent attention and DeepSeek's experts (deepseek.py).
- "gguf": a folder without config.json holding one `.gguf` file (llama.cpp, ollama), named after the folder;
  config, tensors and tokenizer all come from that file (gguf.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError
from circuits_core.formats.alibi_families import ALIBI_MODEL_TYPES, alibi_config, load_alibi
from circuits_core.formats.deepseek import DEEPSEEK_MODEL_TYPES, deepseek_config, load_deepseek
from circuits_core.formats.gguf import gguf_file
from circuits_core.formats.gpt_oss import gpt_oss_config, load_gpt_oss
from circuits_core.formats.hf import load_gpt2, load_gpt_neox
from circuits_core.formats.llama import LLAMA_MODEL_TYPES, llama_config, load_llama, shard_names
from circuits_core.formats.llama_variants import VARIANT_MODEL_TYPES, load_variant, refuse_newer_layout, variant_config
from circuits_core.formats.moe_families import MOE_MODEL_TYPES, load_moe, moe_config
from circuits_core.formats.phi3 import load_phi3, phi3_config
from circuits_core.formats.qkov_format import load_qkov
from circuits_core.formats.statedict import folder_file, folder_listing, read_json_object
from circuits_core.formats.transformer_lens import load_transformer_lens
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader

Format = Literal[
    "qkov", "transformer_lens", "gpt2", "gpt_neox", "gguf", "llama", "mistral", "qwen2",
    "gemma2", "gemma3_text", "gemma3", "qwen3", "olmo2", "olmo3", "gpt_oss", "mixtral", "qwen3_moe", "olmoe", "bloom",
    "mpt", "phi3", "deepseek_v2", "deepseek_v3",
]  # fmt: skip
FORMATS: tuple[str, ...] = get_args(Format)
# A loader turns (folder, parsed config.json) into (config, TransformerLens state dict, key -> file, files).
# The compute dtype is passed so a loader may convert each tensor as it reads it (peak: one copy + one tensor).
Loader = Callable[
    [Path, dict[str, Any], torch.dtype], tuple[ModelConfig, dict[str, Tensor], dict[str, str], list[Path]]
]
HF_MODEL_TYPES: dict[str, Format] = {
    "gpt2": "gpt2", "gpt_neox": "gpt_neox", "llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
    "gemma2": "gemma2", "gemma3_text": "gemma3_text", "gemma3": "gemma3", "qwen3": "qwen3", "olmo2": "olmo2",
    "olmo3": "olmo3", "gpt_oss": "gpt_oss", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "olmoe": "olmoe",
    "bloom": "bloom", "mpt": "mpt", "phi3": "phi3", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3",
}  # fmt: skip
SAFETENSORS_FAMILIES = (
    *LLAMA_MODEL_TYPES,
    *VARIANT_MODEL_TYPES,
    "gpt_oss",
    *MOE_MODEL_TYPES,
    *ALIBI_MODEL_TYPES,
    "phi3",
    *DEEPSEEK_MODEL_TYPES,
)  # read shard by shard (llama.py's reader)
# Formats whose config.json prices the model before any tensor is read.
CONFIG_READERS: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    **dict.fromkeys(LLAMA_MODEL_TYPES, llama_config),
    **dict.fromkeys(VARIANT_MODEL_TYPES, variant_config),
    "gpt_oss": gpt_oss_config,
    **dict.fromkeys(MOE_MODEL_TYPES, moe_config),
    **dict.fromkeys(ALIBI_MODEL_TYPES, alibi_config),
    "phi3": phi3_config,
    **dict.fromkeys(DEEPSEEK_MODEL_TYPES, deepseek_config),
}


def detect_format(folder: str | Path) -> Format:
    """Which loader reads this folder (from config.json); CheckpointError says what was found instead."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder.name!r} not found")
    if not folder_file(folder, "config.json").is_file():
        if gguf_file(folder) is not None:  # a folder holding one .gguf file (llama.cpp, ollama) is a model
            return "gguf"
        raise CheckpointError(f"no config.json (found: {folder_listing(folder)}); formats: {', '.join(FORMATS)}")
    data = read_json_object(folder, "config.json")
    if "model_type" in data:
        model_type = ConfigReader(data).text("model_type")
        if model_type in HF_MODEL_TYPES:
            return HF_MODEL_TYPES[model_type]
        refuse_newer_layout(model_type)
        raise CheckpointError(
            f"config.json: unknown architecture model_type={model_type!r}; supported Hugging Face "
            f"model types: {', '.join(HF_MODEL_TYPES)} (formats: {', '.join(FORMATS)}; found: {folder_listing(folder)})"
        )
    if data.get("format") == "qkov":
        return "qkov"
    # A bare ModelConfig.to_dict() (qkov fields only; "use_bias" is not a TransformerLens field).
    qkov_fields = {f.name for f in dataclasses.fields(ModelConfig)} | {"format_version", "processing"}
    if "use_bias" in data and set(data) <= qkov_fields and folder_file(folder, "model.safetensors").is_file():
        return "qkov"
    if "n_layers" in data and "d_model" in data:
        return "transformer_lens"
    raise CheckpointError(
        f"config.json: not a known checkpoint format (formats: {', '.join(FORMATS)}); config.json has neither "
        f"model_type nor n_layers/d_model (found: {folder_listing(folder)})"
    )


REGISTRY: dict[Format, Loader] = {
    "qkov": load_qkov,
    "transformer_lens": load_transformer_lens,
    "gpt2": load_gpt2,
    "gpt_neox": load_gpt_neox,
    "llama": load_llama,
    "mistral": load_llama,
    "qwen2": load_llama,
    "gpt_oss": load_gpt_oss,
    "mixtral": load_moe,
    "qwen3_moe": load_moe,
    "olmoe": load_moe,
    "bloom": load_alibi,
    "mpt": load_alibi,
    "phi3": load_phi3,
    "deepseek_v2": load_deepseek,
    "deepseek_v3": load_deepseek,
    "gemma2": load_variant,
    "gemma3_text": load_variant,
    "gemma3": load_variant,
    "qwen3": load_variant,
    "olmo2": load_variant,
    "olmo3": load_variant,
}


def weight_files_known_before_reading(folder: Path, fmt: Format) -> list[Path] | None:
    """The weight files a loader will read, where the folder names them before any tensor is read (GGUF: its one
    file; the Llama family: its shards); None for the formats whose loaders find their files while reading."""
    if fmt == "gguf":
        return [folder_file(folder, gguf_file(folder) or "")]
    if fmt in SAFETENSORS_FAMILIES:
        return [folder_file(folder, name) for name in shard_names(folder)]
    return None
