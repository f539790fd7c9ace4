"""Top entries of the full OV, QK and direct-path circuits, and skip-trigram tables (paper-math 2.2-2.6).

Every circuit is a FactoredMatrix [d_vocab, d_vocab] from circuits_core.circuits; with a token we read its
row (or, for QK keys, its column) from the factors, without one the global top-k streams row blocks under
`limits.matrix_budget_bytes`. Nothing sized d_vocab x d_vocab is allocated.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from app.schemas import CircuitTopView, MatrixEntry, ScoredToken, SkipTrigram, SkipTrigramView
from app.settings import Limits
from app.views.inputs import check_k, model_ref, resolve_token, token_ref
from circuits_core import circuits
from circuits_core.config import head_name, parse_head
from circuits_core.factored import FactoredMatrix
from circuits_core.weights import LoadedModel

QKSide = Literal["query", "key"]

LABELS = {
    "ov": ("source token (attended to)", "output token (logit raised)"),
    "qk": ("query token (destination)", "key token (source)"),
    "direct": ("current token", "next token"),
}


def _top_view(
    loaded: LoadedModel,
    fm: FactoredMatrix,
    circuit: Literal["ov", "qk", "direct"],
    head: str | None,
    token: str | None,
    side: Literal["row", "column"],
    k: int,
    limits: Limits,
) -> CircuitTopView:
    rows_label, cols_label = LABELS[circuit]

    def view(k: int, entries: list[MatrixEntry], **found: Any) -> CircuitTopView:
        return CircuitTopView(
            model=model_ref(loaded), circuit=circuit, head=head, row_label=rows_label, col_label=cols_label,
            k=k, entries=entries, **found,
        )

    with torch.no_grad():
        if token is None:
            k = check_k(k, limits, fm.ldim * fm.rdim)
            values, rows, cols = fm.topk_global(k, budget_bytes=limits.matrix_budget_bytes)  # [k] each
            entries = [
                MatrixEntry(row=token_ref(loaded, r), col=token_ref(loaded, c), value=float(v))
                for v, r, c in zip(values.tolist(), rows.tolist(), cols.tolist(), strict=True)
            ]
            return view(k, entries)
        t = resolve_token(loaded, token)
        line: Tensor = (fm.rows([t]) if side == "row" else fm.cols([t]))[0]  # [d_vocab]
        k = check_k(k, limits, line.numel())
        values, idx = line.topk(k)
        own = float(line[t]) if fm.ldim == fm.rdim else None
        ref = token_ref(loaded, t)
        entries = [
            MatrixEntry(row=ref, col=token_ref(loaded, i), value=float(v))
            if side == "row"
            else MatrixEntry(row=token_ref(loaded, i), col=ref, value=float(v))
            for v, i in zip(values.tolist(), idx.tolist(), strict=True)
        ]
        rank = int((line > line[t]).sum()) + 1 if own is not None else None
    return view(k, entries, token=ref, side=side, diagonal=own, diagonal_rank=rank)


def build_ov_view(loaded: LoadedModel, head: str, token: str | None, k: int, limits: Limits) -> CircuitTopView:
    """Full OV circuit W_E W_V W_O W_U of a head: the token's row (the logits it raises), else global top-k."""
    layer, h = parse_head(head, loaded.model.cfg)
    fm = circuits.full_ov_circuit(loaded.model, layer, h)
    return _top_view(loaded, fm, "ov", head_name(layer, h), token, "row", k, limits)


def build_qk_view(
    loaded: LoadedModel, head: str, token: str | None, k: int, limits: Limits, side: QKSide = "query"
) -> CircuitTopView:
    """Full QK circuit W_E W_Q W_K^T W_E^T / s: as query, the keys a token attends to; as key, the queries attending to it."""
    layer, h = parse_head(head, loaded.model.cfg)
    fm = circuits.full_qk_circuit(loaded.model, layer, h)
    return _top_view(loaded, fm, "qk", head_name(layer, h), token, "row" if side == "query" else "column", k, limits)


def build_direct_view(loaded: LoadedModel, token: str | None, k: int, limits: Limits) -> CircuitTopView:
    """Direct path W_E W_U (the bigram table): top next tokens for a current token, else global top-k."""
    return _top_view(loaded, circuits.direct_path(loaded.model), "direct", None, token, "row", k, limits)


def _strongest_source(loaded: LoadedModel, layer: int, h: int, limits: Limits) -> int:
    """The source token of the largest full-OV entry (the default source of the skip-trigram table)."""
    _, rows, _ = circuits.full_ov_circuit(loaded.model, layer, h).topk_global(1, budget_bytes=limits.matrix_budget_bytes)
    return int(rows[0])


def build_skip_trigrams_view(loaded: LoadedModel, head: str, token: str | None, k: int, limits: Limits) -> SkipTrigramView:
    """[source] ... [destination] -> [out] through one head; without a token, the source of the largest OV entry."""
    layer, h = parse_head(head, loaded.model.cfg)
    k = check_k(k, limits, loaded.model.cfg.d_vocab)
    with torch.no_grad():
        source = resolve_token(loaded, token) if token is not None else _strongest_source(loaded, layer, h, limits)
        st = circuits.skip_trigrams(loaded.model, layer, h, source, k)
    dest = [ScoredToken(token=token_ref(loaded, t), value=float(v)) for t, v in zip(st.dest_tokens.tolist(), st.dest_scores.tolist(), strict=True)]
    outs = [ScoredToken(token=token_ref(loaded, t), value=float(v)) for t, v in zip(st.out_tokens.tolist(), st.out_scores.tolist(), strict=True)]
    qk = dict(zip(st.dest_tokens.tolist(), st.dest_scores.tolist(), strict=True))
    ov = dict(zip(st.out_tokens.tolist(), st.out_scores.tolist(), strict=True))
    src = token_ref(loaded, source)
    trigrams = [
        SkipTrigram(source=src, destination=token_ref(loaded, b), out=token_ref(loaded, c), qk=qk[b], ov=ov[c], joint=joint)
        for b, c, joint in st.triples[:k]
    ]
    return SkipTrigramView(
        model=model_ref(loaded), head=head_name(layer, h), source=src, k=k, copying=st.copying,
        destinations=dest, outs=outs, trigrams=trigrams,
    )
