"""The logit path expansion on grouped-query models, its term names, and its price against its measured memory.

- Each term of a truncated expansion (its last order computed without readouts, through the first head's
  values per key/value group) equals the same term of the full expansion (computed with readouts), float64,
  on an RMS + GQA + rotary + gated-MLP + biases model.
- The term names (built on demand) equal a brute-force enumeration of (source, heads) in emission order.
- paths.cost is never below the peak of the tensors the frozen run and the expansion actually hold (counted
  op by op by a dispatch mode), and the 1B-shaped order-2 request is priced within the default
  budget.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from biased_models import small_model

from app.settings import Limits
from circuits_core.formats.llama import llama_config
from circuits_core.model.config import ModelConfig
from circuits_core.model.head_names import head_name
from circuits_core.model.transformer import Transformer
from circuits_core.prompt import paths
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.paths import expand_logits
from tests.held_bytes import HeldBytes

# small float64 models with random biases and norm weights: RMS + GQA (3 query heads, 1 key/value head) + rotary
# + gated MLP, and LayerNorm attention-only with standard positions
GQA = dict(n_layers=3, ln="RMS", pos="rotary", mlp=True, n_key_value_heads=1, gated_mlp=True, n_ctx=24)
LN_ATTN_ONLY = dict(n_layers=3, ln="LN", pos="standard", n_ctx=24)


def _tokens(cfg: ModelConfig, n: int) -> torch.Tensor:
    return torch.randint(0, cfg.d_vocab, (n,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", [GQA, LN_ATTN_ONLY], ids=["rms-gqa-rotary-mlp", "ln-attn-only"])
def test_truncated_terms_equal_full_terms_and_names_enumerate_paths(case: dict[str, Any]) -> None:
    model = small_model(**case)
    cfg = model.cfg
    tokens = _tokens(cfg, 11)
    run = frozen_run(model, tokens)
    full = expand_logits(model, tokens, (4, 9), positions=None, max_order=cfg.n_layers, run=run, by_source=False)
    logits = model(tokens[None])[0]
    torch.testing.assert_close(full.values.sum(0), logits[:, 4] - logits[:, 9], atol=1e-9, rtol=0)
    index = {p: i for i, p in enumerate(full.paths)}
    for order in range(cfg.n_layers):
        part = expand_logits(model, tokens, (4, 9), positions=[2, 10], max_order=order, run=run, by_source=True)
        assert len(part.paths) == int((full.orders <= order).sum())
        rows = torch.tensor([index[p] for p in part.paths])
        assert (full.orders[rows] == part.orders).all()
        torch.testing.assert_close(part.values, full.values[rows][:, [2, 10]], atol=1e-10, rtol=0)
        # the split over source positions: causal (nothing from after a destination), and an order-0 term is read
        # at its own position only; its sum over sources is the value by construction, so it is not what is tested
        split = part.by_source  # [T, q, n]
        assert split is not None
        dest = torch.tensor([2, 10])
        later = torch.arange(split.shape[-1])[None, :] > dest[:, None]  # [q, n]
        assert (split[:, later] == 0).all()
        elsewhere = torch.arange(split.shape[-1])[None, :] != dest[:, None]
        order0 = part.orders == 0
        assert order0.any() and (split[order0][:, elsewhere] == 0).all()
        assert order == 0 or (split[~order0][:, ~later & elsewhere] != 0).any()  # higher orders read other positions
    # names: every source x every chain of heads in increasing layers, each exactly once, in emission order
    sources = [(), *[(f"{kind}:L{layer}",) for layer in range(cfg.n_layers) for kind in (
        ("bias",) if cfg.attn_only else ("bias", "mlp"))]]  # fmt: skip
    entry = {(): 0} | {s: int(s[0].rsplit("L", 1)[1]) + 1 for s in sources[1:]}
    heads = [(layer, h) for layer in range(cfg.n_layers) for h in range(cfg.n_heads)]
    want = {("bias:unembed",)}
    for k in range(cfg.n_layers + 1):
        for chain in itertools.combinations(heads, k):
            if len({layer for layer, _ in chain}) == k:
                first = chain[0][0] if chain else cfg.n_layers
                names = tuple(head_name(*c) for c in chain)
                want |= {s + names for s in sources if entry[s] <= first}
    assert len(full.paths) == len(want) == len(set(full.paths)) and set(full.paths) == want
    assert list(full.paths) == [full.paths[i] for i in range(len(full.paths))] == full.paths[:]
    assert full.paths[-1] == ("bias:unembed",) and full.paths[-len(full.paths)] == full.paths[0]


@pytest.mark.parametrize(
    ("case", "n", "max_order", "by_source", "positions"),
    [(GQA, 12, 2, False, -1), (GQA, 12, 3, True, -1), (GQA, 9, 2, False, None), (LN_ATTN_ONLY, 16, 3, False, -1),
     (LN_ATTN_ONLY, 16, 2, True, None)],
)  # fmt: skip
def test_price_covers_the_measured_peak(
    case: dict[str, Any], n: int, max_order: int, by_source: bool, positions: int | None
) -> None:
    model = small_model(**case)
    tokens = _tokens(model.cfg, n)
    existing = [*model.parameters(), *model.buffers(), tokens]
    with torch.no_grad(), HeldBytes(existing) as held:
        exp = expand_logits(model, tokens, 5, positions=positions, max_order=max_order, by_source=by_source)
    q = exp.positions.numel()
    priced = paths.cost(model, n, max_order, by_source, q=q).peak_bytes
    assert held.peak > 0 and held.peak <= priced, (held.peak, priced)
    assert priced < 2 * held.peak, (held.peak, priced)  # priced from the same steps, not a blanket bound


def test_one_billion_shape_order_two_is_within_the_default_budget() -> None:
    """a 128-token order-2 expansion on the Llama-3.2-1B shape (16 layers, 32 heads, 8 key/value
    heads, d_model 2048, vocabulary 128,256), priced on a model built without memory."""
    from bench.modern import LLAMA_1B

    with torch.device("meta"):
        model = Transformer(llama_config(LLAMA_1B))
    price = paths.cost(model, 128, 2, by_source=False, q=1, k=30)
    assert price.peak_bytes <= Limits().peak_bytes, price
