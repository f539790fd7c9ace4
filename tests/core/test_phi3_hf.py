"""Phi-3 checkpoints that transformers writes, against transformers' eager forward pass: the fused qkv and gate/up
projections split on load (grouped-query heads so the q, k and v row blocks differ in size), a sliding window that
bites, logits ≤ 1e-4 and patterns ≤ 1e-5 in float32, the path expansion summing to the logit in float64, and the
variants qkov cannot honour refused by name."""

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
FIELDS = {"hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "sliding_window": 6, "pad_token_id": None,
          "eos_token_id": None, "bos_token_id": None, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}  # fmt: skip  # noqa: E501


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    hf = hf_model("Phi3Config", "Phi3ForCausalLM", FIELDS, seed=50)
    return save(hf, tmp_path_factory.mktemp("phi3") / "tiny"), hf


def test_logits_and_patterns_equal_transformers(world: tuple[Path, Any]) -> None:
    folder, hf = world
    ref_logits, ref_patterns = hf_run(hf, TOKENS)
    model = load_checkpoint(folder, process=False).model
    logits, cache = model.run(TOKENS, names=lambda n: n.endswith("hook_pattern"))
    assert (logits - ref_logits).abs().max() <= 1e-4 and ref_logits.abs().max() > 1
    for layer, ref in enumerate(ref_patterns):
        assert (cache[f"blocks.{layer}.attn.hook_pattern"] - ref).abs().max() <= 1e-5
    assert (load_checkpoint(folder).model(TOKENS).log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max() <= 1e-4
    unwindowed = build_model(dataclasses.replace(model.cfg, window_size=None), model.state_dict(), model.dtype, "x")
    assert (unwindowed(TOKENS) - ref_logits).abs().max() > 1e-2  # the window bites (6 of 14 tokens)


def test_identities_in_float64(world: tuple[Path, Any]) -> None:
    model = load_checkpoint(world[0], dtype=F64).model
    tokens = TOKENS[0]
    logit = model(tokens[None])[0]
    full = expand_logits(model, tokens, target=(4, 9), positions=None, max_order=2)
    actual = logit[:, 4] - logit[:, 9]
    assert (full.values.sum(0) - actual).abs().max() < 1e-9 * max(1.0, float(actual.abs().max()))
    _, cache = model.run(tokens[None], names={"blocks.1.attn.hook_attn_scores"})
    terms = expand_scores(model, tokens, (1, 3), keep_terms=True).terms
    assert terms is not None
    seen = ~torch.isinf(cache["blocks.1.attn.hook_attn_scores"][0, 3])  # causal and within the window
    assert (terms.sum((0, 1))[seen] - cache["blocks.1.attn.hook_attn_scores"][0, 3][seen]).abs().max() < 1e-9
    assert seen.sum() < N * (N + 1) // 2


@pytest.mark.parametrize(
    ("edit", "message"),
    [({"rope_parameters": {"rope_type": "longrope", "rope_theta": 100.0}}, "'longrope'"),
     ({"rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.75}}, "partial_rotary_factor"),  # noqa: E501
     ({"attention_bias": True}, "attention_bias")],
)  # fmt: skip
def test_variants_qkov_cannot_honour_are_refused_by_name(
    world: tuple[Path, Any], tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    folder, _ = world
    assert_edit_refused(folder, tmp_path / "edited", edit, message)
