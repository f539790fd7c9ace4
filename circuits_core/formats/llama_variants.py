"""Hugging Face Gemma 2, Gemma 3 (text), Qwen3, OLMo 2 and OLMo 3 checkpoints: Llama's layout with the newest attention.

Each is read as the Llama loader reads its family (llama.py: sharded safetensors, memory-mapped, each tensor
converted to the compute dtype and laid out in one copy) with what the family adds (model_type -> what it sets):
- gemma2: query_pre_attn_scalar (scores divided by its square root), attn_logit_softcapping and
  final_logit_softcapping (soft caps), sliding_window on the layers `layer_types` names sliding_attention,
  sandwich norms (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
  post_feedforward_layernorm), GeGLU (hidden_activation, tanh GELU), the embedding multiplied by sqrt(hidden_size)
  and norm gains applied as (1 + w). The last two are loader conventions, as in TransformerLens: W_E is stored
  scaled, each gain as 1 + w.
- gemma3_text (and the text tower of a gemma3 checkpoint: `text_config`, tensors
  `language_model.model.*` or `model.language_model.*`): Gemma 2's
  layout without the attention cap, plus per-head QK-norm (self_attn.q_norm / k_norm, (1 + w) gains) and a rope
  per layer type (rope_parameters.sliding_attention / full_attention, or the older rope_local_base_freq +
  rope_theta + rope_scaling + sliding_window_pattern): local layers plain rope at their own base, global layers
  the configured scaling (linear on the larger models).
- qwen3: per-head QK-norm (gains as stored), a sliding window on the layers from max_window_layers on when
  use_sliding_window is set.
- olmo2: QK-norm over all heads of a layer (q_norm [heads * head_dim]), output norms only
  (post_attention_layernorm, post_feedforward_layernorm): Q, K, V and the MLP read the raw residual stream.
- olmo3: OLMo 2 plus sliding windows on the layers `layer_types` names, with a rope per layer type.
What qkov cannot honour is refused by name (CheckpointError naming the field): a rope type other than default /
linear / llama3 (on local layers: default only), bidirectional attention, Gemma 3's attn_logit_softcapping (which
transformers' Gemma 3 never applies), a layer type other than sliding_attention / full_attention, and newer
layouts transformers describes (Gemma 4's per-layer-type head dims, Qwen3.5's linear-attention layers) by
model_type.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError
from circuits_core.formats.hf import _act_fn, _bos, _config
from circuits_core.formats.llama import (
    Loaded,
    _Shards,
    head_shape,
    rope_fields,
    single_threaded,
    take_gated_mlp,
    take_projections,
    take_unembedding,
)
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader

State = dict[str, Tensor]
VARIANT_MODEL_TYPES = ("gemma2", "gemma3_text", "gemma3", "qwen3", "olmo2", "olmo3")
# Newer layouts transformers describes that qkov does not run yet, each with what it would need.
REFUSED_MODEL_TYPES = {
    "gemma4": "per-layer-type head dims (global_head_dim) and per-layer inputs",
    "gemma4_text": "per-layer-type head dims (global_head_dim) and per-layer inputs",
    "qwen3_5": "linear-attention (Gated DeltaNet) layers",
    "qwen3_5_text": "linear-attention (Gated DeltaNet) layers",
    "qwen3_next": "linear-attention (Gated DeltaNet) layers and mixture-of-experts MLPs",
    "gemma3n": "per-layer embeddings, AltUp and laurel blocks",
}
LAYER_TYPES = {"full_attention": "global", "sliding_attention": "local"}


def refuse_newer_layout(model_type: str) -> None:
    """Raise CheckpointError naming `model_type` and what qkov would need for it, when it is one of
    REFUSED_MODEL_TYPES (the folder's detection and the variant loader both ask)."""
    if model_type in REFUSED_MODEL_TYPES:
        raise CheckpointError(
            f"config.json: model_type {model_type!r} is not supported yet: {REFUSED_MODEL_TYPES[model_type]}"
        )


_GEMMA = ("gemma2", "gemma3_text")
_OLMO = ("olmo2", "olmo3")


# Where a gemma3 checkpoint keeps its text tower: (decoder prefix, lm_head name), as transformers 5 names them and as
# the checkpoints on the Hub (and transformers' save_pretrained) store them.
GEMMA3_TOWERS = (
    ("language_model.model.", "language_model.lm_head.weight"),
    ("model.language_model.", "lm_head.weight"),
)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: a gemma3 checkpoint's text tower (`text_config`), else the config itself."""
    if hf.get("model_type") == "gemma3":
        return {"model_type": "gemma3_text", **ConfigReader(hf).section("text_config").data}
    return hf


def _rope(r: ConfigReader, model_type: str) -> dict[str, Any]:
    """Rope fields: one rope for every layer, or (Gemma 3, OLMo 3) one per layer type, where local layers must rotate
    by plain rope (their base becomes rotary_base_local)."""
    params = r.section("rope_parameters")
    global_default = 1_000_000.0 if model_type == "gemma3_text" else 10_000.0
    if params.has("full_attention") or params.has("sliding_attention"):
        full = rope_fields(r, params.section("full_attention"), global_default)
        local_fields = rope_fields(r, params.section("sliding_attention"), 10_000.0)
    elif model_type == "gemma3_text":  # the older Gemma 3 configs on the Hub
        full = rope_fields(r, r.section("rope_scaling") if r.has("rope_scaling") else r, global_default)
        local_fields = {"rotary_base": r.number("rope_local_base_freq", default=10_000.0, gt=0), "rope_type": "default"}
    else:
        return rope_fields(r, params if r.has("rope_parameters") else r.section("rope_scaling"))
    if local_fields["rope_type"] != "default":
        raise CheckpointError(
            f"config.json: rope_parameters.sliding_attention.rope_type {local_fields['rope_type']!r} is not "
            "supported: local layers rotate by plain rope (default)"
        )
    return {**full, "rotary_base_local": local_fields["rotary_base"]}


def _attn_types(r: ConfigReader, model_type: str, n_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(window_size, attn_types) from layer_types / sliding_window (and each family's defaults when absent)."""
    window = r.integer("sliding_window", default=None, ge=1)
    if model_type == "qwen3" and not r.flag("use_sliding_window", default=False):
        window = None
    raw = r.data.get("layer_types")
    if raw is None:
        if model_type == "gemma2":
            raw = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
        elif model_type == "gemma3_text":
            every = r.integer("sliding_window_pattern", default=6, ge=1)
            raw = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
        elif model_type == "olmo3":
            raw = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n_layers)]
        elif model_type == "qwen3" and window is not None:
            first = r.integer("max_window_layers", default=n_layers, ge=0)
            raw = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        else:
            raw = ["full_attention"] * n_layers
    if not isinstance(raw, list) or len(raw) != n_layers:
        raise CheckpointError(f"config.json: field layer_types must list one type per layer ({n_layers})")
    unknown = sorted({str(t) for t in raw} - set(LAYER_TYPES))
    if unknown:
        raise CheckpointError(
            f"config.json: field layer_types: layer type {unknown[0]!r} is not supported "
            f"(supported: {', '.join(LAYER_TYPES)})"
        )
    types = tuple(LAYER_TYPES[t] for t in raw)
    if "local" not in types:
        return None, None
    if window is None:
        raise CheckpointError("config.json: layer_types names sliding_attention layers but sliding_window is not set")
    return window, types


def _refuse_unhonoured(r: ConfigReader, model_type: str) -> None:
    if r.flag("use_bidirectional_attention", default=False):
        raise CheckpointError("config.json: use_bidirectional_attention=true is not supported (qkov is causal)")
    if model_type == "gemma3_text" and r.has("attn_logit_softcapping"):
        raise CheckpointError(
            "config.json: attn_logit_softcapping is set, but transformers' Gemma 3 never applies it: refused rather "
            "than run a cap the model does not have"
        )
    if model_type not in _GEMMA and (r.has("attn_logit_softcapping") or r.has("final_logit_softcapping")):
        raise CheckpointError(f"config.json: soft-capping is not part of {model_type}: refused")
    if r.flag("mlp_bias", default=False):
        raise CheckpointError(
            "config.json: mlp_bias=true is not supported (the gated MLP has one bias, after the gate)"
        )


def variant_config(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a Gemma 2/3, Qwen3 or OLMo 2/3 config.json (refusing what the model does not implement)."""
    path = Path("config.json")
    model_type = ConfigReader(hf, path.name).text("model_type")
    refuse_newer_layout(model_type)
    if model_type not in VARIANT_MODEL_TYPES:
        raise CheckpointError(f"config.json: model_type {model_type!r} is not one of {', '.join(VARIANT_MODEL_TYPES)}")
    text = text_config(hf)
    if model_type == "gemma3" and text.get("final_logit_softcapping") is not None:
        raise CheckpointError(
            "config.json: text_config.final_logit_softcapping is set, but transformers' Gemma 3 image-text model "
            "never applies it: refused rather than run a cap the model does not have"
        )
    r = ConfigReader(text, path.name, "text_config." if model_type == "gemma3" else "")
    model_type = text["model_type"]
    _refuse_unhonoured(r, model_type)
    d, n_heads, n_kv, dh = head_shape(r)
    n_layers, d_vocab = r.integer("num_hidden_layers", ge=0), r.integer("vocab_size", ge=1)
    window, attn_types = _attn_types(r, model_type, n_layers)
    gemma, olmo = model_type in _GEMMA, model_type in _OLMO
    scalar = r.number("query_pre_attn_scalar", default=None, gt=0) if gemma else None
    return _config(
        path, n_layers=n_layers, d_model=d, n_heads=n_heads, d_head=dh, d_vocab=d_vocab,
        n_ctx=r.integer("max_position_embeddings", ge=1), d_mlp=r.integer("intermediate_size", ge=1),
        attn_only=False, normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
        act_fn=_act_fn(r, "hidden_activation" if gemma else "hidden_act", "gelu_pytorch_tanh" if gemma else "silu"),
        eps=r.number("rms_norm_eps", default=1e-6, gt=0), use_bias=r.flag("attention_bias", default=False),
        n_key_value_heads=n_kv if n_kv != n_heads else None, rotary_dim=dh, bos_token_id=_bos(r, d_vocab),
        attn_scale=math.sqrt(scalar) if scalar is not None else None,
        qk_norm="layer" if olmo else None if model_type == "gemma2" else "head",
        attn_scores_soft_cap=r.number("attn_logit_softcapping", default=None, gt=0) if gemma else None,
        output_logits_soft_cap=r.number("final_logit_softcapping", default=None, gt=0) if gemma else None,
        window_size=window, attn_types=attn_types, post_norms=gemma or olmo, pre_norms=not olmo,
        **_rope(r, model_type),
    )  # fmt: skip


@single_threaded
def load_variant(folder: Path, hf: dict[str, Any], dtype: torch.dtype) -> Loaded:
    """(config, TransformerLens state dict in `dtype`, tensor -> shard file, weight files)."""
    cfg = variant_config(hf)
    gemma = text_config(hf)["model_type"] in _GEMMA
    src = _Shards(folder, dtype)
    prefix, lm_head = "model.", "lm_head.weight"
    if hf.get("model_type") == "gemma3":  # the text tower; the vision tower and projector are not read
        prefix, lm_head = next(
            ((p, h) for p, h in GEMMA3_TOWERS if src.has(f"{p}embed_tokens.weight")), GEMMA3_TOWERS[0]
        )
        src.left = {k for k in src.left if k.startswith(prefix) or k == lm_head}
    d, H, G, dh, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_vocab
    d_mlp = cfg.d_mlp or 0

    def gain(key: str, shape: tuple[int, ...]) -> Tensor:
        """A norm gain as the model applies it: Gemma's files store w for a gain of (1 + w)."""
        w = src.take(key, shape)
        return w.add_(1.0) if gemma else w

    # Gemma scales the embedding by sqrt(d_model) (in the weights' dtype, as transformers does)
    embed_scale: Callable[[Tensor], Tensor] = lambda W: W  # noqa: E731
    if gemma:
        scale = torch.tensor(d**0.5, dtype=torch.float32).to(dtype)
        embed_scale = lambda W: W * scale  # noqa: E731
    W_E_raw = src.take(f"{prefix}embed_tokens.weight", (V, d))
    sd: State = {"embed.W_E": embed_scale(W_E_raw)}
    for layer in range(cfg.n_layers):
        h, p = f"{prefix}layers.{layer}", f"blocks.{layer}"
        if cfg.pre_norms:
            sd[f"{p}.ln1.w"] = gain(f"{h}.input_layernorm.weight", (d,))
            ln2 = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
            sd[f"{p}.ln2.w"] = gain(f"{h}.{ln2}.weight", (d,))
        if cfg.post_norms:
            sd[f"{p}.ln1_post.w"] = gain(f"{h}.post_attention_layernorm.weight", (d,))
            sd[f"{p}.ln2_post.w"] = gain(f"{h}.post_feedforward_layernorm.weight", (d,))
        take_projections(src, cfg, h, p, sd)
        if cfg.qk_norm is not None:
            size_q, size_k = (dh, dh) if cfg.qk_norm == "head" else (H * dh, G * dh)
            sd[f"{p}.attn.q_norm.w"] = gain(f"{h}.self_attn.q_norm.weight", (size_q,))
            sd[f"{p}.attn.k_norm.w"] = gain(f"{h}.self_attn.k_norm.weight", (size_k,))
        if cfg.use_bias:
            sd[f"{p}.attn.b_O"] = src.take(f"{h}.self_attn.o_proj.bias", (d,))
            sd[f"{p}.mlp.b_in"] = torch.zeros(d_mlp, dtype=dtype)
            sd[f"{p}.mlp.b_out"] = torch.zeros(d, dtype=dtype)
        take_gated_mlp(src, cfg, h, p, sd)
    sd["ln_final.w"] = gain(f"{prefix}norm.weight", (d,))
    tied = ConfigReader(hf).flag("tie_word_embeddings", default=gemma)
    sd["unembed.W_U"] = take_unembedding(src, folder, W_E_raw, tied, lm_head)  # the unscaled embedding
    if cfg.use_bias:
        sd["unembed.b_U"] = torch.zeros(V, dtype=dtype)
    src.finish()
    return cfg, sd, dict(src.where), src.files
