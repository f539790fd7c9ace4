"""How a refused run of an analysis is explained (app/analysis.py's `run` and `run_json` use both): a computation
that fails on a model's non-finite weights is a refusal naming those tensors, and a request refused for its price
is told which parameter, lowered to which value, makes it run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pydantic import BaseModel

from app.scheduling import current_service
from circuits_core.cost import Cost
from circuits_core.errors import CheckpointError, LimitExceededError, QkovError

P = TypeVar("P", bound=BaseModel)


@contextmanager
def refused_on_nonfinite(subject: Any) -> Iterator[None]:
    """On a model with NaN or inf weights, a computation that fails (an SVD or eigensolver that does not converge
    on them, say) is a refusal of the model naming those tensors (422), not an internal error; an analysis whose
    maths carries the NaN through answers with it."""
    try:
        yield
    except QkovError:
        raise
    except Exception as exc:
        bad = getattr(subject, "nonfinite", None)
        if not bad:
            raise
        raise CheckpointError(
            f"this analysis cannot run on the model's non-finite weights: {', '.join(bad[:5])}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            + f" ({type(exc).__name__})"
        ) from exc


def with_advice(
    exc: LimitExceededError, path: str, priced: Callable[[P], Cost], params: P, kw: dict[str, Any]
) -> LimitExceededError:
    """A refusal of the request's price (not of its content) with the advice that makes it run: the first integer
    parameter (not one of the route `path`'s) which, lowered to `at_most` (the largest value the same price check
    admits), gives an answer. `priced(params)` is the analysis's own price of its subject, so following the advice
    is never refused for its price."""
    service = current_service()
    if service.admits(kw["cost"], kw["key"] is not None):
        return exc  # refused by the computation itself (its input), not by the price
    for name, info in type(params).model_fields.items():
        value = getattr(params, name)
        if not isinstance(value, int) or isinstance(value, bool) or "{" + name + "}" in path:
            continue
        low = next((int(m.ge) for m in info.metadata if hasattr(m, "ge") and m.ge is not None), 1)

        def fits(v: int, name: str = name) -> bool:
            try:
                lowered = params.model_copy(update={name: v})
                return service.admits(priced(lowered), kw["key"] is not None)
            except QkovError:
                return False

        if value <= low or not fits(low):
            continue
        lo, hi = low, value - 1  # fits(lo); find the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        said = str(exc)
        said = said[: said.rindex(": lower ")] if ": lower " in said else said  # the generic hint, replaced
        refused = LimitExceededError(f"{said}: lower {name} to {lo} or less ({name}={lo} runs)")
        refused.advice = {"parameter": name, "at_most": lo}  # type: ignore[attr-defined]
        return refused
    return exc
