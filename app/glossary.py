"""The glossary (docs/glossary.md, rendered at /glossary) and the links from each page's first use of a term.

docs/glossary.md defines one term per `###` heading; an optional first line `Also: a, b` lists the other names the
pages use for it. `link_first_uses` turns the first occurrence of each term (or one of its names) in the page head
and in each panel (<section>, <article>: the blocks htmx swaps alone, which so read the same alone as in their
page) into a link to its definition, skipping text inside links, scripts, code, form controls, table headers (a
click there sorts the table) and the page title.

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
GLOSSARY_URL = "/glossary"
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

    def matcher(self) -> re.Pattern[str]:
        """Every name of every term, longest first (so 'K-composition positivity' wins over 'positivity')."""
        names = sorted({n for t in self.terms for n in t.names}, key=len, reverse=True)
        return re.compile(r"(?<![\w-])(" + "|".join(re.escape(n) for n in names) + r")(?![\w-])", re.I)

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


# Elements whose text is never linked: already links, machine text, controls, sortable headers, the page title.
SKIPPED = {"a", "script", "style", "code", "pre", "textarea", "select", "option", "button", "th", "h1", "label", "svg"}
TAG = re.compile(r"(<script\b.*?</script\s*>|<style\b.*?</style\s*>|<!--.*?-->|<[^>]*>)", re.S | re.I)
TAG_NAME = re.compile(r"^<\s*(/?)\s*([a-zA-Z][a-zA-Z0-9]*)")
PANELS = {"section", "article"}  # a panel or a tour figure: first uses are counted afresh in each
VOID = {"br", "hr", "img", "input", "meta", "link", "wbr", "area", "col", "source"}


def link_first_uses(html: str) -> Markup:
    """`html` with the first use of each glossary term linked to its definition (class "term")."""
    g = glossary()
    pattern, anchors = g.matcher(), g.anchor_of()
    seen: set[str] = set()
    out: list[str] = []
    skipping: list[str] = []  # open skipped elements
    for piece in TAG.split(str(html)):
        if not piece:
            continue
        if piece.startswith("<"):
            out.append(piece)
            m = TAG_NAME.match(piece)
            if m is None:
                continue
            closing, name = m.group(1) == "/", m.group(2).lower()
            if name in PANELS and not closing:
                seen.clear()  # each panel links its own first uses: a panel swapped alone reads the same
            if name in SKIPPED and name not in VOID and not piece.endswith("/>"):
                if closing:
                    if name in skipping:
                        del skipping[len(skipping) - 1 - skipping[::-1].index(name) :]
                elif not piece.lower().startswith(("<script", "<style")):
                    skipping.append(name)
            continue
        if skipping:
            out.append(piece)
            continue

        def link(m: re.Match[str]) -> str:
            anchor = anchors[m.group(1).lower()]
            if anchor in seen:
                return m.group(0)
            seen.add(anchor)
            return f'<a class="term" href="{GLOSSARY_URL}#{anchor}" title="glossary: what this means">{m.group(0)}</a>'

        out.append(pattern.sub(link, piece))
    return Markup("".join(out))


def glossary_links(html: str, on: bool = True) -> Markup:
    """The Jinja filter of base.html's main block: `link_first_uses`, or the html unchanged (`on` false: the
    glossary page itself)."""
    return link_first_uses(html) if on else Markup(html)
