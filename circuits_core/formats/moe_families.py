"""Hugging Face Mixtral, Qwen3-MoE and OLMoE checkpoints: Llama's layout with a mixture-of-experts MLP (moe.py).

Read as the Llama loader reads its family (llama.py: sharded safetensors, memory-mapped, tensor by tensor). Every
layer's MLP is num_experts SwiGLU experts, stored one nn.Linear per expert and stacked here on a leading axis:
    mixtral    block_sparse_moe.gate [E, d] -> mlp.W_router;  experts.{e}.w1 / w3 / w2 -> W_gate[e] / W_in[e] / W_out[e]
    qwen3_moe  mlp.gate [E, d];  mlp.experts.{e}.gate_proj / up_proj / down_proj (d_mlp = moe_intermediate_size)
    olmoe      as qwen3_moe (d_mlp = intermediate_size)
Routing (moe.route): Mixtral renormalises the top-k of the router softmax (= the softmax over the chosen logits);
Qwen3-MoE and OLMoE do so when norm_topk_prob is set, else keep the top-k entries of the full softmax.
Attention: Mixtral as Mistral (a sliding_window, when set, on every layer); Qwen3-MoE per-head QK-norm
(self_attn.q_norm / k_norm [d_head]); OLMoE QK-norm over all heads of a layer ([heads * d_head]).
Refused by name: dense layers among the sparse ones (Qwen3-MoE mlp_only_layers, decoder_sparse_step != 1), shared
experts, OLMoE's clip_qkv, attention biases, Qwen3-MoE's use_sliding_window, and the rope types rope_scaling.py
does not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError
from circuits_core.formats.hf import _act_fn, _bos, _config
from circuits_core.formats.llama import (
    _T,
    Loaded,
    State,
    _Shards,
    head_shape,
    single_threaded,
    take_projections,
    take_unembedding,
)
from circuits_core.formats.rope_scaling import rope_fields, rope_section
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "olmoe")
# model_type -> (router tensor, expert prefix, (gate, up, down) names, experts field, d_mlp field, QK-norm)
_LAYOUT = {
    "mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts", ("w1", "w3", "w2"), "num_local_experts",
                "intermediate_size", None),
    "qwen3_moe": ("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"), "num_experts",
                  "moe_intermediate_size", "head"),
    "olmoe": ("mlp.gate", "mlp.experts", ("gate_proj", "up_proj", "down_proj"), "num_experts", "intermediate_size",
              "layer"),
}  # fmt: skip


def _refuse_unhonoured(r: ConfigReader, model_type: str, n_layers: int) -> None:
    name = r.source
    if r.flag("attention_bias", default=False):
        raise CheckpointError(f"{name}: attention_bias=true is not supported for {model_type}")
    if r.number("clip_qkv", default=None) is not None:
        raise CheckpointError(f"{name}: clip_qkv (clamped q, k, v) is not supported")
    if r.integer("shared_expert_intermediate_size", default=0, ge=0) or r.integer("n_shared_experts", default=0, ge=0):
        raise CheckpointError(f"{name}: shared experts are not supported")
    if model_type == "qwen3_moe":
        if r.integer("decoder_sparse_step", default=1, ge=1) != 1:
            raise CheckpointError(f"{name}: decoder_sparse_step != 1 (dense layers among the sparse ones)")
        dense = r.data.get("mlp_only_layers") or []
        if dense:
            raise CheckpointError(f"{name}: mlp_only_layers={dense!r} (dense layers among the sparse ones)")
        if r.flag("use_sliding_window", default=False):
            raise CheckpointError(f"{name}: use_sliding_window=true is not supported for qwen3_moe")


def moe_config(hf: dict[str, Any]) -> ModelConfig:
    path = Path("config.json")
    r = ConfigReader(hf, path.name)
    model_type = r.text("model_type")
    if model_type not in MOE_MODEL_TYPES:
        raise CheckpointError(f"{path.name}: model_type {model_type!r} is not one of {', '.join(MOE_MODEL_TYPES)}")
    _, _, _, experts_field, d_mlp_field, qk_norm = _LAYOUT[model_type]
    n_layers = r.integer("num_hidden_layers", ge=0)
    _refuse_unhonoured(r, model_type, n_layers)
    d, n_heads, n_kv, dh = head_shape(r)
    d_vocab = r.integer("vocab_size", ge=1)
    window = r.integer("sliding_window", default=None, ge=1) if model_type == "mixtral" else None
    return _config(
        path, n_layers=n_layers, d_model=d, n_heads=n_heads, d_head=dh, d_vocab=d_vocab,
        n_ctx=r.integer("max_position_embeddings", ge=1), window_size=window, d_mlp=r.integer(d_mlp_field, ge=1),
        attn_only=False, normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
        act_fn=_act_fn(r, "hidden_act", "silu"), eps=r.number("rms_norm_eps", default=1e-6, gt=0),
        n_key_value_heads=n_kv if n_kv != n_heads else None, rotary_dim=dh, bos_token_id=_bos(r, d_vocab),
        qk_norm=qk_norm, num_experts=_n_experts(r, experts_field),
        experts_per_token=r.integer("num_experts_per_tok", ge=1),
        moe_norm_topk=True if model_type == "mixtral" else r.flag("norm_topk_prob", default=False),
        **rope_fields(r, rope_section(r), d_head=dh),
    )  # fmt: skip


def _n_experts(r: ConfigReader, field: str) -> int:
    """The expert count: the family's field, or the other name transformers writes for it (Qwen3-MoE's files say
    num_experts, transformers 5 saves num_local_experts)."""
    other = "num_local_experts" if field == "num_experts" else "num_experts"
    count = r.integer(field, default=None, ge=1)
    return count if count is not None else r.integer(other, ge=1)


@single_threaded
def load_moe(folder: Path, hf: dict[str, Any], dtype: torch.dtype) -> Loaded:
    """(config, TransformerLens state dict in `dtype`, tensor -> shard file, weight files)."""
    cfg = moe_config(hf)
    router, experts, (gate, up, down), _, _, _ = _LAYOUT[hf["model_type"]]
    src = _Shards(folder, dtype)
    d, H, G, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    E, m = cfg.num_experts or 0, cfg.d_mlp or 0
    sd: State = {"embed.W_E": src.take("model.embed_tokens.weight", (cfg.d_vocab, d))}
    for layer in range(cfg.n_layers):
        h, p = f"model.layers.{layer}", f"blocks.{layer}"
        sd[f"{p}.ln1.w"] = src.take(f"{h}.input_layernorm.weight", (d,))
        sd[f"{p}.ln2.w"] = src.take(f"{h}.post_attention_layernorm.weight", (d,))
        take_projections(src, cfg, h, p, sd)
        if cfg.qk_norm is not None:
            size_q, size_k = (dh, dh) if cfg.qk_norm == "head" else (H * dh, G * dh)
            sd[f"{p}.attn.q_norm.w"] = src.take(f"{h}.self_attn.q_norm.weight", (size_q,))
            sd[f"{p}.attn.k_norm.w"] = src.take(f"{h}.self_attn.k_norm.weight", (size_k,))
        sd[f"{p}.mlp.W_router"] = src.take(f"{h}.{router}.weight", (E, d), _T)  # [d_model, n_experts]
        for name, stored, shape in (("W_gate", gate, (m, d)), ("W_in", up, (m, d)), ("W_out", down, (d, m))):
            sd[f"{p}.mlp.{name}"] = _stacked(src, [f"{h}.{experts}.{e}.{stored}.weight" for e in range(E)], shape)
    sd["ln_final.w"] = src.take("model.norm.weight", (d,))
    tied = ConfigReader(hf).flag("tie_word_embeddings", default=False)
    sd["unembed.W_U"] = take_unembedding(src, folder, sd["embed.W_E"], tied)
    src.finish()
    return cfg, sd, dict(src.where), src.files


def _stacked(src: _Shards, keys: list[str], shape: tuple[int, int]) -> Tensor:
    """Per-expert nn.Linear weights [d_out, d_in] as one [n_experts, d_in, d_out] tensor (x @ W form), each expert
    converted and transposed as it is read."""
    out = torch.empty(len(keys), shape[1], shape[0], dtype=src.dtype)
    for e, key in enumerate(keys):
        out[e] = src.take(key, shape, _T)
    return out
