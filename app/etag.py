"""ETags and Cache-Control on the JSON API; `If-None-Match` answers 304 Not Modified; HEAD on every GET route.

Every GET under /api/ answering 200 with JSON is a deterministic function of its URL and the model
folders, so its ETag is a hash of the body. The tag is weak (`W/"..."`): the same JSON is sent gzip-coded
or plain (GZipMiddleware, outside), and a strong tag would have to differ per content coding. Every tagged
answer, 304s included, carries `Vary: Accept-Encoding`. Weight-derived answers carry
`Cache-Control: public, max-age=60` (their body names the checkpoint digest; a changed checkpoint changes
the tag); the model listing, which changes when folders are added, carries `no-cache` (revalidate each
time). The body is still computed for a conditional request (the result cache makes that cheap); the
304 saves the transfer.

Elsewhere (static files, which tag themselves from their stat) a strong ETag is made weak the same way and
gets the same Vary.

`HeadMiddleware` answers HEAD on every GET route, generated ones included: the request runs as a GET and
the body is dropped (headers, Content-Length included, are the GET's).
"""

from __future__ import annotations

import hashlib

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_PREFIX = "/api/"
REVALIDATE = {"/api/v1/models"}
MAX_AGE_S = 60


def etag_of(body: bytes) -> str:
    return 'W/"' + hashlib.sha256(body).hexdigest()[:40] + '"'


def matches(if_none_match: str, etag: str) -> bool:
    """RFC 9110 13.1.2: weak comparison (opaque tags equal, W/ ignored) of a list of tags, or `*`."""
    tags = [t.strip() for t in if_none_match.split(",")]
    return "*" in tags or any(t.removeprefix("W/") == etag.removeprefix("W/") for t in tags)


def weaken(send: Send) -> Send:
    """A sender that turns a strong ETag set downstream (StaticFiles) into a weak one and adds Vary:
    Accept-Encoding, so the gzip-coded and plain bodies never carry one strong tag (their 304s included)."""

    async def sender(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            etag = headers.get("etag")
            if etag is not None:
                if not etag.startswith("W/"):
                    headers["ETag"] = "W/" + etag
                if "accept-encoding" not in headers.get("vary", "").lower():
                    headers.add_vary_header("Accept-Encoding")
        await send(message)

    return sender


class HeadMiddleware:
    """HEAD = GET without the body, for every route (FastAPI routes declare GET only)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def drop_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, drop_body)


class ETagMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        if not scope["path"].startswith(API_PREFIX):
            await self.app(scope, receive, weaken(send))  # static files tag themselves (strong): made weak here
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def buffer(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = Headers(raw=message["headers"])
                if message["status"] != 200 or not headers.get("content-type", "").startswith("application/json"):
                    start = None
                    await send(message)
                    return
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            etag = etag_of(body)
            headers = MutableHeaders(scope=start)
            headers["ETag"] = etag
            headers["Cache-Control"] = "no-cache" if scope["path"] in REVALIDATE else f"public, max-age={MAX_AGE_S}"
            if "accept-encoding" not in headers.get("vary", "").lower():
                headers.add_vary_header("Accept-Encoding")
            inm = Headers(scope=scope).get("if-none-match")
            if inm is not None and matches(inm, etag):
                start["status"] = 304
                for name in ("content-length", "content-type"):
                    del headers[name]
                await send(start)
                await send({"type": "http.response.body", "body": b""})
                return
            await send(start)
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, buffer)
