"""The frozen-attention machinery on rotary / GQA models (issue 11.3): QK path terms, logit path terms, order
and head ablation, detectors and virtual heads, each against an independent computation in float64."""

import pytest
import torch
from rotary_models import CASES, rotary_model, tokens_for

from circuits_core.circuits.copying_spectra import copying_score
from circuits_core.circuits.rotary import omega
from circuits_core.prompt.ablation import ablate_head, order_logits
from circuits_core.prompt.detectors import detector_scores
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.qk_paths import expand_scores
from circuits_core.prompt.virtual import virtual_copying_scores, virtual_ov

IDS = list(CASES)


@pytest.mark.parametrize("case", IDS)
def test_qk_path_terms_sum_to_real_scores(case):
    """Σ_(a,b) q_a k_b^T / s == hook_attn_scores (causal part), each component rotated at its position; the
    (embed, embed) term equals y_i Ω(i - j) y_j^T / s with y the normalised embedding component."""
    model = rotary_model(n_layers=3, **CASES[case])
    tokens = tokens_for(model, n=10)
    run = frozen_run(model, tokens)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    i, j = causal.nonzero(as_tuple=True)
    for layer, h in ((1, 3), (2, 0)):
        exp = expand_scores(model, tokens, (layer, h), run=run, keep_terms=True)
        real = run.cache[f"blocks.{layer}.attn.hook_attn_scores"][h]
        torch.testing.assert_close(exp.terms.sum((0, 1))[causal], real[causal], atol=1e-10, rtol=0)
        y = run.cache["hook_embed"] * run.inv_scale(f"blocks.{layer}.ln1")[:, None] * model.blocks[layer].ln1.w
        if model.cfg.normalization_type == "LN":
            y = (
                (run.cache["hook_embed"] - run.cache["hook_embed"].mean(-1, keepdim=True))
                * run.inv_scale(f"blocks.{layer}.ln1")[:, None]
                * model.blocks[layer].ln1.w
            )
        Om = omega(model, layer, h, torch.arange(10)).AB  # [n, d, d]
        expected = torch.einsum("pd,pde,pe->p", y[i], Om[i - j], y[j]) / model.cfg.scale
        torch.testing.assert_close(exp.term("embed", "embed")[causal], expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("case", ["gqa", "gqa-adjacent-partial-linear", "layernorm"])
def test_logit_paths_and_order_ablation_reproduce_the_forward_pass(case):
    model = rotary_model(n_layers=2, **CASES[case])
    tokens = tokens_for(model, n=9)
    logits = model.run(tokens)[0][0]  # [n, V], a plain forward pass
    exp = expand_logits(model, tokens, target=5, positions=None, max_order=2)
    torch.testing.assert_close(exp.total, logits[:, 5], atol=1e-10, rtol=0)
    torch.testing.assert_close(order_logits(model, tokens)[-1][0], logits, atol=1e-10, rtol=0)


def test_head_ablation_recomputed_equals_zeroed_output_weights():
    """Under GQA, removing query head 1's result (later patterns recomputed) == zeroing its W_O (its key/value
    group is shared with head 0, which must keep working)."""
    model = rotary_model(n_layers=2, **CASES["gqa"])
    tokens = tokens_for(model, n=9)
    ablated, _ = ablate_head(model, tokens, 0, 1, recompute_patterns=True)
    edited = rotary_model(n_layers=2, **CASES["gqa"])
    with torch.no_grad():
        edited.blocks[0].attn.W_O[1] = 0
    torch.testing.assert_close(ablated, edited.run(tokens)[0], atol=1e-10, rtol=0)


def test_detectors_on_gqa_rotary_model_vs_patterns():
    model = rotary_model(n_layers=2, **CASES["gqa-adjacent-partial-linear"])
    tokens = tokens_for(model, n=16, batch=3)
    scores = detector_scores(model, tokens)
    _, cache = model.run(tokens, names={f"blocks.{lay}.attn.hook_pattern" for lay in range(2)})
    for layer in range(2):
        p = cache[f"blocks.{layer}.attn.hook_pattern"]  # [b, H, n, n]
        prev = torch.stack([p[:, :, i, i - 1] for i in range(1, 16)], -1).mean((0, 2))
        torch.testing.assert_close(scores["previous_token"][layer], prev, atol=1e-12, rtol=0)


def test_virtual_heads_use_the_group_value_weights():
    model = rotary_model(n_layers=2, **CASES["gqa"])
    a, b = model.blocks[0].attn, model.blocks[1].attn
    dense = a._W_V[3 // 2] @ a.W_O[3] @ b._W_V[2 // 2] @ b.W_O[2]
    torch.testing.assert_close(virtual_ov(model, (0, 3), (1, 2)).AB, dense, atol=1e-12, rtol=0)
    E, U = model.W_E, model.W_U
    full = E @ dense @ U  # [V, V]
    score = virtual_copying_scores(model, G=U @ E)[0, 3, 1, 2]
    assert abs(float(copying_score(torch.linalg.eigvals(full))) - float(score)) < 1e-8
