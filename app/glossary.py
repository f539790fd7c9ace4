"""The glossary (docs/glossary.md, rendered at /glossary) and the data of the links from each page's first use
of a term.

docs/glossary.md defines one term per `###` heading; an optional first line `Also: a, b` lists the other names the
pages use for it. Every page embeds `term_anchors()` (base.html); static/glossary.js links the first occurrence of
each name in the page's text to its definition, after load and after each htmx swap, and leaves the served HTML
(and so the sentences the tests and the tour quote) as it is.

Markdown (this glossary, the API descriptions of /docs) is rendered by markdown-it in CommonMark mode with raw
HTML off, so a description can never inject markup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from markdown_it import MarkdownIt
from markupsafe import Markup

GLOSSARY_FILE = Path(__file__).resolve().parent.parent / "docs" / "glossary.md"
_md = MarkdownIt("commonmark", {"html": False})


def render_markdown(text: str) -> Markup:
    """Markdown as HTML (raw HTML in the text is escaped, not passed through)."""
    return Markup(_md.render(text))


def render_markdown_inline(text: str) -> Markup:
    """One line of markdown (`code`, *emphasis*, links) as inline HTML, no paragraph around it."""
    return Markup(_md.renderInline(text))


def slug(term: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", term.lower()).strip("-")


@dataclass(frozen=True)
class Term:
    name: str
    aliases: tuple[str, ...]
    anchor: str

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True)
class Glossary:
    terms: tuple[Term, ...]
    html: Markup  # the page body, each term's heading with id=anchor

    def anchor_of(self) -> dict[str, str]:
        return {n.lower(): t.anchor for t in self.terms for n in t.names}


@cache
def glossary() -> Glossary:
    """The parsed glossary (read once per process)."""
    text = GLOSSARY_FILE.read_text(encoding="utf-8")
    terms: list[Term] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("### "):
            name = line[4:].strip()
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            aliases = tuple(a.strip() for a in nxt[len("Also:") :].split(",")) if nxt.startswith("Also:") else ()
            terms.append(Term(name, tuple(a for a in aliases if a), slug(name)))
    body = _md.render(re.sub(r"^Also: (.*)$", r"*Also shown as:* \1", text, flags=re.M))
    for t in terms:  # ids on the term headings (markdown-it's CommonMark has no heading attributes)
        body = body.replace(f"<h3>{_escape(t.name)}</h3>", f'<h3 id="{t.anchor}">{_escape(t.name)}</h3>', 1)
    return Glossary(tuple(terms), Markup(body))


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def term_anchors() -> dict[str, str]:
    """Every name of every term (lower case) -> its anchor on the glossary page: the data static/glossary.js links
    each page's first uses with (base.html embeds it)."""
    return glossary().anchor_of()
