"""Behavioural detectors on repeated random tokens (or a prompt): scores, patterns, per-position loss."""

from __future__ import annotations

from pydantic import BaseModel, Field

from app.schemas.common import ModelRef, TokenRef
from app.schemas.heads import DetectorInput, HeadScores


class HeadPattern(BaseModel):
    head: str
    pattern: list[list[float]] = Field(description="[query][key] attention of the first sequence")


class LossByPosition(BaseModel):
    loss: list[float | None] = Field(
        description="mean next-token loss (nats) at each position, averaged over the batch; last is None"
    )
    first_repeat: float | None = Field(default=None, description="mean loss over the first copy of r")
    second_repeat: float | None = Field(
        default=None, description="mean loss over the second copy of r (in-context copying lowers it)"
    )


class DetectorsView(BaseModel):
    model: ModelRef
    detector_input: DetectorInput
    tokens: list[TokenRef] = Field(description="the first sequence")
    heads: list[HeadScores]
    selected: list[str] = Field(description="heads whose patterns are included (best head of each detector)")
    patterns: list[HeadPattern]
    loss: LossByPosition
