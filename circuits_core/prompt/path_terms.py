"""What a frozen-attention path expansion answers (paths.py computes it): the target (a token's logit, or the
difference of two), and per destination position one value per path term, their orders, optionally each term
split over source positions, the model's actual value and the remainder of the orders not listed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from circuits_core.errors import InvalidInputError

Target = int | tuple[int, int]


@dataclass
class PathTerm:
    path: tuple[str, ...]
    order: int
    value: Tensor  # [q]: one value per destination position
    by_source: Tensor | None  # [q, n]: split over source positions (sums to value)


@dataclass
class PathExpansion:
    """Terms of the frozen-attention expansion of one target at destination positions `positions` [q]."""

    positions: Tensor  # [q]
    target: Target
    max_order: int
    paths: Sequence[tuple[str, ...]]  # [T] (a PathNames: each path built when asked for)
    orders: Tensor  # [T]
    values: Tensor  # [T, q]
    by_source: Tensor | None  # [T, q, n]
    value: Tensor  # [q]: the model's actual logit (difference) at each destination
    remainder: Tensor  # [q]: all paths of order > max_order
    _index: dict[tuple[str, ...], int] = field(default_factory=dict, repr=False)

    @property
    def total(self) -> Tensor:
        """Sum of every explicit term and the remainder [q] (equals `value`)."""
        return self.values.sum(0) + self.remainder

    def order_totals(self) -> Tensor:
        """[max_order + 1, q]: the sum of the terms of each order."""
        out = self.values.new_zeros(self.max_order + 1, self.values.shape[1])
        return out.index_add_(0, self.orders, self.values)

    def term(self, path: tuple[str, ...]) -> PathTerm:
        if not self._index:
            self._index.update({p: i for i, p in enumerate(self.paths)})
        if path not in self._index:
            raise InvalidInputError(f"no term {path!r} in this expansion (max_order {self.max_order})")
        i = self._index[path]
        return PathTerm(
            path, int(self.orders[i]), self.values[i], None if self.by_source is None else self.by_source[i]
        )

    def terms(self) -> list[PathTerm]:
        return [self.term(p) for p in self.paths]

    def ranked(self, position: int = 0) -> Tensor:
        """[T]: the terms by |value| at the position-th destination, largest first; equal sizes (the zero terms of
        absent biases) in the terms' own order (docs/maths.md §1.7)."""
        return self.values[:, position].abs().argsort(descending=True, stable=True)

    def top(self, k: int = 20, position: int = 0) -> list[PathTerm]:
        """The k terms of largest |value| at the position-th destination (in the order of `ranked`)."""
        return [self.term(self.paths[int(i)]) for i in self.ranked(position)[:k]]
