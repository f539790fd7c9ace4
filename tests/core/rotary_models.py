"""Small float64 rotary models for the rotary-circuit tests: both layouts, partial rotary, rope scaling, GQA, and the
newest attention (QK-norm per head and per layer, soft caps, sliding windows with local/global rope, sandwich and
output-only norms)."""

import itertools

import torch

from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model

# name -> config overrides of `rotary_model` (each one differs from the default in what it tests)
CASES = {
    "half": {},
    "adjacent": dict(rotary_adjacent_pairs=True),
    "partial": dict(rotary_dim=4),
    "gqa": dict(n_key_value_heads=2),
    "gqa-adjacent-partial-linear": dict(
        n_key_value_heads=1, rotary_adjacent_pairs=True, rotary_dim=6, rope_type="linear", rope_factor=2.0
    ),
    "layernorm": dict(normalization_type="LN", gated_mlp=False, act_fn="gelu_new"),
    # Gemma 2: soft caps that bite, windows shorter than the prompts on alternate layers, sandwich norms, GQA,
    # query_pre_attn_scalar, GeGLU
    "gemma2": dict(
        n_key_value_heads=2, attn_scores_soft_cap=0.7, output_logits_soft_cap=1.5, window_size=4, attn_types="LG",
        post_norms=True, attn_scale=3.0, act_fn="gelu_new",
    ),
    # Gemma 3: per-head QK-norm, multi-query, 2 local layers (own rope base) per global one (linear scaling)
    "gemma3": dict(
        n_key_value_heads=1, qk_norm="head", window_size=3, attn_types="LLG", rotary_base_local=10.0,
        rope_type="linear", rope_factor=2.0, post_norms=True, act_fn="gelu_new",
    ),
    "qwen3": dict(n_key_value_heads=2, qk_norm="head"),
    # OLMo 2: QK-norm over the layer's heads, output norms only (the layers read the raw stream)
    "olmo2": dict(n_key_value_heads=2, qk_norm="layer", pre_norms=False, post_norms=True),
    # OLMo 3: OLMo 2 plus local layers (own rope base) with a window shorter than the prompts and global ones (3 local
    # per global in the real models; 2 here, so that a 3-layer test model has a global layer)
    "olmo3": dict(
        n_key_value_heads=2, qk_norm="layer", pre_norms=False, post_norms=True, window_size=3, attn_types="LLG",
        rotary_base_local=10.0,
    ),
}  # fmt: skip
NEWEST = ("gemma2", "gemma3", "qwen3", "olmo2", "olmo3")


def rotary_config(**overrides):
    """A Llama-shaped rotary config (RMS norms, gated SiLU MLP, rotary base 100), with `overrides`."""
    fields = dict(
        n_layers=2,
        d_model=16,
        n_heads=4,
        d_head=8,
        d_vocab=40,
        n_ctx=32,
        attn_only=False,
        d_mlp=24,
        gated_mlp=True,
        act_fn="silu",
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_base=100.0,
    )
    fields.update(overrides)
    if isinstance(fields.get("attn_types"), str):  # "LG": local, global, local, ... over the layers
        kinds = {"L": "local", "G": "global"}
        fields["attn_types"] = tuple(
            kinds[c] for c in itertools.islice(itertools.cycle(fields["attn_types"]), fields["n_layers"])
        )
    return ModelConfig(**fields)


def rotary_model(seed=0, n_layers=2, **overrides):
    """A Llama-shaped model (RMS norms with random gains, gated MLPs, no biases) in float64."""
    cfg = rotary_config(n_layers=n_layers, use_bias=False, **overrides)
    model = random_model(cfg, seed=seed, dtype=torch.float64, std_embed=0.5)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "w":
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif leaf == "b":
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def tokens_for(model, n=12, seed=1, batch=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.d_vocab, (batch, n), generator=gen)
