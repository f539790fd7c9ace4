"""Weight processing never changes what the model computes (float64), and each switch does what it records."""

from __future__ import annotations

import itertools

import pytest
import torch

from circuits_core.formats.processing import process_weights
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, random_model

POSITIONS = ("standard", "shortformer", "rotary", "none")


def _cfg(pos: str, norm: str | None, attn_only: bool, use_bias: bool, parallel: bool = False) -> ModelConfig:
    return ModelConfig(
        n_layers=2, d_model=12, n_heads=3, d_head=4, d_vocab=23, n_ctx=9,
        d_mlp=None if attn_only else 20, attn_only=attn_only, act_fn=None if attn_only else "gelu_new",
        normalization_type=norm, positional_embedding_type=pos, use_bias=use_bias,  # type: ignore[arg-type]
        parallel_attn_mlp=parallel, rotary_dim=2 if pos == "rotary" else None,
    )  # fmt: skip


def _model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Random float64 model whose biases and LN weights are non-zero too (zeros would hide folding bugs)."""
    model = random_model(cfg, seed=seed, dtype=torch.float64, std_embed=0.5)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "w":
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=gen, dtype=torch.float64))
            elif leaf == "b" or leaf.startswith("b_"):
                param.copy_(0.3 * torch.randn(param.shape, generator=gen, dtype=torch.float64))
    return model


def _tokens(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.d_vocab, (3, cfg.n_ctx), generator=torch.Generator().manual_seed(7))


def _run(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits, cache = model.run(tokens, names=lambda n: n.endswith("hook_pattern"))
    return logits.log_softmax(-1), cache


CASES = [
    (pos, norm, attn_only, use_bias)
    for pos, norm, attn_only, use_bias in itertools.product(POSITIONS, ("LN", None), (True, False), (True, False))
]


@pytest.mark.parametrize(("pos", "norm", "attn_only", "use_bias"), CASES)
def test_processing_keeps_log_probs_and_patterns(pos: str, norm: str | None, attn_only: bool, use_bias: bool) -> None:
    cfg = _cfg(pos, norm, attn_only, use_bias)
    model = _model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = _tokens(cfg)
    lp, cache = _run(model, tokens)
    processed = process_weights(model)
    lp2, cache2 = _run(processed, tokens)
    assert processed.dtype == torch.float64
    torch.testing.assert_close(lp2, lp, rtol=0, atol=1e-10)
    for key, pattern in cache.items():
        torch.testing.assert_close(cache2[key], pattern, rtol=0, atol=1e-10)
    # the input model is untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.cfg == cfg and model.processing == {}
    rec = processed.processing
    shortformer_ln = pos == "shortformer" and norm == "LN"
    assert rec["fold_ln"] is (not shortformer_ln)
    assert ("fold_ln_skipped" in rec) is shortformer_ln
    assert processed.cfg.normalization_type == (None if norm is None else "LN" if shortformer_ln else "LNPre")
    shortformer = pos == "shortformer"  # TransformerLens's from_pretrained choices: no centring either
    assert rec["center_writing_weights"] is (norm is not None and not shortformer)
    assert ("center_writing_weights_skipped" in rec) is (norm is None or shortformer)
    assert rec["center_unembed"] is (not shortformer) and ("center_unembed_skipped" in rec) is shortformer
    assert rec["fold_value_biases"] is True
    # post-conditions of each switch
    zero = torch.zeros((), dtype=torch.float64)
    if not shortformer:
        torch.testing.assert_close(processed.W_U.mean(-1).abs().max(), zero, rtol=0, atol=1e-12)
    if rec["center_writing_weights"]:
        torch.testing.assert_close(processed.W_E.mean(-1).abs().max(), zero, rtol=0, atol=1e-12)
        torch.testing.assert_close(processed.W_O.mean(-1).abs().max(), zero, rtol=0, atol=1e-12)
    if processed.cfg.use_bias:
        assert all(not b.attn.b_V.any() for b in processed.blocks)


def test_parallel_attn_mlp_with_ln() -> None:
    cfg = _cfg("rotary", "LN", attn_only=False, use_bias=True, parallel=True)
    model = _model(cfg, seed=3)
    tokens = _tokens(cfg)
    processed = process_weights(model)
    torch.testing.assert_close(_run(processed, tokens)[0], _run(model, tokens)[0], rtol=0, atol=1e-10)
    assert processed.cfg.normalization_type == "LNPre"


def test_fold_ln_adds_biases_only_when_needed() -> None:
    cfg = _cfg("standard", "LN", attn_only=False, use_bias=False)
    model = _model(cfg, seed=1)  # LN biases are random: folding them needs b_Q, b_in, b_U
    tokens = _tokens(cfg)
    folded = process_weights(model, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
    assert folded.cfg.use_bias and folded.cfg.normalization_type == "LNPre"
    torch.testing.assert_close(_run(folded, tokens)[0], _run(model, tokens)[0], rtol=0, atol=1e-10)
    # Raw logits (not only log-probs) are unchanged by fold_ln alone.
    torch.testing.assert_close(folded.run(tokens)[0], model.run(tokens)[0], rtol=0, atol=1e-10)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".b"):
                param.zero_()
    assert not process_weights(model).cfg.use_bias


def test_fold_ln_weights_match_hand_computation() -> None:
    """Layer 0's folded W_Q equals diag(ln1.w) W_Q centred over d_model; b_Q = b_Q + ln1.b W_Q."""
    cfg = _cfg("rotary", "LN", attn_only=True, use_bias=True)
    model = _model(cfg, seed=2)
    attn, ln = model.blocks[0].attn, model.blocks[0].ln1
    folded = process_weights(model, center_writing_weights=False, center_unembed=False, fold_value_biases=False)
    h = 1
    W = torch.diag(ln.w) @ attn.W_Q[h]  # [d_model, d_head]
    torch.testing.assert_close(folded.blocks[0].attn.W_Q[h], W - W.mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(folded.blocks[0].attn.b_Q[h], attn.b_Q[h] + ln.b @ attn.W_Q[h], rtol=0, atol=1e-12)


def test_skipped_switches_would_have_changed_the_output() -> None:
    """The skips are necessary: centring writers without LN, or folding ln1.w with shortformer, breaks log-probs."""
    tokens = _tokens(_cfg("none", None, True, False))
    model = _model(_cfg("standard", None, attn_only=True, use_bias=True))
    with torch.no_grad():
        naive = process_weights(model, fold_ln=False, center_unembed=False, fold_value_biases=False)
        naive.embed.W_E.sub_(naive.embed.W_E.mean(-1, keepdim=True))
    assert (_run(naive, tokens)[0] - _run(model, tokens)[0]).abs().max() > 1e-3
    short = _model(_cfg("shortformer", "LN", attn_only=True, use_bias=True))
    with torch.no_grad():
        scaled = process_weights(short, fold_ln=False, center_writing_weights=False, center_unembed=False)
        for block in scaled.blocks:  # fold ln1.w into W_Q only (what a naive fold would do)
            block.attn.W_Q.mul_(block.ln1.w[None, :, None])
            block.ln1.w.fill_(1.0)
    assert (_run(scaled, tokens)[0] - _run(short, tokens)[0]).abs().max() > 1e-3


def test_processing_is_idempotent_and_options() -> None:
    cfg = _cfg("standard", "LN", attn_only=False, use_bias=True)
    model = _model(cfg, seed=4)
    once = process_weights(model)
    twice = process_weights(once)
    for (k, v), (k2, v2) in zip(once.state_dict().items(), twice.state_dict().items(), strict=True):
        assert k == k2
        torch.testing.assert_close(v2, v, rtol=0, atol=1e-12)
    assert twice.processing == once.processing
    only_unembed = process_weights(
        model, fold_ln=False, center_writing_weights=False, center_unembed=True, fold_value_biases=False
    )
    assert only_unembed.processing == {
        "fold_ln": False, "center_writing_weights": False, "center_unembed": True, "fold_value_biases": False,
    }  # fmt: skip
    float32 = process_weights(random_model(cfg, dtype=torch.float32))
    assert float32.dtype == torch.float32 and not any(p.requires_grad for p in float32.parameters())
