"""`make bench-gpu` (`python -m bench.gpu`): the GPU goals at Llama-3.1-8B shape, each printed next to its goal.

On a machine where torch sees no CUDA device it says so and exits 0. Otherwise, on the first CUDA device:
  - the bf16 8B-shaped checkpoint of bench/big_models.py (written once to .cache/big-models if absent);
  - load onto the GPU, bf16 kept, every tensor read (goal < 30 s);
  - the heads table as served: detectors on the standard input, copying scores, 2-D view (goal < 5 s);
  - OV copying scores of all heads (goal < 1 s), and the precision of the products: the largest difference on any
    head's score from the same scores computed in float64 (a float64 copy of the attention and embedding weights,
    its MLPs deferred) (goal <= 1e-3);
  - Q/K/V composition profiles of all pairs over the default offsets (goal < 2 s);
  - order-2 path expansion of 128 tokens (goal < 3 s);
  - virtual weights of all pairs (goal < 3 s);
  - each weight-only analysis's priced working memory beside the GPU memory it took (a minute at most);
  - GET /api/v1/models/{model}/heads through uvicorn with QKOV_DEVICE=cuda, cold (goal < 6 s).
Each timing is synchronised (torch.cuda.synchronize) and the first call of each is reported (cold is what a request
pays); the GPU's name and the torch/CUDA versions come first. Nothing asserts on time.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.big_models import CACHE as FOLDER
from bench.big_models import LLAMA_8B, LLAMA_70B, REPO, GiB, request, weight_only, write_checkpoint
from bench.server import serving

MODELS = FOLDER.parent
PRICE_TABLE_8B_S = 60  # the 8B model's price table runs this long at most (the 70B one, while the budget lasts)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def line(label: str, seconds: float, goal_s: float, extra: str = "") -> None:
    verdict = "met" if seconds < goal_s else "MISSED"
    print(f"  {label:<46} {seconds:8.3f} s   goal < {goal_s:g} s: {verdict}  {extra}".rstrip(), flush=True)


def http_heads(model_id: str) -> float:
    """Seconds of a cold GET .../heads from a fresh uvicorn serving MODELS with QKOV_DEVICE=cuda."""
    import httpx

    try:  # preloaded: ready once the model is on the GPU
        with serving(None, within_s=240, device="cuda", models_dir=str(MODELS), preload="true") as server:
            t0 = time.perf_counter()
            answer = httpx.get(f"{server.base}/api/v1/models/{model_id}/heads", timeout=120)
            seconds = time.perf_counter() - t0
    except RuntimeError as exc:  # the server stopped or missed its start: say why (its stderr), measure nothing
        print(f"    {exc}")
        return float("nan")
    if answer.status_code != 200:
        print(f"    /heads answered {answer.status_code}: {answer.text[:300]}")
    return seconds


def profiled(label: str, fn: Callable[[], Any]) -> None:
    """fn run again (warm) under cProfile and torch.profiler: the Python functions that took the wall time, the GPU
    kernels that took the device's, printed; the cProfile stats saved to QKOV_BENCH_PROFILE/<label>.prof."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    folder = Path(os.environ["QKOV_BENCH_PROFILE"])
    folder.mkdir(parents=True, exist_ok=True)
    python = cProfile.Profile()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as device:
        t0 = time.perf_counter()
        python.enable()
        fn()
        torch.cuda.synchronize()
        python.disable()
        warm = time.perf_counter() - t0
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:40]
    python.dump_stats(folder / f"{slug}.prof")
    print(f"    profile of {label} (warm, profiled: {warm:.2f} s); Python by own time:", flush=True)
    stats = pstats.Stats(python, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(14)
    print("    GPU kernels by device time:", flush=True)
    events = device.key_averages()
    key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    print(events.table(sort_by=key, row_limit=12, max_name_column_width=60), flush=True)


def goal(label: str, fn: Callable[[], Any], goal_s: float, extra: Callable[[Any], str] | None = None) -> Any:
    """fn timed cold against its goal; profiled (QKOV_BENCH_PROFILE set) when it misses."""
    seconds, out = timed(fn)
    line(label, seconds, goal_s, extra(out) if extra else "")
    if seconds >= goal_s and os.environ.get("QKOV_BENCH_PROFILE"):
        profiled(label, fn)
    return out


def measure() -> None:
    """The in-process goals (the model is freed when this returns, before the HTTP server loads its own)."""
    from app.views.shared.heads_table import build_heads_view
    from circuits_core.circuits import virtual_weight_table as vwt
    from circuits_core.circuits.composition_rotary import composition_profiles
    from circuits_core.circuits.copying_spectra import ov_copying_scores
    from circuits_core.circuits.gram_pair_sums import GRAM_BLOCK
    from circuits_core.circuits.stream_grams import block_for
    from circuits_core.formats.checkpoint import load_checkpoint
    from circuits_core.prompt.paths import expand_logits

    seconds, loaded = timed(lambda: load_checkpoint(FOLDER, device="cuda", keep_half=True))
    line("load, bf16 kept, every tensor", seconds, 30, str(loaded.provenance()))
    model = loaded.model
    with torch.no_grad():
        goal("heads table (as served)", lambda: build_heads_view(loaded), 5)
        exact = load_checkpoint(FOLDER, dtype=torch.float64, device="cuda", lazy_mlp=True).model
        ov64 = ov_copying_scores(exact)
        del exact
        torch.cuda.empty_cache()
        goal(
            "OV copying, all heads", lambda: ov_copying_scores(model), 1,
            lambda ov: f"largest difference from float64 {float((ov.double() - ov64).abs().max()):.1e} (goal <= 1e-3)",
        )  # fmt: skip
        goal("Q/K/V composition profiles, all pairs", lambda: composition_profiles(model), 2)
        tokens = torch.randint(0, LLAMA_8B["vocab_size"], (128,), device="cuda", generator=None)
        goal(
            "order-2 path expansion, 128 tokens",
            lambda: expand_logits(model, tokens, 1000, max_order=2, by_source=False, max_elements=4_000_000_000),
            3,
        )
        goal(f"virtual weights, all pairs (block {block_for(model.device)})", lambda: vwt.all_scores(model), 3)
        seconds, _ = timed(lambda: vwt.all_scores(model, block=GRAM_BLOCK))  # the CPU's block, side by side
        line(f"virtual weights, all pairs (block {GRAM_BLOCK}, the CPU's)", seconds, 3)
    print("  8B, every tensor loaded: each weight-only analysis's price beside the GPU memory it took", flush=True)
    price_table(loaded, time.perf_counter() + PRICE_TABLE_8B_S)


def measure_70b(deadline: float) -> None:
    """A checkpoint of Llama-3.1-70B's shape holding only the attention, norm, embedding and unembedding tensors
    (bf16), loaded onto the GPU with its MLPs deferred; then each weight-only analysis (declared weights="attention")
    through its builder, its priced working memory beside the GPU memory it took (torch's peak above the weights),
    while time is left before `deadline`."""
    from circuits_core.formats.checkpoint import load_checkpoint

    folder = REPO / ".cache" / "big-models-70b" / "llama-3.1-70b-attention"  # not under MODELS: never preloaded
    t0 = time.perf_counter()
    write_checkpoint(folder, LLAMA_70B, device="cuda", keep=lambda key: ".mlp." not in key)
    print(f"  70B attention-only checkpoint ready in {time.perf_counter() - t0:.0f} s", flush=True)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    seconds, loaded = timed(lambda: load_checkpoint(folder, device="cuda", keep_half=True, lazy_mlp=True))
    resident = torch.cuda.memory_allocated() - base
    print(f"  70B load, attention tensors only: {seconds:.1f} s, {resident / GiB:.1f} GiB on the GPU "
          f"({loaded.provenance()})", flush=True)  # fmt: skip
    price_table(loaded, deadline)


def price_table(loaded: Any, deadline: float) -> None:
    """Each weight-only analysis (declared weights="attention") through its builder on the loaded model, its priced
    working memory beside the GPU memory it took (torch's peak above what was allocated before), while time is left
    before `deadline`."""
    from app.settings import Limits
    from circuits_core.errors import QkovError

    free = torch.cuda.mem_get_info()[0]
    limits = Limits(max_k=200, peak_bytes=free, max_answer_bytes=2**31)
    print(f"  {'analysis':<24} {'priced':>10} {'measured':>10} {'seconds':>8}", flush=True)
    for analysis, params_class in weight_only(limits):
        if time.perf_counter() > deadline:
            print(f"  (time's up: {analysis.name} and the rest not run)", flush=True)
            break
        try:
            params = request(params_class, {"tokens": "1,2,3"}).normalised(loaded)
            priced = analysis.cost(loaded, params, limits).peak_bytes
            if priced > free:
                print(f"  {analysis.name:<24} {priced / GiB:9.2f}G  not run: over the {free / GiB:.0f} GiB free")
                continue
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            seconds, _ = timed(lambda a=analysis, p=params: a.build(loaded, p, limits))
            took = torch.cuda.max_memory_allocated() - before
            verdict = "within its price" if took <= priced else "OVER ITS PRICE"
            print(
                f"  {analysis.name:<24} {priced / GiB:9.2f}G {took / GiB:9.2f}G {seconds:8.2f}  {verdict}", flush=True
            )
        except QkovError as exc:
            print(f"  {analysis.name:<24} refused: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
        torch.cuda.empty_cache()


def main() -> int:
    if not torch.cuda.is_available():
        print("bench-gpu: torch sees no CUDA device on this machine; nothing to measure (the GPU goals need one)")
        return 0
    started = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    print(f"bench-gpu on {props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, TF32 matmul {torch.backends.cuda.matmul.allow_tf32}", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    write_checkpoint(FOLDER, LLAMA_8B, device="cuda")
    print(f"  checkpoint ready in {time.perf_counter() - t0:.0f} s ({FOLDER})", flush=True)
    measure()
    torch.cuda.empty_cache()
    line("GET /heads over HTTP, QKOV_DEVICE=cuda, cold", http_heads(FOLDER.name), 6)
    budget = float(os.environ.get("QKOV_BENCH_GPU_SECONDS", "330"))  # the 70B part runs while time is left
    if time.perf_counter() - started < budget - 60:
        measure_70b(started + budget)
    else:
        print(f"  70B part skipped: {time.perf_counter() - started:.0f} s of {budget:.0f} s used", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
