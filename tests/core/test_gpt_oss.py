"""gpt-oss checkpoints that transformers writes, against transformers' own eager forward pass, and the exact forms
qkov gives its learned sinks and its mixture of experts.

- Logits (≤ 1e-4, float32) and attention patterns (sinks included: rows that sum to less than 1) equal
  transformers' on a 2-layer model with grouped-query heads, attention biases, sinks, YaRN rope scaling and a
  top-2-of-4 mixture of clamped-SwiGLU experts; the same after processing (log-probs).
- Each knob matters: turning off the sinks, the clamp, the top-k softmax or YaRN in qkov's config moves the logits.
- Sink mass: 1 - row sum = sigmoid(b_h - LSE_j s_ij) from the scores, against transformers' patterns; with one key
  (position 0) the head attends with probability sigmoid(s_00 - b_h).
- MXFP4: qkov's dequantiser equals transformers' on random blocks, and a checkpoint whose experts are stored as
  MXFP4 blocks and scales gives the logits of transformers' model holding transformers' dequantised weights.
- Identities in float64: path terms sum to the logit (the value biases reach each position scaled by its row sum),
  QK path terms sum to the scores, factored OV circuits equal the dense product, frozen routing replays the run.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from circuits_core.circuits import sinks
from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.mxfp4 import dequantize_mxfp4
from circuits_core.formats.statedict import build_model
from circuits_core.model.hooks import Frozen
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.qk_paths import expand_scores
from tests.core.hf_families import TOKENS, N, assert_edit_refused, hf_model, hf_run, save

F64 = torch.float64
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 8, "truncate": False}  # fmt: skip
FIELDS = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 32,
    "head_dim": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32,
    "sliding_window": 6,
    "rope_parameters": YARN,
}  # fmt: skip (the window bites: 14 tokens)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    hf = hf_model("GptOssConfig", "GptOssForCausalLM", FIELDS, seed=11)
    with torch.no_grad():  # sinks around the scores' scale: rows from ~0 to ~1 of their mass kept on the keys
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 6.0, 4))
    return save(hf, tmp_path_factory.mktemp("gpt_oss") / "tiny"), hf


def _variant(model: Transformer, **changes: Any) -> Transformer:
    return build_model(dataclasses.replace(model.cfg, **changes), model.state_dict(), model.dtype, "variant")


def test_logits_and_patterns_equal_transformers(world: tuple[Path, Any]) -> None:
    folder, hf = world
    ref_logits, ref_patterns = hf_run(hf, TOKENS)
    loaded = load_checkpoint(folder, process=False)
    assert loaded.format == "gpt_oss" and loaded.model.cfg.attn_types == ("local", "global")
    logits, cache = loaded.model.run(TOKENS, names=lambda n: n.endswith("hook_pattern"))
    assert (logits - ref_logits).abs().max() <= 1e-4 and ref_logits.abs().max() > 1
    for layer, ref in enumerate(ref_patterns):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert (pattern - ref).abs().max() <= 1e-5
        rows = ref.sum(-1)
        assert rows.min() < 0.5 and (rows < 0.99).float().mean() > 0.5  # the sink keeps a visible share
    processed = load_checkpoint(folder).model
    assert processed.processing["fold_value_biases"] is False and "sinks" in str(
        processed.processing["fold_value_biases_skipped"]
    )
    err = (processed(TOKENS).log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max()
    assert err <= 1e-4


@pytest.mark.parametrize(
    "changes",
    [{"attn_sinks": False}, {"clamped_swiglu": False}, {"moe_norm_topk": False},
     {"rope_type": "default", "rope_factor": 1.0}, {"swiglu_limit": 0.5}, {"window_size": None, "attn_types": None}],
)  # fmt: skip
def test_each_knob_matters(world: tuple[Path, Any], changes: dict[str, Any]) -> None:
    folder, hf = world
    model = load_checkpoint(folder, process=False).model
    if "attn_sinks" in changes:
        state = {k: v for k, v in model.state_dict().items() if not k.endswith(".sinks")}
        variant = build_model(dataclasses.replace(model.cfg, **changes), state, model.dtype, "variant")
    else:
        variant = _variant(model, **changes)
    diff = (variant(TOKENS) - hf_run(hf, TOKENS)[0]).abs().max().item()
    assert diff > 1e-2, f"{changes} left the logits within {diff:.2e} of transformers"


def test_sink_mass_is_a_threshold_on_the_scores(world: tuple[Path, Any]) -> None:
    folder, hf = world
    model = load_checkpoint(folder, process=False, dtype=F64).model
    _, ref_patterns = hf_run(hf, TOKENS)
    _, cache = model.run(TOKENS, names=lambda n: n.endswith("hook_attn_scores"))
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    for layer in range(2):
        scores = cache[f"blocks.{layer}.attn.hook_attn_scores"].masked_fill(~causal, -math.inf)  # [b, h, q, k]
        b = model.blocks[layer].attn.sinks  # [h]
        kept = torch.sigmoid(scores.logsumexp(-1) - b[None, :, None])  # sigma(LSE_j s_ij - b_h)
        assert (kept - ref_patterns[layer].sum(-1).to(F64)).abs().max() < 1e-5
        one_key = torch.sigmoid(scores[..., 0, 0] - b[None])  # position 0 sees one key
        assert (one_key - ref_patterns[layer][..., 0, 0].to(F64)).abs().max() < 1e-5


def test_mxfp4_dequantiser_equals_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 4 * 32, 10]: transposed
    assert torch.equal(dequantize_mxfp4(blocks, scales).transpose(1, 2), ref)
    assert ref.abs().max() > 1 and (ref == 0).float().mean() < 0.2


def test_mxfp4_checkpoint_gives_transformers_logits(world: tuple[Path, Any], tmp_path: Path) -> None:
    """Experts stored as MXFP4 blocks + scales (as the released files): qkov dequantises them; transformers' model
    is given the weights its own dequantiser produces from the same bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder, hf = world
    state = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(9)
    E, d, m = 4, FIELDS["hidden_size"], FIELDS["intermediate_size"]
    with torch.no_grad():
        for layer in range(2):
            key = f"model.layers.{layer}.mlp.experts"
            for proj, d_out, d_in in (("gate_up_proj", 2 * m, d), ("down_proj", d, m)):
                blocks = torch.randint(0, 256, (E, d_out, d_in // 32, 16), generator=gen, dtype=torch.uint8)
                scales = torch.randint(120, 125, (E, d_out, d_in // 32), generator=gen, dtype=torch.uint8)
                del state[f"{key}.{proj}"]
                state[f"{key}.{proj}_blocks"], state[f"{key}.{proj}_scales"] = blocks, scales
                getattr(hf.model.layers[layer].mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    logits = load_checkpoint(out, process=False).model(TOKENS)
    ref = hf_run(hf, TOKENS)[0]
    assert (logits - ref).abs().max() <= 1e-4 * max(1.0, float(ref.abs().max()))
    bad = {**config, "quantization_config": {"quant_method": "fp8"}}
    (out / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="'fp8'"):
        load_checkpoint(out)


@pytest.mark.parametrize(
    ("edit", "message"),
    [({"attention_bias": False}, "attention_bias"), ({"layer_types": ["sliding_attention"]}, "layer_types"),
     ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'")],
)  # fmt: skip
def test_variants_qkov_cannot_honour_are_refused_by_name(
    world: tuple[Path, Any], tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    folder, _ = world
    assert_edit_refused(folder, tmp_path / "edited", edit, message)


@pytest.mark.parametrize("processed", [False, True])
def test_identities_in_float64(world: tuple[Path, Any], processed: bool) -> None:
    model = load_checkpoint(world[0], dtype=F64, process=processed).model
    tokens = TOKENS[0]
    logit = model(tokens[None])[0]
    run = frozen_run(model, tokens)
    full = expand_logits(model, tokens, target=(4, 9), positions=None, max_order=2, run=run)
    actual = logit[:, 4] - logit[:, 9]
    assert actual.abs().max() > 0.5
    assert (full.values.sum(0) - actual).abs().max() < 1e-9 * max(1.0, float(actual.abs().max()))
    assert full.term(("bias:L0",)).value.abs().max() > 1e-3  # the per-position value bias is really there
    _, cache = model.run(tokens[None], names={"blocks.1.attn.hook_attn_scores"})
    expansion = expand_scores(model, tokens, (1, 3), keep_terms=True)
    assert expansion.terms is not None
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    real = cache["blocks.1.attn.hook_attn_scores"][0, 3]
    assert (expansion.terms.sum((0, 1))[causal] - real[causal]).abs().max() < 1e-9


def test_frozen_routing_replays_the_run(world: tuple[Path, Any]) -> None:
    """Routes recorded on one run and replayed (Frozen.routes) give the same logits; the per-expert outputs sum to
    the MLP's output; replaying other routes changes the output (so the router really is bypassed)."""
    model = load_checkpoint(world[0], dtype=F64, process=False).model
    names = lambda n: "mlp.hook_expert" in n or n.endswith("hook_mlp_out")  # noqa: E731
    logits, cache = model.run(TOKENS, names=names)
    routes = {
        layer: (cache[f"blocks.{layer}.mlp.hook_expert_indices"], cache[f"blocks.{layer}.mlp.hook_expert_weights"])
        for layer in range(2)
    }
    replay, _ = model.run(TOKENS, frozen=Frozen(routes=routes))
    assert (replay - logits).abs().max() < 1e-12
    for layer in range(2):
        assert (
            cache[f"blocks.{layer}.mlp.hook_expert_out"].sum(2) - cache[f"blocks.{layer}.hook_mlp_out"]
        ).abs().max() < 1e-12
    shifted = {layer: ((idx + 1) % 4, w) for layer, (idx, w) in routes.items()}
    assert (model.run(TOKENS, frozen=Frozen(routes=shifted))[0] - logits).abs().max() > 1e-2


def test_sink_threshold_on_the_direct_path(world: tuple[Path, Any]) -> None:
    """Layer 0 reads the embeddings, so its real scores are the direct-path scores sinks.direct_scores gives (q/k
    biases and the rotation at each offset included; -inf beyond the local window), and a query with one key
    attends with sigma(s - b_h), as transformers' pattern at position 0 says."""
    folder, hf = world
    model = load_checkpoint(folder, dtype=F64).model  # processed: RMS weights folded into W_Q, W_K
    _, ref_patterns = hf_run(hf, TOKENS)
    _, cache = model.run(TOKENS, names={"blocks.0.attn.hook_attn_scores"})
    tokens = TOKENS[0]
    i, j = torch.tril_indices(N, N)
    for h in range(FIELDS["num_attention_heads"]):
        real = cache["blocks.0.attn.hook_attn_scores"][0, h, i, j]
        direct = torch.stack(
            [
                sinks.direct_scores(model, 0, h, tokens[a : a + 1], tokens[b : b + 1], int(a - b))[0]
                for a, b in zip(i, j, strict=True)
            ]
        )
        assert torch.equal(torch.isinf(direct), torch.isinf(real)) and torch.isinf(direct).any()  # the window
        finite = ~torch.isinf(real)
        assert (direct[finite] - real[finite]).abs().max() < 1e-12
        alone = sinks.attends_alone(model, 0, h, direct[0:1])  # (0, 0): the first query's only key
        assert abs(float(alone[0]) - float(ref_patterns[0][0, h, 0, 0])) < 1e-5
    mass = sinks.sink_mass(ref_patterns[1].to(F64))
    assert mass.min() > 0 and mass.max() < 1
