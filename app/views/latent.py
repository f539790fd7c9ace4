"""The head page's multi-head latent attention panel (DeepSeek-V2/V3): which QK term is which, their sizes, OV through
the latent, and what composition into these heads reads (circuits_core/circuits/latent_circuits.py)."""

from __future__ import annotations

from typing import Any

from circuits_core.circuits.latent_circuits import term_norms
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.config import parse_head


def latent_head_panel(loaded: LoadedModel, head: str) -> dict[str, Any] | None:
    """The numbers the panel shows for one head (term_norms: Frobenius norms and rank bounds of A_h, C_h, D, OV_h, on
    the served weights), with the layer's shape; None on a model without latent attention."""
    model = loaded.model
    cfg = model.cfg
    if not cfg.latent_attention:
        return None
    layer, h = parse_head(head, cfg)
    return {
        **term_norms(model, layer, h),
        "layer": layer,
        "n_heads": cfg.n_heads,
        "q_rank": cfg.mla_q_rank,
        "d_rope": cfg.rotary_dim,
        "d_nope": cfg.mla_d_nope,
        "d_v": cfg.mla_d_v,
    }
