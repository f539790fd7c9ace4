"""Term importance on the real SmolLM2-135M (30 layers x 9 heads, GQA, rotary, gated MLPs), served with the default
settings: the default answer arrives (priced under the deadline), heads=all is refused before it runs, and the page's
sentences hold on the real numbers, recomputed here by weight-edited forward passes (nothing from ablation.py)."""

from __future__ import annotations

import copy
import html
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.app.conftest import until_done

FOLDER = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"
SUMMARY = FOLDER / "model_summary.json"
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]


@pytest.fixture(scope="module")
def served() -> Iterator[Any]:
    """The app with default settings (deadline, compute rate, limits) serving the fetched SmolLM2."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    if not SUMMARY.exists():
        pytest.skip("SmolLM2-135M not fetched (make smollm2)")
    with TestClient(create_app(Settings(store_url="off", models_dir=FOLDER.parent))) as c:
        yield c


def _loss(logits: torch.Tensor, ids: list[int]) -> float:
    return float(F.cross_entropy(logits[0, :-1].double(), torch.tensor(ids[1:])))


def test_smollm2_default_term_importance_and_its_sentences(served: Any) -> None:
    from app.settings import Settings
    from circuits_core.formats.checkpoint import load_checkpoint
    from circuits_core.model.head_names import parse_head
    from circuits_core.model.transformer import Frozen
    from circuits_core.prompt import ablation

    response = until_done(served, "/api/v1/models/smollm2-135m/term-importance")  # a job on this model
    assert response.status_code == 200, response.text
    body = response.json()
    # the heads the summary names: those model_summary.json lists (measured by `make smollm2` on the same standard
    # input) and the heads that matter of the computed summary, the heads every page starts from
    summary = json.loads(SUMMARY.read_text())
    computed = until_done(served, "/api/v1/models/smollm2-135m/summary").json()
    named = {h["head"] for key in ("induction_heads", "previous_token_heads") for h in summary[key]}
    named |= {computed["induction_head"], computed["previous_token_head"]}
    assert body["heads_asked"] == "default" and {h["head"] for h in body["heads"]} == named
    assert body["heads_note"].startswith(f"The {len(named)} of 270 heads that the model's summary names")
    ids = [t["id"] for t in body["tokens"]]

    # every head is priced over the inline budget but under the job budget: it becomes a polled job, not an answer
    # within the request (the default heads answer inline) and not a refusal
    loaded = load_checkpoint(FOLDER)
    model = loaded.model
    settings = Settings()
    every = ablation.cost(model, len(ids)).flops
    chosen = ablation.cost(model, len(ids), heads=[parse_head(h, model.cfg) for h in named]).flops
    assert settings.job_budget_s > every / settings.compute_flops_per_s > settings.inline_budget_s
    queued = served.get("/api/v1/models/smollm2-135m/term-importance", params={"heads": "all"})
    assert queued.status_code == 202 and "/api/v1/jobs/" in queued.json()["status_url"], queued.text
    assert chosen < every
    assert body["all_heads_gflop"] == pytest.approx(every / 1e9)

    # the sentence names the previous-token head of the heads that matter (the heads table's, a job of its own here)
    assert until_done(served, "/api/v1/models/smollm2-135m/heads").status_code == 200
    page = html.unescape(until_done(served, "/models/smollm2-135m/term-importance").text)
    note = re.search(r'id="ablated-heads">(.*?)</p>', page, re.S)
    assert note is not None and body["heads_note"] in note[1] and f"{every / 1e9:,.0f} GFLOP" in note[1]
    claim = re.search(
        r'id="ablation-claim">Here, removing the previous-token head L(\d+)H(\d+) changes the loss by '
        r"([+-]\d+\.\d+) nats with every other pattern frozen and by ([+-]\d+\.\d+) with the later patterns "
        r"recomputed\.</p>",
        page,
    )
    assert claim is not None, page[page.find("sum-check") :][:600]
    layer, h = int(claim[1]), int(claim[2])
    prev, ind = summary["previous_token_scores"], summary["induction_scores"]
    # the heads that matter, by brute force: the strongest induction head of layers >= 1, the strongest
    # previous-token head of the layers before it
    strongest = max(
        ((lay, hh) for lay in range(1, len(ind)) for hh in range(len(ind[lay]))), key=lambda x: ind[x[0]][x[1]]
    )
    best = max(
        ((lay, hh) for lay in range(strongest[0]) for hh in range(len(prev[lay]))), key=lambda x: prev[x[0]][x[1]]
    )
    assert (layer, h) == best and prev[layer][h] >= summary["head_threshold"]  # a previous-token head, the one feeding
    seq = torch.tensor([ids])
    with torch.no_grad():
        clean_logits, cache = model.run(seq, names=lambda n: n.endswith("hook_pattern"))
        edited = copy.deepcopy(model)
        edited.blocks[layer].attn.W_O[h] = 0
        clean = _loss(clean_logits, ids)
        frozen = _loss(edited.run(seq, frozen=Frozen(cache))[0], ids) - clean
        recomputed = _loss(edited.run(seq)[0], ids) - clean
    assert float(claim[3]) == pytest.approx(frozen, abs=6e-4) and float(claim[4]) == pytest.approx(recomputed, abs=6e-4)
    row = next(r for r in body["heads"] if r["head"] == f"L{layer}H{h}")
    assert row["loss_change"] == pytest.approx(frozen, abs=2e-5)
    assert row["loss_change_recomputed"] == pytest.approx(recomputed, abs=2e-5)
    assert abs(recomputed - frozen) > 5e-3  # the two ablations tell different stories here (composition acts)
