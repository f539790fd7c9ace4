"""Every request priced before it runs, and its answer bounded (docs/design.md §3).

A circuits_core.cost.Cost (the engine's own estimate) is compared with the request's `Budgets` before a compute
slot is taken (`check_cost`: 422 naming the size, the budget and what to lower); the answer is encoded to JSON
inside the slot (`encode`) and its real size checked again (`check_answer`). The cache and the store hold those
bytes under `key_text(key)`; `Answer` carries a computation's value and/or its bytes back to the requests.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from circuits_core.cost import Cost
from circuits_core.errors import LimitExceededError

Key = tuple[Hashable, ...] | str


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def check_dense_bytes(needed: int, budget: int, what: str = "this request") -> None:
    """LimitExceededError (422) when a dense intermediate of `needed` bytes is over `budget`."""
    if needed > budget:
        raise LimitExceededError(
            f"{what} needs about {needed} bytes ({format_bytes(needed)}) of dense working memory; "
            f"the budget is {budget} bytes ({format_bytes(budget)}): ask for fewer tokens, sequences or heads"
        )


def key_text(key: Key) -> str:
    """The cache (and store) key: a string as it is, a tuple joined with "|"."""
    return key if isinstance(key, str) else "|".join(map(str, key))


@dataclass(frozen=True)
class Budgets:
    """What one request may spend (from settings.limits and the time budgets); None: unchecked."""

    peak_bytes: int | None = None
    answer_bytes: int | None = None
    seconds: float | None = None  # a job's time budget (settings.job_budget_s): beyond it a request is refused
    flops_per_second: float | None = None  # the rate that turns a Cost's FLOPs into time (settings.compute_flops_per_s)
    inline_seconds: float | None = None  # answered within the request up to this (settings.inline_budget_s), else a job

    def estimated_seconds(self, cost: Cost) -> float | None:
        """The cost's time: its FLOPs at `flops_per_second` (None when it counts none, or no rate is set)."""
        return cost.flops / self.flops_per_second if cost.flops and self.flops_per_second else None

    def mode(self, cost: Cost) -> Literal["inline", "job"]:
        """How a priced request runs: inline when its estimated time is within the inline budget (or unknown),
        else as a polled job (check_cost has refused it already when it is over the job budget)."""
        seconds = self.estimated_seconds(cost)
        if seconds is None or self.inline_seconds is None or seconds <= self.inline_seconds:
            return "inline"
        return "job"


def _hint(lower: str) -> str:
    """': lower k, max_order' from 'k, max_order' (or from 'lower k, max_order')."""
    return f": lower {lower.removeprefix('lower ')}" if lower else ": ask for less"


def check_cost(cost: Cost, budgets: Budgets, lower: str = "", what: str = "this request") -> None:
    """LimitExceededError (422) when the priced cost is over a budget: names the size, the limit and `lower`."""
    hint = _hint(lower)
    if budgets.peak_bytes is not None and cost.peak_bytes > budgets.peak_bytes:
        raise LimitExceededError(
            f"{what} needs about {_size(cost.peak_bytes)} of working memory; the budget (peak_bytes) is "
            f"{_size(budgets.peak_bytes)}{hint}"
        )
    if budgets.answer_bytes is not None and cost.answer_bytes > budgets.answer_bytes:
        raise LimitExceededError(
            f"{what} would answer about {_size(cost.answer_bytes)} of JSON; the budget (max_answer_bytes) is "
            f"{_size(budgets.answer_bytes)}{hint}"
        )
    seconds = budgets.estimated_seconds(cost)
    if budgets.seconds is not None and seconds is not None and seconds > budgets.seconds:
        raise _over_time(
            cost, budgets, seconds, "the longest a computation may run (job_budget_s)", budgets.seconds, hint, what
        )


def check_request_time(
    cost: Cost, budgets: Budgets, request_s: float | None, lower: str = "", what: str = "this request"
) -> None:
    """A request that cannot run as a job (its answer is not kept: a prompt of its own) must fit the request's own
    deadline: LimitExceededError (422) when its priced time is over `request_s`."""
    seconds = budgets.estimated_seconds(cost)
    if request_s is not None and seconds is not None and seconds > request_s:
        raise _over_time(
            cost, budgets, seconds, "the request deadline (request_timeout_s)", request_s, _hint(lower), what
        )


def _over_time(
    cost: Cost, budgets: Budgets, seconds: float, limit_name: str, limit: float, hint: str, what: str
) -> LimitExceededError:
    rate = budgets.flops_per_second or 0.0
    work = (
        f" ({cost.flops / 1e9:,.0f} GFLOP at {rate / 1e9:g} GFLOP/s, compute_flops_per_s)"
        if cost.flops and rate
        else ""
    )
    return LimitExceededError(f"{what} would take about {seconds:.0f} s{work}; {limit_name} is {limit:g} s{hint}")


def _size(n: int) -> str:
    return f"{n} bytes ({format_bytes(n)})"


def check_answer(size: int, budgets: Budgets, lower: str = "", what: str = "this request") -> None:
    """The real size of an encoded answer against max_answer_bytes (checked inside the slot)."""
    if budgets.answer_bytes is not None and size > budgets.answer_bytes:
        hint = _hint(lower)
        raise LimitExceededError(
            f"{what} answered {_size(size)} of JSON; the budget (max_answer_bytes) is "
            f"{_size(budgets.answer_bytes)}{hint}"
        )


def encode(value: Any) -> bytes | None:
    """The JSON bytes of a pydantic answer or of plain JSON data (dicts, lists, numbers, strings); None for
    anything else (a loaded model, a tensor): not cached, returned as is."""
    if isinstance(value, BaseModel):
        return value.__pydantic_serializer__.to_json(value)
    if isinstance(value, dict | list | str | int | float) and not isinstance(value, bool):
        try:
            return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
        except (TypeError, ValueError):  # not plain JSON data (a tensor inside, NaN): not cached
            return None
    return None


def view_type(fn: Callable[..., Any]) -> type[BaseModel] | None:
    """The pydantic model `fn` returns (its return annotation), to decode cached bytes."""
    try:
        hint = typing.get_type_hints(fn).get("return")
    except Exception:  # noqa: BLE001 - unresolvable annotations: no decoding
        return None
    return hint if isinstance(hint, type) and issubclass(hint, BaseModel) else None


@dataclass
class Answer:
    """A computation's result: the value (None when only bytes are known, e.g. from the cache) and its JSON."""

    value: Any
    body: bytes | None

    def as_value(self, view: type[BaseModel] | None) -> Any:
        """The value; from the JSON when only that is known (the view type's model, else plain JSON data)."""
        if self.value is None and self.body is not None:
            return view.model_validate_json(self.body) if view is not None else json.loads(self.body)
        return self.value

    def as_json(self) -> bytes:
        if self.body is None:
            raise TypeError(f"compute_json needs a pydantic answer, got {type(self.value).__name__}")
        return self.body
