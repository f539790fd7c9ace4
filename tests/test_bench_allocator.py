"""Every bench process runs with glibc malloc's thresholds fixed (bench.STEADY_MALLOC): `python -m bench` sets them
itself, and bench.paired hands them to both commits' processes. Without that, a block freed and allocated again
is given back to the system and faulted in afresh, or not, depending on what the process freed before; the checks
count the page faults of that pattern (two 28 MiB blocks touched and freed, as TransformerLens's model.OV does
per call), which do not depend on the machine's load."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import STEADY_MALLOC, paired

ROOT = Path(__file__).resolve().parent.parent
glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc's malloc only"
)

# The third round's page faults of two 28 MiB blocks malloc'ed, written and freed; the first rounds set glibc's
# dynamic thresholds to what the pattern itself leaves (trim at 2 x 28 MiB: the freed top is given back each time).
FAULTS = textwrap.dedent(
    """
    import ctypes, ctypes.util, resource, sys
    sys.path.insert(0, {root!r})
    {setup}
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 28 * 2**20
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(size) for _ in range(2)]
        for block in blocks:
            ctypes.memset(block, 1, size)
        for block in blocks:
            libc.free(block)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(faults)
    """
)
PAGES = 2 * 28 * 2**20 // 4096  # 14,336 pages in the two blocks


def third_round_faults(setup: str) -> int:
    code = FAULTS.format(root=str(ROOT), setup=setup)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return int(out.stdout.split()[-1])


@glibc
def test_without_fixed_thresholds_the_freed_blocks_are_faulted_in_again() -> None:
    # the control: glibc's default behaviour, which the bench must not be left to
    assert third_round_faults("") > PAGES // 2


@glibc
def test_the_bench_harness_fixes_the_thresholds() -> None:
    # `python -m bench` (here with --list, which runs no section) leaves the process with the thresholds fixed
    setup = "from bench.__main__ import main; main(['--list'])"
    assert third_round_faults(setup) < PAGES // 20


@glibc
def test_the_steady_settings_as_environment_variables_fix_them_from_start_up() -> None:
    # what bench.paired hands a commit whose harness does not call steady_allocator itself
    code = FAULTS.format(root=str(ROOT), setup="")
    env = {"PATH": "/usr/bin:/bin", **STEADY_MALLOC}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    assert int(out.stdout.split()[-1]) < PAGES // 20


def test_paired_runs_both_commits_with_the_steady_settings(tmp_path: Path) -> None:
    # a stand-in checkout whose `python -m bench SECTION` prints the malloc settings it was started with
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "__main__.py").write_text(
        "import os\nprint(' '.join(f'{k}={os.environ.get(k)}' for k in sorted(os.environ) if k.startswith('MALLOC_')))"
    )
    out = paired.run_section(tmp_path, "engine", timeout_s=60).split()
    assert sorted(out) == sorted(f"{k}={v}" for k, v in STEADY_MALLOC.items())
