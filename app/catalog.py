"""Every declared analysis (app/analysis.py), found where it is declared: beside its builder in a module of
app/views (app/views/shared/ too: the heads table the derived analyses read), or of app/tour (the tour's
ServerAnalysis). Adding an analysis needs no line here.

The scan (`declared_in`), explicit and deterministic: every module of the package and its subpackages
(pkgutil.walk_packages), in the order of their dotted names, each imported; from each, its top-level names bound to
an `Analysis` or `ServerAnalysis`, in the order the module defines them. Each declaration is listed once, as its
home module's: the module that defines its `build`, or, for a builder a module of the package makes for others
(app/views/shared/per_head.py: one number per head), the one module that binds it. So a declaration a module imports
(the derived views import HEADS) is listed once, as its home module's; one bound in a scanned module whose builder
lives outside the package is refused (ValueError at import: declare it beside its builder), and so is a made one
bound in two modules; one declared anywhere else is not served (tests/app/test_catalog.py). ANALYSES, the views'
then the tour's, is the order of the API docs.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

import app.tour
import app.views
from app.analysis import Analysis, Declared, ServerAnalysis


def declared_in(package: ModuleType) -> list[Declared[Any, Any]]:
    """The declarations of `package`'s modules, in dotted-name order, each in its module's definition order."""
    prefix = package.__name__ + "."
    bound: list[tuple[str, str, Analysis[Any, Any] | ServerAnalysis[Any, Any]]] = []  # (module, name, declaration)
    for info in sorted(pkgutil.walk_packages(package.__path__, prefix), key=lambda m: m.name):
        module = importlib.import_module(info.name)
        bound += [(info.name, n, v) for n, v in vars(module).items() if isinstance(v, Analysis | ServerAnalysis)]
    binders: dict[int, list[str]] = {}  # id(declaration) -> the modules binding it
    for module_name, _, value in bound:
        binders.setdefault(id(value), []).append(module_name)
    found: list[Declared[Any, Any]] = []
    for module_name, name, value in bound:
        builder, modules = value.build.__module__, binders[id(value)]
        if not builder.startswith(prefix):
            raise ValueError(
                f"{module_name}.{name} ({value.name!r}) is built by {builder}, outside {package.__name__}: "
                "declare an analysis beside its builder"
            )
        if builder not in modules and len(set(modules)) > 1:
            raise ValueError(f"{value.name!r}, made by {builder}, is bound in {sorted(set(modules))}: bind it in one")
        home = builder if builder in modules else modules[0]
        if home == module_name and all(value is not f for f in found):
            found.append(value)
    return found


ANALYSES: list[Declared[Any, Any]] = [*declared_in(app.views), *declared_in(app.tour)]
