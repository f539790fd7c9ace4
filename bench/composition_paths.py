"""Composition, path expansion and term importance benchmark on the random GPT-2-small-shaped model
(bench.engine.GPT2_SMALL, float32, 2 threads).

Section `composition-paths`:
  (a) all Q/K/V composition scores of the 144 heads (9504 earlier->later pairs each), with peak extra memory
      (goal < 2 s, < 1 GiB): cold (the 300-sample random baseline drawn too) and warm (baseline cached); the
      float32 scores against a float64 computation (max abs difference);
  (b) frozen-attention path expansion of one target logit, last position of a 128-token prompt, up to order 2,
      with the per-source-position breakdown (goal < 1 s); the sum check (terms + remainder == logit);
  (c) pattern detector scores of all 144 heads on 10 sequences of BOS + 2 x 50 repeated random tokens
      (goal < 1.5 s).
Each figure is set against TransformerLens 3.9.0 on the same weights (bench.engine.tl_model: a float32
HookedTransformer, no weight processing on either side), in the same run, 2-thread pass only: TL time, qkov time,
ratio, largest difference --
  (a) model.all_composition_scores("Q"/"K"/"V") (peak RSS measured; a kind is skipped when the free memory could
      not hold its ~9 GiB of broadcast operands) against qkov's raw scores;
  (b) TL's closest feature, first-order direct logit attribution: run_with_cache, stack_head_results(-1, -1)
      (TL computes the head results from z @ W_O), apply_ln_to_stack, @ W_U[:, target]; per head it equals the sum of
      qkov's path terms that end at that head, all orders (b_V W_O, zero here, added as in
      tests/core/transformer_lens/test_vs_transformer_lens.py). The order-2 expansion is complete for the heads of
      layers 0-1; the sum over all heads also matches orders >= 1 + remainder. apply_ln_to_stack leaves out
      ln_final.w, so the numbers are compared only where ln_final.w == 1;
  (c) transformer_lens.head_detector.detect_head (error_measure "mul", 10 prompts = 10 forward passes per
      detector) and a batched run_with_cache + the same scoring; TL's mul score == qkov's score x eligible rows /
      (batch x n) exactly on equal patterns (qkov pools the eligible rows of the batch).
The machine is shared, so each figure comes with the fp32 GFLOP/s of a 2048^3 reference matmul timed just before
and after it, and an "idle-machine estimate" = time x (reference GFLOP/s now / idle reference GFLOP/s). On a
loaded machine 2 OpenMP threads stall at every barrier while the other thread is descheduled (many small ops
suffer far more than the big reference matmul), so each figure is also taken with 1 thread (idle reference
taken as half the 2-thread one). Medians of a few repeats; nothing asserts on time.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import PeakRSS, fmt_time, median_time, row, sized
from bench.engine import gpt2_shaped_model, tl_model
from circuits_core.circuits.composition import composition_scores, random_baseline, raw_composition_scores
from circuits_core.model.head_names import head_name
from circuits_core.prompt.detectors import detector_scores, duplicate_targets, induction_targets, standard_tokens
from circuits_core.prompt.frozen import frozen_run, ln_weight
from circuits_core.prompt.paths import expand_logits

MiB, GiB = 2**20, 2**30
IDLE_GFLOPS = {2: 180.0, 1: 90.0}  # fp32 2048^3 matmul on this 2-core machine when idle, by thread count


def reference_gflops(size: int = sized(2048, 256), repeats: int = 3) -> float:
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


def run_composition_paths(print_fn=print) -> None:
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
        t_cold, g, scores = timed(cold)
    row(
        "(a) Q/K/V composition scores, all 3 x 9504 pairs, cold",
        t_cold,
        "< 2 s",
        f"peak +{mem.delta / MiB:.0f} MiB (goal < 1024); {normalised(t_cold, g)}",
    )
    t_warm, g, scores = timed(lambda: composition_scores(model, n_samples=300))
    row(
        "    warm (random baseline cached)",
        t_warm,
        "< 2 s",
        f"{normalised(t_warm, g)}; max V {float(scores.raw['v'].max()):.3f}, baseline {scores.baseline:.4f} "
        f"(sampled {scores.sampled_baseline:.4f} ± {scores.sampled_std:.4f})",
    )
    if accuracy:
        W_Q, W_K, W_V, W_O = (w.detach().double() for w in (model.W_Q, model.W_K, model.W_V, model.W_O))
        exact = raw_composition_scores(W_Q, W_K, W_V, W_O)  # [3, L, H, L, H] float64
        got = torch.stack([scores.raw[k] for k in ("q", "k", "v")]).double()
        print(f"      float32 vs float64 scores: max abs difference {float((got - exact).abs().max()):.1e}", flush=True)
        del W_Q, W_K, W_V, W_O, exact, got
    tl = tl_model() if accuracy else None
    if tl is not None:
        _tl_composition(tl, scores.raw, t_warm, exact_peak=mem.delta)

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
    if tl is not None:
        _tl_logit_attribution(tl, model, run, target, exp, t + t_run)

    rep = standard_tokens(model, seed=0)
    detector_scores(model, rep)
    t, g, det = timed(lambda: detector_scores(model, rep))
    row(
        "(c) detectors, 144 heads, 10 x (BOS + 2 x 50)",
        t,
        "< 1.5 s",
        f"{normalised(t, g)}; {len(det)} detectors; max induction {float(det['induction'].max()):.3f}",
    )
    if tl is not None:
        _tl_detectors(tl, rep, det, t)


# -- TransformerLens on the same weights -------------------------------------------------------------------
def mem_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where unreadable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tl_line(what: str, t_tl: float, t_qkov: float, diff: str) -> None:
    """The comparison line: TL time, qkov time, ratio, largest difference."""
    row(f"    TL {what}", t_tl, "", f"qkov {fmt_time(t_qkov).strip()}; ratio TL/qkov {t_tl / t_qkov:.1f}; {diff}")


def _tl_composition(tl: Any, raw: dict[str, torch.Tensor], t_qkov: float, exact_peak: int) -> None:
    """(a) TL all_composition_scores per kind: its matmul broadcasts both collapsed factors to [L, H, L, H, ...]."""
    c = tl.cfg
    operands = 2 * (c.n_layers * c.n_heads) ** 2 * c.d_head * c.d_model * 4  # the two broadcast float32 copies
    need = int(operands * 1.2)  # + collapse and result; replaced by the measured peak after the first kind
    times, diffs, peaks, skipped = [], [], [], []
    for kind in ("Q", "K", "V"):
        gc.collect()
        free = mem_available()
        if free < need + 3 * GiB:
            skipped.append(f"{kind} ({free / GiB:.1f} GiB free, needs ~{need / GiB:.1f} + 3 GiB margin)")
            continue
        with PeakRSS() as mem:
            t, theirs = median_time(lambda k=kind: tl.all_composition_scores(k), repeats=1)  # [L, H, L, H]
        times.append(t)
        peaks.append(mem.delta)
        need = max(peaks)
        diffs.append(float((theirs - raw[kind.lower()]).abs().max()))
        row(
            f"    TL all_composition_scores({kind!r})",
            t,
            "",
            f"peak +{mem.delta / MiB:.0f} MiB; max |diff| {diffs[-1]:.1e}",
        )
        del theirs
    if skipped:
        print(f"      TL kinds not run (OOM risk on this {mem_total() / GiB:.0f} GiB machine): {', '.join(skipped)}")
    if times:
        t_tl = sum(times) * 3 / len(times)
        note = "" if len(times) == 3 else f" (x3/{len(times)} from the kinds run)"
        tl_line(
            f"(a) all 3 kinds{note}",
            t_tl,
            t_qkov,
            f"max |diff| {max(diffs):.1e} vs qkov raw float32; peak TL +{max(peaks) / MiB:.0f} MiB vs qkov "
            f"+{exact_peak / MiB:.0f} MiB (qkov warm: 3 kinds + normalisation, baseline cached)",
        )


def mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024
    except OSError:
        return 0


def _tl_logit_attribution(tl: Any, model: Any, run: Any, target: int, exp: Any, t_qkov: float) -> None:
    """(b) TL per-head direct logit attribution at the last position against the paths ending at each head."""
    cfg = model.cfg
    toks = run.tokens[None]  # [1, n]

    def tl_dla() -> torch.Tensor:
        _, cache = tl.run_with_cache(toks)
        stack = cache.stack_head_results(layer=-1, pos_slice=-1)  # [L*H, 1, d]; TL computes it from z @ W_O
        stack = cache.apply_ln_to_stack(stack, layer=-1, pos_slice=-1)
        return stack[:, 0] @ tl.W_U[:, target]  # [L*H]

    tl_dla()
    t_tl, theirs = median_time(tl_dla, repeats=3)
    w_f = ln_weight(model, "ln_final")
    if w_f is not None and not bool((w_f == 1).all()):
        tl_line(
            "(b) run_with_cache + per-head DLA", t_tl, t_qkov, "not comparable: apply_ln_to_stack leaves out ln_final.w"
        )
        return
    L, H = cfg.n_layers, cfg.n_heads
    index = {head_name(layer, h): layer * H + h for layer in range(L) for h in range(H)}
    mine = torch.zeros(L * H, dtype=torch.float64)
    for path, value in zip(exp.paths, exp.values[:, 0].tolist(), strict=True):
        if path and path[-1] in index:
            mine[index[path[-1]]] += value
    # b_V^h W_O^h rides in the head's result in TL; qkov moves it to the layer's bias source (zero on this model)
    inv_f = float(run.inv_scale("ln_final")[-1])  # the frozen final-LN scale at the last position
    u = model.W_U[:, target].double()
    bv = torch.stack(
        [model.blocks[layer].attn.b_V[h] @ model.blocks[layer].attn.W_O[h] for layer in range(L) for h in range(H)]
    ).double()
    if cfg.normalization_type is not None:
        bv = (bv - bv.mean(-1, keepdim=True)) * inv_f
    mine += bv @ u
    theirs = theirs.double()
    complete = min(exp.max_order, L) * H  # heads of layers < max_order: every path ending there is explicit
    heads_sum = float(exp.values[exp.orders > 0, 0].double().sum() + exp.remainder[0].double() + (bv @ u).sum())
    tl_line(
        "(b) run_with_cache + per-head DLA",
        t_tl,
        t_qkov,
        f"max |diff| {float((mine[:complete] - theirs[:complete]).abs().max()):.1e} on the {complete} heads of layers "
        f"0-{min(exp.max_order, L) - 1} (complete at order {exp.max_order}); sum over {L * H} heads: |TL - (orders >= "
        f"1 + remainder)| {abs(float(theirs.sum()) - heads_sum):.1e} of {float(theirs.sum()):.3g} (qkov: frozen_run + "
        f"expansion)",
    )


def _tl_detectors(tl: Any, rep: torch.Tensor, det: dict[str, torch.Tensor], t_qkov: float) -> None:
    """(c) TL detect_head per detector (one forward pass per prompt) and a batched run_with_cache + mul scoring."""
    from transformer_lens import head_detector as tl_heads

    b, n = rep.shape
    names: dict[str, Any] = {
        "previous_token": "previous_token_head",
        "duplicate_token": "duplicate_token_head",
        "induction": "induction_head",
    }
    targets = {
        "previous_token": torch.eye(n, dtype=torch.bool).roll(-1, 1).tril(-1).expand(b, n, n),
        "duplicate_token": duplicate_targets(rep),
        "induction": induction_targets(rep),
    }  # [b, n, n] bool: qkov's detection patterns
    tl_pattern = {
        k: torch.stack([getattr(tl_heads, f"get_{v}_detection_pattern")(rep[i : i + 1]) for i in range(b)])
        for k, v in names.items()
    }  # [b, n, n] float
    same = all(torch.equal(tl_pattern[k] > 0, targets[k]) for k in names)
    # TL mul per prompt = attention mass on the pattern / n, averaged over prompts = qkov x eligible rows / (b n)
    expected = {k: det[k] * int(targets[k].any(-1).sum()) / (b * n) for k in names}  # [L, H]
    prompts = [str(i) for i in range(b)]
    # detect_head tokenises strings: give it the token ids instead (as test_vs_transformer_lens.py does)
    tl.to_tokens = lambda seq, *args, **kwargs: rep if isinstance(seq, list) else rep[int(seq)][None]
    try:

        def tl_detect() -> dict[str, torch.Tensor]:
            return {k: tl_heads.detect_head(tl, prompts, v, error_measure="mul") for k, v in names.items()}

        t_tl, theirs = median_time(tl_detect, repeats=1)
    finally:
        del tl.to_tokens
    diff = max(float((theirs[k] - expected[k]).abs().max()) for k in names)
    tl_line(
        f"(c) detect_head x 3 detectors x {b} prompts",
        t_tl,
        t_qkov,
        f"max |diff| {diff:.1e} (TL mul vs qkov x eligible/(b n)); same detection patterns {same}; qkov: 5 detectors",
    )

    def tl_batched() -> dict[str, torch.Tensor]:
        _, cache = tl.run_with_cache(rep, names_filter=lambda name: name.endswith("hook_pattern"))
        pat = torch.stack([cache["pattern", layer] for layer in range(tl.cfg.n_layers)])  # [L, b, H, n, n]
        return {
            k: (pat * p[None, :, None]).sum((-1, -2)).mean(1) / pat.sum((-1, -2)).mean(1)  # [L, H]
            for k, p in tl_pattern.items()
        }

    tl_batched()
    t_tl, batched = median_time(tl_batched, repeats=3)
    diff = max(float((batched[k] - expected[k]).abs().max()) for k in names)
    tl_line("(c) batch-10 run_with_cache + mul scoring", t_tl, t_qkov, f"max |diff| {diff:.1e}")


SECTIONS = {"composition-paths": run_composition_paths}
