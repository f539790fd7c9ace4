"""QK circuit norm of every head (circuits_core/circuits/qk_circuit_norm.py): page and JSON."""

from __future__ import annotations

from app.views.shared.per_head import per_head_analysis
from circuits_core.circuits import qk_circuit_norm

QK_CIRCUIT_NORM = per_head_analysis(
    qk_circuit_norm.qk_circuit_norms,
    qk_circuit_norm.cost,
    name="qk-circuit-norm",
    field="norms",
    summary="QK circuit norm of every head",
    title="QK circuit norm",
    quantity="||W_Q W_K^T||_F",
    explanation="The Frobenius norm ||W_Q W_K^T||_F of each head's QK circuit (d_model × d_model, computed from its "
    "d_head × d_head Gram matrices; under grouped-query attention each query head reads its key/value group's W_K).",
    qk_level="weight",
    nav=110,
)
