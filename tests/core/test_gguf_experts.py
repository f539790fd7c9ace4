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
from tests.core.gguf_writing import converter_writer, finish
from tests.core.hf_families import TOKENS, hf_model

Q = gguf.GGMLQuantizationType
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
# transformers' parameter name (after model.layers.{l}.) -> llama.cpp's (after blk.{l}.)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",  # a dense Llama-family MLP
}  # fmt: skip
GPT_OSS_NAMES = LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias":
    "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias", "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias", "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}  # fmt: skip
GPT_OSS = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 32, "head_dim": 16,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
           "sliding_window": 4, "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter for "llama" files: rotate-half rows (head, half, i) -> adjacent pairs (head, i, half)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: Any, arch: str) -> dict[str, np.ndarray]:
    """llama.cpp's tensors of a transformers MoE model: names, merged experts [E, d_out, d_in], permuted Q/K."""
    cfg, out = model.config, {}
    for name, p in model.state_dict().items():
        value = p.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = value
        elif name == "model.norm.weight":
            out["output_norm.weight"] = value
        elif name == "lm_head.weight":
            out["output.weight"] = value
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            if rest == "mlp.experts.gate_up_proj" and arch == "gpt-oss":  # [E, d, 2 d_mlp], gate and up interleaved
                out[f"blk.{layer}.ffn_gate_exps.weight"] = value[:, :, 0::2].transpose(0, 2, 1)  # [E, d_mlp, d]
                out[f"blk.{layer}.ffn_up_exps.weight"] = value[:, :, 1::2].transpose(0, 2, 1)
                continue
            if rest == "mlp.experts.gate_up_proj_bias":  # gpt-oss: [E, 2 d_mlp], interleaved
                out[f"blk.{layer}.ffn_gate_exps.bias"] = value[:, 0::2]
                out[f"blk.{layer}.ffn_up_exps.bias"] = value[:, 1::2]
                continue
            if rest == "mlp.experts.down_proj" and arch == "gpt-oss":  # [E, d_mlp, d] (x @ W) -> [E, d, d_mlp]
                out[f"blk.{layer}.ffn_down_exps.weight"] = value.transpose(0, 2, 1)
                continue
            if rest == "mlp.experts.gate_up_proj":  # [E, 2 d_mlp, d]: the gate's rows, then the up projection's
                gate, up = np.split(value, 2, axis=1)
                out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
                continue
            if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                heads = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
                value = llama_permute(value, heads)
            out[f"blk.{layer}.{(GPT_OSS_NAMES if arch == 'gpt-oss' else LAYER_NAMES)[rest]}"] = value
    return out


def write_gguf(
    model: Any,
    arch: str,
    path: Path,
    expert_type: Q = Q.F32,
    extra: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    add: dict[str, np.ndarray] | None = None,
) -> None:
    """The GGUF llama.cpp's converter writes for `model` (no tokenizer; a dense Llama-family model too), experts
    stored as `expert_type`."""
    cfg = model.config
    writer = converter_writer(path, arch, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    n_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if n_experts:
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "gpt-oss":  # what the converter adds: the window, the experts' width, YaRN
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(cfg.rope_parameters["factor"])
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_parameters["original_max_position_embeddings"])
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    for name, value in ({**gguf_tensors(model, arch), **(add or {})}).items():
        if name in drop:
            continue
        if "_exps.weight" in name and expert_type != Q.F32:
            writer.add_tensor(name, gguf.quants.quantize(value, expert_type), raw_dtype=expert_type)
        else:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    finish(writer)


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
