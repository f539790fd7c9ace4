"""BLOOM and MPT checkpoints that transformers writes, against transformers' eager forward pass; ALiBi's slopes.

Six heads (not a power of two): logits ≤ 1e-4 and patterns ≤ 1e-5 in
float32, processed log-probs too; the slopes equal transformers' own slope functions for 4, 6, 12 and 5 heads
(and the two rules coincide at MPT's default alibi_bias_max = 8); other slopes move the logits; in float64 the
path terms sum to the logit and the QK path terms plus the linear kernel -m_h (i - j) sum to the scores."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.statedict import build_model
from circuits_core.model.alibi import alibi_kernel, alibi_slopes
from circuits_core.model.config import ModelConfig
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.qk_paths import expand_scores
from tests.core.hf_families import TOKENS, N, assert_edit_refused, hf_model, hf_run, save

F64 = torch.float64
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bloom": ("BloomConfig", "BloomForCausalLM", {"hidden_size": 24, "n_head": 6, "n_layer": 2}),
    "mpt": ("MptConfig", "MptForCausalLM", {"d_model": 24, "n_heads": 6, "n_layers": 2, "max_seq_len": 32}),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("alibi_hf")
    out = {}
    for i, (name, (config, model, fields)) in enumerate(CASES.items()):
        hf = hf_model(config, model, fields, seed=40 + i)
        out[name] = (save(hf, root / name), hf)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_patterns_equal_transformers(world: dict[str, tuple[Path, Any]], name: str) -> None:
    folder, hf = world[name]
    ref_logits, ref_patterns = hf_run(hf, TOKENS)
    loaded = load_checkpoint(folder, process=False)
    assert loaded.format == name and loaded.model.cfg.alibi == name
    logits, cache = loaded.model.run(TOKENS, names=lambda n: n.endswith("hook_pattern"))
    assert (logits - ref_logits).abs().max() <= 1e-4 and ref_logits.abs().max() > 1
    for layer, ref in enumerate(ref_patterns):
        assert (cache[f"blocks.{layer}.attn.hook_pattern"] - ref).abs().max() <= 1e-5
    processed = load_checkpoint(folder).model
    assert (processed(TOKENS).log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max() <= 1e-4
    other = dataclasses.replace(loaded.model.cfg, alibi="mpt", alibi_bias_max=4.0)  # other slopes
    swapped = build_model(other, loaded.model.state_dict(), torch.float32, "x")
    assert (swapped(TOKENS) - ref_logits).abs().max() > 1e-2


@pytest.mark.parametrize("heads", [4, 6, 12, 5])
def test_slopes_follow_each_models_rule(heads: int) -> None:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    cfg = ModelConfig(n_layers=1, d_model=2 * heads, n_heads=heads, d_head=2, d_vocab=5, n_ctx=8,
                      positional_embedding_type="none", alibi="bloom")  # fmt: skip
    bloom = alibi_slopes(cfg)
    assert (bloom - _get_alibi_slopes(heads, torch.device("cpu")).to(F64)).abs().max() < 1e-7
    mpt = alibi_slopes(dataclasses.replace(cfg, alibi="mpt"))
    assert (mpt + build_mpt_alibi_tensor(heads, 2)[:, 0, 0].to(F64)).abs().max() < 1e-7  # (its j = 0 column: -m)
    # Measured: with MPT's default alibi_bias_max = 8 the two rules give the same slopes for every head count
    # tried, powers of two or not (MPT's interleaving of the next power of two's slopes reproduces BLOOM's odd
    # powers); they part as soon as alibi_bias_max differs from 8.
    assert (bloom - mpt).abs().max() < 1e-12
    steeper = alibi_slopes(dataclasses.replace(cfg, alibi="mpt", alibi_bias_max=16.0))
    assert (steeper - bloom).abs().max() > 1e-3
    kernel = alibi_kernel(cfg, 5)
    assert kernel[:, 4, 1].tolist() == pytest.approx((-3 * bloom).tolist())  # -m_h (i - j)


@pytest.mark.parametrize("name", list(CASES))
def test_identities_in_float64(world: dict[str, tuple[Path, Any]], name: str) -> None:
    model = load_checkpoint(world[name][0], dtype=F64).model
    tokens = TOKENS[0]
    logit = model(tokens[None])[0]
    full = expand_logits(model, tokens, target=(4, 9), positions=None, max_order=2)
    actual = logit[:, 4] - logit[:, 9]
    assert (full.values.sum(0) - actual).abs().max() < 1e-9 * max(1.0, float(actual.abs().max()))
    _, cache = model.run(tokens[None], names={"blocks.1.attn.hook_attn_scores"})
    exp = expand_scores(model, tokens, (1, 2), keep_terms=True)
    assert exp.terms is not None and exp.positional is not None
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    real = cache["blocks.1.attn.hook_attn_scores"][0, 2]
    assert ((exp.terms.sum((0, 1)) + exp.positional)[causal] - real[causal]).abs().max() < 1e-9
    assert exp.positional[causal].abs().max() > 0.1  # the kernel is really there


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [("bloom", {"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
     ("mpt", {"attn_config": {"alibi": False}}, "alibi"), ("mpt", {"attn_config": {"alibi": True, "clip_qkv": 6.0}}, "clip_qkv"),  # noqa: E501
     ("mpt", {"no_bias": False}, "no_bias")],
)  # fmt: skip
def test_variants_qkov_cannot_honour_are_refused_by_name(
    world: dict[str, tuple[Path, Any]], tmp_path: Path, name: str, edit: dict[str, Any], message: str
) -> None:
    folder = world[name][0]
    assert_edit_refused(folder, tmp_path / "edited", edit, message)
