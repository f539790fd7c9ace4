"""The load watchdog: no folder, whatever it holds, makes its load add more than a stated multiple of its weights'
size to the process's memory; over it the load is refused for that model, by name (a CheckpointError).

The limit, in bytes of resident memory (RSS) added since the load began:

    LOAD_MEMORY_MULTIPLE x weights + LOAD_MEMORY_ALLOWANCE

with `weights` the model's parameters priced in the compute dtype (statedict.load_bytes, dequantised: a Q4 GGUF
counts its float32 size), set by the loader once the config prices the model (`LoadWatchdog.weights`); before that,
the bytes of the folder's files stand in. The allowance covers what does not scale with the weights (the tokenizer of
a small model, the allocator's arenas, the first use of torch's kernels). A real load stays well under it: SmolLM2
and Gemma-3 270M add about 1.0-1.3 times their float32 weights at their peak (docs/serving.md).

How it holds: a sampler thread (schedule.sampling) reads the process's RSS every SAMPLE_S and keeps the peak. The
loading thread calls `checkpoint()` between bounded steps (each GGUF metadata key, each safetensors header entry, each
chunk of GGUF rows: gguf_quants.CHUNK_VALUES values): once the peak is over the limit, the next step raises. One native
step cannot be interrupted, so a step whose cost is known before it runs reserves it first (`reserve`: each safetensors
tensor's stored bytes, a torch archive's declared records before torch.load, the tokenizer's parse at
TOKENIZER_PARSE_FACTOR bytes per byte of tokenizer file) and is refused before it starts when the growth so far plus its
cost would cross the limit. What no checkpoint divides: the steps after the reads (building the model from its state
dict, weight processing, the tokenizer built on its worker thread) allocate in proportion to the priced weights and are
checked once, when the load ends (a refusal then names the growth the sampler saw).

What it measures is the process's RSS, not the load's own allocations: Linux keeps no resident-memory count per
thread, and torch, numpy and `tokenizers` allocate where Python's tracing does not see. Watched loads therefore run
one at a time (ONE_LOAD), so no other load counts (two at once made SmolLM2's growth include Gemma-3's, and `make run`
refused SmolLM2). Other work running beside a load does count, both ways: a computation that grows the process during
a load counts against the load (the registry retries a load refused here after a while; app/registry.py), and one
that frees memory lets the load grow by as much. What holds exactly is a bound on the process: a load is refused once
the process has grown, whoever grew it, by more than the folder's limit since the load began, or would by a reserved
step.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType

from circuits_core.errors import CheckpointError
from circuits_core.schedule import sampling

MiB = 1024 * 1024
LOAD_MEMORY_MULTIPLE = 3.0  # times the weights' size in the compute dtype
LOAD_MEMORY_ALLOWANCE = 256 * MiB  # on top of it, whatever the model's size
SAMPLE_S = 0.005
TOKENIZER_PARSE_FACTOR = 48  # bytes of memory per byte of tokenizer file while `tokenizers` parses it (measured:
# 12 for a pretty-printed Gemma-sized BPE, 39 for a compact BPE of 1-3 character tokens)
_PAGE = 4096


class LoadMemoryExceeded(CheckpointError):
    """A load refused by its watchdog (the process grew, or would grow, past the folder's limit)."""


def rss_bytes() -> int:
    """The process's resident memory now (Linux: /proc/self/statm; elsewhere through psutil)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


_current = threading.local()
ONE_LOAD = threading.RLock()  # watched loads of a process, one at a time (re-entrant: a load inside a load)


class LoadWatchdog:
    """`with LoadWatchdog(name, files_bytes):` around one load (see the module docstring)."""

    def __init__(
        self,
        name: str,
        files_bytes: int,
        multiple: float = LOAD_MEMORY_MULTIPLE,
        allowance: int = LOAD_MEMORY_ALLOWANCE,
    ):
        self.name, self.multiple, self.allowance = name, multiple, allowance
        self.weight_bytes, self.priced = files_bytes, False
        self.baseline = self.peak = 0
        self._sampling: AbstractContextManager[None] | None = None
        self._outer: LoadWatchdog | None = None

    @property
    def limit(self) -> int:
        return int(self.multiple * self.weight_bytes) + self.allowance

    def weights(self, nbytes: int) -> None:
        """The weights' size in the compute dtype, once the config prices them (replaces the files' bytes)."""
        self.weight_bytes, self.priced = nbytes, True

    def _grown(self) -> int:
        return max(self.peak, rss_bytes() - self.baseline)

    def _refusal(self, grown: int, detail: str = "") -> LoadMemoryExceeded:
        what = "its weights in the compute dtype" if self.priced else "its files"
        return LoadMemoryExceeded(
            f"{self.name}: loading it {detail or f'grew the process by {grown // MiB} MiB'}, over its limit of "
            f"{self.limit // MiB} MiB ({self.multiple:g} x {self.weight_bytes // MiB} MiB of {what} + "
            f"{self.allowance // MiB} MiB); other work running beside the load counts too"
        )

    def check(self, now: bool = False) -> None:
        """Raise once the peak the sampler saw (and, with `now`, the RSS read now) is over the limit. Without `now`
        it reads one attribute: cheap enough to call per entry of a header."""
        grown = self._grown() if now else self.peak
        if grown > self.limit:
            raise self._refusal(grown)

    def reserve_bytes(self, nbytes: int, what: str) -> None:
        """Refuse a step that would cost `nbytes` when the growth so far plus it would cross the limit."""
        grown = self._grown()
        if grown + nbytes > self.limit:
            raise self._refusal(grown, f"would need {nbytes // MiB} MiB more for {what} ({grown // MiB} MiB so far)")

    def _sample(self) -> None:
        self.peak = max(self.peak, rss_bytes() - self.baseline)

    def __enter__(self) -> LoadWatchdog:
        ONE_LOAD.acquire()  # another load's growth is not this one's: wait for it to end
        self.baseline = rss_bytes()
        self._outer = getattr(_current, "watchdog", None)
        _current.watchdog = self
        self._sampling = sampling(self._sample, SAMPLE_S, f"qkov-load-watchdog-{self.name}")
        self._sampling.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self._sampling is not None:
                self._sampling.__exit__(None, None, None)  # stopped and joined: no sample after the load
            _current.watchdog = self._outer
            if kind is None:
                self.check(now=True)  # a last native step may have crossed the limit after the last checkpoint
        finally:
            ONE_LOAD.release()


def checkpoint() -> None:
    """Between two bounded steps of a load: raise LoadMemoryExceeded once its watchdog saw the limit crossed."""
    watchdog: LoadWatchdog | None = getattr(_current, "watchdog", None)
    if watchdog is not None:
        watchdog.check()


def reserve(nbytes: int, what: str) -> None:
    """Before a native step of known cost: refuse it when it would take the load over its limit."""
    watchdog: LoadWatchdog | None = getattr(_current, "watchdog", None)
    if watchdog is not None:
        watchdog.reserve_bytes(nbytes, what)


def folder_bytes(folder: Path) -> int:
    """Bytes of the files directly in a model folder (the weights' stand-in until the config prices them)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
