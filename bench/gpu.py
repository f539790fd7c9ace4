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
  - GET /api/v1/models/{model}/heads through uvicorn with QKOV_DEVICE=cuda, cold (goal < 6 s).
Each timing is synchronised (torch.cuda.synchronize) and the first call of each is reported (cold is what a request
pays); the GPU's name and the torch/CUDA versions come first. Nothing asserts on time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.big_models import CACHE as FOLDER
from bench.big_models import LLAMA_8B, REPO, write_checkpoint

MODELS = FOLDER.parent


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

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "QKOV_DEVICE": "cuda",
        "QKOV_MODELS_DIR": str(MODELS),
        "QKOV_STORE_URL": "off",
        "QKOV_PRELOAD": "true",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 240
        while time.time() < deadline:  # preloaded: ready once the model is on the GPU
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        t0 = time.perf_counter()
        answer = httpx.get(f"{base}/api/v1/models/{model_id}/heads", timeout=120)
        seconds = time.perf_counter() - t0
        if answer.status_code != 200:
            print(f"    /heads answered {answer.status_code}: {answer.text[:300]}")
        return seconds
    finally:
        server.terminate()
        server.wait(30)


def measure() -> None:
    """The in-process goals (the model is freed when this returns, before the HTTP server loads its own)."""
    from app.views.shared.heads_table import build_heads_view
    from circuits_core.circuits import virtual_weight_table as vwt
    from circuits_core.circuits.composition_rotary import composition_profiles
    from circuits_core.circuits.copying_spectra import ov_copying_scores
    from circuits_core.formats.checkpoint import load_checkpoint
    from circuits_core.prompt.paths import expand_logits

    seconds, loaded = timed(lambda: load_checkpoint(FOLDER, device="cuda", keep_half=True))
    line("load, bf16 kept, every tensor", seconds, 30, str(loaded.provenance()))
    model = loaded.model
    with torch.no_grad():
        seconds, _ = timed(lambda: build_heads_view(loaded))
        line("heads table (as served)", seconds, 5)
        seconds, ov = timed(lambda: ov_copying_scores(model))
        exact = load_checkpoint(FOLDER, dtype=torch.float64, device="cuda", lazy_mlp=True).model
        ov64 = ov_copying_scores(exact)
        del exact
        worst = float((ov.double() - ov64).abs().max())
        line("OV copying, all heads", seconds, 1, f"largest difference from float64 {worst:.1e} (goal <= 1e-3)")
        seconds, _ = timed(lambda: composition_profiles(model))
        line("Q/K/V composition profiles, all pairs", seconds, 2)
        tokens = torch.randint(0, LLAMA_8B["vocab_size"], (128,), device="cuda", generator=None)
        seconds, _ = timed(
            lambda: expand_logits(model, tokens, 1000, max_order=2, by_source=False, max_elements=4_000_000_000)
        )
        line("order-2 path expansion, 128 tokens", seconds, 3)
        seconds, _ = timed(lambda: vwt.all_scores(model))
        line("virtual weights, all pairs", seconds, 3)


def main() -> int:
    if not torch.cuda.is_available():
        print("bench-gpu: torch sees no CUDA device on this machine; nothing to measure (the GPU goals need one)")
        return 0
    props = torch.cuda.get_device_properties(0)
    print(f"bench-gpu on {props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, TF32 matmul {torch.backends.cuda.matmul.allow_tf32}", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    write_checkpoint(FOLDER, LLAMA_8B)
    print(f"  checkpoint ready in {time.perf_counter() - t0:.0f} s ({FOLDER})", flush=True)
    measure()
    torch.cuda.empty_cache()
    line("GET /heads over HTTP, QKOV_DEVICE=cuda, cold", http_heads(FOLDER.name), 6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
