"""QK symmetry of every head (circuits_core/circuits/qk_symmetry.py): page and JSON."""

from __future__ import annotations

from app.views.shared.per_head import per_head_analysis
from circuits_core.circuits import qk_symmetry

QK_SYMMETRY = per_head_analysis(
    qk_symmetry.qk_symmetries,
    qk_symmetry.cost,
    name="qk-symmetry",
    field="symmetries",
    summary="QK symmetry of every head",
    title="QK symmetry",
    quantity="trace(W_QK W_QK) / ||W_QK||_F²",
    explanation="How symmetric each head's QK circuit W_QK = W_Q W_K^T is: (|S|² − |A|²) / (|S|² + |A|²) for its "
    "symmetric and antisymmetric parts S and A, computed from d_head × d_head products, never the d_model × d_model "
    "matrix. 1 when a query x scores a key y as y would score x, −1 when the scores swap sign, 0 for a zero circuit; "
    "on rotary models, the form of a query and a key at the same position.",
    qk_level="weight",
    nav=115,
)
