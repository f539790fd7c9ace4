"""Tiny random checkpoints that transformers writes for the families beyond Llama (gpt-oss, the MoE models), and
what the tests compare against: transformers' own eager forward pass on the same weights."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint

VOCAB, N = 61, 14
TOKENS = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(3))


def randomise(model: Any, seed: int) -> None:
    """Re-draw every parameter at a scale that makes logits O(1-10): norms 1 + 0.3 N, biases and sinks 0.5 N (so
    some pattern rows keep most of their mass and others give most of it to the sink), matrices N(0, 1.5² / fan_in).
    Stacked experts [E, d_in, d_out] (gpt-oss) have their fan-in on axis -2, nn.Linear [d_out, d_in] on axis -1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                fan_in = (
                    p.shape[-2]
                    if name.endswith(("gate_up_proj", "experts.down_proj")) and p.dim() == 3
                    else p.shape[-1]
                )
                p.copy_(noise * 1.5 / math.sqrt(fan_in))


def hf_model(config_name: str, model_name: str, fields: dict[str, Any], seed: int) -> Any:
    config = getattr(transformers, config_name)(**{"vocab_size": VOCAB, **fields})
    config._attn_implementation = "eager"  # the reference: patterns as transformers' eager attention returns them
    model = getattr(transformers, model_name)(config).eval()
    randomise(model, seed)
    return model


def save(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def hf_run(model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(logits [batch, n, V], attention patterns per layer [batch, heads, n, n]) from transformers."""
    with torch.no_grad():
        out = model(tokens, output_attentions=True)
    return out.logits, out.attentions


def assert_edit_refused(folder: Path, out: Path, edit: dict[str, Any], message: str) -> None:
    """The checkpoint in `folder` with `edit` merged into its config.json (written to `out`) is refused by
    load_checkpoint with a CheckpointError naming `message`: a variant qkov cannot honour is never loaded as another."""
    out.mkdir()
    (out / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (out / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **edit}))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(out)


def assert_runs_like(folder: Path, reference: Any) -> Any:
    """The checkpoint in `folder`, loaded unprocessed, gives `reference`'s logits (to 1e-4 of their largest) and
    eager patterns (to 1e-5); loaded processed (gains folded, W_U centred), its log-probs (to 1e-4). Returns the
    unprocessed load."""
    ref_logits, ref_patterns = hf_run(reference, TOKENS)
    loaded = load_checkpoint(folder, process=False)
    logits, cache = loaded.model.run(TOKENS, names=lambda n: n.endswith("hook_pattern"))
    assert (logits - ref_logits).abs().max() < 1e-4 * ref_logits.abs().max() and ref_logits.abs().max() > 1
    for layer, ref in enumerate(ref_patterns):
        assert (cache[f"blocks.{layer}.attn.hook_pattern"] - ref).abs().max() <= 1e-5
    processed = load_checkpoint(folder).model
    assert (processed(TOKENS).log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max() < 1e-4
    return loaded
