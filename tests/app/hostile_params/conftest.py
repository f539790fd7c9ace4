"""The hostile pass's models and clients (tests/app/hostile_folders.py), one set per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.app.hostile_folders import build_folders, poor_client, served_app


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_folders(tmp_path_factory.mktemp("hostile-params"))


@pytest.fixture(scope="module")
def app_client(folders: tuple[Path, Path]) -> Iterator[tuple[Any, TestClient]]:
    yield from served_app(folders)


@pytest.fixture(scope="module")
def client(app_client: tuple[Any, TestClient]) -> TestClient:
    """The hostile folders' app (it replaces tests/app/conftest.py's client in this folder)."""
    return app_client[1]


@pytest.fixture(scope="module")
def poor(folders: tuple[Path, Path]) -> Iterator[TestClient]:
    yield from poor_client(folders)
