"""The shipped ALiBi toy (checkpoints/toy-alibi-2l) is served as `make run` serves it, beside the other toys from the
shipped folder, with its card; its heads' positional kernel, asked of the API, is a content constant minus m_h δ with
BLOOM's slopes (transformers' own function). tests/app/test_defaults_answer.py walks its every page and endpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
NAME = "toy-alibi-2l"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    torch.set_num_threads(1)
    with TestClient(create_app(Settings(store_url="off", models_dir=None))) as c:
        yield c


def test_listed_beside_the_other_toys_with_its_card(client: TestClient) -> None:
    assert {"toy-0l", "toy-1l", "toy-2l", NAME} <= {m["id"] for m in client.get("/api/v1/models").json()}
    toy = client.get(f"/api/v1/models/{NAME}").json()
    assert toy["shipped"] and toy["positional_embedding_type"] == "none"
    assert toy["card"]["alibi"]["rule"] == "bloom" and toy["card"]["name"] == NAME


@pytest.mark.parametrize("layer", [0, 1])
def test_positional_kernel_of_every_head_is_linear_with_blooms_slope(client: TestClient, layer: int) -> None:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    slopes = _get_alibi_slopes(8, torch.device("cpu"))
    for h in range(8):
        body = client.get(f"/api/v1/models/{NAME}/heads/L{layer}H{h}/positional", params={"max_offset": 8}).json()
        steps = [b - a for a, b in zip(body["kernel"], body["kernel"][1:], strict=False)]
        assert steps == pytest.approx([-float(slopes[h])] * 8, abs=1e-6) and body["peak_offset"] == 0
        assert "ALiBi" in body["basis"]


def test_positivity_answers_naming_its_partner_by_score_below_a_previous_token_head(client: TestClient) -> None:
    """The card's partner (the K-composition partner of its induction head) is the strongest layer-0 previous-token
    scorer, and its score on the standard input, the card's, is below model_summary's 0.4: the positivity view still
    answers at its defaults, reading that head, and the overview's scatter names it by its score, not as a
    previous-token head."""
    import json

    from circuits_core.prompt.model_summary import HEAD_THRESHOLD

    card = json.loads((CHECKPOINTS / NAME / "model_card.json").read_text())["phenomena"]
    partner, score = card["k_composition_partner"], card["partner_previous_token_score"]
    assert score == pytest.approx(max(card["previous_token_scores"][0]), abs=1e-4) and score < HEAD_THRESHOLD
    r = client.get(f"/api/v1/models/{NAME}/positivity")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["previous_token_head"] == partner and body["previous_token_score"] == pytest.approx(score, abs=1e-4)
    assert {p["head"] for p in body["points"]} == {f"L1H{h}" for h in range(8)}
    page = client.get(f"/models/{NAME}").text
    assert f"{partner} (previous-token score {score:.2f}, below the {HEAD_THRESHOLD} that names" in page
    assert f"previous-token head {partner}" not in page
