"""DeepSeek-V2/V3 GGUF files (`deepseek2`: latent attention, experts with shared experts, YaRN) against transformers.

Each random transformers DeepSeek (3 layers: one dense, then 8 routed experts top-2 and a shared expert; every
parameter re-drawn, V3's e_score_correction_bias too) is written as llama.cpp's converter writes it: one key/value
head, key_length = kv_lora_rank + d_rope and the per-head widths under the _mla keys, kv_b_proj split into attn_k_b
(its key rows, transposed) and attn_v_b, the experts merged, e_score_correction_bias as exp_probs_b.bias, YaRN's
mscale_all_dim as yarn_log_mul = 0.1 mscale_all_dim; one case as files written before llama.cpp's MLA rewrite
(attn_kv_b, no _mla keys, no gating key). qkov reading the GGUF must give transformers' logits (float32) and
patterns, and the MLA content and rotary terms (float64) must sum to the scores transformers' eager attention
computes, captured inside its attention function (to float32's precision: transformers turns the rope in float32).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers

from circuits_core.circuits.latent_circuits import latent_rho, score_terms
from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.statedict import build_model
from tests.core.gguf_writing import write_deepseek
from tests.core.hf_families import TOKENS, assert_runs_like, hf_model, hf_run
from tests.core.test_deepseek_hf import randomise_choice_bias

F64 = torch.float64
BASE = {
    "num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 16,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
    "kv_lora_rank": 12, "q_lora_rank": 10, "qk_rope_head_dim": 4, "v_head_dim": 6, "qk_nope_head_dim": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}, "rms_norm_eps": 2.0**-20,
}  # fmt: skip
# mscale == mscale_all_dim, as in every released DeepSeek config: the file keeps only mscale_all_dim. The file's
# float32 values (eps, 0.1 mscale_all_dim) are chosen exact, so that the float64 comparison below is exact too.
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.25, "mscale_all_dim": 1.25, "beta_fast": 16.0, "beta_slow": 0.25}  # fmt: skip
V3, V2 = ("DeepseekV3Config", "DeepseekV3ForCausalLM"), ("DeepseekV2Config", "DeepseekV2ForCausalLM")
# name -> (classes, config fields, the config's scoring_func as released configs state it, legacy layout)
CASES: dict[str, tuple[tuple[str, str], dict[str, Any], str | None, bool]] = {
    "v3-yarn": (V3, {**BASE, "n_group": 4, "topk_group": 2, "rope_parameters": YARN}, "sigmoid", False),
    "v2-lite": (V2, {**BASE, "q_lora_rank": None, "routed_scaling_factor": 1.5}, "softmax", False),
    "v2-grouped-legacy": (V2, {**BASE, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1,
                               "rope_parameters": YARN}, None, True),
}  # fmt: skip


def deepseek_model(name: str, seed: int) -> Any:
    (config, model_cls), fields, _, _ = CASES[name]
    return randomise_choice_bias(hf_model(config, model_cls, fields, seed=seed), seed)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("gguf_deepseek")
    out = {}
    for i, (name, (_, _, scoring, legacy)) in enumerate(CASES.items()):
        model = deepseek_model(name, seed=60 + i)
        (root / name).mkdir()
        write_deepseek(model, root / name / "m.gguf", scoring, legacy)
        out[name] = (root / name, model)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_patterns_equal_transformers(world: dict[str, tuple[Path, Any]], name: str) -> None:
    folder, reference = world[name]
    cfg = assert_runs_like(folder, reference).model.cfg
    assert cfg.latent_attention and cfg.moe_dense_layers == 1 and cfg.moe_shared_d_mlp == 16
    assert cfg.moe_scoring == ("sigmoid" if name.startswith("v3") else "softmax")
    assert (cfg.mla_q_rank is None) == (name == "v2-lite")


@pytest.mark.parametrize(
    ("name", "change"),
    [("v3-yarn", {"moe_scoring": "softmax"}), ("v3-yarn", {"moe_norm_topk": False}),
     ("v3-yarn", {"moe_n_groups": None, "moe_topk_groups": None}), ("v2-lite", {"moe_routed_scale": 1.0}),
     ("v2-grouped-legacy", {"moe_n_groups": None, "moe_topk_groups": None}),
     ("v3-yarn", {"rotary_adjacent_pairs": False}), ("v3-yarn", {"attn_scale": 12**0.5}),
     ("v3-yarn", {"rope_beta_fast": 32.0, "rope_beta_slow": 1.0})],
)  # fmt: skip
def test_each_value_read_from_the_metadata_matters(
    world: dict[str, tuple[Path, Any]], name: str, change: dict[str, Any]
) -> None:
    """Undo one value the loader read from the file (scoring, renormalisation, groups, routed scale, rope layout,
    YaRN's mscale and its beta_fast, beta_slow): the logits move away from transformers'."""
    folder, reference = world[name]
    model = load_checkpoint(folder, process=False).model
    state = model.state_dict()
    if "moe_scoring" in change:  # the softmax router has no choice bias
        state = {k: v for k, v in state.items() if not k.endswith("b_choice")}
    changed = build_model(dataclasses.replace(model.cfg, **change), state, model.dtype, "changed")
    assert (changed(TOKENS) - hf_run(reference, TOKENS)[0]).abs().max() > 1e-3


def test_values_the_file_does_not_carry_are_listed(world: dict[str, tuple[Path, Any]]) -> None:
    assert {d.field for d in load_checkpoint(world["v3-yarn"][0], process=False).defaulted} == {"yarn_attention_factor"}
    assert {d.field for d in load_checkpoint(world["v2-grouped-legacy"][0], process=False).defaulted} == {
        "moe_scoring", "yarn_attention_factor"
    }  # fmt: skip


def eager_scores(model: Any, tokens: torch.Tensor) -> list[torch.Tensor]:
    """transformers' pre-softmax scores q kᵀ · scaling [batch, heads, n, n] per layer, captured inside its eager
    attention function."""
    v2 = model.config.model_type == "deepseek_v2"
    module: Any = transformers.models.deepseek_v2 if v2 else transformers.models.deepseek_v3
    module = module.modeling_deepseek_v2 if v2 else module.modeling_deepseek_v3
    original, scores = module.eager_attention_forward, []

    def recording(attn: Any, query: torch.Tensor, key: torch.Tensor, value: Any, mask: Any, scaling: float,
                  *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        scores.append(query @ key.transpose(2, 3) * scaling)
        return original(attn, query, key, value, mask, scaling, *args, **kwargs)

    module.eager_attention_forward = recording
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        module.eager_attention_forward = original
    return scores


@pytest.mark.parametrize("name", ["v3-yarn", "v2-lite"])
def test_content_and_rotary_terms_sum_to_transformers_scores(world: dict[str, tuple[Path, Any]], name: str) -> None:
    """In float64 the two terms sum to the scores of qkov's run to 1e-9, and to transformers' own eager scores to
    float32's precision: transformers computes the rope's angles in float32 whatever the model's dtype."""
    folder, reference = world[name]
    model = load_checkpoint(folder, dtype=F64).model  # processed: the ln gains folded into the latent projections
    tokens = TOKENS[:1]
    n = tokens.shape[1]
    reference.set_experts_implementation("eager")  # transformers' grouped products take no float64
    ref = eager_scores(reference.double(), tokens)
    reference.float()
    _, cache = model.run(tokens, names=lambda k: k.endswith(("ln1.hook_normalized", "hook_attn_scores")))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(model.cfg.n_layers):
        x_hat = cache[f"blocks.{layer}.ln1.hook_normalized"][0]
        rho_q, rho_kv = latent_rho(model, layer, x_hat)
        for h in range(model.cfg.n_heads):
            content, rotary = score_terms(model, layer, h, x_hat, rho_q, rho_kv)
            theirs, ours = ref[layer][0, h][causal], cache[f"blocks.{layer}.attn.hook_attn_scores"][0, h][causal]
            assert (content + rotary)[causal].sub(ours).abs().max() < 1e-9
            assert (content + rotary)[causal].sub(theirs).abs().max() < 1e-5 * theirs.abs().max()
            assert (rotary[causal] - theirs).abs().max() > 1e-3  # neither term alone is the score
            assert (content[causal] - theirs).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("edit", "message"),
    [({"deepseek2.expert_gating_func": gguf.GGUFValue(3, gguf.GGUFValueType.UINT32)},
      "expert_gating_func=3 is not supported"),
     ({"deepseek2.rope.scaling.type": gguf.GGUFValue("linear", gguf.GGUFValueType.STRING)},
      "rope scaling type 'linear' is not supported"),
     ({"deepseek2.expert_weights_norm": gguf.GGUFValue(True, gguf.GGUFValueType.BOOL)},
      "expert_weights_norm under the softmax")],
)  # fmt: skip
def test_variants_qkov_cannot_honour_are_refused_by_name(
    world: dict[str, tuple[Path, Any]], tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    write_deepseek(world["v2-lite"][1], tmp_path / "m.gguf", scoring="softmax", legacy=False, edit=edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


def test_a_tokenizer_not_built_here_gives_way_to_a_tokenizer_json_beside(tmp_path: Path) -> None:
    """A DeepSeek GGUF whose byte-level BPE names a llama.cpp pre-tokenizer qkov does not build (here 'tekken',
    Mistral's): alone the file is refused, naming it; with a tokenizer.json beside it, that one is read (the same
    encoding as the tokenizers library gives) and the model's defaulted values say so."""
    from tests.app.conftest import train_tokenizer

    tok = train_tokenizer()
    (config, model_cls), fields, _, _ = CASES["v2-lite"]
    model = hf_model(config, model_cls, {**fields, "vocab_size": tok.get_vocab_size()}, seed=70)
    vocab = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    S = gguf.GGUFValueType.STRING
    edit = {"tokenizer.ggml.model": gguf.GGUFValue("gpt2", S), "tokenizer.ggml.pre": gguf.GGUFValue("tekken", S),
            "tokenizer.ggml.tokens": gguf.GGUFValue(vocab, gguf.GGUFValueType.ARRAY, S)}  # fmt: skip
    write_deepseek(model, tmp_path / "m.gguf", "softmax", legacy=False, edit=edit)
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre 'tekken' is not supported"):
        load_checkpoint(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    loaded = load_checkpoint(tmp_path)
    assert loaded.tokenizer is not None
    text = "the cat sat on the mat"
    assert loaded.tokenizer.encode(text, prepend_bos=False) == tok.encode(text, add_special_tokens=False).ids
    assert [d.field for d in loaded.defaulted] == ["tokenizer"] and "tekken" in loaded.defaulted[0].source
