"""What the residual-stream pages share (app/views/residual.py, residual_usage.py, the tour's residual chapter): their
offset and energy parameters and the note of what the paper, and qkov with it, ignores between layers."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from circuits_core.model.transformer import Transformer

Offset = Annotated[
    int,
    Field(
        ge=0,
        le=1_000_000,
        description=(
            "rotary models: query position - key position at which Q/K readers are read (0: W_Q W_K^T; must be < "
            "n_ctx); other models: 0 only"
        ),
    ),
]


Energy = Annotated[
    float,
    Field(gt=0, le=1, description="a component's subspace = its top singular directions holding this share of sum s^2"),
]


def ignored_note(model: Transformer) -> str:
    """What the paper ignores and qkov ignores with it, for this model (shown on every residual page)."""
    kind = model.cfg.normalization_type
    if kind is None:
        return "This model has no norm between layers, so nothing is left out: these are the exact linear maps."
    name = "RMSNorm" if kind.startswith("RMS") else "LayerNorm"
    folded = kind.endswith("Pre") or bool(model.processing.get("fold_ln"))
    weight = (
        "its weight (and, for LayerNorm, its centring) is folded into these weights"
        if folded
        else "its weight is not folded into these weights and is left out too"
    )
    return (
        f"As in the paper, the {name} between layers is ignored: {weight}; its per-token scale depends on the "
        "input and is left out (the path pages freeze it on a prompt instead). The token embedding is W_E after "
        "layer 0's norm, row by row (exact only when positions are not added to the stream)."
    )
