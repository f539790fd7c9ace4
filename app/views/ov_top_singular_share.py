"""OV top singular share of every head (circuits_core/circuits/ov_top_singular_share.py): page and JSON."""

from __future__ import annotations

from app.views.shared.per_head import per_head_analysis
from circuits_core.circuits import ov_top_singular_share

OV_TOP_SINGULAR_SHARE = per_head_analysis(
    ov_top_singular_share.ov_top_singular_shares,
    ov_top_singular_share.cost,
    name="ov-top-singular-share",
    field="shares",
    summary="OV top singular share of every head",
    title="OV top singular share",
    quantity="share σ₁² / Σσ² of W_V W_O's squared norm in its top singular value",
    explanation="How close to rank one each head's OV circuit W_V W_O is: the share σ₁² / Σσ² = ‖W_OV‖₂² / ‖W_OV‖_F² "
    "of its squared Frobenius norm carried by its top singular value σ₁ (d_model × d_model, rank at most d_head; "
    "computed from its factors, never formed; under grouped-query attention each query head reads its key/value "
    "group's W_V). 1 when the head moves a single direction, 1/d_head when all its directions are equally strong, "
    "0 for a zero circuit; its inverse is the stable rank, never above the effective rank.",
    nav=121,
)
