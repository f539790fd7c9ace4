"""Frozen-attention path expansion of a logit (or a logit difference) into direct, head and virtual-head terms.

Paper section: "Two-layer path expansion" and "Virtual attention heads" (Elhage et al. 2021; docs/maths.md §2.3,
2.10, 2.11). Row-vector convention. With the clean run's attention patterns and LayerNorm scales frozen
(frozen.py), the final residual stream is a sum over paths p = (source, h_1, ..., h_k), l_1 < ... < l_k:
    x_L ⊇ A^{h_k} D_{l_k} ... A^{h_1} D_{l_1} X_s C W_OV^{h_1} C ... C W_OV^{h_k}
and the target value at a destination position p is inv_f[p] (x_L[p] . r) + const (frozen.readout).

Sources (where a path starts):
    ()               the embedding x_0 (W_E[t], + W_pos for standard positions), enters layer 0
    ("bias:L3",)     beta_3, the constant output of attention layer 3 (b_O and folded b_V, b_ln1), enters layer 4
                     (under an output norm it is written as beta_3 diag(gamma) / rho_post(i), under learned sinks
                     each head's value bias is scaled by its row sum: one row per position, frozen.written_bias)
    ("mlp:L3",)      the MLP of layer 3's actual output in the clean run, enters layer 4. An MLP is a node:
                     its inputs are NOT expanded further (the MLP is not linear), so every path through an MLP
                     starts at it.
    ("mlp:L3.e5",)   a mixture of experts, routing frozen: expert 5's weighted output on the tokens that chose it
                     (one source per expert used on the prompt; they sum to the MLP's output).
    ("bias:unembed",) b_U + b_ln_final . u, order 0
A path's tuple is (source?, *head names); its order is the number of heads. Terms of order > max_order are
summed into an explicit `remainder` (actual value minus the explicit terms), so terms + remainder always
equal the model's actual value; the tests check the remainder against the explicit higher-order terms.
Output norms (frozen.py) put diag(gamma_post) into each head's W_O and 1 / rho_post(i) into its coefficient at its
destination; a soft-capped logit is expanded with its cap factor g frozen per destination (frozen.readout), so the
terms sum to the capped value the model outputs.

Algorithm: backward "suffix" propagation, batched by layer. A suffix (h_m..h_k) carries a coefficient over
source positions coef [q, n] (e_p^T A^{h_k} D ... A^{h_m} D) and a residual readout vector w [d_model]
(C W_OV^{h_m} ... C W_OV^{h_k} r). Prepending all heads of layer l to all suffixes starting later is two
einsums (coef @ A^l, W_OV^l w via W_O then W_V, never d_model x d_model). A source X_s ends a suffix:
term[j] = coef[j] * (X_s[j] . w), or, when many suffixes share the first layer, (X_s C W_V^l)[j] . (W_O w).
The suffixes of the last order only end terms, so their readouts w are never formed: their terms always go
through the first head's values, computed once per layer and key/value group (grouped-query attention), and
g = W_O w ([H, P0, d_head]). Term names are built on demand (path_names.PathNames). `cost` walks the same
steps (`_schedule`) and prices what each holds. The answer's types are in path_terms.py (PathExpansion), the
sources in path_sources.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.errors import InvalidInputError, LimitExceededError
from circuits_core.model.head_names import head_name
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.frozen import (
    FrozenRun,
    attention,
    centre,
    frozen_run,
    head_o_apply,
    head_ov_apply,
    ln_weight,
    readout,
    run_cost,
    target_cap_factors,
    value_inv_scale,
)
from circuits_core.prompt.path_names import PathNames
from circuits_core.prompt.path_sources import PathSource, path_sources
from circuits_core.prompt.path_terms import PathExpansion, Target


def _positions(positions: int | Sequence[int] | None, n: int, device: torch.device) -> Tensor:
    if positions is None:
        return torch.arange(n, device=device)
    pos = torch.tensor([positions] if isinstance(positions, int) else list(positions), dtype=torch.long, device=device)
    if pos.numel() == 0 or (pos < -n).any() or (pos >= n).any():
        raise InvalidInputError(f"destination positions must be in [-{n}, {n}), got {pos.tolist()}")
    return pos % n


def _as_slice(idx: list[int]) -> slice | list[int]:
    """An arithmetic progression of indices as a slice (a view when indexing), else the list."""
    if len(idx) == 1 or (
        len(idx) > 1 and all(b - a == idx[1] - idx[0] > 0 for a, b in zip(idx, idx[1:], strict=False))
    ):
        return slice(idx[0], idx[-1] + 1, idx[1] - idx[0] if len(idx) > 1 else 1)
    return idx


class _Expander:
    """Accumulates terms; one instance per expansion.

    Sources are batched: the sequence sources ([n, d_model]: the embedding, MLP outputs) are stacked into one
    [S, n, d_model] tensor, the constant ones (biases) into [S', d_model]. Sources are listed by the layer where
    they enter, so the sources that can start suffixes at a layer are a prefix of each stack.
    """

    def __init__(
        self, model: Transformer, run: FrozenRun, sources: list[PathSource], by_source: bool, max_order: int, q: int
    ):
        self.model, self.run, self.sources, self.by_source = model, run, sources, by_source
        self.paths = PathNames()
        self.block_orders: list[tuple[int, int]] = []  # (order, number of terms) per block of self.paths
        entries = [src.entry for src in sources]
        if entries != sorted(entries):
            raise AssertionError("path sources must be ordered by entry layer")
        # every term, plus one row for the unembedding bias: [T + 1, q, n] (by source) or [T + 1, q]
        self.n_terms = _term_count(entries, model.cfg.n_layers, model.cfg.n_heads, max_order)
        shape = (self.n_terms + 1, q, run.n) if by_source else (self.n_terms + 1, q)
        self.values = torch.empty(shape, dtype=model.dtype, device=model.device)
        self.offset = 0
        self.const = [  # constant rows (a bias; per position under learned sinks or an output norm)
            s for s, src in enumerate(sources) if src.name and src.name[0].startswith("bias:") and src.X.shape[0] == 1
        ]
        self.seq = [s for s in range(len(sources)) if s not in self.const]
        self.X_seq = torch.stack([sources[s].X for s in self.seq])  # [S, n, d]
        self.X_const = torch.stack([sources[s].X[0] for s in self.const]) if self.const else None  # [S', d]
        self._values_cache: dict[int, Tensor] = {}

    def _values(self, layer: int, X: Tensor) -> Tensor:
        """X C diag(w_ln1) W_V^g: rows X [m, d] read by each key/value group g of `layer`, [n_kv_heads, m, d_head]."""
        w = ln_weight(self.model, f"blocks.{layer}.ln1")
        X = centre(self.model, X)
        return torch.matmul(X * w if w is not None else X, attention(self.model, layer).grouped("W_V"))

    def layer_values(self, layer: int, count: int) -> Tensor:
        """The values of the first `count` sequence sources, [n_kv_heads, count * n, d_head], cached per layer."""
        if layer not in self._values_cache or self._values_cache[layer].shape[1] < count * self.run.n:
            self._values_cache[layer] = self._values(layer, self.X_seq[:count].flatten(0, 1))
        return self._values_cache[layer][:, : count * self.run.n]

    def _through_values(self, g: Tensor, V: Tensor) -> Tensor:
        """g [H, P0, dh] (W_O w per head) . V [G, m, dh] (values of m rows per group) -> [H, P0, m]: query head h
        reads group h // group_size, so the heads of a group are one matmul (never repeated per head)."""
        cfg = self.model.cfg
        H, P0, m = g.shape[0], g.shape[1], V.shape[1]
        grouped = g.reshape(cfg.n_kv_heads, cfg.group_size * P0, cfg.d_head)  # [G, group * P0, dh]
        return torch.matmul(grouped, V.transpose(-2, -1)).view(H, P0, m)

    def emit(
        self,
        order: int,
        first_layer: int,
        heads: list[tuple[str, ...]],
        rests: list[tuple[str, ...]],
        coef: Tensor,
        w: Tensor | None,
        g: Tensor | None = None,
    ) -> None:
        """Terms of every source that can start the suffixes head + rest (head-major). coef [P, q, n], w [P, d]
        (None when only g is known); g [H, P0, d_head] (W_O w before the heads of `first_layer` were prepended,
        P = H * P0) enables the dot through the values of the first head, cheaper when P0 > d_head."""
        valid = [s for s, src in enumerate(self.sources) if src.entry <= first_layer]
        seq = [i for i, s in enumerate(valid) if s not in self.const]
        const = [i for i, s in enumerate(valid) if s in self.const]
        P, q, n = coef.shape
        out = self.values[self.offset : self.offset + len(valid) * P].view(len(valid), P, *self.values.shape[1:])
        self.offset += len(valid) * P
        through_values = g is not None and (w is None or g.shape[1] > g.shape[2])
        if seq:
            S = len(seq)
            if through_values:
                assert g is not None
                dots = self._through_values(g, self.layer_values(first_layer, S))  # [H, P0, S*n]
                dots = dots.unflatten(2, (S, n)).permute(2, 0, 1, 3).flatten(1, 2)  # [S, P, n]
            else:
                assert w is not None
                dots = (self.X_seq[:S].flatten(0, 1) @ w.T).view(S, n, P).transpose(1, 2)  # [S, P, n]
            self._terms(coef, dots, out, seq)
        if const:
            assert self.X_const is not None
            if w is not None:
                dots_c = (self.X_const[: len(const)] @ w.T)[:, :, None]  # [S', P, 1]
            else:  # (beta C diag(w_ln) W_V^h) . g[h, p]
                assert g is not None
                V_c = self._values(first_layer, self.X_const[: len(const)])  # [G, S', dh]
                dots_c = self._through_values(g, V_c).permute(2, 0, 1).flatten(1, 2)[:, :, None]  # [S', P, 1]
            self._terms(coef, dots_c, out, const)
        size = self.paths.add([self.sources[s].name for s in valid], heads, rests)
        self.block_orders.append((order, size))

    def orders(self) -> Tensor:
        """[T]: the order of every term emitted so far."""
        orders = torch.tensor([o for o, _ in self.block_orders], dtype=torch.long, device=self.model.device)
        sizes = torch.tensor([c for _, c in self.block_orders], dtype=torch.long, device=self.model.device)
        return orders.repeat_interleave(sizes)

    def _terms(self, coef: Tensor, dots: Tensor, out: Tensor, rows: list[int]) -> None:
        """out[rows] = coef [P, q, n] * dots [S, P, n or 1] (summed over sources positions unless by_source)."""
        index = _as_slice(rows)
        if self.by_source:
            terms = coef[None] * dots[:, :, None, :]  # [S, P, q, n]
        elif dots.shape[-1] == 1:
            terms = coef.sum(-1)[None] * dots  # [S, P, q]
        else:
            terms = torch.einsum("pqn,spn->spq", coef, dots)
        if isinstance(index, slice):
            out[index] = terms
        else:
            out.index_copy_(0, torch.tensor(index, device=out.device), terms)


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
    if run.logit_cap is not None and q > 1:  # a cap factor per destination: one expansion each, side by side
        parts = [
            expand_logits(model, tokens, target, int(p), max_order, by_source, run, max_elements, should_stop)
            for p in dest
        ]
        return _side_by_side(parts, dest)
    n_suffixes = _count_suffixes(L, H, max_order)
    sources = path_sources(model, run)
    n_terms = n_suffixes * len(sources)
    if n_terms * q * (n if by_source else 1) > max_elements:
        raise LimitExceededError(
            f"about {n_terms} terms x {q} positions x {n if by_source else 1} sources is over the "
            f"budget of {max_elements} numbers; lower max_order, positions or by_source"
        )
    heads_of: list[list[tuple[str, ...]]] = [[(head_name(layer, h),) for h in range(H)] for layer in range(L)]
    with torch.no_grad():
        r, const = readout(model, target, target_cap_factors(run, target, int(dest[0])))
        inv_f = run.inv_scale("ln_final")
        exp = _Expander(model, run, sources, by_source, max_order, q)
        coef0 = torch.zeros(1, q, n, dtype=model.dtype, device=model.device)
        coef0[0, torch.arange(q), dest] = inv_f[dest]
        exp.emit(0, L, [()], [()], coef0, r[None])
        # Suffixes of the previous order, concatenated in decreasing order of their first layer, so the ones that
        # start after `layer` are a prefix: names, coef [P, q, n], w [P, d], and the first layer of each.
        names_prev: list[tuple[str, ...]] = [()]
        coef_prev, w_prev, first_prev = coef0, r[None], [L]
        for order in range(1, max_order + 1):
            last = order == max_order  # the new suffixes end terms only: their readouts w are never needed
            names_new_all: list[tuple[str, ...]] = []
            coefs, ws, firsts = [], [], []
            for layer in range(L - 1, -1, -1):
                check_stop(should_stop, "path expansion")
                P0 = sum(1 for f in first_prev if f > layer)
                if P0 == 0:
                    continue
                names, coef, w = names_prev[:P0], coef_prev[:P0], w_prev[:P0]  # [P0, q, n], [P0, d]
                A = run.patterns[layer]  # [H, n, n]
                inv = value_inv_scale(model, run, layer)  # [n]: ln1's 1/sigma (and MLA's 1/rho_kv) at the sources
                # the output norm's 1 / rho at the heads' rows
                written = coef * run.inv_scale(f"blocks.{layer}.ln1_post") if cfg.post_norms else coef
                coef_new = torch.matmul(written.reshape(P0 * q, n), A).mul_(inv).view(H * P0, q, n)  # [H*P0, q, n]
                if last:
                    exp.emit(order, layer, heads_of[layer], names, coef_new, None, head_o_apply(model, layer, w))
                    continue
                g, w_new = head_ov_apply(model, layer, w)  # [H, P0, dh], [H, P0, d]
                w_new = w_new.flatten(0, 1)
                exp.emit(order, layer, heads_of[layer], names, coef_new, w_new, g)
                names_new_all += [head + nm for head in heads_of[layer] for nm in names]
                coefs.append(coef_new)
                ws.append(w_new)
                firsts += [layer] * (H * P0)
            if not coefs:
                break
            names_prev, first_prev = names_new_all, firsts
            coef_prev, w_prev = torch.cat(coefs), torch.cat(ws)
        assert exp.offset == exp.n_terms
        values_all = exp.values  # [T + 1, q, n] or [T + 1, q]; the last row: the order-0 term of the final biases
        if by_source:
            values_all[-1] = 0
            values_all[-1, torch.arange(q), dest] = const
            values = values_all.sum(-1)
        else:
            values = values_all
            values[-1] = const
        exp.paths.add([("bias:unembed",)], [()], [()])
        exp.block_orders.append((0, 1))
        actual = _actual_value(run.logits_at(dest), target)
        remainder = actual - values.sum(0)
    return PathExpansion(
        dest, target, max_order, exp.paths, exp.orders(), values, values_all if by_source else None, actual, remainder
    )


def _side_by_side(parts: list[PathExpansion], dest: Tensor) -> PathExpansion:
    """One expansion of several destinations from single-destination expansions of the same terms."""
    first = parts[0]
    by_source = (
        None if first.by_source is None else torch.cat([p.by_source for p in parts if p.by_source is not None], 1)
    )
    return PathExpansion(
        dest, first.target, first.max_order, first.paths, first.orders, torch.cat([p.values for p in parts], 1),
        by_source, torch.cat([p.value for p in parts]), torch.cat([p.remainder for p in parts]),
    )  # fmt: skip


def _actual_value(logits: Tensor, target: Target) -> Tensor:
    """logits [q, d_vocab] -> [q]: the target logit or logit difference."""
    if isinstance(target, int):
        return logits[:, target]
    a, b = target
    return logits[:, a] - logits[:, b]


def _schedule(L: int, H: int, max_order: int) -> list[tuple[int, int, int]]:
    """(order, layer, P0) of every step of expand_logits: the heads of `layer` are prepended to the P0 suffixes of
    order - 1 that start after it, making H * P0 suffixes of `order` (layers in decreasing order within an order)."""
    steps, prev = [], {L: 1}  # prev: first layer -> number of suffixes of the previous order
    for order in range(1, max_order + 1):
        new = {}
        for layer in range(L - 1, -1, -1):
            P0 = sum(c for f, c in prev.items() if f > layer)
            if P0:
                steps.append((order, layer, P0))
                new[layer] = H * P0
        prev = new
    return steps


def _term_count(entries: list[int], L: int, H: int, max_order: int) -> int:
    """Exact number of (source, suffix) terms: sources enter at `entries`, suffixes up to max_order heads."""
    later = sum(H * P0 * sum(1 for e in entries if e <= layer) for _, layer, P0 in _schedule(L, H, max_order))
    return len(entries) + later  # order 0: every source


def _count_suffixes(L: int, H: int, max_order: int) -> int:
    """Number of head tuples with strictly increasing layers, of length 0..max_order."""
    # count[k] = C(L, k) * H^k
    from math import comb

    return sum(comb(L, k) * H**k for k in range(max_order + 1))


def cost(model: Transformer, n: int, max_order: int, by_source: bool = False, q: int = 1, k: int | None = None) -> Cost:
    """expand_logits on n tokens at q positions; answer: the k listed terms (all when k is None), each with its
    path of up to max_order heads (and n source values with by_source).

    Held throughout: the frozen run, one value per term (x n with by_source), the suffixes of every order below
    the last (a [q, n] coefficient and a [d_model] readout each, the newest order twice while it is
    concatenated) and the first heads' values of the sequence sources ([n_kv_heads, S n, d_head] per layer).
    Plus the largest step (`_schedule`): the new coefficients [H P0, q, n], g [H, P0, d_head], the new readouts
    [H P0, d_model] (not at the last order: its suffixes only end terms), the dots [S, H P0, n] and the terms."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    order = max(0, min(max_order, L))
    mlps = 0 if cfg.attn_only else min(cfg.num_experts or 1, n * cfg.experts_per_token)  # MLP parts per layer
    mlps += 1 if cfg.moe_shared_d_mlp else 0  # DeepSeek's shared experts: one part more
    entries = [0] + [layer + 1 for layer in range(L) for _ in range(1 + mlps)]
    terms = _term_count(entries, L, H, order) + 1
    per_term = q * (n if by_source else 1)
    steps = _schedule(L, H, order)

    def n_seq(layer: int) -> int:  # sequence sources read at `layer`: the embedding, the earlier MLPs (and biases)
        return 1 + mlps * layer + (layer if cfg.attn_sinks else 0)

    suffix = q * n + cfg.d_model  # a coefficient and a readout
    kept = sum(H * P0 for o, _, P0 in steps if o < order) + sum(H * P0 for o, _, P0 in steps if o == order - 1)
    values = cfg.n_kv_heads * n * cfg.d_head * sum(n_seq(layer) for layer in {layer for _, layer, _ in steps})
    step = max(
        [H * P0 * (q * n + cfg.d_head + (cfg.d_model if o < order else 0) + n_seq(layer) * (n + per_term))
         for o, layer, P0 in steps] + [len(entries) * (n + per_term)]
    )  # fmt: skip
    work = (terms * (per_term + q) + kept * suffix + values + step) * itemsize(model.dtype)
    listed = terms if k is None else min(k, terms) + 2
    return (run_cost(model, n) + Cost(work)).with_answer(
        numbers=listed * (2 + (n if by_source else 0)) + (order + 1) + 3 * n, labels=listed * (order + 1) + n
    )
