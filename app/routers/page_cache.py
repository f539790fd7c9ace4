"""Rendered pages, kept like answers: a page's key from its parts (the model's digest, the URL, the htmx block
asked for, the models in the picker), and the page kept in the answer cache and the result store under it
(app/routers/rendering.py's `Page` serves them; its `page_key` gathers the parts)."""

from __future__ import annotations

import json
from collections.abc import Iterable

from fastapi import Request
from fastapi.responses import Response


def encode_page_key(
    digest: str,
    route: str,
    path: str,
    query: Iterable[tuple[str, str]],
    fragment: tuple[str, str],
    models: Iterable[str],
) -> str:
    """The page key as JSON of its parts, never joined raw: a value holding '&', '=', '|' or ',' cannot make two
    URLs share a key (a prompt 'a&weighted=true' once keyed the page of prompt 'a' with weighted=true). The query
    is normalised by ordering the parameters by name; the values of a repeated name keep their order."""
    pairs = sorted(([k, v] for k, v in query), key=lambda kv: kv[0])
    return json.dumps(["page", digest, route, path, pairs, list(fragment), list(models)], ensure_ascii=True)


async def cached_page(request: Request, key: str) -> bytes | None:
    service = request.app.state.compute
    body: bytes | None = service.cache.get(key)
    if body is None and service.store is not None and (body := await service.store.get(key)) is not None:
        service.cache.put(key, body)
    return body


async def keep_page(request: Request, key: str, body: bytes) -> None:
    service = request.app.state.compute
    service.cache.put(key, body)
    if service.store is not None:
        await service.store.put(key, body)


def html_page(body: bytes) -> Response:
    return Response(body, media_type="text/html; charset=utf-8", headers={"Vary": "HX-Request"})
