"""Virtual-weight benchmark on the random GPT-2-small-shaped model (bench.engine.GPT2_SMALL, float32).

Section `virtual_weights`:
  (a) every writer x reader score (158 writers: embed, pos, 144 heads, 12 MLPs; 445 readers: 144 x Q/K/V, 12 MLP
      inputs, unembed) from blocked Grams (goal < 3 s, < 1 GiB), cold (random baseline drawn) and warm, peak extra
      memory; float32 scores against float64 dense products on a sample of pairs;
  (b) TransformerLens's way, on the same weights in the same run: a FactoredMatrix product per pair, `.norm()`
      (what TL users write by hand: no all-pairs API exists), timed on a sample of head -> head pairs and
      extrapolated to every pair (labelled as an extrapolation), largest difference with qkov's scores;
  (c) one pair's page payload: embed -> unembed (vocabulary on both sides) singular values and token directions;
  (d) the usage panel (spectra, 90 % subspaces, all overlaps, bandwidth) and the erasure scan, one run each.
Each figure comes with bench.composition_paths's reference fp32 GFLOP/s around it and the idle-machine estimate (the
machine is shared); 2 threads, then 1. Nothing asserts on time.
"""

from __future__ import annotations

import random

import torch

from bench import PeakRSS, fmt_time, median_time, row
from bench.composition_paths import IDLE_GFLOPS, normalised, timed
from bench.engine import gpt2_shaped_model, tl_model
from circuits_core.circuits import erasure as stream_erasure
from circuits_core.circuits import residual_stream, stream_chains, stream_components
from circuits_core.circuits import virtual_weight_table as vwt
from circuits_core.circuits import virtual_weights as vw
from circuits_core.circuits.composition import random_baseline

MiB = 2**20


def run_virtual_weights() -> None:
    threads = torch.get_num_threads()
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            print(f"  -- {n} thread(s); idle reference {IDLE_GFLOPS[n]:.0f} GFLOP/s", flush=True)
            _run(extra=n == 2)
    finally:
        torch.set_num_threads(threads)


def _dense64(chain: list) -> torch.Tensor:  # type: ignore[type-arg]
    out = None
    for f in chain:
        f = f.double()
        out = f if out is None else out @ f
    assert out is not None
    return out


def _run(extra: bool) -> None:
    model = gpt2_shaped_model()
    vwt.all_scores(model)  # warm-up

    def cold() -> vwt.VirtualWeightScores:
        random_baseline.cache_clear()
        return vwt.all_scores(model)

    with PeakRSS() as mem:
        t_cold, g, scores = timed(cold, repeats=1)
    Nw, Nr = len(scores.writers), len(scores.readers)
    row(
        f"(a) all {Nw} x {Nr} writer x reader scores, cold",
        t_cold,
        "< 3 s",
        f"peak +{mem.delta / MiB:.0f} MiB (goal < 1024); {normalised(t_cold, g)}",
    )
    with PeakRSS() as mem:
        t_warm, g, scores = timed(lambda: vwt.all_scores(model))
    row(
        "    warm (random baseline cached)",
        t_warm,
        "< 3 s",
        f"peak +{mem.delta / MiB:.0f} MiB; {normalised(t_warm, g)}; {int(scores.mask.sum())} reachable pairs; "
        f"cost estimate {vwt.all_scores_cost(model).peak_bytes / MiB:.0f} MiB",
    )
    if not extra:
        return
    rng = random.Random(0)
    reach = [
        (i, j)
        for i, j in scores.mask.nonzero().tolist()
        if scores.writers[i].kind in ("head", "mlp") and scores.readers[j].role != "unembed"
    ]
    diffs = []
    for i, j in rng.sample(reach, 20):
        w, r = scores.writers[i], scores.readers[j]
        W = _dense64(stream_chains.writer_chain(model, w))
        R = _dense64(stream_chains.reader_chain(model, r))
        diffs.append(abs(float((W @ R).norm() / (W.norm() * R.norm())) - float(scores.raw[i, j])))
    print(f"      float32 vs float64 dense products, 20 sampled pairs: max abs difference {max(diffs):.1e}", flush=True)

    tl = tl_model()
    if tl is not None:
        _tl_pairs(tl, scores, t_warm)

    t, g, rep = timed(
        lambda: vw.pair_report(model, stream_components.Writer("embed"), stream_components.Reader("unembed")), repeats=1
    )
    row("(c) one pair: embed -> unembed SVD + token directions", t, "", normalised(t, g))
    t, g, usage = timed(lambda: residual_stream.stream_usage(model), repeats=1)
    row(
        "(d) usage: spectra, 90 % subspaces, all overlaps, bandwidth",
        t,
        "",
        f"{normalised(t, g)}; used dims {usage.bandwidth.used_dims:.0f} of {model.cfg.d_model}",
    )
    t, g, er = timed(lambda: stream_erasure.erasure(model), repeats=1)
    row("    erasure scan (every writer x later head)", t, "", f"{normalised(t, g)}; {len(er.candidates)} candidates")


def _tl_pairs(tl, scores: vwt.VirtualWeightScores, t_qkov: float) -> None:  # type: ignore[no-untyped-def]
    """TL: (model.OV[l1, h1] @ model.QK[l2, h2]).norm() / norms, per pair, on a sample; extrapolated."""
    OV, QK = tl.OV, tl.QK
    wi = {w.name: i for i, w in enumerate(scores.writers)}
    ri = {r.name: j for j, r in enumerate(scores.readers)}
    rng = random.Random(1)
    L, H = tl.cfg.n_layers, tl.cfg.n_heads
    sample: list[tuple[int, int, int, int]] = []
    while len(sample) < 20:
        l1, l2 = sorted(rng.sample(range(L), 2))
        sample.append((l1, rng.randrange(H), l2, rng.randrange(H)))

    def per_pair() -> list[float]:
        out = []
        for l1, h1, l2, h2 in sample:
            a, b = OV[l1, h1], QK[l2, h2]
            out.append(float((a @ b).norm() / (a.norm() * b.norm())))
        return out

    per_pair()  # warm-up
    t, theirs = median_time(per_pair, repeats=1)
    ours = [float(scores.raw[wi[f"L{l1}H{h1}"], ri[f"L{l2}H{h2}.Q"]]) for l1, h1, l2, h2 in sample]
    diff = max(abs(a - b) for a, b in zip(theirs, ours, strict=True))
    n_pairs = int(scores.mask.sum())
    est = t / len(sample) * n_pairs
    row(
        f"    TL FactoredMatrix per pair, {len(sample)} head->head Q pairs",
        t,
        "",
        f"{t / len(sample) * 1e3:.1f} ms/pair; x {n_pairs} pairs = ~{fmt_time(est).strip()} (extrapolated); "
        f"ratio TL/qkov ~{est / t_qkov:.0f}; max |diff| {diff:.1e}",
    )


SECTIONS = {"virtual_weights": run_virtual_weights}
