"""profile_shape: 'flat' and 'edge of the range' against profiles whose shape is known by construction of the
input (not of the function): a constant-plus-ripple profile, a ramp, an interior bump, and the real case of
SmolLM2's L16H0 -> L18H6 (a K-composition profile 0.1607-0.1618 whose arg-max is δ = 64)."""

from __future__ import annotations

import math

import pytest

from circuits_core.circuits.profile_shape import FLAT_FRACTION, near_edge, profile_shape

OFFSETS = list(range(65))


def test_flat_profile_is_called_flat_not_a_peak() -> None:
    # the pair page's profile: 0.1607..0.1618, rising to the window's end
    values = [0.1607 + 0.0011 * d / 64 for d in OFFSETS]
    shape = profile_shape(values, OFFSETS)
    assert shape.flat and not shape.at_edge
    assert shape.relative_range == pytest.approx(0.0011 / 0.1618, rel=1e-9)
    text = shape.describe("K peak")
    assert text.startswith("flat") and "K peak" not in text and "0.161–0.162" in text


def test_ramp_peaks_at_the_edge_of_an_open_window() -> None:
    values = [d / 64 for d in OFFSETS]
    shape = profile_shape(values, OFFSETS)
    assert not shape.flat and shape.at_edge and shape.peak_offset == 64
    assert "edge of the range" in shape.describe()
    closed = profile_shape(values, OFFSETS, open_end=False)  # the window ends at the model's last position
    assert not closed.at_edge


@pytest.mark.parametrize("centre, edge", [(61, True), (62, True), (64, True), (58, False), (20, False), (1, False)])
def test_bump_position_decides_the_edge(centre: int, edge: bool) -> None:
    values = [math.exp(-((d - centre) ** 2) / 4) for d in OFFSETS]
    shape = profile_shape(values, OFFSETS)
    assert shape.peak_offset == centre
    assert shape.at_edge is edge
    assert ("edge of the range" in shape.describe()) is edge


def test_peak_at_zero_is_never_an_edge() -> None:
    values = [1.0 / (1 + d) for d in OFFSETS]
    shape = profile_shape(values, OFFSETS)
    assert shape.peak_offset == 0 and not shape.at_edge and not shape.flat


def test_flat_threshold_is_the_stated_fraction() -> None:
    below = [1.0, 1.0 - 0.99 * FLAT_FRACTION, 1.0]
    above = [1.0, 1.0 - 1.01 * FLAT_FRACTION, 1.0]
    assert profile_shape(below, [0, 1, 2]).flat
    assert not profile_shape(above, [0, 1, 2]).flat


def test_negative_and_zero_profiles() -> None:
    assert profile_shape([0.0, 0.0, 0.0], [0, 1, 2]).flat
    shape = profile_shape([-2.0, -1.0, -3.0], [0, 1, 2], open_end=False)
    assert shape.peak == -1.0 and shape.peak_offset == 1 and not shape.flat


def test_near_edge_margin() -> None:
    assert near_edge(64, 0, 64) and near_edge(61, 0, 64) and not near_edge(60, 0, 64)
    assert near_edge(8, 0, 8) and not near_edge(7, 0, 8)  # a short window: only its last offset


def test_mismatched_lengths_refused() -> None:
    with pytest.raises(ValueError):
        profile_shape([1.0, 2.0], [0])
