"""One mapping from errors to HTTP answers.

Engine errors (circuits_core.errors) and request-validation errors map to a status once, here:

    NotFoundError 404 · InvalidInputError 422 · LimitExceededError 422 · CheckpointError 422
    CancelledError 503 · RequestValidationError 422 · anything else 500 (logged; none should happen)

The answer's form depends on who asked:
- `/api/...` paths: RFC 9457 `application/problem+json` {type, title, status, detail, instance}
  (+ `errors` for validation failures);
- htmx requests (`HX-Request` header): an HTML fragment (templates/_error.html) for the panel that asked;
- otherwise a full error page (templates/error.html).
Templates receive {status, title, detail, instance, type}; a missing template falls back to escaped HTML.
"""

from __future__ import annotations

import html
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from jinja2 import Environment, FileSystemLoader, TemplateNotFound, select_autoescape
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.glossary import term_anchors
from app.settings import REPO_ROOT
from circuits_core.errors import (
    CancelledError,
    CheckpointError,
    InvalidInputError,
    LimitExceededError,
    NotFoundError,
    QkovError,
)

log = logging.getLogger("qkov.errors")

PROBLEM_JSON = "application/problem+json"


@dataclass(frozen=True)
class ProblemKind:
    status: int
    slug: str
    title: str

    @property
    def type(self) -> str:
        return f"urn:qkov:problem:{self.slug}"


# Most specific class first: the first isinstance match wins.
ERROR_KINDS: dict[type[Exception], ProblemKind] = {
    NotFoundError: ProblemKind(404, "not-found", "Not found"),
    LimitExceededError: ProblemKind(422, "limit-exceeded", "Limit exceeded"),
    InvalidInputError: ProblemKind(422, "invalid-input", "Invalid input"),
    CheckpointError: ProblemKind(422, "model-cannot-be-loaded", "Model cannot be loaded"),
    CancelledError: ProblemKind(503, "cancelled", "Computation cancelled"),
    QkovError: ProblemKind(422, "invalid-input", "Invalid input"),
}
VALIDATION = ProblemKind(422, "invalid-request", "Invalid request parameters")
INTERNAL = ProblemKind(500, "internal", "Internal server error")


def kind_of(exc: Exception) -> ProblemKind:
    for cls, kind in ERROR_KINDS.items():
        if isinstance(exc, cls):
            return kind
    return INTERNAL


def _validation_detail(exc: RequestValidationError) -> tuple[str, list[dict[str, Any]]]:
    errors = []
    parts = []
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        where = f"{loc[0]} parameter {'.'.join(loc[1:])}" if len(loc) > 1 else ".".join(loc) or "request"
        given = err.get("input")
        shown = repr(given) if len(repr(given)) <= 80 else repr(given)[:60] + f"... ({len(str(given))} characters)"
        msg = f"{where}: {err.get('msg', 'invalid')}" + (
            f" (got {shown})" if given is not None and not isinstance(given, dict) else ""
        )
        parts.append(msg)
        errors.append({"loc": loc, "msg": err.get("msg"), "type": err.get("type")})
    return "; ".join(parts) or "invalid request", errors


_env = Environment(loader=FileSystemLoader(str(REPO_ROOT / "templates")), autoescape=select_autoescape(default=True))
_env.globals["glossary_terms"] = term_anchors  # base.html's


def _html(template: str, context: dict[str, Any], status: int, fragment: bool) -> HTMLResponse:
    try:
        body = _env.get_template(template).render(**context)
    except TemplateNotFound:
        inner = (
            f'<div class="error" role="alert"><strong>{context["status"]} {html.escape(context["title"])}</strong>'
            f"<p>{html.escape(context['detail'])}</p></div>"
        )
        body = (
            inner
            if fragment
            else f"<!doctype html><title>{context['status']} {html.escape(context['title'])}</title>{inner}"
        )
    headers = {"Vary": "HX-Request"}
    if fragment:  # an error shown in its panel is not a state to push to the address bar (pages' hx-push-url)
        headers["HX-Push-Url"] = "false"
    return HTMLResponse(body, status_code=status, headers=headers)


def problem_response(request: Request, kind: ProblemKind, detail: str, **extra: Any) -> Response:
    """The answer for an error of `kind`: problem+json, htmx fragment or full page, by who asked."""
    context = {
        "type": kind.type,
        "title": kind.title,
        "status": kind.status,
        "detail": detail,
        "instance": str(request.url.path),
    }
    if request.url.path.startswith("/api/") or request.url.path == "/openapi.json":
        return JSONResponse({**context, **extra}, status_code=kind.status, media_type=PROBLEM_JSON)
    if request.headers.get("HX-Request") == "true":
        return _html("_error.html", {**context, **extra, "request": request}, kind.status, fragment=True)
    return _html("error.html", {**context, **extra, "request": request}, kind.status, fragment=False)


def render_fragment(template: str, context: dict[str, Any]) -> HTMLResponse:
    """A small HTML fragment from templates/ (a job's progress bar), never pushed to the address bar."""
    return HTMLResponse(_env.get_template(template).render(**context), headers={"HX-Push-Url": "false"})


def without_server_paths(detail: str, request: Request) -> str:
    """An engine message with the server's folders removed (model folder paths become `<model id>/...`)."""
    settings = getattr(request.app.state, "settings", None)
    folders = [getattr(settings, "models_dir", None), getattr(settings, "shipped_dir", None), REPO_ROOT]
    roots = {str(p) for folder in folders if isinstance(folder, Path) for p in (folder, folder.resolve())}
    for root in sorted(roots, key=len, reverse=True):  # the deepest first: a model's folder keeps its id
        detail = detail.replace(root + "/", "").replace(root, "<server folder>")
    return detail


async def _qkov_error(request: Request, exc: Exception) -> Response:
    kind = kind_of(exc)
    if kind.status >= 500:
        log.warning("%s %s: %s", request.method, request.url.path, exc)
    advice = getattr(exc, "advice", None)  # a price refusal: the parameter which, lowered so, runs
    return problem_response(
        request, kind, without_server_paths(str(exc), request), **({"advice": advice} if advice else {})
    )


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    detail, errors = _validation_detail(exc)
    return problem_response(request, VALIDATION, detail, errors=errors)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    titles = {404: "Not found", 405: "Method not allowed"}
    kind = ProblemKind(exc.status_code, f"http-{exc.status_code}", titles.get(exc.status_code, "HTTP error"))
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no such URL: {request.url.path}"
    response = problem_response(request, kind, detail)
    for key, value in (exc.headers or {}).items():
        response.headers[key] = value
    return response


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return problem_response(request, INTERNAL, "an unexpected error occurred; it has been logged")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(QkovError, _qkov_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
