"""BLOOM GGUF files (`bloom`: ALiBi, LayerNorms with biases, the embedding LayerNorm) against transformers.

A random transformers BLOOM with 6 heads (not a power of two, where BLOOM's slope rule has its extra slopes) is
written as llama.cpp's converter writes it: the fused query_key_value's per-head (head, 3, d_head) rows reordered
into q's rows, then k's, then v's, and the tied embedding copied to output.weight. qkov reading the GGUF must give
transformers' logits and eager patterns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from tests.core.gguf_writing import finish
from tests.core.hf_families import TOKENS, hf_model, hf_run

FIELDS = {"hidden_size": 48, "n_layer": 2, "n_head": 6, "pad_token_id": None, "eos_token_id": None,
          "bos_token_id": None}  # fmt: skip
NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attention.query_key_value":
    "attn_qkv", "self_attention.dense": "attn_output", "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down",
}  # fmt: skip
TOP = {"word_embeddings.weight": "token_embd.weight", "word_embeddings_layernorm.weight": "token_embd_norm.weight",
       "word_embeddings_layernorm.bias": "token_embd_norm.bias", "ln_f.weight": "output_norm.weight",
       "ln_f.bias": "output_norm.bias"}  # fmt: skip


def write_bloom(model: Any, path: Path, arch: str = "bloom") -> None:
    cfg = model.config
    d, H = cfg.hidden_size, cfg.n_head
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(64)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(4 * d)
    writer.add_head_count(H)
    writer.add_head_count_kv(H)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    for name, p in model.state_dict().items():
        value = p.detach().float().numpy()
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight":
            continue
        if name in TOP:
            writer.add_tensor(TOP[name], np.ascontiguousarray(value))
            if name == "word_embeddings.weight":  # the converter's copy of the tied embedding
                writer.add_tensor("output.weight", np.ascontiguousarray(value))
            continue
        layer, rest = name.removeprefix("h.").split(".", 1)
        stem, suffix = rest.rsplit(".", 1)
        if stem == "self_attention.query_key_value":  # rows (head, 3, d_head) -> q's, k's, v's
            value = value.reshape(H, 3, d // H, -1).swapaxes(0, 1).reshape(value.shape)
        writer.add_tensor(f"blk.{layer}.{NAMES[stem]}.{suffix}", np.ascontiguousarray(value))
    finish(writer)


def test_logits_and_patterns_equal_transformers(tmp_path: Path) -> None:
    model = hf_model("BloomConfig", "BloomForCausalLM", FIELDS, seed=53)
    write_bloom(model, tmp_path / "m.gguf")
    loaded = load_checkpoint(tmp_path, process=False)
    assert loaded.model.cfg.alibi == "bloom" and loaded.model.cfg.n_heads == 6
    ref_logits, ref_patterns = hf_run(model, TOKENS)
    logits, cache = loaded.model.run(TOKENS, names=lambda n: n.endswith("hook_pattern"))
    assert (logits - ref_logits).abs().max() < 1e-4 * ref_logits.abs().max()
    for layer, ref in enumerate(ref_patterns):
        assert (cache[f"blocks.{layer}.attn.hook_pattern"] - ref).abs().max() <= 1e-5
    processed = load_checkpoint(tmp_path).model.run(TOKENS)[0]
    assert (processed.log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max() < 1e-4


def test_mpt_files_are_refused_by_name(tmp_path: Path) -> None:
    model = hf_model("BloomConfig", "BloomForCausalLM", FIELDS, seed=54)
    write_bloom(model, tmp_path / "m.gguf", arch="mpt")
    with pytest.raises(CheckpointError, match="architecture 'mpt' is not supported yet"):
        load_checkpoint(tmp_path)
