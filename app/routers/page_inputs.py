"""What the prompt and composition pages share: the prompt a page starts with, a page's prompt or token ids, the
heads a page starts from (the heads that matter), the heads a page's head filter keeps, and where a panel's "copy as
Python" snippet loads the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from app.head_filter import HeadFilter
from app.params import (
    NoParams,
)
from app.routers.rendering import PageCall, Refusal
from app.scheduling import cheap
from app.tour.figures import REPEATED
from app.views.shared.heads_table import HEADS

# The prompt a page starts with: repeated code, where induction heads have something to do.
DEFAULT_PROMPT = REPEATED


class HasText(Protocol):
    @property
    def prompt(self) -> str | None: ...
    @property
    def tokens(self) -> str | None: ...


async def snippet_source(call: PageCall[Any]) -> tuple[Path, str]:
    """The folder and dtype a panel's "copy as Python" snippet loads the model from (as this server does)."""
    entry = await cheap(call.registry.entry, call.model_id or "")
    return entry.path, str(call.registry.dtype).removeprefix("torch.")


def text_of(p: HasText) -> tuple[str | None, str | None]:
    """(prompt, tokens) of a page. A page opened with token ids (a tour link) keeps them in a hidden field beside
    its prompt box, so its form sends both: text typed in the box wins, an empty box keeps the ids. Neither given:
    DEFAULT_PROMPT."""
    if p.prompt:
        return p.prompt, None
    if p.tokens is not None:
        return None, p.tokens
    return (p.prompt, None) if p.prompt is not None else (DEFAULT_PROMPT, None)


def default_heads(n_layers: int, n_heads: int, count: int) -> list[str]:
    """One head of each layer (H0), up to `count`: a starting point for the pattern and chain views."""
    return [f"L{layer}H0" for layer in range(n_layers)][: max(1, count)] if n_heads else []


async def suggested_heads(call: PageCall[Any], count: int) -> list[str]:
    """Where a researcher starts on a model of 2+ layers: the heads that matter (the heads view's previous_token_head
    and induction_head, chosen by detectors.heads_that_matter from the model's own scores); else `default_heads`."""
    cfg = call.model.model.cfg
    fallback = default_heads(cfg.n_layers, cfg.n_heads, count)
    if cfg.n_layers < 2 or count < 2:
        return fallback
    view, _ = await call.attempt(HEADS, NoParams())
    if view is None or view.previous_token_head is None or view.induction_head is None:
        return fallback
    return [view.previous_token_head, view.induction_head]


async def filtered_heads(call: PageCall[Any], text: str | None) -> tuple[HeadFilter, set[str] | None, Refusal | None]:
    """(the page's head filter, the names of the heads it keeps, the heads table's refusal or job). No filter: every
    head (None). The scores it tests are the model's heads table (HEADS: the overview's), whatever the page shows."""
    head_filter = HeadFilter.parse(text)  # 422 naming the fields and operators when unreadable
    if not head_filter:
        return head_filter, None, None
    heads, error = await call.attempt(HEADS, NoParams())
    return head_filter, (set() if heads is None else head_filter.kept(heads.heads)), error
