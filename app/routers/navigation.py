"""A model's left navigation: one entry per labelled model page, in the declared order, leaving out the views a
model cannot have (too few attention layers for composition, no MLP for an MLP's table) with one line saying why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from app.analysis import Analysis, Declared


@dataclass(frozen=True)
class NavEntry:
    """One entry of a model's left navigation, derived from a Page with a `label` (see `model_nav`)."""

    key: str  # the page's nav key (page.nav, else its analysis's name)
    label: str
    sub: str  # the page's path below /models/{model} ("" for the overview)
    needs_layers: int  # its analysis's needs_layers: a model with fewer leaves it out (`nav_note` says why)
    needs_mlp: bool = False  # its analysis's needs_mlp: an attention-only model leaves it out

    def applies(self, n_layers: int, attn_only: bool = False) -> bool:
        return fits(self.needs_layers, self.needs_mlp, n_layers, attn_only)


def fits(layers_needed: int, mlp_needed: bool, n_layers: int, attn_only: bool) -> bool:
    """Whether a page that needs `layers_needed` attention layers (and, `mlp_needed`, an MLP) applies to a model with
    `n_layers` of them (`attn_only`: no MLPs)."""
    return n_layers >= layers_needed and not (mlp_needed and attn_only)


def needs_layers(analysis: Declared[Any, Any]) -> int:
    """The attention layers a page's analysis needs (a server-wide one: none)."""
    return analysis.needs_layers if isinstance(analysis, Analysis) else 0


def needs_mlp(analysis: Declared[Any, Any]) -> bool:
    """Whether a page's analysis reads an MLP (a server-wide one: no)."""
    return analysis.needs_mlp if isinstance(analysis, Analysis) else False


def nav_note(model_id: str, n_layers: int, hidden: list[str], attn_only: bool = False) -> str | None:
    """One line saying why the `hidden` views are not offered for this model (too few layers, or, `attn_only`, no
    MLP for the views of MLPs)."""
    if not hidden:
        return None
    names = ", ".join(hidden[:-1]) + (" and " if len(hidden) > 1 else "") + hidden[-1]
    if attn_only:
        return f"{model_id} is attention-only (no MLPs), so {names} {'are' if len(hidden) > 1 else 'is'} not shown."
    if n_layers == 0:
        return (
            f"{model_id} has no attention layers (its logits are the direct path W_E W_U alone), so the views of "
            f"heads are not shown: {names}."
        )
    return (
        f"{model_id} has {n_layers} attention layer{'s' if n_layers != 1 else ''} and no head reads another's output, "
        f"so {names} (views of composition between layers) {'are' if len(hidden) > 1 else 'is'} not shown."
    )


def model_nav(request: Request) -> list[NavEntry]:
    """The navigation of a model page: every model page with a `label`, in ascending `order` (app.state.pages, set
    in create_app)."""
    pages: list[Any] = sorted(  # rendering.Page
        request.app.state.pages, key=lambda p: p.order or 0
    )
    prefix = "/models/{model}"
    return [
        NavEntry(p.key, p.label, p.route[len(prefix) :], needs_layers(p.analysis), needs_mlp(p.analysis))
        for p in pages
        if p.label is not None and p.route.startswith(prefix) and "{" not in p.route[len(prefix) :]
    ]
