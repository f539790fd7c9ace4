"""The names of the terms of a path expansion (paths.py), built on demand.

A term's path is a tuple (source?, head, ..., head) such as ("mlp:L3", "L5H1", "L9H7") (paths.py). An order-2
expansion of a 16-layer, 32-head model has over a million terms; naming each one as a tuple up front costs more
than computing the terms, so the expansion records its terms in blocks and a PathNames builds a name when it is
read (indexing, iteration, comparison with a list of tuples all work as on that list).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import overload

Path = tuple[str, ...]  # (source?, head, ..., head)


class PathNames(Sequence[Path]):
    """The path of every term, in term order. Terms come in blocks, each the product (source, first head, rest of
    the suffix): term i of a block is sources[a] + heads[b] + rests[c] with i = (a * len(heads) + b) * len(rests)
    + c, the order in which paths.py emits them."""

    def __init__(self) -> None:
        self._blocks: list[tuple[int, list[Path], list[Path], list[Path]]] = []
        self._starts: list[int] = []
        self._len = 0

    def add(self, sources: list[Path], heads: list[Path], rests: list[Path]) -> int:
        """Append a block; returns its number of terms."""
        size = len(sources) * len(heads) * len(rests)
        if size:
            self._blocks.append((self._len, sources, heads, rests))
            self._starts.append(self._len)
            self._len += size
        return size

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, i: int) -> Path: ...
    @overload
    def __getitem__(self, i: slice) -> list[Path]: ...

    def __getitem__(self, i: int | slice) -> Path | list[Path]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if not -self._len <= i < self._len:
            raise IndexError(f"term {i} out of range ({self._len} terms)")
        i %= self._len
        start, sources, heads, rests = self._blocks[bisect_right(self._starts, i) - 1]
        a, rem = divmod(i - start, len(heads) * len(rests))
        b, c = divmod(rem, len(rests))
        return sources[a] + heads[b] + rests[c]

    def __iter__(self) -> Iterator[Path]:
        for _, sources, heads, rests in self._blocks:
            for src in sources:
                for head in heads:
                    yield from (src + head + rest for rest in rests)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]
