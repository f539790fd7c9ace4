"""Health and readiness: /healthz answers while the process does; /readyz loads every model and runs one
forward pass of each (once per checkpoint digest), ready when every shipped model does and at least one exists."""

from __future__ import annotations

import threading
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field

from app.registry import ModelRegistry
from circuits_core.errors import QkovError


class Health(BaseModel):
    status: Literal["ok"]


class ReadinessReport(BaseModel):
    status: Literal["ready", "not ready"]
    models: dict[str, str] = Field(
        description="model id -> 'ok', 'error: <why>' or 'loading' (a user folder whose load goes on)"
    )
    store: dict[str, Any] | None = Field(
        default=None, description="the result store: kind, ok, and why not (Redis down: the local store serves)"
    )


class Readiness:
    """Load every model and run one forward pass of each (once per checkpoint digest)."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry
        self._verified: set[str] = set()
        self._lock = threading.Lock()

    def check(self) -> tuple[bool, dict[str, str]]:
        with self._lock:
            report: dict[str, str] = {}
            shipped_ok = True
            deadline = self.registry.deadline()  # a user folder still loading then: "loading"
            entries = self.registry.entries(deadline)
            states = self.registry.settle(entries, deadline)
            for entry in entries:
                state = states[entry.id]
                if state is None:
                    report[entry.id] = "loading"
                    continue
                try:
                    if isinstance(state, Exception):
                        raise state
                    loaded = state
                    digest = str(loaded.digest)
                    if digest not in self._verified:
                        n = max(1, min(4, loaded.model.cfg.n_ctx))
                        tokens = torch.zeros(1, n, dtype=torch.long, device=loaded.model.device)  # [1, n]
                        with torch.no_grad():
                            logits, _ = loaded.model.run(tokens, names=lambda name: False)  # [1, n, d_vocab]
                        if not bool(torch.isfinite(logits).all()):
                            raise QkovError("the forward pass gave non-finite logits")
                        self._verified.add(digest)
                    report[entry.id] = "ok"
                except Exception as exc:  # noqa: BLE001 - reported, not raised
                    report[entry.id] = f"error: {exc}"
                    shipped_ok = shipped_ok and not entry.shipped
            ready = shipped_ok and any(v == "ok" for v in report.values())
            return ready, report
