"""Pages of every head that filter their heads (app/head_filter.py): copying, and the pages of one number per head
(a [layer][head] grid and its table: attention entropy, QK circuit norm). Each context runs its analysis on the params
without the filter (the JSON twin's) and shows the heads the filter keeps."""

from __future__ import annotations

from app.head_filter import FilterText, masked_grid
from app.params import NoParams, PromptInput
from app.routers.page_inputs import filtered_heads
from app.routers.rendering import PageCall, PageContext
from app.views.copying import COPYING_ALL, CopyingAllParams


# -- copying of every head ----------------------------------------------------------------------------------------
class CopyingPageParams(CopyingAllParams):
    filter: FilterText = None  # of the chart and the table


async def copying_context(call: PageCall[CopyingPageParams]) -> PageContext:
    params = CopyingAllParams(**call.params.model_dump(exclude={"filter"}))
    call.json_params = params
    head_filter, kept, filter_error = await filtered_heads(call, call.params.filter)
    whole, error = await call.attempt(COPYING_ALL, params)
    view = (
        whole
        if whole is None or kept is None
        else whole.model_copy(update={"heads": [h for h in whole.heads if h.head in kept]})
    )
    return {
        "view": view,
        "error": error or filter_error,
        "params": params,
        "head_filter": str(head_filter),
        "filter_text": call.params.filter,
        "n_measured": None if whole is None else len(whole.heads),
    }


# -- pages of one number per head ([layer][head] grids): attention entropy, QK circuit norm -------------------------
class EntropyPageParams(PromptInput):
    filter: FilterText = None  # of the grid and the table


class QKCircuitNormPageParams(NoParams):
    filter: FilterText = None  # of the grid and the table


async def head_grid_context(call: PageCall[EntropyPageParams | QKCircuitNormPageParams]) -> PageContext:
    """The analysis's view (a [layer][head] grid and its table), `kept`: the heads the filter keeps (None: all)."""
    params = call.page.analysis.params(**call.params.model_dump(exclude={"filter"}))
    call.json_params = params
    head_filter, kept, filter_error = await filtered_heads(call, call.params.filter)
    view, error = await call.attempt(call.page.analysis, params)
    cfg = call.model.model.cfg
    return {
        "view": view,
        "error": error or filter_error,
        "params": params,
        "head_filter": str(head_filter),
        "filter_text": call.params.filter,
        "kept": kept,
        "n_heads": cfg.n_layers * cfg.n_heads,
        "masked": lambda grid: masked_grid(grid, kept),
    }
