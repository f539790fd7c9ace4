"""The token tables of a circuit shared by the views: the global top-k of a [d_vocab, d_vocab] circuit over the ranked
token set, or one token's row or column, as a CircuitTopView (heads' OV, QK and direct tables; an MLP writer's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from app.schemas import CircuitTopView, MatrixEntry
from app.settings import Limits
from app.views.shared.basis import basis
from app.views.shared.global_tables import CircuitOf, global_top
from app.views.shared.inputs import check_k, model_ref, resolve_token, token_ref
from app.views.shared.token_sets import token_set
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.ranking import top_k

LABELS = {
    "ov": ("source token (attended to)", "output token (logit raised)"),
    "expert": ("source token (the expert's input)", "output token (logit raised)"),
    "qk": ("query token (destination)", "key token (source)"),
    "direct": ("current token", "next token"),
}


def top_view(
    loaded: LoadedModel,
    circuit_of: CircuitOf,
    circuit: Literal["ov", "qk", "direct", "expert"],
    head: str | None,
    token: str | None,
    side: Literal["row", "column"],
    k: int,
    limits: Limits,
    min_count: int | None = None,
    line_of: Callable[[int], Tensor] | None = None,
    vocab: Literal["default", "all"] = "default",
    offset: int = 0,
    name: str | None = None,
) -> CircuitTopView:
    """circuit_of(ids) builds the factored circuit (global top-k, or a token's line); line_of(t), when given,
    reads a token's row/column straight from the weights instead (no [d_vocab, d_head] factors: ms on GPT-2).
    `name` names the table's component in the cache key when it is not a head (an MLP writer: L1.mlp.e3)."""
    rows_label, cols_label = LABELS[circuit]
    ranked = token_set(
        loaded, min_count, vocab if token is None else "all"
    )  # a token's line: every token or min_count's
    n_vocab = None if ranked.ids is None else ranked.n

    def view(k: int, entries: list[MatrixEntry], **found: Any) -> CircuitTopView:
        return CircuitTopView(
            model=model_ref(loaded),
            circuit=circuit,
            head=head,
            row_label=rows_label,
            col_label=cols_label,
            k=k,
            entries=entries,
            min_count=min_count,
            n_tokens=n_vocab,
            token_set=ranked.said,
            token_ids=None if ranked.ids is None else ranked.ids.tolist(),
            basis=basis(loaded),
            **found,
        )

    with torch.no_grad():
        if token is None:
            k = check_k(k, limits, ranked.n**2)
            top = global_top(loaded, circuit_of, (circuit, head or name or "", str(offset)), k, ranked, limits)
            entries = [
                MatrixEntry(row=token_ref(loaded, r), col=token_ref(loaded, c), value=v)
                for v, r, c in zip(top.values, top.rows, top.cols, strict=True)
            ]
            return view(k, entries)
        vocab_ids = ranked.ids
        t = resolve_token(loaded, token)
        if line_of is not None:
            line: Tensor = line_of(t)  # [d_vocab]
        else:
            fm = circuit_of(None)
            line = (fm.rows([t]) if side == "row" else fm.cols([t]))[0]  # [d_vocab]
        own = float(line[t])  # every circuit here is [d_vocab, d_vocab]
        if vocab_ids is not None:  # rank and list only the frequent tokens
            line = torch.full_like(line, float("-inf")).index_copy(0, vocab_ids, line[vocab_ids])
        k = check_k(k, limits, line.numel() if n_vocab is None else n_vocab)
        values, idx = top_k(line, k)  # equal values: the lower token id first
        ref = token_ref(loaded, t)
        entries = [
            MatrixEntry(row=ref, col=token_ref(loaded, i), value=float(v))
            if side == "row"
            else MatrixEntry(row=token_ref(loaded, i), col=ref, value=float(v))
            for v, i in zip(values.tolist(), idx.tolist(), strict=True)
        ]
        rank = int((line > own).sum()) + 1 if own is not None else None
    return view(k, entries, token=ref, side=side, diagonal=own, diagonal_rank=rank)
