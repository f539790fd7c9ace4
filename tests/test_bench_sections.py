"""Every section of `make bench` runs end to end in small mode (QKOV_BENCH_SMALL=1: its own code paths on its
smallest shapes, each timing once) and prints its figure lines with no error. Nothing here times anything: a
section that a refactor broke (an import moved, a signature changed) fails here instead of at the next bench run.
Sections on the real models use the GGUFs `make test` fetches (models/smollm2-135m, models/gemma3-270m)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import SMALL_SWITCH
from bench.__main__ import collect
from bench.paired import FIGURE_RE

ROOT = Path(__file__).resolve().parent.parent

# sections that start servers or load a real model run in the suite's groups of those, one at a time on one worker;
# the rest (random models of toy size) share a group of their own
GROUPS = {
    "gemma3": "gemma3",
    "real": "smollm2",
    "modern": "smollm2",
    "http": "uvicorn",
    "load": "uvicorn",
    "store": "uvicorn",
}
SECTIONS = list(collect())


def small_run(section: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, SMALL_SWITCH: "1"}
    return subprocess.run(
        [sys.executable, "-m", "bench", section], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "section", [pytest.param(s, marks=pytest.mark.xdist_group(GROUPS.get(s, "bench-sections"))) for s in SECTIONS]
)
def test_section_runs_end_to_end_in_small_mode(section: str) -> None:
    run = small_run(section)
    said = run.stdout + run.stderr
    assert run.returncode == 0 and "Traceback" not in said, said[-4000:]
    body = run.stdout.split(f"== {section} ==", 1)[1]
    figures = [line for line in body.splitlines() if FIGURE_RE.search(line) and f"[{section} took" not in line]
    assert figures, f"`python -m bench {section}` printed no figure line:\n{run.stdout[-3000:]}"
