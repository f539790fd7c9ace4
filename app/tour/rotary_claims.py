"""The values behind the SmolLM2 chapter's measured sentences (app/tour/rotary.py, figures R1-R3), typed: the
chapter builds them, the tour page draws its claim charts from them (app/routers/pages_tour.py) and
tests/app/test_tour_rotary.py recomputes each, so all three agree on names and types instead of on dict keys.
A figure's JSON twin carries them as its `claim` (TourData), field for field."""

from __future__ import annotations

from pydantic import BaseModel

from app.schemas.heads import DetectorInput


class KCompositionSource(BaseModel):
    """An induction head's strongest K-composition source among the previous-token heads, C_K(δ) over offsets."""

    target: str  # the induction head
    source: str  # the previous-token head
    min: float
    max: float
    peak_offset: int
    profile: list[float]  # C_K(δ), δ = 0..KERNEL_WINDOW: the figure's line


class InductionHeadsClaim(BaseModel):
    """R1: the heads above the detector threshold, their kernels' peaks and each induction head's source."""

    induction: list[tuple[str, float]]  # (head, induction score), strongest first
    previous_token: list[tuple[str, float]]  # (head, previous-token score), strongest first
    kernel_peaks: dict[str, int | None]  # previous-token head -> its positional kernel's peak offset
    k_sources: list[KCompositionSource]
    baseline: float  # the random baseline of C_K at the model's shapes
    input: DetectorInput


class LogitByOrderClaim(BaseModel):
    """R2: a repeated token's logit split by path order (order 0, order 1, the remainder; they sum to `value`)."""

    tokens: list[int]
    position: int
    target: int
    value: float
    rank: int
    order0: float
    order1: float
    remainder: float
    top_path: list[str]  # the largest order-1 term's path
    top_value: float


class ScoreTermsClaim(BaseModel):
    """R3: an induction head's score from a query to its induction target and its largest QK path terms."""

    head: str
    query: int
    key: int
    score: float
    attention: float
    top_terms: list[tuple[str, str, float]]  # (query-side component, key-side component, term), largest |term| first


RotaryClaim = InductionHeadsClaim | LogitByOrderClaim | ScoreTermsClaim
