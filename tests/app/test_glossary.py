"""The glossary page defines every term it lists (those the pages used undefined among them), every page embeds
the terms its first uses link to, and markdown (the glossary, the API descriptions of /docs) is rendered with raw
HTML escaped."""

from __future__ import annotations

import html
import json
import re

from fastapi.testclient import TestClient

from app.glossary import glossary

PAGE_TERMS = ("K-composition positivity", "icl score", "subspace energy", "erasure score", "participation ratio")


def test_glossary_page_defines_every_term(client: TestClient) -> None:
    page = client.get("/glossary")
    assert page.status_code == 200
    html = page.text
    g = glossary()
    names = {n.lower(): t.anchor for t in g.terms for n in t.names}
    for term in PAGE_TERMS:  # terms the pages use: each has a definition
        assert term.lower() in names, term
        assert f'id="{names[term.lower()]}"' in html
    for t in g.terms:
        # a heading with the anchor, and a definition paragraph after it
        block = html.split(f'id="{t.anchor}"', 1)[1].split("<h", 1)[0]
        assert len(re.sub(r"<[^>]+>", "", block).strip()) > 40, t.name


def test_pages_embed_the_terms_their_links_point_to(client: TestClient) -> None:
    """Every page carries the term -> anchor table static/glossary.js links first uses with (the browser test
    tests/browser/test_wide_models_browser.py follows the links); every anchor lands on a definition."""
    glossary_html = client.get("/glossary").text
    for path in ("/models/tiny-2l", "/models/tiny-2l/composition", "/tour"):
        page = client.get(path).text
        found = re.search(
            r'<script type="application/x-qkov-glossary\+json" id="glossary-terms">(.*?)</script>', page, re.S
        )
        assert found, path
        table = json.loads(found.group(1))
        for term in PAGE_TERMS:
            assert term.lower() in table, (path, term)
        for anchor in set(table.values()):
            assert f'id="{anchor}"' in glossary_html
    assert 'id="glossary-terms"' not in glossary_html  # the glossary page does not link to itself


def test_docs_render_markdown_and_escape_html(client: TestClient) -> None:
    html = client.get("/docs").text
    assert "**" not in re.sub(r"<pre>.*?</pre>", "", html, flags=re.S)  # no raw markdown bold outside JSON schemas
    assert "<code>" in html
    from app.glossary import render_markdown

    assert str(render_markdown("a <b>x</b> **y**")) == "<p>a &lt;b&gt;x&lt;/b&gt; <strong>y</strong></p>\n"


# Every page of a model (its navigation, a head, a pair), with the params the test model needs.
PAGES = [
    "/models/tiny-2l",
    "/models/tiny-2l/composition",
    "/models/tiny-2l/prompt?prompt=the+cat+sat+on+the+mat",
    "/models/tiny-2l/path?prompt=the+cat+sat+on+the+mat",
    "/models/tiny-2l/qk-paths?prompt=the+cat+sat+on+the+mat",
    "/models/tiny-2l/detectors",
    "/models/tiny-2l/term-importance?prompt=the+cat+sat+on+the+mat",
    "/models/tiny-2l/direct",
    "/models/tiny-2l/copying",
    "/models/tiny-2l/attention-entropy?prompt=the+cat+sat+on+the+mat",
    "/models/tiny-2l/qk-circuit-norm",
    "/models/tiny-2l/residual",
    "/models/tiny-2l/residual/usage",
    "/models/tiny-2l/heads/L1H2",
    "/models/tiny-2l/composition/L0H1/L1H2",
]
# column headers that name no quantity of their own (tokens, heads, positions, plain statistics)
PLAIN = {
    "head",
    "earlier head",
    "later head",
    "source",
    "partner",
    "kind",
    "order",
    "path",
    "value",
    "logit",
    "component",
    "writer",
    "measure",
    "met",
    "required",
    "std",
    "key side",
    "query side",
    "next token",
    "held-out count",
    "… destination",
    "→ out",
}
PLAIN_PREFIXES = (
    "query token",
    "key token",
    "source token",
    "output token",
    "token read by",
    "model p(",
    "held-out p(",
)


def test_every_term_a_table_shows_is_defined(client: TestClient) -> None:
    """The terms shown, enumerated: every column header of every table on every page of a model names a glossary term
    (one of its names, as a word) or is plain (a token, a head, a position). A new column of a new quantity fails
    until the glossary defines it."""
    names = sorted(glossary().anchor_of(), key=len, reverse=True)
    undefined: dict[str, str] = {}
    for path in PAGES:
        page = client.get(path)
        assert page.status_code == 200, path
        for cell in re.findall(r"<th[^>]*>(.*?)</th>", page.text, re.S):
            text = html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
            low = text.lower()
            if not text or re.fullmatch(r"L\d+H\d+", text) or low in PLAIN or low.startswith(PLAIN_PREFIXES):
                continue
            if not any(re.search(rf"(^|[^\w-]){re.escape(n)}($|[^\w-])", low) for n in names):
                undefined.setdefault(text, path)
    assert not undefined, f"column headers naming no glossary term: {undefined}"
