"""Copying of every head measured three ways, beside random weights of the same shapes
(circuits_core/circuits/copying.py).

The eigenvalue score sum(lambda)/sum(|lambda|) can be near +1 while almost no token raises its own logit most,
so the page shows it beside the top-1 / top-k self-copy shares and the diagonal of each full OV circuit, and
beside what random OV weights of the model's shapes score through its own W_E and W_U.

Cost: the exact shares rank every row of a [V, V] circuit per head (~1.8 s a head on GPT-2's 50k vocabulary), so
on vocabularies over FULL_ROWS_MAX tokens the shares and diagonal are measured on a sample of source tokens drawn
at random (seeded; each row still ranked against every column) unless `rows` asks otherwise, and the answer says
so (`n_rows`, `sample`, a standard error per share). `heads` restricts the answer to some heads (the head page's
panel). It is its own analysis, loaded by the overview and head pages as a panel of its own: never part of /heads.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Annotated

import torch
from pydantic import BaseModel, Field

from app import snippets
from app.analysis import Analysis, AnalysisParams, split_heads
from app.page_spec import OwnPage
from app.params import Heads, K, MinCount
from app.scheduling import cached, cached_build
from app.schemas import ModelRef
from app.settings import Limits
from app.views.shared.basis import basis
from app.views.shared.head_spectra import spectra
from app.views.shared.inputs import check_k, model_ref, parse_heads
from app.views.shared.token_sets import frequent_tokens
from circuits_core.circuits import copying, copying_spectra
from circuits_core.circuits import head_circuits as circuits
from circuits_core.cost import Cost, report_progress
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import all_heads, head_name
from circuits_core.model.transformer import Transformer
from circuits_core.schedule import shared_tasks

N_TOP_SAMPLES = 2  # random circuits whose self-copy shares are measured (each a full [V, V] row stream)
FULL_ROWS_MAX = 8192  # vocabularies up to this size: every source token (the shipped toys: 4096)
# Larger ones: HEAD_ROWS // (heads measured) source tokens, within [MIN_ROWS, MAX_ROWS], drawn at random (seed
# SAMPLE_SEED), unless `rows` is given: one head (its page) 1024 rows, every head of GPT-2 small (the overview) 256.
HEAD_ROWS, MIN_ROWS, MAX_ROWS = 16384, 256, 1024
SAMPLE_SEED = 0


class CopyingAllParams(AnalysisParams):
    k: K = 10
    min_count: MinCount = None
    samples: Annotated[
        int, Field(ge=N_TOP_SAMPLES, le=1000, description="random OV circuits drawn for the baseline")
    ] = 200
    heads: Heads = None
    rows: Annotated[
        int | None,
        Field(
            ge=1,
            le=10**7,
            description=(
                f"source tokens measured for the shares and the diagonal, drawn at random (seed {SAMPLE_SEED}); at "
                f"least the "
                f"number of tokens ranked: every one. Default: every token up to {FULL_ROWS_MAX} tokens ranked, else "
                f"{HEAD_ROWS} / (heads measured), within [{MIN_ROWS}, {MAX_ROWS}]"
            ),
        ),
    ] = None


class HeadCopying(BaseModel):
    head: str
    ov_copying: float = Field(description="eigenvalue copying score sum(eig)/sum(|eig|) of the full OV circuit")
    top1: float = Field(description="share of source tokens whose own logit is the largest of their OV row")
    topk: float = Field(description="share of source tokens whose own logit is among the k largest of their row")
    top1_stderr: float = Field(
        description="standard error of top1 from sampling the rows (0 when every row is measured)"
    )
    topk_stderr: float = Field(description="standard error of topk from sampling the rows")
    diagonal_positive: float = Field(description="share of tokens a with M[a, a] > 0")
    diagonal_median: float = Field(description="median of the diagonal M[a, a] (logits)")


class CopyingBaselineView(BaseModel):
    ov_copying_mean: float
    ov_copying_std: float
    ov_copying_min: float
    ov_copying_max: float
    top1_mean: float
    topk_mean: float
    n_samples: int
    n_top_samples: int
    seed: int = 0


class CopyingOverview(BaseModel):
    model: ModelRef
    basis: str = Field(description="which weights: raw, or which processing (centred unembedding, folded LayerNorm)")
    k: int
    n_tokens: int = Field(description="tokens ranked: the vocabulary, or those seen >= min_count times")
    n_rows: int = Field(description="source tokens measured (rows): n_tokens, or a random sample of them")
    sample: str = Field(description="which source tokens the shares and diagonal are measured on, in words")
    min_count: int | None
    heads: list[HeadCopying]
    baseline: CopyingBaselineView = Field(
        description="random W_V, W_O of the model's shapes (standard normal, seeded) "
        "through its own W_E and W_U, the same summaries"
    )


def default_rows(n_tokens: int, rows: int | None, n_heads: int) -> int | None:
    """Source rows measured (None: all): as asked, else every token up to FULL_ROWS_MAX ranked tokens, else
    HEAD_ROWS // n_heads within [MIN_ROWS, MAX_ROWS]."""
    if rows is not None:
        return rows if rows < n_tokens else None
    return None if n_tokens <= FULL_ROWS_MAX else max(MIN_ROWS, min(MAX_ROWS, HEAD_ROWS // max(1, n_heads)))


def stderr(p: float, r: int, n: int) -> float:
    """Standard error of a share p measured on r of n rows drawn without replacement (0 when r = n)."""
    return 0.0 if r >= n else math.sqrt(p * (1 - p) / r * (n - r) / max(1, n - 1))


def chosen_heads(loaded: LoadedModel, p: CopyingAllParams, limits: Limits) -> list[tuple[int, int]] | None:
    """The heads `heads` names, each once (in the order first named); None: every head."""
    return list(dict.fromkeys(parse_heads(split_heads(p.heads), loaded, limits.max_heads))) if p.heads else None


class CircuitRows(BaseModel):
    """One OV circuit's copying.RowRanks (a head's or a random one's), kept in the result cache: the overview and
    each head page's panel read the same entry (a head's rows are computed once per sample, not once per page)."""

    above: list[int]
    diag: list[float]
    k: int

    def ranks(self) -> copying.RowRanks:
        return copying.RowRanks(torch.tensor(self.above), torch.tensor(self.diag, dtype=torch.float64), self.k)


class RandomScores(BaseModel):
    scores: list[float]  # eigenvalue copying scores of the random circuits, in drawing order


Circuit = tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]  # a circuit's name and its (W_V, W_O)


def circuits_rows(
    loaded: LoadedModel,
    p: CopyingAllParams,
    k: int,
    vocab: torch.Tensor | None,
    rows: int | None,
    circuits: Sequence[Circuit],
    limits: Limits,
    beside: Callable[[], None] | None = None,
) -> list[copying.RowRanks]:
    """The source rows of each circuit (a name, and W: its W_V, W_O) from the result cache, else measured and kept:
    those not cached are measured together, copying.STACK_CIRCUITS at a time (copying.rows_ranks shares their work),
    the batches taken in turn by two threads when a core is idle (schedule.shared_tasks); `beside`, another part of
    the answer, is the first task the threads take (the random circuits' eigenvalue scores: one thread forms them
    while the other measures rows, instead of the other core waiting for them).
    A sample smaller than a one-head panel's is the first rows of the panel's draw (copying.sample_order): read off
    its entry when cached (precompute asks the panels first), so the overview measures no row twice."""
    n = loaded.model.cfg.d_vocab if vocab is None else int(vocab.numel())

    def key(r: int | None, circuit: str) -> tuple[object, ...]:
        return ("copying-rows", str(loaded.digest), basis(loaded), k, p.min_count, SAMPLE_SEED, r, circuit)

    def known(circuit: str) -> copying.RowRanks | None:
        wide = default_rows(n, None, 1)
        if rows is not None and wide is not None and rows < wide:
            hit = cached(key(wide, circuit), CircuitRows)
            if hit is not None:
                return hit.ranks().first(rows)
        own = cached(key(rows, circuit), CircuitRows)
        return None if own is None else own.ranks()

    found = {name: ranks for name, _ in circuits if (ranks := known(name)) is not None}
    todo = [(name, W) for name, W in circuits if name not in found]
    order = copying.sample_order(n, rows, SAMPLE_SEED)

    def measure(batch: Sequence[Circuit], workspace: None) -> None:
        report_progress(len(found), len(circuits))  # a job's progress bar: circuits measured
        with torch.no_grad():
            measured = copying.rows_ranks(
                loaded.model, [W() for _, W in batch], k, order, vocab, limits.matrix_budget_bytes
            )
        for (name, _), ranks in zip(batch, measured, strict=True):
            kept = CircuitRows(above=ranks.above.tolist(), diag=ranks.diag.tolist(), k=k)
            found[name] = cached_build(key(rows, name), CircuitRows, functools.partial(_kept, kept)).ranks()

    step = copying.STACK_CIRCUITS
    batches = [functools.partial(measure, todo[i : i + step]) for i in range(0, len(todo), step)]
    first = [] if beside is None else [lambda workspace: beside()]
    shared_tasks([*first, *batches], lambda: None, "qkov-copying-rows")  # two threads take them in turn (schedule.py)
    return [found[name] for name, _ in circuits]


def _kept(rows: CircuitRows) -> CircuitRows:
    return rows  # a circuit's rows measured with others' (circuits_rows), kept under its own key


def _head(model: Transformer, layer: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    ov = circuits.ov_circuit(model, layer, h)
    return ov.A, ov.B  # W_V [d, d_head], W_O [d_head, d]


def _sample(weights: Callable[[], tuple[torch.Tensor, torch.Tensor]], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    W_V, W_O = weights()
    return W_V[i], W_O[i]  # the i-th random circuit's W_V [d, d_head], W_O [d_head, d]


class RandomCircuits:
    """The random W_V, W_O of the model's shapes (p.samples of them, seed SAMPLE_SEED), drawn once when first asked
    (by whichever thread asks first: the eigenvalue scores and the random circuits' rows are measured side by side)."""

    def __init__(self, loaded: LoadedModel, p: CopyingAllParams):
        copying.check_baseline(loaded.model, p.samples, N_TOP_SAMPLES)
        self.loaded, self.samples = loaded, p.samples
        self._lock = threading.Lock()
        self._weights: tuple[torch.Tensor, torch.Tensor] | None = None

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if self._weights is None:
                self._weights = copying.random_ov_weights(self.loaded.model, self.samples, SAMPLE_SEED)
            return self._weights

    def circuits(self) -> list[Circuit]:
        """The first N_TOP_SAMPLES, whose rows are measured like a head's (circuits_rows)."""
        return [
            (f"random {i} of {self.samples}", functools.partial(_sample, self.weights, i)) for i in range(N_TOP_SAMPLES)
        ]

    def scores(self) -> torch.Tensor:
        """[samples] eigenvalue copying scores, kept once per (weights, samples)."""

        def eig() -> RandomScores:
            with torch.no_grad():
                return RandomScores(scores=copying.random_eig_scores(self.loaded.model, *self.weights()).tolist())

        key = ("copying-random-scores", str(self.loaded.digest), basis(self.loaded), self.samples, SAMPLE_SEED)
        return torch.tensor(cached_build(key, RandomScores, eig).scores, dtype=torch.float64)


def _baseline(random: RandomCircuits, scores: torch.Tensor, ranks: Sequence[copying.RowRanks]) -> CopyingBaselineView:
    """Random W_V, W_O of the model's shapes: their eigenvalue scores, and the self-copy shares of the first
    N_TOP_SAMPLES circuits (`ranks`, measured with the heads' by circuits_rows)."""
    tops = torch.stack([r.shares() for r in ranks])  # [N, 4]
    return CopyingBaselineView(
        ov_copying_mean=float(scores.mean()),
        ov_copying_std=float(scores.std()),
        ov_copying_min=float(scores.min()),
        ov_copying_max=float(scores.max()),
        top1_mean=float(tops[:, 0].mean()),
        topk_mean=float(tops[:, 1].mean()),
        n_samples=random.samples,
        n_top_samples=N_TOP_SAMPLES,
    )


def build_copying_overview(loaded: LoadedModel, p: CopyingAllParams, limits: Limits) -> CopyingOverview:
    model = loaded.model
    if model.cfg.n_layers == 0:
        raise InvalidInputError("a model without attention layers has no OV circuit to measure copying on")
    vocab = frequent_tokens(loaded, p.min_count)
    n = model.cfg.d_vocab if vocab is None else int(vocab.numel())
    k = check_k(p.k, limits, n)
    cfg = model.cfg
    todo = chosen_heads(loaded, p, limits) or all_heads(cfg)
    rows = default_rows(n, p.rows, len(todo))
    every = spectra(loaded)  # every head's OV eigenvalues, kept once per model (app/views/shared/head_spectra.py)
    eig = copying_spectra.copying_score(
        torch.complex(
            torch.tensor(every.ov_re, dtype=torch.float64), torch.tensor(every.ov_im, dtype=torch.float64)
        ).view(cfg.n_layers, cfg.n_heads, cfg.d_head)
    )  # [L, H]
    r = n if rows is None else rows  # source rows measured per circuit
    random = RandomCircuits(loaded, p)  # the baseline does not depend on `heads`: its entries serve every panel
    named = [(head_name(layer, h), functools.partial(_head, model, layer, h)) for layer, h in todo]
    scores: list[torch.Tensor] = []
    measured = circuits_rows(
        loaded, p, k, vocab, rows, [*random.circuits(), *named], limits, beside=lambda: scores.append(random.scores())
    )
    baseline = _baseline(random, scores[0], measured[:N_TOP_SAMPLES])
    heads = []
    for (layer, h), ranks in zip(todo, measured[N_TOP_SAMPLES:], strict=True):
        top1, topk, positive, median = ranks.shares().tolist()
        heads.append(
            HeadCopying(
                head=head_name(layer, h),
                ov_copying=float(eig[layer, h]),
                top1=top1,
                topk=topk,
                diagonal_positive=positive,
                diagonal_median=median,
                top1_stderr=stderr(top1, r, n),
                topk_stderr=stderr(topk, r, n),
            )
        )
    ranked = "tokens" if vocab is None else f"tokens seen at least {p.min_count} times in training"
    sample = (
        f"every one of the {n} {ranked} as source"
        if r == n
        else f"{r} of the {n} {ranked} as sources, drawn at random (seed {SAMPLE_SEED}), each ranked against all {n}"
    )
    return CopyingOverview(
        model=model_ref(loaded),
        basis=basis(loaded),
        k=k,
        n_tokens=n,
        n_rows=r,
        sample=sample,
        min_count=p.min_count,
        heads=heads,
        baseline=baseline,
    )


def copying_overview_cost(loaded: LoadedModel, p: CopyingAllParams, limits: Limits) -> Cost:
    vocab = frequent_tokens(loaded, p.min_count)
    n = loaded.model.cfg.d_vocab if vocab is None else int(vocab.numel())
    cfg = loaded.model.cfg
    todo = chosen_heads(loaded, p, limits)
    n_heads = len(todo) if todo is not None else cfg.n_layers * cfg.n_heads
    return copying.cost(
        loaded.model,
        p.k,
        p.samples,
        N_TOP_SAMPLES,
        min(limits.matrix_budget_bytes, copying.BLOCK_BYTES),
        n,
        rows=default_rows(n, p.rows, n_heads),
        n_heads=n_heads,
    )


COPYING_ALL = Analysis(
    name="copying-all",
    weights="attention",
    path="copying",
    params=CopyingAllParams,
    view=CopyingOverview,
    build=build_copying_overview,
    cost=copying_overview_cost,
    summary="Copying of every head: eigenvalue score, self-copy shares, random baseline",
    snippet=snippets.copying_all_body,
    tags=["heads"],
    needs_layers=1,
    page=OwnPage(template="copying.html", nav=90, head_filter="the chart and the table list only these"),
)
