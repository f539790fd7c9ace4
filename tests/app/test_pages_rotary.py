"""Rotary parts of the pages: the head page's offset control, positional kernel and band energies,
the pair page's δ profiles, the composition page at an offset; absent for models without rotary positions."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from tests.app.test_api_rotary import client, folders, rope  # noqa: F401  (module fixtures)

API = "/api/v1/models"


def charts_in(html: str) -> dict[str, dict]:
    """The plotly figures of a page by their data-name."""
    found = re.findall(r'data-name="([^"]+)">\s*<script type="application/json">(.*?)</script>', html, re.S)
    return {name: json.loads(body) for name, body in found}


def test_head_page_of_a_rotary_model(client: TestClient):  # noqa: F811
    page = client.get("/models/rope/heads/L1H3", params={"offset": 3, "k": 5})
    assert page.status_code == 200, page.text
    html = page.text
    assert 'id="offset-input"' in html and 'value="3"' in html and 'max="95"' in html
    assert "QK: query attends to key at δ = 3" in html
    figs = charts_in(html)
    kernel = figs["rope-L1H3-positional-kernel"]["data"][0]
    api = client.get(f"{API}/rope/heads/L1H3/positional").json()
    assert kernel["x"] == api["offsets"] and kernel["y"] == api["kernel"]
    bands = figs["rope-L1H3-rotary-bands"]["data"][0]
    assert (bands.get("y") or bands.get("x")) == client.get(f"{API}/rope/heads/L1H3/bands").json()["share"]
    qk = client.get(f"{API}/rope/heads/L1H3/qk", params={"offset": 3, "k": 5}).json()
    first = qk["entries"][0]
    assert f"{first['value']:.3f}".rstrip("0") in html or f"{first['value']:.4f}" in html
    assert "offset=3" in html  # token links keep the offset
    api_qk = client.get(f"{API}/rope/heads/L1H3/qk-copying", params={"offset": 3}).json()
    curve, eig = figs["rope-L1H3-qk-copying-offsets"]["data"][0], figs["rope-L1H3-qk-eigenvalues-offset"]["data"][-1]
    assert curve["x"] == api_qk["offsets"] and curve["y"] == api_qk["scores"]
    assert eig["x"] == [z["re"] for z in api_qk["eigenvalues"]] and eig["y"] == [z["im"] for z in api_qk["eigenvalues"]]
    assert f"{api_qk['score']:+.3f} at δ = 3" in html and 'id="qk-copying-offset"' in html


def test_pair_and_composition_pages_of_a_rotary_model(client: TestClient):  # noqa: F811
    html = client.get("/models/rope/composition/L0H1/L2H2").text
    fig = charts_in(html)["rope-L0H1-L2H2-profile"]
    series = {d["name"]: d["y"] for d in fig["data"]}
    api = client.get(f"{API}/rope/composition/L0H1/L2H2/profile", params={"kind": "K"}).json()
    assert series["K-composition"] == api["scores"] and series["random baseline"][0] == api["baseline"]
    assert f"offset={api['peak_offset']}" in html
    comp = client.get("/models/rope/composition", params={"kind": "K", "offset": 4})
    assert comp.status_code == 200 and "at offset δ = 4" in comp.text and 'id="offset-input"' in comp.text


def test_pages_of_a_model_without_rotary_positions(client: TestClient):  # noqa: F811
    html = client.get("/models/short/heads/L1H0").text
    assert "offset-input" not in html and "Positional kernel" not in html and "QK eigenvalue copying over δ" not in html
    assert "Composition over the offset" not in client.get("/models/short/composition/L0H0/L1H1").text
    assert client.get("/models/short/heads/L1H0", params={"offset": 2}).status_code == 422


def _reading(scores: list[float], offsets: list[int], n_ctx: int) -> str:
    """What the page must say of a profile, worked out here from its numbers: flat under 5 % spread, the edge of
    the range when the maximum is in the last 5 % of an open window, else the peak."""
    hi, lo = max(scores), min(scores)
    if (hi - lo) / max(abs(hi), abs(lo)) < 0.05:
        return "flat"
    at = offsets[scores.index(hi)]
    last = offsets[-1]
    if last < n_ctx - 1 and at >= last - int(0.05 * len(offsets)):
        return "edge of the range"
    return f"at δ = {at}"


def test_pair_page_reads_each_profile(client: TestClient):  # noqa: F811
    """The pair page's note says 'flat' / 'edge of the range' / the peak as the profile's numbers demand (it said
    'K peak 0.162 at δ=64' of a flat profile)."""
    n_ctx = client.get(f"{API}/rope").json()["n_ctx"]
    for source, target in (("L0H1", "L2H2"), ("L0H0", "L1H1"), ("L1H2", "L2H0")):
        html = client.get(f"/models/rope/composition/{source}/{target}").text
        note = re.search(r'id="profile-shapes">(.*?)</span>', html, re.S).group(1)
        for kind in ("K", "Q"):
            api = client.get(f"{API}/rope/composition/{source}/{target}/profile", params={"kind": kind}).json()
            part = re.split(r"\s·\s", note.split(f"{kind}-composition ")[1])[0]
            expected = _reading(api["scores"], api["offsets"], n_ctx)
            assert expected in part, (kind, part, expected)
            assert api["shape"]["summary"] == part.strip()
    for max_offset in (4, 40):  # a short open window whose kernel can end high, and a longer one
        api = client.get(f"{API}/rope/heads/L1H3/positional", params={"max_offset": max_offset}).json()
        assert _reading(api["kernel"], api["offsets"], n_ctx) in api["shape"]["summary"]


def test_pair_profile_snippet(client: TestClient):  # noqa: F811
    """The pair page's "copy as Python" snippet, run as a notebook would, gives the K profile of its JSON twin."""
    from tests.app.test_snippets import run, snippets_in

    page = client.get("/models/rope/composition/L0H1/L2H2").text
    result = run(snippets_in(page)["profile-python"])
    api = client.get(f"{API}/rope/composition/L0H1/L2H2/profile", params={"kind": "K"}).json()
    assert result["scores"] == pytest.approx(api["scores"], abs=1e-9)


def test_heads_table_flags_kernel_peaks_at_the_window_edge(client: TestClient):  # noqa: F811
    """The kernel peak column says 'edge' exactly for peaks in the last 5 % of the δ ≤ 64 window (61-64), which
    the overview showed as plain peaks."""
    heads = client.get(f"{API}/rope/heads").json()["heads"]
    table = client.get("/models/rope").text.split('id="heads-table"', 1)[1].split("</table>", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r'<tr><td data-value="(L\d+H\d+)">(.*?)</tr>', table, re.S)}
    assert set(rows) == {h["head"] for h in heads}
    for h in heads:
        assert ("kernel-edge" in rows[h["head"]]) == (h["kernel_peak_offset"] >= 61), h


@pytest.mark.parametrize(
    ("analysis", "query"),
    [
        ("rotary-bands", {}),
        ("rotary-bands", {"basis": "raw"}),
        ("positional", {}),
        ("positional", {"basis": "raw"}),
        ("qk-copying-offset", {}),
        ("qk-copying-offset", {"offset": "5"}),
        ("qk", {"offset": "3"}),  # the QK table at δ = 3
        ("qk", {"offset": "3", "token": "7"}),
        ("skip-trigrams", {"offset": "2"}),  # destinations from the QK column at δ = 2
    ],
    ids=str,
)
def test_rotary_head_snippets(client: TestClient, analysis: str, query: dict[str, str]):  # noqa: F811
    """The rotary head page's declared snippets, run as a notebook would, give the numbers of their JSON twins."""
    from tests.app.test_snippets import json_twin, run, same, snippets_in

    page = client.get("/models/rope/heads/L1H3", params=query)
    assert page.status_code == 200, page.text
    result = run(snippets_in(page.text)[f"{analysis}-python"])
    answer = client.get(json_twin(page.text, analysis, "rope")).json()
    assert result and set(result) <= set(answer)
    same(result, answer)
