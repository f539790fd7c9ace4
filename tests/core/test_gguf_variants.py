"""GGUF files of the newest architectures (gemma3, qwen3) against transformers on the same weights.

Each test builds a random transformers model from a config (offline), writes its weights as llama.cpp's converter
writes them (llama.cpp's tensor names; Gemma's norm gains stored as 1 + w; Q and K rows in Hugging Face order), and
checks that qkov reading the GGUF gives transformers' logits (float32, eager attention). The files carry only what
llama.cpp writes: for gemma3 the global rope base and the window, never the local base, the layer pattern nor
query_pre_attn_scalar, so the per-architecture defaults are exercised (and transformers is configured with the
values those defaults claim: local base 10,000, every 6th layer global, query_pre_attn_scalar = head_dim). The model
has 7 layers (layer 5 global), a window of 4 on a 24-token sequence, multi-query attention, d_head != d_model /
n_heads, and its norm gains far from 1.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.gguf import GEMMA3_SOURCES, REFUSED, gguf_config
from circuits_core.formats.gguf_header import GGUFHeader
from tests.core.gguf_writing import converter_writer, finish

VOCAB, N = 97, 24
GEMMA3 = {
    "vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 7,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 16,
    "sliding_window": 4, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "attn_implementation": "eager",
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
}  # fmt: skip
QWEN3 = {
    "vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "attn_implementation": "eager", "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
}  # fmt: skip
TOKENS = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(5))
# transformers' parameter name (after model.layers.{l}.) -> llama.cpp's tensor name (after blk.{l}.)
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
QWEN3_LAYER_NAMES = LAYER_NAMES | {"post_attention_layernorm": "ffn_norm"}


def hf_model(kind: str, fields: dict[str, Any], seed: int) -> Any:
    config_class, model_class = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "qwen3": ("Qwen3Config",
                                 "Qwen3ForCausalLM")}[kind]  # fmt: skip
    config = getattr(transformers, config_class)(**fields)
    model = getattr(transformers, model_class)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            # Gemma's files store w for a gain of 1 + w; gains well away from 1 so that a missing or doubled + 1 shows
            p.copy_(0.5 * noise + (0.0 if kind == "gemma3" else 1.0) if name.endswith("norm.weight") else 0.2 * noise)
    return model


def write_as_llama_cpp(model: Any, path: Path, kind: str, extra: dict[str, Any] | None = None) -> None:
    """The GGUF llama.cpp's convert_hf_to_gguf.py writes for this model (F32 tensors, no tokenizer)."""
    cfg = model.config
    writer = converter_writer(path, kind, cfg)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if kind == "gemma3" else rope["rope_theta"])
    if kind == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    for key, value in (extra or {}).items():
        writer.add_key_value(
            key, value, gguf.GGUFValueType.UINT32 if isinstance(value, int) else gguf.GGUFValueType.FLOAT32
        )
    names = LAYER_NAMES if kind == "gemma3" else QWEN3_LAYER_NAMES
    for name, p in model.state_dict().items():
        value = p.detach().float().numpy()
        if name.endswith("norm.weight") and kind == "gemma3":
            value = value + 1  # llama.cpp's Gemma converter: the gain the model applies, 1 + w
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            stem, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[stem]}.{suffix}"
        writer.add_tensor(gguf_name, np.ascontiguousarray(value, dtype=np.float32))
    finish(writer)


@pytest.mark.parametrize("kind", ["gemma3", "qwen3"])
def test_logits_equal_transformers_on_the_same_weights(kind: str, tmp_path: Path) -> None:
    model = hf_model(kind, GEMMA3 if kind == "gemma3" else QWEN3, seed=1)
    folder = tmp_path / kind
    folder.mkdir()
    write_as_llama_cpp(model, folder / "m.gguf", kind)
    loaded = load_checkpoint(folder, process=False)
    cfg = loaded.model.cfg
    assert cfg.d_head * cfg.n_heads != cfg.d_model and cfg.qk_norm == "head"
    if kind == "gemma3":
        assert cfg.attn_types == ("local",) * 5 + ("global", "local") and cfg.window_size == 4
        assert (cfg.rotary_base, cfg.rotary_base_local) == (1_000_000.0, 10_000.0)
        assert {d.field for d in loaded.defaulted} == set(GEMMA3_SOURCES)
    else:
        assert loaded.defaulted == [] and cfg.window_size is None
    with torch.no_grad():
        expected = model(TOKENS).logits
    got = loaded.model.run(TOKENS)[0]
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()
    processed = load_checkpoint(folder).model.run(TOKENS)[0]  # gains folded where they can be, W_U centred
    assert (processed.log_softmax(-1) - expected.log_softmax(-1)).abs().max() < 1e-4


def test_a_gemma3_file_that_names_its_local_base_and_pattern_is_read_not_defaulted(tmp_path: Path) -> None:
    fields = {
        **GEMMA3,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        "sliding_window_pattern": 3,
    }
    model = hf_model("gemma3", fields, seed=2)
    path = tmp_path / "m.gguf"
    extra = {"gemma3.attention.sliding_window_pattern": 3, "gemma3.rope.freq_base_swa": 500.0}
    write_as_llama_cpp(model, path, "gemma3", extra)
    with GGUFHeader(path) as header:
        cfg, defaulted = gguf_config(header, VOCAB)
    assert cfg.attn_types == ("local", "local", "global") * 2 + ("local",) and cfg.rotary_base_local == 500.0
    assert [d.field for d in defaulted] == ["attn_scale"]  # never in a gemma3 file


def test_gemma3_attention_soft_capping_and_other_architectures_are_refused_by_name(tmp_path: Path) -> None:
    model = hf_model("gemma3", GEMMA3, seed=3)
    folder = tmp_path / "capped"
    folder.mkdir()
    write_as_llama_cpp(model, folder / "m.gguf", "gemma3", {"gemma3.attn_logit_softcapping": 50.0})
    with pytest.raises(CheckpointError, match="gemma3.attn_logit_softcapping is set, but Gemma 3 never applies it"):
        load_checkpoint(folder)
    assert "per-layer-type head dims" in REFUSED["gemma4"] and "linear-attention" in REFUSED["qwen35"]
    refused = [(arch, re.escape(why)) for arch, why in REFUSED.items()]  # gemma3n, gemma4, qwen35, qwen3next
    for arch, why in (*refused, ("falcon", "")):
        other = tmp_path / arch
        other.mkdir()
        writer = gguf.GGUFWriter(other / "m.gguf", arch)
        writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 32), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(CheckpointError, match=f"architecture '{arch}' is not supported.*{why}"):
            load_checkpoint(other)
