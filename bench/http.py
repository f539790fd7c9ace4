"""Speed through HTTP (section `http` of `make bench`): the GPT-2-small-shaped checkpoint served
by a real uvicorn on 127.0.0.1, next to TransformerLens 3.9.0 on the same weights in the same run.

The checkpoint is bench.engine's random GPT-2-small-shaped model (12 layers x 12 heads, d_model 768, d_head 64,
d_vocab 50,257) written in TransformerLens format (config.json + model.safetensors) with `qkov.json`
{"processing": false}, so the server holds exactly TransformerLens's weights. The server runs with the default
slots and threads, the result cache and store off (every request computes: "cold" in the compute sense), every
request answered inline (the inline budget raised to the job budget, so a request priced over the default 3 s is
timed as computed, not answered 202 as a polled job), and the model preloaded. Figures: the first answer (true cold:
lazy kernel set-up included) and the median of the next repeats, for
    GET /heads                      the heads table (detectors on 10 x 101 tokens, copying scores, 2-D view)
    GET /heads/L5H1/ov?token=1234&k=20   one row of the full OV circuit, top 20
    GET /composition?kind=K        one composition kind, every head pair
TransformerLens, in this process: `W_E[t] @ OV[l, h] @ W_U` then topk(20) for the row (its FactoredMatrix),
`all_composition_scores("K")` (skipped when free memory cannot hold its ~8 GiB of broadcast operands), and
`run_with_cache` on the same 10 x 101 detector input (the forward pass the heads table needs; TransformerLens
has no heads table). Then, in this process, where a cold heads table's time goes (detector pass, the two Grams
from one pass over the vocabulary, G_E W_Q, the spectra, the induction view's K-composition), wall and CPU seconds,
head_table against half its parts' CPU (its steps are shared by two threads when a core is idle: half the parts'
CPU estimates both cores busy all along) and head_table with every core as torch threads (an OpenMP team per
computation: slower than one thread on a busy machine), and the detector pass plus Grams with their products by
oneDNN (circuits_core/model/linear.py) against MKL's alone, alternated. The machine is shared: the load average is
printed; ratios and CPU seconds are what to compare.
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from app.settings import Settings
from bench import fmt_time, row, sized
from bench.engine import GPT2_SMALL, HEAD, LAYER, TOKEN, gpt2_shaped_model, tl_model
from bench.load import rss_bytes
from bench.server import serving

MODEL_ID = "gpt2-small-random"
# A bench server answers every request within the request, however it is priced (the inline budget raised to the job
# budget, the longest price served at all): the figures time the computation as a client waits for it, not a 202 job.
INLINE_BUDGET_S = str(Settings.model_fields["job_budget_s"].default)
K = 20  # the row's top-k; LAYER, HEAD and TOKEN are bench.engine's
GiB = 2**30


def write_tl_checkpoint(folder: Path) -> Path:
    """The random GPT-2-small-shaped model as a TransformerLens checkpoint folder (weights as stored)."""
    model = gpt2_shaped_model()
    c = GPT2_SMALL
    target = folder / MODEL_ID
    target.mkdir(parents=True)
    config = {
        "n_layers": c.n_layers,
        "d_model": c.d_model,
        "n_heads": c.n_heads,
        "d_head": c.d_head,
        "d_vocab": c.d_vocab,
        "n_ctx": c.n_ctx,
        "d_mlp": c.d_mlp,
        "act_fn": c.act_fn,
        "normalization_type": c.normalization_type,
        "positional_embedding_type": c.positional_embedding_type,
    }
    (target / "config.json").write_text(json.dumps(config))
    (target / "qkov.json").write_text(json.dumps({"processing": False}))
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(target / "model.safetensors"))
    return target


def timed_get(client: httpx.Client, url: str, repeats: int) -> tuple[float, float, httpx.Response]:
    """(first answer's seconds, median of the next `repeats`, last response); each answer must be 200."""
    times = []
    answer = None
    for _ in range(sized(repeats, 1) + 1):
        t0 = time.perf_counter()
        answer = client.get(url)
        times.append(time.perf_counter() - t0)
        if answer.status_code != 200:
            raise RuntimeError(f"GET {url}: {answer.status_code} {answer.text[:300]}")
    assert answer is not None
    return times[0], statistics.median(times[1:]), answer


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def tl_figures(rep_tokens: torch.Tensor) -> dict[str, float]:
    """TransformerLens timings on the same weights: OV row, one composition kind, run_with_cache."""
    tl = tl_model()
    if tl is None:
        return {}
    out: dict[str, float] = {}
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        row_tl = tl.W_E[TOKEN] @ tl.OV[LAYER, HEAD] @ tl.W_U  # [d_vocab]: a vector through the FactoredMatrix
        row_tl.topk(K)
        times.append(time.perf_counter() - t0)
    out["ov_row"] = statistics.median(times)
    with torch.no_grad():
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            tl.run_with_cache(rep_tokens, names_filter=lambda n: n.endswith("hook_pattern"))
            times.append(time.perf_counter() - t0)
        out["run_with_cache"] = statistics.median(times)
    gc.collect()
    c = GPT2_SMALL
    need = int(2 * (c.n_layers * c.n_heads) ** 2 * c.d_head * c.d_model * 4 * 1.2)
    if mem_available() > need + 3 * GiB:
        t0 = time.perf_counter()
        tl.all_composition_scores("K")
        out["composition"] = time.perf_counter() - t0
    else:
        print(
            f"  TL all_composition_scores skipped: {mem_available() / GiB:.1f} GiB free, it needs ~{need / GiB:.1f} "
            f"GiB + 3 GiB margin"
        )
    gc.collect()
    return out


def _timed(fn: Any) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds of this process: every thread, result) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w0, time.process_time() - c0, out


def heads_breakdown(model: Any) -> None:
    """Where a cold heads table's time goes, in this process with the torch threads the server gives one
    computation: the detector pass, both d_model x d_model Grams from one pass over the vocabulary, G_E W_Q, the
    2 x (L x H) spectra, the 2-D induction view's K-composition positivities (one-hot and weighted, split over two
    threads when a core is idle) and, on a rotary model, μ's pass on the reference
    (app.views.shared.rotary_reference.reference_tokens: seeded random ids, as for any model without a tokenizer) and
    the kernel peaks, each once, cold; then the detector pass with the next-token losses that the heads view asks
    for (head_table's with_loss: a full pass to the logits), which the cold table above includes and the parts and
    head_table's own line below do not. Wall and CPU seconds (all threads) side by side: on a busy machine the CPU
    seconds are the steadier figure."""
    import os

    from app.scheduling.slots import default_torch_threads
    from app.settings import Settings
    from app.views.shared.rotary_reference import reference_tokens
    from circuits_core.circuits import copying_spectra, rotary
    from circuits_core.formats.checkpoint import LoadedModel
    from circuits_core.prompt import detectors as heads
    from circuits_core.prompt import head_table
    from circuits_core.schedule import available_cores

    settings = Settings()
    threads = settings.torch_threads or default_torch_threads(settings.compute_slots)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    tokens = heads.standard_tokens(model)
    is_rotary = model.cfg.positional_embedding_type == "rotary"
    ref = reference_tokens(LoadedModel(model=model, tokenizer=None, format="qkov", digest="bench", path=Path("bench")))[
        0
    ]
    kw: dict[str, Any] = (
        dict(means=lambda: rotary.reference_means(model, ref), reference_tokens=ref.shape[1]) if is_rotary else {}
    )
    budget = settings.limits.peak_bytes
    heads_n = model.cfg.n_layers * model.cfg.n_heads
    try:
        with torch.no_grad():
            det = _timed(lambda: heads.detector_scores(model, tokens, budget_bytes=budget))
            grams = _timed(lambda: copying_spectra.embed_grams(model))
            G, G_E = (gram.to(model.W_E.dtype) for gram in grams[2])  # float64 totals, rounded once as head_table does
            gq = _timed(lambda: copying_spectra.gram_queries(model, G_E))
            ov = _timed(lambda: copying_spectra.ov_copying_scores(model, G))
            qk = _timed(lambda: copying_spectra.qk_copying_scores(model, G_E, gq[2]))
            iv = _timed(lambda: head_table.induction_view(model, tokens, det[2], ov[2], G_E, gq[2]))
            rows = [
                (f"detector pass ({tokens.shape[0]} x {tokens.shape[1]} tokens, patterns only)", det),
                ("Grams W_U W_E_eff and W_E_eff^T W_E_eff, one pass over the vocabulary", grams),
                ("G_E W_Q (QK spectra and weighted K-composition)", gq),
                (f"OV spectra ({heads_n} x d_head eigenvalues)", ov),
                (f"QK spectra ({heads_n} x d_head eigenvalues)", qk),
                ("induction view: K-composition one-hot + weighted (two threads when a core is idle)", iv),
            ]
            if is_rotary:
                mu = _timed(lambda: rotary.reference_means(model, ref))
                rows += [
                    (f"μ: pass on the reference ({ref.shape[1]} tokens; once per model: kept in the result store)", mu),
                    (
                        f"kernel peak offsets, δ 0..{min(rotary.KERNEL_WINDOW, model.cfg.n_ctx - 1)}",
                        _timed(lambda: rotary.kernel_peak_offsets(model, mu[2])),
                    ),
                ]
            losses = _timed(lambda: heads.detector_run(model, tokens, budget_bytes=budget, with_loss=True))
            whole = [_timed(lambda: head_table.head_table(model, tokens, budget_bytes=budget, **kw)) for _ in range(3)]
            libraries = _onednn_against_mkl(
                lambda: (heads.detector_scores(model, tokens, budget_bytes=budget), copying_spectra.embed_grams(model))
            )
            torch.set_num_threads(available_cores())  # what a lone computation would get with QKOV_TORCH_THREADS=cores
            t_cores = _timed(lambda: head_table.head_table(model, tokens, budget_bytes=budget, **kw))[0]
    finally:
        torch.set_num_threads(before)
    cpu = sum(r[1] for _, r in rows)
    print(
        f"  where the heads table's time goes (in process, {threads} torch thread(s) as one server computation; "
        f"load average {os.getloadavg()[0]:.2f}):"
    )
    for label, (wall, c, _) in rows:
        row(f"  {label}", wall, "", f"CPU {fmt_time(c).strip()}, {100 * c / cpu:4.0f} % of the parts' CPU")
    row(
        "  detector pass with the next-token losses (the heads view's, in place of the pass above)",
        losses[0],
        "",
        f"CPU {fmt_time(losses[1]).strip()}, {losses[1] / det[1]:.2f}x the pass without (a full pass to the logits)",
    )
    wall_med = statistics.median(w for w, _, _ in whole)
    cpu_med = statistics.median(c for _, c, _ in whole)
    row(
        "  head_table.head_table, all parts in one call (median of 3)" + (" (μ measured)" if is_rotary else ""),
        wall_med,
        "",
        f"CPU {fmt_time(cpu_med).strip()}; parts' CPU {fmt_time(cpu).strip()}, half of it "
        f"{fmt_time(cpu / 2).strip()} (both cores busy all along, from the parts timed one by one: an estimate)",
    )
    row(
        f"  head_table.head_table with {available_cores()} torch threads",
        t_cores,
        "",
        f"{wall_med / t_cores:.2f}x the {threads}-thread call",
    )
    if libraries:
        dnn, mkl = (statistics.median(libraries[name]) for name in ("oneDNN", "MKL"))
        row(
            "  detector pass + Grams, products by oneDNN (linear.py)",
            dnn,
            "",
            f"CPU; by MKL alone (oneDNN off): {fmt_time(mkl).strip()}, {mkl / dnn:.2f}x (alternated, medians of 3)",
        )


def _onednn_against_mkl(work: Any) -> dict[str, list[float]]:
    """CPU seconds of `work` with linear.py's oneDNN products and with MKL's alone (linear._ONEDNN_LINEAR off),
    alternated three times so both see the same machine; {} when this torch has no oneDNN linear."""
    from circuits_core.model import linear

    real = linear._ONEDNN_LINEAR
    if real is None:
        return {}
    cpu: dict[str, list[float]] = {"oneDNN": [], "MKL": []}
    try:
        for _ in range(3):
            for name, product in (("oneDNN", real), ("MKL", None)):
                linear._ONEDNN_LINEAR = product
                cpu[name].append(_timed(work)[1])
    finally:
        linear._ONEDNN_LINEAR = real
    return cpu


def http() -> None:
    from circuits_core.prompt.detectors import standard_tokens

    tmp = Path(tempfile.mkdtemp(prefix="qkov-bench-http-"))
    write_tl_checkpoint(tmp)
    m = f"/api/v1/models/{MODEL_ID}"
    t0 = time.perf_counter()
    with serving(tmp, cache_bytes="0", preload="true", inline_budget_s=INLINE_BUDGET_S) as server:
        print(
            f"  server ready (model loaded, one forward pass) in {time.perf_counter() - t0:.1f} s; "
            f"RSS {rss_bytes(server.pid) / GiB:.2f} GiB; result cache and store off: every request computes"
        )
        with httpx.Client(base_url=server.base, timeout=600) as client:
            heads_first, heads_med, _ = timed_get(client, f"{m}/heads", 3)
            row_first, row_med, ov = timed_get(client, f"{m}/heads/L{LAYER}H{HEAD}/ov?token={TOKEN}&k={K}", 7)
            comp_first, comp_med, comp = timed_get(client, f"{m}/composition?kind=K", 3)
    print("  through HTTP (first answer; median of the repeats after it):")
    row("GET /heads (10 x 101 detector input)", heads_med, "< 2 s", f"first {fmt_time(heads_first).strip()}")
    row(
        f"GET /heads/L{LAYER}H{HEAD}/ov?token={TOKEN}&k={K}",
        row_med,
        "< 50 ms",
        f"first {fmt_time(row_first).strip()}",
    )
    row("GET /composition?kind=K", comp_med, "< 1 s", f"first {fmt_time(comp_first).strip()}")
    heads_breakdown(gpt2_shaped_model())
    tl = tl_figures(standard_tokens(gpt2_shaped_model()))
    if not tl:
        return
    print("  TransformerLens 3.9.0, same weights, in this process (median):")
    row_ids = [e["col"]["id"] for e in ov.json()["entries"]]
    hooked = tl_model()
    assert hooked is not None
    tl_row = (hooked.W_E[TOKEN] @ hooked.OV[LAYER, HEAD] @ hooked.W_U).topk(K).indices.tolist()
    row(
        "TL W_E[t] @ OV @ W_U row, topk(20)",
        tl["ov_row"],
        "",
        f"HTTP/TL {row_med / tl['ov_row']:.2f}; same top-20 ids: {row_ids == tl_row}",
    )
    row(
        "TL run_with_cache(10 x 101 tokens), patterns",
        tl["run_with_cache"],
        "",
        f"HTTP /heads (whole table) / TL forward pass {heads_med / tl['run_with_cache']:.2f}",
    )
    if "composition" in tl:
        row(
            "TL all_composition_scores('K')",
            tl["composition"],
            "",
            f"TL/HTTP {tl['composition'] / comp_med:.1f}x (HTTP includes JSON of {len(comp.content) / 1024:.0f} KiB)",
        )


SECTIONS = {"http": http}
