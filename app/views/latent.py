"""The head page's multi-head latent attention panel (DeepSeek-V2/V3): which QK term is which, their sizes (the head
view's `latent`, circuits_core/circuits/latent_circuits.py), OV through the latent, and what composition into these
heads reads."""

from __future__ import annotations

from typing import Any

from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import parse_head


def latent_head_panel(loaded: LoadedModel, head: str, norms: dict[str, float | int] | None) -> dict[str, Any] | None:
    """What the panel shows for one head: the head view's `latent` numbers (term_norms: Frobenius norms and rank
    bounds of A_h, C_h, D, OV_h on the served weights) with the layer's shape; None without latent attention."""
    cfg = loaded.model.cfg
    if not cfg.latent_attention or norms is None:
        return None
    layer, _ = parse_head(head, cfg)
    return {
        **norms,
        "layer": layer,
        "n_heads": cfg.n_heads,
        "q_rank": cfg.mla_q_rank,
        "d_rope": cfg.rotary_dim,
        "d_nope": cfg.mla_d_nope,
        "d_v": cfg.mla_d_v,
    }
