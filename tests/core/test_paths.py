"""Frozen-attention logit path expansion: terms sum to the real logits; terms match dense brute force (float64)."""

import itertools

import pytest
import torch
from biased_models import small_model, tokens_for

from circuits_core.errors import CancelledError, InvalidInputError, LimitExceededError
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.paths import expand_logits

CASES = [
    dict(n_layers=1),
    dict(n_layers=2),
    dict(n_layers=3),
    dict(n_layers=2, ln="LN"),
    dict(n_layers=3, ln="LN", pos="standard"),
    dict(n_layers=2, ln="LNPre"),
    dict(n_layers=2, pos="standard"),
    dict(n_layers=2, ln="LN", pos="rotary"),
    dict(n_layers=1, pos="none"),
    dict(n_layers=2, ln="LN", mlp=True),
    dict(n_layers=3, ln="LN", mlp=True, pos="standard"),
    dict(n_layers=2, ln="LN", mlp=True, parallel=True),
    dict(n_layers=2, bias=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_full_expansion_sums_to_logits(case):
    model = small_model(**case)
    tokens = tokens_for(model)
    run = frozen_run(model, tokens)
    with torch.no_grad():
        logits = model.run(tokens[None])[0][0]  # [n, V]: a separate plain forward pass (nothing recorded or frozen)
    for target in (7, (3, 11)):
        real = logits[:, target] if isinstance(target, int) else logits[:, target[0]] - logits[:, target[1]]  # [n]
        full = expand_logits(model, tokens, target, positions=None, max_order=model.cfg.n_layers, run=run)
        torch.testing.assert_close(full.values.sum(0), real, atol=1e-9, rtol=0)  # every path, no remainder
        # truncated expansion: same explicit terms, remainder == sum of the higher-order ones
        for k in range(model.cfg.n_layers):
            part = expand_logits(model, tokens, target, positions=None, max_order=k, run=run, by_source=False)
            keep = full.orders <= k
            assert [p for p, o in zip(full.paths, full.orders, strict=True) if o <= k] == part.paths
            torch.testing.assert_close(part.values, full.values[keep], atol=1e-12, rtol=0)
            torch.testing.assert_close(part.remainder, full.values[~keep].sum(0), atol=1e-9, rtol=0)
            torch.testing.assert_close(part.value, real, atol=1e-9, rtol=0)  # the value it reports is the model's


def _dense_head_terms(model, run, target, p):
    """Brute force: x0 through every path of heads (all orders) with dense d x d W_OV, at destination p.

    {path: [n]}: the term split over the position j of the embedding it starts from (x0 placed alone in row j,
    propagated through each head of the path with the frozen patterns and LayerNorm scales)."""
    cfg = model.cfg
    d = cfg.d_model
    C = torch.eye(d, dtype=torch.float64) - (1.0 / d if cfg.normalization_type else 0.0)
    x0 = run.cache["hook_embed"] + (run.cache["hook_pos_embed"] if cfg.positional_embedding_type == "standard" else 0)
    u = model.W_U[:, target]
    if cfg.normalization_type == "LN":
        u = model.ln_final.w * u
    out = {}
    heads = [(lay, h) for lay in range(cfg.n_layers) for h in range(cfg.n_heads)]
    for k in range(cfg.n_layers + 1):
        for path in itertools.combinations(heads, k):
            if len({lay for lay, _ in path}) < k:
                continue
            X = torch.diag_embed(x0.T).permute(1, 2, 0)  # [n (source j), n (position), d]: x0[j] alone in row j
            for lay, h in path:
                D = run.inv_scale(f"blocks.{lay}.ln1")[None, :, None]
                w = model.blocks[lay].ln1.w if cfg.normalization_type == "LN" else torch.ones(d, dtype=torch.float64)
                W_OV = C @ torch.diag(w) @ model.W_V[lay, h] @ model.W_O[lay, h]  # [d, d] dense
                X = run.patterns[lay, h] @ (D * X) @ W_OV
            val = run.inv_scale("ln_final")[p] * (X[:, p] @ C @ u)  # [n]
            out[tuple(f"L{lay}H{h}" for lay, h in path)] = val
    return out


@pytest.mark.parametrize(
    "case", [dict(n_layers=2), dict(n_layers=3, ln="LN", pos="standard"), dict(n_layers=2, ln="LN", mlp=True)]
)
def test_terms_match_dense_brute_force(case):
    """Each head path's value and its split over source positions against the dense brute force."""
    model = small_model(**case)
    tokens = tokens_for(model, n=8)
    run = frozen_run(model, tokens)
    exp = expand_logits(model, tokens, 5, positions=6, max_order=model.cfg.n_layers, run=run)
    dense = _dense_head_terms(model, run, 5, 6)
    assert len(dense) > model.cfg.n_heads
    for path, by_source in dense.items():
        term = exp.term(path)
        assert abs(float(term.value[0]) - float(by_source.sum())) < 1e-10, path
        torch.testing.assert_close(term.by_source[0], by_source, atol=1e-10, rtol=0, msg=str(path))


def test_first_order_head_term_by_source_matches_pattern():
    """Order-1 term split by source position j = A[p, j] D[j] (x0[j] C diag(w) W_OV C r) inv_f[p], computed here
    row by row from the cached activations; the direct path reads only the destination row."""
    model = small_model(n_layers=2, ln="LN")
    tokens = tokens_for(model, n=9)
    run = frozen_run(model, tokens)
    exp = expand_logits(model, tokens, 4, positions=-1, max_order=1, run=run)
    term = exp.term(("L1H2",))
    x0 = run.cache["hook_embed"]  # shortformer: W_pos is not in the residual stream
    ln1 = model.blocks[1].ln1
    centred = x0 - x0.mean(-1, keepdim=True)
    r = model.ln_final.w * model.W_U[:, 4]
    r = r - r.mean()
    inv_f = 1.0 / run.cache["ln_final.hook_scale"][8, 0]
    D = 1.0 / run.cache["blocks.1.ln1.hook_scale"][:, 0]
    want = torch.stack(
        [
            run.patterns[1, 2, 8, j] * D[j] * ((centred[j] * ln1.w) @ model.W_V[1, 2] @ model.W_O[1, 2] @ r) * inv_f
            for j in range(9)
        ]
    )
    torch.testing.assert_close(term.by_source[0], want, atol=1e-10, rtol=0)
    assert want.abs().max() > 1e-3  # a non-trivial comparison
    direct = exp.term(()).by_source[0]
    assert (direct[:8] == 0).all() and direct[8] != 0


def test_errors_and_cancel():
    model = small_model(n_layers=2)
    tokens = tokens_for(model)
    with pytest.raises(InvalidInputError):
        expand_logits(model, tokens, 7, positions=99)
    with pytest.raises(InvalidInputError):
        expand_logits(model, tokens, 10_000)
    with pytest.raises(LimitExceededError):
        expand_logits(model, tokens, 7, positions=None, max_elements=10)
    with pytest.raises(CancelledError):
        expand_logits(model, tokens, 7, should_stop=lambda: True)
