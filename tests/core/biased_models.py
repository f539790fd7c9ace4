"""Shared fixtures of the path, composition and ablation tests: small float64 models with random biases and LayerNorm
weights."""

import torch

from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model


def small_model(n_layers=2, ln=None, pos="shortformer", mlp=False, bias=True, seed=0, parallel=False, n_ctx=32, **kw):
    cfg = ModelConfig(
        n_layers=n_layers,
        d_model=24,
        n_heads=3,
        d_head=6,
        d_vocab=40,
        n_ctx=n_ctx,
        attn_only=not mlp,
        d_mlp=32 if mlp else None,
        act_fn="gelu_new" if mlp else None,
        normalization_type=ln,
        positional_embedding_type=pos,
        use_bias=bias,
        parallel_attn_mlp=parallel,
        **kw,
    )
    model = random_model(cfg, seed=seed, dtype=torch.float64, std_embed=0.5)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf.startswith("b") or leaf == "b":
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif leaf == "w":
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def tokens_for(model, n=10, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.d_vocab, (n,), generator=gen)
