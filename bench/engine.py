"""Engine benchmark (docs/maths.md §2.5-2.8) on a GPT-2-small-shaped model with random weights.

12 layers, 12 heads, d_model 768, d_head 64, d_vocab 50257, n_ctx 1024, standard positions, LN, MLPs,
biases (circuits_core.model.transformer.random_model, std_embed 0.02, float32). Sections:
  engine      (a) all 144 OV copying scores, (b) one token's top-20 row of a full OV circuit, (c) the
              global top-100 of one head's full OV circuit (50257^2 entries) with its peak extra memory;
              each against TransformerLens on the same weights when transformer-lens is installed.
  checkpoint  (d) save_checkpoint + load_checkpoint(process=True) of that model, against TransformerLens's
              load_and_process_state_dict, with the largest log-prob difference of the two processed models.
"""

from __future__ import annotations

import functools
import tempfile
import time
from typing import Any

import torch

from bench import PeakRSS, median_time, row, sized
from circuits_core.circuits import copying_spectra, embedding
from circuits_core.circuits import head_circuits as C
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer, random_model

GPT2_SMALL = ModelConfig(
    n_layers=sized(12, 2),
    d_model=sized(768, 64),
    n_heads=sized(12, 4),
    d_head=sized(64, 16),
    d_vocab=sized(50257, 2048),
    n_ctx=sized(1024, 256),
    d_mlp=sized(3072, 256),
    attn_only=False,
    act_fn="gelu_new",
    normalization_type="LN",
    positional_embedding_type="standard",
    use_bias=True,
)  # in small mode (bench.SMALL) the same architecture at toy size
LAYER, HEAD, TOKEN = sized(5, 1), 1, 1234
SUB = sized(6144, 512)  # rows of the full OV circuit for the TransformerLens global top-k reference
BUDGET = 256 * 2**20
MiB = 2**20


@functools.cache
def gpt2_shaped_model() -> Transformer:
    """The random GPT-2-small-shaped model, built once per process (other sections may reuse it)."""
    t0 = time.perf_counter()
    model = random_model(GPT2_SMALL, seed=0, dtype=torch.float32, std_embed=0.02)
    print(f"  built a random GPT-2-small-shaped model in {time.perf_counter() - t0:.1f} s", flush=True)
    return model


@functools.cache
def tl_model() -> Any | None:
    """TransformerLens HookedTransformer with the same weights, or None when not installed."""
    try:
        from transformer_lens import HookedTransformer, HookedTransformerConfig
    except ImportError:
        print("  transformer-lens is not installed: TransformerLens reference figures skipped", flush=True)
        return None
    c = GPT2_SMALL
    cfg = HookedTransformerConfig(
        n_layers=c.n_layers,
        d_model=c.d_model,
        n_heads=c.n_heads,
        d_head=c.d_head,
        d_vocab=c.d_vocab,
        n_ctx=c.n_ctx,
        d_mlp=c.d_mlp,
        act_fn=c.act_fn,
        normalization_type=c.normalization_type,
        positional_embedding_type=c.positional_embedding_type,
        init_weights=False,
        device="cpu",
        dtype=torch.float32,
    )
    tl = HookedTransformer(cfg)
    missing, unexpected = tl.load_state_dict(gpt2_shaped_model().state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith((".mask", ".IGNORE"))]
    if missing or unexpected:
        raise RuntimeError(f"TransformerLens state dict mismatch: missing {missing}, unexpected {unexpected}")
    return tl.requires_grad_(False)


def _tl_embed_eff(tl: Any) -> torch.Tensor:
    return tl.blocks[0].ln1(tl.W_E[None])[0]  # LN(W_E) with TransformerLens's own LayerNorm


def _topk_global_tl_style(full_ov: Any, k: int, rows_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a TransformerLens user would write: dense row blocks `full_OV[i:j].AB`, flat top-k, merge."""
    best_v, best_i = torch.empty(0), torch.empty(0, dtype=torch.long)
    V = full_ov.rdim
    for start in range(0, full_ov.ldim, rows_per_block):
        v, i = full_ov[start : start + rows_per_block].AB.flatten().topk(k)
        best_v, pick = torch.cat([best_v, v]).topk(k)
        best_i = torch.cat([best_i, i + start * V])[pick]
    return best_v, best_i


def run_engine() -> None:
    torch.manual_seed(0)
    model = gpt2_shaped_model()
    n_heads = GPT2_SMALL.n_layers * GPT2_SMALL.n_heads

    print("(a) eigenvalue copying score of all 144 full OV circuits, via d_head x d_head W_O (W_U W_E) W_V")
    t_all, scores = median_time(lambda: copying_spectra.ov_copying_scores(model), repeats=5)
    row("ov_copying_scores(model), 144 heads", t_all, "< 0.6 s")
    t_gram, G = median_time(lambda: copying_spectra.unembed_embed_gram(model), repeats=3)
    row("  of which G = W_U @ LN(W_E) [768, 768], once per model", t_gram)
    t_heads, _ = median_time(lambda: copying_spectra.ov_copying_scores(model, G=G), repeats=3)
    row("  the 144 heads given G", t_heads)
    print(
        f"  scores: mean {scores.mean():+.4f}, std {scores.std():.4f}, max |.| {scores.abs().max():.4f} (random null ~ "
        f"0)"
    )

    print(f"(b) top-20 row of the full OV circuit of L{LAYER}H{HEAD} for token {TOKEN}")
    t_row, (row_v, row_i) = median_time(lambda: C.full_ov_row(model, LAYER, HEAD, TOKEN).topk(20), repeats=7)
    row("full_ov_row(...).topk(20)", t_row, "< 30 ms")
    t_fm, _ = median_time(lambda: C.full_ov_circuit(model, LAYER, HEAD).topk_row(TOKEN, 20), repeats=3)
    row("full_ov_circuit(...).topk_row (builds [V, 64] factors)", t_fm)

    print(
        f"(c) global top-100 of the full OV circuit of L{LAYER}H{HEAD} over all 50257^2 entries, budget "
        f"{BUDGET // MiB} MiB"
    )
    times, peaks = [], []
    for _ in range(2):
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            glob_v, glob_r, glob_c = C.full_ov_circuit(model, LAYER, HEAD).topk_global(100, budget_bytes=BUDGET)
            times.append(time.perf_counter() - t0)
        peaks.append(mem.delta)
    t_glob = sorted(times)[0] if len(times) == 1 else sum(times) / len(times)
    row(
        "full_ov_circuit(...).topk_global(100)",
        t_glob,
        "< 3 s",
        f"peak extra RSS {max(peaks) / MiB:.0f} MiB (goal < 512 MiB); median of 2 = mean",
    )

    tl = tl_model()
    if tl is None:
        return
    from transformer_lens import FactoredMatrix as TLFactoredMatrix

    print("TransformerLens 3.9.0 on the same weights (LN(W_E) from TL's own ln1, computed outside the timings)")
    W_E_eff = _tl_embed_eff(tl)  # [V, d]
    print(f"  max |LN(W_E) qkov - TL| = {(W_E_eff - embedding.embed_eff(model)).abs().max():.2e}")

    heads = list(range(4))  # L0H0-L0H3 only: the per-head TL route costs ~10 GFLOP a head

    def tl_scores() -> torch.Tensor:
        out = []
        for h in heads:
            eig = (W_E_eff @ tl.OV[0, h] @ tl.W_U).eigenvalues  # [64], TL's FactoredMatrix, mdim = d_head
            out.append(eig.sum().real / eig.abs().sum())
        return torch.stack(out)

    t_tl, tl_s = median_time(tl_scores, repeats=1)
    t_tl_all = t_tl * n_heads / len(heads)
    row(
        f"(a) TL eigenvalues, {len(heads)} heads timed, x{n_heads // len(heads)} for 144",
        t_tl_all,
        "",
        f"qkov is {t_tl_all / t_all:.0f}x faster; max |score diff| "
        f"{(tl_s.double() - scores[0, : len(heads)]).abs().max():.1e}",
    )

    t_tl_row, (tl_v, tl_i) = median_time(lambda: (W_E_eff[TOKEN] @ tl.OV[LAYER, HEAD] @ tl.W_U).topk(20), repeats=7)
    row(
        "(b) TL (W_E[t] @ model.OV[l, h] @ W_U).topk(20)",
        t_tl_row,
        "",
        f"ratio TL/qkov {t_tl_row / t_row:.2f}; same tokens {torch.equal(tl_i, row_i)}; "
        f"max |diff| {(tl_v - row_v).abs().max():.1e}",
    )
    t_tl_arena, _ = median_time(lambda: (W_E_eff @ tl.OV[LAYER, HEAD] @ tl.W_U)[TOKEN].AB.topk(20), repeats=3)
    row("(b) TL ARENA idiom (W_E @ OV @ W_U)[t].AB", t_tl_arena, "", f"ratio TL/qkov {t_tl_arena / t_row:.0f}")

    # (c) on the first SUB rows only (TL's route is slow): both engines on the same sub-matrix, same run.
    full_ov = W_E_eff[:SUB] @ tl.OV[LAYER, HEAD] @ tl.W_U  # TL FactoredMatrix [SUB, V], mdim 64
    assert isinstance(full_ov, TLFactoredMatrix)
    ours = C.full_ov_circuit(model, LAYER, HEAD)
    ours = FactoredMatrix(ours.A[:SUB], ours.B)
    t_sub, (sub_v, sub_r, sub_c) = median_time(lambda: ours.topk_global(100, budget_bytes=BUDGET), repeats=1)
    rows_per_block = ours.rows_per_block(BUDGET, copies=2)
    with PeakRSS() as mem:
        t_tl_glob, (tl_gv, tl_gi) = median_time(lambda: _topk_global_tl_style(full_ov, 100, rows_per_block), repeats=1)
    same = torch.equal(tl_gi, sub_r * GPT2_SMALL.d_vocab + sub_c)
    row(
        f"(c) TL row blocks full_OV[i:j].AB + flat topk, {SUB} rows",
        t_tl_glob,
        "",
        f"qkov on the same rows {t_sub:.2f} s: ratio TL/qkov {t_tl_glob / t_sub:.1f}; TL peak extra "
        f"{mem.delta / MiB:.0f} MiB; same entries {same}; max |diff| {(tl_gv - sub_v).abs().max():.1e}",
    )


def run_checkpoint() -> None:
    try:
        from circuits_core.formats.checkpoint import load_checkpoint
        from circuits_core.formats.qkov_format import save_checkpoint
    except ImportError as exc:
        print(f"  circuits_core.formats.checkpoint is not available ({exc}): skipped")
        return
    model = gpt2_shaped_model()
    with tempfile.TemporaryDirectory() as folder:
        t_save, _ = median_time(lambda: save_checkpoint(model, folder), repeats=1)
        row("(d) save_checkpoint (qkov format, safetensors, 650 MB)", t_save)
        for process in (False, True):
            with PeakRSS() as mem:
                t_load, loaded = median_time(
                    lambda p=process: load_checkpoint(folder, dtype=torch.float32, process=p), repeats=2
                )
            row(f"(d) load_checkpoint(process={process})", t_load, "", f"peak extra RSS {mem.delta / MiB:.0f} MiB")
        tl = tl_model()
        if tl is None:
            return
        from safetensors.torch import load_file

        def tl_load() -> None:
            tl.load_and_process_state_dict(load_file(f"{folder}/model.safetensors"))

        t_tl, _ = median_time(tl_load, repeats=1)
        tl_model.cache_clear()  # the TL model is now processed: later sections must rebuild it
        row("(d) TL load_file + load_and_process_state_dict", t_tl, "", f"ratio TL/qkov {t_tl / t_load:.2f}")
        tokens = torch.randint(0, GPT2_SMALL.d_vocab, (1, 64), generator=torch.Generator().manual_seed(0))
        ours = loaded.model.run(tokens)[0].log_softmax(-1)
        theirs = tl(tokens).log_softmax(-1)
        raw = model.run(tokens)[0].log_softmax(-1)
        print(
            f"  max |log-prob diff|: processed qkov vs processed TL {(ours - theirs).abs().max():.1e}, "
            f"processed vs unprocessed qkov {(ours - raw).abs().max():.1e} (float32)"
        )


SECTIONS = {"engine": run_engine, "checkpoint": run_checkpoint}
