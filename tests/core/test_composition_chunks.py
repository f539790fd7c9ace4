"""Composition scores read layer by layer, in chunks of target layers, and their price against the memory they hold.

- The scores computed from the model's own weights (W_K, W_V per key/value group, never repeated) in 1, 2, 3 or
  L-1 target layers per chunk equal the dense float64 per-pair Frobenius formula on the repeated per-query-head
  weights, and the stacked raw_composition_scores (which composition_rotary calls) in every chunking, with and
  without grouped-query attention.
- composition.cost is never below the peak of the tensors the computation actually holds (counted op by op by
  a dispatch mode), in every chunking, and is priced from those steps (within 2x of the peak).
- K- and V-composition of grouped-query models take grouped_composition's route (large products through the shared
  key/value weights) when it pays: the GQA cases with kinds K alone go that way, the same dense scores and prices.
- The budget picks the fewest chunks whose price fits it, and the Llama-3.2-1B shape's K-composition is priced
  within the default 1 GiB in one chunk, all three kinds in more.
"""

from __future__ import annotations

import pytest
import torch
from test_composition import _dense_scores

from app.settings import Limits
from circuits_core.circuits import composition, gram_pair_sums
from circuits_core.circuits.composition import CompositionKind, composition_scores, raw_composition_scores
from circuits_core.formats.llama import llama_config
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, random_model
from tests.held_bytes import HeldBytes


def _model(n_kv: int | None, n_layers: int = 5, d_model: int = 40, seed: int = 7) -> Transformer:
    cfg = ModelConfig(n_layers=n_layers, d_model=d_model, n_heads=4, d_head=6, d_vocab=30, n_ctx=8,
                      n_key_value_heads=n_kv)  # fmt: skip
    return random_model(cfg, seed=seed, dtype=torch.float64)


@pytest.fixture(params=[False, True], ids=["one-product", "causal-groups"])
def causal_split(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Each Gram block's pair sums as one product (small models), or per group of target layers against only the
    earlier sources (large ones: composition.CAUSAL_SPLIT_PAIRS), here in groups of 5 target heads (2 layers of 4
    heads, or 1 layer per kind when kinds share a layer's columns)."""
    if request.param:
        monkeypatch.setattr(composition, "CAUSAL_SPLIT_PAIRS", 0)
        monkeypatch.setattr(composition, "CAUSAL_GROUP_TARGETS", 5)
    return bool(request.param)


@pytest.mark.parametrize("n_kv", [None, 2, 1], ids=["mha", "gqa-2-groups", "gqa-1-group"])
def test_chunked_scores_equal_dense_and_unchunked(n_kv: int | None, causal_split: bool) -> None:
    model = _model(n_kv)
    L = model.cfg.n_layers
    dense = _dense_scores(model)  # per pair, from the d x d W_OV and W_QK of the per-query-head weights
    stacked = (model.W_Q, model.W_K, model.W_V, model.W_O)
    for chunk in (1, 2, 3, L - 1):
        all_kinds: tuple[tuple[CompositionKind, ...], ...] = (("q", "k", "v"), ("k",), ("v", "q"))
        for kinds in all_kinds:
            got = composition_scores(model, kinds=kinds, n_samples=2, budget_bytes=None).raw if chunk == L - 1 else {
                kind: s for kind, s in zip(kinds, composition.layer_scores(
                    composition.model_weight(model, torch.float64),
                    (L, model.cfg.n_heads, model.cfg.group_size, model.cfg.d_model, model.cfg.d_head),
                    model.W_O, kinds, block=16, layers_per_chunk=chunk), strict=True)}  # fmt: skip
            flat = raw_composition_scores(*stacked, kinds=kinds, block=16, layers_per_chunk=chunk)
            for i, kind in enumerate(kinds):
                torch.testing.assert_close(got[kind], dense[kind], atol=1e-12, rtol=0)
                torch.testing.assert_close(flat[i], dense[kind], atol=1e-12, rtol=0)
    assert dense["k"][0, 0, L - 1].abs().min() > 0  # the last layer's targets are scored (not left at 0)


@pytest.mark.parametrize("n_kv", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("kinds", [("k",), ("q", "k", "v")])
def test_price_covers_the_held_peak_in_every_chunking(
    n_kv: int | None, kinds: tuple[CompositionKind, ...], causal_split: bool
) -> None:
    model = _model(n_kv, n_layers=6, d_model=64)
    L, cfg = model.cfg.n_layers, model.cfg
    shape = (L, cfg.n_heads, cfg.group_size, cfg.d_model, cfg.d_head)
    like = torch.empty((), dtype=torch.float64)
    peaks = []
    for chunk in (1, 2, 3, None):
        with torch.no_grad(), HeldBytes([*model.parameters(), like]) as held:
            composition.layer_scores(
                composition.model_weight(model, torch.float64), shape, like, kinds, layers_per_chunk=chunk
            )
        priced = 8 * composition.scores_numbers(model, kinds, chunk)
        assert 0 < held.peak <= priced < 2 * held.peak, (chunk, held.peak, priced)
        peaks.append(held.peak)
    if not composition.grouped_route(shape, kinds, gram_pair_sums.GRAM_BLOCK):  # (the grouped route has no chunks)
        assert peaks[0] < peaks[-1]  # chunks of one layer hold less than all targets at once


def test_the_budget_picks_the_fewest_chunks_that_fit() -> None:
    model = _model(2, n_layers=6, d_model=64)
    kinds: tuple[composition.CompositionKind, ...] = ("q", "k", "v")
    prices = {m: composition._priced(model, kinds, m).peak_bytes for m in range(1, 6)}
    assert prices[1] < prices[5]
    for m in range(1, 6):
        assert composition.layers_per_chunk(model, kinds, prices[m]) >= m  # type: ignore[operator]
        assert composition.cost(model, kinds, budget_bytes=prices[m]).peak_bytes <= prices[m]
    assert composition.layers_per_chunk(model, kinds, prices[1] - 1) == 1  # nothing fits: one layer, priced over
    assert composition.cost(model, kinds, budget_bytes=prices[1] - 1).peak_bytes > prices[1] - 1
    chosen = composition.layers_per_chunk(model, kinds, prices[2])
    fewer = composition.chunk_bounds(6, chosen)
    torch.testing.assert_close(  # the scores do not depend on the chunking the budget chose
        composition_scores(model, kinds, n_samples=2, budget_bytes=prices[2]).raw["v"],
        composition_scores(model, kinds, n_samples=2).raw["v"],
        atol=1e-12,
        rtol=0,
    )
    assert len(fewer) > 1


def test_one_billion_shape_k_composition_fits_the_default_budget() -> None:
    """one kind on the Llama-3.2-1B shape (16 layers, 32 heads, 8 key/value heads, d_model 2048),
    priced on a model built without memory, within 1 GiB (and so within Limits().peak_bytes, 3 GiB); all three kinds
    need chunks at 1 GiB."""
    from bench.modern import LLAMA_1B

    with torch.device("meta"):
        model = Transformer(llama_config(LLAMA_1B))
    budget = 1 << 30
    assert budget <= Limits().peak_bytes
    for kind in ("q", "k", "v"):
        assert composition.cost(model, (kind,), budget_bytes=budget).peak_bytes <= budget  # type: ignore[arg-type]
        assert composition.layers_per_chunk(model, (kind,), budget) == model.cfg.n_layers - 1  # type: ignore[arg-type]
    assert composition.cost(model, ("q", "k", "v"), budget_bytes=budget).peak_bytes <= budget
    assert composition.layers_per_chunk(model, ("q", "k", "v"), budget) < model.cfg.n_layers - 1  # type: ignore[operator]


@pytest.mark.parametrize("n_kv", [None, 2], ids=["mha", "gqa"])
def test_flop_price_is_what_torch_counts(n_kv: int | None, causal_split: bool) -> None:
    """composition.scores_flops against torch's FlopCounterMode over layer_scores, in every chunking and for each set
    of kinds (the workers run in this thread, where the counter sees them: a `yielding` block keeps the helper off),
    and a d_model below d_head (QR roots, not counted as products)."""
    from test_circuit_flops import IN_PLACE
    from torch.utils.flop_counter import FlopCounterMode

    from circuits_core.schedule import yielding

    for model in (_model(n_kv, n_layers=5, d_model=48), _model(n_kv, n_layers=3, d_model=4)):
        cfg = model.cfg
        shape = (cfg.n_layers, cfg.n_heads, cfg.group_size, cfg.d_model, cfg.d_head)
        for chunk in (1, 2, None):
            for kinds in (("q", "k", "v"), ("k",), ("v", "q")):
                with (
                    torch.no_grad(),
                    yielding(lambda: True),
                    FlopCounterMode(display=False, custom_mapping=IN_PLACE) as c,
                ):
                    composition.layer_scores(
                        composition.model_weight(model, torch.float64), shape, model.W_O, kinds, block=16,
                        layers_per_chunk=chunk,
                    )  # fmt: skip
                assert c.get_total_flops() == composition.scores_flops(model, kinds, chunk, block=16), (chunk, kinds)


def test_grouped_route_is_taken_where_it_pays() -> None:
    """The Llama-3.2-1B shape's K- and V-composition (4 query heads per key/value group, ~0.6x the Gram route's FLOPs)
    take the grouped route; the 8B shape's (1.24x), Q-composition, GPT-2's (no groups) and SmolLM2's (3 heads per
    group, d_model 576: the Gram route does ~5x fewer FLOPs) do not."""
    block = gram_pair_sums.GRAM_BLOCK
    assert composition.grouped_route((16, 32, 4, 2048, 64), ("k",), block)
    assert composition.grouped_route((16, 32, 4, 2048, 64), ("k", "v"), block)
    assert not composition.grouped_route((32, 32, 4, 4096, 128), ("k",), block)
    assert not composition.grouped_route((16, 32, 4, 2048, 64), ("q", "k"), block)
    assert not composition.grouped_route((12, 12, 1, 768, 64), ("k",), block)
    assert not composition.grouped_route((30, 9, 3, 576, 64), ("k",), block)
