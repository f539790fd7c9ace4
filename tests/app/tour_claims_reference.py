"""Independent references for the tour's sentences about the shipped toys (test_claims.py, test_claims_induction.py):
the tour built as the app serves it, the shipped weights as stored in float64, the evaluation data, and dense
recomputations (OV circuits, eigenvalue copying scores, forward passes, path terms) that use none of the engine's
factored circuits, path expansion or detectors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from app.registry import ModelRegistry
from app.settings import Settings
from app.tour import paper_claims as pc
from app.tour.tour import build_tour_view
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.prompt.phenomena import MIN_TRAIN_COUNT, EvalData

ROOT = Path(__file__).resolve().parents[2] / "checkpoints"


TOYS = ("toy-0l", "toy-1l", "toy-2l")


C = TypeVar("C", bound=pc.FigureClaim)


def build_served() -> tuple[dict[str, Any], ModelRegistry]:
    """The tour's figures by id as the app builds them (float32, the registry's processing), and the registry."""
    torch.set_num_threads(1)
    settings = Settings(store_url="off")
    registry = ModelRegistry(settings)
    view = build_tour_view(registry, settings.limits)
    return {f.id: f for f in view.figures}, registry


def raw_toys() -> dict[str, Any]:
    """The shipped weights exactly as stored, float64, no processing."""
    return {name: load_checkpoint(ROOT / name, dtype=torch.float64, process=False).model for name in TOYS}


def eval_data() -> EvalData:
    return EvalData.load(ROOT / "eval_data.npz")


def twin(tour, fig_id: str) -> dict[str, Any]:
    """The figure's data as its JSON twin serves it."""
    return tour[fig_id].data.model_dump(mode="json")


def claim(tour, fig_id: str, kind: type[C]) -> tuple[str, C]:
    """The figure's sentence and its measured values, read back from the figure's data as its claim type."""
    fig = tour[fig_id]
    assert fig.available, fig.detail
    return fig.look_for, kind.model_validate(fig.data.claim)


def frequent(data: EvalData) -> torch.Tensor:
    return torch.from_numpy(np.flatnonzero(data.train_counts >= MIN_TRAIN_COUNT)).long()


def dense_ov(m, layer: int, h: int) -> torch.Tensor:
    return m.W_E @ m.W_V[layer, h] @ m.W_O[layer, h] @ m.W_U  # [V, V] (no LayerNorm in the toys)


def copying_scores(m) -> dict[str, float]:
    """Eigenvalue copying score of every head from the dense [d, d] W_V W_O W_U W_E (its d_head largest eigenvalues)."""
    out = {}
    for layer in range(m.cfg.n_layers):
        for h in range(m.cfg.n_heads):
            eig = torch.linalg.eigvals(m.W_V[layer, h] @ m.W_O[layer, h] @ m.W_U @ m.W_E)
            eig = eig[eig.abs().argsort(descending=True)[: m.cfg.d_head]]
            out[f"L{layer}H{h}"] = float(eig.sum().real / eig.abs().sum())
    return out


def forward(m, ids: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits, cache = m.run(torch.tensor([ids]), names=lambda n: True)
    return logits[0], {k: v[0] for k, v in cache.items()}


# -- two layers -----------------------------------------------------------------------------------------------
def figure_ids(tour, fig_id: str, key: str) -> list[int]:
    return [t["id"] for t in twin(tour, fig_id)[key]["tokens"]]


def path_term(m, cache, path: list[str], pos: int, target: int) -> float:
    """A path term of an attention-only model without LayerNorm or biases, densely: A_k ... A_1 X0 W_OV_1 ... W_U."""
    X = cache["hook_embed"]
    for name in path:
        layer, h = int(name[1]), int(name[3:])
        X = cache[f"blocks.{layer}.attn.hook_pattern"][h] @ X @ m.W_V[layer, h] @ m.W_O[layer, h]
    return float(X[pos] @ m.W_U[:, target])
