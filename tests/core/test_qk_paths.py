"""QK path expansion: terms sum to the real attention scores; K-composition circuit vs dense (float64)."""

import copy

import pytest
import torch
from biased_models import small_model, tokens_for
from rotary_models import rotary_model

from circuits_core.circuits.copying_spectra import copying_score
from circuits_core.circuits.embedding import embed_eff
from circuits_core.errors import CancelledError, InvalidInputError
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.qk_paths import (
    circuit_positivity,
    expand_scores,
    k_composition_circuit,
    k_composition_positivity,
)

CASES = [
    dict(n_layers=2),
    dict(n_layers=3, ln="LN"),
    dict(n_layers=2, ln="LN", pos="standard"),
    dict(n_layers=2, ln="LNPre", pos="shortformer"),
    dict(n_layers=3, ln="LN", mlp=True),
    dict(n_layers=2, ln="LN", mlp=True, parallel=True, pos="standard"),
    dict(n_layers=2, ln="LN", pos="rotary"),
    dict(n_layers=2, bias=False, pos="none"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_terms_sum_to_attention_scores(case):
    model = small_model(**case)
    tokens = tokens_for(model, n=9)
    run = frozen_run(model, tokens)
    for layer in range(1, model.cfg.n_layers):
        exp = expand_scores(model, tokens, (layer, 1), run=run, keep_terms=True)
        torch.testing.assert_close(exp.terms.sum((0, 1)), exp.scores, atol=1e-9, rtol=0)
        causal = torch.ones(9, 9, dtype=torch.bool).tril()
        real = run.cache[f"blocks.{layer}.attn.hook_attn_scores"]
        torch.testing.assert_close(exp.terms.sum((0, 1))[causal], real[1][causal], atol=1e-9, rtol=0)
        if case.get("pos") != "rotary":
            torch.testing.assert_close(
                exp.q_parts.sum(0), run.cache[f"blocks.{layer}.attn.hook_q"][:, 1], atol=1e-9, rtol=0
            )
        a, b = exp.components[1], exp.components[-2]
        torch.testing.assert_close(exp.term(a, b), exp.terms[1, len(exp.components) - 2], atol=1e-12, rtol=0)
        i, j = 0, len(exp.components) - 1
        assert abs(float(exp.std[i, j]) - float(exp.terms[i, j][causal].std())) < 1e-12
        assert len(exp.top_pairs(3)) == 3


def test_k_composition_term_equals_token_circuit():
    """docs/maths.md §5.3: (W_E W_Q W_K^T W_OV'^T W_E^T)[t][:, t] A'^T == (E W_Q)(A' E W_OV' W_K)^T (no LN, no
    biases)."""
    model = small_model(n_layers=2, bias=False)
    tokens = tokens_for(model, n=8)
    run = frozen_run(model, tokens)
    exp = expand_scores(model, tokens, (1, 2), run=run)
    fm = k_composition_circuit(model, (1, 2), (0, 1))
    A_prev = run.patterns[0, 1]  # [n, n]
    expected = fm.AB[tokens][:, tokens] @ A_prev.T
    torch.testing.assert_close(exp.term("embed", "L0H1"), expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("ln", [None, "LN"])
def test_k_composition_positivity_small_vs_dense(ln):
    model = small_model(n_layers=3, ln=ln)
    weights = torch.zeros(3, 3, dtype=torch.float64)
    weights[0, 1] = 1.0
    got = k_composition_positivity(model, weights)
    dense_one = copying_score(torch.linalg.eigvals(k_composition_circuit(model, (2, 0), (0, 1)).AB))
    assert abs(float(got[2, 0]) - float(dense_one)) < 1e-8
    assert abs(circuit_positivity(k_composition_circuit(model, (2, 0), (0, 1))) - float(dense_one)) < 1e-8
    # Olsson's weighted version over every earlier head
    w = torch.rand(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got_w = k_composition_positivity(model, w)
    for layer in (1, 2):
        for h in range(3):
            assert abs(float(got_w[layer, h]) - dense_weighted_positivity(model, w, layer, h)) < 1e-8
    assert (got_w[0] == 0).all()


def dense_weighted_positivity(model, w, layer, h):
    """Positivity of W_E W_Q^h W_K^{hT} W_sum^T W_E^T [V, V] written out densely, W_sum = sum_{l' < layer, j}
    w_j W_V^j W_O^j formed explicitly (W_K, W_V per query head: its group's under GQA)."""
    W_E, H = embed_eff(model), model.cfg.n_heads
    W_sum = sum(w[lay, j] * model.W_V[lay, j] @ model.W_O[lay, j] for lay in range(layer) for j in range(H))
    M = W_E @ model.W_Q[layer, h] @ model.W_K[layer, h].T @ W_sum.T @ W_E.T  # [V, V] dense
    return float(copying_score(torch.linalg.eigvals(M)))


def test_k_composition_positivity_sparse_weights_across_layers_vs_dense():
    """A few weighted heads in several layers (3 x d_head < d_model: the factored route, summed over layers)
    against the dense V x V token circuit with W_sum formed explicitly."""
    model = small_model(n_layers=4, ln="LN", seed=2)
    w = torch.zeros(4, 3, dtype=torch.float64)
    w[0, 1], w[1, 2], w[2, 0], w[3, 1] = 0.7, -1.3, 0.4, 5.0  # the last layer's weight is never "earlier"
    got = k_composition_positivity(model, w)
    for layer in (1, 2, 3):
        for h in range(3):
            assert abs(float(got[layer, h]) - dense_weighted_positivity(model, w, layer, h)) < 1e-8
    assert (got[0] == 0).all()


@pytest.mark.parametrize("n_kv", [1, 2])
def test_k_composition_positivity_under_gqa_vs_dense(n_kv):
    """Grouped-query attention (query heads share their group's W_K, W_V): the dense route works per key/value
    group; every head's positivity equals the dense V x V token circuit with each head's expanded W_K, W_V."""
    model = rotary_model(seed=3, n_layers=3, n_key_value_heads=n_kv)
    w = torch.rand(3, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64) - 0.3
    assert 4 * model.cfg.d_head >= model.cfg.d_model  # one layer's weighted heads already take the dense route
    got = k_composition_positivity(model, w)
    for layer in (1, 2):
        for h in range(4):
            assert abs(float(got[layer, h]) - dense_weighted_positivity(model, w, layer, h)) < 1e-8
    assert (got[0] == 0).all()


def test_k_composition_positivity_of_a_float32_model_tracks_float64():
    """Products run in the weights' precision (eigenvalues in float64): the float32 copy of a model gives the
    float64 model's positivities to float32 accuracy, on both routes (one-hot: factored; weighted: dense)."""
    model = small_model(n_layers=3, ln="LN", seed=4)
    single = copy.deepcopy(model).float()
    assert single.dtype == torch.float32
    one_hot = torch.zeros(3, 3, dtype=torch.float64)
    one_hot[0, 2] = 1.0
    weighted = torch.rand(3, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for w in (one_hot, weighted):
        want = k_composition_positivity(model, w)
        got = k_composition_positivity(single, w.float())
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert (got[1:] != 0).all()


def test_errors():
    model = small_model(n_layers=2)
    tokens = tokens_for(model)
    with pytest.raises(InvalidInputError):
        expand_scores(model, tokens, (0, 1))
    with pytest.raises(InvalidInputError):
        k_composition_circuit(model, (0, 1), (1, 0))
    with pytest.raises(CancelledError):
        expand_scores(model, tokens, (1, 0), should_stop=lambda: True)
