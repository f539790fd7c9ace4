"""The pages analyses declare (their `page=` field, app/page_spec.py), made `Page`s: an `OwnPage` renders its
template with the default context (rendering.default_context); a `PerHeadPage` renders templates/per_head.html with
the view's [layer][head] numbers. Each is labelled with its analysis's summary and placed in a model's navigation at
its `nav` (app/routers/pages.py appends them to PAGES).

A page declaring `head_filter` (the page-context hook of app/page_spec.py) takes a `filter` parameter beside its
analysis's (`with_filter`), and its context is wrapped by `head_filter_context`: the analysis runs on its own params
(the JSON twin's), and the template gets the heads the filter keeps."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic import create_model

from app.analysis import Analysis, AnalysisParams, Declared
from app.head_filter import FilterText, keep_grid
from app.page_spec import PerHeadPage
from app.routers.page_inputs import filtered_heads
from app.routers.rendering import AnalysisContext, Page, PageCall, PageContext, default_context

Context = Callable[[PageCall[Any]], Awaitable[PageContext]]
# a context giving the analysis's view, refusal and params (default_context, per_head_context): what a filter wraps
AnalysisContextOf = Callable[[PageCall[Any]], Awaitable[AnalysisContext]]


class PerHeadContext(AnalysisContext):
    """The shared per-head page's context (templates/per_head.html): the default one, the declaration (`shown`) and
    the view's [layer][head] numbers (`values`; None on a refusal)."""

    shown: PerHeadPage
    values: list[list[float]] | None


async def per_head_context(call: PageCall[Any]) -> PerHeadContext:
    """The default context, and for the shared per-head page its declaration and numbers."""
    context = await default_context(call)
    analysis = call.page.analysis
    assert isinstance(analysis, Analysis) and isinstance(analysis.page, PerHeadPage)
    view = context["view"]
    values = getattr(view, analysis.page.values) if view else None
    return {**context, "shown": analysis.page, "values": values}


def with_filter(params: type[AnalysisParams]) -> type[AnalysisParams]:
    """The page's params: the analysis's and the head filter (FilterText, the one definition)."""
    return create_model(f"{params.__name__}Filtered", __base__=params, filter=(FilterText, None))


class HeadFilterContext(AnalysisContext):
    """A page with a head filter (head_filter_context): its analysis's context (the default one, or the per-head
    page's with its `shown` and `values`) with the refusal of the filter's heads table as `error` when the analysis
    has none, and the filter's state for templates/_macros.html's head_filter_input and head_filter_note."""

    head_filter: str  # the filter as read ('' for none)
    filter_text: str | None  # as typed
    kept: set[str] | None  # the names of the heads the filter keeps (None: every head)
    n_heads: int  # the model's heads, all layers
    filter_what: str  # the declaration's note: what the filter restricts on the page
    keep_grid: Callable[[Sequence[Sequence[float | None]]], list[list[float | None]]]  # a [layer][head] grid, blanked


def head_filter_context(context: AnalysisContextOf) -> Callable[[PageCall[Any]], Awaitable[HeadFilterContext]]:
    """`context` on the analysis's own params (the filter left out, so its answer and JSON twin are the
    unfiltered ones), with the head filter's state: `head_filter` (the filter as read, '' for none), `filter_text`
    (as typed), `kept` (the names of the heads it keeps, None: every head), `n_heads`, `filter_what` (the
    declaration's note) and `keep_grid` (a [layer][head] grid blanked outside `kept`). A filter needs the heads
    table's scores: its refusal or job is the page's error."""

    async def filtered(call: PageCall[Any]) -> HeadFilterContext:
        analysis = call.page.analysis
        assert isinstance(analysis, Analysis) and analysis.page is not None and analysis.page.head_filter is not None
        text: str | None = call.params.filter
        call.params = call.json_params = analysis.params.model_validate(call.params.model_dump(exclude={"filter"}))
        head_filter, kept, filter_error = await filtered_heads(call, text)
        inner = await context(call)
        cfg = call.model.model.cfg
        return {
            **inner,
            "error": inner["error"] or filter_error,
            "head_filter": str(head_filter),
            "filter_text": text,
            "kept": kept,
            "n_heads": cfg.n_layers * cfg.n_heads,
            "filter_what": analysis.page.head_filter,
            "keep_grid": lambda grid: keep_grid(grid, kept),
        }

    return filtered


def declared_pages(analyses: list[Declared[Any, Any]]) -> list[Page[Any]]:
    """The page of every analysis that declares one, in the catalog's order (the navigation sorts by `nav`)."""
    pages: list[Page[Any]] = []
    for a in analyses:
        if not isinstance(a, Analysis) or a.page is None:
            continue
        if isinstance(a.page, PerHeadPage) and a.page.values not in a.view.model_fields:
            raise ValueError(f"{a.name}: its PerHeadPage shows {a.page.values!r}, not a field of {a.view.__name__}")
        if isinstance(a.page, PerHeadPage) and a.params.model_fields:  # its caption says: the weights as served
            raise ValueError(f"{a.name}: the shared per-head page has no form; its params must have no fields")
        context: AnalysisContextOf = per_head_context if isinstance(a.page, PerHeadPage) else default_context
        params = None
        if a.page.head_filter is not None:
            if "filter" in a.params.model_fields:
                raise ValueError(f"{a.name}: its params have a `filter` field, the name of the page's head filter")
            params = with_filter(a.params)
            page_context: Context = head_filter_context(context)
        else:
            page_context = context
        label = a.summary if a.page.nav is not None else None
        pages.append(Page(a, a.page.template, page_context, params=params, label=label, order=a.page.nav))
    return pages
