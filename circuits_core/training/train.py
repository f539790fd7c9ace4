"""Training the shipped toy models: attention-only transformers of 0, 1 and 2 layers on the stdlib corpus.

Paper context (Elhage et al. 2021): the paper's toy models are attention-only, without biases, with
positions only in the query and key inputs ("shortformer"), so the residual stream carries tokens alone and
W_E W_V W_O W_U is exactly a head's OV circuit. qkov trains such models itself (circuits_core.training.corpus for the
data) and ships them with a model card of what circuits_core.prompt.phenomena measures.

    python -m circuits_core.training.train <toy-0l|toy-1l|toy-2l|all> --out checkpoints [--device cpu|cuda]
    python -m circuits_core.training.train measure checkpoints/toy-2l     # refresh a card's measurements

What a run is (shape, optimiser, batches, seed) and the model it starts from are recipes.py's. Training uses
`training_logits` (F.scaled_dot_product_attention over the same parameters); tests check it
against `Transformer.run`. Learning rate: linear warmup then constant, so a run stopped at step S equals a
run planned for S steps. Everything is seeded: init (circuits_core.model.transformer.init_weights), batches (numpy
PCG64).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from circuits_core.model.alibi import alibi_kernel
from circuits_core.model.transformer import Block, Transformer
from circuits_core.prompt.phenomena import TOKEN_COUNTS_FILE, EvalData, check_thresholds, quick_metrics
from circuits_core.training.corpus import Corpus, load_or_build, write_manifest
from circuits_core.training.recipes import RECIPES, Recipe, make_model
from circuits_core.training.toy_card import DESCRIPTIONS, NOTES, first_crossings, remeasure, save_toy


def training_logits(model: Transformer, tokens: Tensor) -> Tensor:
    """Logits [batch, pos, d_vocab] of an attention-only, LayerNorm-free, bias-free model via SDPA.

    Same parameters and maths as `model.run` (shortformer: q/k read resid + W_pos, v reads resid; ALiBi: the
    kernel −m_h (i − j) joins the causal mask as an additive bias); other architectures fall back to `model.run`.
    """
    cfg = model.cfg
    if (
        not cfg.attn_only
        or cfg.normalization_type is not None
        or cfg.use_bias
        or cfg.positional_embedding_type not in ("shortformer", "none")
    ):
        return model.run(tokens)[0]
    x = model.W_E[tokens]  # [b, n, d]
    pos = model.W_pos[: tokens.shape[1]] if model.W_pos is not None else 0.0
    mask = None  # [H, n, n] additive: −m_h (i − j) where j <= i, −inf above the diagonal
    if cfg.alibi is not None:
        n = tokens.shape[1]
        seen = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
        mask = alibi_kernel(cfg, n, tokens.device).to(x.dtype).masked_fill(~seen, float("-inf"))
    for block in cast("Iterable[Block]", model.blocks):  # nn.ModuleList iterates as plain Modules
        a = block.attn
        qk_in = x + pos
        q = torch.einsum("bpd,hde->bhpe", qk_in, a.W_Q)  # [b, H, n, dh]
        k = torch.einsum("bpd,hde->bhpe", qk_in, a.W_K)
        v = torch.einsum("bpd,hde->bhpe", x, a.W_V)
        z = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=1.0 / cfg.scale
        )  # [b, H, n, dh]
        x = x + torch.einsum("bhpe,hed->bpd", z, a.W_O)
    return x @ model.W_U


class Batches:
    """Seeded training rows: EOT + (n_ctx - 1) tokens from a random offset, or BOS + r + r + ... (truncated)."""

    def __init__(self, train: np.ndarray, recipe: Recipe, eot: int, rep_vocab: np.ndarray):
        self.train, self.r, self.eot, self.rep_vocab = train, recipe, eot, rep_vocab
        self.rng = np.random.Generator(np.random.PCG64(recipe.seed))

    def next(self) -> Tensor:
        r, rng, span = self.r, self.rng, self.r.n_ctx - 1
        rows = np.empty((r.batch, r.n_ctx), dtype=np.int64)
        rows[:, 0] = self.eot
        offsets = rng.integers(0, len(self.train) - span, r.batch)
        repeat = rng.random(r.batch) < r.repeat_frac
        for i in range(r.batch):
            if repeat[i]:
                seq = self.rep_vocab[rng.integers(0, len(self.rep_vocab), rng.integers(r.repeat_min, r.repeat_max + 1))]
                rows[i, 1:] = np.tile(seq, span // len(seq) + 1)[:span]
            else:
                rows[i, 1:] = self.train[offsets[i] : offsets[i] + span]
        return torch.from_numpy(rows)


def train(
    name: str,
    recipe: Recipe,
    corpus: Corpus,
    out: Path,
    device: str,
    max_minutes: float | None = None,
    snapshots: bool = False,
    progress: bool = True,
    stop: threading.Event | None = None,
) -> dict:
    """Train, evaluate every `eval_every` steps, save the checkpoint with its model card; returns the card.

    The run ends early, evaluated and saved like a finished one, after `max_minutes` or once `stop` is set."""
    torch.manual_seed(recipe.seed)
    eval_data = EvalData(corpus.val, corpus.train_counts(), corpus.eot)
    model = make_model(recipe, corpus.tokenizer.get_vocab_size(), corpus.eot, out).to(device)
    decay = [p for n, p in model.named_parameters() if not n.startswith(("embed.", "pos_embed."))]
    no_decay = [p for n, p in model.named_parameters() if n.startswith(("embed.", "pos_embed."))]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, recipe.beta2),
        fused=device.startswith("cuda"),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / recipe.warmup))
    batches = Batches(corpus.train, recipe, corpus.eot, eval_data.rep_vocab().numpy())
    history: list[dict] = []
    first: dict[str, dict] = {}
    met_step: int | None = None
    saved: set[str] = set()
    start, cpu_start = time.perf_counter(), time.process_time()
    bar = _bar(recipe.steps, name, progress)
    step, loss_avg = 0, float("nan")
    for step in range(1, recipe.steps + 1):
        tokens = batches.next().to(device, non_blocking=True)
        logits = training_logits(model, tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        sched.step()
        timed_out = (max_minutes is not None and time.perf_counter() - start > 60 * max_minutes) or (
            stop is not None and stop.is_set()
        )
        is_eval = step % recipe.eval_every == 0 or step == recipe.steps or timed_out
        if step % 50 == 0 or is_eval:
            loss_avg = float(loss.detach())
            bar.set_postfix(loss=f"{loss_avg:.3f}")
        bar.update(1)
        if is_eval:
            minutes = (time.perf_counter() - start) / 60
            row = {
                "step": step,
                "minutes": round(minutes, 3),
                "train_loss": round(loss_avg, 4),
                **quick_metrics(model, eval_data),
            }
            checks = check_thresholds(recipe.n_layers, row, alibi=recipe.alibi is not None)
            row["met"] = bool(checks) and all(checks.values())
            history.append(row)
            first = first_crossings(history, recipe.n_layers, recipe.alibi is not None)
            bar.write(json.dumps(row))
            tag = "met" if met_step is None else "met2"
            if snapshots and row["met"] and (met_step is None or step >= 2 * met_step) and tag not in saved:
                saved.add(tag)
                met_step = met_step or step
                _finish(
                    name,
                    recipe,
                    model,
                    corpus,
                    eval_data,
                    out / f"{name}-{tag}",
                    step,
                    start,
                    device,
                    history,
                    first,
                    cpu_start,
                )
            if timed_out:
                break
    bar.close()
    return _finish(name, recipe, model, corpus, eval_data, out / name, step, start, device, history, first, cpu_start)


def _bar(total: int, name: str, enabled: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        enabled = False
    if not enabled:

        class _Quiet:
            def update(self, n: int) -> None: ...
            def set_postfix(self, **kw: Any) -> None: ...
            def write(self, s: str) -> None:
                print(s, file=sys.stderr, flush=True)

            def close(self) -> None: ...

        return _Quiet()
    return tqdm(total=total, desc=name, mininterval=2.0, file=sys.stderr)


def _finish(
    name: str,
    recipe: Recipe,
    model: Transformer,
    corpus: Corpus,
    eval_data: EvalData,
    folder: Path,
    step: int,
    start: float,
    device: str,
    history: list[dict],
    first: dict[str, dict],
    cpu_start: float,
) -> dict:
    wall = time.perf_counter() - start
    card = {
        "name": name,
        "description": DESCRIPTIONS.get(name, ""),
        "recipe": {**dataclasses.asdict(recipe), "steps": step},
        "data": corpus.stats(),
        "training": {
            "steps": step,
            "tokens_seen": step * recipe.batch * recipe.n_ctx,
            "wall_seconds": round(wall, 1),
            # CPU time of this process (evaluations included): on a shared machine the wall time depends on the
            # other jobs, which the load average at the end describes
            "cpu_seconds": round(time.process_time() - cpu_start, 1),
            "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
            "device": torch.cuda.get_device_name(0)
            if device.startswith("cuda")
            else f"cpu ({torch.get_num_threads()} threads)",
            "torch": torch.__version__,
            "final_train_loss": history[-1]["train_loss"] if history else None,
        },
        "first_crossed": first,
        "notes": NOTES.get(name, ""),
        "history": history,
    }
    save_toy(folder, model, corpus.tokenizer, card)
    write_manifest(corpus, folder.parent / "corpus_manifest.json")
    eval_data.save(folder.parent / "eval_data.npz")
    np.save(folder / TOKEN_COUNTS_FILE, eval_data.train_counts.astype(np.int64))  # the model's own counts
    return remeasure(folder)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m circuits_core.training.train", description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="toy-0l | toy-1l | toy-2l | all | measure")
    p.add_argument("folder", nargs="?", help="checkpoint folder (for `measure`)")
    p.add_argument("--out", type=Path, default=Path("checkpoints"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--corpus", type=Path, default=None, help="cache folder of the tokenized corpus (built if missing)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--snapshots", action="store_true", help="also save when all thresholds are first met (and at 2x)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a recipe field")
    p.add_argument("--save-as", default=None, help="folder name under --out (default: the recipe name)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    stop = threading.Event()  # Ctrl-C or kill: the run ends after its current step, evaluated and saved
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.name == "measure":
        print(json.dumps(remeasure(Path(args.folder))["phenomena"], indent=1))
        return 0
    names = list(RECIPES) if args.name == "all" else [args.name]
    corpus = load_or_build(args.corpus)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        recipe = RECIPES[name]
        overrides = {k: v for k, v in (s.split("=", 1) for s in args.set)}
        fields = {f.name: f.type for f in dataclasses.fields(Recipe)}
        # Field names come from the command line, so the values can only be typed per field at run time.
        parsed: dict[str, Any] = {
            k: (float(v) if fields[k] == "float" else int(v) if fields[k] == "int" else v) for k, v in overrides.items()
        }
        recipe = dataclasses.replace(recipe, **parsed)
        if args.steps:
            recipe = dataclasses.replace(recipe, steps=args.steps)
        card = train(
            args.save_as or name,
            recipe,
            corpus,
            args.out,
            args.device,
            args.max_minutes,
            args.snapshots,
            not args.no_progress,
            stop,
        )
        print(
            json.dumps(
                {"name": card["name"], "phenomena": card["phenomena"], "first_crossed": card["first_crossed"]}, indent=1
            )
        )
        if stop.is_set():  # the models after a stopped one are not started
            break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
