"""Attention entropy of every head on a prompt (circuits_core/prompt/attention_entropy.py): page and JSON."""

from __future__ import annotations

import torch
from pydantic import BaseModel, Field

from app import snippets
from app.analysis import Analysis
from app.page_spec import OwnPage
from app.params import PromptInput
from app.schemas import ModelRef, TokenRef
from app.settings import Limits
from app.views.shared.default_prompt import prompt_or_default
from app.views.shared.inputs import model_ref, token_refs
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.prompt import attention_entropy


class EntropyView(BaseModel):
    model: ModelRef
    tokens: list[TokenRef]
    text_source: str = Field(description="prompt, tokens, or the default text: card (held-out sample) or builtin")
    mean: list[list[float]] = Field(description="[layer][head] mean over query positions of H_i (nats)")
    normalised: list[list[float | None]] = Field(
        description="[layer][head] mean of H_i / log(i + 1) over i >= 1: 0 one key, 1 uniform"
    )
    per_position: list[list[list[float]]] = Field(description="[layer][head][i] entropy H_i of query position i (nats)")


def build_entropy_view(loaded: LoadedModel, p: PromptInput, limits: Limits) -> EntropyView:
    ids, source = prompt_or_default(loaded, p, limits)
    H = attention_entropy.head_entropies(loaded.model, torch.tensor(ids, device=loaded.model.device))  # [L, heads, n]
    norm = attention_entropy.normalised(H).mean(-1) if len(ids) > 1 else torch.full(H.shape[:2], float("nan"))
    return EntropyView(
        model=model_ref(loaded),
        tokens=token_refs(loaded, ids),
        text_source=source,
        mean=H.mean(-1).tolist(),
        normalised=[[None if v != v else v for v in row] for row in norm.tolist()],
        per_position=H.tolist(),
    )


def entropy_cost(loaded: LoadedModel, p: PromptInput, limits: Limits) -> Cost:
    return attention_entropy.cost(loaded.model, len(prompt_or_default(loaded, p, limits)[0]))


ATTENTION_ENTROPY = Analysis(
    name="attention-entropy",
    path="attention-entropy",
    params=PromptInput,
    view=EntropyView,
    build=build_entropy_view,
    cost=entropy_cost,
    summary="Attention entropy of every head",
    snippet=snippets.attention_entropy_body,
    tags=["prompts"],
    cache=lambda p: p.prompt is None and p.tokens is None,  # the default text only
    needs_layers=1,
    page=OwnPage(
        template="attention_entropy.html", nav=100, head_filter="the heat map colours and the table lists only these"
    ),
)
