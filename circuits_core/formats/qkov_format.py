"""qkov's own checkpoint format: config.json (ModelConfig fields + "format": "qkov", its version and the processing
applied) + model.safetensors (+ tokenizer.json, model_card.json). `save_checkpoint` writes it, `load_qkov` reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from circuits_core.errors import CheckpointError
from circuits_core.formats.processing import SWITCHES
from circuits_core.formats.statedict import folder_file, folder_listing, model_config, read_weight_files
from circuits_core.formats.tokenizer import Tokenizer
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader
from circuits_core.model.transformer import Transformer

QKOV_FORMAT_VERSION = 1


def load_qkov(
    folder: Path, data: dict[str, Any], dtype: torch.dtype
) -> tuple[ModelConfig, dict[str, Tensor], dict[str, str], list[Path]]:
    version = ConfigReader(data).integer("format_version", default=QKOV_FORMAT_VERSION, ge=1)
    if version > QKOV_FORMAT_VERSION:
        raise CheckpointError(f"config.json: format_version {version} is newer than this code ({QKOV_FORMAT_VERSION})")
    weights = folder_file(folder, "model.safetensors")
    if not weights.is_file():
        raise CheckpointError(f"qkov checkpoint without model.safetensors (found: {folder_listing(folder)})")
    state, origin = read_weight_files([weights])
    return model_config(data, folder / "config.json"), state, origin, [weights]


def save_checkpoint(
    model: Transformer,
    folder: str | Path,
    tokenizer_json: str | Tokenizer | None = None,
    card: dict[str, Any] | None = None,
) -> Path:
    """Write qkov's format: config.json + model.safetensors (+ tokenizer.json, model_card.json)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    processing = {k: v for k, v in model.processing.items() if k in SWITCHES or k.endswith("_skipped")}
    config = {"format": "qkov", "format_version": QKOV_FORMAT_VERSION, **model.cfg.to_dict(), "processing": processing}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_json is not None:
        text = tokenizer_json.to_json() if isinstance(tokenizer_json, Tokenizer) else tokenizer_json
        (folder / "tokenizer.json").write_text(text)
    if card is not None:
        (folder / "model_card.json").write_text(json.dumps(card, indent=2) + "\n")
    return folder
