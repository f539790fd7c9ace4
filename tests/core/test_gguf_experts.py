"""Mixture-of-experts GGUF files (Mixtral, Qwen3-MoE, OLMoE) against transformers on the same weights.

Each test builds a random transformers model from a config (offline, every parameter re-drawn), writes it as
llama.cpp's converter does (its tensor names and metadata keys, every layer's experts merged into one tensor per
matrix, Mixtral's Q/K rows permuted to the adjacent-pairs rotary layout), and checks that qkov reading the GGUF gives
transformers' logits (float32, eager attention). The routing normalisation is not in the files: Mixtral and
Qwen3-MoE renormalise the top-k, OLMoE does not, so the configurations below make that difference show in the
logits. The quantised test stores the experts in Q8_0 and reads them in chunks that run over from one expert into
the next; transformers then runs the values the gguf library's reference code dequantises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from circuits_core.errors import CheckpointError
from circuits_core.formats import gguf_quants
from circuits_core.formats.checkpoint import load_checkpoint
from tests.core.gguf_writing import Q, write_gguf
from tests.core.hf_families import TOKENS, hf_model

BASE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts_per_tok": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}, "tie_word_embeddings": False}  # fmt: skip
# name -> (GGUF architecture, transformers config and model classes, config fields)
CASES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "mixtral": ("llama", "MixtralConfig", "MixtralForCausalLM", {**BASE, "num_local_experts": 4,
                                                                  "intermediate_size": 32}),
    "qwen3_moe": ("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**BASE, "num_experts": 4,
                  "moe_intermediate_size": 32, "intermediate_size": 96, "norm_topk_prob": True, "head_dim": 8}),
    "olmoe": ("olmoe", "OlmoeConfig", "OlmoeForCausalLM", {**BASE, "num_experts": 4, "intermediate_size": 32,
                                                          "norm_topk_prob": False}),
}  # fmt: skip
GPT_OSS = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 32, "head_dim": 16,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "sliding_window": 4, "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip


def moe_model(name: str, seed: int) -> tuple[str, Any]:
    arch, config_class, model_class, fields = CASES[name]
    return arch, hf_model(config_class, model_class, fields, seed)


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers_on_the_same_weights(name: str, tmp_path: Path) -> None:
    arch, model = moe_model(name, seed=40)
    write_gguf(model, arch, tmp_path / "m.gguf")
    loaded = load_checkpoint(tmp_path, process=False)
    cfg = loaded.model.cfg
    assert (cfg.num_experts, cfg.experts_per_token, cfg.d_mlp) == (4, 2, 32)
    assert cfg.moe_norm_topk == (name != "olmoe") and cfg.rotary_adjacent_pairs == (arch == "llama")
    expected = logits(model)
    got = loaded.model.run(TOKENS)[0]
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()
    processed = load_checkpoint(tmp_path).model.run(TOKENS)[0]  # gains folded where they can be, W_U centred
    assert (processed.log_softmax(-1) - expected.log_softmax(-1)).abs().max() < 1e-4


def test_quantised_experts_read_in_chunks_that_span_two_experts(tmp_path: Path, monkeypatch: Any) -> None:
    arch, model = moe_model("mixtral", seed=41)
    write_gguf(model, arch, tmp_path / "m.gguf", expert_type=Q.Q8_0)
    with torch.no_grad():  # transformers runs the values the gguf library's reference code decodes
        for layer in model.model.layers:
            experts = layer.mlp.experts
            for param in (experts.gate_up_proj, experts.down_proj):
                q = gguf.quants.quantize(param.detach().float().numpy(), Q.Q8_0)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(q, Q.Q8_0)))
    # 7 rows of 64 (14 of 32) per chunk: the 32- and 64-row experts end inside a chunk
    monkeypatch.setattr(gguf_quants, "CHUNK_VALUES", 7 * 64)
    got = load_checkpoint(tmp_path, process=False).model.run(TOKENS)[0]
    expected = logits(model)
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()


def test_variants_llama_cpp_runs_otherwise_are_refused_by_name(tmp_path: Path) -> None:
    arch, model = moe_model("qwen3_moe", seed=42)
    sigmoid = tmp_path / "sigmoid"
    sigmoid.mkdir()
    write_gguf(model, arch, sigmoid / "m.gguf", extra={"qwen3moe.expert_gating_func": 2})
    with pytest.raises(CheckpointError, match="expert_gating_func=2 is not supported"):
        load_checkpoint(sigmoid)
    shared = tmp_path / "shared"
    shared.mkdir()
    write_gguf(model, arch, shared / "m.gguf", add={"blk.0.ffn_up_shexp.weight": np.zeros((8, 64), np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor.*blk.0.ffn_up_shexp.weight"):
        load_checkpoint(shared)
    old = tmp_path / "per_expert"
    old.mkdir()
    write_gguf(model, arch, old / "m.gguf", drop=("blk.0.ffn_gate_inp.weight",),
               add={"blk.0.ffn_gate.0.weight": np.zeros((32, 64), np.float32)})  # fmt: skip
    with pytest.raises(CheckpointError, match="per-expert tensors"):
        load_checkpoint(old)


def gpt_oss_model(seed: int) -> Any:
    model = hf_model("GptOssConfig", "GptOssForCausalLM", GPT_OSS, seed)
    with torch.no_grad():  # sinks around the scores' scale: some rows keep most of their mass, others give it away
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 6.0, 4))
    return model


@pytest.mark.parametrize("expert_type", [Q.F32, Q.MXFP4], ids=["f32", "mxfp4"])
def test_gpt_oss_logits_and_patterns_equal_transformers(expert_type: Q, tmp_path: Path) -> None:
    """gpt-oss as the converter writes it (sinks, biases, windows on even layers, YaRN; experts in F32 or, as the
    released files, MXFP4): transformers' logits and its eager patterns, rows that give mass to the sink included."""
    model = gpt_oss_model(seed=43)
    write_gguf(model, "gpt-oss", tmp_path / "m.gguf", expert_type=expert_type)
    if expert_type == Q.MXFP4:  # transformers runs the values the gguf library's reference code decodes
        with torch.no_grad():
            for layer in model.model.layers:
                experts = layer.mlp.experts
                for param in (experts.gate_up_proj, experts.down_proj):  # quantised along d_in, as in the file
                    value = param.detach().float().numpy().transpose(0, 2, 1)
                    decoded = gguf.quants.dequantize(gguf.quants.quantize(value, Q.MXFP4), Q.MXFP4)
                    param.copy_(torch.from_numpy(decoded.transpose(0, 2, 1).copy()))
    loaded = load_checkpoint(tmp_path, process=False)
    cfg = loaded.model.cfg
    assert cfg.attn_types == ("local", "global") and cfg.window_size == 4 and cfg.attn_sinks
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_truncate) == ("yarn", 32.0, False)
    assert {d.field for d in loaded.defaulted} == {"rope_truncate", "rope_beta_fast", "rope_beta_slow"}
    with torch.no_grad():
        out = model(TOKENS, output_attentions=True)
    logits, cache = loaded.model.run(TOKENS, names=lambda n: n.endswith("hook_pattern"))
    assert (logits - out.logits).abs().max() < 1e-4 * out.logits.abs().max()
    for layer, ref in enumerate(out.attentions):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert (pattern - ref).abs().max() <= 1e-5
    assert out.attentions[0].sum(-1).min() < 0.5  # some rows give most of their mass to the sink
