"""The tour's residual-stream section (app/tour/residual.py) on the shipped toy-2l: every number in its
sentences recomputed here from dense float64 products and SVDs of the served weights, so a sentence that stops
being true fails CI."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from app.registry import ModelRegistry
from app.settings import Settings
from app.tour import paper_claims
from app.tour import residual as tour_residual
from circuits_core.circuits import erasure as stream_erasure
from circuits_core.circuits import stream_components as sc
from circuits_core.circuits import virtual_weight_table as vwt
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from tests.app.conftest import LIMITS
from tests.core.test_virtual_weights import dense_reader, dense_writer

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


@pytest.fixture(scope="module")
def toy() -> LoadedModel:
    return load_checkpoint(CHECKPOINTS / "toy-2l", dtype=torch.float64)


@pytest.fixture(scope="module")
def chapter() -> dict:
    registry = ModelRegistry(
        Settings(shipped_dir=CHECKPOINTS, models_dir=CHECKPOINTS / "none", dtype="float64", limits=LIMITS)
    )
    return {f.id: f for f in tour_residual.residual_chapter(registry, LIMITS)}


@pytest.fixture(scope="module")
def dense(toy: LoadedModel) -> dict:
    """Every reachable pair's score from dense products, and the writers' dense matrices."""
    m = toy.model
    W = {w.name: dense_writer(m, w) for w in sc.writers(m)}
    R = {r.name: dense_reader(m, r) for r in sc.readers(m)}
    scores = {
        (w.name, r.name): float((W[w.name] @ R[r.name]).norm() / (W[w.name].norm() * R[r.name].norm()))
        for w in sc.writers(m)
        for r in sc.readers(m)
        if sc.reaches(m, w, r)
    }
    return {"W": W, "scores": scores}


def test_the_section_is_available_with_links(chapter: dict) -> None:
    assert list(chapter) == ["F2", "F3", "F4"]
    for f in chapter.values():
        assert f.available and "Measured:" in f.look_for and f.link.startswith("/models/toy-2l/residual")
        assert f.api == "/api/v1" + f.link


def test_f2_channel_counts_and_strongest_pair(chapter: dict, toy: LoadedModel, dense: dict) -> None:
    v = paper_claims.ChannelClaim.model_validate(chapter["F2"].data.claim)  # as the JSON twin carries it
    m = toy.model
    baseline = 1 / math.sqrt(m.cfg.d_model)
    heads = {k: s for k, s in dense["scores"].items() if k[0].startswith("L") and k[1].endswith((".Q", ".K", ".V"))}
    assert (v.writers, v.readers, v.pairs) == (len(dense["W"]), len(sc.readers(m)), len(dense["scores"]))
    assert v.head_pairs == len(heads) == 2 * 8 * 8 * 3 // 2  # layer-0 heads -> layer-1 Q, K, V
    assert v.above == sum(s > baseline for s in heads.values())
    best = max(dense["scores"].items(), key=lambda kv: kv[1])
    assert list(v.best[:2]) == list(best[0]) and v.best[2] == pytest.approx(best[1], rel=1e-9)
    assert f"{v.above} of its {v.head_pairs}" in chapter["F2"].look_for


def test_f3_embedding_reader_and_its_tokens(chapter: dict, toy: LoadedModel, dense: dict) -> None:
    v = paper_claims.EmbeddingReaderClaim.model_validate(chapter["F3"].data.claim)  # as the JSON twin carries it
    readers = {r: s for (w, r), s in dense["scores"].items() if w == "embed"}
    assert v.reader == max(readers, key=readers.get) and v.score == pytest.approx(readers[v.reader], rel=1e-9)
    vw_dense = dense["W"]["embed"] @ dense_reader(toy.model, sc.parse_reader(toy.model, v.reader))
    U, S, _ = torch.linalg.svd(vw_dense, full_matrices=False)
    assert v.sigma == pytest.approx(float(S[0]), rel=1e-9)
    u = U[:, 0] if U[v.top[0], 0] > 0 else -U[:, 0]  # the direction's sign is free
    n = len(v.top)
    assert v.top == u.topk(n).indices.tolist() and v.bottom == (-u).topk(n).indices.tolist()
    assert "no norm between layers" in chapter["F3"].look_for


def test_f4_bandwidth_and_erasure(chapter: dict, toy: LoadedModel, dense: dict) -> None:
    v = paper_claims.BandwidthClaim.model_validate(chapter["F4"].data.claim)  # as the JSON twin carries it
    d = toy.model.cfg.d_model
    bases = {}
    for name, W in dense["W"].items():
        _, S, Vh = torch.linalg.svd(W, full_matrices=False)
        share = S.pow(2).cumsum(0) / S.pow(2).sum()
        k = int((share < 0.9 - 1e-12).sum()) + 1
        bases[name] = Vh[:k].T  # [d, k] stream side
    assert v.total_dims == sum(b.shape[1] for b in bases.values()) and v.d_model == d
    load = sum(b @ b.T for b in bases.values())
    lam, E = torch.linalg.eigh(load)
    assert v.used_dims == pytest.approx(float(lam.sum() ** 2 / lam.pow(2).sum()), rel=1e-9)
    assert v.crowded_load == pytest.approx(float(lam[-1]), rel=1e-9)
    shares = {n: float((b.T @ E[:, -1]).pow(2).sum()) for n, b in bases.items()}
    assert v.crowded_writers == sorted(shares, key=shares.get, reverse=True)[:2]
    if v.erasure is not None:
        writer, eraser, score, z = v.erasure
        U, W_OV = bases[writer], dense["W"][eraser]
        expected = -torch.trace(U.T @ W_OV @ U) / (math.sqrt(U.shape[1]) * (U.T @ W_OV).norm())
        assert score == pytest.approx(float(expected), rel=1e-8) and score > 0 and z > 5
        assert f"{eraser} reads {writer}'s subspace" in chapter["F4"].look_for


def test_the_section_is_priced_by_the_engine_costs(toy: LoadedModel) -> None:
    registry = ModelRegistry(
        Settings(shipped_dir=CHECKPOINTS, models_dir=CHECKPOINTS / "none", dtype="float64", limits=LIMITS)
    )
    cost = tour_residual.residual_chapter_cost(registry, LIMITS)
    m = registry.get("toy-2l").model
    assert cost.peak_bytes >= max(vwt.all_scores_cost(m).peak_bytes, stream_erasure.erasure_cost(m).peak_bytes)
    assert cost.answer_bytes > 0
    empty = ModelRegistry(
        Settings(shipped_dir=CHECKPOINTS / "none", models_dir=CHECKPOINTS / "none", dtype="float64", limits=LIMITS)
    )
    assert tour_residual.residual_chapter_cost(empty, LIMITS).peak_bytes == 0
