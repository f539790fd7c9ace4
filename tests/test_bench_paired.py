"""bench/paired.py pairs the figures of two commits' bench output by their line's wording: medians over the runs,
the ratio after/before, WORSE past the threshold (for a rate, when it falls), a unit printed differently in another
run (955 ms vs 1.02 s) converted, settings and goals (equal in every run) left out, reworded lines listed apart."""

from __future__ import annotations

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
    assert "5 s -> 6 s x1.20 WORSE" in rows
    assert "0.025 s -> 1 s x40.00 WORSE" in rows  # in the unit the last run printed: 955 ms and 1.045 s are one figure
    assert "90 GFLOP/s -> 60 GFLOP/s x0.67 WORSE" in rows
    assert "2 GiB -> 2.12 GiB x1.06\n" in rows + "\n"  # the median, not the mean (2.107), and not WORSE
    assert "0.6 s ->" not in rows and "30 ms ->" not in rows and "256 MiB ->" not in rows  # goals and settings


def test_reworded_lines_are_listed_apart() -> None:
    before = [run("4.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB")]
    after = [run("4.00 s", "20.0 ms", "100 GFLOP/s", "2.00 GiB").replace("peak RSS", "peak resident set")]
    rows = compare("engine", before, after, worse=0.10)
    assert any("before only" in r for r in rows) and any("after only" in r for r in rows)
    assert "    peak RSS 2.00 GiB" in rows and "    peak resident set 2.00 GiB" in rows
