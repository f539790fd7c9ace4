"""The pages analyses declare (their `page=` field, app/page_spec.py), made `Page`s: an `OwnPage` renders its
template with the default context (rendering.default_context); a `PerHeadPage` renders templates/per_head.html with
the view's [layer][head] numbers. Each is labelled with its analysis's summary and placed in a model's navigation at
its `nav` (app/routers/pages.py appends them to PAGES)."""

from __future__ import annotations

from typing import Any

from app.analysis import Analysis, Declared
from app.page_spec import PerHeadPage
from app.routers.rendering import Page, PageCall, PageContext, default_context


async def per_head_context(call: PageCall[Any]) -> PageContext:
    """The default context, and for the shared per-head page its declaration (`shown`) and the view's [layer][head]
    numbers (`values`; None on a refusal)."""
    context = await default_context(call)
    analysis = call.page.analysis
    assert isinstance(analysis, Analysis) and isinstance(analysis.page, PerHeadPage)
    view = context["view"]
    return {**context, "shown": analysis.page, "values": getattr(view, analysis.page.values) if view else None}


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
        context = per_head_context if isinstance(a.page, PerHeadPage) else default_context
        label = a.summary if a.page.nav is not None else None
        pages.append(Page(a, a.page.template, context, label=label, order=a.page.nav))
    return pages
