"""Skip-trigrams "[source] ... [destination] -> [out]" through one head (docs/maths.md §2.6), as a table: without a
token, the source is that of the largest full-OV entry (the first row of the OV circuit's shared global table,
app/views/shared/global_tables.py); on rotary models destinations come from the QK column at an offset.
"""

from __future__ import annotations

import torch

from app import snippets
from app.analysis import Analysis
from app.params import SkipTrigramParams
from app.schemas import ScoredToken, SkipTrigram, SkipTrigramView
from app.settings import Limits
from app.views.shared.basis import raw_copy_cost, with_basis
from app.views.shared.global_tables import global_top, search_cost
from app.views.shared.inputs import check_k, model_ref, qk_form_fields, resolve_token, token_ref
from app.views.shared.rotary_reference import check_offset, is_rotary
from app.views.shared.token_sets import TokenSet, frequent_tokens, token_set
from circuits_core.circuits import head_circuits as circuits
from circuits_core.circuits import rotary, skip_trigrams
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name, parse_head


def _strongest_source(loaded: LoadedModel, layer: int, h: int, limits: Limits, ranked: TokenSet) -> int:
    """The source token of the largest full-OV entry (among the ranked tokens): the default skip-trigram source, the
    first row of the OV circuit's shared global table."""
    top = global_top(
        loaded,
        lambda ids: circuits.full_ov_circuit(loaded.model, layer, h, ids),
        ("ov", head_name(layer, h), "0"),
        1,
        ranked,
        limits,
    )
    return top.rows[0]


def build_skip_trigrams_view(loaded: LoadedModel, p: SkipTrigramParams, limits: Limits) -> SkipTrigramView:
    """[source] ... [destination] -> [out] through one head; without a token, the source of the largest OV entry.

    With min_count, destinations, outs and the default source are frequent tokens only."""
    loaded = with_basis(loaded, p.basis)
    head, token, k, min_count = p.head, p.token, p.k, p.min_count
    layer, h = parse_head(head, loaded.model.cfg)
    vocab = frequent_tokens(loaded, min_count)  # [n] or None
    ranked = token_set(loaded, min_count, p.vocab)  # the default source's candidates
    k = check_k(k, limits, loaded.model.cfg.d_vocab if vocab is None else int(vocab.numel()))
    with torch.no_grad():
        source = (
            resolve_token(loaded, token) if token is not None else _strongest_source(loaded, layer, h, limits, ranked)
        )
        check_offset(loaded, p.offset, layer)
        offset = p.offset if is_rotary(loaded) else None  # rotary: destinations from the QK column at δ
        col = rotary.full_qk_col_at(loaded.model, layer, h, source, offset) if offset is not None else None
        st = skip_trigrams.skip_trigrams(loaded.model, layer, h, source, k, vocab, qk_col=col)
    dest = [
        ScoredToken(token=token_ref(loaded, t), value=float(v))
        for t, v in zip(st.dest_tokens.tolist(), st.dest_scores.tolist(), strict=True)
    ]
    outs = [
        ScoredToken(token=token_ref(loaded, t), value=float(v))
        for t, v in zip(st.out_tokens.tolist(), st.out_scores.tolist(), strict=True)
    ]
    qk = dict(zip(st.dest_tokens.tolist(), st.dest_scores.tolist(), strict=True))
    ov = dict(zip(st.out_tokens.tolist(), st.out_scores.tolist(), strict=True))
    src = token_ref(loaded, source)
    trigrams = [
        SkipTrigram(
            source=src, destination=token_ref(loaded, b), out=token_ref(loaded, c), qk=qk[b], ov=ov[c], joint=joint
        )
        for b, c, joint in st.triples[:k]
    ]
    return SkipTrigramView(
        model=model_ref(loaded),
        **qk_form_fields(loaded, "token"),  # the destinations' QK column
        head=head_name(layer, h),
        source=src,
        k=k,
        copying=st.copying,
        min_count=min_count,
        destinations=dest,
        outs=outs,
        trigrams=trigrams,
        offset=offset,
        token_set=ranked.said if token is None else None,
    )


def skip_trigrams_cost(loaded: LoadedModel, p: SkipTrigramParams, limits: Limits) -> Cost:
    """The two lines (skip_trigrams.skip_trigrams_cost) after, without a token, the OV table's search on its token
    set for the default source."""
    check_offset(loaded, p.offset, parse_head(p.head, loaded.model.cfg)[0])
    lines = skip_trigrams.skip_trigrams_cost(loaded.model, p.k, limits.matrix_budget_bytes, token=True)
    search = Cost(0) if p.token is not None else search_cost(loaded, p.model_copy(update={"k": 1}), limits, "ov")
    return search.then(lines) + raw_copy_cost(loaded, p.basis)


SKIP_TRIGRAMS = Analysis(
    name="skip-trigrams",
    weights="attention",
    path="heads/{head}/skip-trigrams",
    params=SkipTrigramParams,
    view=SkipTrigramView,
    build=build_skip_trigrams_view,
    cost=skip_trigrams_cost,
    summary="Skip-trigrams of a source token",
    snippet=snippets.skip_trigrams_body,
    tags=["circuits"],
)
