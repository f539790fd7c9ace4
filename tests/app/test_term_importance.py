"""Term importance in the app: which heads are ablated (`heads`), their numbers against weight-edited models, the
default per model size, and the time price (FLOPs against the request deadline) refusing before anything runs."""

from __future__ import annotations

import copy
import html
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Frozen
from circuits_core.prompt import ablation
from tests.app.conftest import LIMITS, assert_problem, save_qkov, train_tokenizer, until_done

API = "/api/v1/models/tiny-2l/term-importance"
PROMPT = "the cat sat on the mat"
MiB = 2**20


@pytest.fixture(scope="module")
def app_client(settings: Settings):
    with TestClient(
        create_app(settings.model_copy(update={"limits": LIMITS.model_copy(update={"matrix_budget_bytes": 16 * MiB})}))
    ) as c:
        yield c


def _ce(logits: torch.Tensor, ids: list[int]) -> float:
    return float(F.cross_entropy(logits[0, :-1], torch.tensor(ids[1:])))


def zeroed(loaded: LoadedModel, ids: list[int], layer: int, h: int) -> tuple[float, float]:
    """(patterns frozen, later patterns recomputed) loss change of the model with W_O[h] of `layer` zeroed, by full
    forward passes of a weight-edited copy (nothing from ablation.py)."""
    seq = torch.tensor([ids])
    clean_logits, cache = loaded.model.run(seq, names=lambda n: n.endswith("hook_pattern"))
    other = copy.deepcopy(loaded.model)
    with torch.no_grad():
        other.blocks[layer].attn.W_O[h] = 0
    clean = _ce(clean_logits, ids)
    return _ce(other.run(seq, frozen=Frozen(cache))[0], ids) - clean, _ce(other.run(seq)[0], ids) - clean


def test_the_heads_asked_are_ablated_in_layer_order(app_client: TestClient, tiny: LoadedModel) -> None:
    response = app_client.get(API, params={"prompt": PROMPT, "heads": "L01H2, l0"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["heads_asked"] == "L1H2,L0"  # canonical: L1H2, and every head of layer 0
    assert [h["head"] for h in body["heads"]] == ["L0H0", "L0H1", "L0H2", "L0H3", "L1H2"]
    assert body["heads_note"].startswith("The 5 of 8 heads asked for")
    ids = [t["id"] for t in body["tokens"]]
    for row in body["heads"]:
        layer, h = int(row["head"][1]), int(row["head"][3])
        frozen, recomputed = zeroed(tiny, ids, layer, h)
        assert row["loss_change"] == pytest.approx(frozen, abs=1e-9)
        assert row["loss_change_recomputed"] == pytest.approx(recomputed, abs=1e-9)
    layer0 = [h["loss_change"] - h["loss_change_recomputed"] for h in body["heads"][:4]]
    assert max(abs(x) for x in layer0) > 1e-4  # the two ablations differ where later patterns can change
    every = app_client.get(API, params={"prompt": PROMPT, "heads": "ALL"}).json()
    assert every["heads_asked"] == "all" and len(every["heads"]) == 8
    assert every["loss_by_order"] == body["loss_by_order"]  # the order reruns do not depend on the heads
    none = app_client.get(API, params={"prompt": PROMPT, "heads": "none"}).json()
    assert none["heads"] == [] and none["loss_by_order"] == body["loss_by_order"]


def test_default_is_every_head_of_a_small_model(app_client: TestClient) -> None:
    body = app_client.get(API, params={"prompt": PROMPT}).json()
    assert body["heads_asked"] == "default" and body["heads_note"] == "Every head (8)." and len(body["heads"]) == 8
    assert body["all_heads_gflop"] > 0


def test_bad_selections_are_refused(app_client: TestClient) -> None:
    assert_problem(app_client.get(API, params={"heads": "L2"}), 404, "layer 2", "2 layers")
    assert_problem(app_client.get(API, params={"heads": "L1-L0"}), 422, "backwards")
    assert_problem(app_client.get(API, params={"heads": "L0H9"}), 404, "out of range")
    assert_problem(app_client.get(API, params={"heads": "cats"}), 422, "L<layer>H<head>")
    assert_problem(app_client.get(API, params={"heads": "all,L1"}), 422, "'all' stands alone")
    assert_problem(app_client.get(API, params={"heads": "L0," * 40}), 422)  # over max_length (max_heads x 12)
    schema = app_client.get("/openapi.json").json()["paths"]["/api/v1/models/{model}/term-importance"]["get"]
    field = next(p for p in schema["parameters"] if p["name"] == "heads")
    assert "server limit" in field["description"] and "deadline" in field["description"]


def test_the_time_price_refuses_before_running(settings: Settings, tiny: LoadedModel) -> None:
    """With a compute rate that puts every head over the job budget and no head under it, heads=all is refused (422
    naming the FLOPs, job_budget_s and `heads`) and heads=none answers: the price is the engine's FLOP count, compared
    before a slot."""
    n = len(tiny.tokenizer.encode(PROMPT, prepend_bos=True))
    every, none = ablation.cost(tiny.model, n).flops, ablation.cost(tiny.model, n, heads=[]).flops
    assert every > 2 * none
    budget = 50.0
    rate = (every + none) / 2 / budget
    limits = LIMITS.model_copy(update={"matrix_budget_bytes": 16 * MiB})
    changed = {"limits": limits, "compute_flops_per_s": rate, "job_budget_s": budget, "inline_budget_s": budget}
    with TestClient(create_app(settings.model_copy(update=changed))) as c:
        refused = assert_problem(
            c.get(API, params={"prompt": PROMPT, "heads": "all"}), 422, "job_budget_s", "heads", "GFLOP"
        )
        said = re.search(r"would take about (\d+) s \(([\d.,]+) GFLOP", refused["detail"])
        assert said is not None and float(said[2].replace(",", "")) == pytest.approx(every / 1e9, abs=0.5)
        assert int(said[1]) == round(every / rate)
        assert c.get(API, params={"prompt": PROMPT, "heads": "none"}).status_code == 200


def test_a_long_custom_prompt_runs_as_a_job(settings: Settings, app_client: TestClient) -> None:
    """A prompt of the reader's own priced over the inline budget (and under the job budget) is not refused for the
    request deadline: it answers 202 with a job to poll, and the job's answer is the one the same request gets
    inline on a server where it fits."""
    inline = app_client.get(API, params={"prompt": PROMPT, "heads": "all"})
    assert inline.status_code == 200, inline.text
    limits = LIMITS.model_copy(update={"matrix_budget_bytes": 16 * MiB})
    slow = {"limits": limits, "compute_flops_per_s": 1.0, "inline_budget_s": 1.0, "job_budget_s": 1e12}
    with TestClient(create_app(settings.model_copy(update={**slow, "request_timeout_s": 1.0}))) as c:
        first = c.get(API, params={"prompt": PROMPT, "heads": "all"})
        assert first.status_code == 202 and first.json()["id"], first.text
        done = until_done(c, API, params={"prompt": PROMPT, "heads": "all"})
        assert done.status_code == 200, done.text
        assert done.json()["heads"] == inline.json()["heads"]
        assert done.json()["loss_by_order"] == inline.json()["loss_by_order"]


def test_default_on_a_model_of_many_heads_without_a_summary(tmp_path_factory: pytest.TempPathFactory) -> None:
    """More than 64 heads and no model_summary.json: the default removes the heads the model's summary names, computed
    from its own scores on first use -- the heads that matter (those every page starts from) and every head scoring
    at least 0.4 as an induction or previous-token head. The rule is applied here by brute force to detector scores
    computed here; the losses are checked against weight-edited forward passes."""
    from circuits_core.prompt.detectors import detector_scores, repeated_random_tokens

    root: Path = tmp_path_factory.mktemp("many-heads")
    tok = train_tokenizer()
    cfg = ModelConfig(
        n_layers=9,
        d_model=16,
        n_heads=8,
        d_head=2,
        d_vocab=tok.get_vocab_size(),
        n_ctx=32,
        positional_embedding_type="shortformer",
    )
    save_qkov(root / "many", cfg, tok, seed=7)
    assert not (root / "many" / "model_summary.json").exists()
    with TestClient(create_app(Settings(shipped_dir=root, dtype="float64", store_url="off", limits=LIMITS))) as c:
        body = c.get("/api/v1/models/many/term-importance", params={"prompt": PROMPT}).json()
        table = c.get("/api/v1/models/many/heads").json()
        summary = c.get("/api/v1/models/many/summary").json()
        prompt_page = html.unescape(c.get("/models/many/prompt", params={"prompt": PROMPT}).text)
        asked = c.get("/api/v1/models/many/term-importance", params={"prompt": PROMPT, "heads": "L8"}).json()
        page = c.get("/models/many/term-importance", params={"prompt": PROMPT}).text

    loaded = load_checkpoint(root / "many", dtype=torch.float64)
    inp = table["detector_input"]
    tokens = repeated_random_tokens(cfg.d_vocab, inp["seq_len"], inp["batch"], seed=inp["seed"], bos=inp["bos"])
    with torch.no_grad():
        scores = detector_scores(loaded.model, tokens)
    ind, prev = scores["induction"].double(), scores["previous_token"].double()  # [L, H]
    # the rule, by brute force: the strongest induction head of layers >= 1, the strongest previous-token head before
    best = max((float(ind[la, h]), la, h) for la in range(1, 9) for h in range(8))
    feeding = max((float(prev[la, h]), la, h) for la in range(best[1]) for h in range(8))
    matter = {f"L{feeding[1]}H{feeding[2]}", f"L{best[1]}H{best[2]}"}
    strong = {f"L{la}H{h}" for la in range(9) for h in range(8) if max(ind[la, h], prev[la, h]) >= 0.4}
    want = sorted(matter | strong, key=lambda n: tuple(int(x) for x in n[1:].split("H")))
    assert body["heads_asked"] == "default" and [h["head"] for h in body["heads"]] == want
    # the same heads everywhere: the summary's, and the heads the prompt page opens on
    assert {summary["previous_token_head"], summary["induction_head"]} == matter
    assert {h["head"] for h in summary["induction_heads"] + summary["previous_token_heads"]} == strong
    assert f"L{feeding[1]}H{feeding[2]}" in body["heads_note"] and f"L{best[1]}H{best[2]}" in body["heads_note"]
    assert body["heads_note"].startswith(f"The {len(want)} of 72 heads that the model's summary names")
    ids = [t["id"] for t in body["tokens"]]
    for row in body["heads"]:
        layer, h = (int(x) for x in row["head"][1:].split("H"))
        frozen, recomputed = zeroed(loaded, ids, layer, h)
        assert row["loss_change"] == pytest.approx(frozen, abs=1e-9)
        assert row["loss_change_recomputed"] == pytest.approx(recomputed, abs=1e-9)
    assert len(body["loss_by_order"]) == 10
    assert [h["head"] for h in asked["heads"]] == [f"L8H{h}" for h in range(8)]
    note = html.unescape(re.search(r'id="ablated-heads">(.*?)</p>', page, re.S)[1])  # type: ignore[index]
    assert body["heads_note"] in note and f"{body['all_heads_gflop']:,.0f} GFLOP" in note
    assert f"/models/many/heads/{want[0]}" in page  # the charts and the table list the heads
    assert body["all_heads_gflop"] == pytest.approx(ablation.cost(loaded.model, len(body["tokens"])).flops / 1e9)
    opened = re.search(r'name="heads" value="([^"]*)"', prompt_page)
    assert opened is not None and set(opened[1].split(",")) == matter, "the prompt page starts from the same heads"


def test_the_page_keeps_the_selection(app_client: TestClient) -> None:
    page = app_client.get("/models/tiny-2l/term-importance", params={"heads": "L1"}).text
    assert 'name="heads" size="24" value="L1"' in page
    assert "The 4 of 8 heads asked for (heads=L1)." in html.unescape(page)
    assert "heads=L1" in page  # the JSON twin link carries it
