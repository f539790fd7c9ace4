"""Mixtral, Qwen3-MoE and OLMoE checkpoints that transformers writes, against transformers' eager forward pass.

Each tiny model (2 layers, grouped-query heads, 4 experts, top-2) is built by transformers with every parameter
re-drawn (hf_families.randomise), saved with save_pretrained (one expert per nn.Linear, as the released files) and
loaded by qkov. Logits ≤ 1e-4 and patterns ≤ 1e-5 in float32; the router's normalisation matters (flipping
moe_norm_topk moves the logits); the path expansion, with routing frozen and one source per expert used, sums to
the logit in float64, and so do the QK path terms where the model has no QK-norm (Mixtral)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.statedict import build_model
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.qk_paths import expand_scores
from tests.core.hf_families import TOKENS, N, assert_edit_refused, hf_model, hf_run, save

F64 = torch.float64
BASE = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts_per_tok": 2, "max_position_embeddings": 64, "rope_parameters": {"rope_type": "default",
                                                                                      "rope_theta": 100.0}}  # fmt: skip
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**BASE, "num_local_experts": 4, "intermediate_size": 24}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**BASE, "num_experts": 4, "moe_intermediate_size": 24,
                                                            "intermediate_size": 40, "norm_topk_prob": True,
                                                            "head_dim": 8}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {**BASE, "num_experts": 4, "intermediate_size": 24,
                                                  "norm_topk_prob": False}),
}  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_hf")
    return {
        name: save(hf_model(config, model, fields, seed=30 + i), root / name)
        for i, (name, (config, model, fields)) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def references(world: dict[str, Path]) -> dict[str, Any]:
    """transformers' own models read back from the saved folders (what the released files give transformers)."""
    import transformers

    return {
        name: transformers.AutoModelForCausalLM.from_pretrained(world[name], attn_implementation="eager").eval()
        for name in CASES
    }


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_patterns_equal_transformers(world: dict[str, Path], references: dict[str, Any], name: str) -> None:
    folder = world[name]
    ref_logits, ref_patterns = hf_run(references[name], TOKENS)
    loaded = load_checkpoint(folder, process=False)
    assert loaded.format == name and loaded.model.cfg.num_experts == 4
    logits, cache = loaded.model.run(TOKENS, names=lambda n: n.endswith("hook_pattern"))
    assert (logits - ref_logits).abs().max() <= 1e-4 and ref_logits.abs().max() > 1
    for layer, ref in enumerate(ref_patterns):
        assert (cache[f"blocks.{layer}.attn.hook_pattern"] - ref).abs().max() <= 1e-5
    processed = load_checkpoint(folder).model
    assert (processed(TOKENS).log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max() <= 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_the_router_normalisation_matters(world: dict[str, Path], references: dict[str, Any], name: str) -> None:
    model = load_checkpoint(world[name], process=False).model
    flipped = build_model(
        dataclasses.replace(model.cfg, moe_norm_topk=not model.cfg.moe_norm_topk),
        model.state_dict(),
        model.dtype,
        "flipped",
    )
    diff = (flipped(TOKENS) - hf_run(references[name], TOKENS)[0]).abs().max().item()
    assert diff > 1e-2


@pytest.mark.parametrize("name", list(CASES))
def test_identities_in_float64(world: dict[str, Path], name: str) -> None:
    model = load_checkpoint(world[name], dtype=F64).model
    tokens = TOKENS[0]
    logit = model(tokens[None])[0]
    full = expand_logits(model, tokens, target=(4, 9), positions=None, max_order=2)
    actual = logit[:, 4] - logit[:, 9]
    assert (full.values.sum(0) - actual).abs().max() < 1e-9 * max(1.0, float(actual.abs().max()))
    assert any(p and p[0].startswith("mlp:L0.e") for p in full.paths)  # experts named as sources
    if model.cfg.qk_norm is None:
        _, cache = model.run(tokens[None], names={"blocks.1.attn.hook_attn_scores"})
        terms = expand_scores(model, tokens, (1, 2), keep_terms=True).terms
        assert terms is not None
        causal = torch.ones(N, N, dtype=torch.bool).tril()
        real = cache["blocks.1.attn.hook_attn_scores"][0, 2]
        assert (terms.sum((0, 1))[causal] - real[causal]).abs().max() < 1e-9


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"), ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),  # noqa: E501
     ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"), ("mixtral", {"attention_bias": True}, "attention_bias"),
     ("mixtral", {"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'")],
)  # fmt: skip
def test_variants_qkov_cannot_honour_are_refused_by_name(
    world: dict[str, Path], tmp_path: Path, name: str, edit: dict[str, Any], message: str
) -> None:
    folder = world[name]
    assert_edit_refused(folder, tmp_path / "edited", edit, message)
