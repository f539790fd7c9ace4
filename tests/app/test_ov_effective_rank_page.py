"""OV effective rank per head (app/views/ov_effective_rank.py): the API's answer against the engine, the page."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from circuits_core.circuits.ov_effective_rank import ov_effective_ranks
from circuits_core.formats.checkpoint import LoadedModel


def test_api_answer_is_the_engines(client: TestClient, tiny: LoadedModel) -> None:
    answer = client.get("/api/v1/models/tiny-2l/ov-effective-rank")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = ov_effective_ranks(tiny.model).tolist()  # [L][H], dense-checked in tests/core
    assert body["group_size"] == 1 and body["d_head"] == tiny.model.cfg.d_head
    assert len(body["ranks"]) == 2 and len(body["ranks"][0]) == 4
    for got, want in zip(body["ranks"], expected, strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_page_shows_the_numbers_and_is_in_the_navigation(client: TestClient, tiny: LoadedModel) -> None:
    page = client.get("/models/tiny-2l/ov-effective-rank")
    assert page.status_code == 200
    table = page.text.split('<table class="data">', 1)[1].split("</table>", 1)[0]
    for layer, row in enumerate(ov_effective_ranks(tiny.model).tolist()):  # every head's number, in its row
        for head, value in enumerate(row):
            assert re.search(rf'/heads/L{layer}H{head}"[^<]*</a></td><td[^>]*>{value:.4f}<', table), (layer, head)
    assert 'href="/models/tiny-2l/heads/L1H3"' in page.text and "data-plotly" in page.text
    assert 'href="/models/tiny-2l/ov-effective-rank"' in client.get("/models/tiny-2l").text


def test_unknown_model_is_a_404(client: TestClient) -> None:
    assert client.get("/api/v1/models/no-such-model/ov-effective-rank").status_code == 404
