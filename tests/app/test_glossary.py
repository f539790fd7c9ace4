"""The glossary page defines every term it lists (those the pages used undefined among them), every page embeds
the terms its first uses link to, and markdown (the glossary, the API descriptions of /docs) is rendered with raw
HTML escaped."""

from __future__ import annotations

import json
import re

from fastapi.testclient import TestClient

from app.glossary import glossary

ISSUE_TERMS = ("K-composition positivity", "icl score", "subspace energy", "erasure score", "participation ratio")


def test_glossary_page_defines_every_term(client: TestClient) -> None:
    page = client.get("/glossary")
    assert page.status_code == 200
    html = page.text
    g = glossary()
    names = {n.lower(): t.anchor for t in g.terms for n in t.names}
    for term in ISSUE_TERMS:  # the terms the pages used without a definition
        assert term.lower() in names, term
        assert f'id="{names[term.lower()]}"' in html
    for t in g.terms:
        # a heading with the anchor, and a definition paragraph after it
        block = html.split(f'id="{t.anchor}"', 1)[1].split("<h", 1)[0]
        assert len(re.sub(r"<[^>]+>", "", block).strip()) > 40, t.name


def test_pages_embed_the_terms_their_links_point_to(client: TestClient) -> None:
    """Every page carries the term -> anchor table static/glossary.js links first uses with (the browser test
    tests/browser/test_realui_browser.py follows the links); every anchor lands on a definition."""
    glossary_html = client.get("/glossary").text
    for path in ("/models/tiny-2l", "/models/tiny-2l/composition", "/tour"):
        page = client.get(path).text
        found = re.search(
            r'<script type="application/x-qkov-glossary\+json" id="glossary-terms">(.*?)</script>', page, re.S
        )
        assert found, path
        table = json.loads(found.group(1))
        for term in ISSUE_TERMS:
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
