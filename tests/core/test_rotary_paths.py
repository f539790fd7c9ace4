"""The frozen-attention machinery on rotary / GQA models: QK path terms, logit path terms, order
and head ablation, detectors and virtual heads, each against an independent computation in float64."""

import pytest
import torch
from rotary_models import CASES, NEWEST, rotary_model, tokens_for

from circuits_core.circuits.copying_spectra import copying_score
from circuits_core.circuits.rotary import omega
from circuits_core.model.hooks import Frozen
from circuits_core.model.soft_cap import soft_cap
from circuits_core.model.window import visible
from circuits_core.prompt.ablation import ablate_head, order_logits
from circuits_core.prompt.detectors import detector_scores
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.qk_paths import expand_scores
from circuits_core.prompt.virtual import virtual_copying_scores, virtual_ov

IDS = list(CASES)


@pytest.mark.parametrize("case", IDS)
def test_qk_path_terms_sum_to_real_scores(case):
    """Σ_(a,b) q_a k_b^T / s == hook_attn_scores (on the entries the head sees), each component rotated at its
    position; the (embed, embed) term equals y_i Ω(i - j) y_j^T / s with y the normalised embedding component (under
    QK-norm divided by the run's rho_q(i) rho_k(j), Ω with the gains folded; under a cap times the entry's frozen cap
    factor)."""
    model = rotary_model(n_layers=3, **CASES[case])
    cfg = model.cfg
    tokens = tokens_for(model, n=10)
    run = frozen_run(model, tokens)
    for layer, h in ((1, 3), (2, 0)):
        seen = visible(10, cfg.layer_window(layer))
        i, j = seen.nonzero(as_tuple=True)
        exp = expand_scores(model, tokens, (layer, h), run=run, keep_terms=True)
        real = run.cache[f"blocks.{layer}.attn.hook_attn_scores"][h]
        torch.testing.assert_close(exp.terms.sum((0, 1))[seen], real[seen], atol=1e-10, rtol=0)
        ln1 = model.blocks[layer].ln1
        y = run.cache["hook_embed"]
        if cfg.normalization_type == "LN":
            y = y - y.mean(-1, keepdim=True)
        if ln1.kind is not None:
            y = y * run.inv_scale(f"blocks.{layer}.ln1")[:, None] * ln1.w
        Om = omega(model, layer, h, torch.arange(10)).AB  # [n, d, d]
        expected = torch.einsum("pd,pde,pe->p", y[i], Om[i - j], y[j]) / cfg.scale
        if cfg.qk_norm is not None:
            rho_q = run.cache[f"blocks.{layer}.attn.q_norm.hook_scale"][:, h if cfg.qk_norm == "head" else 0, 0]
            group = h // cfg.group_size if cfg.qk_norm == "head" else 0
            rho_k = run.cache[f"blocks.{layer}.attn.k_norm.hook_scale"][:, group, 0]
            expected = expected / (rho_q[i] * rho_k[j])
        if cfg.attn_scores_soft_cap is not None:
            expected = expected * exp.cap_factor[i, j]
            assert exp.beyond_cap > 0  # the cap bites on this prompt
        torch.testing.assert_close(exp.term("embed", "embed")[seen], expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("case", ["gqa", "gqa-adjacent-partial-linear", "layernorm", *NEWEST])
def test_logit_paths_and_order_ablation_reproduce_the_forward_pass(case):
    model = rotary_model(n_layers=2, **CASES[case])
    tokens = tokens_for(model, n=9)
    logits = model.run(tokens)[0][0]  # [n, V], a plain forward pass
    exp = expand_logits(model, tokens, target=5, positions=None, max_order=2)
    torch.testing.assert_close(exp.total, logits[:, 5], atol=1e-10, rtol=0)
    cumulative = exp.order_totals().cumsum(0)  # [3, n]: paths of order <= k, from paths.py
    cap = model.cfg.output_logits_soft_cap
    if cap is not None:  # the expansion freezes the full logit's cap factor g; a rerun caps its own truncated logit
        g = logits[:, 5] / model.run(tokens, names={"hook_logits_uncapped"})[1]["hook_logits_uncapped"][0, :, 5]
        cumulative = soft_cap(cumulative / g, cap)
    for k, per_order in enumerate(order_logits(model, tokens)):  # the reruns, another implementation
        torch.testing.assert_close(per_order[0, :, 5], cumulative[k], atol=1e-10, rtol=0)


@pytest.mark.parametrize("case", NEWEST)
def test_every_logit_path_sums_to_the_capped_logit(case):
    """On the newest attention (output norms frozen per token, the logit cap's factor frozen per destination) the
    terms of the full expansion, with no remainder, sum to the model's logits (and logit differences) in float64."""
    model = rotary_model(n_layers=2, **CASES[case])
    tokens = tokens_for(model, n=9)
    logits = model.run(tokens)[0][0]  # [n, V], a plain forward pass (soft-capped if the model caps)
    cap = model.cfg.output_logits_soft_cap
    if cap is not None:
        assert (model.run(tokens, names={"hook_logits_uncapped"})[1]["hook_logits_uncapped"].abs() > cap).any()
    for target in (5, (3, 11)):
        real = logits[:, target] if isinstance(target, int) else logits[:, target[0]] - logits[:, target[1]]
        exp = expand_logits(model, tokens, target=target, positions=None, max_order=2)
        torch.testing.assert_close(exp.values.sum(0), real, atol=1e-9, rtol=0)
        torch.testing.assert_close(exp.by_source.sum(-1), exp.values, atol=1e-12, rtol=0)


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


@pytest.mark.parametrize("case", NEWEST)
def test_a_frozen_run_takes_every_norm_scale_the_model_divides_by(case):
    """Frozen with the clean run's patterns and every scale (input, output and QK-norm ones) reproduces the logits;
    doubling the frozen QK-norm or output-norm scales of one layer changes them (the hooks are really read)."""
    model = rotary_model(n_layers=2, **CASES[case])
    tokens = tokens_for(model, n=9)
    logits, cache = model.run(tokens, names=lambda n: n.endswith(("hook_pattern", "hook_scale")))
    patterns = {k: v for k, v in cache.items() if k.endswith("hook_pattern")}
    scales = {k: v for k, v in cache.items() if k.endswith("hook_scale")}
    frozen = model.run(tokens, frozen=Frozen(patterns=patterns, ln_scales=scales))[0]
    torch.testing.assert_close(frozen, logits, atol=1e-12, rtol=0)
    for kind in ("attn.q_norm", "ln1_post"):
        key = f"blocks.0.{kind}.hook_scale"
        if key in scales:
            changed = {**scales, key: 2 * scales[key]}
            unfrozen = {} if kind == "attn.q_norm" else patterns  # q_norm acts through the patterns
            moved = model.run(tokens, frozen=Frozen(patterns=unfrozen, ln_scales=changed))[0]
            assert (moved - logits).abs().max() > 1e-6
