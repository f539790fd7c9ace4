"""The rankings of the app's own answers, with exact ties planted, against a brute-force Python sort of the same
float64 values, whichever way the backend orders equal values (tests/another_backend.py): a head's QK score split
into its terms (zero bias components), a token's row of the OV table (twin tokens), composition's strongest pairs
(twin heads). The engine's rankings are tests/core/test_ranking.py; every analysis under another backend,
tests/app/test_device_clean.py."""

from __future__ import annotations

from pathlib import Path

import torch

from app.analysis import BoundAnalyses
from app.catalog import ANALYSES
from app.views.qk_paths import score_terms
from circuits_core.circuits.head_circuits import full_ov_row
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.prompt.qk_paths import expand_scores
from tests.another_backend import AnotherBackend
from tests.app.conftest import LIMITS


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


def test_a_tokens_ov_row_ranks_twin_tokens_by_id(model_dirs: tuple[Path, Path]) -> None:
    """Tokens given the unembedding column of the row's top output token tie with it exactly: listed by id."""
    loaded = load_checkpoint(model_dirs[0] / "tiny-2l", dtype=torch.float64)
    model, source = loaded.model, 5
    top = int(full_ov_row(model, 1, 0, source).argmax())
    with torch.no_grad():
        for twin in {0, 3, model.cfg.d_vocab - 1} - {top}:
            model.unembed.W_U[:, twin] = model.unembed.W_U[:, top]
    row = full_ov_row(model, 1, 0, source).tolist()  # [d_vocab] float64
    assert row.count(max(row)) >= 3  # the ties
    ov = next(a for a in ANALYSES if a.name == "ov")
    params = BoundAnalyses(ANALYSES, LIMITS).bound(ov).model_validate({"head": "L1H0", "token": str(source), "k": 8})
    with AnotherBackend() as mode:
        view = ov.build(loaded, params.normalised(loaded), LIMITS)
    assert mode.calls
    expected = sorted(range(len(row)), key=lambda i: (-row[i], i))[:8]
    assert [e.col.id for e in view.entries] == expected


def test_composition_pairs_of_twin_heads_rank_by_heads(model_dirs: tuple[Path, Path]) -> None:
    """Layer 0's heads 1 and 2 given head 0's W_V and W_O compose equally with every later head: the strongest pairs
    list them by value, then (source, target) in head order."""
    loaded = load_checkpoint(model_dirs[0] / "tiny-2l", dtype=torch.float64)
    attn = loaded.model.blocks[0].attn
    with torch.no_grad():
        for h in (1, 2):
            attn.W_V[h].copy_(attn.W_V[0])
            attn.W_O[h].copy_(attn.W_O[0])
    composition = next(a for a in ANALYSES if a.name == "composition")
    params = BoundAnalyses(ANALYSES, LIMITS).bound(composition).model_validate({"kind": "K"}).normalised(loaded)
    with AnotherBackend() as mode:
        view = composition.build(loaded, params, LIMITS)
    assert mode.calls
    scored = [  # (score, source, target) of every pair the table shows
        (score, source, target)
        for source, row in zip(view.sources, view.scores, strict=True)
        for target, score in zip(view.targets, row, strict=True)
        if score is not None
    ]
    assert len({s for s, _, _ in scored}) < len(scored)  # the ties
    expected = sorted(scored, key=lambda e: (-e[0], head_order(e[1]), head_order(e[2])))[: len(view.top_pairs)]
    assert [(p.source, p.target) for p in view.top_pairs] == [(s, t) for _, s, t in expected]


def head_order(name: str) -> tuple[int, int]:
    layer, head = name[1:].split("H")
    return int(layer), int(head)
