"""Term-importance ablation: reruns vs the model and vs paths.py (two implementations), float64."""

import copy

import pytest
import torch
from engine2_models import small_model

from circuits_core.ablation import head_ablation, lm_loss, order_ablation, order_logits
from circuits_core.errors import CancelledError, InvalidInputError
from circuits_core.model import Frozen
from circuits_core.paths import expand_logits

CASES = [dict(n_layers=1), dict(n_layers=2, ln="LN"), dict(n_layers=3, ln="LN", pos="standard"), dict(n_layers=2, pos="rotary")]


def _tokens(model, b=2, n=10, seed=4):
    return torch.randint(0, model.cfg.d_vocab, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_orders_match_paths(case):
    model = small_model(**case)
    tokens = _tokens(model)
    per_order = order_logits(model, tokens)
    torch.testing.assert_close(per_order[-1], model.run(tokens)[0], atol=1e-9, rtol=0)
    seq = tokens[1]
    for target in (3, 17):
        exp = expand_logits(model, seq, target, positions=None, max_order=model.cfg.n_layers)
        cumulative = exp.order_totals().cumsum(0)  # [L + 1, n]
        for k, logits in enumerate(per_order):
            torch.testing.assert_close(logits[1, :, target], cumulative[k], atol=1e-9, rtol=0)
    result = order_ablation(model, tokens)
    assert abs(float(result.losses[-1]) - result.clean_loss) < 1e-9
    torch.testing.assert_close(result.marginal, result.losses[:-1] - result.losses[1:])
    # first-order terms of one layer == order-0 terms + that layer's order-1 terms from paths.py
    exp = expand_logits(model, seq, 5, positions=None, max_order=1)
    for layer in range(model.cfg.n_layers):
        keep = [o == 0 or (o == 1 and f"L{layer}H" in p[-1]) for p, o in zip(exp.paths, exp.orders.tolist(), strict=True)]
        want = exp.values[torch.tensor(keep)].sum(0)
        L = model.cfg.n_layers
        zero = torch.zeros(1, 10, model.cfg.d_model, dtype=torch.float64)
        _, cache = model.run(seq, names=lambda n: n.endswith(("hook_pattern", "hook_scale")))
        pats = {k: v for k, v in cache.items() if k.endswith("pattern")}
        scales = {k: v for k, v in cache.items() if k.endswith("scale")}
        _, c0 = model.run(seq, names=lambda n: n.endswith("resid_pre"), frozen=Frozen(pats, scales, dict.fromkeys(range(L), zero)))
        vr = dict.fromkeys(range(L), zero)
        vr[layer] = c0[f"blocks.{layer}.hook_resid_pre"]
        logits, _ = model.run(seq, frozen=Frozen(pats, scales, vr))
        torch.testing.assert_close(logits[0, :, 5], want, atol=1e-9, rtol=0)
        assert abs(float(lm_loss(logits, seq[None]))) > 0


def test_head_ablation_matches_zeroed_weights():
    model = small_model(n_layers=2, ln="LN")
    tokens = _tokens(model)
    got = head_ablation(model, tokens)
    clean_logits, cache = model.run(tokens, names=lambda n: n.endswith("hook_pattern"))
    for layer, h in [(0, 1), (1, 2)]:
        other = copy.deepcopy(model)
        with torch.no_grad():
            other.blocks[layer].attn.W_O[h] = 0  # result = z W_O = 0
        logits, _ = other.run(tokens, frozen=Frozen(cache))
        ref = lm_loss(logits, tokens) - lm_loss(clean_logits, tokens)
        assert abs(float(got[layer, h]) - float(ref)) < 1e-10


def test_errors():
    with pytest.raises(InvalidInputError):
        order_ablation(small_model(n_layers=2, ln="LN", mlp=True), torch.zeros(1, 5, dtype=torch.long))
    model = small_model(n_layers=2)
    with pytest.raises(CancelledError):
        order_ablation(model, _tokens(model), should_stop=lambda: True)
    with pytest.raises(CancelledError):
        head_ablation(model, _tokens(model), should_stop=lambda: True)
