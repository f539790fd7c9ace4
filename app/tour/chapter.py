"""A chapter of the tour measured on one model (gemma3.py, residual.py, rotary.py): the model, or why it is missing,
then each figure in order, measured, or marked unavailable with the reason (`available: false`, `detail`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from pydantic import BaseModel

from app.registry import ModelRegistry
from app.tour.figure_data import ClaimChart, TourData, TourFigure
from circuits_core.errors import QkovError
from circuits_core.formats.checkpoint import LoadedModel

log = logging.getLogger("qkov.tour")


@dataclass(frozen=True)
class ChapterFigure:
    """What a chapter says about a figure before measuring it."""

    id: str
    title: str
    anchor: str  # the paper section's URL
    look_for: str  # what to look for, in one sentence


@dataclass(frozen=True)
class Measured:
    """One figure measured: its sentence and the values behind it, and where its full view and data are."""

    sentence: str
    values: BaseModel  # the typed claim (paper_claims.py, rotary_claims.py, gemma3.py), written field for field
    link: str  # the dashboard URL of the full view
    api: str  # the JSON API URL of its data
    claim_chart: ClaimChart | None = None  # the chart drawn from `values`, if any


def load_or_reason(registry: ModelRegistry, model_id: str, hint: str = "") -> LoadedModel | str:
    """The loaded model, or why it is not available (`hint`: how to get it, e.g. "make smollm2")."""
    try:
        return registry.get(model_id)
    except QkovError as exc:
        return f"model {model_id!r} is not available{f' ({hint})' if hint else ''}: {exc}"


def chapter_figures(
    registry: ModelRegistry,
    model_id: str,
    figures: Sequence[ChapterFigure],
    measure: Callable[[ChapterFigure, LoadedModel], Measured],
    hint: str = "",
) -> list[TourFigure]:
    """Each figure measured on `model_id` in order (so a figure may read what an earlier one found), without
    gradients; a QkovError makes that figure unavailable with its message, a missing model every figure."""
    loaded = load_or_reason(registry, model_id, hint)
    out: list[TourFigure] = []
    for fig in figures:
        if isinstance(loaded, str):
            out.append(_figure(fig, model_id, detail=loaded))
            continue
        try:
            with torch.no_grad():
                m = measure(fig, loaded)
        except QkovError as exc:
            log.info("tour figure %s not available: %s", fig.id, exc)
            out.append(_figure(fig, model_id, detail=str(exc)))
            continue
        out.append(_figure(fig, model_id, m))
    return out


def _figure(fig: ChapterFigure, model_id: str, m: Measured | None = None, detail: str | None = None) -> TourFigure:
    """The figure as measured (`m`), or unavailable for `detail`."""
    if m is None:
        return TourFigure(id=fig.id, title=fig.title, anchor=fig.anchor, look_for=fig.look_for, model=model_id,
                          link=None, api=None, available=False, detail=detail, data=None)  # fmt: skip
    data = TourData(claim=m.values.model_dump())
    if m.claim_chart is not None:  # set only when drawn: an unset field is not written (TourData)
        data.claim_chart = m.claim_chart
    return TourFigure(id=fig.id, title=fig.title, anchor=fig.anchor, look_for=f"{fig.look_for} Measured: {m.sentence}",
                      model=model_id, link=m.link, api=m.api, available=True, data=data)  # fmt: skip
