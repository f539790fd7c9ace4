"""Gemma-3 270M (the Q4_K_M GGUF of `make gemma3`): the figures of the newest-attention issue, next to its goals.

- load: `load_checkpoint` (float32, processed) in a fresh process, median of 3: wall and CPU seconds (all threads:
  what a quiet machine's wall time would be, roughly) and peak RSS; then, in the same processes, when its tokenizer
  (262,144 entries, built on a worker thread once load_checkpoint has built the model: formats/checkpoint.py) is
  ready, and the peak RSS then. Goals: < 5 s, peak RSS < 3 GiB.
- heads table, cold: `head_table.head_table` on the app's standard detector input (BOS + 2 x 50 random tokens,
  10 sequences) on a model just loaded (nothing cached). Goal < 8 s.
- one OV row over the full vocabulary: `full_ov_row` of the strongest induction head for one token (262,144
  logits). Goal < 50 ms.
- global top-100 of an OV circuit: `full_ov_circuit(...).topk_global(100)` of that head over every pair of the full
  262,144-token vocabulary (6.9e10 entries). Goal < 3 s.
The load average is printed with the figures: on this shared 2-core machine they are noisy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from bench import median_time, row
from bench.modern import REPO, measure_load

GEMMA3 = REPO / "models" / "gemma3-270m"
GiB = 2**30
BUDGET = 256 * 2**20


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def gemma3() -> None:
    from circuits_core.circuits import head_circuits as C
    from circuits_core.formats.checkpoint import load_checkpoint
    from circuits_core.prompt.detectors import standard_tokens
    from circuits_core.prompt.head_table import head_table

    if not any(GEMMA3.glob("*.gguf")):
        raise RuntimeError(f"{GEMMA3} has no GGUF: run `make gemma3` first")
    size = sum(p.stat().st_size for p in GEMMA3.glob("*.gguf"))
    print(f"  {GEMMA3.relative_to(REPO)}: Q4_K_M GGUF {size / 2**20:.0f} MiB; load average {_loadavg()}")
    load = measure_load("qkov", GEMMA3, 3)
    row("load_checkpoint (float32, processed), fresh process", load.seconds, "< 5 s",
        f"CPU {load.cpu:.2f} s; peak RSS {load.peak / GiB:.2f} GiB (goal < 3 GiB), {load.base / GiB:.2f} before "
        "the load")  # fmt: skip
    row("  the same processes: its tokenizer ready", load.tokenizer_seconds, "",
        f"peak RSS {load.tokenizer_peak / GiB:.2f} GiB once it is")  # fmt: skip
    t0, c0 = time.perf_counter(), time.process_time()
    loaded = load_checkpoint(GEMMA3)
    loaded_at, loaded_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert loaded.tokenizer is not None
    loaded.tokenizer.hf  # noqa: B018 - waits for the tokenizer, built once load_checkpoint returns
    row("  in this process: model ready / tokenizer ready", loaded_at, "",
        f"CPU {loaded_cpu:.2f} s (all threads); tokenizer ready at {time.perf_counter() - t0:.2f} s")  # fmt: skip
    model = loaded.model
    tokens = standard_tokens(model)
    t0, c0 = time.perf_counter(), time.process_time()
    table = head_table(model, tokens, budget_bytes=BUDGET)
    row("heads table, cold (detectors + copying spectra)", time.perf_counter() - t0, "< 8 s",
        f"CPU {time.process_time() - c0:.2f} s (all threads); {tokens.shape[0]} x {tokens.shape[1]} tokens; "
        f"load average {_loadavg()}")  # fmt: skip
    layer, head = divmod(int(table.detectors["induction"].argmax()), model.cfg.n_heads)  # the strongest induction head
    token = loaded.tokenizer.lookup(" Paris")
    t_row, _ = median_time(lambda: C.full_ov_row(model, layer, head, token).topk(20), repeats=7)
    row(f"one OV row of L{layer}H{head} over the full {model.cfg.d_vocab:,}-token vocabulary, top 20", t_row,
        "< 50 ms", f"token ' Paris' ({token})")  # fmt: skip
    t0, c0 = time.perf_counter(), time.process_time()
    values, _, _ = C.full_ov_circuit(model, layer, head).topk_global(100, budget_bytes=BUDGET)
    row(f"global top-100 of L{layer}H{head}'s OV circuit, all {model.cfg.d_vocab:,}^2 token pairs",
        time.perf_counter() - t0, "< 3 s", f"CPU {time.process_time() - c0:.2f} s; 100th value "
        f"{float(values[-1]):.3f}; load average {_loadavg()}")  # fmt: skip
    print(f"  torch threads {torch.get_num_threads()}, cores {os.cpu_count()}")


SECTIONS = {"gemma3": gemma3}
