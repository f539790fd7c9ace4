"""Pydantic schemas of every JSON answer (and of the data the pages render). Nothing else lives here."""

from app.schemas.circuits import Circuit, CircuitTopView, Side, SkipTrigram, SkipTrigramView
from app.schemas.common import Complex, MatrixEntry, ModelRef, ScoredToken, TokenRef
from app.schemas.detectors import DetectorsView, HeadPattern, LossByPosition
from app.schemas.heads import CopyingMetricsView, DetectorInput, HeadScores, HeadsView, HeadView, PositionalQK
from app.schemas.models import ModelListView, ModelSummary, TokenizeView, UnavailableModel

__all__ = [
    "Circuit",
    "CircuitTopView",
    "CopyingMetricsView",
    "Complex",
    "DetectorInput",
    "DetectorsView",
    "HeadPattern",
    "HeadScores",
    "HeadsView",
    "HeadView",
    "LossByPosition",
    "MatrixEntry",
    "ModelListView",
    "ModelRef",
    "ModelSummary",
    "PositionalQK",
    "ScoredToken",
    "Side",
    "SkipTrigram",
    "SkipTrigramView",
    "TokenizeView",
    "TokenRef",
    "UnavailableModel",
]
