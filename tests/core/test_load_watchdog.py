"""The load watchdog (formats/load_watchdog.py): a load may add at most LOAD_MEMORY_MULTIPLE x its weights (in the
compute dtype) + LOAD_MEMORY_ALLOWANCE to the process's memory.

The hostile folder: a model of width 8 with a 600,000-token vocabulary (38 MB of float32 weights) beside a compact
20 MB tokenizer.json, under the tokenizer's own byte allowance (8 MiB + 512 bytes per token) but costing about 39
times its bytes to parse. Measured in a fresh process: refused by name before the parse, the peak RSS growth under
the limit (the previous loader parsed it and loaded the model, growing the process by about 900 MiB). The measuring
half: a load that keeps allocating is stopped at its next step once the sampled RSS crosses the limit, with the
growth measured independently from /proc; a native step crossing it after the last step is refused at the end."""

from __future__ import annotations

import itertools
import json
import mmap
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from circuits_core.formats.load_watchdog import (
    LOAD_MEMORY_ALLOWANCE,
    LOAD_MEMORY_MULTIPLE,
    LoadMemoryExceeded,
    LoadWatchdog,
    checkpoint,
)
from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.formats.statedict import load_bytes
from circuits_core.formats.tokenizer import tokenizer_allowance
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024

MEASURE = """
import json, sys
from pathlib import Path
from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
def status(field):  # KiB; VmHWM is this process's peak (ru_maxrss would carry the parent's peak across exec)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
before = status("VmRSS")
try:
    load_checkpoint(Path(sys.argv[1]))
    outcome = "loaded"
except CheckpointError as exc:
    outcome = f"{type(exc).__name__}: {exc}"
print(json.dumps({"outcome": outcome, "grown_bytes": (status("VmHWM") - before) * 1024}))
"""


def _compact_bpe(n_tokens: int) -> str:
    """A BPE of `n_tokens` entries of 1-3 printable characters, each longer entry reachable by its two splits,
    written without indentation: about 35 bytes per entry, and the densest thing for the library to parse."""
    chars = [chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"\\\\']
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    for n in (1, 2, 3):
        for parts in itertools.product(chars, repeat=n):
            if len(vocab) == n_tokens:
                break
            token = "".join(parts)
            vocab[token] = len(vocab)
            if n >= 2:
                merges.append((token[:-1], token[-1]))
            if n == 3:
                merges.append((token[0], token[1:]))
    return HFTokenizer(models.BPE(vocab=vocab, merges=merges)).to_str(pretty=False)


def test_a_folder_whose_tokenizer_would_cost_more_than_its_limit_is_refused_before_the_parse(tmp_path):
    n = 600_000
    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, d_head=4, d_mlp=16, d_vocab=n, n_ctx=16, act_fn="gelu")
    text = _compact_bpe(n)
    size = len(text.encode())
    assert 15 * MiB < size < tokenizer_allowance(n)  # within the tokenizer's own byte allowance
    folder = save_checkpoint(Transformer(cfg), tmp_path / "dense-tokenizer", tokenizer_json=text)
    limit = LOAD_MEMORY_MULTIPLE * load_bytes(cfg) + LOAD_MEMORY_ALLOWANCE
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(folder)], cwd=REPO, capture_output=True, text=True, timeout=600, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["outcome"].startswith("LoadMemoryExceeded: dense-tokenizer: loading it would need"), got
    assert "for parsing tokenizer.json" in got["outcome"]
    assert got["grown_bytes"] < limit, (got, limit)  # the previous loader: about 900 MiB, over a limit of ~371 MiB


def _rss() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) * 1024


def test_a_load_that_keeps_allocating_is_stopped_at_its_next_step():
    step = 8 * MiB
    kept: list[mmap.mmap] = []  # fresh anonymous pages each step: resident once written, whatever malloc holds free
    ones = b"\1" * step
    before = _rss()
    watchdog = LoadWatchdog("hog", files_bytes=16 * MiB, multiple=1.0, allowance=64 * MiB)  # limit: 80 MiB
    with pytest.raises(LoadMemoryExceeded, match=r"hog: loading it grew the process by \d+ MiB, over its limit of 80"):
        with watchdog:
            for _ in range(100):  # 800 MiB if nothing stopped it
                checkpoint()
                page = mmap.mmap(-1, step)
                page.write(ones)  # written, so resident
                kept.append(page)
                time.sleep(0.01)  # (the sampler reads /proc every 5 ms)
    grown = _rss() - before
    # the last step crossed the limit (the sampler may have seen a few pages more than this process counts here)
    assert watchdog.limit <= grown < watchdog.limit + 4 * step, (grown, watchdog.limit)


def test_a_native_step_after_the_last_checkpoint_is_refused_at_the_end_and_nothing_is_watched_outside():
    with pytest.raises(LoadMemoryExceeded, match="native"):
        with LoadWatchdog("native", files_bytes=0, multiple=1.0, allowance=32 * MiB):
            big = mmap.mmap(-1, 64 * MiB)
            big.write(b"\1" * (64 * MiB))  # one step, no checkpoint after it
    checkpoint()  # outside any load: nothing to check
    big.close()


def test_two_loads_at_once_each_see_only_their_own_growth():
    """Two folders loading at the same time (as `make run` loads SmolLM2 and Gemma-3 on two loader threads): each
    grows the process by 48 MiB under a 64 MiB limit. Measured together, each would see the other's growth (96 MiB)
    and be refused; the watched loads run one at a time, so both load."""
    import threading

    step = 8 * MiB
    kept: list[mmap.mmap] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def load(name: str) -> None:
        start.wait()
        try:
            with LoadWatchdog(name, files_bytes=0, multiple=1.0, allowance=64 * MiB):
                for _ in range(6):  # 48 MiB in steps, long enough for the two to overlap if nothing orders them
                    checkpoint()
                    page = mmap.mmap(-1, step)
                    page.write(b"\1" * step)
                    kept.append(page)
                    time.sleep(0.03)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(name,)) for name in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for page in kept:
        page.close()


STEP_PROBE = """
import json, sys
from pathlib import Path
from circuits_core.errors import CheckpointError
from circuits_core.formats.load_watchdog import LoadWatchdog
from circuits_core.formats.statedict import read_weight_file
def status(field):  # KiB
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here on
before = status("VmRSS")
try:
    with LoadWatchdog("big", files_bytes=0, multiple=1.0, allowance=int(sys.argv[2])):
        read_weight_file(Path(sys.argv[1]))
    outcome = "read"
except CheckpointError as exc:
    outcome = f"{type(exc).__name__}: {exc}"
print(json.dumps({"outcome": outcome, "grown_bytes": (status("VmHWM") - before) * 1024}))
"""


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_a_read_that_would_cross_the_limit_is_refused_before_it_runs(tmp_path, suffix):
    """One tensor read (safetensors) or one torch.load (a .pth archive) is a single native step: checked only
    between steps, a 64 MiB tensor under a 16 MiB limit was read whole and refused after it (the process grew by
    64 MiB). Its size is known before it runs (the header's offsets, the archive's declared records), so it is
    reserved first and refused before anything is read, in a fresh process whose peak growth stays under the limit."""
    tensors = {"small": torch.ones(4), "big": torch.zeros(16 * MiB)}  # 64 MiB of float32
    path = tmp_path / f"model{suffix}"
    if suffix == ".pth":
        torch.save(tensors, path)
    else:
        save_file(tensors, str(path))
    limit = 16 * MiB
    out = subprocess.run(
        [sys.executable, "-c", STEP_PROBE, str(path), str(limit)], cwd=REPO, capture_output=True, text=True,
        timeout=300, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["outcome"].startswith("LoadMemoryExceeded: big: loading it would need 64 MiB more for"), got
    assert path.name in got["outcome"], got
    assert got["grown_bytes"] < limit, got
