"""Copying, measured three ways for every head, beside what random weights of the same shapes give.

Paper section: "Detecting copying" and "Summarizing OV/QK matrices" (Elhage et al. 2021; docs/maths.md §2.7,
2.8). Row-vector convention: the full OV circuit of head h is M = W_E_eff W_V W_O W_U [V, V], row a = the
logit effect of attending to token a (circuits.full_ov_circuit). Three summaries of "M copies":
- the eigenvalue score sum(lambda) / sum(|lambda|) (circuits.ov_copying_scores), which can be near +1 while
  almost no token raises its own logit most: it weighs the few large eigen-directions, not the tokens;
- self-copy shares: the fraction of source tokens a whose own logit is the largest of row a (top-1) or
  among its k largest (top-k);
- the diagonal: the fraction of tokens with M[a, a] > 0 and its median.
With `vocab` (token ids, e.g. the tokens seen often in training) rows and columns are restricted to those
tokens: "among frequent tokens, does a raise a most?" (rare tokens are under-trained and dominate the rest).
With `rows` (a number of source tokens) the shares and diagonal are measured on that many source tokens drawn
uniformly without replacement (seeded), each row still ranked against every column: an unbiased estimate whose
standard error is sqrt(p (1 - p) / rows) at most. A GPT-2-sized vocabulary costs a [50k, 50k] row stream per
head for the exact shares (~1.8 s); 1024 rows cost ~1/50 of it, the factor W_O W_U [d_head, V] aside.

The baseline: random W_V [d_model, d_head] and W_O [d_head, d_model] (standard normal; every summary above is
invariant to their scale) through the model's own W_E_eff and W_U, so it answers "what would a head of these
shapes that learned nothing about copying score on this model's embeddings?".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.copying_spectra import copying_score, model_gram_cost, unembed_embed_gram
from circuits_core.circuits.factored import DEFAULT_BUDGET_BYTES, FactoredMatrix
from circuits_core.circuits.head_circuits import (
    factors_cost,
    full_ov_circuit,
    full_ov_flops,
    ov_circuit,
    token_factors_cost,
)
from circuits_core.circuits.host_linalg import eigvals
from circuits_core.circuits.ov_row_ranks import (  # noqa: F401 - copying's own names, read as copying.X
    BLOCK_BYTES,
    STACK_CIRCUITS,
    RowRanks,
    row_ranks,
    row_ranks_flops,
    rows_ranks,
    stacked_bytes,
)
from circuits_core.circuits.own_rank import count_above, probe_columns, probe_size
from circuits_core.cost import Cost, check_stop, float64_copy_size
from circuits_core.errors import InvalidInputError
from circuits_core.model.head_names import all_heads
from circuits_core.model.transformer import Transformer


@dataclass
class SelfCopy:
    """Per-head self-copy shares and diagonal statistics of the full OV circuits, all [n_layers, n_heads]."""

    top1: Tensor  # share of source tokens whose own logit is the largest of their row
    topk: Tensor  # share of source tokens whose own logit is among the k largest of their row
    diagonal_positive: Tensor  # share of tokens a with M[a, a] > 0
    diagonal_median: Tensor  # median of M[a, a]
    k: int
    n_tokens: int  # tokens ranked (d_vocab, or len(vocab))
    n_rows: int  # source tokens measured (n_tokens, or a seeded sample of `rows` of them)
    seed: int | None  # the sample's seed (None: every source token)


@dataclass
class CopyingBaseline:
    """The same summaries for random OV weights of the model's shapes (n samples each)."""

    ov_copying: Tensor  # [n_samples] eigenvalue copying scores
    top1: Tensor  # [n_top_samples]
    topk: Tensor  # [n_top_samples]
    diagonal_positive: Tensor  # [n_top_samples]
    k: int
    n_tokens: int
    n_rows: int


def sample_order(n: int, rows: int | None, seed: int = 0) -> Tensor:
    """Positions [r] (into the n ranked tokens) of the source rows measured, in the order drawn: all n in order when
    rows is None or >= n, else the first `rows` of torch.randperm(n) from torch.Generator().manual_seed(seed). A smaller
    sample of the same seed is a prefix of a larger one, so its rows can be read off the larger one's
    (RowRanks.first)."""
    if rows is None or rows >= n:
        return torch.arange(n)
    if rows < 1:
        raise InvalidInputError(f"rows must be >= 1 (source tokens sampled), got {rows}")
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:rows]


def _check_vocab(model: Transformer, vocab: Tensor | None, k: int) -> int:
    n = model.cfg.d_vocab if vocab is None else int(vocab.numel())
    if vocab is not None and (
        vocab.dim() != 1 or n == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= model.cfg.d_vocab
    ):
        raise InvalidInputError(
            f"vocab must be a non-empty 1-D list of token ids in [0, {model.cfg.d_vocab}), got {tuple(vocab.shape)}"
        )
    if not 1 <= k <= n:
        raise InvalidInputError(f"k must be in [1, {n}] (the tokens ranked), got {k}")
    return n


def self_copy(
    model: Transformer,
    k: int = 10,
    vocab: Tensor | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    rows: int | None = None,
    seed: int = 0,
    heads: list[tuple[int, int]] | None = None,
) -> SelfCopy:
    """Top-1 / top-k self-copy shares and diagonal statistics of every head's full OV circuit (or of `heads` only:
    the others are NaN), over every source token or a seeded sample of `rows` of them."""
    n = _check_vocab(model, vocab, k)
    cfg = model.cfg
    order = sample_order(n, rows, seed)  # [r]
    out = torch.full(
        (4, cfg.n_layers, cfg.n_heads), float("nan"), dtype=torch.float64
    )  # top1, topk, diag > 0, diag median
    todo = heads if heads is not None else all_heads(cfg)
    with torch.no_grad():
        for start in range(0, len(todo), STACK_CIRCUITS):  # a batch of heads ranked together (ov_row_ranks)
            batch = todo[start : start + STACK_CIRCUITS]
            ovs = [ov_circuit(model, layer, h) for layer, h in batch]  # W_V [d, d_head], W_O [d_head, d] each
            ranks = rows_ranks(model, [(ov.A, ov.B) for ov in ovs], k, order, vocab, budget_bytes)
            for (layer, h), ranked in zip(batch, ranks, strict=True):
                out[:, layer, h] = ranked.shares()
    return SelfCopy(out[0], out[1], out[2], out[3], k, n, len(order), None if len(order) == n else seed)


def random_ov_weights(model: Transformer, n: int, seed: int) -> tuple[Tensor, Tensor]:
    """n random (W_V [n, d_model, d_head], W_O [n, d_head, d_model]), standard normal, in the model's dtype: drawn in
    float64 (the same values in every dtype), W_V rounded before W_O is drawn (one float64 draw held at a time, not
    both: 400 MiB of 200 samples at d_model 1024, d_head 128)."""
    gen = torch.Generator().manual_seed(seed)
    d, dh = model.cfg.d_model, model.cfg.d_head
    W_V = torch.randn(n, d, dh, generator=gen, dtype=torch.float64).to(model.W_E.dtype).to(model.device)
    W_O = torch.randn(n, dh, d, generator=gen, dtype=torch.float64).to(model.W_E.dtype).to(model.device)
    return W_V, W_O


def random_eig_scores(model: Transformer, W_V: Tensor, W_O: Tensor) -> Tensor:
    """[n] eigenvalue copying scores of the circuits W_E_eff W_V[i] W_O[i] W_U, through d_head x d_head matrices."""
    G = unembed_embed_gram(model)  # [d, d]
    return copying_score(eigvals((W_O @ G @ W_V).double()))  # nonzero spectrum of W_E W_V W_O W_U [n, d_h]


def check_baseline(model: Transformer, n_samples: int, n_top_samples: int) -> None:
    if not 1 <= n_top_samples <= n_samples:
        raise InvalidInputError(f"need 1 <= n_top_samples <= n_samples, got {n_top_samples} and {n_samples}")
    if model.cfg.n_layers == 0:
        raise InvalidInputError("a model without attention layers has no OV circuit")


def random_baseline(
    model: Transformer,
    n_samples: int = 200,
    n_top_samples: int = 4,
    k: int = 10,
    vocab: Tensor | None = None,
    seed: int = 0,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    rows: int | None = None,
) -> CopyingBaseline:
    """Eigenvalue scores of n_samples random OV circuits W_E_eff W_V W_O W_U (through d_head x d_head matrices),
    and self-copy shares of the first n_top_samples of them (each a full [V, V] row stream, hence fewer), over the
    same source rows as the heads' (same seed)."""
    n = _check_vocab(model, vocab, k)
    check_baseline(model, n_samples, n_top_samples)
    W_V, W_O = random_ov_weights(model, n_samples, seed)
    with torch.no_grad():
        scores = random_eig_scores(model, W_V, W_O)  # [n_samples]
        order = sample_order(n, rows, seed)  # [r]
        tops = torch.zeros(3, n_top_samples, dtype=torch.float64)
        for start in range(0, n_top_samples, STACK_CIRCUITS):
            check_stop(what="random copying baseline")
            end = min(n_top_samples, start + STACK_CIRCUITS)
            circuits = [(W_V[i], W_O[i]) for i in range(start, end)]
            for i, ranked in enumerate(rows_ranks(model, circuits, k, order, vocab, budget_bytes), start):
                tops[:, i] = ranked.shares()[:3]
    return CopyingBaseline(scores, tops[0], tops[1], tops[2], k, n, len(order))


def cost(
    model: Transformer,
    k: int,
    n_samples: int,
    n_top_samples: int,
    budget_bytes: int,
    n_tokens: int | None = None,
    rows: int | None = None,
    n_heads: int | None = None,
) -> Cost:
    """self_copy over every head (or n_heads of them) and beside it random_baseline (app/views/copying.py measures them
    on two threads at once), rows_ranks taking STACK_CIRCUITS circuits at a time: at most one head's W_O W_U
    [d_head, n] (through W_U's [d_model, n] ranked columns when not all), the rows' factors, the probed columns, a
    block of logits and its masks, the [r] ranks and diagonal, and the batch's stacked open rows; beside them the
    random weights in the model's dtype (random_ov_weights: while they are drawn, one float64 draw) and their
    eigenvalue scores (random_eig_scores); answer: per head 5 numbers, per sample 4."""
    cfg, size = model.cfg, model.W_E.element_size()
    n = cfg.d_vocab if n_tokens is None else n_tokens
    r = n if rows is None else min(rows, n)
    block = min(budget_bytes, r * n * (size + 2))  # a block of logits and its two masks (own_rank.count_above)
    columns = cfg.d_model * n * size if n != cfg.d_vocab else 0
    heads = cfg.n_layers * cfg.n_heads if n_heads is None else n_heads
    rows = r * (2 * cfg.d_model + cfg.d_head) * size + r * 40  # x W_V, x W_V W_O, own columns; counts and diagonal
    probe = cfg.d_model * probe_size(n) * size  # the probed columns of W_U, gathered
    stack = min(heads + n_top_samples, STACK_CIRCUITS) * stacked_bytes(cfg.d_model, cfg.d_head, r, size)
    one_head = Cost(
        cfg.d_head * n * size + columns + rows + probe + block + stack,
        flops=row_ranks_flops(cfg.d_model, cfg.d_head, n, r) * (heads + n_top_samples),
    )
    one_draw = n_samples * cfg.d_model * cfg.d_head
    drawing = Cost(one_draw * float64_copy_size(model.W_E.dtype))  # W_O's float64 draw beside its rounded copy
    weights = Cost(2 * one_draw * size) + drawing.then(random_eig_scores_cost(model, n_samples))
    return (one_head + weights).with_answer(numbers=5 * heads + 4 * n_samples, labels=heads)


def random_eig_scores_cost(model: Transformer, n: int) -> Cost:
    """random_eig_scores on n samples: G (copying_spectra.model_gram_cost), then beside it in the model's dtype
    W_O G [n, d_head, d_model] and W_O G W_V [n, d_head, d_head], its float64 copy (unless float64) and the complex
    eigenvalues (the per-thread parts and their concatenation); FLOPs: G, then the two products."""
    cfg, size = model.cfg, model.W_E.element_size()
    d, dh = cfg.d_model, cfg.d_head
    small = n * dh * dh * (size + float64_copy_size(model.W_E.dtype)) + 2 * n * dh * 16
    products = Cost(d * d * size + n * dh * d * size + small, flops=n * 2 * dh * d * (d + dh))
    return model_gram_cost(model, unembed=True).then(products)


# -- one head's copying metrics (any square token circuit) ------------------------------------------------
@dataclass
class CopyingMetrics:
    """The paper's alternative copying metrics for one head's full OV circuit M [V, V] (rows source a)."""

    diagonal_positive: float  # fraction of tokens a with M[a, a] > 0
    diagonal_quantiles: Tensor  # [5] quantiles 0, .25, .5, .75, 1 of the diagonal
    top1: float  # fraction of tokens a whose own logit is the largest in row a (ARENA top_1_acc)
    topk: float  # fraction of tokens a among the k largest of row a
    k: int


def ov_copying_metrics(
    model: Transformer,
    layer: int,
    head: int,
    k: int = 5,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    tokens: Tensor | None = None,
) -> CopyingMetrics:
    """Diagonal sign fraction and top-1 / top-k accuracy of the full OV circuit, rows streamed in blocks; with
    `tokens` (ids [n]) of its [n, n] submatrix (each token ranked among those tokens)."""
    return copying_metrics(full_ov_circuit(model, layer, head, tokens), k, budget_bytes)


def copying_metrics(M: FactoredMatrix, k: int = 5, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> CopyingMetrics:
    """The metrics of CopyingMetrics for any square token circuit M [n, n] (row i and column i: one token)."""
    if M.ldim != M.rdim:
        raise InvalidInputError(f"copying metrics need a square circuit, got {M.ldim} x {M.rdim}")
    if not 1 <= k <= M.rdim:
        raise InvalidInputError(f"k must be in [1, {M.rdim}], got {k}")
    diag = M.diag()  # [V]
    V = M.ldim
    own = torch.arange(V, device=diag.device)
    A, B = M.A, M.B  # [V, inner], [inner, V]
    above = count_above(
        lambda rows, columns: A[rows] @ B[:, columns],
        diag,
        own,
        V,
        k,
        budget_bytes,
        B.element_size(),
        probe=probe_columns(V),
    )  # [V] columns above each row's own entry, capped at k (own_rank.count_above)
    qs = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    return CopyingMetrics(
        diagonal_positive=float((diag > 0).double().mean()),
        diagonal_quantiles=torch.quantile(diag.double(), qs.to(diag.device)),
        top1=int((above == 0).sum()) / V,
        topk=int((above < k).sum()) / V,
        k=k,
    )


def copying_metrics_cost(model: Transformer, k: int, budget_bytes: int, n_tokens: int | None = None) -> Cost:
    """ov_copying_metrics: the factors (on n_tokens tokens, default every token: token_factors_cost or factors_cost),
    then beside them one block of logits and its masks (at most budget_bytes), the diagonal and the counts; FLOPs at
    most: the factors, the probe of every row, then every row of the [n, n] circuit (2 n^2 d_head;
    own_rank.count_above settles most rows of a head that does not copy early)."""
    cfg, size = model.cfg, model.W_E.element_size()
    n = cfg.d_vocab if n_tokens is None else n_tokens
    block = min(budget_bytes, n * n * (size + 2)) + n * 24
    flops = full_ov_flops(model, n_tokens) + 2 * n * cfg.d_head * (probe_size(n) + n)
    factors = factors_cost(model) if n_tokens is None else token_factors_cost(model, n)
    count = Cost(2 * n * cfg.d_head * size + block + n * (size + 8), flops=flops)
    return factors.then(count).with_answer(numbers=12, labels=6)
