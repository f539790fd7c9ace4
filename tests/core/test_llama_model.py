"""The Llama-family model in float64: each feature against an independent computation.

- Grouped-query attention == the same model with K/V repeated per query head (a plain multi-head model).
- Adjacent-pair rotary == rotate-half rotary with W_Q/W_K columns permuted (the GGUF vs Hugging Face layouts).
- rotate(): R(p) is orthogonal, R(a) R(b)^T = R(a - b), unrotated dims stay (partial rotary), and a rotated q
  dotted with a rotated k depends only on the offset.
- RMSNorm: the fused kernel, the recorded path and a frozen run give the same logits.
- The frozen-attention path expansion sums to the real logit (1e-9) with RMS, GQA, rotary, gated MLPs and
  biases together; terms above max_order equal the remainder of a lower-order expansion.
- Processing (fold RMS weights, centre W_U, fold value biases) keeps the log-probs.
- The QK path expansion sums to the real rotated scores; the order ablation's full rerun gives the logits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.processing import process_weights
from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.formats.statedict import build_model
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Frozen, Transformer, random_model, rotary_inv_freq, rotary_pairs, rotate
from circuits_core.prompt.ablation import order_logits
from circuits_core.prompt.frozen import attention, frozen_run
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.qk_paths import expand_scores

F64 = torch.float64
LLAMA = ModelConfig(
    n_layers=3, d_model=24, n_heads=6, d_head=4, d_vocab=37, n_ctx=16, d_mlp=20, attn_only=False,
    normalization_type="RMS", positional_embedding_type="rotary", act_fn="silu", gated_mlp=True,
    n_key_value_heads=2, use_bias=True, rotary_base=50.0, rope_type="llama3", rope_factor=4.0,
    rope_original_max_position_embeddings=12,
)  # fmt: skip
TOKENS = torch.randint(0, LLAMA.d_vocab, (2, 13), generator=torch.Generator().manual_seed(5))


def _noisy(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A random float64 model whose RMS weights and biases are non-trivial (1 + 0.3 N, 0.3 N)."""
    model = random_model(cfg, seed=seed, dtype=F64, std_embed=1.0)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1].lstrip("_")
            if leaf == "w" or leaf.startswith("b_"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=F64))
    return model


def _with(model: Transformer, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Transformer:
    return build_model(cfg, state, dtype=F64, origin="test")


def test_gqa_equals_multi_head_with_repeated_kv() -> None:
    model = _noisy(LLAMA)
    assert model.cfg.group_size == 3 and model.W_K_groups.shape == (3, 2, 24, 4) and model.W_K.shape == (3, 6, 24, 4)
    state: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if key.rsplit(".", 1)[-1] in ("_W_K", "_W_V", "_b_K", "_b_V"):
            value = value.repeat_interleave(3, dim=0)  # kv head g serves query heads 3g, 3g+1, 3g+2
            key = key.replace("._", ".")
        state[key] = value
    mha = _with(model, dataclasses.replace(LLAMA, n_key_value_heads=None), state)
    logits, cache = model.run(TOKENS, names=lambda n: n.endswith(("hook_k", "hook_pattern")))
    logits_mha, cache_mha = mha.run(TOKENS, names=lambda n: n.endswith(("hook_k", "hook_pattern")))
    assert (logits - logits_mha).abs().max() < 1e-12
    for key, value in cache.items():
        assert value.shape == cache_mha[key].shape and (value - cache_mha[key]).abs().max() < 1e-12, key
    assert torch.equal(model.W_V, mha.W_V)


def test_adjacent_pairs_equal_rotate_half_with_permuted_columns() -> None:
    """GGUF's layout: pair k is dims (2k, 2k+1); Hugging Face's: (k, k + K). Permuting W_Q/W_K (and b_Q/b_K)
    columns from one layout to the other gives the same model; mixing them up does not."""
    for rotary_dim in (8, 4):  # full and partial rotary
        half_cfg = dataclasses.replace(LLAMA, n_heads=3, d_head=8, n_key_value_heads=1, rotary_dim=rotary_dim)
        half = _noisy(half_cfg, seed=3)
        adj_cfg = dataclasses.replace(half_cfg, rotary_adjacent_pairs=True)
        first_h, second_h = rotary_pairs(half_cfg)
        first_a, second_a = rotary_pairs(adj_cfg)
        perm = torch.arange(8)  # adjacent dim j takes half dim perm[j]
        perm[first_a], perm[second_a] = first_h, second_h
        state = {}
        for key, value in half.state_dict().items():
            leaf = key.rsplit(".", 1)[-1].lstrip("_")
            state[key] = value[..., perm] if leaf in ("W_Q", "W_K", "b_Q", "b_K") else value
        adjacent = _with(half, adj_cfg, state)
        assert (adjacent(TOKENS) - half(TOKENS)).abs().max() < 1e-12
        wrong = _with(half, adj_cfg, half.state_dict())  # the trap: right weights, wrong layout
        assert (wrong(TOKENS) - half(TOKENS)).abs().max() > 1e-2


@pytest.mark.parametrize("adjacent", [False, True])
def test_rotate_is_a_position_rotation(adjacent: bool) -> None:
    cfg = dataclasses.replace(LLAMA, rotary_dim=2, rotary_adjacent_pairs=adjacent, rope_type="linear")
    eye = torch.eye(cfg.d_head, dtype=F64)
    R = {p: rotate(cfg, eye, torch.tensor(p)) for p in (-5, 0, 3, 7, 10)}
    assert torch.allclose(R[0], eye, atol=0)
    for Rp in R.values():
        assert (Rp @ Rp.T - eye).abs().max() < 1e-14  # orthogonal
        assert torch.equal(Rp[2:, 2:], eye[2:, 2:])  # partial rotary: dims from rotary_dim on stay
    assert (R[10] @ R[3].T - R[7]).abs().max() < 1e-13  # R(a) R(b)^T = R(a - b)
    assert (R[3] @ R[-5].T - rotate(cfg, eye, torch.tensor(8))).abs().max() < 1e-13
    # the angle of pair 0 at p is p * theta_0 = p / factor (linear scaling, theta_0 = 1 before it)
    first, second = (int(i[0]) for i in rotary_pairs(cfg))
    angle = 7 * float(rotary_inv_freq(cfg)[0])
    assert abs(angle - 7 / cfg.rope_factor) < 1e-15
    assert abs(float(R[7][first, first]) - torch.tensor(angle, dtype=F64).cos().item()) < 1e-15
    assert abs(float(R[7][first, second]) - torch.tensor(angle, dtype=F64).sin().item()) < 1e-15
    # batched positions broadcast: rotating a [pos, heads, d_head] tensor row by row
    x = torch.randn(6, 3, cfg.d_head, dtype=F64, generator=torch.Generator().manual_seed(0))
    rows = torch.stack([x[p] @ rotate(cfg, eye, torch.tensor(p)) for p in range(6)])
    assert (rotate(cfg, x, torch.arange(6)[:, None]) - rows).abs().max() < 1e-14


def test_rope_scaling_types_and_refusals() -> None:
    base = rotary_inv_freq(dataclasses.replace(LLAMA, rope_type="default", rope_factor=1.0))
    assert torch.allclose(rotary_inv_freq(dataclasses.replace(LLAMA, rope_type="linear")), base / 4)
    # llama3 with original context 12, low 1, high 4, factor 4: wavelengths 2 pi / theta = 6.28 (between 12/4 and
    # 12/1: interpolated with s = (12 / 6.28 - 1) / (4 - 1)) and 44.4 (longer than 12: divided by the factor)
    llama3 = rotary_inv_freq(LLAMA)
    s = (12 / (2 * torch.pi / base[0]) - 1) / 3
    assert 0 < s < 1 and abs(llama3[0] - ((1 - s) * base[0] / 4 + s * base[0])) < 1e-15
    assert 2 * torch.pi / base[1] > 12 and llama3[1] == base[1] / 4
    with pytest.raises(InvalidInputError, match="'dynamic'"):
        dataclasses.replace(LLAMA, rope_type="dynamic")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="name the scaling type"):
        dataclasses.replace(LLAMA, rope_type="default")  # rope_factor 4 left without its type
    with pytest.raises(InvalidInputError, match="must divide"):
        dataclasses.replace(LLAMA, n_key_value_heads=4)
    with pytest.raises(InvalidInputError, match="gated_mlp"):
        dataclasses.replace(LLAMA, attn_only=True, d_mlp=None, act_fn=None)


def test_rms_fused_recorded_and_frozen_runs_agree() -> None:
    model = _noisy(LLAMA)
    fused = model(TOKENS)  # nothing recorded: torch's rms_norm kernel
    recorded, cache = model.run(TOKENS, names=lambda n: n.endswith(("hook_scale", "hook_pattern")))
    manual = cache["blocks.0.ln1.hook_scale"]
    x = model.W_E[TOKENS]
    assert (manual - (x.pow(2).mean(-1, keepdim=True) + LLAMA.eps).sqrt()).abs().max() < 1e-14  # no centring
    frozen = Frozen(
        patterns={k: v for k, v in cache.items() if k.endswith("hook_pattern")},
        ln_scales={k: v for k, v in cache.items() if k.endswith("hook_scale")},
    )
    frozen_logits, _ = model.run(TOKENS, frozen=frozen)
    assert (fused - recorded).abs().max() < 1e-12 and (frozen_logits - recorded).abs().max() < 1e-12


@pytest.mark.parametrize("processed", [False, True])
def test_path_expansion_sums_to_the_logit(processed: bool) -> None:
    model = _noisy(LLAMA, seed=7)
    if processed:
        model = process_weights(model)
        assert model.cfg.normalization_type == "RMSPre"
    tokens = TOKENS[0]
    logit = model(tokens[None])[0]  # a separate forward pass, not the expansion's cached run
    run = frozen_run(model, tokens)
    full = expand_logits(model, tokens, target=(4, 9), positions=None, max_order=LLAMA.n_layers, run=run)
    actual = logit[:, 4] - logit[:, 9]
    assert actual.abs().max() > 0.5
    assert (full.values.sum(0) - actual).abs().max() < 1e-9 * max(1.0, float(actual.abs().max()))
    low = expand_logits(model, tokens, target=(4, 9), positions=None, max_order=1, run=run)
    higher = full.values[full.orders > 1].sum(0)
    assert (low.remainder - higher).abs().max() < 1e-9
    assert higher.abs().max() > 1e-3  # the remainder is not trivially zero


def test_processing_keeps_log_probs_and_reports_rms_choices() -> None:
    model = _noisy(LLAMA, seed=2)
    processed = process_weights(model)
    p = processed.processing
    assert p["fold_ln"] is True and p["center_unembed"] is True and p["fold_value_biases"] is True
    assert p["center_writing_weights"] is False and "RMSNorm" in str(p["center_writing_weights_skipped"])
    assert processed.cfg.normalization_type == "RMSPre" and "blocks.0.ln1.w" not in processed.state_dict()
    assert torch.equal(attention(processed, 0).grouped("b_V"), torch.zeros(2, 4, dtype=F64))
    err = (processed(TOKENS).log_softmax(-1) - model(TOKENS).log_softmax(-1)).abs().max()
    assert err < 1e-12
    assert (processed(TOKENS) - model(TOKENS)).abs().max() > 1e-3  # logits move (W_U centred), log-probs do not


def test_qkov_format_round_trip(tmp_path: Path) -> None:
    """save_checkpoint writes the new config fields and the grouped `_W_K` keys; load_checkpoint reads them back."""
    model = _noisy(LLAMA, seed=4)
    save_checkpoint(model, tmp_path / "raw")
    loaded = load_checkpoint(tmp_path / "raw", dtype=F64, process=False)
    assert loaded.format == "qkov" and loaded.model.cfg == LLAMA
    assert torch.equal(loaded.model(TOKENS), model(TOKENS))
    save_checkpoint(process_weights(model), tmp_path / "processed")
    again = load_checkpoint(tmp_path / "processed", dtype=F64)
    assert again.model.cfg.normalization_type == "RMSPre" and again.model.processing["fold_ln"] is True
    assert (again.model(TOKENS).log_softmax(-1) - model(TOKENS).log_softmax(-1)).abs().max() < 1e-12


def test_frozen_machinery_on_the_llama_model() -> None:
    """The QK path expansion's terms sum to the real (rotated, grouped) pre-softmax scores, and the order
    ablation's full-order rerun (every value path through frozen patterns) gives back the logits."""
    model = _noisy(LLAMA, seed=6)
    tokens = TOKENS[:1]
    _, cache = model.run(tokens, names={"blocks.2.attn.hook_attn_scores"})
    expansion = expand_scores(model, tokens[0], (2, 4), keep_terms=True)
    assert expansion.terms is not None
    causal = torch.ones(13, 13, dtype=torch.bool).tril()
    real = cache["blocks.2.attn.hook_attn_scores"][0, 4]
    assert (expansion.terms.sum((0, 1))[causal] - real[causal]).abs().max() < 1e-12
    assert real[causal].abs().max() > 0.5
    reruns = order_logits(model, tokens)
    assert (reruns[-1] - model(tokens)).abs().max() < 1e-12
    assert (reruns[0] - model(tokens)).abs().max() > 1e-2  # lower orders really drop paths
