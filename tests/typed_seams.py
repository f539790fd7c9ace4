"""The typed seams, checked by mypy in `make lint` (pyproject.toml lists this file with app and circuits_core).

Each wrong declaration below carries `# type: ignore[<code>]` for the error mypy must report, and this module is
checked with warn_unused_ignores: if mypy stopped rejecting one (say `build` were typed `Callable[..., V]` again),
its ignore would be unused and `make lint` fails. The right declarations carry none, so they must pass.

- An Analysis whose builder or cost takes other params than it declares, or whose builder returns another view.
- A Page whose context reads other page params than the page declares.
- PageCall.run given params of another analysis; its answer is the analysis's view type.
- A per-head analysis (app/views/shared/per_head.py) whose engine function or cost does not take the model.
- A page context, the page frame or the basis picker's state with a misspelt or missing key, or a value of the
  wrong type (rendering.AnalysisContext, PageFrame, BasisContext; declared_pages.PerHeadContext).
- A head-filtered page's context (declared_pages.HeadFilterContext) with a misspelt key or the kept heads as a list,
  or the filter wrapped around a context that has no analysis view and refusal (head_filter_context).
- A page context built by hand in a router with a misspelt, missing or wrong-typed key (pages_analyses.ChainContext,
  pages_tour.TourContext, pages_composition.CompositionFrameContext), or a context function whose page params are not
  its page's (TourContext's params).
"""

from __future__ import annotations

from typing import assert_type

from pydantic import BaseModel
from torch import Tensor

from app.analysis import Analysis, AnalysisParams
from app.head_filter import keep_grid
from app.page_spec import PerHeadPage
from app.params import DetectorParams, TourParams
from app.routers.declared_pages import HeadFilterContext, PerHeadContext, head_filter_context
from app.routers.pages import DetectorPageParams, DirectPageParams, detectors_context, direct_context
from app.routers.pages_analyses import ChainContext
from app.routers.pages_composition import CompositionFrameContext
from app.routers.pages_tour import TourContext
from app.routers.rendering import AnalysisContext, BasisContext, Page, PageCall, PageFrame, default_context
from app.schemas import DetectorsView
from app.settings import Limits
from app.tour.figure_data import TourView
from app.views.circuits import DIRECT
from app.views.detectors import DETECTORS
from app.views.shared.per_head import PerHeadAnalysis, per_head_analysis
from circuits_core.circuits import qk_circuit_norm
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel


class KP(AnalysisParams):
    k: int = 1


class OP(AnalysisParams):
    j: str = ""


class KV(BaseModel):
    k: int


def build_k(loaded: LoadedModel, p: KP, limits: Limits) -> KV:
    return KV(k=p.k)


def build_other(loaded: LoadedModel, p: OP, limits: Limits) -> KV:
    return KV(k=len(p.j))


def cost_k(loaded: LoadedModel, p: KP, limits: Limits) -> Cost:
    return Cost(0)


def cost_other(loaded: LoadedModel, p: OP, limits: Limits) -> Cost:
    return Cost(0)


RIGHT = Analysis(name="k", path="k", params=KP, view=KV, build=build_k, cost=cost_k, summary="", tags=[])
WRONG_BUILD = Analysis(name="b", path="b", params=KP, view=KV, build=build_other, cost=cost_k, summary="", tags=[])  # type: ignore[arg-type]
WRONG_COST = Analysis(name="c", path="c", params=KP, view=KV, build=build_k, cost=cost_other, summary="", tags=[])  # type: ignore[arg-type]
WRONG_VIEW = Analysis(name="v", path="v", params=KP, view=OP, build=build_k, cost=cost_k, summary="", tags=[])  # type: ignore[arg-type]

RIGHT_PAGE = Page(DIRECT, "direct.html", direct_context, params=DirectPageParams)
WRONG_PAGE = Page(DIRECT, "direct.html", detectors_context, params=DirectPageParams)  # type: ignore[arg-type]


async def page_runs(call: PageCall[DetectorPageParams]) -> None:
    assert_type(call.params, DetectorPageParams)
    assert_type(await call.run(DETECTORS, DetectorParams()), DetectorsView)
    await call.run(DIRECT, DetectorParams())  # type: ignore[misc]


def per_loaded(loaded: LoadedModel) -> Tensor:
    return qk_circuit_norm.qk_circuit_norms(loaded.model)


def priced_loaded(loaded: LoadedModel) -> Cost:
    return Cost(0)


RIGHT_PER_HEAD = per_head_analysis(
    qk_circuit_norm.qk_circuit_norms, qk_circuit_norm.cost, name="r", field="r", summary="", title="R", quantity="",
    explanation="", nav=None,
)  # fmt: skip
assert_type(RIGHT_PER_HEAD, PerHeadAnalysis)
WRONG_ENGINE = per_head_analysis(
    per_loaded, qk_circuit_norm.cost, name="e", field="e", summary="", title="E", quantity="",  # type: ignore[arg-type]
    explanation="", nav=None,
)  # fmt: skip
WRONG_PRICE = per_head_analysis(
    qk_circuit_norm.qk_circuit_norms, priced_loaded, name="p", field="p", summary="", title="P", quantity="",  # type: ignore[arg-type]
    explanation="", nav=None,
)  # fmt: skip

SHOWN = PerHeadPage(values="k", title="K", explanation="", quantity="k")
RIGHT_CONTEXT: AnalysisContext = {"view": KV(k=1), "error": None, "params": KP()}
MISSPELT_CONTEXT: AnalysisContext = {"veiw": KV(k=1), "error": None, "params": KP()}  # type: ignore[typeddict-unknown-key, typeddict-item]
UNPARSED_CONTEXT: AnalysisContext = {"view": None, "error": None, "params": {"k": 1}}  # type: ignore[typeddict-item]
RIGHT_PER_HEAD_CONTEXT: PerHeadContext = {**RIGHT_CONTEXT, "shown": SHOWN, "values": [[1.0]]}
NO_VALUES_CONTEXT: PerHeadContext = {**RIGHT_CONTEXT, "shown": SHOWN}  # type: ignore[typeddict-item]
FRAME: PageFrame = {"title": "t", "json_url": "/api", "model_id": None, "nav": None}
FRAME["model_nav"] = [("ov", "OV circuit", "/models/m/ov")]
FRAME["model_navs"] = []  # type: ignore[typeddict-unknown-key]
WRONG_BASIS: BasisContext = {"basis": None, "basis_differs": "yes", "served_basis": "raw"}  # type: ignore[typeddict-item]
CHAIN: ChainContext = {
    "view": None, "error": None, "figs": {}, "prompt": None, "tokens": None, "heads": "L0H1,L1H2", "target": None,
    "k": 5, "max_k": 100,
}  # fmt: skip
MISSPELT_CHAIN: ChainContext = {  # type: ignore[typeddict-unknown-key, typeddict-item]
    "view": None, "error": None, "figs": {}, "prompt": None, "tokens": None, "heads": "L0H1", "target": None,
    "k": 5, "maxk": 100,
}  # fmt: skip
NO_HEADS_CHAIN: ChainContext = {  # type: ignore[typeddict-item]
    "view": None, "error": None, "figs": {}, "prompt": None, "tokens": None, "target": None, "k": 5, "max_k": 100,
}  # fmt: skip
TEXT_K_CHAIN: ChainContext = {
    "view": None, "error": None, "figs": {}, "prompt": None, "tokens": None, "heads": "L0H1", "target": None,
    "k": "5", "max_k": 100,  # type: ignore[typeddict-item]
}  # fmt: skip
TOUR_PAGE: TourContext = {"view": TourView(models={}, figures=[]), "parts": [], "params": TourParams()}
WRONG_TOUR_VIEW: TourContext = {"view": KV(k=1), "parts": [], "params": TourParams()}  # type: ignore[typeddict-item]
WRONG_TOUR_PARAMS: TourContext = {"view": TourView(models={}, figures=[]), "parts": [], "params": KP()}  # type: ignore[typeddict-item]
FRAME_FIRST: CompositionFrameContext = {"panel_url": "/models/m/composition?kind=K", "kind": "K", "panel_seconds": 7.0}
NO_SUCH_KIND: CompositionFrameContext = {"panel_url": "/m", "kind": "X", "panel_seconds": 7.0}  # type: ignore[typeddict-item]
PANEL_IN_MS: CompositionFrameContext = {"panel_url": "/m", "kind": "K", "panel_ms": 7000}  # type: ignore[typeddict-unknown-key, typeddict-item]
FILTERED: HeadFilterContext = {
    **RIGHT_CONTEXT, "head_filter": "", "filter_text": None, "kept": None, "n_heads": 4, "filter_what": "",
    "keep_grid": lambda grid: keep_grid(grid, None),
}  # fmt: skip
MISSPELT_FILTER: HeadFilterContext = {  # type: ignore[typeddict-unknown-key, typeddict-item]
    **RIGHT_CONTEXT, "head_filter": "", "filter_txt": None, "kept": None, "n_heads": 4, "filter_what": "",
    "keep_grid": lambda grid: keep_grid(grid, None),
}  # fmt: skip
KEPT_AS_LIST: HeadFilterContext = {
    **RIGHT_CONTEXT, "head_filter": "", "filter_text": None, "kept": ["L0H1"], "n_heads": 4, "filter_what": "",  # type: ignore[typeddict-item]
    "keep_grid": lambda grid: keep_grid(grid, None),
}  # fmt: skip
FILTERED_PAGE = head_filter_context(default_context)
FILTERED_DETECTORS = head_filter_context(detectors_context)  # type: ignore[arg-type]
