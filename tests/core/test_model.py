"""The transformer itself: recorded vs fused LayerNorm, frozen runs, the causal mask, the cache names, the next-token
losses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from circuits_core.errors import InvalidInputError
from circuits_core.model import transformer
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Frozen, next_token_losses, random_model

CONFIGS = [
    ModelConfig(n_layers=2, d_model=16, n_heads=2, d_head=8, d_vocab=40, n_ctx=12, normalization_type=norm,
                positional_embedding_type=pos, attn_only=attn_only, d_mlp=None if attn_only else 32,
                act_fn=None if attn_only else "gelu_new", use_bias=True)
    for norm in ("LN", "LNPre", None)
    for pos in ("standard", "shortformer", "rotary")
    for attn_only in (True, False)
]  # fmt: skip


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"{c.normalization_type}-{c.positional_embedding_type}-{c.attn_only}"
)
def test_recording_and_freezing_do_not_change_the_logits(cfg: ModelConfig) -> None:
    """A run that records nothing (fused LayerNorm kernel) == one that records every activation (explicit
    LayerNorm maths) == a run with every pattern and LayerNorm scale frozen to the recorded values."""
    model = random_model(cfg, seed=3, dtype=torch.float64, std_embed=1.0)
    with torch.no_grad():
        for block in model.blocks:  # non-trivial LN weights and biases
            for ln in (block.ln1, getattr(block, "ln2", None)):
                if ln is not None and ln.has_weights:
                    ln.w.normal_(1.0, 0.3), ln.b.normal_(0.0, 0.3)
    tokens = torch.randint(0, cfg.d_vocab, (3, cfg.n_ctx), generator=torch.Generator().manual_seed(0))
    plain, nothing = model.run(tokens)
    recorded, cache = model.run(tokens, names=lambda name: True)
    assert nothing == {}
    torch.testing.assert_close(plain, recorded, rtol=0, atol=1e-12)
    frozen = Frozen(
        patterns={k: v for k, v in cache.items() if k.endswith("hook_pattern")},
        ln_scales={k: v for k, v in cache.items() if k.endswith("hook_scale")},
    )
    torch.testing.assert_close(model.run(tokens, frozen=frozen)[0], plain, rtol=0, atol=1e-12)
    for layer in range(cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]  # [batch, head, query, key]
        assert torch.triu(pattern, diagonal=1).abs().max() == 0  # causal: no key after its query
        torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern[..., 0]), rtol=0, atol=1e-12)
        assert f"blocks.{layer}.hook_resid_pre" in cache and f"blocks.{layer}.attn.hook_z" in cache
    if cfg.normalization_type is not None:
        assert "ln_final.hook_scale" in cache


@pytest.mark.parametrize(
    "cfg",
    [c for c in CONFIGS if not c.attn_only and c.normalization_type == "LN"],
    ids=lambda c: c.positional_embedding_type,
)
def test_run_until_stops_at_every_hook(cfg: ModelConfig) -> None:
    """run_until(stop_after=name) stops at every hook a full recording run fills, including those the layers' fast
    paths skip when nothing asks for them (LayerNorm hook_scale, the MLP's hook_pre, hook_result), with or without
    `names`; the stopped run's value equals the full run's (float64; to 1e-12: recording every hook takes the explicit
    LayerNorm maths, recording one the fused kernel)."""
    model = random_model(cfg, seed=4, dtype=torch.float64, std_embed=1.0)
    tokens = torch.randint(0, cfg.d_vocab, (2, cfg.n_ctx), generator=torch.Generator().manual_seed(1))
    _, cache = model.run(tokens, names=lambda name: True)
    assert {"blocks.0.ln1.hook_scale", "blocks.1.mlp.hook_pre", "blocks.1.attn.hook_result"} <= set(cache)
    for name, value in cache.items():
        assert model.run_until(tokens, name) == {}  # stops there: no "no hook" error after a full run
        torch.testing.assert_close(model.run_until(tokens, name, names=[name])[name], value, rtol=0, atol=1e-12)


def test_token_checks() -> None:
    model = random_model(CONFIGS[0])
    with pytest.raises(InvalidInputError, match="context"):
        model.run(torch.zeros(1, CONFIGS[0].n_ctx + 1, dtype=torch.long))
    with pytest.raises(InvalidInputError, match="vocab|token ids"):
        model.run(torch.tensor([[0, CONFIGS[0].d_vocab]]))


# positions per block of float64 rows of 40 logits: every position at once, 3 whole sequences (of 10 positions),
# 7 positions (a sequence in 2 blocks, the last shorter), one position
@pytest.mark.parametrize("rows", [100, 30, 7, 1])
def test_next_token_losses_in_blocks_are_those_of_the_whole_logits(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """next_token_losses, a block of positions at a time, == the cross-entropy of all the logits at once in float64
    (the same numbers: each row's log-softmax is its own) and == log-sum-exp minus the target's logit (float64)."""
    monkeypatch.setattr(transformer, "LOSS_BLOCK_BYTES", rows * 40 * 8)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, 40, generator=gen) * 4  # [b, n, V] float32
    tokens = torch.randint(0, 40, (7, 11), generator=gen)
    losses = next_token_losses(logits, tokens, torch.float64)  # [b, n - 1]
    whole = F.cross_entropy(logits[:, :-1].double().reshape(-1, 40), tokens[:, 1:].reshape(-1), reduction="none")
    assert losses.dtype == torch.float64 and torch.equal(losses, whole.view(7, 10))
    x = logits[:, :-1].double()  # [b, n - 1, V]
    target = x.gather(-1, tokens[:, 1:, None])[..., 0]  # [b, n - 1]
    torch.testing.assert_close(losses, x.logsumexp(-1) - target, rtol=0, atol=1e-12)
    plain = next_token_losses(logits, tokens)  # in the logits' dtype
    whole = F.cross_entropy(logits[:, :-1].reshape(-1, 40), tokens[:, 1:].reshape(-1), reduction="none")
    assert plain.dtype == torch.float32 and torch.equal(plain, whole.view(7, 10))
