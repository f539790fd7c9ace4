"""The values behind the paper chapter's measured sentences (figures F2-F29: claims.py, and residual.py for the
residual stream's F2-F4), typed.

claims.py (residual.py) measures each one and writes it as its figure's `claim` (TourData) in the JSON twin, field
for field in the order declared here; a field a figure did not measure (F6 without held-out data, F11 without
training counts, F14 without a query token, F23 without a repeated segment) is left unset and not written. The tour
page and tests/app/tour_claims/test_claims.py (test_claims_induction.py) read the claim back through the same class,
so the three agree on names and types instead of on dict keys (as rotary_claims.py does for the SmolLM2 chapter).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class FigureClaim(BaseModel):
    """The values one sentence measured; frozen once measured."""

    model_config = ConfigDict(frozen=True)

    def measured(self) -> dict[str, Any]:
        """The fields the measurement set, in declaration order: the figure's `claim` in its JSON twin."""
        return self.model_dump(exclude_unset=True)


class ChannelClaim(FigureClaim):
    """F2: the residual stream as a channel: its writers and readers, and the head -> head pairs above chance."""

    writers: int
    readers: int
    pairs: int  # (writer, reader) pairs where the reader sees the writer
    head_pairs: int  # head -> head Q/K/V pairs among them
    above: int  # head pairs above the random baseline
    baseline: float  # 1/sqrt(d_model)
    best: tuple[str, str, float]  # the strongest pair: writer, reader, score


class EmbeddingReaderClaim(FigureClaim):
    """F3: the token embedding's strongest reader and the tokens its top singular direction weighs."""

    reader: str
    score: float
    sigma: float  # the top singular value of the virtual weight
    top: list[int]  # token ids at the direction's positive end, strongest first
    bottom: list[int]  # at its negative end


class BandwidthClaim(FigureClaim):
    """F4: how crowded d_model is, and the strongest erasure candidate (None: none beyond the threshold)."""

    total_dims: int  # the writers' subspaces' dimensions, summed
    d_model: int
    used_dims: float  # effective directions used
    crowded_load: float  # writer subspaces on the most crowded direction
    crowded_writers: list[str]  # the two writers that load it most
    erasure: tuple[str, str, float, float] | None  # writer, eraser, erasure score, z


class DirectPathBigramsClaim(FigureClaim):
    """F6: the direct path's largest entries and how many of them are held-out bigrams."""

    pairs: list[tuple[int, int]]  # (current token, next token) ids, largest entry first
    min_count: int | None  # the training-count floor of the tokens shown
    held_out_counts: list[int] | None = None  # per pair, its count in the held-out code (unset without the data)
    seen: int | None = None  # pairs with a nonzero count


class PathTermsSumClaim(FigureClaim):
    """F9: the listed path terms at the last position sum to the model's logit."""

    total: float
    value: float  # the model's logit
    target: int  # the target token's id


class TokenCopyingClaim(FigureClaim):
    """F10: the most-copying head's eigenvalue score against its token-level copying."""

    head: str
    score: float  # eigenvalue copying score
    top1: float  # share of source tokens whose own logit is raised most
    top10: float
    diagonal: int  # diagonal entries among the largest OV entries shown


class CopyingSourceClaim(FigureClaim):
    """F11: a source token of the most-copying head and its outputs (source, top_out, share with training counts;
    copying without them)."""

    head: str
    copying: bool | None = None  # the source is among its own top-k outputs
    source: int | None = None  # the source token's id
    top_out: int | None = None  # the id of its largest output
    share: float | None = None  # share of frequent tokens that raise their own logit most
    min_count: int | None = None


class SecondCopyingHeadClaim(FigureClaim):
    """F12: the head with the second-highest eigenvalue copying score."""

    head: str


class QueryRowClaim(FigureClaim):
    """F14: the most-copying head's QK circuit, one query's row (keys unset when no query is chosen)."""

    head: str
    query: int | None  # the query token's id
    keys: list[int] | None = None  # the keys it scores highest, highest first


class PositionalHeadClaim(FigureClaim):
    """F15: the previous-token head's purely positional pattern, averaged over positions."""

    head: str | None
    previous: float  # attention on the previous position
    current: float  # attention on the present position


class PositiveEigenvaluesClaim(FigureClaim):
    """F17: per head, how many of its OV eigenvalues have a positive real part."""

    positive: dict[str, int]
    n: int  # eigenvalues per head


class CopyingScoresClaim(FigureClaim):
    """F18: the heads' eigenvalue copying scores against random OV weights, and their token-level copying."""

    positive: int  # heads with a positive score
    n: int
    low: float
    high: float
    baseline_mean: float  # random OV weights of the same shapes through the model's embeddings
    baseline_std: float
    max_top1: float  # the largest share of source tokens that raise their own logit most, over heads
    max_top10: float


class LargestPathTermsClaim(FigureClaim):
    """F19: the largest path terms at the last position and the logit they sum to with the rest."""

    top: list[tuple[list[str], float]]  # (path of heads, term), largest first
    value: float


class QKTermSpreadClaim(FigureClaim):
    """F20: the QK score terms of a head with the largest spread over the prompt's causal pairs."""

    top: list[tuple[str, float]]  # ("query side × key side", std), largest first


class TopCompositionPairsClaim(FigureClaim):
    """F21: the top pair of each composition kind, (source, target, score), and the random baseline."""

    K: tuple[str, str, float]
    Q: tuple[str, str, float]
    V: tuple[str, str, float]
    baseline: float  # 1/sqrt(d_model)


class InductionMassClaim(FigureClaim):
    """F22: the induction head's attention on the induction targets, plain and value-weighted."""

    head: str | None
    mass: float | None
    weighted_mass: float | None


class NextTokenEffectClaim(FigureClaim):
    """F23: the induction head's direct effect on each next token of the second copy (only n = 0 without one)."""

    head: str
    positive: int | None = None  # positions of the second copy with a positive effect
    n: int
    min: float | None = None
    max: float | None = None


class StandardInputClaim(FigureClaim):
    """F24: repeat losses and the strongest induction score on the standard input."""

    rep1: float | None  # loss on the first repeat (nats)
    rep2: float | None  # on the second
    head: str
    induction: float | None


class KCompositionDiagonalClaim(FigureClaim):
    """F25: diagonal entries among the largest of a K-composition token circuit."""

    diagonal: int
    k: int  # entries shown


class PositivityCornerClaim(FigureClaim):
    """F26: the three heads nearest the (OV copying, K-composition positivity) corner."""

    points: list[tuple[str, float | None, float]]  # (head, OV copying, K-composition positivity)


class LossByOrderClaim(FigureClaim):
    """F27: the loss of the direct path, of the first-order terms added, and of the full model."""

    losses: list[float]


class FirstOrderGainsClaim(FigureClaim):
    """F28: the loss reduction from the direct path when one layer's head terms are added, per layer."""

    gains: list[float]


class ChainPatternClaim(FigureClaim):
    """F29: a chain of heads' pattern on the induction targets and on the earlier occurrences themselves."""

    heads: list[str]
    mass: float
    mass_on_occurrence: float
    rows: int  # query positions whose token occurred before
