"""Self-copy shares on the random GPT-2-small-shaped model (bench.engine.GPT2_SMALL, float32): one head exact (every
source row of its [50257, 50257] full OV circuit ranked) against the sampled rows the overview and head pages use
(app/views/copying.py default_rows: 1024 rows for one head, 256 each for all 144 heads, each row ranked against all
50257 columns), and all 144 heads sampled (the overview's copying panel). TransformerLens has no streamed equivalent:
its FactoredMatrix .AB of one full OV circuit is a dense 50257^2 float32 matrix (10 GB), so no TL line is printed.
"""

from __future__ import annotations

from bench import median_time, row
from bench.engine import gpt2_shaped_model
from circuits_core.circuits import copying


def run_copying(print_fn=print) -> None:  # noqa: ANN001
    from app.views.copying import default_rows

    model = gpt2_shaped_model()
    cfg = model.cfg
    n_heads = cfg.n_layers * cfg.n_heads
    rows_one, rows_all = default_rows(cfg.d_vocab, None, 1), default_rows(cfg.d_vocab, None, n_heads)
    print_fn(
        f"copying: {cfg.n_layers} x {cfg.n_heads} heads, d_vocab {cfg.d_vocab}, rows sampled {rows_one} (one head), "
        f"{rows_all} (all heads)"
    )
    one = [(cfg.n_layers - 1, 0)]
    t_exact, exact = median_time(lambda: copying.self_copy(model, k=10, heads=one), repeats=1)
    row("self-copy shares, one head, every row (exact)", t_exact)
    t_one, sampled = median_time(lambda: copying.self_copy(model, k=10, heads=one, rows=rows_one), repeats=3)
    row(
        f"self-copy shares, one head, {rows_one} rows (head page)",
        t_one,
        extra=f"x{t_exact / t_one:.0f} faster than exact",
    )
    layer, h = one[0]
    print_fn(
        f"    top-10 share: exact {float(exact.topk[layer, h]):.4f}, sampled {float(sampled.topk[layer, h]):.4f}; "
        f"diagonal > 0: exact {float(exact.diagonal_positive[layer, h]):.4f}, sampled "
        f"{float(sampled.diagonal_positive[layer, h]):.4f}"
    )
    t_all, _ = median_time(lambda: copying.self_copy(model, k=10, rows=rows_all), repeats=1)
    row(
        f"self-copy shares, all {n_heads} heads, {rows_all} rows (overview panel)",
        t_all,
        extra=f"exact would be ~{t_exact * n_heads:.0f} s",
    )


SECTIONS = {"copying": run_copying}
