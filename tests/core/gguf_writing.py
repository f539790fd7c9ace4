"""Writing GGUF files the way llama.cpp's converter does, from a transformers model (random weights, offline), for
the GGUF tests and the GGUF loads of `python -m bench gguf-load`: the hyperparameters every transformers config with
(grouped-query) attention gets, the three writes that close a file, and the files of the Llama family with its
mixture-of-experts relatives (Mixtral, Qwen3-MoE, OLMoE, gpt-oss), DeepSeek-V2/V3 (`deepseek2`) and the ALiBi
families (BLOOM, MPT), as the converter names, merges and permutes their tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def converter_writer(path: Path, arch: str, cfg: Any, n_kv: int | None = None) -> gguf.GGUFWriter:
    """A writer for `arch` holding the counts and sizes the converter writes for any such config: layers, context,
    widths of the residual stream and the MLP, query and key/value heads (`n_kv` where the converter writes another
    count than the config's: 1 for DeepSeek's latent attention, run by llama.cpp as one shared key/value head)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads if n_kv is None else n_kv)
    return writer


def finish(writer: gguf.GGUFWriter) -> None:
    """Write the header, the metadata and the tensors added, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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


DEEPSEEK_NAMES = {  # transformers' name (after model.layers.{l}.) -> llama.cpp's (after blk.{l}.)
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}  # fmt: skip


def deepseek_tensors(model: Any, legacy: bool) -> dict[str, np.ndarray]:
    """llama.cpp's tensors of a transformers DeepSeek: names, merged experts, kv_b_proj split (or, `legacy`, kept)."""
    cfg, out = model.config, {}
    H, d_nope, d_v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    for name, p in model.state_dict().items():
        value = p.detach().float().numpy()
        if name in top:
            out[top[name]] = value
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        b = f"blk.{layer}"
        if rest == "self_attn.kv_b_proj.weight" and not legacy:  # [H (nope + v), kv_rank] -> k_b, v_b
            kv_b = value.reshape(H, d_nope + d_v, -1)
            out[f"{b}.attn_k_b.weight"] = kv_b[:, :d_nope].transpose(0, 2, 1)  # [H, kv_rank, d_nope]
            out[f"{b}.attn_v_b.weight"] = kv_b[:, d_nope:]  # [H, d_v, kv_rank]
        elif rest == "self_attn.kv_b_proj.weight":
            out[f"{b}.attn_kv_b.weight"] = value
        elif rest == "mlp.experts.gate_up_proj":  # [E, 2 d_mlp, d]: the gate's rows, then the up projection's
            out[f"{b}.ffn_gate_exps.weight"], out[f"{b}.ffn_up_exps.weight"] = np.split(value, 2, axis=1)
        elif rest == "mlp.experts.down_proj":  # [E, d, d_mlp]
            out[f"{b}.ffn_down_exps.weight"] = value
        elif rest == "mlp.gate.e_score_correction_bias":
            out[f"{b}.exp_probs_b.bias"] = value
        else:
            stem, suffix = rest.rsplit(".", 1)
            out[f"{b}.{DEEPSEEK_NAMES[stem]}.{suffix}"] = value
    return out


def write_deepseek(
    model: Any, path: Path, scoring: str | None, legacy: bool, edit: dict[str, gguf.GGUFValue] | None = None
) -> None:
    """The GGUF llama.cpp's converter writes for `model` (no tokenizer); `scoring`: the config's scoring_func;
    `edit`: metadata values replaced or added after the converter's."""
    cfg = model.config
    writer = converter_writer(path, "deepseek2", cfg, n_kv=1)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.n_group is not None:
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
    if scoring is not None:
        writer.add_expert_gating_func(
            gguf.ExpertGatingFuncType.SIGMOID if scoring == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX
        )
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank is not None:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if legacy:  # before the MLA rewrite: the per-head widths under the plain keys
        writer.add_key_length(d_qk)
        writer.add_value_length(cfg.v_head_dim)
    else:
        writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(d_qk)
        writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    for name, value in deepseek_tensors(model, legacy).items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.kv_data[0].update(edit or {})
    finish(writer)


BLOOM_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attention.query_key_value":
    "attn_qkv", "self_attention.dense": "attn_output", "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down",
}  # fmt: skip
BLOOM_TOP = {"word_embeddings.weight": "token_embd.weight",
             "word_embeddings_layernorm.weight": "token_embd_norm.weight",
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
        if name in BLOOM_TOP:
            writer.add_tensor(BLOOM_TOP[name], np.ascontiguousarray(value))
            if name == "word_embeddings.weight":  # the converter's copy of the tied embedding
                writer.add_tensor("output.weight", np.ascontiguousarray(value))
            continue
        layer, rest = name.removeprefix("h.").split(".", 1)
        stem, suffix = rest.rsplit(".", 1)
        if stem == "self_attention.query_key_value":  # rows (head, 3, d_head) -> q's, k's, v's
            value = value.reshape(H, 3, d // H, -1).swapaxes(0, 1).reshape(value.shape)
        writer.add_tensor(f"blk.{layer}.{BLOOM_NAMES[stem]}.{suffix}", np.ascontiguousarray(value))
    finish(writer)


MPT_NAMES = {"norm_1": "attn_norm", "norm_2": "ffn_norm", "attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output",
             "ffn.up_proj": "ffn_up", "ffn.down_proj": "ffn_down"}  # fmt: skip


def write_mpt(model: Any, path: Path, extra: dict[str, gguf.GGUFValue] | None = None) -> None:
    cfg = model.config
    writer = gguf.GGUFWriter(path, "mpt")
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(4 * cfg.d_model)
    writer.add_head_count(cfg.n_heads)
    writer.add_layer_norm_eps(1e-5)
    writer.add_max_alibi_bias(cfg.attn_config.alibi_bias_max)
    top = {"transformer.wte.weight": "token_embd.weight", "transformer.norm_f.weight": "output_norm.weight"}
    for name, p in model.state_dict().items():
        value = np.ascontiguousarray(p.detach().float().numpy())
        if name == "lm_head.weight":  # tied: the converter writes no output.weight
            continue
        if name in top:
            writer.add_tensor(top[name], value)
            continue
        layer, rest = name.removeprefix("transformer.blocks.").split(".", 1)
        stem, suffix = rest.rsplit(".", 1)
        writer.add_tensor(f"blk.{layer}.{MPT_NAMES[stem]}.{suffix}", value)
    writer.kv_data[0].update(extra or {})
    finish(writer)
