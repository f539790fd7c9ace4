"""The declarations are typed seams: mypy rejects an Analysis whose builder or cost takes other params than it
declares, or whose builder returns another view. A small module with one right and three wrong declarations is
checked with the project's mypy configuration; mypy must report exactly the three wrong ones."""

from __future__ import annotations

import re
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[2]
DECLARATIONS = """
from pydantic import BaseModel

from app.analysis import Analysis, AnalysisParams
from app.settings import Limits
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
WRONG_BUILD = Analysis(name="b", path="b", params=KP, view=KV, build=build_other, cost=cost_k, summary="", tags=[])
WRONG_COST = Analysis(name="c", path="c", params=KP, view=KV, build=build_k, cost=cost_other, summary="", tags=[])
WRONG_VIEW = Analysis(name="v", path="v", params=KP, view=OP, build=build_k, cost=cost_k, summary="", tags=[])
"""


def test_mypy_rejects_a_mismatched_builder_cost_or_view(tmp_path: Path) -> None:
    module = tmp_path / "declarations.py"
    module.write_text(DECLARATIONS)
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), str(module)])
    assert status == 1, out + err
    lines = DECLARATIONS.splitlines()
    flagged = {lines[int(n) - 1].split(" = ")[0] for n in re.findall(r"declarations\.py:(\d+): error", out)}
    assert flagged == {"WRONG_BUILD", "WRONG_COST", "WRONG_VIEW"}, out
    assert 'Argument "build" to "Analysis"' in out and 'Argument "cost" to "Analysis"' in out, out
