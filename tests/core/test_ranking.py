"""The rankings answers give, with exact ties planted, against a brute-force Python sort of the same float64 values,
whichever way the backend orders equal values (tests/another_backend.py; docs/maths.md §1.7)."""

from __future__ import annotations

from typing import Any

import torch

from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, random_model
from circuits_core.prompt.paths import expand_logits
from tests.another_backend import AnotherBackend


def tiny_model(**fields: Any) -> Transformer:
    cfg = dict(n_layers=2, d_model=16, n_heads=2, d_head=4, d_vocab=40, n_ctx=10, attn_only=True) | fields
    return random_model(ModelConfig(**cfg), seed=0, dtype=torch.float64)


def test_path_terms_of_equal_size_rank_in_the_expansions_order() -> None:
    """Without biases, the bias terms (and every path from them) are exactly 0: they rank after the others, in the
    expansion's own order, on either backend (the first GPU check listed two of them swapped)."""
    model = tiny_model(normalization_type="LN", positional_embedding_type="standard")
    exp = expand_logits(model, torch.tensor([1, 5, 7, 2, 5]), target=3, max_order=2, by_source=False)
    values = exp.values[:, 0].tolist()  # [T] float64
    assert values.count(0.0) >= 3  # the planted ties
    expected = sorted(range(len(values)), key=lambda i: (-abs(values[i]), i))
    with AnotherBackend() as mode:
        assert exp.ranked(0).tolist() == expected
        assert [t.path for t in exp.top(len(values))] == [exp.paths[i] for i in expected]
    assert mode.calls
