"""One head: its summary (scores from the heads table, app/views/shared/heads_table.py; spectra; positional
pattern) and the copying metrics of its full OV circuit (docs/maths.md §2.7, §2.8).
"""

from __future__ import annotations

import torch

from app import snippets
from app.analysis import Analysis, build_cached, cache_key
from app.params import CopyingParams, HeadParams, NoParams
from app.scheduling import is_cached
from app.schemas import CopyingMetricsView, HeadView, PositionalQK
from app.settings import Limits
from app.views.shared.head_spectra import spectra
from app.views.shared.heads_table import HEADS, heads_cost, num
from app.views.shared.inputs import check_k, model_ref, qk_form_fields
from app.views.shared.token_sets import token_set
from circuits_core.circuits import copying, copying_spectra
from circuits_core.circuits import head_circuits as circuits
from circuits_core.circuits.latent_circuits import term_norms
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name, parse_head

POSITIONAL_MAX_N = 128  # positions shown in the positional QK pattern


def build_copying_view(loaded: LoadedModel, p: CopyingParams, limits: Limits) -> CopyingMetricsView:
    """Diagonal sign, top-1 and top-k copying of a head's full OV circuit (rows streamed under the byte budget), over
    the token set the OV tables rank (`vocab`: a large vocabulary's stated default set, or every token)."""
    layer, h = parse_head(p.head, loaded.model.cfg)
    ranked = token_set(loaded, None, p.vocab)
    k = check_k(p.k, limits, ranked.n)
    with torch.no_grad():
        m = copying.ov_copying_metrics(
            loaded.model, layer, h, k=k, budget_bytes=limits.matrix_budget_bytes, tokens=ranked.ids
        )
        score = copying_spectra.ov_copying_scores(loaded.model)[layer, h]
    return CopyingMetricsView(
        model=model_ref(loaded),
        head=head_name(layer, h),
        ov_copying=num(score),
        diagonal_positive=m.diagonal_positive,
        diagonal_quantiles=[float(q) for q in m.diagonal_quantiles],
        top1=m.top1,
        topk=m.topk,
        k=m.k,
        n_tokens=ranked.n,
        token_set=ranked.said,
    )


def _positional(loaded: LoadedModel, layer: int, h: int) -> PositionalQK | None:
    cfg = loaded.model.cfg
    if loaded.model.W_pos is None or cfg.positional_embedding_type not in ("standard", "shortformer") or cfg.n_ctx < 2:
        return None
    pos = circuits.positional_qk(loaded.model, layer, h, n=min(cfg.n_ctx, POSITIONAL_MAX_N))
    pattern = pos.pattern.double().nan_to_num(0.0).tolist()
    return PositionalQK(
        n_positions=len(pattern), pattern=pattern, previous_token=pos.previous_token, current_token=pos.current_token
    )


def build_head_view(loaded: LoadedModel, p: HeadParams, limits: Limits) -> HeadView:
    """One head: its scores (from the heads table, cached), OV/QK spectra (eigenvalues by |lambda|, singular
    values) and positional pattern."""
    model = loaded.model
    layer, h = parse_head(p.head, model.cfg)
    name = head_name(layer, h)
    table = build_cached(HEADS, loaded, loaded.path.name, NoParams(), limits)
    scores = next(s for s in table.heads if s.head == name)
    every, index, d_head = spectra(loaded), layer * model.cfg.n_heads + h, model.cfg.d_head
    with torch.no_grad():
        ov_s = circuits.ov_circuit(model, layer, h).S  # [d_head]
        qk_s = circuits.qk_circuit(model, layer, h).S  # [d_head]
        positional = _positional(loaded, layer, h)
    return HeadView(
        model=model_ref(loaded),
        **qk_form_fields(loaded, "weight"),
        head=name,
        layer=layer,
        index=h,
        scores=scores,
        ov_eigenvalues=every.head("ov", index, d_head),
        qk_eigenvalues=every.head("qk", index, d_head),
        ov_singular_values=[float(s) for s in ov_s],
        qk_singular_values=[float(s) for s in qk_s],
        positional=positional,
        latent=term_norms(model, layer, h) if model.cfg.latent_attention else None,
    )


def head_cost(loaded: LoadedModel, p: HeadParams, limits: Limits) -> Cost:
    """The heads table (when not cached), then the head's spectra and positional pattern."""
    n = min(loaded.model.cfg.n_ctx, POSITIONAL_MAX_N)
    own = copying_spectra.head_spectra_cost(loaded.model, n)
    if is_cached(cache_key(HEADS, loaded.path.name, loaded, NoParams())):
        return own
    return heads_cost(loaded, p, limits).then(own)


def copying_cost(loaded: LoadedModel, p: CopyingParams, limits: Limits) -> Cost:
    """The metrics over the token set, then every head's eigenvalue copying score."""
    ranked = token_set(loaded, None, p.vocab)
    metrics = copying.copying_metrics_cost(
        loaded.model, p.k, limits.matrix_budget_bytes, None if ranked.ids is None else ranked.n
    )
    return metrics.then(copying_spectra.ov_copying_scores_cost(loaded.model))


HEAD = Analysis(
    name="head",
    path="heads/{head}",
    params=HeadParams,
    view=HeadView,
    build=build_head_view,
    cost=head_cost,
    summary="One head: spectra, positional pattern",
    snippet=snippets.head_body,
    tags=["heads"],
)
COPYING = Analysis(
    name="copying",
    weights="attention",
    path="heads/{head}/copying",
    params=CopyingParams,
    view=CopyingMetricsView,
    build=build_copying_view,
    cost=copying_cost,
    summary="Copying metrics of the full OV circuit",
    tags=["heads"],
)
