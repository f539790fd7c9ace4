"""Term importance by path order and pattern-preserving head ablation (docs/maths.md §2.13), from
circuits_core.prompt.ablation: losses with paths up to each order (patterns and LayerNorm scales frozen, values
reading the previous rerun), the marginal effect of each order, first-order terms by layer, and the loss
change when one head's result is zeroed with every pattern frozen (Olsson et al.) and with the later patterns
recomputed, for the heads asked (`heads`; the default is every head on a small model, the heads a big model's summary
names otherwise -- computed from its heads table on first use, the heads every page starts from: `ablated_heads`, said
on the page).

MLP models follow paths.py's convention: an MLP is a fixed node whose clean output is an order-0 path source
(like the embedding), so every order rerun keeps each MLP's clean output and only head paths are truncated;
the head ablation recomputes downstream MLPs (only attention patterns are frozen, as in Olsson et al.).

The default text, when neither prompt nor tokens is given: the model card's `sample_text` (held-out text
shipped with the model) when present, else BUILTIN_TEXT, a short Python snippet (app/views/shared/default_prompt.py).
"""

from __future__ import annotations

import torch

from app import snippets
from app.analysis import Analysis, build_cached, cache_key
from app.params import DEFAULT_ALL_HEADS, NoParams, TermImportanceParams, head_selection
from app.scheduling import cached
from app.schemas import HeadsView
from app.schemas.analyses import HeadAblation, TermImportanceView
from app.settings import Limits
from app.views.shared.default_prompt import prompt_or_default
from app.views.shared.heads_table import HEADS, heads_cost
from app.views.shared.inputs import model_ref, token_refs
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name
from circuits_core.prompt import ablation
from circuits_core.prompt.ablation import term_importance
from circuits_core.prompt.model_summary import HEAD_THRESHOLD


def summary_heads(heads: HeadsView) -> list[tuple[int, int]]:
    """The heads the model's summary names (app/views/model_summary.py, computed from the heads table on first use):
    the heads that matter (HEADS_RULE: the strongest induction head and the previous-token head feeding it) and every
    head scoring at least HEAD_THRESHOLD as an induction or previous-token head on the standard input; layer order."""
    named = {h.head for h in heads.heads if max(h.induction or 0.0, h.previous_token or 0.0) >= HEAD_THRESHOLD}
    named |= {h for h in (heads.previous_token_head, heads.induction_head) if h is not None}
    return sorted((h.layer, h.index) for h in heads.heads if h.head in named)


def cached_heads(loaded: LoadedModel) -> HeadsView | None:
    """The heads table when it is computed already (no work), else None."""
    return cached(cache_key(HEADS, loaded.path.name, loaded, NoParams()), HeadsView)


def ablated_heads(
    loaded: LoadedModel, p: TermImportanceParams, heads_view: HeadsView | None
) -> tuple[list[tuple[int, int]], str, str]:
    """(heads removed in turn, the selection as asked ('all', 'none', 'L16H0,L2' or 'default'), a sentence saying which
    heads these are). Default: every head on a model of at most DEFAULT_ALL_HEADS heads; on a larger one the heads its
    summary names (`summary_heads` of `heads_view`, the heads table: the same heads every page starts from)."""
    cfg = loaded.model.cfg
    total = cfg.n_layers * cfg.n_heads
    if p.heads is not None:
        heads = sorted({pair for _, pairs in head_selection(p.heads, cfg) for pair in pairs})
        return heads, p.heads, f"The {len(heads)} of {total} heads asked for (heads={p.heads})."
    if total <= DEFAULT_ALL_HEADS:
        every = f"Every head ({total})." if total else "None: the model has no attention heads."
        return ablation.all_heads(cfg), "default", every
    heads = [] if heads_view is None else summary_heads(heads_view)
    if heads_view is None or not heads:
        return [], "default", "No head: the model's heads table has no scores (heads=L0 for one layer, or heads=all)."
    inp = heads_view.detector_input
    return (
        heads,
        "default",
        (
            f"The {len(heads)} of {total} heads that the model's summary names: the heads that matter, "
            f"{heads_view.previous_token_head} and {heads_view.induction_head} ({heads_view.heads_rule}), and every "
            f"head scoring at least {HEAD_THRESHOLD} as an induction or previous-token head on BOS + r + r "
            f"(r = {inp.seq_len} random tokens, {inp.batch} sequences, seed {inp.seed}); heads=all removes every head."
        ),
    )


def default_needs_heads(loaded: LoadedModel, p: TermImportanceParams) -> bool:
    """Whether the heads ablated are the summary's (read off the heads table)."""
    cfg = loaded.model.cfg
    return p.heads is None and cfg.n_layers * cfg.n_heads > DEFAULT_ALL_HEADS


def build_term_importance_view(loaded: LoadedModel, p: TermImportanceParams, limits: Limits) -> TermImportanceView:
    """Loss by max path order, marginal effect of each order, first-order terms by layer, per-head ablations."""
    model = loaded.model
    ids, source = prompt_or_default(loaded, p, limits)
    n = len(ids)
    if n < 2:
        raise InvalidInputError(f"term importance needs at least 2 tokens (a next-token loss), got {n}")
    table = (
        build_cached(HEADS, loaded, loaded.path.name, NoParams(), limits) if default_needs_heads(loaded, p) else None
    )
    heads, asked, note = ablated_heads(loaded, p, table)
    seq = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, n]
    with torch.no_grad():
        orders, frozen, recomputed = term_importance(model, seq, heads)  # frozen: Olsson's; recomputed: later patterns
    every = ablation.cost(model, n).flops
    return TermImportanceView(
        model=model_ref(loaded),
        text_source=source,
        tokens=token_refs(loaded, ids),
        clean_loss=orders.clean_loss,
        loss_by_order=orders.losses.tolist(),
        marginal_by_order=orders.marginal.tolist(),
        first_order_by_layer=orders.first_order_gain.tolist(),
        heads_asked=asked,
        heads_note=note,
        all_heads_gflop=every / 1e9,
        heads=[
            HeadAblation(
                head=head_name(layer, h), loss_change=float(frozen[i]), loss_change_recomputed=float(recomputed[i])
            )
            for i, (layer, h) in enumerate(heads)
        ],
    )


def term_importance_cost(loaded: LoadedModel, p: TermImportanceParams, limits: Limits) -> Cost:
    """The engine's price of the ablations asked (FLOPs included: the app compares them with the request deadline).
    The summary's heads by default on a large model: before its heads table is computed, the table then the ablation
    of every head (a bound: which heads the table names is not known yet)."""
    n = len(prompt_or_default(loaded, p, limits)[0])
    if not default_needs_heads(loaded, p):
        return ablation.cost(loaded.model, n, heads=ablated_heads(loaded, p, None)[0])
    table = cached_heads(loaded)
    if table is None:
        return heads_cost(loaded, NoParams(), limits).then(ablation.cost(loaded.model, n))
    return ablation.cost(loaded.model, n, heads=ablated_heads(loaded, p, table)[0])


TERM_IMPORTANCE = Analysis(
    name="term-importance",
    path="term-importance",
    params=TermImportanceParams,
    view=TermImportanceView,
    build=build_term_importance_view,
    cost=term_importance_cost,
    summary="Loss by path order and per-head ablations",
    snippet=snippets.term_importance_body,
    tags=["ablation"],
    cache=lambda p: p.prompt is None and p.tokens is None,  # the default text only
    needs_layers=1,
)
