"""Copying of every head measured three ways, beside random weights of the same shapes (circuits_core/copying.py).

The eigenvalue score sum(lambda)/sum(|lambda|) can be near +1 while almost no token raises its own logit most,
so the page shows it beside the top-1 / top-k self-copy shares and the diagonal of each full OV circuit, and
beside what random OV weights of the model's shapes score through its own W_E and W_U.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import BaseModel, Field

from app.analysis import Analysis, AnalysisParams
from app.params import K, MinCount
from app.schemas import ModelRef
from app.settings import Limits
from app.views.basis import basis
from app.views.circuits import frequent_tokens
from app.views.inputs import check_k, model_ref
from circuits_core import circuits, copying
from circuits_core.config import head_name
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError
from circuits_core.weights import LoadedModel

N_TOP_SAMPLES = 2  # random circuits whose self-copy shares are measured (each a full [V, V] row stream)


class CopyingAllParams(AnalysisParams):
    k: K = 10
    min_count: MinCount = None
    samples: Annotated[int, Field(ge=N_TOP_SAMPLES, le=1000, description="random OV circuits drawn for the baseline")] = 200


class HeadCopying(BaseModel):
    head: str
    ov_copying: float = Field(description="eigenvalue copying score sum(eig)/sum(|eig|) of the full OV circuit")
    top1: float = Field(description="share of source tokens whose own logit is the largest of their OV row")
    topk: float = Field(description="share of source tokens whose own logit is among the k largest of their row")
    diagonal_positive: float = Field(description="share of tokens a with M[a, a] > 0")
    diagonal_median: float = Field(description="median of the diagonal M[a, a] (logits)")


class CopyingBaselineView(BaseModel):
    ov_copying_mean: float
    ov_copying_std: float
    ov_copying_min: float
    ov_copying_max: float
    top1_mean: float
    topk_mean: float
    n_samples: int
    n_top_samples: int
    seed: int = 0


class CopyingOverview(BaseModel):
    model: ModelRef
    basis: str = Field(description="which weights: raw, or which processing (centred unembedding, folded LayerNorm)")
    k: int
    n_tokens: int = Field(description="tokens ranked: the vocabulary, or those seen >= min_count times")
    min_count: int | None
    heads: list[HeadCopying]
    baseline: CopyingBaselineView = Field(description="random W_V, W_O of the model's shapes (standard normal, seeded) "
                                          "through its own W_E and W_U, the same summaries")


def build_copying_overview(loaded: LoadedModel, p: CopyingAllParams, limits: Limits) -> CopyingOverview:
    model = loaded.model
    if model.cfg.n_layers == 0:
        raise InvalidInputError("a model without attention layers has no OV circuit to measure copying on")
    vocab = frequent_tokens(loaded, p.min_count)
    n = model.cfg.d_vocab if vocab is None else int(vocab.numel())
    k = check_k(p.k, limits, n)
    with torch.no_grad():
        eig = circuits.ov_copying_scores(model)  # [L, H]
        sc = copying.self_copy(model, k=k, vocab=vocab, budget_bytes=limits.matrix_budget_bytes)
        base = copying.random_baseline(model, n_samples=p.samples, n_top_samples=N_TOP_SAMPLES, k=k, vocab=vocab,
                                       budget_bytes=limits.matrix_budget_bytes)
    heads = [
        HeadCopying(head=head_name(layer, h), ov_copying=float(eig[layer, h]), top1=float(sc.top1[layer, h]),
                    topk=float(sc.topk[layer, h]), diagonal_positive=float(sc.diagonal_positive[layer, h]),
                    diagonal_median=float(sc.diagonal_median[layer, h]))
        for layer in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)
    ]
    s = base.ov_copying
    baseline = CopyingBaselineView(ov_copying_mean=float(s.mean()), ov_copying_std=float(s.std()), ov_copying_min=float(s.min()),
                                   ov_copying_max=float(s.max()), top1_mean=float(base.top1.mean()),
                                   topk_mean=float(base.topk.mean()), n_samples=p.samples, n_top_samples=N_TOP_SAMPLES)
    return CopyingOverview(model=model_ref(loaded), basis=basis(loaded), k=k, n_tokens=n, min_count=p.min_count,
                           heads=heads, baseline=baseline)


def copying_overview_cost(loaded: LoadedModel, p: CopyingAllParams, limits: Limits) -> Cost:
    vocab = frequent_tokens(loaded, p.min_count)
    return copying.cost(loaded.model, p.k, p.samples, N_TOP_SAMPLES, limits.matrix_budget_bytes,
                        None if vocab is None else int(vocab.numel()))


COPYING_ALL = Analysis(
    name="copying-all", path="copying", params=CopyingAllParams, view=CopyingOverview, build=build_copying_overview,
    cost=copying_overview_cost, summary="Copying of every head: eigenvalue score, self-copy shares, random baseline",
    tags=["heads"], template="copying.html",
)
