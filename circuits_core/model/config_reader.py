"""Typed reads of a raw config mapping (a Hugging Face config.json, GGUF metadata): `ConfigReader`, whose errors
(CheckpointError) name the file and the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from circuits_core.errors import CheckpointError
from circuits_core.model.field_checks import show_value

_REQUIRED: Any = object()


class ConfigReader:
    """Typed reads of a raw config mapping (a Hugging Face config.json); every error names the field.

    `r = ConfigReader(hf, "config.json")`; `r.integer("n_head", ge=1)`, `r.number("layer_norm_epsilon",
    default=1e-5, gt=0)`, `r.flag("tie_word_embeddings", default=True)`, `r.text("hidden_act", default="gelu")`,
    `r.section("rope_scaling")` (a reader of a nested object; absent or null -> empty). A field that is absent
    or null takes `default`; without a default it is required. Errors are CheckpointError.
    """

    def __init__(self, data: Any, source: str = "config.json", prefix: str = ""):
        if not isinstance(data, Mapping):
            raise CheckpointError(
                f"{source}: {prefix.rstrip('.') or 'the config'} must be a JSON object, got {show_value(data)}"
            )
        self.data, self.source, self.prefix = data, source, prefix

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def _fail(self, name: str, expected: str, value: Any) -> CheckpointError:
        return CheckpointError(f"{self.source}: field {self.prefix}{name} must be {expected}, got {show_value(value)}")

    def _get(self, name: str, default: Any) -> tuple[bool, Any]:
        value = self.data.get(name)
        if value is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.source}: required field {self.prefix}{name} is missing")
            return False, default
        return True, value

    def _bounded(self, name: str, value: Any, kind: str, ge: float | None, gt: float | None, le: float | None) -> Any:
        for bound, sign, holds in ((ge, ">=", value.__ge__), (gt, ">", value.__gt__), (le, "<=", value.__le__)):
            if bound is not None and not holds(bound):
                raise self._fail(name, f"{kind} {sign} {bound}", value)
        return value

    def integer(self, name: str, default: Any = _REQUIRED, ge: int | None = None, le: int | None = None) -> Any:
        given, value = self._get(name, default)
        if not given:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(name, "an integer", value)
        return self._bounded(name, value, "an integer", ge, None, le)

    def number(
        self,
        name: str,
        default: Any = _REQUIRED,
        ge: float | None = None,
        gt: float | None = None,
        le: float | None = None,
    ) -> Any:
        given, value = self._get(name, default)
        if not given:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self._fail(name, "a number", value)
        return self._bounded(name, float(value), "a number", ge, gt, le)

    def flag(self, name: str, default: Any = _REQUIRED) -> Any:
        given, value = self._get(name, default)
        if given and not isinstance(value, bool):
            raise self._fail(name, "true or false", value)
        return value

    def text(self, name: str, default: Any = _REQUIRED) -> Any:
        given, value = self._get(name, default)
        if given and not isinstance(value, str):
            raise self._fail(name, "a string", value)
        return value

    def section(self, name: str) -> ConfigReader:
        _, value = self._get(name, {})
        if not isinstance(value, Mapping):
            raise self._fail(name, "an object", value)
        return ConfigReader(value, self.source, f"{self.prefix}{name}.")
