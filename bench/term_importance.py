"""Term importance on the real SmolLM2-135M (printed by section `modern`): the default answer of
/term-importance (the built-in text, 51 tokens; the 16 heads model_summary.json names, both ablations; the order
reruns) against one full forward pass per rerun (the straightforward loop this replaced) and against
TransformerLens 3.9.0 hooks on the same weights (bench.rotary.tl_model), with the engine's FLOP price.

  qkov       ablation.term_importance: reruns from the first layer they change, a layer's heads in one batch,
             the order reruns beside the head ablations when a core is idle (schedule.side_by_side)
  loop       the same numbers, one full model.run per order rerun, per layer term and per ablated head
  TL         the same head ablations (not the order reruns: TL has no frozen-value rerun) with run_with_hooks:
             hook_z of the head zeroed (later patterns recomputed) and, for the frozen kind, every hook_pattern
             replaced by the clean run's; one forward pass each, return_type="loss"
Times: wall and process CPU (both threads) at the bench's torch threads; the load average beside them (the 2-core
machine is shared). Nothing asserts on time; the numbers of the three are compared.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import fmt_time, row, sized
from circuits_core.model.flops import layers_flops, unembed_flops
from circuits_core.model.transformer import Frozen, Transformer
from circuits_core.prompt import ablation

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = REPO / "models" / "smollm2-135m"


def _clock(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall s, process CPU s, result) of one call."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def _load() -> str:
    return f"load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""


def loop(
    model: Transformer, seq: torch.Tensor, heads: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order losses [L + 1], frozen [len(heads)], recomputed [len(heads)]): one full model.run per rerun and head."""
    L = model.cfg.n_layers
    clean = ablation.clean_run(model, seq)
    zero = torch.zeros_like(clean.resid_pre[0])
    value_resid, losses = dict.fromkeys(range(L), zero), []
    with torch.no_grad():
        for _ in range(L + 1):
            logits, cache = model.run(
                seq,
                names=lambda n: n.endswith("hook_resid_pre"),
                frozen=Frozen(clean.frozen.patterns, clean.frozen.ln_scales, value_resid, clean.frozen.mlp_out),
            )
            losses.append(ablation.lm_loss(logits, seq))
            value_resid = {layer: cache[f"blocks.{layer}.hook_resid_pre"] for layer in range(L)}
        for layer in range(L):  # the per-layer first-order terms: one full run each, as before
            model.run(
                seq, frozen=Frozen(clean.frozen.patterns, clean.frozen.ln_scales, {layer: zero}, clean.frozen.mlp_out)
            )
        base = clean.loss  # the clean run's lm_loss (CleanRun keeps the loss, not the logits)
        kinds = [
            torch.stack(
                [
                    ablation.lm_loss(ablation.ablate_head(model, seq, lay, h, rec, frozen=clean.frozen)[0], seq) - base
                    for lay, h in heads
                ]
            )
            for rec in (False, True)
        ]
    return torch.stack(losses), kinds[0], kinds[1]


def tl_ablations(tl: Any, seq: torch.Tensor, heads: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(frozen, recomputed) loss changes with TransformerLens hooks."""
    with torch.no_grad():
        clean_loss, cache = tl.run_with_cache(
            seq, return_type="loss", names_filter=lambda n: n.endswith("hook_pattern")
        )
        out: list[list[float]] = [[], []]
        for layer, h in heads:

            def zero_head(z: torch.Tensor, hook: Any, h: int = h) -> torch.Tensor:
                z[:, :, h] = 0
                return z

            ablate = [(f"blocks.{layer}.attn.hook_z", zero_head)]
            frozen = [(name, lambda p, hook, name=name: cache[name]) for name in cache]
            out[0].append(float(tl.run_with_hooks(seq, return_type="loss", fwd_hooks=frozen + ablate) - clean_loss))
            out[1].append(float(tl.run_with_hooks(seq, return_type="loss", fwd_hooks=ablate) - clean_loss))
    return torch.tensor(out[0], dtype=torch.float64), torch.tensor(out[1], dtype=torch.float64)


def term_importance_smollm2() -> None:
    from app.params import TermImportanceParams
    from app.settings import Settings
    from app.views.shared.default_prompt import default_text
    from app.views.shared.heads_table import build_heads_view
    from app.views.term_importance import ablated_heads, default_needs_heads
    from circuits_core.formats.checkpoint import load_checkpoint

    if not SMOLLM2.is_dir():
        print("  term importance: SmolLM2 not fetched (make smollm2): skipped", flush=True)
        return
    loaded = load_checkpoint(SMOLLM2)
    model, tok = loaded.model, loaded.tokenizer
    assert tok is not None
    seq = torch.tensor([tok.encode(default_text(loaded)[0], prepend_bos=True)])
    p = TermImportanceParams()
    # the default heads on a model this size are those its heads table's summary names, as the page reads them
    heads, _, _ = ablated_heads(loaded, p, build_heads_view(loaded) if default_needs_heads(loaded, p) else None)
    heads = sized(heads, heads[:2])  # small mode: two of the default heads
    price = ablation.cost(model, seq.shape[1], heads=heads)
    rate = Settings().compute_flops_per_s
    ablation.term_importance(model, seq, heads[:1])  # warm-up
    wall, cpu, (orders, frozen, recomputed) = _clock(lambda: ablation.term_importance(model, seq, heads))
    row(
        f"term importance, default ({seq.shape[1]} tokens, {len(heads)} heads)",
        wall,
        "< 20 s",
        f"CPU {cpu:.1f} s; priced {price.flops / 1e9:,.0f} GFLOP ({price.flops / 1e9 / cpu:.0f} GFLOP/CPU-s achieved, "
        f"{price.flops / rate:.0f} s at the server's {rate / 1e9:g} GFLOP/s); peak {price.peak_bytes / 2**20:.0f} MiB "
        f"priced; {torch.get_num_threads()} thread(s); {_load()}",
    )
    every = ablation.cost(model, seq.shape[1]).flops
    cfg, n = model.cfg, seq.shape[1]
    full_pass = layers_flops(cfg, 1, n, True, True, range(cfg.n_layers)) + unembed_flops(cfg, 1, n)
    passes = 2 * cfg.n_layers + 1 + 2 * cfg.n_layers * cfg.n_heads  # the loop: orders, layer terms, 2 per head
    deadline = Settings().request_timeout_s or float("inf")  # None: no deadline
    verdict = "refused under" if every / rate > deadline else "within"
    print(
        f"    heads=all ({cfg.n_layers * cfg.n_heads} heads) priced {every / 1e9:,.0f} GFLOP = {every / rate:.0f} s at "
        f"{rate / 1e9:g} GFLOP/s: {verdict} the {deadline:g} s deadline; the loop's {passes} full passes would be "
        f"{passes * full_pass / 1e9:,.0f} GFLOP ({passes * full_pass / every:.1f}x)",
        flush=True,
    )
    lw, lc, (l_orders, l_frozen, l_rec) = _clock(lambda: loop(model, seq, heads))
    diff = max(
        float((orders.losses - l_orders).abs().max()),
        float((frozen - l_frozen).abs().max()),
        float((recomputed - l_rec).abs().max()),
    )
    row(
        "  one full forward pass per rerun (the loop it replaced)",
        lw,
        "",
        f"CPU {lc:.1f} s; qkov {lw / wall:.1f}x faster (wall), {lc / cpu:.1f}x (CPU); largest difference {diff:.1e} "
        f"nats; {_load()}",
    )
    from bench.rotary import tl_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tl = tl_model(model)
    if tl is None:
        return
    tw, tc, (t_frozen, t_rec) = _clock(lambda: tl_ablations(tl, seq, heads))
    qw, qc, _ = _clock(
        lambda: (ablation.head_ablations(model, seq, heads), ablation.head_ablations(model, seq, heads, True))
    )
    tdiff = max(float((t_frozen - frozen).abs().max()), float((t_rec - recomputed).abs().max()))
    row(
        "  TransformerLens 3.9 hooks, the same 2 x 16 head ablations",
        tw,
        "",
        f"CPU {tc:.1f} s; qkov's head ablations alone {fmt_time(qw).strip()} (CPU {qc:.1f} s): {tw / qw:.1f}x; "
        f"largest difference {tdiff:.1e} nats; {_load()}",
    )
