"""Component x component decomposition of a later head's attention scores on a prompt (docs/maths.md §2.12).

circuits_core.prompt.qk_paths.expand_scores splits the pre-softmax scores q k^T / s of head (layer >= 1) into terms
q_a k_b^T / s over the components a, b of its input (embedding, positions, each earlier head's output, MLPs,
biases); the terms sum to the real scores. The summary is each term's std over causal positions (ARENA's
`decompose_attn_scores` plot): an induction head's (embed, previous-token head) K-composition term stands out.
"""

from __future__ import annotations

from typing import Any

import torch

from app.analysis import Analysis
from app.params import QKPathsParams
from app.schemas.analyses import QKCell, QKPair, QKPathsView, QKTerm
from app.settings import Limits
from app.views.shared.inputs import check_k, model_ref, resolve_prompt, token_refs
from circuits_core.circuits.qk_forms import qk_form
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name, parse_head
from circuits_core.prompt import qk_paths
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.qk_paths import expand_scores


def build_qk_paths_view(loaded: LoadedModel, p: QKPathsParams, limits: Limits) -> QKPathsView:
    """The std summary of every (query component, key component) term of `head`'s scores, and the k strongest terms."""
    head, prompt, tokens, k = p.head, p.prompt, p.tokens, p.k
    model = loaded.model
    layer, h = parse_head(head, model.cfg)
    ids = resolve_prompt(loaded, prompt, tokens, limits)
    n = len(ids)
    C = qk_paths.n_components(model, layer)
    k = check_k(k, limits, C * C)
    run_tokens = torch.tensor(ids, dtype=torch.long, device=model.device)
    with torch.no_grad():
        run = frozen_run(model, run_tokens)
        exp = expand_scores(model, run_tokens, (layer, h), run=run)
        causal = exp.visible if exp.visible is not None else torch.ones(n, n, dtype=torch.bool).tril()
        total = exp.q_parts.sum(0) @ exp.k_parts.sum(0).T / exp.scale  # [n, n]: the sum of all C x C terms
        if exp.positional is not None:  # ALiBi: + the linear kernel -m_h (i - j)
            total = total + exp.positional
        if exp.cap_factor is not None:  # each term times its entry's frozen cap factor
            total = total * exp.cap_factor
        error = float((total - exp.scores)[causal].abs().max())
        pairs = exp.top_pairs(k)
        terms = {f"{a}|{b}": exp.term(a, b).masked_fill(~causal, 0.0).double().tolist() for a, b, _ in pairs}
        scores = [[float(exp.scores[i, j]) if causal[i, j] else None for j in range(n)] for i in range(n)]
        at = None
        if p.query is not None or p.key is not None:
            at = score_terms(exp, run.patterns[layer, h], p.query, p.key, n, k)
    return QKPathsView(
        model=model_ref(loaded),
        head=head_name(layer, h),
        tokens=token_refs(loaded, ids),
        components=exp.components,
        std=exp.std.double().tolist(),
        top_pairs=[QKPair(query=a, key=b, std=s) for a, b, s in pairs],
        terms=terms,
        scores=scores,
        max_abs_error=error,
        qk_form=qk_form(model, "prompt"),
        score_cap=model.cfg.attn_scores_soft_cap,
        beyond_cap=exp.beyond_cap if model.cfg.attn_scores_soft_cap is not None else None,
        window=model.cfg.layer_window(layer),
        at=at,
    )


def score_terms(exp: Any, pattern: torch.Tensor, query: int | None, key: int | None, n: int, k: int) -> QKCell:
    """The score at (query, key) split into its C x C terms q_a k_b^T / s, the k largest |term| first."""
    if query is None or key is None:
        raise InvalidInputError("give both query and key (positions) to split one score into its terms")
    if not 0 <= key <= query < n:
        raise InvalidInputError(f"need 0 <= key <= query < {n} (the prompt's length): got query {query}, key {key}")
    if exp.visible is not None and not bool(exp.visible[query, key]):
        raise InvalidInputError(f"the head's sliding window does not reach key {key} from query {query}")
    terms = exp.q_parts[:, query] @ exp.k_parts[:, key].T / exp.scale  # [C, C]
    if exp.cap_factor is not None:  # the entry's frozen cap factor: the terms sum to the capped score
        terms = terms * exp.cap_factor[query, key]
    C = len(exp.components)
    order = terms.flatten().abs().argsort(descending=True, stable=True)[:k].tolist()  # ties: (query, key) order
    return QKCell(
        query=query,
        key=key,
        score=float(exp.scores[query, key]),
        attention=float(pattern[query, key]),
        terms=[
            QKTerm(query=exp.components[i // C], key=exp.components[i % C], value=float(terms.flatten()[i]))
            for i in order
        ],
    )


def qk_paths_cost(loaded: LoadedModel, p: QKPathsParams, limits: Limits) -> Cost:
    layer, _ = parse_head(p.head, loaded.model.cfg)
    return qk_paths.cost(loaded.model, layer, len(resolve_prompt(loaded, p.prompt, p.tokens, limits)), p.k)


QK_PATHS = Analysis(
    name="qk-paths",
    path="qk-paths",
    params=QKPathsParams,
    view=QKPathsView,
    build=build_qk_paths_view,
    cost=qk_paths_cost,
    summary="Decomposition of a head's attention scores",
    tags=["prompts"],
    needs_layers=2,
)
