"""Llama-3.1-8B and 70B shapes on one box (sections `llama-8b-cpu` and `llama-70b-prices` of `make bench`).

`llama-8b-cpu`: a bf16 safetensors checkpoint of Llama-3.1-8B shape (32 layers, 32 heads, 8 key/value heads,
d_model 4096, d_mlp 14336, vocabulary 128,256; random N(0, 0.02) weights, RMS weights 1) is written once to
.cache/big-models/llama-3.1-8b-shape (~16 GB, gitignored; run the bench under `flock /work/coord/heavy.lock` on a shared
machine), then, in a child process so its peak RSS is its own:
  - the attention-only load: memory-mapped shards, bf16 kept, MLP weights deferred (formats/lazy_mlp.py), with the
    bytes read from the shards counted (goal < 60 s, peak RSS < 12 GiB);
  - all-pairs K-composition (composition_scores, kinds K; goal < 3 min);
  - one OV row W_E[t] W_OV W_U of one head over the vocabulary (goal < 1 s);
  and that the MLP weights were never read.
`llama-70b-prices`: for Llama-3.1-70B's shape (80 layers x 64 heads, 8 key/value heads, d_model 8192, d_mlp 28672,
vocabulary 128,256), built on the meta device (no memory), the weights a weight-only analysis reads (bf16) and the
working memory each analysis declared weights="attention" would take, from its own price function; the 8B shape's
beside it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import SMALL, row, sized

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "big-models" / "llama-3.1-8b-shape"  # (also the models folder bench/gpu.py serves)
GiB = 2**30
LLAMA_8B: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
    "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, "torch_dtype": "bfloat16",
}  # fmt: skip
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64}  # fmt: skip
LLAMA_TINY = {**LLAMA_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1024}  # fmt: skip
LAYERS_PER_SHARD = 4
OV_ROW = sized((20, 5, 1000), (5, 5, 1000))  # layer, head, token of the timed OV row


def hf_tensors(cfg: dict[str, Any], layer: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of one layer's tensors."""
    d, dm, H, G = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh, p = d // H, f"model.layers.{layer}"
    return {
        f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,),
        f"{p}.self_attn.q_proj.weight": (H * dh, d), f"{p}.self_attn.k_proj.weight": (G * dh, d),
        f"{p}.self_attn.v_proj.weight": (G * dh, d), f"{p}.self_attn.o_proj.weight": (d, H * dh),
        f"{p}.mlp.gate_proj.weight": (dm, d), f"{p}.mlp.up_proj.weight": (dm, d), f"{p}.mlp.down_proj.weight": (d, dm),
    }  # fmt: skip


def write_checkpoint(
    folder: Path, cfg: dict[str, Any], seed: int = 0, device: str = "cpu", keep: Callable[[str], bool] | None = None
) -> None:
    """A random bf16 sharded safetensors checkpoint of this config (skipped when its index is already there): the
    weights drawn on `device` (a GPU draws 16 GB in a second, a CPU core in a minute), only the tensors `keep` names
    when given (bench/gpu.py writes a 70B model's attention tensors alone)."""
    from safetensors.torch import save_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    V, d, L = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    groups: list[dict[str, tuple[int, ...]]] = [{"model.embed_tokens.weight": (V, d)}]
    for start in range(0, L, LAYERS_PER_SHARD):
        groups.append(
            {
                k: s
                for layer in range(start, min(L, start + LAYERS_PER_SHARD))
                for k, s in hf_tensors(cfg, layer).items()
                if keep is None or keep(k)
            }
        )
    groups.append({"model.norm.weight": (d,), "lm_head.weight": (V, d)})
    weight_map = {}
    t0 = time.perf_counter()
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for key, shape in group.items():
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            tensors[key] = (t.fill_(1.0) if len(shape) == 1 else t.normal_(0.0, 0.02, generator=gen)).cpu()
        save_file(tensors, str(folder / f"{name}.part"), metadata={"format": "pt"})
        os.replace(folder / f"{name}.part", folder / name)
        weight_map |= dict.fromkeys(group, name)
        print(f"    wrote {name} ({time.perf_counter() - t0:.0f} s)", flush=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def measure_8b(folder: Path) -> dict[str, Any]:
    """In this (child) process: the load, the two analyses, what was read; figures as a dict."""
    from circuits_core.circuits.composition import composition_scores
    from circuits_core.circuits.head_circuits import full_ov_row
    from circuits_core.formats import llama
    from circuits_core.formats.checkpoint import load_checkpoint
    from circuits_core.formats.lazy_mlp import weight_bytes

    read: list[int] = []
    original = llama._MappedFile.read

    def counted(self: Any, key: str, dtype: torch.dtype, layout: Any) -> torch.Tensor:
        out = original(self, key, dtype, layout)
        read.append(out.numel() * out.element_size())
        return out

    llama._MappedFile.read = counted  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    loaded = load_checkpoint(folder, keep_half=True, lazy_mlp=True)
    out["load_s"] = time.perf_counter() - t0
    out["load_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = loaded.model
    out["read_bytes"], out["resident"], out["deferred"] = (
        sum(read),
        weight_bytes(model, False),
        weight_bytes(model, True),
    )
    out["provenance"] = loaded.provenance()
    print(json.dumps(out), flush=True)  # each figure as soon as it is measured (a later failure keeps it)
    with torch.no_grad():
        t0 = time.perf_counter()
        full_ov_row(model, *OV_ROW)
        out["ov_row_s"] = time.perf_counter() - t0
        print(json.dumps(out), flush=True)
        t0 = time.perf_counter()
        composition_scores(model, kinds=("k",))
        out["k_comp_s"] = time.perf_counter() - t0
    out["mlp_after"] = loaded.provenance()["mlp_weights"]
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def run_8b() -> None:
    if SMALL:  # the same steps on a Llama of toy size, written to a temporary folder
        with tempfile.TemporaryDirectory() as folder:
            write_checkpoint(Path(folder), LLAMA_TINY)
            measure_in_child(Path(folder))
        return
    stat = os.statvfs(REPO / ".cache" if (REPO / ".cache").exists() else REPO)
    free = stat.f_bavail * stat.f_frsize
    if not (CACHE / "model.safetensors.index.json").is_file():
        if free < 20 * GiB:
            print(f"  skipped: {free / GiB:.0f} GiB free, the 8B-shaped checkpoint needs ~16 GiB", flush=True)
            return
        print(f"  writing the 8B-shaped bf16 checkpoint to {CACHE} (once)", flush=True)
        write_checkpoint(CACHE, LLAMA_8B)
    measure_in_child(CACHE)


def measure_in_child(folder: Path) -> None:
    """measure_8b(folder) in a child process (its peak RSS is its own), and its figures printed."""
    code = (
        "import json, sys, pathlib, bench.big_models as b; print(json.dumps(b.measure_8b(pathlib.Path(sys.argv[1]))))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code, str(folder)], cwd=REPO, capture_output=True, text=True, check=False
    )
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode:
        print(f"  the 8B measurement failed; figures so far: {lines[-1] if lines else 'none'}", flush=True)
        print(child.stderr[-3000:], flush=True)
        raise RuntimeError("the 8B measurement failed")
    f = json.loads(lines[-1])
    load = os.getloadavg()[0]
    row(
        "attention-only load (bf16, mmap, MLP deferred)",
        f["load_s"],
        "< 60 s",
        f"peak RSS {f['load_rss'] / GiB:.2f} GiB (goal < 12 GiB)",
    )
    print(f"    read from the shards: {f['read_bytes'] / GiB:.2f} GiB; resident weights {f['resident'] / GiB:.2f} GiB, "
          f"MLP weights deferred {f['deferred'] / GiB:.2f} GiB; {f['provenance']}", flush=True)  # fmt: skip
    row("all-pairs K-composition (992 x 1024 heads)", f["k_comp_s"], "< 3 min")
    row(f"one OV row, L{OV_ROW[0]}H{OV_ROW[1]}, token {OV_ROW[2]} (128,256 logits)", f["ov_row_s"], "< 1 s")
    print(f"    MLP weights after both: {f['mlp_after']}; process peak RSS {f['peak_rss'] / GiB:.2f} GiB; load average "
          f"{load:.1f}", flush=True)  # fmt: skip


REQUEST = {"head": "L1H0", "source": "L0H1", "target": "L1H2", "heads": "L0H1,L1H2"}  # one head, one pair


def weight_only(limits: Any) -> list[tuple[Any, Any]]:
    """(analysis, its params class bound to `limits`) for every model analysis declared weights="attention"."""
    from app.analysis import BoundAnalyses
    from app.catalog import ANALYSES

    analyses = [a for a in ANALYSES if a.scope == "model" and a.weights == "attention"]
    bound = BoundAnalyses(analyses, limits)
    return [(a, bound.bound(a)) for a in analyses]


def request(params_class: Any, extra: dict[str, str] | None = None) -> Any:
    """The benches' request of an analysis (REQUEST, and `extra`), as far as its params take those fields; raises
    what validation raises."""
    values, fields = REQUEST | (extra or {}), params_class.model_fields
    return params_class.model_validate({k: v for k, v in values.items() if k in fields})


def price_table(hf: dict[str, Any], label: str) -> None:
    """The weights a weight-only analysis reads and each attention-only analysis's priced working memory."""
    from app.settings import Limits
    from circuits_core.formats.checkpoint import LoadedModel
    from circuits_core.formats.lazy_mlp import mlp_bytes
    from circuits_core.formats.llama import llama_config
    from circuits_core.formats.statedict import load_bytes
    from circuits_core.model.transformer import Transformer

    cfg = llama_config(hf)
    with torch.device("meta"):
        model = Transformer(cfg).to(torch.bfloat16)
    loaded = LoadedModel(model=model, tokenizer=None, format="llama")
    total, mlp = load_bytes(cfg, torch.bfloat16), mlp_bytes(cfg, torch.bfloat16)
    print(f"  {label}: all weights {total / GiB:.1f} GiB bf16; attention + norms + embeddings "
          f"{(total - mlp) / GiB:.1f} "
          "GiB (what the weight circuits load); working memory per analysis (price functions, bf16 "
          "weights):", flush=True)  # fmt: skip
    limits = Limits(max_k=200)
    for analysis, params_class in weight_only(limits):
        try:
            params = request(params_class)
            cost = analysis.cost(loaded, params, limits)
            print(f"    {analysis.name:<22} {cost.peak_bytes / GiB:8.2f} GiB  answer {cost.answer_bytes / 2**20:7.2f} "
                  f"MiB",
                  flush=True)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a price that needs real weights is reported, not fatal
            print(f"    {analysis.name:<22} not priced on the meta device: {type(exc).__name__}: {str(exc)[:90]}")


def run_prices() -> None:
    price_table(LLAMA_8B, "Llama-3.1-8B shape")
    price_table(LLAMA_70B, "Llama-3.1-70B shape")


SECTIONS = {"llama-8b-cpu": run_8b, "llama-70b-prices": run_prices}
