"""The copying overview (/copying) and each head page's panel (/copying?heads=<head>) share their work
(precompute fills 144 such panels on GPT-2): a circuit's source rows (a head's, or one of the random baseline's) are
measured once per sample and kept in the result cache, read by the overview and the panels alike, and a smaller sample
is read off a larger one of the same seed (its first rows); the random circuits' eigenvalue scores are computed once
per (weights, samples), and the heads' eigenvalue scores come from the cached spectra of all heads. Checked by counting
the engine's calls and against the engine called directly and dense float64 circuits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

import app.views.copying as copying_view
from app.main import create_app
from app.settings import Settings
from circuits_core.circuits import copying, copying_spectra
from circuits_core.formats.checkpoint import load_checkpoint
from tests.app.conftest import LIMITS


def counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    inner = getattr(copying, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(copying_view.copying, name, counted)
    return calls


def counting_circuits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per circuit whose rows the engine measures (copying.rows_ranks takes several at once)."""
    calls: list[int] = []
    inner = copying.rows_ranks

    def counted(model: object, circuits: list[object], *args: object, **kwargs: object) -> object:
        calls.extend(1 for _ in circuits)
        return inner(model, circuits, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(copying_view.copying, "rows_ranks", counted)
    return calls


def test_panels_and_overview_measure_each_circuit_once(
    model_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, eig = counting_circuits(monkeypatch), counting(monkeypatch, "random_eig_scores")
    monkeypatch.setattr(copying, "STACK_CIRCUITS", 3)  # several batches of heads, taken in turn by two threads
    settings = Settings(
        shipped_dir=model_dirs[0], models_dir=model_dirs[1], dtype="float64", store_url="off", limits=LIMITS
    )
    with TestClient(create_app(settings)) as c:
        answers = [
            c.get("/api/v1/models/tiny-2l/copying", params={"heads": h, "samples": 20}).json() for h in ("L0H1", "L1H3")
        ]
        assert (len(rows), len(eig)) == (2 + copying_view.N_TOP_SAMPLES, 1)  # two heads, the baseline's circuits once
        overview = c.get("/api/v1/models/tiny-2l/copying", params={"samples": 20}).json()
    model = load_checkpoint(model_dirs[0] / "tiny-2l", dtype=torch.float64).model
    L, H = model.cfg.n_layers, model.cfg.n_heads
    assert len(rows) == L * H + copying_view.N_TOP_SAMPLES and len(eig) == 1  # the overview measured only the others
    assert answers[0]["baseline"] == answers[1]["baseline"] == overview["baseline"]
    by_head = {row["head"]: row for row in overview["heads"]}
    assert answers[0]["heads"][0] == by_head["L0H1"] and answers[1]["heads"][0] == by_head["L1H3"]

    n = model.cfg.d_vocab  # the engine, uncached
    base = copying.random_baseline(
        model,
        n_samples=20,
        n_top_samples=copying_view.N_TOP_SAMPLES,
        k=10,
        rows=copying_view.default_rows(n, None, 1),
        budget_bytes=LIMITS.matrix_budget_bytes,
    )
    assert answers[0]["baseline"]["ov_copying_mean"] == pytest.approx(float(base.ov_copying.mean()), rel=1e-12)
    assert answers[0]["baseline"]["ov_copying_std"] == pytest.approx(float(base.ov_copying.std()), rel=1e-12)
    assert answers[0]["baseline"]["top1_mean"] == pytest.approx(float(base.top1.mean()), abs=1e-12)
    assert answers[0]["baseline"]["topk_mean"] == pytest.approx(float(base.topk.mean()), abs=1e-12)
    sc = copying.self_copy(model, k=10)
    scores = copying_spectra.ov_copying_scores(model)  # [L, H], straight from the weights
    for layer in range(L):
        for h in range(H):
            row = by_head[f"L{layer}H{h}"]
            assert row["ov_copying"] == pytest.approx(float(scores[layer, h]), abs=1e-12)
            assert [row["top1"], row["topk"], row["diagonal_positive"], row["diagonal_median"]] == pytest.approx(
                [
                    float(sc.top1[layer, h]),
                    float(sc.topk[layer, h]),
                    float(sc.diagonal_positive[layer, h]),
                    float(sc.diagonal_median[layer, h]),
                ],
                abs=1e-12,
            )


def test_a_smaller_sample_is_read_off_the_panels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over FULL_ROWS_MAX tokens a head's panel measures MAX_ROWS sampled rows; an overview asking fewer rows reads the
    first of them (the same rows as its own draw) instead of measuring again, and equals the dense rows of its draw."""
    from circuits_core.model.config import ModelConfig
    from tests.app.conftest import save_qkov, train_tokenizer

    V, r, k = copying_view.FULL_ROWS_MAX + 100, 300, 3
    cfg = ModelConfig(
        n_layers=1, d_model=8, n_heads=2, d_head=4, d_vocab=V, n_ctx=16, positional_embedding_type="shortformer"
    )
    save_qkov(tmp_path / "wide", cfg, train_tokenizer(), seed=3)
    rows = counting_circuits(monkeypatch)
    with TestClient(create_app(Settings(shipped_dir=tmp_path, dtype="float64", store_url="off"))) as c:
        panel = c.get("/api/v1/models/wide/copying", params={"k": k, "samples": 4, "heads": "L0H1"}).json()
        assert panel["n_rows"] == copying_view.MAX_ROWS and len(rows) == 1 + copying_view.N_TOP_SAMPLES
        body = c.get("/api/v1/models/wide/copying", params={"k": k, "samples": 4, "rows": r}).json()
    assert len(rows) == 2 + copying_view.N_TOP_SAMPLES  # only L0H0 measured: L0H1 and the baseline read off the panel's
    m = load_checkpoint(tmp_path / "wide", dtype=torch.float64).model
    picked = torch.randperm(V, generator=torch.Generator().manual_seed(copying_view.SAMPLE_SEED))[
        :r
    ]  # the documented draw
    assert body["n_rows"] == r
    for h, row in enumerate(body["heads"]):
        M = (m.W_E @ m.W_V[0, h] @ m.W_O[0, h] @ m.W_U)[picked]  # [r, V] the dense rows of the draw
        top = M.topk(k, dim=1).indices
        diag = M[torch.arange(r), picked]
        want = [
            float((top[:, 0] == picked).double().mean()),
            float((top == picked[:, None]).any(1).double().mean()),
            float((diag > 0).double().mean()),
            float(diag.quantile(0.5)),
        ]
        assert [row["top1"], row["topk"], row["diagonal_positive"], row["diagonal_median"]] == pytest.approx(
            want, abs=1e-12
        )
    base = copying.random_baseline(m, n_samples=4, n_top_samples=copying_view.N_TOP_SAMPLES, k=k, rows=r)
    assert body["baseline"]["top1_mean"] == pytest.approx(float(base.top1.mean()), abs=1e-12)
    assert body["baseline"]["topk_mean"] == pytest.approx(float(base.topk.mean()), abs=1e-12)
