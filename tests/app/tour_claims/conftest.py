"""The tour as the app builds it and the shipped toys as stored (tests/app/tour_claims_reference.py), per module."""

from __future__ import annotations

from typing import Any

import pytest

from app.registry import ModelRegistry
from circuits_core.prompt.phenomena import EvalData
from tests.app.tour_claims_reference import build_served, eval_data, raw_toys


@pytest.fixture(scope="module")
def served() -> tuple[dict[str, Any], ModelRegistry]:
    return build_served()


@pytest.fixture(scope="module")
def tour(served: tuple[dict[str, Any], ModelRegistry]) -> dict[str, Any]:
    return served[0]


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return raw_toys()


@pytest.fixture(scope="module")
def data() -> EvalData:
    return eval_data()
