"""Every declared analysis (app/analysis.py), found where it is declared: beside its builder in a module of
app/views (app/views/shared/ too: the heads table the derived analyses read), or of app/tour (the tour's
ServerAnalysis). Adding an analysis needs no line here.

The scan (`declared_in`), explicit and deterministic: every module of the package and its subpackages
(pkgutil.walk_packages), in the order of their dotted names, each imported; from each, its top-level names bound to
an `Analysis` or `ServerAnalysis`, in the order the module defines them, keeping those whose `build` the module
itself defines. So a declaration a module imports (the derived views import HEADS) is listed once, as its home
module's; one bound in a scanned module whose builder lives outside the package is refused (ValueError at import:
declare it beside its builder); one declared anywhere else is not served (tests/app/test_catalog.py). ANALYSES, the
views' then the tour's, is the order of the API docs.
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
    found: list[Declared[Any, Any]] = []
    prefix = package.__name__ + "."
    for info in sorted(pkgutil.walk_packages(package.__path__, prefix), key=lambda m: m.name):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if not isinstance(value, Analysis | ServerAnalysis):
                continue
            home = value.build.__module__
            if home == module.__name__:
                found.append(value)
            elif not home.startswith(prefix):
                raise ValueError(
                    f"{module.__name__}.{name} ({value.name!r}) is built by {home}, outside {package.__name__}: "
                    "declare an analysis beside its builder"
                )
    return found


ANALYSES: list[Declared[Any, Any]] = [*declared_in(app.views), *declared_in(app.tour)]
