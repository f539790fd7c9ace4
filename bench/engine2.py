"""Engine-2 benchmark on the random GPT-2-small-shaped model (bench.engine.GPT2_SMALL, float32, 2 threads).

Section `engine2`:
  (a) all Q/K/V composition scores of the 144 heads (9504 earlier->later pairs each), with peak extra memory
      (goal < 2 s, < 1 GiB): cold (the 300-sample random baseline drawn too) and warm (baseline cached); the
      float32 scores against a float64 computation (max abs difference);
  (b) frozen-attention path expansion of one target logit, last position of a 128-token prompt, up to order 2,
      with the per-source-position breakdown (goal < 1 s); the sum check (terms + remainder == logit);
  (c) pattern detector scores of all 144 heads on 10 sequences of BOS + 2 x 50 repeated random tokens
      (goal < 1.5 s).
The machine is shared, so each figure comes with the fp32 GFLOP/s of a 2048^3 reference matmul timed just before
and after it, and an "idle-machine estimate" = time x (reference GFLOP/s now / idle reference GFLOP/s). On a
loaded machine 2 OpenMP threads stall at every barrier while the other thread is descheduled (many small ops
suffer far more than the big reference matmul), so each figure is also taken with 1 thread (idle reference
taken as half the 2-thread one). Medians of a few repeats; nothing asserts on time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import PeakRSS, median_time, row
from bench.engine import gpt2_shaped_model
from circuits_core.composition import composition_scores, random_baseline, raw_composition_scores
from circuits_core.frozen import frozen_run
from circuits_core.heads import detector_scores, standard_tokens
from circuits_core.paths import expand_logits

MiB = 2**20
IDLE_GFLOPS = {2: 180.0, 1: 90.0}  # fp32 2048^3 matmul on this 2-core machine when idle, by thread count


def reference_gflops(size: int = 2048, repeats: int = 3) -> float:
    """Median fp32 GFLOP/s of a size^3 matmul right now (the load of the shared machine included)."""
    a = torch.randn(size, size)
    a @ a
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times) / 1e9


def timed(fn: Callable[[], Any], repeats: int = 3) -> tuple[float, float, Any]:
    """(median seconds, reference GFLOP/s around the run, last result)."""
    before = reference_gflops()
    t, result = median_time(fn, repeats=repeats)
    return t, (before + reference_gflops()) / 2, result


def normalised(t: float, gflops: float) -> str:
    idle = IDLE_GFLOPS[torch.get_num_threads()]
    return f"[ref {gflops:.0f} GFLOP/s; idle-machine estimate {t * gflops / idle:.2f} s]"


def run_engine2(print_fn=print) -> None:
    threads = torch.get_num_threads()
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            print(f"  -- {n} thread(s); idle reference {IDLE_GFLOPS[n]:.0f} GFLOP/s", flush=True)
            _run(accuracy=n == 2)
    finally:
        torch.set_num_threads(threads)


def _run(accuracy: bool) -> None:
    model = gpt2_shaped_model()
    composition_scores(model, n_samples=8)  # warm-up

    def cold() -> object:
        random_baseline.cache_clear()
        return composition_scores(model, n_samples=300)

    with PeakRSS() as mem:
        t, g, scores = timed(cold)
    row(
        "(a) Q/K/V composition scores, all 3 x 9504 pairs, cold",
        t,
        "< 2 s",
        f"peak +{mem.delta / MiB:.0f} MiB (goal < 1024); {normalised(t, g)}",
    )
    t, g, scores = timed(lambda: composition_scores(model, n_samples=300))
    row(
        "    warm (random baseline cached)",
        t,
        "< 2 s",
        f"{normalised(t, g)}; max V {float(scores.raw['v'].max()):.3f}, baseline {scores.baseline:.4f} "
        f"(sampled {scores.sampled_baseline:.4f} ± {scores.sampled_std:.4f})",
    )
    if accuracy:
        W_Q, W_K, W_V, W_O = (w.detach().double() for w in (model.W_Q, model.W_K, model.W_V, model.W_O))
        exact = raw_composition_scores(W_Q, W_K, W_V, W_O)  # [3, L, H, L, H] float64
        got = torch.stack([scores.raw[k] for k in ("q", "k", "v")]).double()
        print(f"      float32 vs float64 scores: max abs difference {float((got - exact).abs().max()):.1e}", flush=True)
        del W_Q, W_K, W_V, W_O, exact, got

    tokens = torch.randint(0, model.cfg.d_vocab, (128,), generator=torch.Generator().manual_seed(0))
    run = frozen_run(model, tokens)
    target = int(tokens[-1])

    def expand() -> object:
        return expand_logits(model, tokens, target, positions=-1, max_order=2, by_source=True, run=run)

    expand()
    t, g, exp = timed(expand)
    t_run, _ = median_time(lambda: frozen_run(model, tokens), repeats=3)
    err = float((exp.values.sum(0) + exp.remainder - exp.value).abs().max())
    row(
        "(b) path expansion to order 2, 128 tokens, by source",
        t,
        "< 1 s",
        f"{normalised(t, g)}; {len(exp.paths)} terms; + clean run {t_run * 1e3:.0f} ms; "
        f"remainder {float(exp.remainder[0]):.3g} of {float(exp.value[0]):.3g}; sum error {err:.1e}",
    )

    rep = standard_tokens(model, seed=0)
    detector_scores(model, rep)
    t, g, det = timed(lambda: detector_scores(model, rep))
    row(
        "(c) detectors, 144 heads, 10 x (BOS + 2 x 50)",
        t,
        "< 1.5 s",
        f"{normalised(t, g)}; {len(det)} detectors; max induction {float(det['induction'].max()):.3f}",
    )


SECTIONS = {"engine2": run_engine2}
