"""Term importance by path order and pattern-preserving head ablation (docs/maths.md §2.13), from
circuits_core.prompt.ablation: losses with paths up to each order (patterns and LayerNorm scales frozen, values
reading the previous rerun), the marginal effect of each order, first-order terms by layer, and the loss
change when one head's result is zeroed with every pattern frozen (Olsson et al.) and with the later patterns
recomputed, for the heads asked (`heads`; the default is every head on a small model, the heads a big model's measured
summary names otherwise: `ablated_heads`, said on the page).

MLP models follow paths.py's convention: an MLP is a fixed node whose clean output is an order-0 path source
(like the embedding), so every order rerun keeps each MLP's clean output and only head paths are truncated;
the head ablation recomputes downstream MLPs (only attention patterns are frozen, as in Olsson et al.).

The default text, when neither prompt nor tokens is given: the model card's `sample_text` (held-out text
shipped with the model) when present, else BUILTIN_TEXT, a short Python snippet (app/views/shared/default_prompt.py).
"""

from __future__ import annotations

import torch

from app.analysis import Analysis
from app.params import DEFAULT_ALL_HEADS, TermImportanceParams, head_selection
from app.schemas.analyses import HeadAblation, TermImportanceView
from app.settings import Limits
from app.views.shared.default_prompt import prompt_or_default
from app.views.shared.inputs import model_ref, token_refs
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError, QkovError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.config import ModelConfig
from circuits_core.model.head_names import head_name, parse_head
from circuits_core.prompt import ablation
from circuits_core.prompt.ablation import term_importance
from circuits_core.prompt.model_summary import HEAD_THRESHOLD, load_summary


def ablated_heads(loaded: LoadedModel, p: TermImportanceParams) -> tuple[list[tuple[int, int]], str, str]:
    """(heads removed in turn, the selection as asked ('all', 'none', 'L16H0,L2' or 'default'), a sentence saying which
    heads these are). Default: every head on a model of at most DEFAULT_ALL_HEADS heads; on a larger one the induction
    and previous-token heads of its measured summary (model_summary.json), else none."""
    cfg = loaded.model.cfg
    total = cfg.n_layers * cfg.n_heads
    if p.heads is not None:
        heads = sorted({pair for _, pairs in head_selection(p.heads, cfg) for pair in pairs})
        return heads, p.heads, f"The {len(heads)} of {total} heads asked for (heads={p.heads})."
    if total <= DEFAULT_ALL_HEADS:
        every = f"Every head ({total})." if total else "None: the model has no attention heads."
        return ablation.all_heads(cfg), "default", every
    summary = load_summary(loaded.path) or {}
    named = [
        e.get("head")
        for key in ("induction_heads", "previous_token_heads")
        for e in summary.get(key) or []
        if isinstance(e, dict)
    ]
    heads = sorted({parse_head(h, cfg) for h in named if isinstance(h, str) and _is_head(h, cfg)})
    if not heads:
        return (
            [],
            "default",
            (
                f"No head: on a model of more than {DEFAULT_ALL_HEADS} heads without a measured summary, "
                f"none is removed unless asked (heads=L0 for one layer, a list of heads, or heads=all)."
            ),
        )
    threshold = summary.get("head_threshold", HEAD_THRESHOLD)
    return (
        heads,
        "default",
        (
            f"The {len(heads)} of {total} heads that the model's measured summary (model_summary.json) "
            f"names as induction or previous-token heads (score >= {threshold} on random sequences "
            f"repeated once, BOS + r + r); heads=all removes every head."
        ),
    )


def _is_head(name: str, cfg: ModelConfig) -> bool:
    try:
        parse_head(name, cfg)
    except QkovError:
        return False
    return True


def build_term_importance_view(loaded: LoadedModel, p: TermImportanceParams, limits: Limits) -> TermImportanceView:
    """Loss by max path order, marginal effect of each order, first-order terms by layer, per-head ablations."""
    model = loaded.model
    ids, source = prompt_or_default(loaded, p, limits)
    n = len(ids)
    if n < 2:
        raise InvalidInputError(f"term importance needs at least 2 tokens (a next-token loss), got {n}")
    heads, asked, note = ablated_heads(loaded, p)
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
    """The engine's price of the ablations asked (FLOPs included: the app compares them with the request deadline)."""
    return ablation.cost(loaded.model, len(prompt_or_default(loaded, p, limits)[0]), heads=ablated_heads(loaded, p)[0])


TERM_IMPORTANCE = Analysis(
    name="term-importance",
    path="term-importance",
    params=TermImportanceParams,
    view=TermImportanceView,
    build=build_term_importance_view,
    cost=term_importance_cost,
    summary="Loss by path order and per-head ablations",
    tags=["ablation"],
    cache=lambda p: p.prompt is None and p.tokens is None,  # the default text only
    needs_layers=1,
)
