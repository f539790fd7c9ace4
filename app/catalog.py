"""Every declared analysis (app/analysis.py), found where it is declared: beside its builder in a module of
app/views. Adding an analysis needs no line here.

The scan (`declared_in`), explicit and deterministic: the modules of the package, in the order of their names
(pkgutil, not recursive), each imported; from each, its top-level names bound to an `Analysis` or `ServerAnalysis`
(a `Declared`), in the order the module defines them, keeping those whose `build` the module itself defines. So a
declaration a module imports from a sibling (the derived views import HEADS) is its sibling's, listed once; one
bound in a views module whose builder lives outside app/views is refused (ValueError at import: declare it beside
its builder); one declared anywhere else is not served (tests/app/test_catalog.py). The order is the API docs'.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

import app.views
from app.analysis import Analysis, Declared, ServerAnalysis


def declared_in(package: ModuleType) -> list[Declared[Any, Any]]:
    """The declarations of `package`'s modules, in module-name order, each in its module's definition order."""
    found: list[Declared[Any, Any]] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if not isinstance(value, Analysis | ServerAnalysis):
                continue
            home = value.build.__module__
            if home == module.__name__:
                found.append(value)
            elif not home.startswith(package.__name__ + "."):
                raise ValueError(
                    f"{module.__name__}.{name} ({value.name!r}) is built by {home}, outside {package.__name__}: "
                    "declare an analysis beside its builder in a module of app/views"
                )
    return found


ANALYSES: list[Declared[Any, Any]] = declared_in(app.views)
