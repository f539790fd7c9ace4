"""The rankings of the app's own answers, with exact ties planted, against a brute-force Python sort of the same
float64 values, whichever way the backend orders equal values (tests/another_backend.py): a head's QK score split
into its terms (zero bias components). The engine's rankings are tests/core/test_ranking.py; every analysis under
another backend, tests/app/test_device_clean.py."""

from __future__ import annotations

from pathlib import Path

import torch

from app.views.qk_paths import score_terms
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.prompt.qk_paths import expand_scores
from tests.another_backend import AnotherBackend


def by_size_then_index(values: list[float], k: int) -> list[int]:
    return sorted(range(len(values)), key=lambda i: (-abs(values[i]), i))[:k]


def test_qk_terms_of_equal_size_rank_by_component(model_dirs: tuple[Path, Path]) -> None:
    """tiny-2l has no biases: its terms with the bias components are exactly 0, and list in (query component, key
    component) order after the others."""
    model = load_checkpoint(model_dirs[0] / "tiny-2l", dtype=torch.float64).model
    tokens = torch.tensor([5, 6, 7, 8, 5, 6, 7])
    exp = expand_scores(model, tokens, (1, 0))
    C = len(exp.components)
    terms = (exp.q_parts[:, 6] @ exp.k_parts[:, 2].T / exp.scale).flatten().tolist()  # [C * C]
    stds = exp.std.flatten().tolist()
    assert terms.count(0.0) >= 3 and stds.count(0.0) >= 3  # the ties
    with AnotherBackend() as mode:
        cell = score_terms(exp, torch.zeros(7, 7), 6, 2, 7, C * C)
        pairs = exp.top_pairs(C * C)
    assert mode.calls
    assert [(t.query, t.key) for t in cell.terms] == [
        (exp.components[i // C], exp.components[i % C]) for i in by_size_then_index(terms, C * C)
    ]
    assert [(a, b) for a, b, _ in pairs] == [
        (exp.components[i // C], exp.components[i % C]) for i in by_size_then_index(stds, C * C)
    ]
