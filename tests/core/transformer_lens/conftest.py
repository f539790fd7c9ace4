"""The checkpoints TransformerLens wrote (tests/core/tl_reference.py), per module, computed on one torch thread."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.core.tl_reference import build_world, one_torch_thread


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return build_world(tmp_path_factory)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from one_torch_thread()
