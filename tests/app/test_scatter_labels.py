"""Which points of a scatter carry a drawn label (app/labels.shown_labels): named heads always, never two labels on
top of each other; checked against the boxes the rule states, on hand-placed points."""

from __future__ import annotations

from app.labels import shown_labels


def test_named_points_too_close_to_label_apart_share_one_label() -> None:
    # L1H0 and L1H2 sit on the same spot (as on toy-2l's positivity scatter); L1H1 is far away
    x, y = [0.99, -0.98, 0.991, 0.0], [0.999, -0.1, 0.9996, 0.0]
    got = shown_labels(x, y, ["L1H0", "L1H1", "L1H2", "L1H3"], named=["L1H0", "L1H2"])
    assert got[0] == "L1H0, L1H2" and got[2] == ""  # one label naming both
    assert got[1] == "L1H1"  # an outlier far from every label
    assert got[3] in ("", "L1H3")


def test_an_unnamed_point_next_to_a_named_one_stays_unlabelled() -> None:
    x, y = [0.0, 0.01, 1.0], [0.0, 0.0, 1.0]
    got = shown_labels(x, y, ["L0H0", "L0H1", "L0H2"], named=["L0H0"])
    assert got == ["L0H0", "", "L0H2"]


def test_at_most_the_asked_number_of_labels_besides_the_named() -> None:
    n = 40
    x = [float(i % 8) for i in range(n)]
    y = [float(i // 8) for i in range(n)]
    labels = [f"L{i // 8}H{i % 8}" for i in range(n)]
    got = shown_labels(x, y, labels, most=5)
    assert sum(bool(t) for t in got) == 5
