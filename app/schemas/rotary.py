"""JSON answers of the rotary-model analyses: the positional kernel, the energy per rotary band and the
composition profile over the query-key offset δ (circuits_core/circuits/rotary.py, composition_rotary.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.schemas.common import Complex, ModelRef, QKFormed
from circuits_core.circuits.profile_shape import ProfileShape


class ReferenceText(BaseModel):
    """The text μ_l is measured on (the mean ln1 output entering each layer)."""

    name: str = Field(description="what the text is")
    n_tokens: int = Field(description="tokens of the text (BOS included); the first one is left out of the mean")
    tokenized: bool = Field(description="false: the model has no tokenizer, seeded random token ids were used")


class ReferenceMeans(BaseModel):
    """μ [n_layers, d_model] of one model on the reference text (derived data, cached per checkpoint digest)."""

    reference: ReferenceText
    means: list[list[float]]


class ProfileShapeView(BaseModel):
    """How to read a profile over δ (circuits_core/circuits/profile_shape.py): flat, a maximum at the window's
    edge, or a peak."""

    summary: str = Field(description="one sentence: 'flat …', the peak at the edge of the range, or the peak")
    flat: bool = Field(description="max − min is under flat_fraction of the largest |value|: no offset stands out")
    at_edge: bool = Field(
        description="the maximum lies at the open end of the plotted range (it may keep rising beyond), or at a "
        "sliding layer's last attended offset δ = window − 1 (the window cuts the profile there)"
    )
    window: int | None = Field(
        default=None,
        description="the layer's sliding window, if any: the profile is defined, and plotted, only for δ < window",
    )
    relative_range: float = Field(description="(max − min) / max |value|")
    flat_fraction: float = Field(description="the spread under which a profile is called flat")

    @classmethod
    def of(cls, shape: ProfileShape, what: str = "peak") -> ProfileShapeView:
        return cls(
            summary=shape.describe(what),
            flat=shape.flat,
            at_edge=shape.at_edge,
            relative_range=shape.relative_range,
            flat_fraction=shape.flat_fraction,
            window=shape.window,
        )


class PositionalView(QKFormed):
    """f_h(δ) = μ_l Ω_h(δ) μ_l^T / s: the score a typical query gives a typical key δ positions back."""

    model: ModelRef
    head: str
    offsets: list[int] = Field(description="δ = query position - key position")
    kernel: list[float] = Field(description="f_h(δ) in attention-score units, one per offset")
    peak_offset: int = Field(description="the offset with the largest kernel value")
    shape: ProfileShapeView
    reference: ReferenceText
    basis: str = Field(description="which weights and input the numbers come from")


class BandsView(QKFormed):
    """Ω_h(δ) = Σ_k [cos(δθ_k) A_k + sin(δθ_k) B_k] + C: the QK energy of each rotary frequency band."""

    model: ModelRef
    head: str
    theta: list[float] = Field(description="θ_k, radians per position of band k (band 0 is the fastest)")
    wavelength: list[float] = Field(description="2π / θ_k in positions")
    cos_part: list[float] = Field(description="||A_k||_F^2")
    sin_part: list[float] = Field(description="||B_k||_F^2")
    energy: list[float] = Field(description="||A_k||^2 + ||B_k||^2 (= ||W_Q[:, pair k]||^2 ||W_K[:, pair k]||^2)")
    unrotated: float = Field(description="||C||_F^2, the dims beyond rotary_dim (0 without partial rotary)")
    share: list[float] = Field(description="energy / (Σ energy + unrotated)")
    basis: str


class CompositionProfileView(QKFormed):
    """C_Q(δ) or C_K(δ) of one (earlier, later) pair over the offsets, with the random baseline."""

    model: ModelRef
    source: str
    target: str
    kind: Literal["Q", "K"]
    offsets: list[int]
    scores: list[float]
    baseline: float = Field(description="mean score of Gaussian factors of the model's shapes (the same at every δ)")
    baseline_std: float
    peak: float
    peak_offset: int
    shape: ProfileShapeView
    basis: str


class QKCopyingView(QKFormed):
    """The eigenvalue copying score of a rotary head's full QK circuit W_E Ω_h(δ) W_Eᵀ / √d_head at each offset δ,
    and its nonzero eigenvalues (those of W_Kᵀ W_Eᵀ W_E W_Q R(δ) / √d_head, d_head x d_head) at the chosen offset."""

    model: ModelRef
    head: str
    offset: int = Field(description="the offset δ of `eigenvalues` and `score`")
    eigenvalues: list[Complex] = Field(
        description="the d_head nonzero eigenvalues of the full QK circuit at δ = offset"
    )
    score: float = Field(description="Σλ / Σ|λ| at δ = offset, in [-1, 1] (+1: every query attends to its own token)")
    offsets: list[int] = Field(description="δ = 0..max_offset")
    scores: list[float] = Field(description="Σλ / Σ|λ| at each of `offsets`")
    peak_offset: int = Field(description="the offset of `offsets` with the largest score")
    shape: ProfileShapeView
    basis: str = Field(description="which weights and embedding the numbers come from")
