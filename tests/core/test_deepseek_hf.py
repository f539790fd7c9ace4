"""DeepSeek-V2 and DeepSeek-V3 checkpoints that transformers writes, against transformers' eager forward pass.

Each tiny model (3 layers: one dense, then 8 routed experts top-2 plus a shared expert) is built by transformers with
every parameter re-drawn (hf_families.randomise; V3's e_score_correction_bias too, so the choice bias matters),
saved with save_pretrained and loaded by qkov. The cases cover a query latent and none (V2-Lite), V3's interleaved
and rotate-half rope, YaRN with mscale_all_dim != mscale (the softmax scale's mscale and the rotary part's own
factor), V2's greedy and group-limited routing (one group kept: with as many groups kept as experts chosen,
ranking groups by their best expert never changes V2's choice) and V3's sigmoid routing. Logits ≤ 1e-4 and
patterns ≤ 1e-5 in float32, unprocessed and processed (ln gains folded into the latent projections)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.statedict import build_model
from tests.core.hf_families import TOKENS, hf_model, hf_run, save

BASE = {
    "num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 16,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
    "kv_lora_rank": 12, "q_lora_rank": 10, "qk_rope_head_dim": 4, "v_head_dim": 6, "qk_nope_head_dim": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
}  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.7}  # fmt: skip
V3, V2 = ("DeepseekV3Config", "DeepseekV3ForCausalLM"), ("DeepseekV2Config", "DeepseekV2ForCausalLM")
CASES: dict[str, tuple[tuple[str, str], dict[str, Any]]] = {
    "v3": (V3, {**BASE, "n_group": 4, "topk_group": 2}),
    "v3-rotate-half-no-q-latent": (V3, {**BASE, "n_group": 4, "topk_group": 2, "rope_interleave": False,
                                        "q_lora_rank": None}),
    "v3-yarn": (V3, {**BASE, "n_group": 4, "topk_group": 2, "rope_parameters": YARN}),
    "v2": (V2, {**BASE, "routed_scaling_factor": 1.5}),
    "v2-lite-grouped": (V2, {**BASE, "q_lora_rank": None, "topk_method": "group_limited_greedy", "n_group": 4,
                             "topk_group": 1, "rope_parameters": YARN}),
}  # fmt: skip


def deepseek_model(name: str, seed: int = 5) -> Any:
    (config, model_cls), fields = CASES[name]
    return randomise_choice_bias(hf_model(config, model_cls, fields, seed=seed), seed)


def randomise_choice_bias(model: Any, seed: int) -> Any:
    """`model` with V3's e_score_correction_bias re-drawn (so the choice bias matters)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:  # a buffer: randomise() draws parameters only
                bias.copy_(0.3 * torch.randn(bias.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("deepseek_hf")
    out = {}
    for name in CASES:
        model = deepseek_model(name)
        out[name] = (save(model, root / name), model)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_patterns_equal_transformers(world: dict[str, tuple[Path, Any]], name: str) -> None:
    folder, reference = world[name]
    ref_logits, ref_patterns = hf_run(reference, TOKENS)
    loaded = load_checkpoint(folder, process=False)
    assert loaded.format == json.loads((folder / "config.json").read_text())["model_type"]
    assert loaded.model.cfg.latent_attention and loaded.model.cfg.moe_dense_layers == 1
    logits, cache = loaded.model.run(TOKENS, names=lambda n: n.endswith("hook_pattern"))
    assert (logits - ref_logits).abs().max() <= 1e-4 and ref_logits.abs().max() > 1
    for layer, ref in enumerate(ref_patterns):
        assert (cache[f"blocks.{layer}.attn.hook_pattern"] - ref).abs().max() <= 1e-5
    processed = load_checkpoint(folder).model
    assert processed.processing["fold_ln"] is True
    assert (processed(TOKENS).log_softmax(-1) - ref_logits.log_softmax(-1)).abs().max() <= 1e-4


@pytest.mark.parametrize(
    ("name", "change"),
    [("v3", {"moe_scoring": "softmax"}), ("v3", {"moe_norm_topk": False}), ("v3", {"moe_n_groups": None,
     "moe_topk_groups": None}), ("v2", {"moe_routed_scale": 1.0}), ("v2-lite-grouped", {"moe_n_groups": None,
     "moe_topk_groups": None}), ("v3", {"rotary_adjacent_pairs": False}), ("v3-yarn", {"attn_scale": 12**0.5})],
)  # fmt: skip
def test_each_routing_and_rope_rule_matters(
    world: dict[str, tuple[Path, Any]], name: str, change: dict[str, Any]
) -> None:
    """Undo one rule the loader read (scoring, renormalisation, groups, routed scale, rope layout, YaRN's mscale):
    the logits move away from transformers'."""
    folder, reference = world[name]
    model = load_checkpoint(folder, process=False).model
    if "moe_scoring" in change:  # the softmax router has no choice bias
        state = {k: v for k, v in model.state_dict().items() if not k.endswith("b_choice")}
    else:
        state = model.state_dict()
    changed = build_model(dataclasses.replace(model.cfg, **change), state, model.dtype, "changed")
    assert (changed(TOKENS) - hf_run(reference, TOKENS)[0]).abs().max() > 1e-3


def test_the_choice_bias_matters(world: dict[str, tuple[Path, Any]]) -> None:
    folder, reference = world["v3"]
    model = load_checkpoint(folder, process=False).model
    state = {k: (torch.zeros_like(v) if k.endswith("b_choice") else v) for k, v in model.state_dict().items()}
    changed = build_model(model.cfg, state, model.dtype, "unbiased")
    assert (changed(TOKENS) - hf_run(reference, TOKENS)[0]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("edit", "message"),
    [({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
     ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
     ({"attention_bias": True}, "attention_bias"),
     ({"kv_lora_rank": "12"}, "kv_lora_rank must be an integer"), ({"qk_rope_head_dim": 5}, "rotary_dim must be even"),
     ({"n_group": 3}, "moe_n_groups=3 must divide num_experts=8"), ({"n_group": 8, "topk_group": 1}, "two"),
     ({"qk_nope_head_dim": 6}, "expected shape"),
     ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'")],
)  # fmt: skip
def test_variants_qkov_cannot_honour_are_refused_by_name(
    world: dict[str, tuple[Path, Any]], tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    folder = world["v3"][0]
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **edit}))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


def test_topk_method_v2_does_not_implement_is_refused(world: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    folder = world["v2"][0]
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    config = {**json.loads((folder / "config.json").read_text()), "topk_method": "noaux_tc"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="noaux_tc"):
        load_checkpoint(tmp_path)


def test_multi_token_prediction_layers_are_left_unread(world: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """A released V3 file carries num_nextn_predict_layers layers after the last; they are not read. A tensor of a
    layer beyond those is still an error (the config does not match the weights)."""
    from safetensors.torch import load_file, save_file

    folder, reference = world["v3"]
    tensors = load_file(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    n = config["num_hidden_layers"]
    save_file({**tensors, f"model.layers.{n}.enorm.weight": torch.ones(32)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    model = load_checkpoint(tmp_path, process=False).model
    assert (model(TOKENS) - hf_run(reference, TOKENS)[0]).abs().max() <= 1e-4
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match="enorm"):
        load_checkpoint(tmp_path)


QUANTISED = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
             "down_proj")  # fmt: skip


def test_fp8_dequantisation_equals_transformers() -> None:
    """dequantize_fp8 against transformers' own FP8 dequantiser, on a shape the blocks do not divide."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from circuits_core.formats.fp8 import dequantize_fp8, scale_grid

    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(10, 9, generator=gen) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(scale_grid((10, 9), (4, 4)), generator=gen) + 0.1  # [3, 3]
    ours = dequantize_fp8(q, scale_inv, (4, 4), torch.float32)
    theirs = _dequantize_fp8_weight(q, scale_inv, [4, 4], torch.float32)
    assert torch.equal(ours, theirs) and ours.abs().max() > 1


def test_block_scaled_fp8_checkpoint(world: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """A V3 file whose linear weights are block-scaled FP8 (blocks of 4 x 4: e4m3 values and a weight_scale_inv per
    block, as the released files store them at 128 x 128) loads dequantised: its logits equal transformers' forward
    pass on the weights transformers' own dequantiser gives (≤ 1e-4, float32)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    folder, reference = world["v3"]
    tensors = load_file(folder / "model.safetensors")
    stored, dequantised = {}, {}
    for key, W in tensors.items():
        if key.endswith(".weight") and key.split(".")[-2] in QUANTISED:
            rows, cols = -(-W.shape[0] // 4), -(-W.shape[1] // 4)  # partial blocks at the ends (10 rows: 3 blocks)
            scale = torch.tensor(
                [[float(W[4 * i : 4 * i + 4, 4 * j : 4 * j + 4].abs().max()) / 448.0 for j in range(cols)]
                 for i in range(rows)]
            ).clamp(min=1e-12)  # fmt: skip  # 448: e4m3's largest value
            q = (W / scale.repeat_interleave(4, 0)[: W.shape[0]].repeat_interleave(4, 1)[:, : W.shape[1]]).to(
                torch.float8_e4m3fn
            )
            stored[key], stored[key.removesuffix("weight") + "weight_scale_inv"] = q, scale
            dequantised[key] = _dequantize_fp8_weight(q, scale, [4, 4], torch.float32)
        else:
            stored[key] = W
    save_file(stored, tmp_path / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [4, 4],
                                     "activation_scheme": "dynamic"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    import copy

    hf = copy.deepcopy(reference)
    state = hf.state_dict()
    experts = {}
    for key, W in dequantised.items():  # transformers' in-memory experts are stacked: gate_up_proj, down_proj
        if ".experts." in key:
            prefix, e, proj = key.rsplit(".", 3)[0], int(key.split(".")[-3]), key.split(".")[-2]
            experts.setdefault(prefix, {}).setdefault(proj, {})[e] = W
        else:
            state[key] = W
    for prefix, projs in experts.items():
        E = len(projs["gate_proj"])
        state[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(E)]
        )
        state[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(E)])
    hf.load_state_dict(state)
    ref = hf_run(hf, TOKENS)[0]
    assert (ref - hf_run(reference, TOKENS)[0]).abs().max() > 1e-3  # the FP8 rounding is visible
    model = load_checkpoint(tmp_path, process=False).model
    assert (model(TOKENS) - ref).abs().max() <= 1e-4
