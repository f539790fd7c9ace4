"""Rotary QK circuits (circuits_core/circuits/rotary.py) against independent computations in float64.

Ω_h(δ) against the forward pass's hook_attn_scores; the full QK circuit at δ against dense matrices built
from a hand-written norm; eigenvalues against dense spectra; the kernel against rotations at absolute
positions; band energies against a least-squares fit of Ω(δ) over offsets and a phase-grid quadrature.
"""

import itertools
import math

import pytest
import torch
from rotary_models import CASES, rotary_model, tokens_for

from circuits_core.circuits.copying_spectra import copying_score
from circuits_core.circuits.rotary import (
    full_qk_circuit_at,
    full_qk_col_at,
    full_qk_row_at,
    kernel_peaks,
    omega,
    positional_kernel,
    qk_copying_scores_at,
    qk_eigenvalues_at,
    reference_means,
    rotation,
)
from circuits_core.circuits.rotary_bands import band_energies
from circuits_core.circuits.skip_trigrams import skip_trigrams
from circuits_core.errors import InvalidInputError
from circuits_core.model.config import ModelConfig
from circuits_core.model.soft_cap import soft_cap
from circuits_core.model.transformer import random_model, rotary_pairs
from circuits_core.model.window import visible

IDS = list(CASES)


def normed(model, x, layer=0):
    """ln1 of layer `layer` written out by hand (RMS: x / rms * w; LN: centred, / sigma * w + b)."""
    ln, eps = model.blocks[layer].ln1, model.cfg.eps
    if model.cfg.normalization_type == "LN":
        x = x - x.mean(-1, keepdim=True)
        return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * ln.w + ln.b
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * ln.w


@pytest.mark.parametrize("case", IDS)
def test_omega_reproduces_attention_scores(case):
    """x̂_i Ω_h(i - j) x̂_j^T / s == hook_attn_scores[h, i, j] for every head and causal (i, j) the head sees, to 1e-10
    (under QK-norm Ω is the gain-folded bilinear form read through the run's rho_q(i) rho_k(j); under a cap the
    prediction is capped as the model caps it)."""
    model = rotary_model(**CASES[case])
    cfg = model.cfg
    n = 12
    tokens = tokens_for(model, n=n, batch=2)
    hooks = (
        "ln1.hook_normalized",
        "hook_resid_pre",
        "attn.hook_attn_scores",
        "attn.q_norm.hook_scale",
        "attn.k_norm.hook_scale",
    )
    _, cache = model.run(tokens, names={f"blocks.{lay}.{hook}" for lay in range(2) for hook in hooks})
    for layer in range(cfg.n_layers):
        i, j = visible(n, cfg.layer_window(layer)).nonzero(as_tuple=True)  # δ = i - j >= 0, inside the window
        x = cache.get(f"blocks.{layer}.ln1.hook_normalized", cache[f"blocks.{layer}.hook_resid_pre"])  # [b, n, d]
        for h in range(cfg.n_heads):

            def predict(offsets, h=h, x=x, i=i, j=j, layer=layer):
                pred = torch.einsum("bpd,pde,bpe->bp", x[:, i], omega(model, layer, h, offsets).AB, x[:, j]) / cfg.scale
                if cfg.qk_norm is not None:
                    rho_q = cache[f"blocks.{layer}.attn.q_norm.hook_scale"]  # [b, n, heads or 1, 1]
                    rho_k = cache[f"blocks.{layer}.attn.k_norm.hook_scale"]
                    pred = pred / (rho_q[:, i, h if cfg.qk_norm == "head" else 0, 0])
                    pred = pred / (rho_k[:, j, h // cfg.group_size if cfg.qk_norm == "head" else 0, 0])
                return soft_cap(pred, cfg.attn_scores_soft_cap)

            real = cache[f"blocks.{layer}.attn.hook_attn_scores"][:, h, i, j]
            assert (predict(i - j) - real).abs().max() < 1e-10
            # the sign of δ matters: R(j - i) instead of R(i - j) does not reproduce the scores
            assert (predict(j - i) - real).abs().max() > 1e-3


def test_omega_uses_the_group_key_weights():
    """Under GQA, query heads 0, 1 share key head 0 and heads 2, 3 key head 1 (n_heads 4, n_kv 2)."""
    model = rotary_model(**CASES["gqa"])
    W_K = model.blocks[1].attn._W_K  # [n_kv, d, dh], as stored
    for h in range(4):
        torch.testing.assert_close(omega(model, 1, h, [0]).B, W_K[h // 2].T, atol=0, rtol=0)
        torch.testing.assert_close(omega(model, 1, h, [0]).A[0], model.blocks[1].attn.W_Q[h], atol=1e-15, rtol=0)


@pytest.mark.parametrize("case", ["half", "adjacent", "partial", "gqa-adjacent-partial-linear"])
def test_rotation_layout_and_pairs(case):
    """R(δ) has the stated layout: pairs (k, k + rd/2) (rotate-half) or (2k, 2k+1) (adjacent), angle δ θ_k,
    R[first, second] = +sin, identity on dims >= rotary_dim; R(a) R(b)^T = R(a - b)."""
    model = rotary_model(**CASES[case])
    cfg = model.cfg
    rd = cfg.rotary_dim or cfg.d_head
    K = rd // 2
    ks = torch.arange(K)
    first, second = (2 * ks, 2 * ks + 1) if cfg.rotary_adjacent_pairs else (ks, ks + K)
    got_first, got_second = rotary_pairs(model.cfg)
    assert got_first.tolist() == first.tolist() and got_second.tolist() == second.tolist()
    base = cfg.rotary_base ** (-2 * ks.double() / rd) / (cfg.rope_factor if cfg.rope_type == "linear" else 1.0)
    for delta in (0, 1, 5, -3):
        expected = torch.eye(cfg.d_head, dtype=torch.float64)
        c, s = (delta * base).cos(), (delta * base).sin()
        expected[first, first], expected[second, second] = c, c
        expected[first, second], expected[second, first] = s, -s
        torch.testing.assert_close(rotation(model, [delta])[0], expected, atol=1e-14, rtol=0)
    R = rotation(model, [7, 3, 4])
    torch.testing.assert_close(R[0] @ R[1].T, R[2], atol=1e-13, rtol=0)


def test_offsets_are_checked():
    model = rotary_model()
    with pytest.raises(InvalidInputError, match="offsets"):
        rotation(model, [model.cfg.n_ctx])
    with pytest.raises(InvalidInputError, match="offsets"):
        rotation(model, [0.5])
    shortformer = random_model(ModelConfig(n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=10, n_ctx=8))
    with pytest.raises(InvalidInputError, match="rotary"):
        omega(shortformer, 0, 0, [0])


@pytest.mark.parametrize("case", ["gqa", "adjacent", "layernorm"])
def test_full_qk_circuit_at_offset_vs_dense(case):
    """E Ω(δ) E^T / s from a hand-normalised E: the whole matrix, rows, columns, global top-k, skip-trigrams."""
    model = rotary_model(**CASES[case])
    E = normed(model, model.W_E)  # [V, d]
    for layer, h, delta in ((1, 3, 2), (0, 1, 0), (1, 0, 9)):
        W_Q = model.blocks[layer].attn.W_Q[h]
        W_K = model.blocks[layer].attn.W_K[h]
        dense = E @ W_Q @ rotation(model, [delta])[0] @ W_K.T @ E.T / model.cfg.scale  # [V, V]
        fm = full_qk_circuit_at(model, layer, h, delta)
        torch.testing.assert_close(fm.AB, dense, atol=1e-11, rtol=0)
        torch.testing.assert_close(full_qk_row_at(model, layer, h, 7, delta), dense[7], atol=1e-11, rtol=0)
        torch.testing.assert_close(full_qk_col_at(model, layer, h, 5, delta), dense[:, 5], atol=1e-11, rtol=0)
        values, rows, cols = fm.topk_global(10)
        torch.testing.assert_close(values, dense.flatten().topk(10).values, atol=1e-11, rtol=0)
        torch.testing.assert_close(dense[rows, cols], values, atol=1e-11, rtol=0)
        st = skip_trigrams(model, layer, h, 5, k=4, qk_col=full_qk_col_at(model, layer, h, 5, delta))  # as the view
        assert st.dest_tokens.tolist() == dense[:, 5].topk(4).indices.tolist()
    # the circuit depends on δ (Ω(0) is TransformerLens's QK, Ω(1) is not)
    assert (full_qk_circuit_at(model, 1, 0, 1).AB - full_qk_circuit_at(model, 1, 0, 0).AB).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["gqa", "partial"])
def test_qk_copying_at_offset_vs_dense_spectrum(case):
    model = rotary_model(**CASES[case])
    E = normed(model, model.W_E)
    for delta in (0, 3):
        eig = qk_eigenvalues_at(model, delta)  # [L, H, dh]
        scores = qk_copying_scores_at(model, delta)
        for layer, h in itertools.product(range(2), range(4)):
            W_Q, W_K = model.blocks[layer].attn.W_Q[h], model.blocks[layer].attn.W_K[h]
            dense = E @ W_Q @ rotation(model, [delta])[0] @ W_K.T @ E.T / model.cfg.scale
            lam = torch.linalg.eigvals(dense)  # [V]: d_head nonzero, the rest ~0
            assert abs(float(copying_score(lam)) - float(scores[layer, h])) < 1e-8
            big = lam[lam.abs() > 1e-8]
            assert torch.allclose(big.abs().sort().values, eig[layer, h].abs().sort().values[-big.numel() :], atol=1e-8)


@pytest.mark.parametrize("case", ["gqa-adjacent-partial-linear", "layernorm"])
def test_positional_kernel_vs_rotations_at_absolute_positions(case):
    """f_h(δ) == (μ W_Q^h rotated at position p + δ) . (μ W_K^g rotated at p) / s, with μ the hand-normalised
    mean of resid_pre over positions 1.. of the reference tokens."""
    model = rotary_model(**CASES[case])
    tokens = tokens_for(model, n=20, batch=2)
    mu = reference_means(model, tokens)  # [L, d]
    _, cache = model.run(tokens, names={f"blocks.{lay}.hook_resid_pre" for lay in range(2)})
    offsets = torch.tensor([0, 3, 1, 7, 2, 9, 4, 8, 5, 6])  # out of order: an index is not an offset
    kernel = positional_kernel(model, mu, offsets)  # [L, H, n]
    peaks = kernel_peaks(kernel, offsets)
    H, n_kv = model.cfg.n_heads, model.cfg.n_key_value_heads or model.cfg.n_heads
    for layer in range(2):
        mu_ref = normed(model, cache[f"blocks.{layer}.hook_resid_pre"], layer)[:, 1:].mean((0, 1))
        torch.testing.assert_close(mu[layer], mu_ref, atol=1e-12, rtol=0)
        attn = model.blocks[layer].attn
        W_K = attn._W_K if model.cfg.n_key_value_heads else attn.W_K  # [n_kv, d, dh]: the stored key heads
        for h in range(H):
            q, k = mu_ref @ attn.W_Q[h], mu_ref @ W_K[h // (H // n_kv)]  # [dh]; query head h reads key group h // g
            p = 5
            values = []
            for n, delta in enumerate(offsets.tolist()):
                qr = model.rotate(q, torch.tensor(p + delta))
                kr = model.rotate(k, torch.tensor(p))
                values.append(float(qr @ kr) / model.cfg.scale)
                assert abs(values[-1] - float(kernel[layer, h, n])) < 1e-12
            best = max(range(len(values)), key=lambda n: values[n])  # the offset where the hand values peak
            assert int(peaks[layer, h]) == offsets.tolist()[best]


def test_positional_kernel_finds_a_planted_previous_token_head():
    """A head whose W_K is W_Q rotated back by one position (W_K = W_Q R(1)) has q_i . k_j = μ W_Q R(δ - 1) W_Q^T μ^T,
    largest at δ = 1 (R(0) = I maximises x R x^T for a single-frequency x): the kernel peak is at δ = 1."""
    model = rotary_model(n_layers=1, d_head=2, d_model=16, n_heads=4, rotary_dim=2)
    tokens = tokens_for(model, n=20)
    mu = reference_means(model, tokens)
    with torch.no_grad():
        attn = model.blocks[0].attn
        attn.W_K[2] = attn.W_Q[2] @ rotation(model, [1])[0]
    kernel = positional_kernel(model, mu, torch.arange(0, 3))
    assert int(kernel_peaks(kernel, torch.arange(0, 3))[0, 2]) == 1


@pytest.mark.parametrize("case", ["half", "partial", "gqa-adjacent-partial-linear", "gemma3"])
def test_band_energies_vs_least_squares_fit_over_offsets(case):
    """Fit Ω(δ) = Σ_k cos(δθ_k) A_k + sin(δθ_k) B_k + C by least squares over offsets 0..29 (dense Ω(δ)
    from the model's rotation), with each layer's θ_k as band_energies states them (Gemma 3: local layers at their
    own base, the global one scaled): the fit is exact, and ||A_k||^2, ||B_k||^2, ||C||^2 equal band_energies'."""
    model = rotary_model(n_layers=3, **CASES[case])
    bands = band_energies(model)
    delta = torch.arange(30, dtype=torch.float64)
    partial = (model.cfg.rotary_dim or model.cfg.d_head) < model.cfg.d_head
    for layer, h in ((0, 0), (1, 3), (2, 1)):
        theta = bands.theta[layer]
        K = theta.numel()
        basis = torch.cat(
            [(delta[:, None] * theta).cos(), (delta[:, None] * theta).sin(), torch.ones(30, 1, dtype=torch.float64)], 1
        )
        if not partial:
            basis = basis[:, :-1]  # no C
        dense = omega(model, layer, h, torch.arange(30)).AB.flatten(1)  # [30, d*d]
        coef = torch.linalg.lstsq(basis, dense).solution  # [2K (+1), d*d]
        torch.testing.assert_close(basis @ coef, dense, atol=1e-9, rtol=0)  # the layer's θ_k describe its rotation
        torch.testing.assert_close(coef[:K].pow(2).sum(-1), bands.cos_part[layer, h], atol=1e-8, rtol=1e-8)
        torch.testing.assert_close(coef[K : 2 * K].pow(2).sum(-1), bands.sin_part[layer, h], atol=1e-8, rtol=1e-8)
        C = float(coef[2 * K].pow(2).sum()) if partial else 0.0
        assert abs(C - float(bands.unrotated[layer, h])) < 1e-8
    if case == "gemma3":  # local layers 0 and 1 at base 10, the global layer 2 at base 100 with linear factor 2
        assert not torch.allclose(bands.theta[0], bands.theta[2]) and torch.equal(bands.theta[0], bands.theta[1])


def test_band_energies_phase_average():
    """The mean of ||W_Q R_φ W_K^T||^2 over the phase grid φ_k in {0, π/2, π, 3π/2} (exact for trigonometric
    polynomials of degree 2 in each phase) is ||C||^2 + Σ_k (||A_k||^2 + ||B_k||^2) / 2; and per band,
    ||A_k||^2 + ||B_k||^2 = ||W_Q[:, pair]||^2 ||W_K[:, pair]||^2."""
    model = rotary_model(n_layers=1, d_head=6, rotary_dim=4, n_heads=2)
    bands = band_energies(model)
    first, second = rotary_pairs(model.cfg)
    attn = model.blocks[0].attn
    for h in range(2):
        W_Q, W_K = attn.W_Q[h], attn.W_K[h]
        total = 0.0
        grid = list(itertools.product([0, 0.5 * math.pi, math.pi, 1.5 * math.pi], repeat=2))
        for phases in grid:
            R = torch.eye(6, dtype=torch.float64)
            for f, s, phi in zip(first.tolist(), second.tolist(), phases, strict=True):
                R[f, f], R[s, s], R[f, s], R[s, f] = math.cos(phi), math.cos(phi), math.sin(phi), -math.sin(phi)
            total += float((W_Q @ R @ W_K.T).pow(2).sum())
        expected = float(bands.unrotated[0, h]) + 0.5 * float(bands.energy[0, h].sum())
        assert abs(total / len(grid) - expected) < 1e-10 * expected
        for k in range(2):
            pair = [int(first[k]), int(second[k])]
            product = W_Q[:, pair].pow(2).sum() * W_K[:, pair].pow(2).sum()
            assert abs(float(bands.energy[0, h, k] - product)) < 1e-10 * float(product)
