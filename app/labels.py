"""How tokens, heads' labels and path terms are written on the dashboard's figures and tables: whitespace and
control characters made visible, repeated tokens made distinct, a path term's name, and which of a scatter's
labels are drawn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Whitespace and control characters drawn visibly: · space, ⏎ newline, ⇥ tab, and an ASCII escape (\r, \x0c,
# \x7f, \x85, \xa0) for every other control character and the no-break space (the Unicode control pictures
# are missing from common monospace fonts and would show as empty boxes).
VISIBLE = {
    " ": "·",
    "\n": "⏎",
    "\t": "⇥",
    "\r": "\\r",
    **{chr(c): f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA1)] if chr(c) not in "\n\t\r"},
}
VISIBLE_TABLE = str.maketrans(VISIBLE)


def visible(text: str | None) -> str:
    """A token as the dashboard shows it (axes, tables): whitespace and control characters visible, ∅ if empty."""
    return text.translate(VISIBLE_TABLE) if text else "∅"


def unique_labels(labels: Sequence[str]) -> list[str]:
    """Plotly merges equal category labels; make repeated tokens distinct by their position."""
    labels = list(labels)
    return [f"{lab} [{i}]" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]


def token_labels(tokens: Sequence[Any]) -> list[str]:
    """Axis labels of a prompt's tokens: visible whitespace, made unique by position."""
    return unique_labels([visible(t.text) for t in tokens])


def term_label(path: Sequence[str], kind: str, n_terms: int | None = None) -> str:
    """A path term's name: 'direct', 'L1H4', 'L0H1→L1H4', 'mlp:L0→L1H4', 'remainder', 'other (12)'."""
    if kind == "other":
        return f"other ({n_terms} terms)" if n_terms else "other"
    if kind == "remainder":
        return "remainder (higher orders)"
    return "→".join(path) if path else "direct"


def shown_labels(
    x: Sequence[float], y: Sequence[float], labels: Sequence[str], most: int = 10, named: Sequence[str] = ()
) -> list[str]:
    """The labels drawn on a scatter: every `named` label, then the points farthest from the centre, each kept
    only when no kept label's point lies within a label's box of it (in fractions of the axis ranges), at most
    `most` in all (the named ones always). Named points too close to label apart share one label ("L1H0, L1H2")
    at the first of them."""
    if not labels:
        return []
    span_x = (max(x) - min(x)) or 1.0
    span_y = (max(y) - min(y)) or 1.0

    def collides(i: int, j: int, text: str) -> bool:
        box_x = 0.12 * max(1, len(text)) / 4  # a label is about 12 % of the width per four characters
        return abs(x[i] - x[j]) / span_x <= box_x and abs(y[i] - y[j]) / span_y <= 0.09

    text: dict[int, str] = {}  # point -> its drawn label
    for i in (i for i, lab in enumerate(labels) if lab in set(named)):
        near = next((j for j in text if collides(i, j, max(labels[i], text[j], key=len))), None)
        if near is None:
            text[i] = labels[i]
        else:
            text[near] += ", " + labels[i]
    cx, cy = sum(x) / len(x), sum(y) / len(y)
    order = sorted(range(len(labels)), key=lambda i: -(((x[i] - cx) / span_x) ** 2 + ((y[i] - cy) / span_y) ** 2))
    shown = set(text) | {i for i, lab in enumerate(labels) if lab in set(named)}
    for i in order:
        if len(shown) >= most:
            break
        if i not in shown and not any(collides(i, j, max(labels[i], text[j], key=len)) for j in text):
            text[i] = labels[i]
            shown.add(i)
    return [text.get(i, "") for i in range(len(labels))]
