"""bench/paired.py pairs the figures of two commits' bench output by their line's wording: medians over the runs,
the ratio after/before, WORSE past the threshold (for a rate, when it falls), a unit printed differently in another
run (955 ms vs 1.02 s) converted, settings and goals (equal in every run) left out, reworded lines listed apart."""

from __future__ import annotations

import fcntl
import io
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import paired
from bench.paired import compare


def run(copy_s: str, row_ms: str, rate: str, peak: str) -> str:
    return f"""qkov bench: torch 2.13.0+cpu, 2 threads, load average 3.1
(a) copying scores of all 144 heads, budget 256 MiB
  ov_copying_scores(model), 144 heads      {copy_s}   (goal < 0.6 s)
  full_ov_row(...).topk(20)                {row_ms}  (goal < 30 ms)
  reference matmul                         {rate}
  peak RSS {peak}
"""


def test_medians_ratios_and_worse() -> None:
    before = [run("4.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB"), run("6.00 s", "30.0 ms", "80 GFLOP/s", "2.00 GiB")]
    after = [
        run("5.00 s", "955 ms", "70 GFLOP/s", "2.00 GiB"),
        run("6.00 s", "1.045 s", "60 GFLOP/s", "2.20 GiB"),
        run("7.00 s", "1.00 s", "50 GFLOP/s", "2.12 GiB"),
    ]
    rows = "\n".join(compare("engine", before, after, worse=0.10))
    # medians by hand: copy 5 -> 6 s (x1.20), row 25 ms -> 1 s (x40), rate 90 -> 60 (x0.67), peak 2.00 -> 2.12
    assert "5 s -> 6 s x1.20 WORSE (before 4 s, 6 s; after 5 s, 6 s, 7 s)" in rows
    assert "0.025 s -> 1 s x40.00 WORSE" in rows  # in the unit the last run printed: 955 ms and 1.045 s are one figure
    assert "90 GFLOP/s -> 60 GFLOP/s x0.67 WORSE" in rows
    assert "2 GiB -> 2.12 GiB x1.06\n" in rows + "\n"  # the median, not the mean (2.107), and not WORSE
    assert "0.6 s ->" not in rows and "30 ms ->" not in rows and "256 MiB ->" not in rows  # goals and settings


def test_a_ratio_printed_as_x37_is_a_number_not_part_of_the_wording() -> None:
    """A line that prints a ratio beside its figure (x37 faster) pairs across runs whose ratio differs; a head name's
    digits (L5H1) stay wording, so two heads' lines are not one."""
    before = ["  one head (head page)   247.1 ms   x37 faster than exact\n  L5H1 row 20.0 ms\n  L5H2 row 30.0 ms\n"]
    after = ["  one head (head page)    62.5 ms   x19 faster than exact\n  L5H1 row 22.0 ms\n  L5H2 row 60.0 ms\n"]
    rows = "\n".join(compare("copying", before, after, worse=0.10))
    assert "247.1 ms -> 62.5 ms x0.25" in rows and "not paired" not in rows
    assert "20 ms -> 22 ms x1.10\n" in rows + "\n" and "30 ms -> 60 ms x2.00 WORSE" in rows


def test_reworded_lines_are_listed_apart() -> None:
    before = [run("4.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB")]
    after = [run("4.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB").replace("peak RSS", "peak resident set")]
    rows = compare("engine", before, after, worse=0.10)
    assert any("before only" in r for r in rows) and any("after only" in r for r in rows)
    assert "    peak RSS 2.00 GiB" in rows and "    peak resident set 2.00 GiB" in rows


def fake_bench(monkeypatch: pytest.MonkeyPatch, outputs: list[str], during: Callable[[], None] = lambda: None) -> None:
    """`python -m bench`: one section, "engine", whose runs print OUTPUTS in turn; DURING is called inside each run."""
    monkeypatch.setattr(paired, "sections", lambda root: ["engine"])

    def run_section(root: Path, section: str, timeout_s: float) -> str:
        during()
        return outputs.pop(0)

    monkeypatch.setattr(paired, "run_section", run_section)


def lock_is_free(path: Path) -> bool:
    """Whether another open file description could take the flock now (flock conflicts even within one process)."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


class RunLinesProbe(io.StringIO):
    """stdout that checks the lock as each run's timing line is printed: after the run has ended, before the next."""

    def __init__(self, lock: Path) -> None:
        super().__init__()
        self.lock = lock
        self.free_between: list[bool] = []

    def write(self, text: str) -> int:
        if re.match(r"\s*(before|after) run \d+:", text):
            self.free_between.append(lock_is_free(self.lock))
        return super().write(text)


def test_pause_leaves_the_lock_free_after_each_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    lock = tmp_path / "heavy.lock"
    fake_bench(monkeypatch, [run(f"{s}.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB") for s in (4, 5, 6, 7)])
    free_in_pauses: list[tuple[float, bool]] = []
    monkeypatch.setattr(paired.time, "sleep", lambda s: free_in_pauses.append((s, lock_is_free(lock))))
    argv = ["--before", str(tmp_path), "--after", str(tmp_path), "--lock", str(lock), "--lock-each-run"]
    assert paired.main([*argv, "--pause", "60"]) == 0
    assert free_in_pauses == [(60.0, True)] * 4  # after each of the 2 + 2 runs, with the lock released


@pytest.mark.parametrize("each_run", [True, False])
def test_lock_each_run_is_released_between_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, each_run: bool
) -> None:
    lock = tmp_path / "heavy.lock"
    held_during: list[bool] = []
    outputs = [run(f"{s}.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB") for s in (4, 5, 6, 7)]
    fake_bench(monkeypatch, outputs, lambda: held_during.append(not lock_is_free(lock)))
    probe = RunLinesProbe(lock)
    monkeypatch.setattr(sys, "stdout", probe)
    flags = ["--lock-each-run"] if each_run else []
    assert paired.main(["--before", str(tmp_path), "--after", str(tmp_path), "--lock", str(lock), *flags]) == 0
    assert held_during == [True] * 4  # every run is timed under the lock, either way
    # per run: free as each run ends (another job may take it); per section: held from the first run to the last
    assert probe.free_between == ([True] * 4 if each_run else [False] * 4)
    assert lock_is_free(lock)
    assert "5 s -> 6 s x1.20 WORSE" in probe.getvalue()  # before 4, 6 s; after 5, 7 s


def test_saved_runs_of_two_invocations_are_paired_as_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    save = tmp_path / "runs"
    first = [run("4.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB"), run("5.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB")]
    second = [run("6.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB"), run("9.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB")]
    for outputs in (first, second):
        fake_bench(monkeypatch, outputs)
        argv = ["--before", str(tmp_path), "--after", str(tmp_path), "--repeats", "1", "--save", str(save)]
        assert paired.main(argv) == 0
    kept = sorted(p.name for p in (save / "engine").iterdir())
    assert kept == ["after-1.txt", "after-2.txt", "before-1.txt", "before-2.txt", "runs.log"]
    assert "  ov_copying_scores(model), 144 heads      6.00 s" in (save / "engine" / "before-2.txt").read_text()
    assert len((save / "engine" / "runs.log").read_text().splitlines()) == 4
    monkeypatch.setattr(paired, "run_section", lambda *a: pytest.fail("--saved must run nothing"))
    probe = io.StringIO()
    monkeypatch.setattr(sys, "stdout", probe)
    assert paired.main(["--saved", str(save)]) == 0
    # medians by hand: before 4, 6 s -> 5 s; after 5, 9 s -> 7 s
    assert "engine: medians of 2 runs before, 2 after" in probe.getvalue()
    assert "5 s -> 7 s x1.40 WORSE (before 4 s, 6 s; after 5 s, 9 s)" in probe.getvalue()
