"""Phi-3 GGUF files (`phi3`, fused attn_qkv and ffn_up) against transformers on the same weights.

A random transformers Phi-3 (grouped-query heads, a sliding window of 6 on 14 tokens, so the window bites) is written
as llama.cpp's converter writes it (tensor names, the fused projections as stored, rows not permuted, the window in
`phi3.attention.sliding_window`), and qkov reading the GGUF must give transformers' logits and eager patterns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from tests.core.gguf_writing import converter_writer, finish
from tests.core.hf_families import TOKENS, hf_model, hf_run

FIELDS = {"hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "sliding_window": 6, "pad_token_id": None,
          "eos_token_id": None, "bos_token_id": None, "tie_word_embeddings": False,
          "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}  # fmt: skip
# transformers' parameter name (after model.layers.{l}.) -> llama.cpp's (after blk.{l}.)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}  # fmt: skip


def write_phi3(model: Any, path: Path, add: dict[str, np.ndarray] | None = None) -> None:
    cfg = model.config
    writer = converter_writer(path, "phi3", cfg)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if cfg.sliding_window is not None:  # a config without one (the app walk's) is written without the key
        writer.add_sliding_window(cfg.sliding_window)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    for name, p in model.state_dict().items():
        if name not in names:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            names[name] = f"blk.{layer}.{LAYER_NAMES[rest]}"
        writer.add_tensor(names[name], np.ascontiguousarray(p.detach().float().numpy()))
    for name, value in (add or {}).items():
        writer.add_tensor(name, value)
    finish(writer)


def test_logits_and_patterns_equal_transformers(tmp_path: Path) -> None:
    model = hf_model("Phi3Config", "Phi3ForCausalLM", FIELDS, seed=51)
    write_phi3(model, tmp_path / "m.gguf")
    loaded = load_checkpoint(tmp_path, process=False)
    assert loaded.model.cfg.window_size == 6 and loaded.model.cfg.attn_types is None  # every layer
    ref_logits, ref_patterns = hf_run(model, TOKENS)
    logits, cache = loaded.model.run(TOKENS, names=lambda n: n.endswith("hook_pattern"))
    assert (logits - ref_logits).abs().max() < 1e-4 * ref_logits.abs().max()
    for layer, ref in enumerate(ref_patterns):
        assert (cache[f"blocks.{layer}.attn.hook_pattern"] - ref).abs().max() <= 1e-5
    processed = load_checkpoint(tmp_path).model.run(TOKENS)[0]
    assert (processed.log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max() < 1e-4
    assert torch.isfinite(logits).all()


def test_longrope_files_are_refused_by_name(tmp_path: Path) -> None:
    model = hf_model("Phi3Config", "Phi3ForCausalLM", FIELDS, seed=52)
    write_phi3(model, tmp_path / "m.gguf", add={"rope_factors_long.weight": np.ones(4, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor.*rope_factors_long"):
        load_checkpoint(tmp_path)
