"""The glossary page defines every term it lists, pages link the first use of each term there (once per term, never
inside links, scripts, code or sortable headers), and markdown (the glossary, the API descriptions of /docs) is
rendered with raw HTML escaped."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from app.glossary import glossary, link_first_uses, slug

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
    assert 'class="term"' not in html  # the glossary does not link to itself


def test_first_use_only_and_never_inside_skipped_elements() -> None:
    html = (
        '<h1>Erasure score</h1><th>icl score</th><a href="/x">erasure score</a><code>icl score</code>'
        '<script type="application/json">{"t": "erasure score"}</script>'
        "<p>The erasure score of a head; again the erasure score. Its icl score, and the participation ratio.</p>"
        "<p>K-composition positivity differs from positivity.</p>"
    )
    out = str(link_first_uses(html))
    links = re.findall(r'<a class="term" href="/glossary#([^"]+)"[^>]*>([^<]+)</a>', out)
    assert links == [
        (slug("Erasure score"), "erasure score"),
        (slug("icl score"), "icl score"),
        (slug("Effective rank"), "participation ratio"),
        (slug("K-composition positivity"), "K-composition positivity"),
    ]
    assert '<h1>Erasure score</h1><th>icl score</th><a href="/x">erasure score</a><code>icl score</code>' in out
    assert '{"t": "erasure score"}' in out
    again = str(link_first_uses("<p>erasure score</p><section><p>erasure score, erasure score</p></section>"))
    assert again.count('class="term"') == 2  # the page head and the panel each link their first use


def test_pages_link_their_first_uses(client: TestClient) -> None:
    html = client.get("/models/tiny-2l").text
    main = html.split('<main id="main">', 1)[1]
    anchors = re.findall(r'<a class="term" href="/glossary#([^"]+)"', main)
    for part in re.split(r"<section\b|<article\b", main):  # each term linked once in the head and in each panel
        found = re.findall(r'<a class="term" href="/glossary#([^"]+)"', part)
        assert len(found) == len(set(found))
    assert slug("Induction score") in anchors and slug("Copying score") in anchors
    for anchor in anchors:  # every link lands on a definition
        assert f'id="{anchor}"' in client.get("/glossary").text


def test_docs_render_markdown_and_escape_html(client: TestClient) -> None:
    html = client.get("/docs").text
    assert "**" not in re.sub(r"<pre>.*?</pre>", "", html, flags=re.S)  # no raw markdown bold outside JSON schemas
    assert "<code>" in html
    from app.glossary import render_markdown

    assert str(render_markdown("a <b>x</b> **y**")) == "<p>a &lt;b&gt;x&lt;/b&gt; <strong>y</strong></p>\n"
