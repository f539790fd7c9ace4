"""The tour's figures carry typed data (app/tour/figure_data.py) whose JSON twin lists only what each figure has,
reads back as the same figures (the answer cache serves the JSON it stored), and whose page draws every figure.

Built as the app serves it on the shipped toy models. The keys below are those of each figure's JSON when its data
was a dict of keys, before the data was typed: a field that appears unset (written as null) or goes missing changes
a figure's JSON for API clients and fails here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.routers.pages_tour import figure_parts
from app.settings import Settings
from app.tour.figure_data import TourView

KEYS = {
    "F2": {"claim"},
    "F3": {"claim"},
    "F4": {"claim"},
    "F6": {"claim", "direct", "min_count"},
    "F9": {"claim", "paths"},
    "F10": {"claim", "ov"},
    "F11": {"claim", "min_count", "share", "skip_trigrams"},
    "F12": {"claim", "skip_trigrams"},
    "F14": {"claim", "ov", "qk"},
    "F15": {"claim", "head", "positional"},
    "F17": {"claim", "eigenvalues"},
    "F18": {"baseline", "claim", "ov_copying", "self_copy"},
    "F19": {"claim", "paths"},
    "F20": {"claim", "qk_paths"},
    "F21": {"K", "Q", "V", "claim"},
    "F22": {"claim", "induction_head", "induction_mass", "induction_rows", "induction_weighted_mass", "prompt"},
    "F23": {"claim", "next_token_effect"},
    "F24": {"claim", "detectors"},
    "F25": {"claim", "pair"},
    "F26": {"claim", "points", "previous_token_head"},
    "F27": {"claim", "term_importance", "token_ids"},
    "F28": {"claim", "first_order_by_layer", "loss_by_order"},
    "F29": {"claim", "path"},
}
STATIC = {"F7", "F8", "F13", "F16", "F30"}  # diagrams and equations: no data


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    torch.set_num_threads(1)
    with TestClient(create_app(Settings(store_url="off"))) as c:
        yield c


@pytest.fixture(scope="module")
def body(client: TestClient) -> dict[str, Any]:
    response = client.get("/api/v1/tour")
    assert response.status_code == 200
    return response.json()


def test_each_figures_json_lists_the_data_it_has(body: dict[str, Any]) -> None:
    assert body["models"] == {"toy-0l": True, "toy-1l": True, "toy-2l": True}
    figures = {f["id"]: f for f in body["figures"]}
    assert set(figures) == set(KEYS) | STATIC
    for fid, keys in KEYS.items():
        assert figures[fid]["available"], figures[fid]["detail"]
        assert set(figures[fid]["data"]) == keys, fid
    assert all(figures[fid]["data"] is None for fid in STATIC)
    eig = figures["F17"]["data"]["eigenvalues"]  # (real, imaginary) pairs, as before: lists of two numbers
    assert all(len(z) == 2 for pts in eig.values() for z in pts)


def test_the_json_reads_back_as_the_same_figures(body: dict[str, Any]) -> None:
    """What a cached answer goes through: parsed into the typed view and written again, unchanged."""
    assert TourView.model_validate(body).model_dump(mode="json") == body


def test_the_page_draws_every_figure_with_data(client: TestClient, body: dict[str, Any]) -> None:
    """Each computed figure but those that only state numbers (F2-F4) draws a chart, a table or the skip-trigrams,
    and the page shows exactly the charts and table captions of each figure's parts (read back from the JSON, as
    the answer cache would)."""
    page = client.get("/tour").text
    for fig in TourView.model_validate(body).figures:
        if fig.data is None:
            assert f'id="chart-{fig.id}-1"' not in page
            continue
        parts = figure_parts(fig)
        drawn = len(parts["charts"]) + len(parts["tables"]) + (parts["trigrams"] is not None)
        assert drawn > 0 or fig.data.model_fields_set == {"claim"}, fig.id  # a sentence only
        n = len(parts["charts"])
        assert f'id="chart-{fig.id}-{n}"' in page if n else True
        assert f'id="chart-{fig.id}-{n + 1}"' not in page
        for caption, *_ in parts["tables"]:
            assert f"<h3>{caption}</h3>" in page
        if parts["trigrams"] is not None:
            assert f'id="{fig.id}-trigrams"' in page
    assert len(re.findall(r'id="chart-F\d+-\d+"', page)) == sum(
        len(figure_parts(f)["charts"]) for f in TourView.model_validate(body).figures if f.data is not None
    )
