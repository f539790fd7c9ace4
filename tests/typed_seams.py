"""The typed seams, checked by mypy in `make lint` (pyproject.toml lists this file with app and circuits_core).

Each wrong declaration below carries `# type: ignore[<code>]` for the error mypy must report, and this module is
checked with warn_unused_ignores: if mypy stopped rejecting one (say `build` were typed `Callable[..., V]` again),
its ignore would be unused and `make lint` fails. The right declarations carry none, so they must pass.

- An Analysis whose builder or cost takes other params than it declares, or whose builder returns another view.
- A Page whose context reads other page params than the page declares.
- PageCall.run given params of another analysis; its answer is the analysis's view type.
"""

from __future__ import annotations

from typing import assert_type

from pydantic import BaseModel

from app.analysis import Analysis, AnalysisParams
from app.params import DetectorParams
from app.routers.pages import DetectorPageParams, DirectPageParams, detectors_context, direct_context
from app.routers.rendering import Page, PageCall
from app.schemas import DetectorsView
from app.settings import Limits
from app.views.circuits import DIRECT
from app.views.detectors import DETECTORS
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
