"""`python -m bench.paired --before REF [SECTION ...]`: each bench figure of two commits, side by side, in paired runs.

For each section present in both commits, the two commits' `python -m bench SECTION` run alternately (before, after,
before, after, ... `--repeats` times each), so a change in the machine's load falls on both alike. Each printed
figure (a number with a unit: s, ms, GiB, GB/s, ...) is matched by its line's wording (the line with its numbers
blanked, and which occurrence of that wording it is), and the two medians over the repeats are printed with their
ratio after/before; a time or memory figure more than `--worse` above its before is marked WORSE (a rate, "/s",
when it falls as much). Lines whose wording changed between the commits cannot be paired and are counted apart.

The before side is a git worktree of REF, added under a temporary folder with the current checkout's models/ and
.cache linked in (or an existing checkout, when REF is a folder); the after side is the current checkout (or
`--after REF`). Both run with this interpreter from their own root, so each imports its own packages. With `--lock
PATH` each section's runs hold an flock on PATH, released between sections, so other heavy work interleaves; with
`--lock-each-run` as well, the lock is held around each single run and released between them, so on a shared machine
each run is timed while no other locked work runs, and a long section does not keep the others' work waiting
(`--pause S` leaves the lock free S seconds after each run: flock is no queue, and a waiter needs the gap).
Both commits' runs get the same fixed malloc thresholds (bench.STEADY_MALLOC), so a figure does not move with the
allocations its commit happened to make before it. Each run's wall time and the load average at its start and end
are printed as it ends. `--save DIR` keeps each run's output as DIR/SECTION/before-N.txt and after-N.txt (N counting
on from the runs already there), and `--saved DIR` pairs the runs kept there instead of running anything, so the
runs of several invocations can be paired as one.
Sections that exist at only one commit are listed as such; `--rename OLD=NEW` pairs a section that was renamed.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench import STEADY_MALLOC

ROOT = Path(__file__).resolve().parent.parent
LINKED = ("models", ".cache")  # large folders the before worktree borrows from the current checkout

# a number not inside a word or another number; a ratio printed as x37 or x0.92 is a number too (its value, not its
# wording, changes between runs), but a name such as L5H1 or W_E2 is not
NUMBER = r"(?:(?<=\bx)|(?<![\w.]))[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
UNIT = r"(?:GFLOP/s|GB/s|MB/s|/s|µs|us|ms|s|min|GiB|MiB|KiB|GB|MB|kB|KB)(?![\w/])"
FIGURE_RE = re.compile(rf"({NUMBER})\s?({UNIT})")
NUMBER_RE = re.compile(NUMBER)


# unit -> (kind, size in the kind's base unit): a figure printed as 955 ms in one run may be 1.02 s in another
SCALE = {
    "µs": ("time", 1e-6), "us": ("time", 1e-6), "ms": ("time", 1e-3), "s": ("time", 1.0), "min": ("time", 60.0),
    "KiB": ("bytes", 2.0**10), "MiB": ("bytes", 2.0**20), "GiB": ("bytes", 2.0**30),
    "kB": ("bytes", 1e3), "KB": ("bytes", 1e3), "MB": ("bytes", 1e6), "GB": ("bytes", 1e9),
    "/s": ("rate", 1.0), "MB/s": ("rate", 1e6), "GB/s": ("rate", 1e9), "GFLOP/s": ("flop rate", 1e9),
}  # fmt: skip


@dataclass(frozen=True)
class Figure:
    value: float  # in the base unit of its kind (seconds, bytes, per second)
    kind: str
    unit: str  # as printed


@dataclass
class Line:
    """One wording of an output line over the runs: its figures, one list of values per run."""

    text: str  # the line as the last run printed it
    figures: list[Figure]  # as the last run printed them
    values: list[list[float]] = field(default_factory=list)  # [run][figure]


def wording(line: str) -> str:
    """The line with its numbers and units blanked and its spaces collapsed (column padding follows the numbers)."""
    return " ".join(NUMBER_RE.sub("#", FIGURE_RE.sub("#", line)).split())


def figures(line: str) -> list[Figure]:
    found = []
    for m in FIGURE_RE.finditer(line):
        kind, size = SCALE[m.group(2)]
        found.append(Figure(float(m.group(1).replace(",", "")) * size, kind, m.group(2)))
    return found


def parse(output: str) -> dict[tuple[str, int], tuple[str, list[Figure]]]:
    """{(wording, occurrence): (line, figures)} for each output line that carries a figure with a unit."""
    seen: dict[str, int] = {}
    parsed: dict[tuple[str, int], tuple[str, list[Figure]]] = {}
    for line in output.splitlines():
        found = figures(line)
        if not found:
            continue
        key = wording(line)
        seen[key] = seen.get(key, 0) + 1
        parsed[(key, seen[key])] = (line.rstrip(), found)
    return parsed


def gather(outputs: list[str]) -> dict[tuple[str, int], Line]:
    """Lines present in every run with the same units, in the order of the last run."""
    runs = [parse(out) for out in outputs]
    lines: dict[tuple[str, int], Line] = {}
    for key, (text, found) in runs[-1].items():
        kinds = [f.kind for f in found]
        if all(key in run and [f.kind for f in run[key][1]] == kinds for run in runs):
            lines[key] = Line(text, found, [[f.value for f in run[key][1]] for run in runs])
    return lines


def shown(value: float, figure: Figure) -> str:
    return f"{value / SCALE[figure.unit][1]:.4g} {figure.unit}"


def ratio_text(before: float, after: float, kind: str, worse: float) -> str:
    if before == 0:
        return "-"
    ratio = after / before
    bad = ratio < 1 / (1 + worse) if "rate" in kind else ratio > 1 + worse
    return f"x{ratio:.2f}" + (" WORSE" if bad else "")


def compare(section: str, before: list[str], after: list[str], worse: float) -> list[str]:
    old, new = gather(before), gather(after)
    rows = [f"{section}: medians of {len(before)} runs before, {len(after)} after; after/before"]
    for key, line in new.items():
        if key not in old:
            continue
        pairs = []
        for i, figure in enumerate(line.figures):
            runs = [run[i] for run in old[key].values + line.values]
            if min(runs) == max(runs):  # a setting or a goal printed beside the figures, not a measurement
                continue
            b = statistics.median(run[i] for run in old[key].values)
            a = statistics.median(run[i] for run in line.values)
            text = ratio_text(b, a, figure.kind, worse)
            if text.endswith("WORSE"):  # each run's value, to tell a slower commit from one noisy run
                runs_of = [[shown(run[i], figure) for run in side.values] for side in (old[key], line)]
                text += f" (before {', '.join(runs_of[0])}; after {', '.join(runs_of[1])})"
            pairs.append(f"{shown(b, figure)} -> {shown(a, figure)} {text}")
        if pairs:
            rows.append(f"  {' '.join(line.text.split())}\n      " + ";  ".join(pairs))
    only_old = [old[k].text.strip() for k in old if k not in new]
    only_new = [new[k].text.strip() for k in new if k not in old]
    for label, texts in (("before only", only_old), ("after only", only_new)):
        if texts:
            rows.append(f"  lines {label} (wording changed or new; not paired): {len(texts)}")
            rows.extend(f"    {t}" for t in texts)
    return rows


def sections(root: Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--list"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    return out.split()


def run_section(root: Path, section: str, timeout_s: float) -> str:
    """`python -m bench SECTION` in root, with the allocator's thresholds fixed from start-up (bench.STEADY_MALLOC):
    a commit whose harness does not fix them itself runs with the same malloc settings as one that does."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench", section],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **STEADY_MALLOC},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"`python -m bench {section}` in {root} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stdout


@contextmanager
def locked(path: str | None) -> Iterator[None]:
    if path is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def checkout(ref: str | None) -> Iterator[Path]:
    """The current checkout (None), an existing folder, or a temporary detached worktree of a commit."""
    if ref is None:
        yield ROOT
        return
    if Path(ref).is_dir():
        yield Path(ref).resolve()
        return
    with tempfile.TemporaryDirectory(prefix="qkov-paired-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], check=True)
        try:
            for name in LINKED:
                if (ROOT / name).exists():
                    (tree / name).symlink_to((ROOT / name).resolve())
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def saved_runs(folder: Path, side: str) -> list[Path]:
    """DIR/SECTION/{side}-N.txt in the order of N."""
    found = [
        (int(m.group(1)), p) for p in folder.glob(f"{side}-*.txt") if (m := re.fullmatch(rf"{side}-(\d+)\.txt", p.name))
    ]
    return [p for _, p in sorted(found)]


def keep(save: Path | None, section: str, side: str, output: str, note: str) -> None:
    """The run's output as DIR/SECTION/{side}-N.txt, its time and load as a line of DIR/SECTION/runs.log."""
    if save is None:
        return
    folder = save / section
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{side}-{len(saved_runs(folder, side)) + 1}.txt"
    (folder / name).write_text(output)
    with open(folder / "runs.log", "a") as log:
        log.write(f"{name}: {note}\n")


def timed_run(root: Path, section: str, label: str, args: argparse.Namespace) -> tuple[str, str]:
    """One `python -m bench SECTION` (under the lock alone with --lock-each-run): its output, and its time and load."""
    with locked(args.lock if args.lock_each_run else None):
        start, t0 = load_average(), time.perf_counter()
        output = run_section(root, section, args.timeout)
        took = time.perf_counter() - t0
    note = f"{took:.0f} s, load average {start} at the start, {load_average()} at the end"
    print(f"  {label}: {note}", flush=True)
    if args.lock_each_run and args.pause > 0:
        time.sleep(args.pause)  # the lock stays free a while: flock is not a queue, so a waiter gets its turn
    return output, note


def pair_saved(folder: Path, chosen: list[str], worse: float) -> int:
    """Pair the runs kept under FOLDER by --save: every section folder there, or the chosen ones."""
    names = chosen or sorted(p.name for p in folder.iterdir() if p.is_dir())
    for section in names:
        before, after = ([p.read_text() for p in saved_runs(folder / section, side)] for side in ("before", "after"))
        if not before or not after:
            print(f"\n== {section}: no saved runs of both commits ({len(before)} before, {len(after)} after) ==")
            continue
        print(f"\n== {section} (saved runs in {folder / section}) ==")
        print("\n".join(compare(section, before, after, worse)), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.paired", description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", help="sections to pair (default: every section of the after commit)")
    parser.add_argument("--before", help="a commit (or a checkout folder) to compare against")
    parser.add_argument("--after", default=None, help="a commit or folder (default: this checkout)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each commit per section (default 2)")
    parser.add_argument("--skip", action="append", default=[], help="a section not to run (repeatable)")
    parser.add_argument("--rename", action="append", default=[], help="OLD=NEW: a section renamed between them")
    parser.add_argument("--lock", default=None, help="flock this file around each section's runs")
    parser.add_argument("--lock-each-run", action="store_true", help="hold --lock around each run, not each section")
    parser.add_argument("--pause", type=float, default=0.0, help="with --lock-each-run: seconds to wait between runs")
    parser.add_argument("--save", type=Path, default=None, help="keep each run's output under this folder")
    parser.add_argument("--saved", type=Path, default=None, help="pair the runs kept under this folder; run nothing")
    parser.add_argument("--worse", type=float, default=0.10, help="mark ratios beyond this fraction (default 0.10)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per bench run (default 1800)")
    args = parser.parse_args(argv)
    if args.saved is not None:
        return pair_saved(args.saved, args.sections, args.worse)
    if args.before is None:
        parser.error("--before is required unless --saved is given")
    if args.lock_each_run and args.lock is None:
        parser.error("--lock-each-run needs --lock PATH")
    # a plain `kill` ends the runs through the finally blocks below: the lock is released, the worktree removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    renamed = dict(pair.split("=", 1) for pair in args.rename)  # {old: new}
    with checkout(args.before) as before_root, checkout(args.after) as after_root:
        old_sections, new_sections = sections(before_root), sections(after_root)
        before_name = {renamed.get(s, s): s for s in old_sections}  # new name -> old name
        chosen = [s for s in (args.sections or new_sections) if s not in args.skip]
        missing = [s for s in chosen if s not in before_name]
        if missing:
            print(f"sections missing at the before commit (not paired): {', '.join(missing)}", flush=True)
        failed = []
        for section in (s for s in chosen if s in before_name):
            print(f"\n-- {section}: runs --", flush=True)
            with locked(None if args.lock_each_run else args.lock):
                start, t0 = load_average(), time.perf_counter()
                before_out: list[str] = []
                after_out: list[str] = []
                try:
                    for n in range(1, args.repeats + 1):
                        for side, root, name, outputs in (
                            ("before", before_root, before_name[section], before_out),
                            ("after", after_root, section, after_out),
                        ):
                            output, note = timed_run(root, name, f"{side} run {n}", args)
                            keep(args.save, section, side, output, note)
                            outputs.append(output)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(f"\n== {section}: failed ==\n{exc}", flush=True)
                    failed.append(section)
                    continue
                took = time.perf_counter() - t0
            print(f"\n== {section} (load average {start} at the start, {load_average()} at the end; {took:.0f} s) ==")
            print("\n".join(compare(section, before_out, after_out, args.worse)), flush=True)
        if failed:
            print(f"\nsections that failed: {', '.join(failed)}", flush=True)
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
