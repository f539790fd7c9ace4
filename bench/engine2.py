"""Engine-2 benchmark on the random GPT-2-small-shaped model (bench.engine.GPT2_SMALL, float32).

Section `engine2`:
  (a) all Q/K/V composition scores of the 144 heads (9504 earlier->later pairs each), with peak extra memory
      (goal < 2 s, < 1 GiB);
  (b) frozen-attention path expansion of one target logit, last position of a 128-token prompt, up to order 2,
      with the per-source-position breakdown (goal < 1 s); the sum check (terms + remainder == logit);
  (c) pattern detector scores of all 144 heads on 10 sequences of BOS + 2 x 50 repeated random tokens
      (goal < 1.5 s).
Medians of a few repeats; nothing asserts on time.
"""

from __future__ import annotations

import torch

from bench import PeakRSS, median_time, row
from bench.engine import gpt2_shaped_model
from circuits_core.composition import composition_scores
from circuits_core.frozen import frozen_run
from circuits_core.heads import detector_scores, standard_tokens
from circuits_core.paths import expand_logits

MiB = 2**20


def run_engine2(print_fn=print) -> None:
    model = gpt2_shaped_model()
    composition_scores(model, n_samples=8)  # warm-up
    with PeakRSS() as mem:
        t, scores = median_time(lambda: composition_scores(model, n_samples=300), repeats=3)
    row(
        "(a) Q/K/V composition scores, all 3 x 9504 pairs",
        t,
        "< 2 s",
        f"peak +{mem.delta / MiB:.0f} MiB (goal < 1024); max V {float(scores.raw['v'].max()):.3f}, "
        f"baseline {scores.baseline:.4f} (sampled {scores.sampled_baseline:.4f} ± {scores.sampled_std:.4f})",
    )

    tokens = torch.randint(0, model.cfg.d_vocab, (128,), generator=torch.Generator().manual_seed(0))
    run = frozen_run(model, tokens)
    target = int(tokens[-1])

    def expand() -> object:
        return expand_logits(model, tokens, target, positions=-1, max_order=2, by_source=True, run=run)

    expand()
    t, exp = median_time(expand, repeats=3)
    t_run, _ = median_time(lambda: frozen_run(model, tokens), repeats=3)
    err = float((exp.values.sum(0) + exp.remainder - exp.value).abs().max())
    row(
        "(b) path expansion to order 2, 128 tokens, by source",
        t,
        "< 1 s",
        f"{len(exp.paths)} terms; + clean run {t_run * 1e3:.0f} ms; remainder {float(exp.remainder[0]):.3g} "
        f"of {float(exp.value[0]):.3g}; sum error {err:.1e}",
    )

    rep = standard_tokens(model, seed=0)
    detector_scores(model, rep)
    t, det = median_time(lambda: detector_scores(model, rep), repeats=3)
    row(
        "(c) detectors, 144 heads, 10 x (BOS + 2 x 50)",
        t,
        "< 1.5 s",
        f"{len(det)} detectors; max induction {float(det['induction'].max()):.3f}",
    )


SECTIONS = {"engine2": run_engine2}
