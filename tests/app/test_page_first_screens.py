"""What a page shows before anything is chosen, on the shipped models: control characters in tokens are drawn
visibly, the prompt / chain / QK-path pages start on the previous-token and induction heads, the model card is a
readable card (thresholds table, training curve, raw history folded away)."""

from __future__ import annotations

import html
import json
import re

import pytest
from fastapi.testclient import TestClient

from app.labels import visible
from app.main import create_app
from app.settings import REPO_ROOT, Settings

M = "tiny-2l"


@pytest.mark.parametrize("code", [*range(0x00, 0x21), *range(0x7F, 0xA1)])
def test_every_control_character_is_drawn_visibly(code: int) -> None:
    shown = visible(chr(code))
    assert shown and shown.isprintable() and not shown.isspace(), (code, shown)
    assert visible("a" + chr(code) + "b").startswith("a") and visible("a" + chr(code) + "b").endswith("b")


def heads_input(page: str, panel: str) -> str:
    block = page[page.index(f'id="{panel}"') :]
    match = re.search(r'name="(?:heads|head)" value="([^"]*)"', block)
    assert match, block[:2000]
    return html.unescape(match.group(1))


def test_pages_start_on_the_previous_token_and_induction_heads(client: TestClient) -> None:
    heads = client.get(f"/api/v1/models/{M}/heads").json()["heads"]
    prev = max((h for h in heads if h["layer"] == 0), key=lambda h: h["previous_token"])["head"]
    last = max(h["layer"] for h in heads)
    induction = max((h for h in heads if h["layer"] == last), key=lambda h: h["induction"])["head"]
    r = client.get(f"/models/{M}/prompt", params={"prompt": "the cat sat on the mat"})
    assert r.status_code == 200, r.text
    assert heads_input(r.text, "patterns_panel") == f"{prev},{induction}"
    r = client.get(f"/models/{M}/path", params={"prompt": "the cat"})
    assert heads_input(r.text, "chain_panel") == f"{prev},{induction}"
    r = client.get(f"/models/{M}/qk-paths", params={"prompt": "the cat"})  # a refusal (budget) keeps its form too
    assert heads_input(r.text, "qk_panel") == induction


@pytest.fixture(scope="module")
def shipped() -> TestClient:
    if not (REPO_ROOT / "checkpoints" / "toy-2l" / "model_card.json").exists():
        pytest.skip("the shipped checkpoints are not in this tree")
    with TestClient(create_app(Settings(shipped_dir=REPO_ROOT / "checkpoints"))) as c:
        yield c


def test_model_card_is_a_card_not_a_json_dump(shipped: TestClient) -> None:
    card = json.loads((REPO_ROOT / "checkpoints" / "toy-2l" / "model_card.json").read_text())
    r = shipped.get("/models/toy-2l")
    assert r.status_code == 200
    table = r.text[r.text.index('id="card-thresholds"') :]
    table = table[: table.index("</table>")]
    assert table.count("<tr>") == 1 + len(card["thresholds"])
    assert table.count("✓") == sum(1 for t in card["thresholds"].values() if t["met"])
    curve = [
        json.loads(s)
        for s in re.findall(
            r'data-name="toy-2l-training-curve">\s*<script type="application/json">(.*?)</script>', r.text, re.S
        )
    ]
    assert len(curve) == 1
    series = {t["name"]: t for t in curve[0]["data"]}
    assert series["train loss"]["x"] == [h["step"] for h in card["history"]]
    assert series["validation loss"]["y"] == [h["val_loss"] for h in card["history"]]
    history = r.text[r.text.index("<summary>history") :]
    assert history.index("</details>") > history.index('{"step"'), "the raw history is folded in its <details>"
