"""Checking a dataclass's fields against their annotations: int never bool, float accepts int (stored as float),
Literal, `X | None`, and the bounds in each field's `metadata` ({"ge": 1}, {"gt": 0}, {"le": MAX_LAYERS}).

`check_fields` is how ModelConfig checks itself, so a new field is checked by declaring it precisely; an error names
the field, the expected type or bound and the value given, shortened by `show_value` (a value may be a list nested
1,000 deep).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import reprlib
import types
import typing
from typing import Any, Literal

from circuits_core.errors import InvalidInputError

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 2, 40, 40, 4, 4
show_value = _repr.repr  # a bounded repr of a config value (a value may be a list nested 1,000 deep)


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _conform(value: Any, tp: Any) -> tuple[bool, Any]:
    """(value fits type `tp`, the value to store): int never bool, a float field takes an int (as float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            ok, conformed = _conform(value, option)
            if ok:
                return True, conformed
        return False, value
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in typing.get_args(tp)), value
    if tp is type(None) or tp is None:
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    return True, value  # Any or a type this checker does not know: left to the field's own checks


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(obj: Any) -> None:
    """Check every field of a dataclass instance against its annotation and `metadata` bounds (ge, gt, le).

    InvalidInputError names the field, the expected type or bound and the value given (shortened). Ints
    given to float fields are stored as floats, so equal configs compare equal.
    """
    hints = _hints(type(obj))  # type: ignore[arg-type]  # classes are hashable
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        ok, conformed = _conform(value, hints[f.name])
        if not ok:
            raise InvalidInputError(
                f"config field {f.name} must be {_type_name(hints[f.name])}, got {show_value(value)} "
                f"({type(value).__name__})"
            )
        if conformed is not value:
            object.__setattr__(obj, f.name, conformed)
        if isinstance(conformed, int | float) and not isinstance(conformed, bool):
            for bound, holds in (("ge", conformed.__ge__), ("gt", conformed.__gt__), ("le", conformed.__le__)):
                if bound in f.metadata and not holds(f.metadata[bound]):
                    sign = {"ge": ">=", "gt": ">", "le": "<="}[bound]
                    raise InvalidInputError(
                        f"config field {f.name} must be {sign} {f.metadata[bound]}, got {show_value(conformed)}"
                    )
