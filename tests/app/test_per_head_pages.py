"""Every analysis of one number per head (app/views/shared/per_head.py), walked from the catalog: its API answer
against its engine function run here on the same checkpoint (each engine function is checked against a dense or
brute-force float64 computation in tests/core), the page's table showing every head's number in its row, its
navigation entry, and the shape check a wrong engine function meets."""

from __future__ import annotations

import re

import pytest
import torch
from fastapi.testclient import TestClient

from app.catalog import ANALYSES
from app.page_spec import PerHeadPage
from app.params import NoParams
from app.settings import Limits
from app.views.shared.per_head import PerHeadAnalysis, per_head_analysis
from circuits_core.circuits import qk_circuit_norm
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.transformer import Transformer

PER_HEAD = [a for a in ANALYSES if isinstance(a, PerHeadAnalysis)]


def test_the_per_head_analyses_are_found() -> None:
    assert {"qk-circuit-norm", "ov-effective-rank"} <= {a.name for a in PER_HEAD}


@pytest.mark.parametrize("analysis", PER_HEAD, ids=lambda a: a.name)
@pytest.mark.parametrize("model", ["tiny-2l", "tiny-ln"])
def test_api_answer_is_the_engines(
    client: TestClient, tiny: LoadedModel, tiny_ln: LoadedModel, analysis: PerHeadAnalysis, model: str
) -> None:
    loaded = tiny if model == "tiny-2l" else tiny_ln  # the served checkpoint, loaded here by the engine (float64)
    answer = client.get(f"/api/v1/models/{model}/{analysis.path}")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    cfg = loaded.model.cfg
    assert (body["d_head"], body["group_size"], body["model"]["id"]) == (cfg.d_head, cfg.group_size, model)
    expected = analysis.values(loaded.model).tolist()  # [L][H]
    assert len(body[analysis.field]) == cfg.n_layers and {len(r) for r in body[analysis.field]} == {cfg.n_heads}
    for got, want in zip(body[analysis.field], expected, strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("analysis", PER_HEAD, ids=lambda a: a.name)
def test_page_shows_every_heads_number_and_is_in_the_navigation(
    client: TestClient, tiny: LoadedModel, analysis: PerHeadAnalysis
) -> None:
    page = client.get(f"/models/tiny-2l/{analysis.path}")
    assert page.status_code == 200
    table = page.text.split('<table class="data">', 1)[1].split("</table>", 1)[0]
    assert isinstance(analysis.page, PerHeadPage)
    digits = analysis.page.digits
    for layer, row in enumerate(analysis.values(tiny.model).tolist()):  # every head's number, in its row
        for head, value in enumerate(row):
            shown = f"{value:.{digits}f}"
            assert re.search(rf'/heads/L{layer}H{head}"[^<]*</a></td><td[^>]*>{shown}<', table), (layer, head)
    assert 'href="/models/tiny-2l/heads/L1H3"' in page.text and "data-plotly" in page.text
    assert f'href="/models/tiny-2l/{analysis.path}"' in client.get("/models/tiny-2l").text
    assert client.get(f"/api/v1/models/no-such-model/{analysis.path}").status_code == 404


def test_an_engine_function_of_the_wrong_shape_is_refused(tiny: LoadedModel) -> None:
    def per_layer(model: Transformer) -> torch.Tensor:
        return qk_circuit_norm.qk_circuit_norms(model).sum(-1)  # [L]: not one number per head

    wrong = per_head_analysis(
        per_layer,
        qk_circuit_norm.cost,
        name="w",
        field="w",
        summary="s",
        title="W",
        quantity="q",
        explanation="e",
        nav=None,
    )
    with pytest.raises(ValueError, match=r"gave \(2,\), not \[n_layers, n_heads\]"):
        wrong.build(tiny, NoParams(), Limits())
