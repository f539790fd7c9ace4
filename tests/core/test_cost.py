"""Bounded work in the engine: chunked detector runs equal one pass, every priced loop stops on the ambient flag,
and the costs grow with what they price.

Chunked vs unchunked detector scores and the losses against a plain forward pass are compared in float64; the
stop flag is checked by setting it before the loop starts (the computation must raise CancelledError, not
finish).
"""

from __future__ import annotations

import pytest
import torch

from circuits_core.circuits import composition, copying
from circuits_core.circuits import head_circuits as circuits
from circuits_core.cost import Cost, check_stop, polled, stopping
from circuits_core.errors import CancelledError
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, next_token_losses, random_model
from circuits_core.prompt import ablation, paths, qk_paths
from circuits_core.prompt import detectors as heads
from circuits_core.prompt.frozen import run_cost

CFG = ModelConfig(
    n_layers=2,
    d_model=32,
    n_heads=4,
    d_head=8,
    d_vocab=50,
    n_ctx=64,
    d_mlp=64,
    attn_only=False,
    act_fn="gelu",
    normalization_type="LN",
    positional_embedding_type="standard",
)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return random_model(CFG, seed=1, dtype=torch.float64)


def test_chunked_detector_run_equals_one_pass(model: Transformer) -> None:
    tokens = heads.repeated_random_tokens(CFG.d_vocab, 10, 5, seed=0, bos=0)  # [5, 21], tokens repeat inside r
    whole = heads.detector_run(model, tokens, with_loss=True)
    assert heads.detector_chunk(model, tokens.shape[1], 5, budget_bytes=1, logits=True) == 1
    chunked = heads.detector_run(model, tokens, budget_bytes=1, with_loss=True)  # one sequence at a time
    assert whole.scores.keys() == chunked.scores.keys() == set(heads.PATTERN_DETECTORS)
    for name in whole.scores:
        torch.testing.assert_close(chunked.scores[name], whole.scores[name], rtol=0, atol=1e-12, equal_nan=True)
    logits, cache = model.run(tokens, names=lambda n: n.endswith("hook_pattern"))
    for layer in range(CFG.n_layers):  # scores of each layer from the independent pattern_detector_scores
        ref = heads.pattern_detector_scores(cache[f"blocks.{layer}.attn.hook_pattern"], tokens)
        for name, value in ref.items():
            torch.testing.assert_close(chunked.scores[name][layer], value, rtol=0, atol=1e-12, equal_nan=True)
    assert chunked.losses is not None and whole.losses is not None  # one chunk of 5 sequences, and 5 chunks of one
    torch.testing.assert_close(chunked.losses, next_token_losses(logits, tokens), rtol=0, atol=1e-12)
    torch.testing.assert_close(whole.losses, next_token_losses(logits, tokens), rtol=0, atol=1e-12)
    torch.testing.assert_close(chunked.first_patterns[1], cache["blocks.1.attn.hook_pattern"][0], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "loop", ["topk_global", "detectors", "paths", "qk_paths", "ablation", "composition", "copying"]
)
def test_every_priced_loop_stops_on_the_ambient_flag(model: Transformer, loop: str) -> None:
    tokens = torch.tensor([0, 5, 6, 7, 5, 6])
    runs = {
        "topk_global": lambda: circuits.full_ov_circuit(model, 1, 0).topk_global(3),
        "detectors": lambda: heads.detector_scores(model, heads.repeated_random_tokens(CFG.d_vocab, 5, 2, bos=0)),
        "paths": lambda: paths.expand_logits(model, tokens, 5, max_order=2),
        "qk_paths": lambda: qk_paths.expand_scores(model, tokens, (1, 0)),
        "ablation": lambda: ablation.order_ablation(model, tokens[None]),
        "composition": lambda: composition.composition_scores(model),
        "copying": lambda: copying.ov_copying_metrics(model, 1, 0),
    }
    runs[loop]()  # runs to the end without a flag
    with stopping(lambda: True), pytest.raises(CancelledError, match="cancelled"):
        runs[loop]()
    check_stop()  # the flag is gone after the block


def test_costs_grow_with_what_they_price(model: Transformer) -> None:
    def grows(small: Cost, big: Cost) -> None:
        assert 0 < small.peak_bytes < big.peak_bytes and 0 < small.answer_bytes < big.answer_bytes

    grows(paths.cost(model, 10, 1, k=5), paths.cost(model, 40, 2, by_source=True, k=50))
    grows(qk_paths.cost(model, 1, 10, 2), qk_paths.cost(model, 1, 40, 20))
    small, big = heads.detectors_cost(model, 21, 2), heads.detectors_cost(model, 61, 8, logits=True)
    assert 0 < small.peak_bytes < big.peak_bytes and small.answer_bytes > 0  # the answer: 5 scores per head
    grows(circuits.top_cost(model, 5, 2**20, line=True), circuits.top_cost(model, 50, 2**20, line=False))
    grows(ablation.cost(model, 8), ablation.cost(model, 40))
    grows(composition.cost(model, ("k",)), composition.cost(model, ("q", "k", "v")))
    # a frozen run holds at least the patterns and scores it keeps: L x H x n x n x 2 float64 numbers
    assert run_cost(model, 30).peak_bytes >= CFG.n_layers * CFG.n_heads * 30 * 30 * 2 * 8


def test_cost_arithmetic() -> None:
    a, b = Cost(10, 1, flops=2), Cost(4, 3, flops=5)
    assert a.then(b) == Cost(10, 4, flops=7) and a + b == Cost(14, 4, flops=7)
    assert Cost(1).with_answer(numbers=2, labels=1) == Cost(1, 2 * 22 + 64 + 1024)


def test_a_polled_forward_pass_stops_between_hooks(model: Transformer) -> None:
    asked: list[str] = []

    def flag() -> bool:  # becomes true once the pass has reached layer 1
        return any(name.startswith("blocks.1.") for name in asked)

    def keep(name: str) -> bool:
        asked.append(name)
        return False

    with pytest.raises(CancelledError, match="forward pass cancelled"):
        model.run(torch.tensor([[0, 5, 6]]), names=polled(keep, flag))
    assert asked[-1].startswith("blocks.1.") and "ln_final.hook_scale" not in asked  # stopped mid-way


def test_composition_scores_with_the_baseline_sampled_beside_them_equal_the_parts() -> None:
    """With one torch thread on a machine with an idle core, the sampled baseline runs in a helper thread: the
    scores and the baseline are exactly those computed on their own (the baseline recomputed, not cached)."""
    from circuits_core.circuits.composition import (
        BASELINE_SAMPLES,
        composition_scores,
        random_baseline,
        raw_composition_scores,
    )

    cfg = ModelConfig(n_layers=3, d_model=48, n_heads=4, d_head=8, d_vocab=50, n_ctx=16, attn_only=True)
    model = random_model(cfg, seed=3, dtype=torch.float64)
    want_raw = raw_composition_scores(model.W_Q, model.W_K, model.W_V, model.W_O, kinds=("k",))[0]
    want = random_baseline.__wrapped__(48, 8, BASELINE_SAMPLES, 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        random_baseline.cache_clear()
        got = composition_scores(model, kinds=("k",))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got.raw["k"], want_raw)
    assert (got.sampled_baseline, got.sampled_std) == want
