"""The glossary page at /glossary (docs/glossary.md) and the API docs page at /docs, generated from the app's OpenAPI
schema (no CDN), inside the dashboard's frame (top bar, model picker) like every other page.

FastAPI's default /docs loads Swagger UI from a CDN, which fails offline; this page lists every operation
with its parameters, constraints (the configured limits) and response schema. /openapi.json stays.
"""

from __future__ import annotations

import html
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from markupsafe import Markup

from app.deps import RegistryDep
from app.glossary import glossary, render_markdown, render_markdown_inline
from app.routers.rendering import page_context, render

_CONSTRAINTS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "enum",
)


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _schema_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " | ".join(_schema_type(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"list[{_schema_type(schema.get('items', {}))}]"
    return str(schema.get("type", "any"))


def _constraints(schema: dict[str, Any]) -> str:
    parts = [f"{k}={schema[k]}" for k in _CONSTRAINTS if k in schema]
    for alt in schema.get("anyOf", []):
        parts += [f"{k}={alt[k]}" for k in _CONSTRAINTS if k in alt]
    return ", ".join(parts)


def _operation(path: str, method: str, op: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td><code>{_esc(p['name'])}</code></td><td>{_esc(p['in'])}</td>"
        f"<td>{'yes' if p.get('required') else ''}</td>"
        f"<td><code>{_esc(_schema_type(p.get('schema', {})))}</code></td>"
        f"<td>{_esc(_constraints(p.get('schema', {})))}</td>"
        f"<td>{_esc(p.get('schema', {}).get('default', ''))}</td>"
        f"<td>{render_markdown_inline(p.get('description', ''))}</td></tr>"
        for p in op.get("parameters", [])
    )
    params = (
        "<table><tr><th>parameter</th><th>in</th><th>required</th><th>type</th><th>limits</th><th>default</th>"
        f"<th>description</th></tr>{rows}</table>"
        if rows
        else ""
    )
    ok = op.get("responses", {}).get("200", {}).get("content", {}).get("application/json", {}).get("schema", {})
    returns = (
        f'<p>Returns <a href="#schema-{_esc(_schema_type(ok))}"><code>{_esc(_schema_type(ok))}</code></a></p>'
        if ok
        else ""
    )
    doc = f'<div class="op-doc">{render_markdown(op["description"])}</div>' if op.get("description") else ""
    return (
        f'<section class="op" id="{_esc(op.get("operationId", path))}"><h3><span '
        f'class="method">{method.upper()}</span> '
        f"<code>{_esc(path)}</code> — {_esc(op.get('summary', ''))}</h3>{doc}{params}{returns}</section>"
    )


def render_docs(spec: dict[str, Any]) -> str:
    """The body of the docs page (HTML, every value escaped; descriptions rendered from markdown with raw HTML
    escaped): the endpoints, then the schemas."""
    ops = "".join(
        _operation(path, method, op) for path, item in spec.get("paths", {}).items() for method, op in item.items()
    )
    schemas = "".join(
        f'<details id="schema-{_esc(name)}"><summary><code>{_esc(name)}</code></summary>'
        f"<pre>{_esc(json.dumps(s, indent=2))}</pre></details>"
        for name, s in sorted(spec.get("components", {}).get("schemas", {}).items())
    )
    info = spec.get("info", {})
    return (
        f'<div class="page-head"><h1>{_esc(info.get("title", ""))} API <span class="note '
        f'mono">v{_esc(info.get("version", ""))}</span></h1>'
        f'<div class="lede">{render_markdown(info.get("description", ""))}</div></div>'
        '<p>Machine-readable schema: <a href="/openapi.json">/openapi.json</a>. Errors are '
        "<code>application/problem+json</code> (RFC 9457) with <code>type, title, status, detail, instance</code>.</p>"
        f'<div class="api-docs"><h2>Endpoints</h2>{ops}<h2>Schemas</h2>{schemas}</div>'
    )


router = APIRouter()


@router.get("/docs", include_in_schema=False, response_class=HTMLResponse)
async def api_docs(request: Request, registry: RegistryDep) -> Response:
    ctx = await page_context(request, registry, "API", "/openapi.json", nav="docs")
    return render(request, "docs.html", {**ctx, "body": Markup(render_docs(request.app.openapi()))})


@router.get("/glossary", include_in_schema=False, response_class=HTMLResponse)
async def glossary_page(request: Request, registry: RegistryDep) -> Response:
    """Every term the dashboard shows, defined (docs/glossary.md); pages link their first use of each here."""
    ctx = await page_context(request, registry, "Glossary", "", nav="glossary")
    return render(request, "docs.html", {**ctx, "body": glossary().html, "plain": True})
