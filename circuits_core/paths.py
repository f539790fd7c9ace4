"""Frozen-attention path expansion of a logit (or a logit difference) into direct, head and virtual-head terms.

Paper section: "Two-layer path expansion" and "Virtual attention heads" (Elhage et al. 2021; paper-math 2.3,
2.10, 2.11). Row-vector convention. With the clean run's attention patterns and LayerNorm scales frozen
(frozen.py), the final residual stream is a sum over paths p = (source, h_1, ..., h_k), l_1 < ... < l_k:
    x_L ⊇ A^{h_k} D_{l_k} ... A^{h_1} D_{l_1} X_s C W_OV^{h_1} C ... C W_OV^{h_k}
and the target value at a destination position p is inv_f[p] (x_L[p] . r) + const (frozen.readout).

Sources (where a path starts):
    ()               the embedding x_0 (W_E[t], + W_pos for standard positions), enters layer 0
    ("bias:L3",)     beta_3, the constant output of attention layer 3 (b_O and folded b_V, b_ln1), enters layer 4
    ("mlp:L3",)      the MLP of layer 3's actual output in the clean run, enters layer 4. An MLP is a node:
                     its inputs are NOT expanded further (the MLP is not linear), so every path through an MLP
                     starts at it.
    ("bias:unembed",) b_U + b_ln_final . u, order 0
A path's tuple is (source?, *head names); its order is the number of heads. Terms of order > max_order are
summed into an explicit `remainder` (actual value minus the explicit terms), so terms + remainder always
equal the model's actual value; the tests check the remainder against the explicit higher-order terms.

Algorithm: backward "suffix" propagation, batched by layer. A suffix (h_m..h_k) carries a coefficient over
source positions coef [q, n] (e_p^T A^{h_k} D ... A^{h_m} D) and a residual readout vector w [d_model]
(C W_OV^{h_m} ... C W_OV^{h_k} r). Prepending all heads of layer l to all suffixes starting later is two
einsums (coef @ A^l, W_OV^l w via W_O then W_V, never d_model x d_model). A source X_s ends a suffix:
term[j] = coef[j] * (X_s[j] . w), or, when many suffixes share the first layer, (X_s C W_V^l)[j] . (W_O w).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from circuits_core.config import head_name
from circuits_core.errors import CancelledError, InvalidInputError, LimitExceededError
from circuits_core.frozen import (
    FrozenRun,
    centre,
    embed_source,
    frozen_run,
    head_ov_apply,
    layer_bias,
    reading_weights,
    readout,
)
from circuits_core.model import Transformer

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
    paths: list[tuple[str, ...]]  # [T]
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
        return PathTerm(path, int(self.orders[i]), self.values[i], None if self.by_source is None else self.by_source[i])

    def terms(self) -> list[PathTerm]:
        return [self.term(p) for p in self.paths]

    def top(self, k: int = 20, position: int = 0) -> list[PathTerm]:
        """The k terms of largest |value| at the position-th destination."""
        idx = self.values[:, position].abs().argsort(descending=True)[:k]
        return [self.term(self.paths[int(i)]) for i in idx]


@dataclass
class _Source:
    name: tuple[str, ...]  # () for the embedding
    entry: int  # first layer that reads it
    X: Tensor  # [n, d_model], or [1, d_model] for a constant (bias) source


def path_sources(model: Transformer, run: FrozenRun) -> list[_Source]:
    """The embedding, each attention layer's bias and each MLP's output, with the layer where they enter."""
    out = [_Source((), 0, embed_source(model, run))]
    for layer in range(model.cfg.n_layers):
        out.append(_Source((f"bias:L{layer}",), layer + 1, layer_bias(model, layer)[None]))
        if not model.cfg.attn_only:
            out.append(_Source((f"mlp:L{layer}",), layer + 1, run.cache[f"blocks.{layer}.hook_mlp_out"]))
    return out


def _positions(positions: int | Sequence[int] | None, n: int, device: torch.device) -> Tensor:
    if positions is None:
        return torch.arange(n, device=device)
    pos = torch.tensor([positions] if isinstance(positions, int) else list(positions), dtype=torch.long, device=device)
    if pos.numel() == 0 or (pos < -n).any() or (pos >= n).any():
        raise InvalidInputError(f"destination positions must be in [-{n}, {n}), got {pos.tolist()}")
    return pos % n


class _Expander:
    """Accumulates terms; one instance per expansion."""

    def __init__(self, model: Transformer, run: FrozenRun, sources: list[_Source], by_source: bool):
        self.model, self.run, self.sources, self.by_source = model, run, sources, by_source
        self.paths: list[tuple[str, ...]] = []
        self.orders: list[int] = []
        self.chunks: list[Tensor] = []  # [P, q, n] or [P, q]
        self._values_cache: dict[tuple[int, int], Tensor] = {}
        self.W_V = [reading_weights(model, layer, "W_V") for layer in range(model.cfg.n_layers)]  # [H, d, dh] each

    def source_values(self, s: int, layer: int) -> Tensor:
        """(X_s C diag(w_ln) W_V^{layer}) [n or 1, H, d_head], cached."""
        key = (s, layer)
        if key not in self._values_cache:
            X = centre(self.model, self.sources[s].X)
            self._values_cache[key] = torch.einsum("nd,hde->nhe", X, self.W_V[layer])
        return self._values_cache[key]

    def emit(self, order: int, first_layer: int, names: list[tuple[str, ...]], coef: Tensor, w: Tensor,
             g: Tensor | None = None) -> None:
        """Terms of every source that can start these suffixes. coef [P, q, n], w [P, d]; g [H, P0, d_head]
        (W_O w before the heads of `first_layer` were prepended, P = H * P0) enables the cheap dot."""
        for s, src in enumerate(self.sources):
            if src.entry > first_layer:
                continue
            if g is not None and g.shape[1] > g.shape[2]:
                dots = torch.einsum("nhe,hpe->hpn", self.source_values(s, first_layer), g).flatten(0, 1)  # [P, n]
            else:
                dots = w @ src.X.T  # [P, n or 1]
            terms = coef * dots[:, None, :]  # [P, q, n]
            self.chunks.append(terms if self.by_source else terms.sum(-1))
            self.paths.extend(src.name + nm for nm in names)
            self.orders.extend([order] * len(names))


def expand_logits(
    model: Transformer,
    tokens: Tensor,
    target: Target,
    positions: int | Sequence[int] | None = -1,
    max_order: int = 2,
    by_source: bool = True,
    run: FrozenRun | None = None,
    max_elements: int = 200_000_000,
    should_stop: Callable[[], bool] | None = None,
) -> PathExpansion:
    """Split the target logit (or logit difference (a, b)) at destination `positions` into path terms.

    tokens [n] or [1, n]; positions: an index, a list, or None for all; max_order: the largest number of heads
    in an explicit path (the rest goes to `remainder`).
    """
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    if max_order < 0:
        raise InvalidInputError(f"max_order must be >= 0, got {max_order}")
    max_order = min(max_order, L)
    run = run if run is not None else frozen_run(model, tokens)
    n = run.n
    dest = _positions(positions, n, model.device)
    q = dest.numel()
    n_suffixes = _count_suffixes(L, H, max_order)
    n_terms = n_suffixes * (1 + (1 if cfg.attn_only else 2) * L)
    if n_terms * q * (n if by_source else 1) > max_elements:
        raise LimitExceededError(f"about {n_terms} terms x {q} positions x {n if by_source else 1} sources is over the "
                                 f"budget of {max_elements} numbers; lower max_order, positions or by_source")
    with torch.no_grad():
        r, const = readout(model, target)
        inv_f = run.inv_scale("ln_final")
        exp = _Expander(model, run, path_sources(model, run), by_source)
        coef0 = torch.zeros(1, q, n, dtype=model.dtype, device=model.device)
        coef0[0, torch.arange(q), dest] = inv_f[dest]
        # suffix groups by order: list of (first_layer, names, coef [P, q, n], w [P, d])
        groups: list[list[tuple[int, list[tuple[str, ...]], Tensor, Tensor]]] = [[(L, [()], coef0, r[None])]]
        exp.emit(0, L, [()], coef0, r[None])
        for order in range(1, max_order + 1):
            new: list[tuple[int, list[tuple[str, ...]], Tensor, Tensor]] = []
            for layer in range(L - 1, -1, -1):
                if should_stop is not None and should_stop():
                    raise CancelledError("path expansion cancelled")
                later = [grp for grp in groups[order - 1] if grp[0] > layer]
                if not later:
                    continue
                names = [nm for grp in later for nm in grp[1]]
                coef = torch.cat([grp[2] for grp in later])  # [P0, q, n]
                w = torch.cat([grp[3] for grp in later])  # [P0, d]
                A = run.patterns[layer]  # [H, n, n]
                inv = run.inv_scale(f"blocks.{layer}.ln1")  # [n]
                coef_new = (torch.einsum("pqi,hij->hpqj", coef, A) * inv).flatten(0, 1)  # [H*P0, q, n]
                g, w_new = head_ov_apply(model, layer, w, exp.W_V[layer])  # [H, P0, dh], [H, P0, d]
                names_new = [(head_name(layer, h),) + nm for h in range(H) for nm in names]
                w_new = w_new.flatten(0, 1)
                exp.emit(order, layer, names_new, coef_new, w_new, g)
                new.append((layer, names_new, coef_new, w_new))
            groups.append(new)
        values_all = torch.cat(exp.chunks)  # [T, q, n] or [T, q]
        values = values_all.sum(-1) if by_source else values_all
        # the order-0 term of the final biases
        values = torch.cat([values, const.expand(1, q)])
        paths = exp.paths + [("bias:unembed",)]
        orders = torch.tensor(exp.orders + [0], dtype=torch.long, device=model.device)
        if by_source:
            extra = values_all.new_zeros(1, q, n)
            extra[0, torch.arange(q), dest] = const
            values_all = torch.cat([values_all, extra])
        actual = _actual_value(run.logits[dest], target)
        remainder = actual - values.sum(0)
    return PathExpansion(dest, target, max_order, paths, orders, values, values_all if by_source else None,
                         actual, remainder)


def _actual_value(logits: Tensor, target: Target) -> Tensor:
    """logits [q, d_vocab] -> [q]: the target logit or logit difference."""
    if isinstance(target, int):
        return logits[:, target]
    a, b = target
    return logits[:, a] - logits[:, b]


def _count_suffixes(L: int, H: int, max_order: int) -> int:
    """Number of head tuples with strictly increasing layers, of length 0..max_order."""
    # count[k] = C(L, k) * H^k
    from math import comb

    return sum(comb(L, k) * H**k for k in range(max_order + 1))
