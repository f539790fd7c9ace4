"""Reading and running a page's "copy as Python" snippets as a notebook would (a fresh namespace; the snippet loads
the model folder itself)."""

from __future__ import annotations

import html
import re
from typing import Any


def snippets_in(page: str) -> dict[str, str]:
    """id -> source of every "copy as Python" snippet on a page (as the Copy button copies it)."""
    found = re.findall(r'<pre><code id="([\w-]+)-code">(.*?)</code></pre>', page, re.S)
    return {name: html.unescape(code) for name, code in found}


def run(code: str) -> dict[str, Any]:
    """The snippet's `result`."""
    namespace: dict[str, Any] = {}
    exec(compile(code, "<snippet>", "exec"), namespace)  # noqa: S102  (the page's own snippet, run as a user would)
    result: dict[str, Any] = namespace["result"]
    return result
