"""Dashboard pages of the prompt analyses beyond the prompt page: a chain of heads (a virtual head), QK paths and
term importance. Each is a `Page` (app/routers/rendering.py) of its analysis: route, params, JSON twin and frame are
derived; the context functions here run the analyses through `call.run` / `call.attempt` and chart their views. Page
URLs mirror the JSON API (`/models/{m}/<view>` <-> `/api/v1/models/{m}/<view>`), so the paper tour's links land on
these pages. The composition pages are in pages_composition.py, the prompt page in pages_prompt.py.
"""

from __future__ import annotations

from typing import Annotated, Any, NotRequired, TypedDict

from pydantic import Field

from app import charts, snippets, view_figures
from app.analysis import HeadField
from app.charts import Figure
from app.head_filter import FilterText
from app.labels import token_labels, visible
from app.params import (
    HEAD_DOC,
    ChainParams,
    Heads,
    NoParams,
    QKPathsParams,
    TermImportanceParams,
)
from app.routers.page_inputs import filtered_heads, snippet_source, suggested_heads, text_of
from app.routers.rendering import Page, PageCall, Refusal
from app.schemas.analyses import ChainView, QKPathsView, TermImportanceView
from app.views.path import PATH
from app.views.qk_paths import QK_PATHS
from app.views.shared.heads_table import HEADS
from app.views.shared.page_claims import ablation_sentence
from app.views.term_importance import TERM_IMPORTANCE, default_needs_heads


# -- a chain of heads (virtual head) ----------------------------------------------------------------------------
class ChainPageParams(ChainParams):
    heads: Heads = None  # type: ignore[assignment]  # default: the suggested heads


class ChainContext(TypedDict):
    """templates/chain.html: a chain of heads on a prompt (its pattern, contributions, OV eigenvalues as figures) and
    the form's state."""

    view: ChainView | None  # None: refused (error)
    error: Refusal | None
    figs: dict[str, Figure]  # none when refused
    prompt: str | None
    tokens: str | None
    heads: str  # the chain as asked, or as the view names it
    target: str | None
    k: int
    max_k: int


async def chain_context(call: PageCall[ChainPageParams]) -> ChainContext:
    p = call.params
    prompt, tokens = text_of(p)
    heads = p.heads or ",".join(await suggested_heads(call, min(2, call.limits.max_order)))
    params = ChainParams(heads=heads, prompt=prompt, tokens=tokens, target=p.target, k=p.k)
    view, error = await call.attempt(PATH, params)
    heads_str = ",".join(view.heads) if view else heads
    call.json_params = params.model_copy(update={"heads": heads_str})
    call.title = f"{heads_str.replace(',', ' → ')} · {call.model_id}"
    ctx: ChainContext = {
        "view": view,
        "error": error,
        "figs": {},
        "prompt": prompt,
        "tokens": tokens,
        "heads": heads_str,
        "target": p.target,
        "k": p.k,
        "max_k": call.limits.max_k,
    }
    if view is None:
        return ctx
    labels = token_labels(view.tokens)
    ctx["figs"] = {
        "text": view_figures.attention_text(view.tokens, {" → ".join(view.heads): view.pattern}),
        "pattern": view_figures.attention_heatmap(
            view.tokens, view.pattern, f"pattern of the chain {' → '.join(view.heads)}"
        ),
        "contribution": charts.bars(
            labels,
            view.contribution,
            title=f"contribution to logit({visible(view.target.text)}) by position",
            x_title="destination position",
        ),
        "next_token": charts.bars(
            [f"{a} → {b}" for a, b in zip(labels[:-1], labels[1:], strict=True)],
            view.next_token_contribution,
            title="contribution to the logit of each position's actual next token",
            x_title="position → next token",
        ),
        "by_source": charts.lines(
            list(range(len(labels))),
            {s.source: s.values for s in view.by_source},
            title="the same chain entered from each source",
            x_title="position",
            y_title="logit",
        ),
        "ov_eig": charts.complex_scatter(
            view_figures.complex_points(view.ov.eigenvalues), title="eigenvalues of the chain's OV circuit"
        ),
    }
    return ctx


# -- QK paths -----------------------------------------------------------------------------------------------------
class QKPathsPageParams(QKPathsParams):
    head: Annotated[str | None, Field(max_length=16, description=HEAD_DOC), HeadField()] = None  # type: ignore[assignment]


class QKPathsContext(TypedDict):
    """templates/qk_paths.html: one head's attention scores split into query-side x key-side terms, as figures, and
    the form's state; the "copy as Python" snippet when one (query, key) score's terms are listed."""

    view: QKPathsView | None  # None: refused (error)
    error: Refusal | None
    head: str  # as asked, or as the view names it
    figs: dict[str, Any]  # std, scores: figures; terms: (name, figure) per term
    prompt: str | None
    tokens: str | None
    query: int | None
    key: int | None
    k: int
    max_k: int
    snippet: NotRequired[str]


async def qk_paths_context(call: PageCall[QKPathsPageParams]) -> QKPathsContext:
    p = call.params
    cfg = call.model.model.cfg
    prompt, tokens = text_of(p)
    head = p.head  # default: the induction head of a 2+ layer model, else H0 of the last layer
    if not head:
        head = (await suggested_heads(call, 2))[-1] if cfg.n_layers else "L0H0"
    params = QKPathsParams(head=head, prompt=prompt, tokens=tokens, k=p.k, query=p.query, key=p.key)
    view, error = await call.attempt(QK_PATHS, params)
    call.json_params = params
    call.title = f"QK paths of {head} · {call.model_id}"
    ctx: QKPathsContext = {
        "view": view,
        "error": error,
        "head": head,
        "figs": {},
        "prompt": prompt,
        "tokens": tokens,
        "query": p.query,
        "key": p.key,
        "k": p.k,
        "max_k": call.limits.max_k,
    }
    if view is None:
        return ctx
    labels = token_labels(view.tokens)
    ctx["head"] = view.head
    if view.at is not None:
        ctx["snippet"] = snippets.qk_score_terms(
            *await snippet_source(call),
            view.head,
            [t.id for t in view.tokens],
            view.at.query,
            view.at.key,
            len(view.at.terms),
        )
    ctx["figs"] = {
        "std": charts.heatmap(
            view.std,
            view.components,
            view.components,
            title="std of each term's scores over (query, key) positions",
            x_title="key-side component",
            y_title="query-side component",
            signed=False,
            hover="query %{y} · key %{x}<br>std %{z:.4f}",
            colorbar="std",
            height=max(300, 40 * len(view.components) + 140),
        ),
        "scores": charts.heatmap(
            view.scores,
            labels,
            labels,
            title=f"real attention scores of {view.head}",
            x_title="key",
            y_title="query",
            signed=True,
            colorbar="score",
            height=charts.label_room(len(labels), 420),
        ),
        "terms": [
            (
                name,
                charts.heatmap(
                    z,
                    labels,
                    labels,
                    title=name.replace("|", " · "),
                    x_title="key",
                    y_title="query",
                    signed=True,
                    colorbar="score",
                    height=380,
                ),
            )
            for name, z in view.terms.items()
        ],
    }
    return ctx


# -- term importance --------------------------------------------------------------------------------------------
class TermImportancePageParams(TermImportanceParams):
    filter: FilterText = None  # of the head ablations' table and charts


class TermImportanceContext(TypedDict):
    """templates/term_importance.html: the loss by path order and per layer, the head ablations the filter keeps, the
    sentence on the previous-token head's ablation, and the form's state."""

    view: TermImportanceView | None  # None: refused, or the heads table's job still running (error)
    error: Refusal | None
    figs: dict[str, Figure]
    prompt: str | None
    heads: str | None
    head_filter: str  # the filter as read ('' for none)
    filter_text: str | None  # as typed
    n_ablated: NotRequired[int | None]  # heads ablated before the filter
    claim: NotRequired[str | None]  # ablation_sentence


async def term_importance_context(call: PageCall[TermImportancePageParams]) -> TermImportanceContext:
    prompt, model = call.params.prompt, call.model_id
    params = TermImportanceParams(**call.params.model_dump(exclude={"filter"}))
    call.json_params = params
    head_filter, kept, filter_error = await filtered_heads(call, call.params.filter)
    ctx: TermImportanceContext = {
        "view": None,
        "error": filter_error,
        "figs": {},
        "prompt": prompt,
        "heads": params.heads,
        "head_filter": str(head_filter),
        "filter_text": call.params.filter,
    }
    heads, heads_error = await call.attempt(HEADS, NoParams())  # first: a large model's default heads are read off it
    if heads_error is not None and heads_error["status"] == 202 and default_needs_heads(call.model, params):
        return {**ctx, "error": heads_error}  # the heads table's job, polled; then the ablations of the heads it names
    whole, error = await call.attempt(TERM_IMPORTANCE, params)
    view = (
        whole
        if whole is None or kept is None
        else whole.model_copy(update={"heads": [h for h in whole.heads if h.head in kept]})
    )
    ctx["view"], ctx["error"] = view, error or filter_error
    ctx["n_ablated"] = None if whole is None else len(whole.heads)
    if view is None or whole is None:
        return ctx
    ctx["claim"] = ablation_sentence(whole, heads)
    n = len(view.loss_by_order)
    ctx["figs"] = {
        "by_order": charts.bars(
            [f"order ≤ {i}" for i in range(n)],
            view.loss_by_order,
            title="mean loss keeping paths up to each order",
            y_title="loss (nats)",
        ),
        "marginal": charts.bars(
            [f"order {i + 1}" for i in range(len(view.marginal_by_order))],
            view.marginal_by_order,
            title="loss reduction added by each order",
            y_title="Δ loss (nats)",
        ),
        "by_layer": charts.bars(
            [f"layer {i}" for i in range(len(view.first_order_by_layer))],
            view.first_order_by_layer,
            title="first-order terms of each layer alone (over the direct path)",
            y_title="Δ loss (nats)",
        ),
        "heads": charts.bars(
            [h.head for h in view.heads],
            [h.loss_change for h in view.heads],
            title="loss increase when one head is removed (patterns frozen)",
            y_title="Δ loss (nats)",
            links=[f"/models/{model}/heads/{h.head}" for h in view.heads],
        ),
        "heads_recomputed": charts.bars(
            [h.head for h in view.heads],
            [h.loss_change_recomputed for h in view.heads],
            title="loss increase when one head is removed (later patterns recomputed)",
            y_title="Δ loss (nats)",
            links=[f"/models/{model}/heads/{h.head}" for h in view.heads],
        ),
    }
    return ctx


CHAIN_PAGE = Page(
    PATH, "chain.html", chain_context, params=ChainPageParams, blocks=("chain_panel",), label="Chain of heads", order=40
)
QK_PATHS_PAGE = Page(
    QK_PATHS,
    "qk_paths.html",
    qk_paths_context,
    params=QKPathsPageParams,
    blocks=("qk_panel",),
    label="QK paths",
    order=50,
)
TERM_IMPORTANCE_PAGE = Page(
    TERM_IMPORTANCE,
    "term_importance.html",
    term_importance_context,
    params=TermImportancePageParams,
    blocks=("ti_panel",),
    title="Term importance · {model}",
    label="Term importance",
    order=70,
)
