"""Every analysis of the API, and every dashboard page that has one, answers on Gemma-3 270M (make gemma3).

The walk takes the catalog (app/catalog.py: every declared analysis, in the order of the API docs), fills each
route's required parameters with a local and a global head of the model (L4H0, L5H0), a prompt for the analyses that
read one, and asks for the JSON and for the page at the same path without /api/v1 (when the app serves one). Each
answers 200 with the model's id in it, or 202 (a polled job: its estimate from the engine's FLOP price is over the
inline budget; a page's job in its data-job), or 422 with `advice` (a parameter that, lowered, runs it); never a 5xx.
The walk runs with an inline budget of 0.05 s, so every analysis priced above it answers 202 and is left to stop
unpolled: the walk checks that each is routed, priced and started on the model, and completes only the quick ones (the
full computations of the 262k-token vocabulary take minutes each on two cores). Before it, every analysis but
tokenising is checked to carry a FLOP price on this model, and an inline answer must come within INLINE_WALL_S: an
unpriced computation over the vocabulary (which took 40-110 s here) would run inline and fail it. The model page lists
the values the GGUF file does not carry, with their sources, and the QK views name the form their numbers are in
(qk_forms.QK_FORMS), in the JSON and in the panel of their page. The app's page routes sit behind its included routers
(FastAPI 0.16x), so the walk finds them with conftest.get_routes; `app.routes` alone lists none of them, and the page
half of the walk went unasked.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.catalog import ANALYSES
from app.main import create_app
from app.settings import Settings
from app.tour.gemma3 import GEMMA3_MODEL
from circuits_core.formats.gguf import GEMMA3_SOURCES
from tests.app.conftest import get_routes, until_done

FOLDER = Path(__file__).resolve().parents[2] / "models" / GEMMA3_MODEL
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gemma3")]
FILL = {
    "head": "L5H0",
    "source": "L4H0",
    "target": "L5H0",
    "heads": "L4H0,L5H0",
    "writer": "embed",
    "reader": "unembed",
}
PROMPT = "When Mary and John went to the store, John gave a drink to"


INLINE_WALL_S = 30.0  # an inline answer (priced under 0.05 s) on two loaded cores, page rendering included
FREE = {"tokenize"}  # no tensor work: its price is its answer


@pytest.fixture(scope="module")
def client() -> Any:
    if not any(FOLDER.glob("*.gguf")):
        pytest.fail(f"{FOLDER} has no GGUF: run `make gemma3` (`make test` runs it first)")
    folder = FOLDER.parent.resolve()
    settings = Settings(models_dir=folder, store_url="off", request_timeout_s=600, inline_budget_s=0.05)  # type: ignore[call-arg]
    with TestClient(create_app(settings)) as c:
        c.app.state.registry.get(GEMMA3_MODEL)  # type: ignore[attr-defined]  # loaded once, outside the timed calls
        yield c
    # The jobs the walk left unpolled were told to stop when the app's lifespan ended (ComputeService.stop_all): wait
    # for their worker threads (each stops at its next step), so that no computation outlives the module.
    c.app.state.compute._executor.shutdown(wait=True)  # type: ignore[attr-defined]


def _calls() -> list[tuple[str, str, dict[str, str]]]:
    out = []
    for analysis in ANALYSES:
        if analysis.scope != "model":
            continue
        path = analysis.api_path.replace("{model}", GEMMA3_MODEL)
        query: dict[str, str] = {}
        for name, field in analysis.params.model_fields.items():
            if "{" + name + "}" in path:
                path = path.replace("{" + name + "}", FILL[name])
            elif field.is_required():
                query[name] = FILL[name]
            elif name == "prompt":
                query[name] = PROMPT
        out.append((analysis.name, path, query))
    return out


def test_every_analysis_is_priced_in_flops(client: TestClient) -> None:
    """Each analysis's default request (the walk's) prices its arithmetic on this model: a FLOP count from the engine,
    which the scheduler turns into inline, job or refusal (tokenising, which does no tensor work, aside)."""
    app = client.app
    loaded = app.state.registry.get(GEMMA3_MODEL)  # type: ignore[attr-defined]
    limits = app.state.settings.limits  # type: ignore[attr-defined]
    unpriced = []
    for analysis in app.state.analyses.analyses:  # type: ignore[attr-defined]
        if analysis.scope != "model" or analysis.name in FREE:
            continue
        raw = {
            n: FILL[n]
            for n, f in analysis.params.model_fields.items()
            if "{" + n + "}" in analysis.path or f.is_required()
        }
        raw |= {"prompt": PROMPT} if "prompt" in analysis.params.model_fields else {}  # as the walk asks
        params = app.state.analyses.bound(analysis).model_validate(raw).normalised(loaded)  # type: ignore[attr-defined]
        if analysis.priced(loaded, params, limits).flops <= 0:
            unpriced.append(analysis.name)
    assert not unpriced, f"analyses without a FLOP price on {GEMMA3_MODEL}: {unpriced}"


def _answers(client: TestClient, url: str, query: dict[str, str], name: str, page: bool) -> None:
    start = time.monotonic()
    r = client.get(url, params=query)
    took = time.monotonic() - start
    said = (name, url, r.status_code, round(took, 1), r.text[:400])
    assert r.status_code in (200, 202, 422), said
    if r.status_code == 422:  # refused for its price, with the parameter that makes it run
        assert (" or less (" in r.text) if page else r.json().get("advice"), said
    elif r.status_code == 202 and not page:  # a job, estimated by its price over the inline budget
        assert r.json()["estimate_s"] > 0.05 and r.json()["status_url"], said
    elif r.status_code == 200:
        assert took < INLINE_WALL_S, said
    if page and r.status_code == 202:  # the page of a job, which polls it (its id in data-job)
        assert re.search(r'data-job="[0-9a-f]+"', r.text), said
    elif page and r.status_code != 422:
        assert GEMMA3_MODEL in r.text, said


@pytest.mark.parametrize(("name", "path", "query"), _calls(), ids=[c[0] for c in _calls()])
def test_every_analysis_answers(client: TestClient, name: str, path: str, query: dict[str, str]) -> None:
    _answers(client, path, query, name, page=False)
    page = _page(client, path)
    if page is not None:
        _answers(client, page, query, name, page=True)


def _page(client: TestClient, api_path: str) -> str | None:
    """The dashboard page at the API path without /api/v1, None when the app serves no page there."""
    page = api_path.removeprefix("/api/v1").split("?")[0]
    served = {path for path, _ in get_routes(client.app) if not path.startswith("/api/")}  # type: ignore[arg-type]
    return page if any(_matches(t, page) for t in served) else None


def _matches(template: str, path: str) -> bool:
    a, b = template.strip("/").split("/"), path.strip("/").split("/")
    return len(a) == len(b) and all(x == y or x.startswith("{") for x, y in zip(a, b, strict=True))


def test_the_model_page_names_the_defaulted_values(client: TestClient) -> None:
    summary = client.get(f"/api/v1/models/{GEMMA3_MODEL}").json()  # (the listing shows it once loaded: 5 s at most)
    assert {d["field"] for d in summary["defaulted"]} == set(GEMMA3_SOURCES)
    page = client.get(f"/models/{GEMMA3_MODEL}")
    assert page.status_code in (200, 202) and 'id="defaulted-values"' in page.text
    for field, source in GEMMA3_SOURCES.items():
        assert field in page.text and source.split(";")[0].split("(")[0].strip() in page.text


def test_each_qk_number_names_its_form(client: TestClient) -> None:
    m = f"/api/v1/models/{GEMMA3_MODEL}"
    forms = {  # url: (its form, whether the dashboard draws it as a page of its own)
        f"{m}/heads/L5H1/qk": ("cosine", False),
        f"{m}/qk-paths?head=L5H1&prompt=The+cat+sat+on+the+mat.+The+cat": ("frozen-norm", True),
        f"{m}/composition?kind=K": ("bilinear", True),
    }
    for url, (form, has_page) in forms.items():
        r = until_done(client, url)  # a long one runs as a job first
        assert r.status_code == 200 and r.json()["qk_form"] == form, (url, r.text[:300])
        assert (_page(client, url) is not None) == has_page, url
        if has_page:  # its panel, as htmx fetches it (a page priced over a moment comes as a frame first)
            page = until_done(client, url.removeprefix("/api/v1"), headers={"HX-Request": "true"})
            assert page.status_code == 200 and f"QK form: {form}" in page.text, url
