"""Hugging Face gpt-oss checkpoints (`model_type: gpt_oss`), converted to TransformerLens names and shapes.

Attention as the Llama family (llama.take_projections: q/k/v/o_proj with biases, grouped-query heads, rotate-half
rope) plus a learned sink per head (`self_attn.sinks` [n_heads] -> attn.sinks); YaRN rope scaling with its
attention factor (rope_scaling.py). Every MLP is a mixture of experts (moe.py), stored as
    mlp.router.weight [E, d] -> mlp.W_router [d, E]        mlp.router.bias [E] -> mlp.b_router
    mlp.experts.gate_up_proj [E, d, 2 d_mlp], gate and up interleaved along the last axis (gate = even columns)
        -> mlp.W_gate, mlp.W_in [E, d, d_mlp]; gate_up_proj_bias [E, 2 d_mlp] -> b_gate, b_in
    mlp.experts.down_proj [E, d_mlp, d] -> mlp.W_out; down_proj_bias [E, d] -> b_out
or, in the released files (quantization_config.quant_method "mxfp4"), as MXFP4 `*_blocks` / `*_scales` pairs
holding each expert projection as [d_out, d_in] (mxfp4.py), dequantised one expert at a time.
Routing: softmax over the top-k router logits; experts: the clamped SwiGLU (swiglu_alpha, swiglu_limit).

Sliding layers (`layer_types`, window `sliding_window`: 128 in the released models) are local layers: keys at
offsets >= window are masked (window.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from circuits_core.errors import CheckpointError
from circuits_core.formats.hf import _bos, _config
from circuits_core.formats.llama import _T, State, _Shards, one_thread, take_projections, take_unembedding
from circuits_core.formats.mxfp4 import BLOCK, dequantize_mxfp4
from circuits_core.formats.rope_scaling import rope_fields, rope_section
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader

LAYER_TYPES = ("sliding_attention", "full_attention")


def _quantised(r: ConfigReader) -> bool:
    method = r.section("quantization_config").text("quant_method", default=None)
    if method not in (None, "mxfp4"):
        raise CheckpointError(f"{r.source}: quantization_config.quant_method {method!r} is not supported (mxfp4 only)")
    return method == "mxfp4"


def _windows(r: ConfigReader, n_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(window_size, attn_types): sliding layers are local (layer_types; transformers' default: even layers slide)."""
    types = r.data.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(f"{r.source}: layer_types must list {n_layers} of {', '.join(LAYER_TYPES)}")
    if "sliding_attention" not in types:
        return None, None
    window = r.integer("sliding_window", ge=1)
    return window, tuple("local" if t == "sliding_attention" else "global" for t in types)


def gpt_oss_config(hf: dict[str, Any]) -> ModelConfig:
    path = Path("config.json")
    r = ConfigReader(hf, path.name)
    if r.text("model_type") != "gpt_oss":
        raise CheckpointError(f"{path.name}: model_type {hf.get('model_type')!r} is not gpt_oss")
    d, n_heads = r.integer("hidden_size", ge=1), r.integer("num_attention_heads", ge=1)
    n_kv = r.integer("num_key_value_heads", default=n_heads, ge=1)
    dh = r.integer("head_dim", default=None, ge=1) or d // n_heads
    if not r.flag("attention_bias", default=True):
        raise CheckpointError(f"{path.name}: attention_bias=false is not supported (gpt-oss has attention biases)")
    n_layers, d_vocab = r.integer("num_hidden_layers", ge=0), r.integer("vocab_size", ge=1)
    window, attn_types = _windows(r, n_layers)
    _quantised(r)
    return _config(
        path, n_layers=n_layers, d_model=d, n_heads=n_heads, d_head=dh, d_vocab=d_vocab,
        n_ctx=r.integer("max_position_embeddings", ge=1), window_size=window, attn_types=attn_types,
        d_mlp=r.integer("intermediate_size", ge=1), attn_only=False,
        normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True, act_fn="silu",
        eps=r.number("rms_norm_eps", default=1e-5, gt=0), use_bias=True,
        n_key_value_heads=n_kv if n_kv != n_heads else None, rotary_dim=dh, bos_token_id=_bos(r, d_vocab),
        attn_sinks=True, num_experts=r.integer("num_local_experts", ge=1),
        experts_per_token=r.integer("num_experts_per_tok", ge=1), moe_norm_topk=True, clamped_swiglu=True,
        swiglu_alpha=r.number("swiglu_alpha", default=1.702, gt=0),
        swiglu_limit=r.number("swiglu_limit", default=7.0, gt=0), **rope_fields(r, rope_section(r), d_head=dh),
    )  # fmt: skip


def load_gpt_oss(
    folder: Path, hf: dict[str, Any], dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, State, dict[str, str], list[Path]]:
    """(config, TransformerLens state dict in `dtype`, tensor -> shard file, weight files)."""
    with one_thread():
        cfg = gpt_oss_config(hf)
        src = _Shards(folder, dtype)
        d, H = cfg.d_model, cfg.n_heads
        sd: State = {"embed.W_E": src.take("model.embed_tokens.weight", (cfg.d_vocab, d))}
        quantised = _quantised(ConfigReader(hf))
        for layer in range(cfg.n_layers):
            h, p = f"model.layers.{layer}", f"blocks.{layer}"
            sd[f"{p}.ln1.w"] = src.take(f"{h}.input_layernorm.weight", (d,))
            sd[f"{p}.ln2.w"] = src.take(f"{h}.post_attention_layernorm.weight", (d,))
            take_projections(src, cfg, h, p, sd)
            sd[f"{p}.attn.b_O"] = src.take(f"{h}.self_attn.o_proj.bias", (d,))
            sd[f"{p}.attn.sinks"] = src.take(f"{h}.self_attn.sinks", (H,))  # [n_heads]
            sd.update(_take_experts(src, cfg, f"{h}.mlp", f"{p}.mlp", quantised))
        sd["ln_final.w"] = src.take("model.norm.weight", (d,))
        tied = ConfigReader(hf).flag("tie_word_embeddings", default=False)
        sd["unembed.W_U"] = take_unembedding(src, folder, sd["embed.W_E"], tied)
        sd["unembed.b_U"] = torch.zeros(cfg.d_vocab, dtype=dtype)
        src.finish()
        return cfg, sd, dict(src.where), src.files


def _take_experts(src: _Shards, cfg: ModelConfig, h: str, p: str, quantised: bool) -> State:
    E, d, m = cfg.num_experts or 0, cfg.d_model, cfg.d_mlp or 0
    sd: State = {
        f"{p}.W_router": src.take(f"{h}.router.weight", (E, d), _T),  # [d_model, n_experts]
        f"{p}.b_router": src.take(f"{h}.router.bias", (E,)),
        f"{p}.b_gate": src.take(f"{h}.experts.gate_up_proj_bias", (E, 2 * m), lambda b: b[:, 0::2]),
        f"{p}.b_in": src.take(f"{h}.experts.gate_up_proj_bias", (E, 2 * m), lambda b: b[:, 1::2]),
        f"{p}.b_out": src.take(f"{h}.experts.down_proj_bias", (E, d)),
    }
    if not quantised:  # [E, d, 2 d_mlp], already x @ W; gate and up interleaved
        sd[f"{p}.W_gate"] = src.take(f"{h}.experts.gate_up_proj", (E, d, 2 * m), lambda W: W[:, :, 0::2])
        sd[f"{p}.W_in"] = src.take(f"{h}.experts.gate_up_proj", (E, d, 2 * m), lambda W: W[:, :, 1::2])
        sd[f"{p}.W_out"] = src.take(f"{h}.experts.down_proj", (E, m, d))  # [E, d_mlp, d_model]
        return sd
    if d % BLOCK or m % BLOCK:
        raise CheckpointError(f"{h}: MXFP4 experts need d_model and d_mlp divisible by {BLOCK}, got {d} and {m}")
    gate_up = _mxfp4(src, f"{h}.experts.gate_up_proj", E, 2 * m, d)  # [E, d, 2 d_mlp]
    sd[f"{p}.W_gate"], sd[f"{p}.W_in"] = gate_up[:, :, 0::2].contiguous(), gate_up[:, :, 1::2].contiguous()
    del gate_up
    sd[f"{p}.W_out"] = _mxfp4(src, f"{h}.experts.down_proj", E, d, m)  # [E, d_mlp, d_model]
    return sd


def _mxfp4(src: _Shards, name: str, E: int, d_out: int, d_in: int) -> torch.Tensor:
    """An MXFP4 expert projection stored [E, d_out, d_in / 32, 16] + scales, as x @ W: [E, d_in, d_out]."""
    groups = d_in // BLOCK
    blocks = src.take(f"{name}_blocks", (E, d_out, groups, BLOCK // 2), dtype=torch.uint8)
    scales = src.take(f"{name}_scales", (E, d_out, groups), dtype=torch.uint8)
    out = torch.empty(E, d_in, d_out, dtype=src.dtype)
    for e in range(E):  # one expert at a time: the peak is one expert's float copy beside the result
        out[e] = dequantize_mxfp4(blocks[e], scales[e], src.dtype).T
    return out
