"""Term importance by path order and pattern-preserving head ablation (paper-math 2.13), from
circuits_core.ablation: losses with paths up to each order (patterns and LayerNorm scales frozen, values
reading the previous rerun), the marginal effect of each order, first-order terms by layer, and the loss
change when one head's result is zeroed with every pattern frozen (Olsson et al.).

MLP models follow paths.py's convention: an MLP is a fixed node whose clean output is an order-0 path source
(like the embedding), so every order rerun keeps each MLP's clean output and only head paths are truncated;
the head ablation recomputes downstream MLPs (only attention patterns are frozen, as in Olsson et al.).

The default text, when neither prompt nor tokens is given: the model card's `sample_text` (held-out text
shipped with the model) when present, else BUILTIN_TEXT, a short Python snippet (the toy models learn code).
"""

from __future__ import annotations

import torch

from app.analysis import Analysis
from app.params import PromptInput, TermImportanceParams
from app.schemas.analyses import HeadAblation, TermImportanceView
from app.settings import Limits
from app.views.inputs import max_prompt_tokens, model_ref, resolve_prompt, token_refs
from circuits_core import ablation
from circuits_core.ablation import head_ablation, order_ablation
from circuits_core.config import head_name
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError
from circuits_core.weights import LoadedModel

BUILTIN_TEXT = (
    "class Stack(object):\n"
    "    def __init__(self):\n"
    "        self.items = []\n\n"
    "    def push(self, item):\n"
    "        self.items.append(item)\n\n"
    "    def pop(self):\n"
    "        return self.items.pop()\n"
)


def default_text(loaded: LoadedModel) -> tuple[str, str]:
    """(text, where it came from): the card's held-out sample, else the built-in snippet."""
    card = loaded.card if isinstance(loaded.card, dict) else {}
    sample = card.get("sample_text")
    return (sample, "card") if isinstance(sample, str) and sample else (BUILTIN_TEXT, "builtin")


def _default_ids(loaded: LoadedModel, limits: Limits) -> tuple[list[int], str]:
    if loaded.tokenizer is None:
        raise InvalidInputError(f"model {loaded.path.name!r} has no tokenizer: give the text as tokens=<ids>")
    text, source = default_text(loaded)
    bos = loaded.tokenizer.bos_token_id is not None
    ids = [int(i) for i in loaded.tokenizer.encode(text, prepend_bos=bos)]
    return ids[: max_prompt_tokens(loaded, limits)], source


def prompt_or_default(loaded: LoadedModel, p: PromptInput, limits: Limits) -> tuple[list[int], str]:
    """(token ids, where they came from): the prompt or token ids given, else the default text (card or builtin)."""
    if p.prompt is None and p.tokens is None:
        return _default_ids(loaded, limits)
    return resolve_prompt(loaded, p.prompt, p.tokens, limits), "prompt" if p.prompt is not None else "tokens"


def build_term_importance_view(loaded: LoadedModel, p: TermImportanceParams, limits: Limits) -> TermImportanceView:
    """Loss by max path order, marginal effect of each order, first-order terms by layer, per-head ablations."""
    model = loaded.model
    cfg = model.cfg
    ids, source = prompt_or_default(loaded, p, limits)
    n = len(ids)
    if n < 2:
        raise InvalidInputError(f"term importance needs at least 2 tokens (a next-token loss), got {n}")
    seq = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, n]
    with torch.no_grad():
        orders = order_ablation(model, seq)
        heads = head_ablation(model, seq)  # [L, H], patterns frozen (Olsson)
        recomputed = head_ablation(model, seq, recompute_patterns=True)  # [L, H], later patterns recomputed
    return TermImportanceView(
        model=model_ref(loaded), text_source=source, tokens=token_refs(loaded, ids), clean_loss=orders.clean_loss,
        loss_by_order=orders.losses.tolist(), marginal_by_order=orders.marginal.tolist(),
        first_order_by_layer=orders.first_order_gain.tolist(),
        heads=[
            HeadAblation(head=head_name(layer, h), loss_change=float(heads[layer, h]),
                         loss_change_recomputed=float(recomputed[layer, h]))
            for layer in range(cfg.n_layers) for h in range(cfg.n_heads)
        ],
    )


def term_importance_cost(loaded: LoadedModel, p: TermImportanceParams, limits: Limits) -> Cost:
    return ablation.cost(loaded.model, len(prompt_or_default(loaded, p, limits)[0]))


TERM_IMPORTANCE = Analysis(
    name="term-importance", path="term-importance", params=TermImportanceParams, view=TermImportanceView,
    build=build_term_importance_view, cost=term_importance_cost, summary="Loss by path order and per-head ablations",
    tags=["ablation"], cache=lambda p: p.prompt is None and p.tokens is None,  # the default text only
)
