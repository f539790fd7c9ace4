"""What a profile over the query-key offset δ says, in words a reader can check against its plot.

A profile is one value per offset δ = 0, 1, …, δ_max: a rotary head's positional kernel f(δ), a pair's Q- or
K-composition C(δ), a head's QK copying score over δ. Its "peak" is only a finding when the profile varies and
the maximum is not where the plotted window was cut:
  * flat: max − min is under FLAT_FRACTION of the largest |value|; the arg-max is then noise, not a place;
  * edge of the range: the maximum sits within EDGE_FRACTION of the window's open end (δ_max, when δ_max is a
    choice of the window rather than the model's last position); the profile may keep rising beyond it.
  * edge of a sliding window: on a layer with a window w the maximum is at δ = w − 1, the last offset the layer
    attends: the window cuts the profile there.
δ = 0 is never an edge: no key lies after its query. This is the one place that decides both; the pages, the
JSON answers and the tour read `ProfileShape` instead of an arg-max.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FLAT_FRACTION = 0.05  # a profile varying by less than 5 % of its largest |value| is "flat"
EDGE_FRACTION = 0.05  # a maximum in the last 5 % of an open window (δ 61..64 of 0..64) is "at the edge"


@dataclass(frozen=True)
class ProfileShape:
    """The reading of one profile: where its maximum is and whether that maximum means anything."""

    peak: float  # the largest value
    peak_offset: int  # the δ where it is
    low: float  # the smallest value
    relative_range: float  # (max − min) / max |value| (0 for an all-zero profile)
    flat: bool  # relative_range < flat_fraction
    at_edge: bool  # the maximum lies within edge_fraction of the open end of the window
    first_offset: int
    last_offset: int
    flat_fraction: float
    open_end: bool  # the window was cut at last_offset (more offsets exist beyond it)
    window: int | None = None  # the layer's sliding window (offsets >= window are not attended), if any

    def describe(self, what: str = "peak", digits: int = 3) -> str:
        """One sentence about the profile: 'flat …', '<what> … at δ = …, the edge of the range …' or the peak."""
        span = f"{self.low:.{digits}f}–{self.peak:.{digits}f}"
        if self.flat:
            return (
                f"flat: {span} over δ = {self.first_offset}..{self.last_offset}, a spread of "
                f"{100 * self.relative_range:.1f} % (under {100 * self.flat_fraction:.0f} %), so no offset stands out"
            )
        text = f"{what} {self.peak:.{digits}f} at δ = {self.peak_offset}"
        if self.at_edge and self.window is not None and self.peak_offset == self.window - 1:
            text += (
                f", the edge of the layer's {self.window}-token window (it attends no key beyond δ = {self.window - 1})"
            )
        elif self.at_edge:
            text += (
                f", the edge of the range (δ ≤ {self.last_offset}): the profile may keep rising beyond the plotted"
                " window"
            )
        return text

    @property
    def label(self) -> str:
        """A short tag for a table cell: 'flat', 'edge' or ''."""
        return "flat" if self.flat else "edge" if self.at_edge else ""


def near_edge(offset: int, first: int, last: int, edge_fraction: float = EDGE_FRACTION) -> bool:
    """Whether δ = offset lies within edge_fraction of the far end of the window first..last (at least the last)."""
    margin = int(edge_fraction * (last - first + 1))
    return offset >= last - margin


def profile_shape(
    values: Sequence[float],
    offsets: Sequence[int],
    *,
    open_end: bool = True,
    flat_fraction: float = FLAT_FRACTION,
    edge_fraction: float = EDGE_FRACTION,
    window: int | None = None,
) -> ProfileShape:
    """The shape of `values` [n] over `offsets` [n] (increasing δ). open_end: the window stops before the model's
    last position, so a maximum near its end may be an artefact of the window. window: the layer's sliding window
    (cfg.layer_window), whose last offset w − 1 is an edge."""
    if len(values) != len(offsets) or not values:
        raise ValueError(f"a profile needs one value per offset (got {len(values)} values, {len(offsets)} offsets)")
    vals = [float(v) for v in values]
    i = max(range(len(vals)), key=vals.__getitem__)  # the first maximum
    high, low = vals[i], min(vals)
    scale = max(abs(high), abs(low))
    rel = (high - low) / scale if scale > 0 else 0.0
    flat = rel < flat_fraction
    first, last = int(offsets[0]), int(offsets[-1])
    return ProfileShape(
        peak=high,
        peak_offset=int(offsets[i]),
        low=low,
        relative_range=rel,
        flat=flat,
        at_edge=(not flat)
        and (
            (open_end and near_edge(int(offsets[i]), first, last, edge_fraction))
            or (window is not None and int(offsets[i]) == window - 1)
        ),
        first_offset=first,
        last_offset=last,
        flat_fraction=flat_fraction,
        open_end=open_end,
        window=window,
    )
