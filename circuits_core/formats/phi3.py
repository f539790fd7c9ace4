"""Hugging Face Phi-3 checkpoints (`model_type: phi3`): the Llama layout with fused projections, split on load.

    self_attn.qkv_proj [(H + 2 G) d_head, d]: rows q (H heads), then k (G), then v (G)  -> W_Q, _W_K, _W_V
    mlp.gate_up_proj [2 d_mlp, d]: rows gate, then up                                  -> W_gate, W_in
o_proj, down_proj, the norms and the unembedding as the Llama family (llama.py, read tensor by tensor). A
`sliding_window` applies to every layer (transformers' Phi-3 masks every layer with it). Refused by name: rope
types rope_scaling.py does not read (the 128k models' longrope), partial rotary (Phi-4-mini), attention biases.
"""

from __future__ import annotations

from collections.abc import Callable
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
    _output_heads,
    _Shards,
    head_shape,
    single_threaded,
    take_unembedding,
)
from circuits_core.formats.rope_scaling import rope_fields, rope_section
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader
from circuits_core.model.transformer import attn_param


def phi3_config(hf: dict[str, Any]) -> ModelConfig:
    path = Path("config.json")
    r = ConfigReader(hf, path.name)
    if r.text("model_type") != "phi3":
        raise CheckpointError(f"{path.name}: model_type {hf.get('model_type')!r} is not phi3")
    if r.flag("attention_bias", default=False):
        raise CheckpointError(f"{path.name}: attention_bias=true is not supported for phi3")
    d, n_heads, n_kv, dh = head_shape(r)
    d_vocab = r.integer("vocab_size", ge=1)
    return _config(
        path, n_layers=r.integer("num_hidden_layers", ge=0), d_model=d, n_heads=n_heads, d_head=dh, d_vocab=d_vocab,
        n_ctx=r.integer("max_position_embeddings", ge=1), window_size=r.integer("sliding_window", default=None, ge=1),
        d_mlp=r.integer("intermediate_size", ge=1), attn_only=False, normalization_type="RMS",
        positional_embedding_type="rotary", gated_mlp=True, act_fn=_act_fn(r, "hidden_act", "silu"),
        eps=r.number("rms_norm_eps", default=1e-5, gt=0), n_key_value_heads=n_kv if n_kv != n_heads else None,
        rotary_dim=dh, bos_token_id=_bos(r, d_vocab), **rope_fields(r, rope_section(r), d_head=dh),
    )  # fmt: skip


def _heads_rows(start: int, heads: int, dh: int, d: int) -> Callable[[Tensor], Tensor]:
    """Rows [start d_head, (start + heads) d_head) of a fused projection as [heads, d_model, d_head]."""
    return lambda W: W[start * dh : (start + heads) * dh].view(heads, dh, d).transpose(1, 2)


@single_threaded
def load_phi3(folder: Path, hf: dict[str, Any], dtype: torch.dtype) -> Loaded:
    """(config, TransformerLens state dict in `dtype`, tensor -> shard file, weight files)."""
    cfg = phi3_config(hf)
    src = _Shards(folder, dtype)
    d, H, G, dh, m = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_mlp or 0
    sd: State = {"embed.W_E": src.take("model.embed_tokens.weight", (cfg.d_vocab, d))}
    rows = (H + 2 * G) * dh
    for layer in range(cfg.n_layers):
        h, p = f"model.layers.{layer}", f"blocks.{layer}"
        sd[f"{p}.ln1.w"] = src.take(f"{h}.input_layernorm.weight", (d,))
        sd[f"{p}.ln2.w"] = src.take(f"{h}.post_attention_layernorm.weight", (d,))
        qkv = f"{h}.self_attn.qkv_proj.weight"
        for x, start, heads in (("Q", 0, H), ("K", H, G), ("V", H + G, G)):  # row blocks [heads * d_head, d]
            sd[f"{p}.attn.{attn_param(cfg, 'W_' + x)}"] = src.take(qkv, (rows, d), _heads_rows(start, heads, dh, d))
        sd[f"{p}.attn.W_O"] = src.take(f"{h}.self_attn.o_proj.weight", (d, H * dh), _output_heads(H, dh, d))
        gate_up = f"{h}.mlp.gate_up_proj.weight"
        sd[f"{p}.mlp.W_gate"] = src.take(gate_up, (2 * m, d), lambda W: W[:m].T)  # [d_model, d_mlp]
        sd[f"{p}.mlp.W_in"] = src.take(gate_up, (2 * m, d), lambda W: W[m:].T)
        sd[f"{p}.mlp.W_out"] = src.take(f"{h}.mlp.down_proj.weight", (d, m), _T)
    sd["ln_final.w"] = src.take("model.norm.weight", (d,))
    tied = ConfigReader(hf).flag("tie_word_embeddings", default=False)
    sd["unembed.W_U"] = take_unembedding(src, folder, sd["embed.W_E"], tied)
    src.finish()
    return cfg, sd, dict(src.where), src.files
