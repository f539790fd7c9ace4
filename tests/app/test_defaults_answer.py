"""No refusal at default settings, and every price refusal says how to get an answer.

- Every sidebar page and every analysis endpoint of every shipped model (and of SmolLM2 as a bare GGUF folder, when
  fetched) answers 200 with its default parameters; a long one answers 202 with a job, which is followed until the
  answer is there (tests.app.conftest.until_done). Path parameters take the model's heads that matter.
- Each kind of price refusal (working memory, answer size, time) carries `advice` {parameter, at_most}; asking again
  with that parameter lowered so answers. A refusal of the model itself (broken weights, an unsupported folder) is
  another problem type, without advice.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.routers.page_inputs import DEFAULT_PROMPT
from app.settings import Limits, Settings
from tests.app.conftest import until_done

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "smollm2-135m"
ROTARY_ONLY = ("/positional", "/bands", "/qk-copying", "/profile")


def sidebar(app: Any, n_layers: int, attn_only: bool = False) -> list[str]:
    """The model's navigation (navigation.model_nav): every labelled model page that applies to its layers (and, on
    an attention-only model, does not read an MLP)."""
    prefix = "/models/{model}"
    return [
        p.route[len(prefix) :]
        for p in app.state.pages
        if p.label is not None
        and p.route.startswith(prefix)
        and "{" not in p.route[len(prefix) :]
        and n_layers >= p.analysis.needs_layers
        and not (attn_only and p.analysis.needs_mlp)
    ]


def endpoints(app: Any, model: str, view: dict[str, Any]) -> list[str]:
    """Every declared analysis endpoint of the model that applies to its layers, path parameters filled with its heads
    that matter."""
    n_layers = 1 + max((h["layer"] for h in view["heads"]), default=-1)
    prev = view.get("previous_token_head") or "L0H0"
    induction = view.get("induction_head") or prev
    fill = {
        "{model}": model,
        "{head}": induction,
        "{source}": prev,
        "{target}": induction,
        "{writer}": "embed",
        "{reader}": f"{induction}.V",
    }
    # required inputs (the API has no default for them): a text (the pages' default prompt), the chain's heads,
    # the QK-paths head
    text = {"prompt": quote(DEFAULT_PROMPT)}
    required = {
        "/tokenize": text,
        "/prompt": text,
        "/paths": text,
        "/path": {"heads": prev, **text},
        "/qk-paths": {"head": induction, **text},
    }
    out = []
    for analysis in app.state.analyses.analyses:
        path = analysis.api_path
        if analysis.scope != "model" or n_layers < analysis.needs_layers:
            continue  # a view the model's navigation leaves out: it needs more layers than the model has
        if (n_layers == 0 and "{" in path.removeprefix("/api/v1/models/{model}/")) or (
            n_layers < 2 and "{source}" in path
        ):
            continue  # no head to name, or no pair of layers
        for k, v in fill.items():
            path = path.replace(k, v)
        query = next((q for end, q in required.items() if path.endswith(end)), {})
        out.append(path + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else ""))
    return out


def walk(c: TestClient, app: Any, model: str) -> None:
    view = until_done(c, f"/api/v1/models/{model}/heads").json()
    rotary = any(h.get("kernel_peak_offset") is not None for h in view["heads"])
    n_layers = 1 + max((h["layer"] for h in view["heads"]), default=-1)
    attn_only = app.state.registry.get(model).model.cfg.attn_only
    failures = []
    page = c.get(f"/models/{model}").text
    for p in app.state.pages:  # an attention-only model's navigation leaves the views of MLPs out, saying why
        if p.label is not None and p.analysis.needs_mlp:
            link = 'href="' + p.route.replace("{model}", model) + '"'
            assert (link not in page and "attention-only (no MLPs)" in page) if attn_only else link in page
    for sub in sidebar(app, n_layers, attn_only):
        r = until_done(c, f"/models/{model}{sub}")
        if r.status_code != 200:
            failures.append((f"/models/{model}{sub}", r.status_code, r.text[:300]))
    for url in endpoints(app, model, view):
        if not rotary and any(url.split("?")[0].endswith(s) for s in ROTARY_ONLY):
            continue  # rotary views: a model with learned positions has no rotation to show
        r = until_done(c, url)
        if attn_only and r.status_code == 422 and "attention-only" in r.json()["detail"]:
            continue  # a view of MLPs on a model without one: refused, saying why
        if r.status_code != 200:
            failures.append((url, r.status_code, r.text[:300]))
    assert not failures, failures


@pytest.mark.parametrize("model", ["toy-0l", "toy-1l", "toy-2l", "toy-alibi-2l"])
def test_every_page_and_endpoint_of_a_shipped_model_answers_with_its_defaults(model: str) -> None:
    app = create_app(Settings(store_url="off", models_dir=None))
    with TestClient(app) as c:
        walk(c, app, model)


@pytest.mark.slow
@pytest.mark.skipif(not list(SMOLLM2.glob("*.gguf")), reason="SmolLM2-135M not fetched (make smollm2)")
def test_every_page_and_endpoint_of_smollm2_answers_with_its_defaults(tmp_path: Path) -> None:
    bare = tmp_path / "models" / "smollm2-135m"
    bare.mkdir(parents=True)
    for gguf in SMOLLM2.glob("*.gguf"):
        shutil.copy(gguf, bare / gguf.name)
    app = create_app(Settings(store_url="off", models_dir=tmp_path / "models"))
    with TestClient(app) as c:
        walk(c, app, "smollm2-135m")


# -- refusals and their advice ----------------------------------------------------------------------------------
def follow(c: TestClient, url: str, params: dict[str, Any]) -> dict[str, Any]:
    """A price refusal (422, limit-exceeded) with advice; the advice followed answers (after its job, if one)."""
    refused = c.get(url, params=params)
    assert refused.status_code == 422, refused.text
    body = refused.json()
    assert body["type"] == "urn:qkov:problem:limit-exceeded" and "advice" in body, body
    advice = body["advice"]
    assert advice["parameter"] in body["detail"] and str(advice["at_most"]) in body["detail"]
    assert advice["at_most"] < int(params.get(advice["parameter"], 10**12))
    lowered = {**params, advice["parameter"]: advice["at_most"]}
    answered = until_done(c, url + "?" + "&".join(f"{k}={v}" for k, v in lowered.items()))
    assert answered.status_code == 200, answered.text
    return advice


CASES = {
    "time over the job budget": (
        {"compute_flops_per_s": 2e7, "job_budget_s": 60.0, "inline_budget_s": 1.0},
        "/api/v1/models/toy-2l/copying",
        {"rows": 4096},
    ),
    "working memory": (
        {"limits": Limits(peak_bytes=3 * 2**20)},
        "/api/v1/models/toy-2l/detectors",
        {"seq_len": 60, "batch": 32},
    ),
    "answer size": (
        {"limits": Limits(max_answer_bytes=8 * 1024)},
        "/api/v1/models/toy-2l/heads/L1H2/ov",
        {"k": 200},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_kind_of_price_refusal_says_what_to_lower_and_that_gives_an_answer(case: str) -> None:
    update, url, params = CASES[case]
    app = create_app(Settings(store_url="off", models_dir=None).model_copy(update=update))
    with TestClient(app) as c:
        follow(c, url, params)


def test_a_refusal_of_the_model_is_another_kind(settings: Settings) -> None:
    """A folder that cannot be loaded (missing weights) is refused as a model, not as a request's price: no advice."""
    with TestClient(create_app(settings.model_copy(update={"store_url": "off"}))) as c:
        r = c.get("/api/v1/models/broken/heads")
        body = r.json()
        assert r.status_code == 422 and body["type"] == "urn:qkov:problem:model-cannot-be-loaded"
        assert "advice" not in body and re.search("W_K|missing", body["detail"])


@pytest.mark.slow
@pytest.mark.skipif(not list(SMOLLM2.glob("*.gguf")), reason="SmolLM2-135M not fetched (make smollm2)")
def test_copying_every_row_of_smollm2_is_refused_before_it_runs(tmp_path: Path) -> None:
    """reported: /copying?rows=10000000 on a 49k vocabulary (every row of 270 heads' [V, V] circuits, ~87 TFLOP)
    is a 422 priced before it runs, whose advice (rows at most N) then runs as a job; nothing was computed for it."""
    bare = tmp_path / "models" / "smollm2-135m"
    bare.mkdir(parents=True)
    for gguf in SMOLLM2.glob("*.gguf"):
        shutil.copy(gguf, bare / gguf.name)
    app = create_app(Settings(store_url="off", models_dir=tmp_path / "models"))
    with TestClient(app) as c:
        assert c.get("/api/v1/models/smollm2-135m").status_code == 200  # loaded
        refused = c.get("/api/v1/models/smollm2-135m/copying", params={"rows": 10_000_000})
        body = refused.json()
        assert refused.status_code == 422 and body["advice"]["parameter"] == "rows", body
        assert "job_budget_s" in body["detail"] and app.state.compute.stats.completed == 0
        lowered = c.get("/api/v1/models/smollm2-135m/copying", params={"rows": body["advice"]["at_most"]})
        assert lowered.status_code == 202 and lowered.json()["estimate_s"] <= 600  # admitted: a job within its budget
