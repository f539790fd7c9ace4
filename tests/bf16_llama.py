"""A Llama checkpoint that transformers writes in bf16, with its norms' gains made uneven (transformers initialises them
to 1, which would hide a gain applied twice or not at all): the half-precision weights' tests load it kept half."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers


def save_bf16_llama(folder: Path, config: dict[str, Any], seed: int) -> Path:
    """transformers' LlamaForCausalLM of `config` (its own initialisation, N(0, 0.02), under `seed`), every norm's gain
    drawn from U(0.5, 1.5), saved in bf16 to folder / "llama"."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = folder / "llama"
    model.to(torch.bfloat16).save_pretrained(path)
    return path
