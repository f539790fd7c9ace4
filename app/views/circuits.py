"""Top entries of the full OV, QK and direct-path circuits, and skip-trigram tables (paper-math 2.2-2.6).

Every circuit is a FactoredMatrix [d_vocab, d_vocab] from circuits_core.circuits; with a token we read its
row (or, for QK keys, its column) from the factors, without one the global top-k streams row blocks under
`limits.matrix_budget_bytes`. Nothing sized d_vocab x d_vocab is allocated.

`min_count` (optional) keeps only tokens seen at least that often in training, read from the model folder's
`token_counts.npy` (circuits_core.phenomena.load_token_counts): the global top-k runs on the factors restricted
to those rows and columns, a token's row or column lists only those tokens. Rare, under-trained tokens
otherwise dominate the global tables of the shipped toy models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from app.analysis import Analysis
from app.params import DirectParams, OVParams, QKParams, SkipTrigramParams
from app.schemas import CircuitTopView, MatrixEntry, ScoredToken, SkipTrigram, SkipTrigramView
from app.settings import Limits
from app.views.basis import basis, raw_copy_cost, with_basis
from app.views.inputs import check_k, model_ref, resolve_token, token_ref
from app.views.rotary import check_offset, is_rotary
from circuits_core import circuits, rotary
from circuits_core.config import head_name, parse_head
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError
from circuits_core.factored import FactoredMatrix
from circuits_core.phenomena import TOKEN_COUNTS_FILE, HeldOutBigrams, find_eval_data, load_token_counts
from circuits_core.weights import LoadedModel

LABELS = {
    "ov": ("source token (attended to)", "output token (logit raised)"),
    "qk": ("query token (destination)", "key token (source)"),
    "direct": ("current token", "next token"),
}


def frequent_tokens(loaded: LoadedModel, min_count: int | None) -> Tensor | None:
    """Sorted ids [n] of the tokens seen at least min_count times in training; None when min_count is None.

    InvalidInputError when the model has no token counts or no token is that frequent.
    """
    if min_count is None:
        return None
    counts = load_token_counts(loaded.path, loaded.model.cfg.d_vocab)
    if counts is None:
        raise InvalidInputError(
            f"model {loaded.path.name!r} has no token counts ({TOKEN_COUNTS_FILE} in its folder): min_count is not available"
        )
    ids = np.flatnonzero(counts >= min_count)
    if ids.size == 0:
        raise InvalidInputError(f"no token was seen min_count={min_count} times in training (the most frequent: {int(counts.max())})")
    return torch.from_numpy(ids).long()


def has_token_counts(loaded: LoadedModel) -> bool:
    """Whether the model folder carries token_counts.npy (so min_count is available)."""
    return (loaded.path / TOKEN_COUNTS_FILE).is_file()


def _top_view(
    loaded: LoadedModel,
    circuit_of: Callable[[], FactoredMatrix],
    circuit: Literal["ov", "qk", "direct"],
    head: str | None,
    token: str | None,
    side: Literal["row", "column"],
    k: int,
    limits: Limits,
    min_count: int | None = None,
    line_of: Callable[[int], Tensor] | None = None,
) -> CircuitTopView:
    """circuit_of() builds the factored circuit (global top-k, or a token's line); line_of(t), when given,
    reads a token's row/column straight from the weights instead (no [d_vocab, d_head] factors: ms on GPT-2)."""
    rows_label, cols_label = LABELS[circuit]
    vocab = frequent_tokens(loaded, min_count)  # [n] or None: all tokens
    n_vocab = None if vocab is None else int(vocab.numel())

    def view(k: int, entries: list[MatrixEntry], **found: Any) -> CircuitTopView:
        return CircuitTopView(
            model=model_ref(loaded), circuit=circuit, head=head, row_label=rows_label, col_label=cols_label,
            k=k, entries=entries, min_count=min_count, n_tokens=n_vocab, basis=basis(loaded), **found,
        )

    with torch.no_grad():
        if token is None:
            fm = circuit_of()
            k = check_k(k, limits, fm.ldim * fm.rdim if n_vocab is None else n_vocab**2)
            values, rows, cols = fm.topk_global(k, budget_bytes=limits.matrix_budget_bytes, rows=vocab, cols=vocab)  # [k] each
            entries = [
                MatrixEntry(row=token_ref(loaded, r), col=token_ref(loaded, c), value=float(v))
                for v, r, c in zip(values.tolist(), rows.tolist(), cols.tolist(), strict=True)
            ]
            return view(k, entries)
        t = resolve_token(loaded, token)
        if line_of is not None:
            line: Tensor = line_of(t)  # [d_vocab]
        else:
            fm = circuit_of()
            line = (fm.rows([t]) if side == "row" else fm.cols([t]))[0]  # [d_vocab]
        own = float(line[t])  # every circuit here is [d_vocab, d_vocab]
        if vocab is not None:  # rank and list only the frequent tokens
            line = torch.full_like(line, float("-inf")).index_copy(0, vocab, line[vocab])
        k = check_k(k, limits, line.numel() if n_vocab is None else n_vocab)
        values, idx = line.topk(k)
        ref = token_ref(loaded, t)
        entries = [
            MatrixEntry(row=ref, col=token_ref(loaded, i), value=float(v))
            if side == "row"
            else MatrixEntry(row=token_ref(loaded, i), col=ref, value=float(v))
            for v, i in zip(values.tolist(), idx.tolist(), strict=True)
        ]
        rank = int((line > own).sum()) + 1 if own is not None else None
    return view(k, entries, token=ref, side=side, diagonal=own, diagonal_rank=rank)


def build_ov_view(loaded: LoadedModel, p: OVParams, limits: Limits) -> CircuitTopView:
    """Full OV circuit W_E W_V W_O W_U of a head: the token's row (the logits it raises), else global top-k."""
    loaded = with_basis(loaded, p.basis)
    layer, h = parse_head(p.head, loaded.model.cfg)
    return _top_view(loaded, lambda: circuits.full_ov_circuit(loaded.model, layer, h), "ov", p.head, p.token, "row", p.k,
                     limits, p.min_count, lambda t: circuits.full_ov_row(loaded.model, layer, h, t))


def build_qk_view(loaded: LoadedModel, p: QKParams, limits: Limits) -> CircuitTopView:
    """Full QK circuit W_E W_Q W_K^T W_E^T / s: as query, the keys a token attends to; as key, the queries attending to it.

    Rotary models: at the query-key offset δ, W_E W_Q R(δ) W_K^T W_E^T / s (circuits_core.rotary)."""
    loaded = with_basis(loaded, p.basis)
    layer, h = parse_head(p.head, loaded.model.cfg)
    side: Literal["row", "column"] = "row" if p.side == "query" else "column"
    check_offset(loaded, p.offset)
    if is_rotary(loaded):
        model, offset = loaded.model, p.offset
        line = rotary.full_qk_col_at if side == "column" else rotary.full_qk_row_at
        view = _top_view(loaded, lambda: rotary.full_qk_circuit_at(model, layer, h, offset), "qk", p.head, p.token, side,
                         p.k, limits, p.min_count, lambda t: line(model, layer, h, t, offset))
        return view.model_copy(update={"offset": offset})
    column = (lambda t: circuits.full_qk_col(loaded.model, layer, h, t)) if side == "column" else None
    return _top_view(loaded, lambda: circuits.full_qk_circuit(loaded.model, layer, h), "qk", p.head, p.token, side, p.k,
                     limits, p.min_count, column)


def build_direct_view(loaded: LoadedModel, p: DirectParams, limits: Limits) -> CircuitTopView:
    """Direct path W_E W_U (the bigram table): top next tokens for a current token, else global top-k; each entry
    with the model's probability (softmax of its row) and, where the model has a held-out corpus, the corpus's."""
    loaded = with_basis(loaded, p.basis)
    view = _top_view(loaded, lambda: circuits.direct_path(loaded.model), "direct", None, p.token, "row", p.k, limits,
                     p.min_count, lambda t: circuits.direct_row(loaded.model, t))
    model = loaded.model
    data = find_eval_data(loaded.path)
    bigrams = HeldOutBigrams(data) if data is not None else None
    log_probs: dict[int, Tensor] = {}
    with torch.no_grad():
        for e in view.entries:
            a, b = e.row.id, e.col.id
            if a not in log_probs:
                row = circuits.direct_row(model, a)  # [V]
                if model.cfg.use_bias and model.b_U is not None:
                    row = row + model.b_U
                log_probs[a] = torch.log_softmax(row.double(), -1)
            e.prob = float(log_probs[a][b].exp())
            if bigrams is not None:
                e.corpus_prob, e.corpus_count = bigrams.prob(a, b), bigrams.count(a, b)
    corpus = None if bigrams is None else f"held-out split of the training corpus ({bigrams.n_tokens} bigrams)"
    return view.model_copy(update={"corpus": corpus})


def top_cost(loaded: LoadedModel, p: DirectParams | OVParams, limits: Limits) -> Cost:
    """A token's row or column, else the global top-k (on the frequent tokens only with min_count)."""
    check_offset(loaded, getattr(p, "offset", 0))  # a request the model cannot answer is refused before its price
    n = None if p.min_count is None else int(frequent_tokens(loaded, p.min_count).numel())  # type: ignore[union-attr]
    cost = circuits.top_cost(loaded.model, p.k, limits.matrix_budget_bytes, line=p.token is not None, n_tokens=n)
    return cost + raw_copy_cost(loaded, p.basis)


def _strongest_source(loaded: LoadedModel, layer: int, h: int, limits: Limits, vocab: Tensor | None) -> int:
    """The source token of the largest full-OV entry (among vocab x vocab): the default skip-trigram source."""
    fm = circuits.full_ov_circuit(loaded.model, layer, h)
    _, rows, _ = fm.topk_global(1, budget_bytes=limits.matrix_budget_bytes, rows=vocab, cols=vocab)
    return int(rows[0])


def build_skip_trigrams_view(loaded: LoadedModel, p: SkipTrigramParams, limits: Limits) -> SkipTrigramView:
    """[source] ... [destination] -> [out] through one head; without a token, the source of the largest OV entry.

    With min_count, destinations, outs and the default source are frequent tokens only."""
    loaded = with_basis(loaded, p.basis)
    head, token, k, min_count = p.head, p.token, p.k, p.min_count
    layer, h = parse_head(head, loaded.model.cfg)
    vocab = frequent_tokens(loaded, min_count)  # [n] or None
    k = check_k(k, limits, loaded.model.cfg.d_vocab if vocab is None else int(vocab.numel()))
    with torch.no_grad():
        source = resolve_token(loaded, token) if token is not None else _strongest_source(loaded, layer, h, limits, vocab)
        check_offset(loaded, p.offset)
        offset = p.offset if is_rotary(loaded) else None  # rotary: destinations from the QK column at δ
        col = rotary.full_qk_col_at(loaded.model, layer, h, source, offset) if offset is not None else None
        st = circuits.skip_trigrams(loaded.model, layer, h, source, k, vocab, qk_col=col)
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
        model=model_ref(loaded), head=head_name(layer, h), source=src, k=k, copying=st.copying, min_count=min_count,
        destinations=dest, outs=outs, trigrams=trigrams, offset=offset,
    )


# -- declarations (app/analysis.py) ----------------------------------------------------------------------
DIRECT = Analysis(
    name="direct", path="direct", params=DirectParams, view=CircuitTopView, build=build_direct_view, cost=top_cost,
    summary="Direct path (bigram table)", tags=["circuits"],
)
OV = Analysis(
    name="ov", path="heads/{head}/ov", params=OVParams, view=CircuitTopView, build=build_ov_view, cost=top_cost,
    summary="Top entries of the full OV circuit", tags=["circuits"],
)
QK = Analysis(
    name="qk", path="heads/{head}/qk", params=QKParams, view=CircuitTopView, build=build_qk_view, cost=top_cost,
    summary="Top entries of the full QK circuit", tags=["circuits"],
)


def skip_trigrams_cost(loaded: LoadedModel, p: SkipTrigramParams, limits: Limits) -> Cost:
    check_offset(loaded, p.offset)
    return circuits.skip_trigrams_cost(loaded.model, p.k, limits.matrix_budget_bytes, token=p.token is not None) + raw_copy_cost(
        loaded, p.basis)


SKIP_TRIGRAMS = Analysis(
    name="skip-trigrams", path="heads/{head}/skip-trigrams", params=SkipTrigramParams, view=SkipTrigramView,
    build=build_skip_trigrams_view, cost=skip_trigrams_cost, summary="Skip-trigrams of a source token", tags=["circuits"],
)
