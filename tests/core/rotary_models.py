"""Small float64 rotary models for the rotary-circuit tests: both layouts, partial rotary, rope scaling, GQA."""

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
}


def rotary_model(seed=0, n_layers=2, **overrides):
    """A Llama-shaped model (RMS norms with random gains, gated MLPs, no biases) in float64."""
    fields = dict(
        n_layers=n_layers,
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
        use_bias=False,
    )
    fields.update(overrides)
    model = random_model(ModelConfig(**fields), seed=seed, dtype=torch.float64, std_embed=0.5)
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
