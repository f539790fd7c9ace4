"""`python -m bench [section ...]`: run the benchmark sections (all by default) and print their figures.

Sections come from the `SECTIONS` dict ({name: callable}) of each module in SECTION_MODULES; a module that
is not there yet is skipped with a note. Figures are medians over a few repeats; ratios are measured in the
same run. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable

import torch

from bench import steady_allocator

SECTION_MODULES = (
    "bench.engine",
    "bench.composition_paths",
    "bench.load",
    "bench.http",
    "bench.virtual_weights",
    "bench.store",
    "bench.modern",
    "bench.rotary",
    "bench.copying",
    "bench.gemma3",
    "bench.big_models",
    "bench.real_model",
    "bench.families",
)


def collect() -> dict[str, Callable[[], None]]:
    sections: dict[str, Callable[[], None]] = {}
    for name in SECTION_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the module exists but something it imports is missing: say so
                raise
            continue
        sections.update(module.SECTIONS)
    return sections


def machine() -> str:
    """The CPU as the figures depend on it: its model name (Linux's /proc/cpuinfo) and the vector instructions torch's
    kernels use (`torch.backends.cpu.get_cpu_capability()`: AVX2, AVX512, ...). The same code ran about twice as fast
    on an AVX-512/AMX Xeon as on an AVX2 one, so figures are compared only between runs on the same kind of CPU."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}"


def main(argv: list[str] | None = None) -> int:
    sections = collect()
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", help=f"sections to run (default all): {', '.join(sections)}")
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    args = parser.parse_args(argv)
    steady = steady_allocator()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.list:
        print("\n".join(sections))
        return 0
    unknown = [s for s in args.sections if s not in sections]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; valid: {', '.join(sections)}")
    chosen = args.sections or list(sections)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(
        f"qkov bench: torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs "
        f"({machine()}), load average {load[0]:.1f}; medians of a few repeats; "
        f"malloc thresholds {'fixed (bench.STEADY_MALLOC)' if steady else 'glibc not found: left to the C library'}",
        flush=True,
    )
    missing = [m for m in SECTION_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        print(f"(not present yet, skipped: {', '.join(missing)})")
    failed = []
    for name in chosen:
        print(f"\n== {name} ==", flush=True)
        t0 = time.perf_counter()
        try:
            sections[name]()
        except Exception:  # one broken section must not hide the others' figures
            traceback.print_exc()
            failed.append(name)
        print(f"  [{name} took {time.perf_counter() - t0:.1f} s]", flush=True)
    if failed:
        print(f"\nsections that failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
