"""OV trace of every head (circuits_core/circuits/ov_trace.py): page and JSON."""

from __future__ import annotations

from app.views.shared.per_head import per_head_analysis
from circuits_core.circuits import ov_trace

OV_TRACE = per_head_analysis(
    ov_trace.ov_traces,
    ov_trace.cost,
    name="ov-trace",
    field="traces",
    summary="OV trace of every head",
    title="OV trace",
    quantity="tr(W_OV) / ||W_OV||_F",
    explanation="How much each head's OV circuit W_OV = W_V W_O (d_model × d_model; under grouped-query attention "
    "each query head reads its key/value group's W_V) maps a residual direction back onto itself: its trace over its "
    "Frobenius norm, computed from d_head × d_head products, never the d_model × d_model matrix. Positive when the "
    "head copies the direction it reads, negative when it inverts it, at most √d_head in size, 0 for a zero circuit.",
    nav=122,
)
