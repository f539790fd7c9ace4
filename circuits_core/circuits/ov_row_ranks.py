"""Where each sampled source row's own logit ranks in its row of a full OV circuit, for one circuit or many at once
(the self-copy shares of docs/maths.md §2.8; the counting itself is own_rank.count_above's).

Row a of M = W_E_eff W_V W_O W_U [r rows, n columns] is x_a W_V W_O W_U: the rows' x W_V [r, d_head] and their logit
directions u_a = x_a W_V W_O [r, d_model] give any block of it, as u W_U[:, c] (2 d_model flops an entry) or as
(x W_V)(W_O W_U[:, c]) (2 d_head d_model a column, then 2 d_head an entry): the first is cheaper for few rows.

Many circuits over the same source rows and columns (every head of the overview's copying panel) share:
- what does not depend on the circuit: the rows' W_E_eff [r, d_model], their own columns W_U[:, a] and the probed
  columns of W_U, gathered once (column gathers of a [d_model, n] W_U cost more than one circuit's probe);
- the scan of the rows the probe leaves open, where a circuit leaves few of them (then the first route is the cheaper
  for it): those rows' u_a of every circuit are stacked, and each block of W_U's columns is read once for all of
  them, in one wide product, instead of once per circuit in a product a few rows tall. A circuit that leaves many
  rows open is scanned on its own, through W_O W_U's columns, only until few of them are left (the rows ranked
  below the top k settle as columns above them are seen): those go on in the stack from the column reached.
Each row's count is the same either way (own_rank: exact, rows dropped only once k columns above are seen).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from circuits_core.circuits.embedding import embed_eff_rows
from circuits_core.circuits.factored import DEFAULT_BUDGET_BYTES
from circuits_core.circuits.own_rank import Logits, probe_columns, probe_size, scan, unsettled_by_probe
from circuits_core.cost import check_stop
from circuits_core.model.transformer import Transformer

BLOCK_BYTES = 16 * 2**20  # a block of logits at most this big, compared in place right after it is formed (on the
# GPT-2-small shape 83 source rows: ~-30 % against 4 MiB blocks of row-major logits, 2x against 256 MiB)
STACK_CIRCUITS = 32  # circuits ranked together at most by the callers (self_copy, the copying pages): their stack


@dataclass
class RowRanks:
    """One full OV circuit's source rows, in the order drawn (copying.sample_order): where each row's own logit
    ranks."""

    above: Tensor  # [r] int64: ranked columns whose logit is above the row's own, capped at k (a tie counts for it)
    diag: Tensor  # [r] float64: the row's own logit M[a, a]
    k: int

    def first(self, r: int) -> RowRanks:
        """The first r rows drawn: the same rows as a sample of r of the same seed."""
        return RowRanks(self.above[:r], self.diag[:r], self.k)

    def shares(self) -> Tensor:
        """[top1, topk, diag > 0, diag median] float64 over these rows."""
        r = len(self.above)
        return torch.tensor(
            [
                int((self.above == 0).sum()) / r,
                int((self.above < self.k).sum()) / r,
                float((self.diag > 0).double().mean()),
                float(self.diag.quantile(0.5)),
            ],
            dtype=torch.float64,
        )


def row_ranks(
    model: Transformer,
    W_V: Tensor,
    W_O: Tensor,
    k: int,
    order: Tensor,
    vocab: Tensor | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> RowRanks:
    """The rows `order` (positions into the ranked tokens: vocab, or all) of M = W_E_eff W_V W_O W_U, each ranked
    against every ranked column (own_rank: rows settled at k early are not formed whole)."""
    return rows_ranks(model, [(W_V, W_O)], k, order, vocab, budget_bytes)[0]


def pooled(d_model: int, d_head: int, rows: int) -> bool:
    """Whether `rows` open rows of one circuit are scanned in the stack of every circuit's (through W_U's columns,
    2 d_model flops an entry) rather than on their own (through W_O W_U's: 2 d_head (d_model + rows) a column)."""
    return d_model * rows <= d_head * (d_model + rows)


def circuit_blocks(X: Tensor, U: Tensor, W_O: Tensor, W_U: Tensor, W_probe: Tensor | None) -> Logits:
    """One circuit's blocks of logits (own_rank.Logits) from its rows' x W_V [r, d_head] and u [r, d_model]: a block of
    the scan (columns a slice of W_U [d_model, n]) or the probe (W_probe [d_model, p]: W_U's probed columns), each by
    the cheaper route for the rows asked."""
    d, dh = W_U.shape[0], W_O.shape[0]
    probed: list[Tensor] = []  # W_O W_U's probed columns [d_head, p], formed once for every row chunk of the probe

    def logits(rows: Tensor, columns: Tensor | slice) -> Tensor:  # [a, c]
        W_c = W_U[:, columns] if isinstance(columns, slice) else W_probe  # [d_model, c]
        assert W_c is not None
        if pooled(d, dh, len(rows)):
            return U[rows] @ W_c
        if isinstance(columns, slice):  # a block of the scan: each asked once
            return X[rows] @ (W_O @ W_c)
        if not probed:
            probed.append(W_O @ W_c)
        return X[rows] @ probed[0]

    return logits


def rows_ranks(
    model: Transformer,
    circuits: Sequence[tuple[Tensor, Tensor]],
    k: int,
    order: Tensor,
    vocab: Tensor | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> list[RowRanks]:
    """row_ranks of each circuit (W_V [d_model, d_head], W_O [d_head, d_model]) on the same rows and columns, the
    work shared between them (module docstring)."""
    ids = order if vocab is None else vocab[order]  # [r] token ids of the source rows
    W_U = model.W_U if vocab is None else model.W_U[:, vocab]  # [d_model, n]
    d, n = W_U.shape
    size = W_U.element_size()
    own = order.to(W_U.device)  # [r] each row's own column among the n
    E = embed_eff_rows(model, ids)  # [r, d_model]
    W_own = W_U[:, own].T  # [r, d_model] each row's own column of W_U
    probe = probe_columns(n)  # [p] or None
    W_probe = None if probe is None else W_U[:, probe.to(W_U.device)]  # [d_model, p], gathered once
    block = min(budget_bytes, BLOCK_BYTES)
    ranks: list[RowRanks] = []
    stacked: list[tuple[int, Tensor, int, Tensor]] = []  # (circuit, its open rows [o], the column each starts at,
    # the columns counted before it [o])
    U_open: list[Tensor] = []  # each stacked circuit's open rows' u [o, d_model]
    own_open: list[Tensor] = []  # and their own logits [o]
    for i, (W_V, W_O) in enumerate(circuits):
        check_stop(what="OV self-copy shares")
        dh = W_V.shape[1]
        X = E @ W_V  # [r, d_head]
        U = X @ W_O  # [r, d_model]: the rows' logit directions
        diag = (U * W_own).sum(-1)  # [r] each row's own logit M[a, a]
        logits = circuit_blocks(X, U, W_O, W_U, W_probe)
        rows = torch.arange(len(own)) if probe is None else unsettled_by_probe(logits, diag, own, k, block, size, probe)
        above = torch.full((len(own),), k, dtype=torch.int64)
        begin, count = 0, torch.zeros(len(rows), dtype=torch.int64)
        if not pooled(d, dh, len(rows)):  # through W_O W_U's columns until few rows are left open, then the stack
            alone = scan(logits, diag, own, rows, n, k, block, size, handoff=partial(pooled, d, dh))
            above[rows] = alone.above
            rows, begin, count = rows[alone.open], alone.reached, alone.above[alone.open]
        if len(rows):
            stacked.append((i, rows, begin, count))
            U_open.append(U[rows])
            own_open.append(diag[rows])
        ranks.append(RowRanks(above, diag.double().cpu(), k))
    if stacked:  # every circuit's few open rows: each block of W_U's columns read once for all of them
        U_all = torch.cat(U_open)  # [o, d_model]
        together = scan(
            lambda rows, columns: U_all[rows] @ W_U[:, columns],
            torch.cat(own_open),
            torch.cat([own[rows] for _, rows, _, _ in stacked]),
            torch.arange(len(U_all)),
            n,
            k,
            block,
            size,
            begin=torch.cat([torch.full((len(rows),), b) for _, rows, b, _ in stacked]),
            count=torch.cat([c for _, _, _, c in stacked]),
        )
        parts = together.above.split([len(rows) for _, rows, _, _ in stacked])
        for (i, rows, _, _), part in zip(stacked, parts, strict=True):
            ranks[i].above[rows] = part
    return ranks


def row_ranks_flops(d_model: int, d_head: int, n: int, r: int) -> int:
    """The most row_ranks (or rows_ranks, per circuit) costs on r source rows ranked against n columns: the rows'
    W_E_eff W_V [r, d_head] and their W_O [r, d_model], the probe, then every row scanned whole (its open rows
    stacked through W_U's columns only while that is the cheaper route, so never more than through (W_O W_U)'s)."""
    p = probe_size(n)
    probe = 2 * d_model * p * r + 2 * d_model * d_head * p  # each row chunk the cheaper way, (W_O W_U)'s columns once
    return 4 * r * d_model * d_head + probe + 2 * n * d_model * d_head + 2 * n * d_head * r


def stacked_bytes(d_model: int, d_head: int, r: int, itemsize: int) -> int:
    """The most one circuit adds to rows_ranks's stack: its open rows' u [o, d_model] while the stack is the cheaper
    route for them (pooled), their own logits and columns, and the counts."""
    o = r if d_model <= d_head else min(r, d_head * d_model // (d_model - d_head))  # the most pooled(o) allows
    return o * (d_model * itemsize + 32)
