"""The forms of the QK circuit under QK-norm, output norms and windows, each against the model's own forward pass
(float64).

- Token level ("cosine"): a token table entry at an offset is exactly the score a layer-0 head gives that query token
  on that key token, read from the model's run (before the cap), and the weight-level product without the per-token
  scalings is not.
- Weight level ("bilinear"): Ω equals W_Q Γ_q R Γ_k W_K^T formed densely from the parameters.
- Output norms: the heads' OV circuits (W_O with the gain folded) times the frozen 1 / rho_post give the layer's write.
- Windows: kernel peaks and composition peaks skip the offsets a local layer never attends.
"""

import pytest
import torch
from rotary_models import CASES, rotary_model, tokens_for

from circuits_core.circuits.composition_rotary import composition_profiles
from circuits_core.circuits.embedding import embed_eff
from circuits_core.circuits.head_circuits import full_qk_circuit, ov_circuit
from circuits_core.circuits.qk_forms import qk_form
from circuits_core.circuits.rotary import (
    full_qk_circuit_at,
    full_qk_col_at,
    full_qk_row_at,
    kernel_defined,
    kernel_peaks,
    omega,
    positional_kernel,
    rotation,
)
from circuits_core.model.hooks import Recorder
from circuits_core.prompt.qk_paths import k_composition_circuit
from circuits_core.prompt.virtual import virtual_ov


def _score(model, a, b, delta, h):
    """The model's pre-cap score of query token b (position delta) on key token a (position 0) in layer 0."""
    tokens = torch.full((1, delta + 1), a)
    tokens[0, delta] = b
    hook = "attn_scores_uncapped" if model.cfg.attn_scores_soft_cap is not None else "attn_scores"
    _, cache = model.run(tokens, names={f"blocks.0.attn.hook_{hook}"})
    return cache[f"blocks.0.attn.hook_{hook}"][0, h, delta, 0]


@pytest.mark.parametrize("case", ["gemma3", "olmo2", "qwen3", "gemma2"])
def test_token_tables_are_the_scores_the_softmax_sees(case):
    model = rotary_model(n_layers=2, **CASES[case])
    assert qk_form(model, "token") == ("exact" if model.cfg.qk_norm is None else "cosine")
    gen = torch.Generator().manual_seed(5)
    for h in (0, 3):
        for delta in (0, 2):
            table = full_qk_circuit_at(model, 0, h, delta).AB  # [V, V] (40 tokens: dense is fine here)
            for a, b in torch.randint(0, model.cfg.d_vocab, (3, 2), generator=gen).tolist():
                a = b if delta == 0 else a  # one position: the query is its own key
                real = _score(model, a, b, delta, h)
                assert abs(float(table[b, a] - real)) < 1e-10
                assert abs(float(full_qk_row_at(model, 0, h, b, delta)[a] - real)) < 1e-10
                assert abs(float(full_qk_col_at(model, 0, h, a, delta)[b] - real)) < 1e-10
                if delta == 0:
                    assert abs(float(full_qk_circuit(model, 0, h).AB[b, a] - real)) < 1e-10
        if model.cfg.qk_norm is not None:  # the weight-level form alone is not the score
            E = model.blocks[0].ln1(model.W_E[None], Recorder(None), None)[0]  # W_E_eff (W_E itself without ln1)
            weight_level = E @ omega(model, 0, h, [2]).AB[0] @ E.T / model.cfg.scale
            assert (weight_level - full_qk_circuit_at(model, 0, h, 2).AB).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["gemma3", "olmo2"])
def test_omega_is_the_gain_folded_bilinear_form(case):
    model = rotary_model(n_layers=3, **CASES[case])
    assert qk_form(model, "weight") == "bilinear"
    cfg = model.cfg
    for layer, h in ((0, 1), (2, 3)):
        attn = model.blocks[layer].attn
        g = h // cfg.group_size
        gq = attn.q_norm.w if cfg.qk_norm == "head" else attn.q_norm.w.view(cfg.n_heads, -1)[h]
        gk = attn.k_norm.w if cfg.qk_norm == "head" else attn.k_norm.w.view(cfg.n_kv_heads, -1)[g]
        R = rotation(model, [3], layer=layer)[0]
        dense = attn.W_Q[h] @ torch.diag(gq) @ R @ torch.diag(gk) @ attn.grouped("W_K")[g].T
        torch.testing.assert_close(omega(model, layer, h, [3]).AB[0], dense, atol=1e-12, rtol=0)


@pytest.mark.parametrize("case", ["gemma2", "olmo2"])
def test_ov_circuits_with_the_output_norm_give_the_layers_write(case):
    """Σ_h x W_V^h (W_O^h diag γ_post) / rho_post == hook_attn_out on a one-token prompt (every pattern is 1)."""
    model = rotary_model(n_layers=2, **CASES[case])
    t = 7
    names = {"blocks.0.hook_attn_out", "blocks.0.ln1_post.hook_scale", "blocks.0.ln1.hook_normalized"}
    _, cache = model.run(torch.tensor([[t]]), names=names)
    x = cache.get("blocks.0.ln1.hook_normalized", model.W_E[[t]][None])[0]  # [1, d]
    write = sum(x @ ov_circuit(model, 0, h).AB for h in range(model.cfg.n_heads))
    write = write / cache["blocks.0.ln1_post.hook_scale"][0]
    torch.testing.assert_close(write, cache["blocks.0.hook_attn_out"][0], atol=1e-12, rtol=0)


def test_windows_bound_kernel_and_composition_peaks():
    model = rotary_model(n_layers=3, **CASES["gemma3"])  # layers local (window 3), local, global
    offsets = torch.arange(8)
    defined = kernel_defined(model, offsets)
    assert defined[0].tolist() == [True] * 3 + [False] * 5 and bool(defined[2].all())
    tokens = tokens_for(model, n=8)
    means = model.run(tokens, names={f"blocks.{lay}.ln1.hook_normalized" for lay in range(3)})[1]
    mu = torch.stack([means[f"blocks.{lay}.ln1.hook_normalized"][0].mean(0) for lay in range(3)])
    kernel = positional_kernel(model, mu, offsets)
    peaks = kernel_peaks(kernel, offsets, defined)
    assert (peaks[:2] < 3).all()  # local layers peak inside their window
    assert bool((peaks[2] == offsets[kernel[2].argmax(-1)]).all())  # the global layer over every offset
    profiles = composition_profiles(model, offsets)
    _, where = profiles.peak("k")
    assert (where[0, :, 1] < 3).all()  # target layer 1 is local


def test_weight_circuits_fold_the_gains_the_forward_pass_keeps_apart():
    """Virtual OV and the token-space K-composition circuit, against dense products of the parameters with the output
    norms' and QK-norm's gains written in by hand (Gemma 3 shape: both kinds of gain)."""
    model = rotary_model(n_layers=2, **CASES["gemma3"])
    a, b = model.blocks[0], model.blocks[1]
    post_a, post_b = torch.diag(a.ln1_post.w), torch.diag(b.ln1_post.w)
    dense = a.attn._W_V[0] @ a.attn.W_O[3] @ post_a @ b.attn._W_V[0] @ b.attn.W_O[2] @ post_b
    torch.testing.assert_close(virtual_ov(model, (0, 3), (1, 2)).AB, dense, atol=1e-12, rtol=0)
    W_E = embed_eff(model)
    W_Q = b.attn.W_Q[1] @ torch.diag(b.attn.q_norm.w)
    W_K = b.attn._W_K[0] @ torch.diag(b.attn.k_norm.w)
    expected = W_E @ W_Q @ (W_E @ a.attn._W_V[0] @ a.attn.W_O[3] @ post_a @ W_K).T / model.cfg.scale
    torch.testing.assert_close(k_composition_circuit(model, (1, 1), (0, 3)).AB, expected, atol=1e-10, rtol=0)
