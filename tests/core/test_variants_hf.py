"""Gemma 2, Gemma 3 (text and the text tower of a gemma3 checkpoint), Qwen3 and OLMo 2/3 checkpoints that transformers
itself writes, against transformers' own forward pass (eager attention).

Each tiny model is built by transformers with its quirks switched on and biting: sliding windows shorter than the
prompt (on the layers the config names), soft caps below the scores and logits they cap (the test checks that some
scores and logits exceed them), QK-norm (per head and per layer), sandwich and output-only norms, grouped- and
multi-query attention, head_dim != d_model / n_heads, Gemma's query_pre_attn_scalar, local/global rope bases with
linear scaling on global layers. Every parameter is re-drawn (norm gains 1 + 0.3 N; Gemma's files store w for a gain
1 + w, so w = 0.3 N) so that a gain applied wrongly shows. Logits must equal transformers' to 1e-4 (float32) and
every layer's attention pattern its eager pattern to 1e-5. Each quirk is also shown to matter: switching it off in
qkov's config moves the logits far from transformers'.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.detect import detect_format
from circuits_core.formats.llama_variants import REFUSED_MODEL_TYPES
from circuits_core.formats.statedict import build_model
from circuits_core.model.transformer import Transformer

VOCAB, N = 61, 14
BASE = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 3,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "attn_implementation": "eager"}  # fmt: skip
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2_gqa_caps_window": ("gemma2", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "query_pre_attn_scalar": 12,
        "attn_logit_softcapping": 1.5, "final_logit_softcapping": 4.0, "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}),
    "gemma3_mqa_local_global": ("gemma3_text", {
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8, "query_pre_attn_scalar": 8,
        "sliding_window": 4, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "final_logit_softcapping": 1.5,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}}}),
    "qwen3_gqa_window_bias": ("qwen3", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6, "attention_bias": True,
        "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}),
    "olmo2_gqa_output_norms": ("olmo2", {
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}),
    "olmo3_window_rope_per_type": ("olmo3", {
        "num_attention_heads": 4, "num_key_value_heads": 4, "sliding_window": 4, "tie_word_embeddings": False,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 500.0}}}),
}  # fmt: skip
CLASSES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
}
TOKENS = torch.randint(0, VOCAB, (2, N), generator=torch.Generator().manual_seed(3))


def randomise(model: Any, seed: int, gemma: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(0.3 * noise + (0.0 if gemma else 1.0))  # Gemma stores w for a gain of 1 + w
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise * (0.3 if gemma else 1.0))  # Gemma multiplies the embedding by sqrt(d_model)
            else:  # nn.Linear [d_out, d_in]
                p.copy_(noise * 2.0 / math.sqrt(p.shape[-1]))


def hf_model(kind: str, extra: dict[str, Any], seed: int) -> Any:
    config_cls, model_cls = (getattr(transformers, name) for name in CLASSES[kind])
    model = model_cls(config_cls(**{**BASE, **extra})).eval()
    randomise(model, seed, kind.startswith("gemma"))
    return model


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("variants_hf")
    out = {}
    for i, (name, (kind, extra)) in enumerate(CASES.items()):
        model = hf_model(kind, extra, seed=40 + i)
        shard = "4KB" if name.startswith("qwen3") else "50GB"  # one checkpoint sharded with its index
        model.save_pretrained(root / name, max_shard_size=shard)
        out[name] = (root / name, model)
    return out


def reference(model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    with torch.no_grad():
        out = model(tokens, output_attentions=True)
    return out.logits, out.attentions


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_patterns_equal_transformers(world: dict[str, tuple[Path, Any]], name: str) -> None:
    folder, hf = world[name]
    kind, extra = CASES[name]
    assert detect_format(folder) == kind
    model = load_checkpoint(folder, dtype=torch.float32, process=False).model
    logits_ref, patterns_ref = reference(hf, TOKENS)
    assert logits_ref.abs().max() > 1.0  # logits large enough for 1e-4 to be a real bound
    logits, cache = model.run(TOKENS, names=lambda n: n.endswith(("hook_pattern", "uncapped")))
    err = (logits - logits_ref).abs().max().item()
    print(f"{name}: max |logit - transformers| = {err:.2e} (float32)")
    assert err <= 1e-4
    for layer, ref in enumerate(patterns_ref):
        pattern_err = (cache[f"blocks.{layer}.attn.hook_pattern"] - ref).abs().max().item()
        assert pattern_err <= 1e-5, f"{name} layer {layer}: pattern differs by {pattern_err:.2e}"
    cfg = model.cfg
    for layer in range(cfg.n_layers):  # a window shorter than the prompt really masks
        window = cfg.layer_window(layer)
        if window is not None:
            assert window < N and bool((patterns_ref[layer][:, :, N - 1, : N - window] == 0).all())
    if cfg.attn_scores_soft_cap is not None:  # the caps bite
        uncapped = torch.stack([cache[f"blocks.{layer}.attn.hook_attn_scores_uncapped"] for layer in range(3)])
        assert (uncapped.abs() > cfg.attn_scores_soft_cap).any()
    if cfg.output_logits_soft_cap is not None:
        assert (cache["hook_logits_uncapped"].abs() > cfg.output_logits_soft_cap).any()


@pytest.mark.parametrize("name", list(CASES))
def test_processed_log_probs_equal_unprocessed_float64(world: dict[str, tuple[Path, Any]], name: str) -> None:
    raw = load_checkpoint(world[name][0], dtype=torch.float64, process=False).model
    processed = load_checkpoint(world[name][0], dtype=torch.float64, process=True).model
    assert processed.processing["fold_ln"] is True and processed.cfg.normalization_type == "RMSPre"
    assert not torch.equal(processed.W_U, raw.W_U)  # processing did change the weights (fold_ln of ln_final)
    err = (processed(TOKENS).log_softmax(-1) - raw(TOKENS).log_softmax(-1)).abs().max().item()
    assert err <= 1e-12, f"{name}: {err:.2e}"


def _variant(model: Transformer, **changes: Any) -> Transformer:
    cfg = dataclasses.replace(model.cfg, **changes)
    state = {k: v for k, v in model.state_dict().items() if not (changes.get("qk_norm", 1) is None and "_norm." in k)}
    if changes.get("post_norms") is False:
        state = {k: v for k, v in state.items() if "_post." not in k}
    return build_model(cfg, state, dtype=model.dtype, origin="variant")


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        ("gemma2_gqa_caps_window", {"attn_scores_soft_cap": None}),
        ("gemma2_gqa_caps_window", {"output_logits_soft_cap": None}),
        ("gemma2_gqa_caps_window", {"window_size": None, "attn_types": None}),
        ("gemma2_gqa_caps_window", {"attn_scale": None}),  # query_pre_attn_scalar, not d_head
        ("gemma2_gqa_caps_window", {"post_norms": False}),
        ("gemma3_mqa_local_global", {"rotary_base_local": None}),
        ("gemma3_mqa_local_global", {"rope_type": "default", "rope_factor": 1.0}),
        ("gemma3_mqa_local_global", {"qk_norm": None}),
        ("qwen3_gqa_window_bias", {"window_size": None, "attn_types": None}),
        ("qwen3_gqa_window_bias", {"qk_norm": None}),
        ("olmo3_window_rope_per_type", {"rotary_base_local": None}),
    ],
)
def test_each_quirk_matters(world: dict[str, tuple[Path, Any]], name: str, changes: dict[str, Any]) -> None:
    model = load_checkpoint(world[name][0], dtype=torch.float32, process=False).model
    diff = (_variant(model, **changes)(TOKENS) - reference(world[name][1], TOKENS)[0]).abs().max().item()
    assert diff > 1e-2, f"{changes} left the logits within {diff:.2e} of transformers: the test would not see it"


def test_olmo2_layer_norm_is_over_all_heads(world: dict[str, tuple[Path, Any]]) -> None:
    """OLMo 2's QK-norm divides by one RMS over the layer's heads: per-head normalisation would differ."""
    folder, hf = world["olmo2_gqa_output_norms"]
    model = load_checkpoint(folder, dtype=torch.float32, process=False).model
    assert model.cfg.qk_norm == "layer" and not model.cfg.pre_norms and model.cfg.post_norms
    _, cache = model.run(TOKENS, names={"blocks.0.attn.q_norm.hook_scale"})
    assert cache["blocks.0.attn.q_norm.hook_scale"].shape == (2, N, 1, 1)
    q = torch.einsum("bpd,hde->bphe", model.W_E[TOKENS].double(), model.W_Q[0].double())  # raw stream, no ln1
    rho = (q.pow(2).mean((-2, -1)) + model.cfg.eps).sqrt()
    assert torch.allclose(cache["blocks.0.attn.q_norm.hook_scale"][..., 0, 0].double(), rho, rtol=1e-5)


def test_gemma3_multimodal_checkpoint_reads_its_text_tower(tmp_path: Path) -> None:
    """The image-text model (Gemma3ForConditionalGeneration) applies no final-logit cap, so its text config has none
    here; one that names a cap is refused."""
    kind, extra = CASES["gemma3_mqa_local_global"]
    text = {**{k: v for k, v in BASE.items() if k != "attn_implementation"}, **extra, "final_logit_softcapping": None}
    vision = {"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 8, "patch_size": 4}  # fmt: skip
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1)
    config._attn_implementation = "eager"
    full = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomise(full, 7, gemma=True)
    full.save_pretrained(tmp_path / "gemma3")
    assert detect_format(tmp_path / "gemma3") == "gemma3"
    model = load_checkpoint(tmp_path / "gemma3", dtype=torch.float32, process=False).model
    with torch.no_grad():
        ref = full(input_ids=TOKENS).logits
    assert (model(TOKENS) - ref).abs().max() <= 1e-4
    config = json.loads((tmp_path / "gemma3" / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = 30.0
    (tmp_path / "gemma3" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text_config.final_logit_softcapping"):
        load_checkpoint(tmp_path / "gemma3")


def _edited(tmp_path: Path, source: Path, edit: dict[str, Any]) -> Path:
    folder = tmp_path / "edited"
    folder.mkdir()
    for item in source.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    return folder


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("gemma3_mqa_local_global", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma3_mqa_local_global", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            "gemma3_mqa_local_global",
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10.0},
                    "full_attention": {"rope_type": "default"},
                }
            },
            "sliding_attention.rope_type",
        ),  # fmt: skip
        (
            "olmo3_window_rope_per_type",
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default"},
                    "full_attention": {"rope_type": "yarn", "factor": 2.0},
                }
            },
            "'yarn'",
        ),
        (
            "qwen3_gqa_window_bias",
            {"layer_types": ["linear_attention", "full_attention", "full_attention"]},
            "linear_attention",
        ),  # fmt: skip
        ("qwen3_gqa_window_bias", {"attn_logit_softcapping": 30.0}, "soft-capping"),
        ("gemma2_gqa_caps_window", {"model_type": "gemma4_text"}, "global_head_dim"),
        ("gemma2_gqa_caps_window", {"model_type": "qwen3_5_text"}, "linear-attention"),
    ],
)
def test_configurations_qkov_cannot_honour_are_refused_by_name(
    tmp_path: Path, world: dict[str, tuple[Path, Any]], name: str, edit: dict[str, Any], message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(_edited(tmp_path, world[name][0], edit))


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith(("gemma3", "qwen3", "olmo"))])
def test_normalised_queries_and_keys_equal_transformers(world: dict[str, tuple[Path, Any]], name: str) -> None:
    """The hooks of the normalised q and k (`attn.q_norm.hook_normalized`, before the rotation) hold what
    transformers' own q_norm and k_norm modules return, captured from its forward pass."""
    folder, hf = world[name]
    model = load_checkpoint(folder, dtype=torch.float32, process=False).model
    _, cache = model.run(TOKENS, names=lambda n: n.endswith("norm.hook_normalized"))
    captured: dict[str, torch.Tensor] = {}
    handles = [
        module.register_forward_hook(lambda m, args, out, key=key: captured.__setitem__(key, out.detach()))
        for key, module in hf.named_modules()
        if key.endswith(("self_attn.q_norm", "self_attn.k_norm"))
    ]
    try:
        reference(hf, TOKENS)
    finally:
        for handle in handles:
            handle.remove()
    assert len(captured) == 2 * model.cfg.n_layers
    for key, theirs in captured.items():
        layer, side = int(key.split(".")[-3]), key.split(".")[-1]  # model.layers.{layer}.self_attn.{q,k}_norm
        ours = cache[f"blocks.{layer}.attn.{side}.hook_normalized"]  # [batch, pos, heads, d_head]
        if theirs.shape[1] != N:  # Gemma 3 normalises [batch, heads, pos, d_head]
            theirs = theirs.transpose(1, 2)
        err = (ours - theirs.reshape(ours.shape)).abs().max().item()  # OLMo: [batch, pos, heads * d_head]
        assert err <= 1e-5, f"{name} {key}: {err:.2e}"


@pytest.mark.parametrize("model_type", list(REFUSED_MODEL_TYPES))
def test_every_newer_layout_is_refused_by_its_name(
    tmp_path: Path, world: dict[str, tuple[Path, Any]], model_type: str
) -> None:
    """Each layout transformers describes that qkov does not run yet (Gemma 4 and 3n, Qwen3.5, Qwen3-Next) is refused
    naming its model_type and what it would need, never read as its older relative."""
    why = re.escape(REFUSED_MODEL_TYPES[model_type])
    with pytest.raises(CheckpointError, match=f"model_type '{model_type}' is not supported yet: {why}"):
        load_checkpoint(_edited(tmp_path, world["gemma2_gqa_caps_window"][0], {"model_type": model_type}))
