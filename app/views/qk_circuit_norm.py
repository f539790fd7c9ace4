"""QK circuit norm of every head (circuits_core/circuits/qk_circuit_norm.py): page and JSON."""

from __future__ import annotations

from pydantic import BaseModel, Field

from app import snippets
from app.analysis import Analysis
from app.page_spec import PerHeadPage
from app.params import NoParams
from app.schemas import ModelRef
from app.settings import Limits
from app.views.shared.inputs import model_ref
from circuits_core.circuits import qk_circuit_norm
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel


class QKCircuitNormView(BaseModel):
    model: ModelRef
    group_size: int = Field(description="query heads per key/value head (1 without grouped-query attention)")
    norms: list[list[float]] = Field(
        description="[layer][head] ||W_Q W_K^T||_F of the head's QK circuit (its key/value group's W_K)"
    )


def build_qk_circuit_norm_view(loaded: LoadedModel, p: NoParams, limits: Limits) -> QKCircuitNormView:
    return QKCircuitNormView(
        model=model_ref(loaded),
        group_size=loaded.model.cfg.group_size,
        norms=qk_circuit_norm.qk_circuit_norms(loaded.model).tolist(),  # [L, H]
    )


def qk_circuit_norm_cost(loaded: LoadedModel, p: NoParams, limits: Limits) -> Cost:
    return qk_circuit_norm.cost(loaded.model)


QK_CIRCUIT_NORM = Analysis(
    name="qk-circuit-norm",
    path="qk-circuit-norm",
    params=NoParams,
    view=QKCircuitNormView,
    build=build_qk_circuit_norm_view,
    cost=qk_circuit_norm_cost,
    summary="QK circuit norm of every head",
    snippet=snippets.qk_circuit_norm_body,
    tags=["circuits"],
    needs_layers=1,
    page=PerHeadPage(
        values="norms",
        title="QK circuit norm",
        explanation="The Frobenius norm ||W_Q W_K^T||_F of each head's QK circuit (d_model × d_model, computed from "
        "its d_head × d_head Gram matrices; under grouped-query attention each query head reads its key/value group's "
        "W_K).",
        quantity="||W_Q W_K^T||_F",
        nav=110,
    ),
)
