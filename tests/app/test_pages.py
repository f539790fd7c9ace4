"""HTML pages: full renders link their JSON twin, htmx requests get only the swapped block, Vary is sent,
errors land in the panel, and token / prompt text is escaped everywhere (tiny random models of conftest)."""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.analysis import Analysis
from app.catalog import ANALYSES
from app.main import create_app
from app.settings import Settings
from circuits_core.model.config import ModelConfig
from circuits_core.prompt.phenomena import MIN_TRAIN_COUNT, TOKEN_COUNTS_FILE
from tests.app.conftest import LIMITS, save_qkov, train_tokenizer

M = "tiny-2l"
# (page URL, the id of the element its pickers swap)
PAGES = [
    ("/", "main"),
    (f"/models/{M}", "heads_panel"),
    (f"/models/{M}?score=ov_copying", "heads_panel"),
    (f"/models/{M}/heads/L1H2", "circuits"),
    (f"/models/{M}/heads/L1H2?token=5&k=7", "circuits"),
    (f"/models/{M}/direct", "direct_panel"),
    (f"/models/{M}/direct?token=7&k=5", "direct_panel"),
    (f"/models/{M}/detectors?seq_len=8&batch=2", "detectors_panel"),
    (f"/models/{M}/detectors?prompt=the+cat+sat+on+the+mat", "detectors_panel"),
    (f"/models/{M}/composition", "composition_panel"),
    (f"/models/{M}/composition?kind=V", "composition_panel"),
    (f"/models/{M}/composition/L0H1/L1H2?k=5", "pair_panel"),
    (f"/models/{M}/prompt?prompt=the+cat+sat+on+the+mat&position=3", "paths_panel"),
    (f"/models/{M}/prompt?prompt=the+cat+sat&heads=L1H0,L0H2&weighted=true", "patterns_panel"),
    (f"/models/{M}/prompt?prompt=the+cat+sat", "prompt_main"),
    (f"/models/{M}/paths?prompt=the+cat+sat&max_order=1", "paths_panel"),
    (f"/models/{M}/path?heads=L0H1,L1H2&prompt=the+cat+sat", "chain_panel"),
    (f"/models/{M}/qk-paths?head=L1H2&prompt=the+cat+sat", "qk_panel"),
    (f"/models/{M}/term-importance?prompt=the+cat+sat", "ti_panel"),
    ("/tour", "main"),
]
# The pages analyses declare (their `page=`) at their own path, without path parameters: the family walks
# (test_families_app.py, test_deepseek_app.py) ask for them beside PAGES, so a new declared page is walked there too.
DECLARED_PAGES = [
    f"/models/{M}/{a.path}" for a in ANALYSES if isinstance(a, Analysis) and a.page is not None and "{" not in a.path
]
ALTERNATE = re.compile(r'<link rel="alternate" type="application/json" href="([^"]+)">')


class Ids(HTMLParser):
    """Collects element ids and the text of application/json scripts."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.json_scripts: list[str] = []
        self._in_json = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.append(str(a["id"]))
        self._in_json = tag == "script" and a.get("type") == "application/json"

    def handle_endtag(self, tag: str) -> None:
        self._in_json = False

    def handle_data(self, data: str) -> None:
        if self._in_json:
            self.json_scripts.append(data)


def parse(html: str) -> Ids:
    p = Ids()
    p.feed(html)
    return p


@pytest.mark.parametrize("path,target", PAGES)
def test_full_page_links_its_json_twin(client: TestClient, path: str, target: str) -> None:
    r = client.get(path)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/html")
    assert "HX-Request" in r.headers["vary"]
    assert r.text.lstrip().lower().startswith("<!doctype html>")
    found = ALTERNATE.search(r.text)
    assert found, "no <link rel=alternate type=application/json>"
    twin = found.group(1).replace("&amp;", "&")
    assert f'href="{found.group(1)}"' in r.text.split("</head>", 1)[1], "no visible link to the JSON twin"
    answer = client.get(twin)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/json"), twin
    ids = parse(r.text)
    assert target in ids.ids
    for script in ids.json_scripts:  # every chart's figure is valid JSON with data
        fig = json.loads(script)
        assert isinstance(fig["data"], list) and fig["data"]


@pytest.mark.parametrize("path,target", PAGES)
def test_htmx_request_gets_only_the_block(client: TestClient, path: str, target: str) -> None:
    r = client.get(path, headers={"HX-Request": "true", "HX-Target": target})
    assert r.status_code == 200, r.text
    assert "HX-Request" in r.headers["vary"]
    assert "<html" not in r.text and "<head>" not in r.text and 'class="topbar"' not in r.text
    ids = parse(r.text)
    if target != "main":
        assert ids.ids[0] == target, "the fragment must be the swapped element itself (hx-swap=outerHTML)"
    full = client.get(path).text
    assert r.text.strip() in full, "the fragment is the same markup as the block of the full page"


def test_history_restore_and_boosted_requests_get_the_full_page(client: TestClient) -> None:
    for extra in ({"HX-History-Restore-Request": "true"}, {"HX-Boosted": "true"}):
        r = client.get(f"/models/{M}", headers={"HX-Request": "true", **extra})
        assert r.status_code == 200 and 'class="topbar"' in r.text


def test_unknown_target_falls_back_to_the_main_block(client: TestClient) -> None:
    r = client.get(f"/models/{M}", headers={"HX-Request": "true", "HX-Target": "nonexistent"})
    assert r.status_code == 200 and 'class="topbar"' not in r.text and 'id="heads_panel"' in r.text


def test_heatmap_cells_open_their_heads(client: TestClient) -> None:
    r = client.get(f"/models/{M}")
    fig = json.loads(parse(r.text).json_scripts[0])
    links = fig["links"]["0"]
    assert len(links) == 2 and len(links[0]) == 4
    assert links[1][3] == f"/models/{M}/heads/L1H3"
    assert client.get(links[1][3]).status_code == 200


def test_path_expansion_shows_the_sum_equal_to_the_model_value(client: TestClient) -> None:
    page = client.get(
        f"/models/{M}/prompt", params={"prompt": "the cat sat on the mat", "position": 2, "max_order": 2}
    ).text
    twin = client.get(
        f"/api/v1/models/{M}/paths", params={"prompt": "the cat sat on the mat", "position": 2, "max_order": 2, "k": 20}
    ).json()
    found = re.search(r'class="sum-check" data-total="([^"]+)" data-value="([^"]+)"', page)
    assert found
    assert float(found.group(1)) == pytest.approx(twin["total"]) and float(found.group(2)) == pytest.approx(
        twin["value"]
    )
    assert float(found.group(1)) == pytest.approx(float(found.group(2)), abs=1e-6)
    waterfall = next(json.loads(s) for s in parse(page).json_scripts if "model value" in s)
    bars = waterfall["data"][0]
    assert bars["x"][-1] == "model value" and bars["y"][-1] == pytest.approx(twin["value"])
    assert sum(bars["y"][:-1]) == pytest.approx(twin["value"], abs=1e-6)  # the drawn terms add up to the drawn total


@pytest.mark.parametrize(
    "path,block",
    [
        (f"/models/{M}/qk-paths?head=L0H1&prompt=the+cat", "qk_panel"),
        (f"/models/{M}/path?heads=L1H0,L0H1&prompt=the+cat", "chain_panel"),
        (f"/models/{M}/prompt?prompt=the+cat&position=20", "paths_panel"),
        ("/models/tiny-ln/composition", "composition_panel"),
    ],
)
def test_refused_analyses_keep_their_form(client: TestClient, path: str, block: str) -> None:
    for headers in ({}, {"HX-Request": "true", "HX-Target": block}):
        r = client.get(path, headers=headers)
        assert r.status_code == 422, r.text
        assert (
            f'id="{block}"' in r.text and ("<form" in r.text or 'class="seg"' in r.text) and 'class="error"' in r.text
        )
        assert r.headers.get("HX-Push-Url") == "false"


def test_picker_redirects_to_the_same_view_of_another_model(client: TestClient) -> None:
    r = client.get("/go", params={"model": "tiny-ln", "view": "detectors"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/models/tiny-ln/detectors"


@pytest.mark.parametrize(
    "path,status,needle",
    [
        (f"/models/{M}/heads/L9H0", 404, "L9H0"),
        ("/models/no-such-model", 404, "no-such-model"),
        (f"/models/{M}/heads/L1H2?k=0", 422, "k"),
        (f"/models/{M}?score=bogus", 422, "score"),
        (f"/models/{M}/direct?token=999999", 422, "999999"),
        ("/models/broken", 422, "broken"),
    ],
)
def test_errors_render_inside_the_panel_that_asked(client: TestClient, path: str, status: int, needle: str) -> None:
    full = client.get(path)
    assert full.status_code == status
    assert 'class="topbar"' in full.text and 'class="error"' in full.text and needle in full.text
    frag = client.get(path, headers={"HX-Request": "true", "HX-Target": "circuits"})
    assert frag.status_code == status
    assert frag.text.lstrip().startswith('<div class="error"') and needle in frag.text
    assert frag.headers["HX-Push-Url"] == "false", "an error in a panel is not pushed to the address bar"
    assert "HX-Request" in frag.headers["vary"]


def test_static_files_are_cached_and_compressed(client: TestClient) -> None:
    vendor = client.get("/static/vendor/htmx-2.0.11.min.js", headers={"Accept-Encoding": "gzip"})
    assert vendor.status_code == 200 and vendor.headers.get("content-encoding") == "gzip"
    assert "immutable" in vendor.headers.get("cache-control", "")
    own = client.get("/static/charts.js")
    assert own.status_code == 200 and "no-cache" in own.headers.get("cache-control", "")
    etag = own.headers["etag"]
    assert client.get("/static/charts.js", headers={"If-None-Match": etag}).status_code == 304


# -- escaping -------------------------------------------------------------------------------------------
EVIL = "<script>alert(1)</script>"


@pytest.fixture(scope="module")
def evil_client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    """A model whose vocabulary has a token that is an HTML script element."""
    root: Path = tmp_path_factory.mktemp("evil")
    tok = train_tokenizer()
    tok.add_tokens([EVIL])
    cfg = ModelConfig(
        n_layers=1,
        d_model=16,
        n_heads=2,
        d_head=8,
        d_vocab=tok.get_vocab_size(),
        n_ctx=64,
        positional_embedding_type="shortformer",
    )
    save_qkov(root / "evil", cfg, tok, seed=5)
    with TestClient(create_app(Settings(shipped_dir=root, dtype="float64", limits=LIMITS))) as c:
        yield c


def evil_id(client: TestClient) -> int:
    r = client.get("/api/v1/models/evil/tokenize", params={"prompt": EVIL})
    ids = [t["id"] for t in r.json()["tokens"] if t["text"] == EVIL]
    assert ids, r.text
    return ids[0]


def assert_escaped(text: str) -> None:
    assert EVIL not in text and "<script>alert" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text or "\\u003cscript\\u003e" in text


def test_token_text_is_escaped(evil_client: TestClient) -> None:
    t = evil_id(evil_client)
    for path in (f"/models/evil/direct?token={t}", f"/models/evil/heads/L0H1?token={t}"):
        for headers in ({}, {"HX-Request": "true"}):
            r = evil_client.get(path, headers=headers)
            assert r.status_code == 200, r.text
            assert_escaped(r.text)
            for script in parse(r.text).json_scripts:  # figures still parse to the original text
                json.loads(script)


def test_prompt_text_is_escaped(evil_client: TestClient) -> None:
    r = evil_client.get("/models/evil/detectors", params={"prompt": "a " + EVIL + " b"})
    assert r.status_code == 200, r.text
    assert_escaped(r.text)
    figs = [json.loads(s) for s in parse(r.text).json_scripts]
    labels = [x for f in figs for trace in f["data"] for x in trace.get("x", []) if isinstance(x, str)]
    # plotly reads labels as an HTML subset: they carry the token escaped as entities, which plotly draws as the
    # token's own characters (tests/browser/test_wide_models_browser.py, test_plotly_draws_token_markup_as_text)
    assert any(EVIL in html.unescape(x) for x in labels), "the token is drawn with its real text"
    assert not any("<script" in x for x in labels)


def test_error_detail_is_escaped(evil_client: TestClient) -> None:
    r = evil_client.get("/models/evil/direct", params={"token": EVIL + EVIL})
    assert r.status_code == 422
    assert "<script>alert" not in r.text


def test_min_count_picker_round_trips_in_the_url(client: TestClient) -> None:
    for page, api in (
        (f"/models/{M}/heads/L1H0", f"/api/v1/models/{M}/heads/L1H0/ov"),
        (f"/models/{M}/direct", f"/api/v1/models/{M}/direct"),
    ):
        html = client.get(page, params={"k": 5, "min_count": 500}).text
        assert re.search(r'<select name="min_count"[^>]*>', html) and '<option value="500" selected>' in html
        assert "min_count=500" in html  # token links, "JSON" links carry the state
        for e in client.get(api, params={"k": 5, "min_count": 500}).json()["entries"]:  # the table is the filtered one
            assert f"token={e['row']['id']}&amp;k=5&amp;min_count=500" in html
        odd = client.get(page, params={"min_count": 321}).text  # a value typed into the URL stays selected
        assert '<option value="321" selected>' in odd
    plain = client.get(f"/models/{M}/heads/L1H0", params={"min_count": ""}).text  # head page: "all" is the default
    assert '<option value="" selected>' in plain and "min_count=" not in plain
    assert 'name="min_count"' not in client.get("/models/tiny-ln/direct").text  # no counts: no picker


def test_direct_page_defaults_to_frequent_tokens_where_the_model_has_counts(client: TestClient, tiny) -> None:
    """Absent min_count: the tokens seen >= MIN_TRAIN_COUNT times (counts read here from the file, not through the app);
    'all' ranks every token; a model without counts ranks every token and shows no picker."""
    counts = np.load(tiny.path / TOKEN_COUNTS_FILE)
    frequent = set(np.flatnonzero(counts >= MIN_TRAIN_COUNT).tolist())
    assert 0 < len(frequent) < len(counts)  # the check below can fail: some tokens are rare
    html = client.get(f"/models/{M}/direct", params={"k": 40}).text
    assert (
        f'<option value="{MIN_TRAIN_COUNT}" selected>' in html
        and f"tokens seen at least {MIN_TRAIN_COUNT} times" in html
    )
    assert f"min_count={MIN_TRAIN_COUNT}" in html  # the JSON twin and the token links say what was ranked
    rows = re.findall(
        r"<tr>(.*?)</tr>", html.split('id="direct-table"')[1].split("<tbody>")[1].split("</tbody>")[0], re.S
    )
    cells = [[int(i) for i in re.findall(r"token=(\d+)&amp;", r)] for r in rows]
    assert cells and all(c and set(c) <= frequent for c in cells), cells
    every = client.get(f"/models/{M}/direct", params={"k": 40, "min_count": "all"}).text
    assert '<option value="all" selected>' in every and not re.search(
        r"min_count=\d", every
    )  # links keep min_count=all
    api_all = client.get(f"/api/v1/models/{M}/direct", params={"k": 40}).json()["entries"]
    assert {
        e["row"]["id"] for e in api_all
    } - frequent  # the global top-40 over all tokens holds rare ones: 'all' differs
    for e in api_all:
        assert f'href="/models/{M}/direct?token={e["row"]["id"]}&amp;k=40&amp;min_count=all"' in every
    assert 'name="min_count"' not in client.get("/models/tiny-ln/direct").text
    assert client.get("/models/tiny-ln/direct", params={"min_count": 5}).status_code == 422


def test_overview_scatter_is_not_drawn_without_an_induction_head(client: TestClient) -> None:
    """tiny-2l (random weights) has no head scoring HEAD_THRESHOLD as induction head on the standard input: the
    overview says why it draws no scatter, naming the strongest head and its score from the heads table."""
    from circuits_core.prompt.model_summary import HEAD_THRESHOLD

    heads = client.get("/api/v1/models/tiny-2l/heads").json()["heads"]
    best = max((h for h in heads if h["layer"] >= 1), key=lambda h: h["induction"])
    assert best["induction"] < HEAD_THRESHOLD  # the premise: no induction head here
    page = client.get("/models/tiny-2l").text
    assert 'id="scatter-claim"' not in page and "positivity-scatter" not in page
    found = re.search(r'id="scatter-refused">(.*?)</p>', page, re.S)
    assert found, "no #scatter-refused on the page"
    said = html.unescape(found.group(1))
    assert f"the strongest, {best['head']}, scores {best['induction']:.2f}" in said
