"""Virtual heads: factored virtual OV vs dense, copying score vs the [V, V] eigenvalues, virtual patterns."""

import pytest
import torch
from biased_models import small_model, tokens_for

from circuits_core.circuits.composition import composition_scores
from circuits_core.circuits.copying_spectra import copying_score
from circuits_core.circuits.embedding import embed_eff
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.virtual import (
    chain_next_token_terms,
    rank_by_contribution,
    rank_by_v_composition,
    virtual_copying_scores,
    virtual_ov,
    virtual_pattern,
)


def test_virtual_ov_and_copying_scores_vs_dense():
    model = small_model(n_layers=3, ln="LN")
    scores = virtual_copying_scores(model)
    W_E = embed_eff(model)
    for (l1, h1), (l2, h2) in [((0, 1), (1, 2)), ((0, 0), (2, 1)), ((1, 2), (2, 0))]:
        dense = model.W_V[l1, h1] @ model.W_O[l1, h1] @ model.W_V[l2, h2] @ model.W_O[l2, h2]
        torch.testing.assert_close(virtual_ov(model, (l1, h1), (l2, h2)).AB, dense, atol=1e-12, rtol=0)
        full = W_E @ dense @ model.W_U  # [V, V]
        ref = copying_score(torch.linalg.eigvals(full))
        assert abs(float(scores[l1, h1, l2, h2]) - float(ref)) < 1e-8
    assert (scores[1, :, 0] == 0).all() and (scores[1, :, 1] == 0).all()


def test_virtual_pattern_and_rankings():
    model = small_model(n_layers=2)
    tokens = tokens_for(model, n=8)
    run = frozen_run(model, tokens)
    A = virtual_pattern(run, (0, 1), (1, 0))
    torch.testing.assert_close(A.sum(-1), torch.ones(8, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (A.triu(1) == 0).all()
    top = rank_by_v_composition(model, k=3)
    v = composition_scores(model, kinds=("v",), n_samples=32).minus_baseline["v"]
    assert abs(top[0][2] - float(v.max())) < 1e-12
    l1, h1 = int(top[0][0][1]), int(top[0][0][3])
    l2, h2 = int(top[0][1][1]), int(top[0][1][3])
    assert abs(float(v[l1, h1, l2, h2]) - top[0][2]) < 1e-12
    exp = expand_logits(model, tokens, 3, positions=-1, max_order=2, run=run)
    ranked = rank_by_contribution(exp, k=4)
    assert len(ranked) == 4 and all(len(p) == 2 for p, _ in ranked)
    assert abs(ranked[0][1]) >= abs(ranked[-1][1])


@pytest.mark.parametrize(
    "case", [dict(n_layers=2), dict(n_layers=3, ln="LN", pos="standard"), dict(n_layers=2, ln="LN", mlp=True)]
)
def test_chain_next_token_terms_equal_the_path_expansion(case):
    """At each position, the chain's term on its actual next token == paths.expand_logits' term for that target."""
    model = small_model(**case)
    tokens = tokens_for(model, n=9)
    run = frozen_run(model, tokens)
    for chain in ([(0, 1)], [(0, 2), (1, 0)]):
        got = chain_next_token_terms(model, run, chain)
        names = tuple(f"L{layer}H{h}" for layer, h in chain)
        for p in range(len(tokens) - 1):
            exp = expand_logits(
                model, tokens, int(tokens[p + 1]), positions=p, max_order=len(chain), run=run, by_source=False
            )
            assert abs(float(got[p]) - float(exp.term(names).value[0])) < 1e-10, (chain, p)
    with pytest.raises(Exception, match="increasing layers"):
        chain_next_token_terms(model, run, [(1, 0), (0, 1)])


@pytest.mark.parametrize("mlp", [False, True])
def test_chain_terms_are_the_expansions_terms_of_that_chain(mlp):
    """chain_terms computes only one chain's terms; the full frozen-attention expansion (every path up to the chain's
    order, expand_logits) lists the same terms among all the others: equal for each source, in float64."""
    from circuits_core.prompt.virtual import chain_terms

    model = small_model(n_layers=3, ln="LN", mlp=mlp)
    tokens = tokens_for(model, 12, seed=3)
    run = frozen_run(model, tokens)
    target = int(run.logits_at([run.n - 1])[0].argmax())
    chain = [(1, 1), (2, 2)]  # layer 0's bias (and MLP) enter before it
    names = ("L1H1", "L2H2")
    exp = expand_logits(model, tokens, target, positions=None, max_order=2, run=run)
    expected = {}
    for i, path in enumerate(exp.paths):
        if path == names:
            expected["embed"] = exp.values[i]
        elif len(path) == 3 and path[1:] == names and path[0].startswith(("bias:", "mlp:")):
            expected[path[0]] = exp.values[i]
    got = dict(chain_terms(model, run, chain, target))
    assert got.keys() == expected.keys() and "embed" in got and len(got) == (3 if mlp else 2)
    for source, values in expected.items():
        torch.testing.assert_close(got[source], values, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "olmo2", "qwen3"])
def test_chain_terms_on_the_newest_attention_are_the_expansions_terms(name):
    """Sandwich and output-only norms scale each head's write by 1 / rho_post(i) (frozen), QK-norm and soft caps
    freeze their factors: a chain's terms (chain_terms, chain_next_token_terms) still equal the full expansion's terms
    for that chain, float64, on each of the newest families' quirks."""
    from rotary_models import CASES, rotary_model
    from rotary_models import tokens_for as rotary_tokens

    from circuits_core.prompt.virtual import chain_terms

    model = rotary_model(n_layers=3, **CASES[name])
    tokens = rotary_tokens(model, 10, seed=3)[0]
    run = frozen_run(model, tokens)
    target = int(run.logits_at([run.n - 1])[0].argmax())
    chain, names = [(1, 1), (2, 2)], ("L1H1", "L2H2")
    exp = expand_logits(model, tokens, target, positions=None, max_order=2, run=run)
    want = next(exp.values[i] for i, path in enumerate(exp.paths) if path == names)
    got = dict(chain_terms(model, run, chain, target))["embed"]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    nxt = chain_next_token_terms(model, run, chain)
    for p in range(len(tokens) - 1):
        one = expand_logits(model, tokens, int(tokens[p + 1]), positions=p, max_order=2, run=run, by_source=False)
        assert abs(float(nxt[p]) - float(one.term(names).value[0])) < 1e-10, p
