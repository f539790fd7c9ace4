"""'Copy as Python': every snippet a page offers is run as a notebook would run it (its own process state: a
fresh namespace, the model loaded from the folder by the snippet) and its `result` compared with the numbers of
the panel's JSON twin."""

from __future__ import annotations

import html
import math
import re
import subprocess
import sys
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.catalog import ANALYSES
from app.settings import REPO_ROOT
from app.views.shared.per_head import PerHeadAnalysis
from tests.app.snippet_runner import run, snippets_in

API = "/api/v1/models"


def test_composition_snippet(client: TestClient) -> None:
    page = client.get("/models/tiny-2l/composition", params={"kind": "K"}).text
    result = run(snippets_in(page)["composition-python"])
    api = client.get(f"{API}/tiny-2l/composition", params={"kind": "K"}).json()
    top = api["top_pairs"][0]
    assert result["top_pair"][:2] == (top["source"], top["target"])
    assert result["top_pair"][2] == pytest.approx(top["score"], abs=1e-9)
    assert result["baseline"] == pytest.approx(api["baseline"], abs=1e-12)


def test_paths_snippet(client: TestClient) -> None:
    prompt, position = "the cat sat on the mat", 4
    page = client.get("/models/tiny-2l/prompt", params={"prompt": prompt, "position": position}).text
    result = run(snippets_in(page)["paths-python"])
    api = client.get(f"{API}/tiny-2l/paths", params={"prompt": prompt, "position": position}).json()
    assert result["value"] == pytest.approx(api["value"], abs=1e-9)
    assert result["order_totals"] == pytest.approx(api["order_totals"], abs=1e-9)


def test_qk_terms_snippet(client: TestClient) -> None:
    params = {"prompt": "the cat sat on the mat", "head": "L1H1", "query": 5, "key": 3}
    page = client.get("/models/tiny-2l/qk-paths", params=params).text
    result = run(snippets_in(page)["qk-terms-python"])
    at = client.get(f"{API}/tiny-2l/qk-paths", params=params).json()["at"]
    assert result["score"] == pytest.approx(at["score"], abs=1e-9)
    assert result["attention"] == pytest.approx(at["attention"], abs=1e-9)
    assert [(q, k) for q, k, _ in result["terms"]] == [(t["query"], t["key"]) for t in at["terms"]]
    assert [v for _, _, v in result["terms"]] == pytest.approx([t["value"] for t in at["terms"]], abs=1e-9)


def test_detectors_snippet(client: TestClient) -> None:
    params = {"seq_len": 12, "batch": 3, "seed": 4}
    page = client.get("/models/tiny-2l/detectors", params=params).text
    result = run(snippets_in(page)["detectors-python"])
    api = client.get(f"{API}/tiny-2l/detectors", params=params).json()
    for h in api["heads"]:
        for key in ("induction", "previous_token", "duplicate_token", "current_token", "first_token"):
            assert result[key][h["head"]] == pytest.approx(h[key], abs=1e-9), (h["head"], key)


@pytest.mark.parametrize(
    ("model", "head", "query"),
    [
        ("tiny-2l", "L1H2", {}),
        ("tiny-2l", "L1H2", {"token": "5"}),
        # the LayerNorm model, where the served (folded) weights differ from the raw ones
        ("tiny-ln", "L0H1", {}),
        ("tiny-ln", "L0H1", {"basis": "raw"}),
        ("tiny-ln", "L0H1", {"token": "5", "k": "7", "basis": "raw"}),
    ],
    ids=str,
)
def test_ov_table_snippet(client: TestClient, model: str, head: str, query: dict[str, str]) -> None:
    """The head page's OV table (global top-k, or a token's row; served or raw weights) against its JSON twin."""
    page = client.get(f"/models/{model}/heads/{head}", params=query).text
    result = run(snippets_in(page)["ov-python"])
    api = client.get(f"{API}/{model}/heads/{head}/ov", params={"k": 10, **query}).json()
    want = [(e["row"]["id"], e["col"]["id"], e["value"]) for e in api["entries"]]
    assert [(r, c) for r, c, _ in result["entries"]] == [(r, c) for r, c, _ in want]
    assert [v for _, _, v in result["entries"]] == pytest.approx([v for _, _, v in want], abs=1e-9)


def test_every_offered_snippet_is_tested(client: TestClient) -> None:
    """The snippets a page's context builds (the functions of app/snippets/pages.py): each has its test above, or
    composition_profile's in tests/app/test_pages_rotary.py (a rotary model)."""
    import inspect

    from app.snippets import pages

    offered = {
        name
        for name, fn in inspect.getmembers(pages, inspect.isfunction)
        if fn.__module__ == pages.__name__ and not name.startswith("_")
    }
    assert offered == {"composition", "qk_score_terms", "logit_paths", "composition_profile", "detectors", "ov_table"}


# -- declared snippets (Analysis.snippet): every page that runs the analysis offers it --------------------------
PROMPT = "the cat sat on the mat"
# analysis name -> the pages (path, query) whose panel offers its snippet; the JSON twin is the page's own JSON link
DECLARED: dict[str, list[tuple[str, dict[str, str]]]] = {
    "heads": [("/models/tiny-2l", {})],
    "head": [("/models/tiny-2l/heads/L1H2", {})],
    "qk": [  # the query side's table (the first QK JSON link of the head page)
        ("/models/tiny-2l/heads/L1H2", {}),
        ("/models/tiny-2l/heads/L1H2", {"token": "5"}),
        ("/models/tiny-2l/heads/L0H1", {"min_count": "1", "k": "7"}),
        ("/models/tiny-ln/heads/L0H1", {"token": "5", "basis": "raw"}),
    ],
    "skip-trigrams": [
        ("/models/tiny-2l/heads/L1H2", {}),  # the source: the largest OV entry's
        ("/models/tiny-2l/heads/L1H2", {"token": "5", "k": "4"}),
        ("/models/tiny-ln/heads/L0H1", {"basis": "raw"}),
    ],
    "direct": [
        ("/models/tiny-2l/direct", {}),  # the frequent tokens (tiny-2l has training counts)
        ("/models/tiny-2l/direct", {"min_count": "all", "k": "7"}),
        ("/models/tiny-2l/direct", {"token": "5"}),
        ("/models/tiny-ln/direct", {"basis": "raw"}),
    ],
    "term-importance": [("/models/tiny-2l/term-importance", {"prompt": PROMPT})],
    "attention-entropy": [("/models/tiny-2l/attention-entropy", {"prompt": PROMPT})],
    "path": [
        ("/models/tiny-2l/path", {"prompt": PROMPT, "heads": "L0H1,L1H2"}),
        ("/models/tiny-2l/path", {"prompt": PROMPT, "heads": "L1H3", "target": "cat"}),
    ],
    "residual": [
        ("/models/tiny-2l/residual", {}),
        ("/models/tiny-ln/residual", {}),  # LayerNorm folded: the processed weights differ from the raw
        ("/models/tiny-ln/residual", {"basis": "raw"}),
    ],
    "residual-pair": [
        ("/models/tiny-2l/residual/embed/unembed", {"k": "3", "n_top": "4"}),  # tokens -> tokens
        ("/models/tiny-2l/residual/L0H1/L1H0.K", {}),  # d_model sides, read through W_E
        ("/models/tiny-2l/residual/L0H1/L1H2.V", {}),  # a value output read through W_U
        ("/models/tiny-ln/residual/L0H1/unembed", {"basis": "raw"}),
    ],
    "copying-all": [
        ("/models/tiny-2l/copying", {}),
        ("/models/tiny-2l/copying", {"rows": "20", "k": "3"}),  # a sample of source rows, drawn with seed 0
        ("/models/tiny-2l/copying", {"heads": "L1H2"}),  # the head page's panel
        ("/models/tiny-ln/copying", {}),
    ],
    "residual-usage": [
        ("/models/tiny-2l/residual/usage", {}),
        ("/models/tiny-2l/residual/usage", {"energy": "0.6", "writers_from": "2", "writers_shown": "3"}),
        ("/models/tiny-ln/residual/usage", {"basis": "raw"}),  # the JSON link keeps the page's basis
    ],
    "composition-pair": [("/models/tiny-2l/composition/L0H1/L1H2", {}), ("/models/tiny-2l/composition/L0H3/L1H0", {})],
    "prompt": [
        ("/models/tiny-2l/prompt", {"prompt": PROMPT, "heads": "L1H2,L0H3"}),
        ("/models/tiny-2l/prompt", {"prompt": PROMPT, "heads": "L1H1", "weighted": "true"}),
    ],
    # one number per head (app/views/shared/per_head.py): each snippet is its engine function's own call
    **{a.name: [(f"/models/tiny-2l/{a.path}", {})] for a in ANALYSES if isinstance(a, PerHeadAnalysis)},
}
# declared snippets tested on a model these fixtures lack: analysis -> the test file
DECLARED_ELSEWHERE = {
    "rotary-bands": "tests/app/test_pages_rotary.py",  # a rotary model
    "qk-copying-offset": "tests/app/test_pages_rotary.py",
    "positional": "tests/app/test_pages_rotary.py",
    "expert-ov": "tests/app/test_residual.py",  # a model with MLPs
    "positivity": "test_positivity_snippet below",  # the shipped toy-2l: the scatter needs an induction head
}
# snippets a page's context builds from what it knows (tested above, or in test_pages_rotary.py)
CONTEXT_BUILT = {"composition", "qk-paths", "paths", "detectors", "ov", "composition-profile"}
NOT_PANELS = {
    "tokenize": "token ids of a text: no numbers of the model",
    "tour": "the paper's figures, each drawn from analyses with pages of their own",
    "copying": "API only: one head's copying metrics (pages show copying-all's)",
    "summary": "API only: the overview's measured card is read off the heads table, whose snippet gives its scores",
}
# panels that offer no "copy as Python" yet, and why: the list only shrinks (a new analysis must offer one)
WITHOUT_SNIPPET: dict[str, str] = {}  # analysis -> why (empty: every panel offers one)


def test_every_analysis_offers_a_snippet_or_is_listed() -> None:
    """Enumerated from the registry (app/catalog.py ANALYSES): an analysis declaring a snippet has a test below; every
    other is a context-built snippet, not a panel, or in WITHOUT_SNIPPET. A new analysis without a snippet fails."""
    declared = {a.name for a in ANALYSES if a.snippet is not None}
    assert declared == set(DECLARED) | set(DECLARED_ELSEWHERE)
    rest = {a.name for a in ANALYSES} - declared
    assert rest == CONTEXT_BUILT | set(NOT_PANELS) | set(WITHOUT_SNIPPET)
    assert not (CONTEXT_BUILT & set(WITHOUT_SNIPPET)) and not (CONTEXT_BUILT & declared)


def same(got: Any, want: Any, where: str = "result") -> None:
    """`got` (the snippet's numbers) equals `want` (the JSON) wherever `got` has a value: dict keys of `got`, lists
    item by item, numbers to 1e-9 (NaN where the JSON has null)."""
    if isinstance(got, dict):
        assert isinstance(want, dict), where
        for key, value in got.items():
            assert key in want, f"{where}.{key} is not in the JSON"
            same(value, want[key], f"{where}.{key}")
    elif isinstance(got, list | tuple):
        assert isinstance(want, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{where}[{i}]")
    elif isinstance(got, float) and math.isnan(got):
        assert want is None or (isinstance(want, float) and math.isnan(want)), where
    elif isinstance(got, bool | str) or got is None:
        assert got == want, where
    else:
        assert want == pytest.approx(got, abs=1e-9), where


def json_twin(page: str, analysis: str, model: str) -> str:
    """The page's JSON link to the analysis's answer (the page's own, or its panel's)."""
    route = next(a for a in ANALYSES if a.name == analysis).api_path.replace("{model}", model)
    pattern = re.sub(r"\\\{\w+\\\}", "[^/?]+", re.escape(route))
    links = [html.unescape(h) for h in re.findall(r'href="(/api/v1/[^"]+)"', page)]
    found = [h for h in links if re.fullmatch(pattern, h.split("?")[0])]
    assert found, f"no JSON link to {route} on the page"
    return found[0]


@pytest.mark.parametrize(
    ("analysis", "path", "query"),
    [(name, path, query) for name, pages in DECLARED.items() for path, query in pages],
    ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()),
)
def test_declared_snippet_reproduces_its_json_twin(
    client: TestClient, analysis: str, path: str, query: dict[str, str]
) -> None:
    """The page's snippet of the analysis, run in a fresh namespace, gives the numbers of the analysis's JSON answer
    for the same request (the page's JSON link, or the analysis's own route with the page's params)."""
    page = client.get(path, params=query)
    assert page.status_code == 200, page.text
    code = snippets_in(page.text).get(f"{analysis}-python")
    assert code is not None, f"{path} offers no snippet of {analysis}"
    result = run(code)
    answer = client.get(json_twin(page.text, analysis, path.split("/")[2])).json()
    assert result and set(result) <= set(answer)
    same(result, answer)


def test_positivity_snippet() -> None:
    """The overview's scatter (drawn only on a model with an induction head: the shipped, trained toy-2l), its
    snippet run as a notebook would, against the positivity JSON the panel links."""
    from pathlib import Path

    from app.main import create_app
    from app.settings import Settings

    shipped = Path(__file__).resolve().parents[2] / "checkpoints"
    if not (shipped / "toy-2l").exists():
        pytest.skip("the shipped checkpoints are not in this tree")
    settings = Settings(shipped_dir=shipped, models_dir=None, store_url="off", dtype="float64")
    with TestClient(create_app(settings)) as client:
        page = client.get("/models/toy-2l")
        assert page.status_code == 200 and "positivity-scatter" in page.text
        result = run(snippets_in(page.text)["positivity-python"])
        answer = client.get(json_twin(page.text, "positivity", "toy-2l")).json()
    assert result["points"] and set(result) <= set(answer)
    same(result, answer)


def test_composition_snippet_leaves_sympy_unimported(client: TestClient) -> None:
    """A notebook's first composition snippet does not pay for torch's symbolic shapes (torch.unravel_index's
    torch._check imports torch.fx and sympy, ~500 modules, on its first call): run in a fresh interpreter."""
    page = client.get("/models/tiny-2l/composition", params={"kind": "K"}).text
    code = snippets_in(page)["composition-python"] + "import sys\nprint('sympy' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False"
