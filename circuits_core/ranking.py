"""Rankings that every device answers alike: equal values keep the order of their indices (docs/maths.md §1.7).

torch.topk and an unstable sort leave the order of equal values to the backend: on a GPU two path terms of 0 (the
zero biases of a model without biases) or two tokens with the same embedding row came out in another order than on
the CPU. A full ranking is a stable argsort (`argsort(descending=True, stable=True)`: equal values in index order);
`top_k` is torch.topk with the same rule, including at the k-th value, where a tie decides which entries are listed.

Ties are exact equality. Values a backend rounds differently (a few ulps apart on one device, equal or swapped on
another) are not ties: no tolerance makes them device-independent (values straddling any tolerance's edge still
rank apart), a tolerance is not transitive, and a ranking by value must keep values that differ apart.
"""

from __future__ import annotations

import torch
from torch import Tensor


def top_k(values: Tensor, k: int, largest: bool = True) -> tuple[Tensor, Tensor]:
    """The k largest (largest=False: smallest) entries of values [n]: values and indices [k], ordered by value, equal
    values by their index (the lower first), at the k-th value too.

    torch.topk finds the k-th value, and one pass over `values` counts the entries that reach it; only where more
    than k do (a tie across the edge) are the tied entries chosen again, the lowest indices first. No loop over the
    entries."""
    found = values.topk(k, largest=largest)
    if k == 0:
        return found.values, found.indices
    edge = found.values[-1]  # the k-th value
    reach = values >= edge if largest else values <= edge  # [n] (none for a NaN edge: topk's choice stands)
    if int(reach.sum()) > k:
        beyond = values > edge if largest else values < edge  # [n]
        tied = (values == edge).nonzero().flatten()  # [t] ascending
        room = k - int(beyond.sum())  # places left for the tied entries
        idx = torch.cat([beyond.nonzero().flatten(), tied[:room]]).sort().values  # [k] ascending
    else:
        idx = found.indices.sort().values  # [k] ascending
    chosen = values[idx]
    order = chosen.argsort(descending=largest, stable=True)  # by value; equal values stay in index order
    return chosen[order], idx[order]


def by_value_then_indices(values: Tensor, indices: tuple[Tensor, ...], largest: bool = True) -> Tensor:
    """[..., k]: the order of the entries of values [..., k] by value (largest=False: smallest first), equal values by
    each of `indices` ([..., k] each) in turn, the lower first: one stable sort per key, the last key first."""
    order = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    for key, descending in [*((i, False) for i in reversed(indices)), (values, largest)]:
        order = order.gather(-1, key.gather(-1, order).argsort(dim=-1, descending=descending, stable=True))
    return order
