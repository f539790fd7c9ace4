"""The `qkov` loggers' one handler: JSON lines (with the request id of the request that caused them, also from
compute threads) or plain text with CR and LF escaped (`settings.log_format`)."""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from typing import Any

from app.settings import Settings

REQUEST_ID: ContextVar[str | None] = ContextVar("qkov_request_id", default=None)  # set by app/serving_middleware.py


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id, and any `extra={"fields": {...}}`."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        if rid:
            out["request_id"] = rid
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class OneLineFormatter(logging.Formatter):
    """Plain text, one line per record: CR and LF (from a request path's %0A, or a traceback) are written as \\r
    and \\n, so no client can forge a log line."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\r", "\\r").replace("\n", "\\n")


def configure_logging(settings: Settings) -> None:
    """Give the `qkov` loggers one stderr handler (JSON lines or plain text), once per process."""
    root = logging.getLogger("qkov")
    root.setLevel(logging.INFO)
    formatter: logging.Formatter = (
        JsonFormatter()
        if settings.log_format == "json"
        else OneLineFormatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    for handler in root.handlers:
        if getattr(handler, "_qkov", False):
            handler.setFormatter(formatter)
            return
    handler = logging.StreamHandler()
    handler._qkov = True  # type: ignore[attr-defined]
    handler.setFormatter(formatter)
    root.addHandler(handler)
