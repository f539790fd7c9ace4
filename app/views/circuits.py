"""Top entries of the full OV, QK and direct-path circuits (docs/maths.md §2.2-2.5; skip-trigrams: skip_trigrams.py).

Every circuit is a FactoredMatrix [d_vocab, d_vocab] from circuits_core.circuits.head_circuits; with a token we read its
row (or, for QK keys, its column) from the factors, without one the global top-k streams row blocks under
`limits.matrix_budget_bytes`. Nothing sized d_vocab x d_vocab is allocated.

`min_count` (optional) keeps only tokens seen at least that often in training, read from the model folder's
`token_counts.npy` (circuits_core.prompt.phenomena.load_token_counts): the global top-k runs on the factors restricted
to those rows and columns, a token's row or column lists only those tokens. Rare, under-trained tokens
otherwise dominate the global tables of the shipped toy models.

Without min_count, a global table of a vocabulary over DEFAULT_VOCAB tokens ranks a stated set (`token_set`):
its DEFAULT_VOCAB most frequent tokens, or else its lowest ids; `vocab=all` ranks every token. On GPT-2's
50,257 tokens a whole-vocabulary table has ~38x the entries of the default one (seconds per head), and the head
page reads two. A token's own row or column is cheap and always ranks every token (or min_count's).

Each global table is computed once per (circuit, head, weights, offset, token set) at k = max(k, SHARED_K) and
kept in the result cache (`global_top`, app/views/shared/global_tables.py): the head page's k=10 tables, the API's
k=20 defaults and the skip-trigram default source (the OV table's first row) all read the same one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from app import snippets
from app.analysis import Analysis
from app.params import DirectParams, OVParams, QKParams
from app.schemas import CircuitTopView, MatrixEntry
from app.settings import Limits
from app.views.shared.basis import raw_copy_cost, with_basis
from app.views.shared.global_tables import search_cost
from app.views.shared.rotary_reference import check_offset, is_rotary
from app.views.shared.token_sets import token_set
from app.views.shared.token_tables import top_view
from circuits_core.circuits import head_circuits as circuits
from circuits_core.circuits import latent_circuits, rotary, sinks
from circuits_core.circuits.qk_forms import QK_FORMS, qk_form
from circuits_core.cost import Cost, itemsize
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import parse_head
from circuits_core.model.soft_cap import share_beyond_cap
from circuits_core.prompt.phenomena import HeldOutBigrams, find_eval_data


def build_ov_view(loaded: LoadedModel, p: OVParams, limits: Limits) -> CircuitTopView:
    """Full OV circuit W_E W_V W_O W_U of a head: the token's row (the logits it raises), else global top-k."""
    loaded = with_basis(loaded, p.basis)
    layer, h = parse_head(p.head, loaded.model.cfg)
    return top_view(
        loaded,
        lambda ids: circuits.full_ov_circuit(loaded.model, layer, h, ids),
        "ov",
        p.head,
        p.token,
        "row",
        p.k,
        limits,
        p.min_count,
        lambda t: circuits.full_ov_row(loaded.model, layer, h, t),
        p.vocab,
    )


def with_sink(loaded: LoadedModel, view: CircuitTopView, layer: int, h: int, offset: int) -> CircuitTopView:
    """The QK view with its head's sink threshold (sinks.py) when the model has learned sinks."""
    model = loaded.model
    if not sinks.has_sinks(model) or not view.entries:
        return view
    with torch.no_grad():
        queries = torch.tensor([e.row.id for e in view.entries], device=model.device)
        keys = torch.tensor([e.col.id for e in view.entries], device=model.device)
        scores = sinks.direct_scores(model, layer, h, queries, keys, offset)
        attend = sinks.attends_alone(model, layer, h, scores).tolist()
    return view.model_copy(update={"sink_logit": sinks.sink_logit(model, layer, h), "sink_attend": attend})


def with_latent_terms(loaded: LoadedModel, view: CircuitTopView, layer: int, h: int, offset: int) -> CircuitTopView:
    """The QK view with each entry's content and rotary terms (latent_circuits.token_pair_terms) under multi-head
    latent attention."""
    model = loaded.model
    if not model.cfg.latent_attention or not view.entries:
        return view
    with torch.no_grad():
        queries = [e.row.id for e in view.entries]
        keys = [e.col.id for e in view.entries]
        content, rotary = latent_circuits.token_pair_terms(model, layer, h, queries, keys, offset)
    return view.model_copy(update={"latent_content": content.tolist(), "latent_rotary": rotary.tolist()})


def build_qk_view(loaded: LoadedModel, p: QKParams, limits: Limits) -> CircuitTopView:
    """Full QK circuit W_E W_Q W_K^T W_E^T / s: as query, the keys a token attends to; as key, the queries on it.

    Rotary models: at the query-key offset δ, W_E W_Q R(δ) W_K^T W_E^T / s (circuits_core.circuits.rotary)."""
    loaded = with_basis(loaded, p.basis)
    layer, h = parse_head(p.head, loaded.model.cfg)
    side: Literal["row", "column"] = "row" if p.side == "query" else "column"
    check_offset(loaded, p.offset, layer)
    if is_rotary(loaded):
        model, offset = loaded.model, p.offset
        line = rotary.full_qk_col_at if side == "column" else rotary.full_qk_row_at
        view = top_view(
            loaded,
            lambda ids: rotary.full_qk_circuit_at(model, layer, h, offset, tokens=ids),
            "qk",
            p.head,
            p.token,
            side,
            p.k,
            limits,
            p.min_count,
            lambda t: line(model, layer, h, t, offset),
            p.vocab,
            offset,
        )
        full_line = lambda t: line(model, layer, h, t, offset)  # the token's whole row or column [V]
        labelled = qk_labelled(loaded, view.model_copy(update={"offset": offset}), layer, full_line)
        return with_latent_terms(loaded, with_sink(loaded, labelled, layer, h, offset), layer, h, offset)
    column = (lambda t: circuits.full_qk_col(loaded.model, layer, h, t)) if side == "column" else None
    view = top_view(
        loaded,
        lambda ids: circuits.full_qk_circuit(loaded.model, layer, h, ids),
        "qk",
        p.head,
        p.token,
        side,
        p.k,
        limits,
        p.min_count,
        column,
        p.vocab,
    )

    return with_sink(loaded, qk_labelled(loaded, view, layer), layer, h, 0)


def qk_labelled(
    loaded: LoadedModel, view: CircuitTopView, layer: int, whole: Callable[[int], Tensor] | None = None
) -> CircuitTopView:
    """A QK table with the form of its values (qk_forms.py), its layer's window, and under a score cap its values
    capped as the softmax sees them (the cap is monotone: the ranking is the same) and, for a token's row or column
    (`whole`: the token's every score, before the cap), the share of them beyond the cap."""
    cfg = loaded.model.cfg
    form = qk_form(loaded.model, "token")
    cap = cfg.attn_scores_soft_cap
    update: dict[str, Any] = {
        "qk_form": form, "qk_form_note": QK_FORMS[form], "score_cap": cap, "window": cfg.layer_window(layer),
    }  # fmt: skip
    if cap is not None:
        update["entries"] = [e.model_copy(update={"value": cap * math.tanh(e.value / cap)}) for e in view.entries]
        if view.diagonal is not None:
            update["diagonal"] = cap * math.tanh(view.diagonal / cap)
        if whole is not None and view.token is not None:
            with torch.no_grad():
                update["beyond_cap"] = share_beyond_cap(whole(view.token.id), cap)
    return view.model_copy(update=update)


def build_direct_view(loaded: LoadedModel, p: DirectParams, limits: Limits) -> CircuitTopView:
    """Direct path W_E W_U (the bigram table): top next tokens for a current token, else global top-k; each entry
    with the model's probability (softmax of its row) and, where the model has a held-out corpus, the corpus's."""
    loaded = with_basis(loaded, p.basis)
    view = top_view(
        loaded,
        lambda ids: circuits.direct_path(loaded.model, ids),
        "direct",
        None,
        p.token,
        "row",
        p.k,
        limits,
        p.min_count,
        lambda t: circuits.direct_row(loaded.model, t),
        p.vocab,
    )
    model = loaded.model
    data = find_eval_data(loaded.path)
    bigrams = HeldOutBigrams(data) if data is not None else None
    by_row: dict[int, list[MatrixEntry]] = {}  # the entries of each current token: its row formed once
    for e in view.entries:
        by_row.setdefault(e.row.id, []).append(e)
    with torch.no_grad():
        for a, entries in by_row.items():  # one [V] row held at a time, not one per current token
            row = circuits.direct_row(model, a)  # [V]
            if model.cfg.use_bias and model.b_U is not None:
                row = row + model.b_U
            log_probs = torch.log_softmax(row.double(), -1)  # [V]
            for e in entries:
                e.prob = float(log_probs[e.col.id].exp())
                if bigrams is not None:
                    e.corpus_prob, e.corpus_count = bigrams.prob(a, e.col.id), bigrams.count(a, e.col.id)
    corpus = None if bigrams is None else f"held-out split of the training corpus ({bigrams.n_tokens} bigrams)"
    return view.model_copy(update={"corpus": corpus})


def top_cost(loaded: LoadedModel, p: DirectParams | OVParams, limits: Limits, circuit: circuits.Circuit = "ov") -> Cost:
    """A token's row or column, else the global top-k (on the frequent tokens only with min_count): priced by
    head_circuits.top_cost for the circuit and side the view reads."""
    layer = parse_head(p.head, loaded.model.cfg)[0] if circuit == "qk" and isinstance(p, OVParams) else None
    check_offset(
        loaded, getattr(p, "offset", 0), layer
    )  # a request the model cannot answer is refused before its price
    side: Literal["row", "column"] = "column" if getattr(p, "side", "query") == "key" else "row"
    ranked = token_set(loaded, p.min_count, p.vocab if p.token is None else "all")  # as _top_view ranks
    if p.token is None:
        cost = search_cost(loaded, p, limits, circuit)
    else:
        n = None if p.min_count is None else ranked.n
        cost = circuits.top_cost(
            loaded.model, p.k, limits.matrix_budget_bytes, line=True, n_tokens=n, circuit=circuit, side=side
        )
    ids = 0 if ranked.ids is None else ranked.n  # the answer's token_ids
    return (cost + raw_copy_cost(loaded, p.basis)).with_answer(numbers=ids)


def direct_cost(loaded: LoadedModel, p: DirectParams, limits: Limits) -> Cost:
    """The table, then each listed entry's probability: one direct row per distinct current token (at most k; the
    token's own row with a token), one at a time: the row [V] in the compute dtype and with b_U added, its float64
    copy and that copy's log-softmax."""
    model = loaded.model
    rows = 1 if p.token is not None else p.k
    row_bytes = model.cfg.d_vocab * (2 * itemsize(model.compute_dtype) + 2 * 8)
    probabilities = Cost(row_bytes, flops=rows * circuits.line_flops(model, "direct-row"))
    return top_cost(loaded, p, limits, "direct").then(probabilities)


def ov_cost(loaded: LoadedModel, p: OVParams, limits: Limits) -> Cost:
    return top_cost(loaded, p, limits, "ov")


def qk_cost(loaded: LoadedModel, p: QKParams, limits: Limits) -> Cost:
    return top_cost(loaded, p, limits, "qk").with_answer(
        numbers=(p.k + 1) if sinks.has_sinks(loaded.model) else 0  # the sink logit and one probability per entry
    )


# -- declarations (app/analysis.py) ----------------------------------------------------------------------
DIRECT = Analysis(
    name="direct",
    weights="attention",
    path="direct",
    params=DirectParams,
    view=CircuitTopView,
    build=build_direct_view,
    cost=direct_cost,
    summary="Direct path (bigram table)",
    snippet=snippets.direct_body,
    tags=["circuits"],
)
OV = Analysis(
    name="ov",
    weights="attention",
    path="heads/{head}/ov",
    params=OVParams,
    view=CircuitTopView,
    build=build_ov_view,
    cost=ov_cost,
    summary="Top entries of the full OV circuit",
    tags=["circuits"],
)
QK = Analysis(
    name="qk",
    weights="attention",
    path="heads/{head}/qk",
    params=QKParams,
    view=CircuitTopView,
    build=build_qk_view,
    cost=qk_cost,
    summary="Top entries of the full QK circuit",
    snippet=snippets.qk_body,
    tags=["circuits"],
)
