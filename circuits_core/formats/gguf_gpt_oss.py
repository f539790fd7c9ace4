"""gpt-oss GGUF files ("gpt-oss", as llama.cpp's converter writes them, MXFP4 experts included): the fields and
tensors that gpt-oss adds to the Llama layout of gguf.py.

    gpt-oss.attention.sliding_window        -> window_size on the even layers (llama.cpp's swa pattern 2, and
                                               transformers' default layer_types: layer 0 slides, layer 1 does not)
    gpt-oss.rope.scaling.type "yarn", .factor, .original_context_length -> rope_type "yarn" (rope_scaling.py's
                                               fields: the attention factor 0.1 ln(factor) + 1 in attn_scale)
    blk.l.attn_sinks.weight [n_heads]       -> attn.sinks (learned per-head sinks)
    blk.l.attn_q/k/v/output.bias            -> b_Q, _b_K, _b_V, b_O
    blk.l.post_attention_norm.weight        -> ln2.w (the MLP's pre-norm; gpt-oss files have no ffn_norm)
    blk.l.ffn_gate_inp.bias [E]             -> mlp.b_router
    blk.l.ffn_gate_exps/ffn_up_exps.bias [E, d_mlp], ffn_down_exps.bias [E, d_model] -> b_gate, b_in, b_out
The converter splits transformers' interleaved gate_up_proj into ffn_gate_exps and ffn_up_exps and stores the
experts as MXFP4 (gguf_quants.py decodes it). Experts are gpt-oss's clamped SwiGLU with alpha 1.702 and limit 7
(constants of the architecture in llama.cpp and transformers, not in the file). Values a file does not carry come
from GPT_OSS_SOURCES, each with its source, and the model page lists them. Refused by name: rope scaling other
than YaRN.
"""

from __future__ import annotations

import math
from typing import Any

from circuits_core.errors import CheckpointError
from circuits_core.formats.gguf_tensors import Metadata, Tensors
from circuits_core.model.rope import yarn_attention_factor

State = dict[str, Any]
GPT_OSS_SOURCES = {
    "rope_truncate": "YaRN's correction range is not rounded to whole dims: transformers GptOssConfig "
    "(rope_parameters truncate=False), as every released gpt-oss config.json says",
    "rope_beta_fast": "YaRN beta_fast 32: transformers' default and gpt-oss's config.json",
    "rope_beta_slow": "YaRN beta_slow 1: transformers' default and gpt-oss's config.json",
}


def gpt_oss_fields(meta: Metadata, arch: str, n_layers: int, d_head: int) -> tuple[dict[str, Any], list[Any]]:
    """(ModelConfig fields, [(field, value, source)] defaulted) of a gpt-oss file."""
    window = meta.int(f"{arch}.attention.sliding_window")
    fields: dict[str, Any] = {
        "attn_sinks": True, "clamped_swiglu": True, "window_size": window,
        "attn_types": tuple("local" if layer % 2 == 0 else "global" for layer in range(n_layers)),
    }  # fmt: skip
    defaulted: list[Any] = []
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "yarn":
        factor = meta.float(f"{arch}.rope.scaling.factor")
        attention = meta.float(f"{arch}.rope.scaling.yarn_attn_factor", yarn_attention_factor(factor))
        fields |= {
            "rope_type": "yarn", "rope_factor": factor, "attn_scale": math.sqrt(d_head) / attention**2,
            "rope_original_max_position_embeddings": meta.int(f"{arch}.rope.scaling.original_context_length"),
            "rope_truncate": False, "rope_beta_fast": 32.0, "rope_beta_slow": 1.0,
        }  # fmt: skip
        for name in ("rope_beta_fast", "rope_beta_slow"):
            key = f"{arch}.rope.scaling.yarn_{name.removeprefix('rope_')}"
            if meta.header.has(key):
                fields[name] = meta.float(key)
        defaulted = [
            (name, fields[name], source)
            for name, source in GPT_OSS_SOURCES.items()
            if not meta.header.has(f"{arch}.rope.scaling.yarn_{name.removeprefix('rope_')}")
        ]
    elif scaling != "none":
        raise CheckpointError(f"{meta.name}: rope scaling type {scaling!r} is not supported for gpt-oss (yarn only)")
    return fields, defaulted


def take_gpt_oss_extras(
    tensors: Tensors, b: str, p: str, H: int, n_experts: int, d: int, d_mlp: int, sd: State
) -> None:
    """Layer `b`'s sinks, output bias, router bias and expert biases (the q/k/v biases are read by gguf.py)."""
    E, m = n_experts, d_mlp
    sd[f"{p}.attn.sinks"] = tensors.need(f"{b}.attn_sinks.weight", (H,))  # [n_heads]
    sd[f"{p}.attn.b_O"] = tensors.need(f"{b}.attn_output.bias", (d,))
    sd[f"{p}.mlp.b_router"] = tensors.need(f"{b}.ffn_gate_inp.bias", (E,))
    sd[f"{p}.mlp.b_gate"] = tensors.need(f"{b}.ffn_gate_exps.bias", (E, m))
    sd[f"{p}.mlp.b_in"] = tensors.need(f"{b}.ffn_up_exps.bias", (E, m))
    sd[f"{p}.mlp.b_out"] = tensors.need(f"{b}.ffn_down_exps.bias", (E, d))
