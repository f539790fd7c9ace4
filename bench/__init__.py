"""Benchmarks for `make bench` (`python -m bench [section ...]`): they print figures, never assert on time.

Shared measuring helpers for every section module (bench/engine.py, bench/composition_paths.py, bench/load.py):
medians of wall-clock repeats, and the peak resident-memory increase of a block of code, sampled from
/proc/self/statm in a thread (torch has no allocator statistics on CPU).

The allocator's thresholds are fixed for every bench process (STEADY_MALLOC, steady_allocator): glibc's malloc
otherwise moves them with the history of the process. A block above its mmap threshold is mapped afresh and faulted
in page by page at each allocation; the threshold rises to the size of the largest mapped block freed so far (up to
32 MiB), and the heap's top is given back to the system whenever more than twice that is free there. So one figure
depended on what ran before it: TransformerLens's one-row product allocates and frees two 28.3 MiB stacks of W_V
and W_O per call; in a process that had freed no larger block, the trim threshold sat at 2 x 28.3 MiB and every
call gave the 57 MiB back and faulted it in again (13,800 page faults, 48 ms instead of 18-23 ms), which is what
qkov's leaner allocations since 3f7781a had left behind in `python -m bench engine` (bench/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Small mode (QKOV_BENCH_SMALL=1, read here and nowhere else): every section runs its own code paths on its smallest
# shapes, each timing once, so a test can run every section end to end in seconds (tests/test_bench_sections.py).
# Its figures say nothing about speed.
SMALL_SWITCH = "QKOV_BENCH_SMALL"
SMALL = os.environ.get(SMALL_SWITCH, "0").strip() not in ("", "0")


def sized(full: T, small: T) -> T:
    """`full` for a bench run, `small` in small mode: a shape, a count, a model."""
    return small if SMALL else full


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# glibc's own dynamic settings once the process has freed a 32 MiB mapped block (its ceiling on 64-bit): blocks up
# to 32 MiB come from the heap, and the heap keeps up to 64 MiB of free top before giving it back. bench.paired
# passes these to both commits' processes (glibc reads them at start-up); steady_allocator() sets them in this one.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(64 * 2**20)}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def steady_allocator() -> bool:
    """Fix glibc malloc's mmap and trim thresholds at STEADY_MALLOC's values for this process, so a figure does not
    depend on the allocations that ran before it; False where the C library is not glibc (nothing is changed)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    return bool(
        mallopt(_M_MMAP_THRESHOLD, int(STEADY_MALLOC["MALLOC_MMAP_THRESHOLD_"]))
        and mallopt(_M_TRIM_THRESHOLD, int(STEADY_MALLOC["MALLOC_TRIM_THRESHOLD_"]))
    )


def rss_bytes() -> int:
    """Current resident set size of this process (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class PeakRSS:
    """`with PeakRSS() as m: ...` then m.delta: peak RSS during the block minus RSS at its start (bytes)."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s, self.start, self.peak = interval_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def delta(self) -> int:
        return self.peak - self.start


def median_time(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, Any]:
    """(median wall-clock seconds over `repeats` calls (one in small mode), the last result)."""
    times, result = [], None
    for _ in range(sized(repeats, 1)):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms" if seconds < 1 else f"{seconds:8.2f} s "


def row(label: str, seconds: float, goal: str = "", extra: str = "") -> None:
    """One aligned result line: label, median time, the goal, anything else."""
    goal = f"(goal {goal})" if goal else ""
    print(f"  {label:<52} {fmt_time(seconds)}  {goal:<14} {extra}".rstrip(), flush=True)
