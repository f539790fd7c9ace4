"""The table of shipped models (docs/models.md) states measured facts; each must equal its model card (which
tests/core/test_shipped_models.py checks against an independent re-measurement), so the docs cannot drift."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS_DOC = REPO / "docs" / "models.md"


def row(model: str) -> str:
    text = MODELS_DOC.read_text()
    match = re.search(rf"^\| `{model}` \|.*$", text, re.M)
    assert match is not None, f"docs/models.md has no row for {model}"
    return match[0]


def card(model: str) -> dict:  # type: ignore[type-arg]
    return json.loads((REPO / "checkpoints" / model / "model_card.json").read_text())["phenomena"]  # type: ignore[no-any-return]


def test_toy_0l_row() -> None:
    r, c = row("toy-0l"), card("toy-0l")
    assert f"KL to validation bigrams {c['kl_ratio']:.2f} of the unigram KL" in r
    assert f"top-1 agreement {c['top1_agreement']:.2f}" in r


def test_toy_1l_row() -> None:
    r, c = row("toy-1l"), card("toy-1l")
    scores = [s for layer in c["ov_copying_scores"] for s in layer]
    assert f"{sum(s > 0 for s in scores)}/{len(scores)} heads with positive OV eigenvalue copying score" in r
    best = c["skip_trigrams"]["examples"][0]
    assert f"`{best['source']} … {best['destination']} → {best['boosted']}`" in r


def test_toy_2l_row() -> None:
    r, c = row("toy-2l"), card("toy-2l")
    assert f"induction head {c['induction_head']} (score {c['induction_score']:.2f})" in r
    assert f"previous-token head {c['k_composition_partner']} ({c['partner_previous_token_score']:.2f})" in r
    assert f"repeat loss {c['rep1_loss']:.2f} → {c['rep2_loss']:.2f} nats" in r
    input_ = c["detector_input"]
    assert (
        f"BOS + {input_['seq_len']} uniform random tokens repeated twice, {input_['batch']} sequences, seed "
        f"{input_['seed']}" in MODELS_DOC.read_text()
    )


def test_toy_alibi_2l_row() -> None:
    r, c = row("toy-alibi-2l"), card("toy-alibi-2l")
    alibi = json.loads((REPO / "checkpoints" / "toy-alibi-2l" / "model_card.json").read_text())["alibi"]
    slope = {0.5: "1/2", 0.25: "1/4"}.get(alibi["partner_slope"], f"{alibi['partner_slope']:g}")
    assert f"induction head {c['induction_head']} (score {c['induction_score']:.2f})" in r
    partner = (
        f"{c['k_composition_partner']} (slope {slope}, previous-token score {c['partner_previous_token_score']:.2f})"
    )
    assert f"K-composes with {partner}" in r
    assert f"repeat loss {c['rep1_loss']:.2f} → {c['rep2_loss']:.2f} nats" in r


def test_toy_alibi_2l_paragraph() -> None:
    """docs/models.md's sentences on how toy-alibi-2l was made, against its recipe and card and toy-2l's card (the
    positivity view's label is tested in tests/app/test_shipped_alibi_toy.py)."""
    from circuits_core.training.recipes import RECIPES

    text = " ".join(MODELS_DOC.read_text().split())
    full = json.loads((REPO / "checkpoints" / "toy-alibi-2l" / "model_card.json").read_text())
    recipe, slopes = full["recipe"], full["alibi"]["slopes"]
    assert "it starts from toy-2l's weights, with the previous-token head moved to the steepest slope" in text
    assert recipe["init_from"] == "toy-2l" and recipe["alibi"] == "bloom"
    base = card("toy-2l")
    moved = {
        int(base["k_composition_partner"][3:]): recipe["init_heads"][0].index(int(base["k_composition_partner"][3:])),
        int(base["induction_head"][3:]): recipe["init_heads"][1].index(int(base["induction_head"][3:])),
    }
    partner, induction = moved.values()
    assert slopes[partner] == max(slopes) and slopes[induction] == min(slopes)
    assert "half its rows (on average) repeated random tokens" in text and recipe["repeat_frac"] == 0.5
    assert "`make models` trains it after toy-2l" in text
    assert list(RECIPES).index("toy-2l") < list(RECIPES).index("toy-alibi-2l")
    assert (
        "its previous-token score is far below toy-2l's, and the positivity view names it by that score rather than "
        "as a previous-token head"
    ) in text
    assert card("toy-alibi-2l")["partner_previous_token_score"] < 0.5 * base["partner_previous_token_score"]
