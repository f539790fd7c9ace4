"""OV effective rank of every head (circuits_core/circuits/ov_effective_rank.py): page and JSON."""

from __future__ import annotations

from app.views.shared.per_head import per_head_analysis
from circuits_core.circuits import ov_effective_rank

OV_EFFECTIVE_RANK = per_head_analysis(
    ov_effective_rank.ov_effective_ranks,
    ov_effective_rank.cost,
    name="ov-effective-rank",
    field="ranks",
    summary="OV effective rank of every head",
    title="OV effective rank",
    quantity="effective rank (Σσ²)² / Σσ⁴ of W_V W_O",
    explanation="The participation ratio (Σσ²)² / Σσ⁴ of the singular values σ of each head's OV circuit W_V W_O "
    "(d_model × d_model, rank at most d_head; computed from its factors, never formed; under grouped-query "
    "attention each query head reads its key/value group's W_V): 1 when one direction carries the whole circuit, "
    "d_head when all its directions are equally strong, 0 for a zero circuit.",
    nav=120,
)
