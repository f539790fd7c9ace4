"""Mixture-of-experts layers in the frozen path expansion (float64): routing frozen per token, one source per expert
a token used, and each expert's terms against a forward pass with that expert removed.

Configurations: gpt-oss's (sinks, biases, clamped SwiGLU, softmax over the top-k logits) and Mixtral's / OLMoE's
(no biases, SwiGLU, top-k of the full softmax), on rotary positions with grouped-query heads."""

from __future__ import annotations

import pytest
import torch

from circuits_core.formats.statedict import build_model
from circuits_core.model.config import ModelConfig
from circuits_core.model.hooks import Frozen
from circuits_core.model.transformer import Transformer, random_model
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.paths import expand_logits

F64 = torch.float64
BASE = dict(n_layers=3, d_model=16, n_heads=4, d_head=4, d_vocab=29, n_ctx=16, d_mlp=12, attn_only=False,
            normalization_type="RMS", positional_embedding_type="rotary", act_fn="silu", gated_mlp=True,
            n_key_value_heads=2, num_experts=5, experts_per_token=2)  # fmt: skip
CONFIGS = {
    "gpt-oss": ModelConfig(**BASE, use_bias=True, attn_sinks=True, clamped_swiglu=True, swiglu_limit=1.5),
    "olmoe": ModelConfig(**BASE, moe_norm_topk=False),
}
TOKENS = torch.randint(0, 29, (11,), generator=torch.Generator().manual_seed(2))


def _model(name: str) -> Transformer:
    model = random_model(CONFIGS[name], seed=4, dtype=F64, std_embed=1.0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith((".w", ".sinks")) or ".b_" in key:
                p.add_(0.5 * torch.randn(p.shape, generator=gen, dtype=F64))
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_expert_terms_equal_removing_the_expert(name: str) -> None:
    """All the terms that start at expert e of layer l sum to the logit difference that removing e makes (its W_out
    and b_out zeroed), with the patterns, norm scales and routing frozen and the later MLPs' outputs frozen, as the
    expansion freezes them."""
    model = _model(name)
    target = (3, 8)
    run = frozen_run(model, TOKENS)
    full = expand_logits(model, TOKENS, target, positions=None, max_order=model.cfg.n_layers, run=run)
    logits = model(TOKENS[None])[0]
    actual = logits[:, 3] - logits[:, 8]
    assert (full.values.sum(0) - actual).abs().max() < 1e-9 * max(1.0, float(actual.abs().max()))
    _, cache = model.run(
        TOKENS[None], names=lambda n: n.endswith(("hook_pattern", "hook_scale", "hook_mlp_out")) or "hook_expert_" in n
    )
    routes = {
        layer: (cache[f"blocks.{layer}.mlp.hook_expert_indices"], cache[f"blocks.{layer}.mlp.hook_expert_weights"])
        for layer in range(model.cfg.n_layers)
    }
    checked = 0
    for layer in range(model.cfg.n_layers - 1):
        used = sorted({int(e) for e in routes[layer][0].flatten()})
        assert [p[0] for p in full.paths if len(p) == 1 and p[0].startswith(f"mlp:L{layer}.")] == [
            f"mlp:L{layer}.e{e}" for e in used
        ]  # one source per expert some token chose, named by it
        for e in used[:2]:
            state = {k: v.clone() for k, v in model.state_dict().items()}
            state[f"blocks.{layer}.mlp.W_out"][e] = 0
            if model.cfg.use_bias:
                state[f"blocks.{layer}.mlp.b_out"][e] = 0
            removed = build_model(model.cfg, state, F64, "expert removed")
            frozen = Frozen(
                patterns={k: v for k, v in cache.items() if k.endswith("hook_pattern")},
                ln_scales={k: v for k, v in cache.items() if k.endswith("hook_scale")},
                mlp_out={
                    later: cache[f"blocks.{later}.hook_mlp_out"] for later in range(layer + 1, model.cfg.n_layers)
                },
                routes=routes,
            )
            out = removed.run(TOKENS[None], frozen=frozen)[0][0]
            drop = actual - (out[:, 3] - out[:, 8])
            terms = sum(full.values[i] for i, p in enumerate(full.paths) if p and p[0] == f"mlp:L{layer}.e{e}")
            assert isinstance(terms, torch.Tensor) and drop.abs().max() > 1e-3
            assert (terms - drop).abs().max() < 1e-9
            checked += 1
    assert checked >= 2


def test_the_router_weights_follow_each_family_rule() -> None:
    """Softmax over the chosen logits (gpt-oss, Mixtral) vs the chosen entries of the full softmax (OLMoE), by hand."""
    for name, norm in (("gpt-oss", True), ("olmoe", False)):
        model = _model(name)
        _, cache = model.run(TOKENS[None], names=lambda n: "hook_router_logits" in n or "hook_expert_" in n)
        logits = cache["blocks.1.mlp.hook_router_logits"][0]  # [n, E]
        idx, w = cache["blocks.1.mlp.hook_expert_indices"][0], cache["blocks.1.mlp.hook_expert_weights"][0]
        assert torch.equal(idx.sort(-1).values, logits.argsort(-1, descending=True)[:, :2].sort(-1).values)
        full = logits.softmax(-1).gather(-1, idx)
        expected = full / full.sum(-1, keepdim=True) if norm else full
        assert (w - expected).abs().max() < 1e-12
        assert (w.sum(-1) - 1).abs().max() < 1e-12 if norm else (w.sum(-1) < 1 - 1e-3).all()
