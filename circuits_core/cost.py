"""What a computation will cost, priced before it runs, and the stop flag its loops poll.

docs/design.md §3: every request is priced before it runs, and a cost is computed by
the engine code that will spend it, so it cannot drift from it. Each engine module therefore publishes a
cost function beside the computation it prices (`FactoredMatrix.topk_global_cost`, `composition.cost`,
`heads.detectors_cost`, `paths.cost`, `qk_paths.cost`, `ablation.cost`, `copying.copying_metrics_cost`, ...). The
app only compares a Cost with its budgets (app/scheduling/); it never recounts terms.

A Cost counts bytes, not numbers:
    peak_bytes    the largest extra working memory held at once (beyond the loaded weights)
    answer_bytes  the size of the answer once encoded as JSON (numbers x JSON_NUMBER_BYTES, roughly)
    flops         the arithmetic it will do (floating-point operations of its matrix products, 2 per multiply-add;
                  0: not counted): machine-independent, so the app turns it into time with the server's stated
                  rate (settings.compute_flops_per_s) and compares that with the request deadline
`a.then(b)` is b run after a (peaks do not add), `a + b` is both held at once (peaks add); FLOPs add.

Stopping: a long loop calls `check_stop(should_stop, what)` between its steps. It raises CancelledError when
the explicit flag or the ambient one (`stopping(flag)`, set by the app's compute service for the thread
running a request's computation) says the result is no longer wanted, so an abandoned computation frees
its slot within one step. Progress: a loop that knows how far it is calls `report_progress(done, total)`; the app's
scheduler (app/scheduling/) shows it on the job's progress bar (`progressing(callback)` sets the receiver).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from circuits_core.errors import CancelledError

# One number in a JSON answer: a float64 repr ("-0.12345678901234568") and its separator.
JSON_NUMBER_BYTES = 22
# A short labelled item in a JSON answer (a token reference {"id": 1234, "text": "..."} or a head name, with
# its key and separators).
JSON_LABEL_BYTES = 64
# The rest of an answer: the model reference (id, digest), parameter echoes, labels and descriptions.
JSON_ENVELOPE_BYTES = 1024


@dataclass(frozen=True)
class Cost:
    """Peak extra bytes, encoded answer bytes and FLOPs of one computation."""

    peak_bytes: int
    answer_bytes: int = 0
    flops: int = 0

    def then(self, other: Cost) -> Cost:
        """`self` then `other`, the first's working memory freed: the larger peak, answers and FLOPs added."""
        return Cost(
            max(self.peak_bytes, other.peak_bytes), self.answer_bytes + other.answer_bytes, self.flops + other.flops
        )

    def __add__(self, other: Cost) -> Cost:
        """Both held at once: peaks, answers and FLOPs added."""
        return Cost(
            self.peak_bytes + other.peak_bytes, self.answer_bytes + other.answer_bytes, self.flops + other.flops
        )

    def with_answer(self, numbers: int = 0, labels: int = 0) -> Cost:
        """This cost with an answer of `numbers` JSON numbers and `labels` labelled items (and its envelope) added."""
        extra = numbers * JSON_NUMBER_BYTES + labels * JSON_LABEL_BYTES + JSON_ENVELOPE_BYTES
        return Cost(self.peak_bytes, self.answer_bytes + extra, self.flops)


FREE = Cost(0)  # the price of work that reads only numbers already at hand


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of a floating dtype."""
    return torch.finfo(dtype).bits // 8


def float64_copy_size(dtype: torch.dtype) -> int:
    """Bytes per element of a `dtype` tensor's .double(): 8, or 0 when it is float64 already (.double() returns the
    tensor itself)."""
    return 0 if dtype == torch.float64 else 8


# -- the stop flag ---------------------------------------------------------------------------------------
_AMBIENT: ContextVar[Callable[[], bool] | None] = ContextVar("qkov_should_stop", default=None)


@contextmanager
def stopping(should_stop: Callable[[], bool]) -> Iterator[None]:
    """Within the block, `check_stop` in this thread (or context) also polls `should_stop`."""
    token = _AMBIENT.set(should_stop)
    try:
        yield
    finally:
        _AMBIENT.reset(token)


def check_stop(should_stop: Callable[[], bool] | None = None, what: str = "computation") -> None:
    """Raise CancelledError when `should_stop` or the ambient flag says the result is no longer wanted."""
    ambient = _AMBIENT.get()
    if (should_stop is not None and should_stop()) or (ambient is not None and ambient()):
        raise CancelledError(f"{what} cancelled: its result is no longer wanted")


def polled(
    names: Callable[[str], bool], should_stop: Callable[[], bool] | None = None, what: str = "forward pass"
) -> Callable[[str], bool]:
    """A hook-name filter for Transformer.run that also polls the stop flag at every hook it is asked about,
    so a long forward pass (big batch, big vocabulary) stops within one hook, not one whole pass."""

    def keep(name: str) -> bool:
        check_stop(should_stop, what)
        return names(name)

    return keep


_PROGRESS: ContextVar[Callable[[float], None] | None] = ContextVar("qkov_progress", default=None)


@contextmanager
def progressing(report: Callable[[float], None]) -> Iterator[None]:
    """Within the block, `report_progress` in this thread (or context) hands its fraction done to `report`."""
    token = _PROGRESS.set(report)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def report_progress(done: float, total: float) -> None:
    """Tell whoever waits for this computation that `done` of `total` steps are finished (no-op when none listens)."""
    report = _PROGRESS.get()
    if report is not None and total > 0:
        report(min(1.0, max(0.0, done / total)))
