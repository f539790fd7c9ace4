"""Modern checkpoints (section `modern` of `make bench`): load time, peak memory and HTTP answers.

1. SmolLM2-135M (models/smollm2-135m, `make smollm2`): `load_checkpoint` of the Q4_1 GGUF (dequantised to
   float32, processed), each load in a fresh subprocess: median wall time of the load and the process's peak
   RSS (VmHWM: interpreter, torch and the model together). Goals: < 3 s, < 1.5 GiB. Side by side:
   transformers' own GGUF reader on the same file (`from_pretrained(folder, gguf_file=...)`), the only other
   reader of it here; TransformerLens cannot read GGUF.
2. A Llama-3.2-1B-shaped random checkpoint in bf16, written here as Hugging Face files (config.json
   model_type llama, two safetensors shards + index; 16 layers, d_model 2048, 32 heads, 8 key/value heads,
   d_head 64, d_mlp 8192, vocabulary 128,256, tied embeddings, llama3 rope scaling) and kept in
   .cache/bench/ for later runs: qkov's load (float32) in a subprocess, goals < 10 s and < 6 GiB peak RSS;
   transformers' LlamaForCausalLM.from_pretrained (float32) and TransformerLens 3.9's
   from_pretrained_no_processing("meta-llama/Llama-3.2-1B", hf_model=...) (its built-in config of that name, the
   weights from transformers' load of these files; two float32 copies, so only with >= 14 GiB available).
3. The same checkpoint served by a real uvicorn on 127.0.0.1 with the default limits (result cache and store
   off, model preloaded): a 128-token order-2 path expansion (GET .../paths?tokens=...&max_order=2; goal
   < 10 s, priced by paths.cost within the default Limits.peak_bytes), and the composition, copying and top-k
   views, each answered within the byte budget (the server's peak RSS during the request is printed beside
   Limits.peak_bytes; a dense vocab x vocab float32 matrix would be 61 GiB).

The machine is shared (2 cores, ~8 workers): the load average is printed; figures are indicative.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import torch

from bench import SMALL, fmt_time, row, sized
from bench.http import INLINE_BUDGET_S, mem_available, timed_get
from bench.load import RssSampler, rss_bytes
from bench.server import serving
from bench.term_importance import term_importance_smollm2

if TYPE_CHECKING:
    from circuits_core.model.transformer import Transformer

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = REPO / "models" / "smollm2-135m"
CACHE = REPO / ".cache" / "bench"
LLAMA_ID = sized("llama-3.2-1b-shaped-random", "llama-toy-shaped-random")
GiB = 2**30
LLAMA_1B: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_theta": 500000.0, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}  # fmt: skip
LLAMA_TOY = {**LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048}  # fmt: skip
LLAMA = sized(LLAMA_1B, LLAMA_TOY)  # the checkpoint section 2 writes (small mode: the same layout at toy size)
VIEW_HEAD = sized("L8H3", "L1H3")  # the head of the per-head views
NEEDS = sized(12 * GiB, 0)  # memory available for the 1B loads and the server, beside the rest
REQUEST_TIMEOUT_S = 300  # the bench server's deadline per request (default 120 s)
WRITTEN_MARK = "written.ok"  # the checkpoint folder is complete (a run stopped while writing leaves none)


# -- the checkpoint ----------------------------------------------------------------------------------------
def _meta_model() -> Transformer:
    """A Transformer of the LLAMA_1B config on the current (meta) device: no memory, for pricing."""
    from circuits_core.formats.llama import llama_config
    from circuits_core.model.transformer import Transformer

    return Transformer(llama_config(LLAMA))


def llama_1b_folder() -> Path:
    """The Llama-3.2-1B-shaped random bf16 checkpoint (written once: ~2.5 GB in .cache/bench/)."""
    from safetensors.torch import save_file

    folder = CACHE / LLAMA_ID
    if (folder / WRITTEN_MARK).is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    c = LLAMA
    d, L, dh = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    H, G, F, V = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"], c["vocab_size"]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:  # N(0, 0.02^2), made in float32 one tensor at a time
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map: dict[str, str] = {}
    shards = [
        ("model-00001-of-00002.safetensors", range(0, L // 2)),
        ("model-00002-of-00002.safetensors", range(L // 2, L)),
    ]
    for index, (name, layers) in enumerate(shards):
        tensors: dict[str, torch.Tensor] = {}
        if index == 0:
            tensors["model.embed_tokens.weight"] = rand(V, d)
        for layer in layers:
            p = f"model.layers.{layer}"
            tensors |= {
                f"{p}.input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
                f"{p}.post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
                f"{p}.self_attn.q_proj.weight": rand(H * dh, d), f"{p}.self_attn.k_proj.weight": rand(G * dh, d),
                f"{p}.self_attn.v_proj.weight": rand(G * dh, d), f"{p}.self_attn.o_proj.weight": rand(d, H * dh),
                f"{p}.mlp.gate_proj.weight": rand(F, d), f"{p}.mlp.up_proj.weight": rand(F, d),
                f"{p}.mlp.down_proj.weight": rand(d, F),
            }  # fmt: skip
        if index == len(shards) - 1:
            tensors["model.norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        del tensors
    total = sum((folder / name).stat().st_size for name, _ in shards)
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))
    (folder / "config.json").write_text(json.dumps(LLAMA, indent=1))
    (folder / "qkov.json").write_text(json.dumps({"processing": False}))  # weights as stored, as transformers
    (folder / WRITTEN_MARK).write_text("")
    return folder


# -- loads in a fresh process ------------------------------------------------------------------------------
def _high_water() -> int:
    """This process's peak RSS in bytes: VmHWM of its own memory map (ru_maxrss would also count the parent's
    RSS at fork time, which Linux carries across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _child(kind: str, folder: str) -> None:
    """Run in a subprocess: load once, print {"seconds", "peak_rss", "base_rss"} as JSON (bytes)."""
    torch.set_num_threads(int(os.environ.get("QKOV_BENCH_THREADS", "2")))
    if kind == "qkov":
        from circuits_core.formats.checkpoint import load_checkpoint

        def load() -> object:
            return load_checkpoint(folder)
    elif kind == "transformers":
        from transformers import AutoModelForCausalLM

        gguf = sorted(p.name for p in Path(folder).glob("*.gguf"))
        kwargs = {"gguf_file": gguf[0]} if gguf else {}

        def load() -> object:
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    else:  # TransformerLens: its own Llama-3.2-1B config (no hub), the weights from transformers' load
        from tokenizers import Tokenizer, models
        from transformer_lens import HookedTransformer
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

        words = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=words)  # a placeholder, so TL does not ask the hub

        def load() -> object:
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            return HookedTransformer.from_pretrained_no_processing(
                "meta-llama/Llama-3.2-1B", hf_model=hf, tokenizer=tokenizer, dtype=torch.float32, device="cpu"
            )

    base = _high_water()
    t0, c0 = time.perf_counter(), time.process_time()
    model = load()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = _high_water()
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None:  # qkov: a GGUF's tokenizer is built once load_checkpoint returns (formats/checkpoint.py)
        tokenizer.hf  # noqa: B018 - waits for it
    ready, ready_peak = time.perf_counter() - t0, _high_water()
    del model
    print(json.dumps({"seconds": seconds, "cpu": cpu, "peak_rss": peak, "base_rss": base,
                      "tokenizer_seconds": ready, "tokenizer_peak_rss": ready_peak}))  # fmt: skip


@dataclass(frozen=True)
class LoadFigures:
    """Medians over fresh processes of the load's wall and CPU seconds (all threads) and of when its tokenizer was
    ready; the largest peak RSS at the load's return and once the tokenizer was ready, and before the load."""

    seconds: float
    cpu: float
    peak: int
    base: int
    tokenizer_seconds: float
    tokenizer_peak: int


def measure_load(kind: str, folder: Path, repeats: int) -> LoadFigures:
    """The load's figures over `repeats` fresh processes. CPU time is what a quiet machine's wall time would be,
    roughly (no contention)."""
    results = []
    for _ in range(sized(repeats, 1)):
        out = subprocess.run(
            [sys.executable, "-m", "bench.modern", "--child", kind, str(folder)],
            cwd=REPO, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"{kind} load of {folder.name} failed: {out.stderr.strip()[-600:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return LoadFigures(
        statistics.median(r["seconds"] for r in results),
        statistics.median(r["cpu"] for r in results),
        max(r["peak_rss"] for r in results),
        max(r["base_rss"] for r in results),
        statistics.median(r["tokenizer_seconds"] for r in results),
        max(r["tokenizer_peak_rss"] for r in results),
    )


def _load_row(label: str, kind: str, folder: Path, repeats: int, goal_s: str, goal_rss: float | None) -> float:
    load = measure_load(kind, folder, repeats)
    goal = f" (goal < {goal_rss:g} GiB)" if goal_rss is not None else ""
    row(
        label,
        load.seconds,
        goal_s,
        f"CPU {load.cpu:.2f} s; peak RSS {load.peak / GiB:.2f} GiB{goal}, {load.base / GiB:.2f} before the load",
    )
    return load.seconds


def smollm2() -> None:
    if not (SMOLLM2 / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():
        raise RuntimeError(f"{SMOLLM2} has no GGUF: run `make smollm2` first")
    print(f"  {SMOLLM2.relative_to(REPO)}: Q4_1 GGUF "
          f"{sum(p.stat().st_size for p in SMOLLM2.glob('*.gguf')) / 2**20:.0f} MiB; "
          "each load in a fresh process (median of 3)")  # fmt: skip
    ours = _load_row("qkov load_checkpoint (float32, processed)", "qkov", SMOLLM2, 3, "< 3 s", 1.5)
    if SMALL:  # a reference only, and the costliest step of the section (~35 CPU s of dequantising in Python)
        print("  transformers from_pretrained(gguf_file=...): not run in small mode")
        return
    theirs = _load_row("transformers from_pretrained(gguf_file=...)", "transformers", SMOLLM2, 1, "", None)
    print(f"  load time transformers / qkov: {theirs / ours:.1f}x (transformers: one load)")


def llama_1b() -> Path:
    t0 = time.perf_counter()
    folder = llama_1b_folder()
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    print(f"  {folder.relative_to(REPO)}: {size / GiB:.2f} GiB of bf16 safetensors in 2 shards "
          f"(ready in {time.perf_counter() - t0:.1f} s); each load in a fresh process")  # fmt: skip
    if mem_available() < NEEDS:
        print(f"  skipped the loads: {mem_available() / GiB:.1f} GiB available, a float32 copy needs ~5 GiB each")
        return folder
    ours = _load_row("qkov load_checkpoint (float32, weights as stored)", "qkov", folder, 2, "< 10 s", 6.0)
    theirs = _load_row("transformers LlamaForCausalLM.from_pretrained (float32)", "transformers", folder, 1, "", None)
    print(f"  load time transformers / qkov: {theirs / ours:.1f}x (transformers: one load)")
    if SMALL:  # TransformerLens builds its own Llama-3.2-1B config, whatever the weights' size
        print("  TransformerLens skipped in small mode: it would build a 1B-parameter model")
        return folder
    if mem_available() < 14 * GiB:
        print(f"  TransformerLens skipped: {mem_available() / GiB:.1f} GiB available, it holds two float32 copies")
        return folder
    try:
        tl = _load_row(
            "TransformerLens from_pretrained_no_processing(hf_model=)", "transformer_lens", folder, 1, "", None
        )
        print(f"  load time TransformerLens (transformers' load + its conversion) / qkov: {tl / ours:.1f}x")
    except RuntimeError as exc:
        print(f"  TransformerLens could not load these weights here: {str(exc)[-300:]}")
    return folder


# -- through HTTP --------------------------------------------------------------------------------------------
def _peak_during(proc: subprocess.Popen[bytes], client: httpx.Client, url: str) -> tuple[float, int, httpx.Response]:
    """(seconds, the server's peak RSS during the request minus before it, response) of one GET."""
    before = rss_bytes(proc.pid)
    sampler = RssSampler(proc.pid, every_s=0.05)
    sampler.start()
    t0 = time.perf_counter()
    answer = client.get(url)
    seconds = time.perf_counter() - t0
    sampler.stopped.set()
    sampler.join()
    return seconds, max(sampler.peak, rss_bytes(proc.pid)) - before, answer


def served(folder: Path) -> None:
    from app.settings import Limits

    if mem_available() < NEEDS:
        print(f"  skipped: {mem_available() / GiB:.1f} GiB available; the server holds ~5 GiB of float32 weights")
        return
    from circuits_core.circuits import composition
    from circuits_core.prompt import paths

    budget = Limits().peak_bytes
    t0 = time.perf_counter()
    with serving(folder.parent, cache_bytes="0", store_url="off", preload="true", max_model_bytes=str(16 * GiB),
                 request_timeout_s=str(REQUEST_TIMEOUT_S), inline_budget_s=INLINE_BUDGET_S) as server:  # fmt: skip
        m, proc = f"/api/v1/models/{LLAMA_ID}", server.proc
        print(f"  server ready (model preloaded) in {time.perf_counter() - t0:.1f} s, RSS "
              f"{rss_bytes(proc.pid) / GiB:.2f} GiB; result cache and store off: every request computes")  # fmt: skip
        tokens = torch.randint(0, LLAMA["vocab_size"], (128,), generator=torch.Generator().manual_seed(0))
        ids = ",".join(str(int(t)) for t in tokens)
        with httpx.Client(base_url=server.base, timeout=900) as client:
            with torch.device("meta"):
                priced = paths.cost(_meta_model(), 128, 2, by_source=False, q=1, k=30).peak_bytes
            url = f"{m}/paths?tokens={ids}&max_order=2&k=30"
            first, median, answer = timed_get(client, url, 2)
            seconds, extra, _ = _peak_during(proc, client, url)
            body = answer.json()
            status = answer.status_code if answer.status_code == 200 else f"{answer.status_code} {answer.text[:160]}"
            row("GET /paths, 128 tokens, max_order=2 (HTTP)", median, "< 10 s",
                f"{status}; first {fmt_time(first).strip()}; {body.get('n_terms')} terms, {len(body.get('terms', []))} "
                f"listed; priced {priced / GiB:.2f} GiB, server +{extra / GiB:.2f} GiB during it "
                f"(Limits.peak_bytes {budget / GiB:.0f} GiB)")  # fmt: skip
            print(f"  views on the 1B shape, one request each (server peak RSS above its RSS before, against the "
                  f"default Limits.peak_bytes = {budget / GiB:.2f} GiB):")  # fmt: skip
            views = [  # cheapest first; a view over the server's request timeout answers 503
                (f"heads/{VIEW_HEAD}/ov?token=1234&k=20", "one row of the full OV circuit"),
                (f"heads/{VIEW_HEAD}/qk?token=1234&k=20", "one row of the full QK circuit"),
                (f"heads/{VIEW_HEAD}/copying", "OV copying of one head"),
                ("composition?kind=K", "all 512 x 512 head pairs"),
                (f"heads/{VIEW_HEAD}/ov?k=20", "global top-20 of the 128k x 128k OV circuit"),
                ("copying?k=10", "copying overview, every head"),
            ]
            with torch.device(
                "meta"
            ):  # the composition view's price, by the engine's cost (fewest chunks within budget)
                prices = {"composition?kind=K": composition.cost(_meta_model(), ("k",), budget).peak_bytes}
            for path, what in views:
                seconds, extra, answer = _peak_during(proc, client, f"{m}/{path}")
                within = "within" if extra <= budget else "OVER"
                status = (
                    answer.status_code if answer.status_code == 200 else f"{answer.status_code} {answer.text[:160]}"
                )
                price_note = f"priced {prices[path] / GiB:.2f} GiB, " if path in prices else ""
                row(
                    f"GET /{path}",
                    seconds,
                    "",
                    f"{status}; {price_note}+{extra / GiB:.2f} GiB ({within} budget): {what}",
                )


def modern() -> None:
    print("-- SmolLM2-135M (GGUF) --")
    smollm2()
    term_importance_smollm2()
    print("-- Llama-3.2-1B shape, random bf16 Hugging Face checkpoint --")
    folder = llama_1b()
    served(folder)


SECTIONS = {"modern": modern}


if __name__ == "__main__":  # the subprocess of measure_load
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    else:
        modern()
