"""'Copy as Python': every snippet a page offers is run as a notebook would run it (its own process state: a
fresh namespace, the model loaded from the folder by the snippet) and its `result` compared with the numbers of
the panel's JSON twin."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

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
    "query", [{}, {"token": "5"}, {"basis": "raw"}, {"token": "5", "k": "7", "basis": "raw"}], ids=str
)
def test_ov_table_snippet(client: TestClient, query: dict[str, str]) -> None:
    """The head page's OV table (global top-k, or a token's row; served or raw weights) against its JSON twin."""
    page = client.get("/models/tiny-2l/heads/L1H2", params=query).text
    result = run(snippets_in(page)["ov-python"])
    api = client.get(f"{API}/tiny-2l/heads/L1H2/ov", params={"k": 10, **query}).json()
    want = [(e["row"]["id"], e["col"]["id"], e["value"]) for e in api["entries"]]
    assert [(r, c) for r, c, _ in result["entries"]] == [(r, c) for r, c, _ in want]
    assert [v for _, _, v in result["entries"]] == pytest.approx([v for _, _, v in want], abs=1e-9)


def test_every_offered_snippet_is_tested(client: TestClient) -> None:
    """The pages above are the only ones offering a snippet on this model (a new one needs a test here)."""
    import inspect

    from app import snippets

    offered = {
        name
        for name, fn in inspect.getmembers(snippets, inspect.isfunction)
        if fn.__module__ == snippets.__name__ and not name.startswith("_")
    }
    # composition_profile: tests/app/test_pages_rotary.py (a rotary model)
    assert offered == {"composition", "qk_score_terms", "logit_paths", "composition_profile", "detectors", "ov_table"}
