"""Declarations register themselves (app/catalog.py declared_in): every analysis bound in a module of app/views is
served, one declared elsewhere is not, a misplaced one is refused; the pages they declare (app/page_spec.py) are in
the navigation at their declared places."""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.analysis import Analysis
from app.catalog import ANALYSES, declared_in
from app.page_spec import PerHeadPage
from app.params import NoParams
from app.routers.declared_pages import declared_pages
from app.settings import REPO_ROOT, Limits
from app.views.shared.per_head import PerHeadView
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel


def build_elsewhere(loaded: LoadedModel, p: NoParams, limits: Limits) -> PerHeadView:
    raise NotImplementedError


def cost_nothing(loaded: LoadedModel, p: NoParams, limits: Limits) -> Cost:
    return Cost(0)


# A declaration outside app/views: not in the catalog, so not served.
OUTSIDE = Analysis(
    name="declared-outside-views",
    path="declared-outside-views",
    params=NoParams,
    view=PerHeadView,
    build=build_elsewhere,
    cost=cost_nothing,
    summary="not served",
    tags=["circuits"],
)


def declared_names_in_source() -> set[str]:
    """The `name=` of every `X = Analysis(...)` / `ServerAnalysis(...)` / `per_head_analysis(...)` at the top of a
    module of app/views or app/tour, read from the source text (not by importing it)."""
    names = set()
    for path in sorted([*(REPO_ROOT / "app" / "views").rglob("*.py"), *(REPO_ROOT / "app" / "tour").rglob("*.py")]):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                func = node.value.func
                if isinstance(func, ast.Name) and func.id in ("Analysis", "ServerAnalysis", "per_head_analysis"):
                    kw = {k.arg: k.value for k in node.value.keywords}
                    assert isinstance(kw["name"], ast.Constant)
                    names.add(kw["name"].value)
    return names


def test_the_catalog_is_every_declaration_in_app_views_once() -> None:
    names = [a.name for a in ANALYSES]
    assert len(names) == len(set(names))
    assert set(names) == declared_names_in_source()
    assert OUTSIDE not in ANALYSES


def test_a_declaration_in_views_is_served_and_one_outside_is_not(client: TestClient) -> None:
    # ov-effective-rank is named in neither app/catalog.py nor app/routers/pages.py
    for file in ("app/catalog.py", "app/routers/pages.py"):
        assert "ov_effective_rank" not in (REPO_ROOT / file).read_text()
    assert client.get("/api/v1/models/tiny-2l/ov-effective-rank").status_code == 200
    assert client.get("/models/tiny-2l/ov-effective-rank").status_code == 200
    assert client.get("/api/v1/models/tiny-2l/declared-outside-views").status_code == 404
    assert client.get("/models/tiny-2l/declared-outside-views").status_code == 404


def write_package(root: Path, name: str, modules: dict[str, str]) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    for module, text in modules.items():
        (root / name / f"{module}.py").write_text(text)


HEADER = """
from app.analysis import Analysis
from app.page_spec import PerHeadPage
from app.params import NoParams
from app.views.shared.per_head import PerHeadView
from tests.app.test_catalog import build_elsewhere, cost_nothing


def build(loaded, p, limits):
    raise NotImplementedError
"""


def declare(var: str, name: str, build: str = "build") -> str:
    return (
        f'{var} = Analysis(name="{name}", path="{name}", params=NoParams, view=PerHeadView, build={build}, '
        'cost=cost_nothing, summary="s", tags=["t"])\n'
    )


def test_scan_order_imports_and_misplaced_builders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    write_package(
        tmp_path,
        "scanned_views",
        {
            "b_second": HEADER + declare("B", "b"),
            # B imported from a sibling is its sibling's, listed once
            "a_first": HEADER + declare("A2", "a2") + "from scanned_views.b_second import B\n" + declare("A1", "a1"),
        },
    )
    try:
        assert [a.name for a in declared_in(__import__("scanned_views"))] == ["a2", "a1", "b"]
        write_package(tmp_path, "misplaced_views", {"m": HEADER + declare("M", "m", "build_elsewhere")})
        with pytest.raises(ValueError, match="declare an analysis beside its builder"):
            declared_in(__import__("misplaced_views"))
    finally:
        for name in [m for m in sys.modules if m.startswith(("scanned_views", "misplaced_views"))]:
            del sys.modules[name]


MAKER = (
    HEADER
    + """

def made(name):
    def build(loaded, p, limits):
        raise NotImplementedError

    return Analysis(name=name, path=name, params=NoParams, view=PerHeadView, build=build, cost=cost_nothing,
                    summary="s", tags=["t"])
"""
)


def test_a_declaration_made_by_a_shared_builder_is_its_binding_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """app/views/shared/per_head.py makes the builder of every per-head analysis: each is listed at the one module
    binding it, in the scan's order; one made there and bound in two modules is refused."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = "from made_views.shared import made\n"
    write_package(
        tmp_path,
        "made_views",
        {
            "shared": MAKER,
            "a_view": HEADER + declare("A", "a"),
            "b_made": made + 'B = made("b")\n',
            "c_view": HEADER + declare("C", "c"),
        },
    )
    write_package(
        tmp_path,
        "twice_views",
        {
            "shared": MAKER,
            "x": 'from twice_views.shared import made\nX = made("x")\n',
            "y": "from twice_views.x import X\n",
        },
    )
    try:
        assert [a.name for a in declared_in(__import__("made_views"))] == ["a", "b", "c"]
        with pytest.raises(ValueError, match="'x', made by twice_views.shared, is bound in"):
            declared_in(__import__("twice_views"))
    finally:
        for name in [m for m in sys.modules if m.startswith(("made_views", "twice_views"))]:
            del sys.modules[name]


# The navigation's order before the pages were declared on their analyses (a new page goes anywhere between these).
NAVIGATION = [
    "",
    "/composition",
    "/prompt",
    "/path",
    "/qk-paths",
    "/detectors",
    "/term-importance",
    "/direct",
    "/copying",
    "/attention-entropy",
    "/qk-circuit-norm",
    "/ov-effective-rank",
    "/residual",
    "/residual/usage",
]


def test_navigation_is_in_the_declared_order(client: TestClient) -> None:
    nav = client.get("/models/tiny-2l").text.split('class="sidenav"', 1)[1].split("</nav>", 1)[0]
    hrefs = re.findall(r'class="item[^"]*" href="/models/tiny-2l([^"]*)"', nav)
    assert [h for h in hrefs if h in NAVIGATION] == NAVIGATION
    placed = [a for a in ANALYSES if isinstance(a, Analysis) and a.page is not None and a.page.nav is not None]
    listed = {a.path for a in placed if not a.needs_mlp}  # tiny-2l is attention-only: no page of an MLP
    assert listed <= {h.lstrip("/") for h in hrefs}  # every page declaring a place is in the navigation
    assert not {a.path for a in placed if a.needs_mlp} & {h.lstrip("/") for h in hrefs}


def test_no_two_navigation_entries_share_a_place() -> None:
    """A new page picks a free `nav` number: a taken one fails here, listing every entry's place."""
    from app.routers.pages import PAGES

    places = sorted((p.order or 0, p.label) for p in PAGES if p.label is not None)
    numbers = [order for order, _ in places]
    assert len(set(numbers)) == len(numbers), f"two navigation entries at one place; the places taken: {places}"


def test_a_per_head_page_must_name_a_field_of_its_view() -> None:
    wrong = replace(OUTSIDE, page=PerHeadPage(values="ranks", title="t", explanation="e", quantity="q"))
    with pytest.raises(ValueError, match="not a field of PerHeadView"):
        declared_pages([wrong])
