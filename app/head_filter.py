"""The head filter: score thresholds a reader types once ("induction > 0.4 and layer < 20") and every heads table and
head-indexed plot of a page applies (the overview's grid, scatter and heads table, the detectors' chart and table, the
composition map and its strongest pairs, the head ablations of term importance). One definition: `FilterText`
is the page parameter, `HeadFilter.parse` its one parser; on a page whose rows are not the heads table's
(app/routers/page_inputs.py `filtered_heads`), the heads it keeps are read off the model's heads table.

A filter is clauses joined by "and" or ","; each clause is `field op number` with op one of > >= < <= =, and
field a column of HeadScores (layer, head, induction, previous_token, …; spaces or hyphens may stand for "_").
A head with no value for a field (None) fails every clause on it. A filter that cannot be read is refused with a
message naming the fields and operators (InvalidInputError -> 422).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, TypeVar

from pydantic import Field

from app.schemas.heads import HeadScores
from circuits_core.errors import InvalidInputError
from circuits_core.model.head_names import head_name
from circuits_core.prompt.model_summary import HEAD_THRESHOLD

FIELDS: dict[str, str] = {  # the name a reader types -> the HeadScores attribute
    "layer": "layer",
    "head": "index",
    "induction": "induction",
    "previous_token": "previous_token",
    "duplicate_token": "duplicate_token",
    "current_token": "current_token",
    "first_token": "first_token",
    "ov_copying": "ov_copying",
    "qk_copying": "qk_copying",
    "k_composition": "qk_k_composition",
    "kernel_peak": "kernel_peak_offset",
}
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "=": operator.eq,
}
CLAUSE = re.compile(r"^\s*([a-z][a-z _-]*?)\s*(>=|<=|>|<|=)\s*(-?\d+(?:\.\d*)?|-?\.\d+)\s*$", re.I)
MAX_FILTER_CHARS = 200
FilterText = Annotated[
    str | None,
    Field(
        max_length=MAX_FILTER_CHARS,
        description="head filter of the page's heads tables and plots: score thresholds joined by 'and', e.g. "
        f"'induction > 0.4 and layer < 20' (fields: {', '.join(FIELDS)})",
    ),
]

H = TypeVar("H", bound=HeadScores)


@dataclass(frozen=True)
class Clause:
    field: str  # the name as typed, normalised (FIELDS key)
    op: str
    value: float

    def holds(self, scores: HeadScores) -> bool:
        got = getattr(scores, FIELDS[self.field])
        return got is not None and OPERATORS[self.op](float(got), self.value)

    def __str__(self) -> str:
        return f"{self.field} {self.op} {self.value:g}"


@dataclass(frozen=True)
class HeadFilter:
    clauses: tuple[Clause, ...]

    @classmethod
    def parse(cls, text: str | None) -> HeadFilter:
        """The filter typed as `text` (empty or None: every head)."""
        if not text or not text.strip():
            return cls(())
        if len(text) > MAX_FILTER_CHARS:
            raise InvalidInputError(f"a head filter is at most {MAX_FILTER_CHARS} characters")
        clauses = []
        for part in re.split(r",|\band\b|&", text, flags=re.I):
            if not part.strip():
                continue
            m = CLAUSE.match(part)
            field = re.sub(r"[\s-]+", "_", m.group(1).strip().lower()) if m else ""
            if m is None or field not in FIELDS:
                raise InvalidInputError(
                    f"cannot read the head filter clause {part.strip()!r}: write `field op number` joined by 'and', "
                    f"e.g. 'induction > 0.4 and layer < 20'; fields: {', '.join(FIELDS)}; operators: "
                    f"{' '.join(OPERATORS)}"
                )
            clauses.append(Clause(field, m.group(2), float(m.group(3))))
        return cls(tuple(clauses))

    def __bool__(self) -> bool:
        return bool(self.clauses)

    def __str__(self) -> str:
        return " and ".join(map(str, self.clauses))

    def keeps(self, scores: HeadScores) -> bool:
        return all(c.holds(scores) for c in self.clauses)

    def apply(self, heads: Sequence[H]) -> list[H]:
        """The heads every clause holds for, in their order."""
        return [s for s in heads if self.keeps(s)]

    def kept(self, heads: Sequence[HeadScores]) -> set[str]:
        """The names of the heads every clause holds for."""
        return {s.head for s in heads if self.keeps(s)}


def labelled_heads(heads: Sequence[HeadScores], most: int = 4) -> list[str]:
    """The heads a chart names on a model of any size: its strongest induction heads and previous-token heads
    (scores of at least HEAD_THRESHOLD, the model summary's rule for calling a head one), `most` of each."""
    named: list[str] = []
    for key in ("induction", "previous_token"):
        ranked = sorted(
            (s for s in heads if (getattr(s, key) or 0.0) >= HEAD_THRESHOLD), key=lambda s: -getattr(s, key)
        )
        named += [s.head for s in ranked[:most] if s.head not in named]
    return named


def keep_grid(grid: Sequence[Sequence[float | None]], kept: set[str] | None) -> list[list[float | None]]:
    """A [layer][head] grid with the heads outside `kept` blanked (None: a heat map leaves the cell empty); `kept`
    None keeps every head."""
    return [
        [v if kept is None or head_name(layer, h) in kept else None for h, v in enumerate(row)]
        for layer, row in enumerate(grid)
    ]
