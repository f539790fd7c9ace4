"""Benchmarks for `make bench` (`python -m bench [section ...]`): they print figures, never assert on time.

Shared measuring helpers for every section module (bench/engine.py, bench/composition_paths.py, bench/load.py):
medians of wall-clock repeats, and the peak resident-memory increase of a block of code, sampled from
/proc/self/statm in a thread (torch has no allocator statistics on CPU).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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
    """(median wall-clock seconds over `repeats` calls, the last result)."""
    times, result = [], None
    for _ in range(repeats):
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
