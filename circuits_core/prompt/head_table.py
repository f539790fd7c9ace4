"""The heads table: every head's detector scores, full-circuit copying scores and the paper's 2-D induction view,
and how that work is shared by two cores.

Paper sections (Elhage et al. 2021): "Induction Heads" (Image 22: OV copying vs the positivity of the
K-composition term with the previous-token head) and the eigenvalue copying analysis (docs/maths.md §2.8, §2.15).
Row-vector convention; the pieces are heads.py (detectors), circuits.py (Grams, spectra) and qk_paths.py
(K-composition positivity).

The work, on GPT-2 small's shape and its standard input (10 x 101 tokens), in three steps, two threads sharing each
(schedule.side_by_side; a caller whose torch threads span the cores gets half of them per thread from
schedule.halves_side_by_side, so the halves run side by side instead of one after the other; one thread does both
only on a single core):
    1  detector pass    every layer's pattern; half the sequences each (this thread first forms W_E's LN
                        statistics, which both threads' Gram rows read)                                  ~165 GFLOP
    2  Grams            G = W_U W_E_eff, G_E = W_E_eff^T W_E_eff (G_E by its blocks on and above the
                        diagonal), the vocabulary's row chunks taken from one queue (schedule.shared_chunks):
                        whichever thread finished its detector half first takes more; partial Grams add up  ~95 GFLOP
                        (rotary models: that thread first measures μ and the kernel peaks)
    3  spectra          this thread: G_E W_Q (read by the QK spectra and both positivities), the one-hot
                        K-composition positivity's matrices (previous-token head), the weighted one's upper layers'
                        | the helper: the OV spectra's, the QK spectra's, the weighted positivity's lower layers'; then
                        both solve the eigenproblems of every batch formed, two per torch thread at a time,
                        from one queue (host_linalg.EigenQueue), so they finish together                   ~45 GFLOP
Each spectrum or positivity is L x H eigenvalue problems (d_head x d_head, float64; ~0.09 s on GPT-2 small, ~6 s of
CPU on Gemma-3 270M's 280 problems of 256 x 256, where a fixed split left one thread ~2 s behind the other).
Detector chunks of whole sequences add up with their weights (heads.DetectorSums): the scores are the same means as
one pass, and chunks of half the batch keep the GEMMs as efficient as one pass (one-sequence chunks cost ~20 % more).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.copying_spectra import (
    copying_score,
    embed_gram,
    embed_grams,
    gram_queries,
    ov_copying_scores,
    ov_matrices,
    qk_matrices,
)
from circuits_core.circuits.embedding import EmbedNorm, embed_norm
from circuits_core.circuits.host_linalg import EigenBatch, EigenQueue, eigen_chunk
from circuits_core.circuits.rotary import KERNEL_WINDOW, kernel_cost, kernel_peak_offsets
from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.model.head_names import head_name
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.detectors import (
    DetectorSums,
    detector_chunk,
    detector_scores,
    detector_sums,
    detectors_cost,
    heads_that_matter,
    standard_tokens,
)
from circuits_core.prompt.qk_paths import k_composition_matrices, k_composition_positivity, k_composition_scores
from circuits_core.schedule import Handoff, available_cores, halves_side_by_side, shared_chunks, side_by_side

# Vocabulary rows per Gram chunk in step 2: two threads' chunks (W_E_eff rows and W_U columns, ~6 MiB each on GPT-2)
# stay within the shared L3 cache; at EMBED_CHUNK (4096 rows) the two threads' Grams took ~12 % more CPU (0.60 vs
# 0.53 s wall on GPT-2 small, quiet machine).
GRAM_ROWS = 2048


@dataclass
class InductionView:
    """The paper's 2-D view (Image 22): OV copying vs positivity of the K-composition term, per head [L, H]."""

    ov_copying: Tensor  # [L, H] eigenvalue copying score of the full OV circuit (circuits.ov_copying_scores)
    qk_k_composition: Tensor  # [L, H] positivity with the previous-token head (0 for layer 0)
    qk_weighted: Tensor  # [L, H] Olsson's version: earlier heads weighted by previous-token score
    previous_token_head: str
    previous_token_scores: Tensor  # [L, H]


def induction_view(
    model: Transformer,
    tokens: Tensor | None = None,
    scores: dict[str, Tensor] | None = None,
    ov_copying: Tensor | None = None,
    G_E: Tensor | None = None,
    G_E_W_Q: Tensor | None = None,
) -> InductionView:
    """Every head's (OV copying, QK K-composition positivity) point, the previous-token head chosen by
    detectors.heads_that_matter.

    scores {name: [L, H]}, ov_copying [L, H], G_E [d, d], G_E_W_Q [L, H, d, d_head]: the detector scores on `tokens`,
    ov_copying_scores, embed_gram and gram_queries when the caller has them already (head_table), so none is
    computed twice."""
    if scores is None:
        scores = detector_scores(model, standard_tokens(model) if tokens is None else tokens)
    prev = scores["previous_token"]
    one_hot, partner = _one_hot(model, scores["induction"], prev)
    ov = ov_copying_scores(model) if ov_copying is None else ov_copying
    G_E = embed_gram(model) if G_E is None else G_E  # [d, d], shared by both positivities
    low, high = _weighted_halves(model)
    (one, weighted_low), weighted_high = side_by_side(
        lambda: (
            k_composition_positivity(model, one_hot, G_E, G_E_W_Q),
            k_composition_positivity(model, prev, G_E, G_E_W_Q, low),
        ),
        lambda: k_composition_positivity(model, prev, G_E, G_E_W_Q, high),
        "qkov-heads-positivity",
    )
    return InductionView(ov, one, weighted_low + weighted_high, partner, prev)  # the halves are 0 outside their layers


def _one_hot(model: Transformer, induction: Tensor, prev: Tensor) -> tuple[Tensor, str]:
    """Weights [L, H] on the previous-token head alone (the paper's 2-D view: heads_that_matter), and its name."""
    layer, head = heads_that_matter(induction, prev)[0]
    one_hot = torch.zeros_like(prev)
    one_hot[layer, head] = 1.0
    return one_hot, head_name(layer, head)


def _weighted_halves(model: Transformer) -> tuple[range, range]:
    """The weighted positivity's layers in two halves of about equal work for two threads, the second a bit smaller
    in layers: its S_l chain runs through every layer below its last (qk_paths.k_composition_matrices), and the first
    shares its thread with ~L x H eigenvalue problems more (the one-hot positivity, or the QK spectra)."""
    split = 1 + (model.cfg.n_layers - 1) * 2 // 5
    return range(1, split), range(split, model.cfg.n_layers)


@dataclass
class HeadTable:
    """Every head's detector scores on one input, copying scores, 2-D induction view and kernel peak offset."""

    detectors: dict[str, Tensor]  # {name: [L, H]}
    ov_copying: Tensor  # [L, H] circuits.ov_copying_scores
    qk_copying: Tensor  # [L, H] circuits.qk_copying_scores
    induction: InductionView | None  # None for a model without layers
    kernel_peak_offset: Tensor | None = None  # [L, H] rotary.kernel_peak_offsets (rotary models, `means` given)
    losses: Tensor | None = None  # [b, n - 1] float64 next-token losses of the detector pass (`with_loss`)
    # [L, H, d_head] complex: the eigenvalues the copying scores come from (copying_spectra.ov_eigenvalues and
    # qk_eigenvalues), for a caller that keeps every head's spectra; None for a model without layers
    ov_eigenvalues: Tensor | None = None
    qk_eigenvalues: Tensor | None = None


def head_table(
    model: Transformer,
    tokens: Tensor,
    should_stop: Callable[[], bool] | None = None,
    budget_bytes: int | None = None,
    means: Callable[[], Tensor] | None = None,
    reference_tokens: int | None = None,
    with_loss: bool = False,
) -> HeadTable:
    """The heads table: one detector pass on `tokens` (its previous-token scores reused by the induction view),
    and the full-circuit spectra from the two d_model x d_model Grams, each formed once; `means` (rotary models):
    gives μ [L, d_model] (stored, or measured on at most `reference_tokens` tokens) for the kernel peak offsets.
    Each step is shared by two threads when a core is idle (see the module docstring)."""
    if model.cfg.n_layers == 0:
        empty = torch.zeros(0, model.cfg.n_heads, dtype=torch.float64)
        return HeadTable(detector_scores(model, tokens, should_stop, budget_bytes), empty, empty, None)
    with halves_side_by_side():  # a caller on every core: each step's halves side by side, half the threads each
        return _head_table(model, tokens, should_stop, budget_bytes, means, reference_tokens, with_loss)


def _head_table(
    model: Transformer,
    tokens: Tensor,
    should_stop: Callable[[], bool] | None,
    budget_bytes: int | None,
    means: Callable[[], Tensor] | None,
    reference_tokens: int | None,
    with_loss: bool,
) -> HeadTable:
    """head_table of a model with layers, its two threads' halves side by side when the caller's threads leave a core
    idle."""
    tokens = model.check_tokens(tokens)
    b, n = tokens.shape
    sequences = shared_chunks(b, table_chunk(model, n, b, budget_bytes, reference_tokens if means else None, with_loss))
    vocabulary = shared_chunks(model.cfg.d_vocab, GRAM_ROWS)
    # W_E's LN statistics (cached), formed once by this thread while the helper runs its detector chunk; the helper
    # waits for them before its Gram rows (the vocabulary queue evens out who started later)
    statistics: Handoff[EmbedNorm | None] = Handoff()
    normalised = model.cfg.normalization_type is not None

    kernel = shared_chunks(1, 1)  # one task: μ and the kernel peaks (rotary models), for the first thread asking

    losses: dict[int, Tensor] | None = {} if with_loss else None  # first row of a chunk -> its losses [c, n - 1]

    def detectors_then_grams(here: bool) -> tuple[DetectorSums, Tensor | None, tuple[Tensor, Tensor]]:  # steps 1, 2
        if here:  # (this thread runs first when the halves run in turn, so the helper never waits for nothing)
            statistics.give(lambda: embed_norm(model) if normalised else None)
        sums = detector_sums(model, tokens, sequences, should_stop, losses)
        with torch.no_grad():  # the first thread done with its detector half measures μ, then both take Gram rows
            peaks = kernel_peak_offsets(model, means()) if means is not None and kernel() is not None else None
            statistics.take()
            return sums, peaks, embed_grams(model, vocabulary)  # partial (G, G_E) [d, d]: the rows this thread took

    (mine, peaks, (G, G_E)), (theirs, peaks_b, (G_b, G_E_b)) = side_by_side(
        lambda: detectors_then_grams(True), lambda: detectors_then_grams(False), "qkov-heads-table"
    )
    dt = model.W_E.dtype  # the partial Grams' float64 totals added, then rounded once
    G, G_E, peaks = (G + G_b).to(dt), (G_E + G_E_b).to(dt), peaks if peaks is not None else peaks_b  # [d, d], [L, H]
    detectors = mine.merge(theirs).scores()
    check_stop(should_stop, "heads table")

    prev = detectors["previous_token"]  # [L, H]
    one_hot, partner = _one_hot(model, detectors["induction"], prev)
    low, high = _weighted_halves(model)
    later = range(1, model.cfg.n_layers)  # the one-hot positivity's layers (layer 0 has nothing earlier)

    queries: Handoff[Tensor] = Handoff()  # G_E W_Q [L, H, d, d_head], formed by this thread, read by both
    problems = EigenQueue()  # every head's four d_head x d_head eigenproblems, solved by whichever thread is free

    def query_side() -> tuple[EigenBatch, EigenBatch]:  # G_E W_Q, the one-hot positivity's and weighted upper half's
        G_E_W_Q = queries.give(lambda: gram_queries(model, G_E))
        one = problems.add(k_composition_matrices(model, one_hot, G_E, G_E_W_Q, later))
        upper = problems.add(k_composition_matrices(model, prev, G_E, G_E_W_Q, high))
        problems.solve()
        return one, upper

    def value_side() -> tuple[EigenBatch, EigenBatch, EigenBatch]:  # the OV and QK spectra's, the weighted lower half's
        ov = problems.add(ov_matrices(model, G))
        qk = problems.add(qk_matrices(model, G_E, queries.take()))
        lower = problems.add(k_composition_matrices(model, prev, G_E, queries.take(), low))
        problems.solve()
        return ov, qk, lower

    with torch.no_grad():  # matrices, then eigenvalues, with no barrier between the threads
        (one, upper), (ov_batch, qk_batch, lower) = side_by_side(query_side, value_side, "qkov-heads-table")
    ov_eig, qk_eig = ov_batch.values, qk_batch.values  # [L, H, d_head] complex each
    ov, qk = copying_score(ov_eig), copying_score(qk_eig)  # [L, H] each
    weighted = k_composition_scores(model, lower.values, low) + k_composition_scores(model, upper.values, high)
    iv = InductionView(ov, k_composition_scores(model, one.values, later), weighted, partner, prev)  # 0 off `layers`
    loss = torch.cat([losses[k] for k in sorted(losses)]) if losses else None  # [b, n - 1], in row order
    return HeadTable(detectors, ov, qk, iv, peaks, loss, ov_eig, qk_eig)


def table_chunk(
    model: Transformer,
    n: int,
    batch: int,
    budget_bytes: int | None,
    reference_tokens: int | None = None,
    with_loss: bool = False,
) -> int:
    """Sequences per detector chunk of head_table: half the batch (rounded up), fewer when two chunks (one per
    thread) and the Grams and spectra held beside them would not fit budget_bytes."""
    chunk = -(-batch // 2)
    if budget_bytes is None:
        return chunk
    room = max(1, (budget_bytes - _spectra_cost(model, reference_tokens).peak_bytes) // 2)
    return min(chunk, detector_chunk(model, n, batch, room, with_loss))


def head_table_cost(
    model: Transformer,
    n: int,
    batch: int,
    budget_bytes: int | None = None,
    reference_tokens: int | None = None,
    with_loss: bool = False,
) -> Cost:
    """head_table on `batch` sequences of n tokens: two detector chunks (one per thread) held beside the Grams (one
    thread may start them while the other still runs its chunk), spectra and (`reference_tokens` given) kernel peaks."""
    cfg = model.cfg
    c = table_chunk(model, n, batch, budget_bytes, reference_tokens, with_loss)
    one = detectors_cost(model, n, c, with_loss)  # a chunk held by each thread; the FLOPs: every chunk's
    chunk = Cost(one.peak_bytes, one.answer_bytes, one.flops * batch // (2 * c) if c else one.flops)
    return (chunk + chunk + _spectra_cost(model, reference_tokens)).with_answer(  # μ's pass beside a chunk: added
        numbers=8 * cfg.n_layers * cfg.n_heads, labels=2 * cfg.n_layers * cfg.n_heads
    )


def _spectra_cost(model: Transformer, reference_tokens: int | None = None) -> Cost:
    """Two threads' partial Grams (float64 totals, each with one LN chunk of W_E at a time), G_E W_Q
    [L, H, d_model, d_head], the four spectra's float64 [L, H, d_head, d_head] matrices and complex eigenvalues (held
    together in the EigenQueue), on each thread one layer's [H, d_model, d_head] products (the spectra and the
    K-composition go layer by layer) and one batch's matrices in the model's dtype before their float64 copy, and μ's
    pass on `reference_tokens` tokens and the kernel (rotary.kernel_cost), which one thread may run while the other
    still holds a detector chunk or partial Grams."""
    cfg = model.cfg
    size, per_layer = itemsize(model.dtype), cfg.n_heads * cfg.d_model * cfg.d_head
    # per thread: the two float64 totals, one chunk's product and its LN rows, and the rounded sum in the model's dtype
    grams = 2 * ((2 * 8 + 2 * size) * cfg.d_model**2 + 2 * GRAM_ROWS * cfg.d_model * size)
    # the four batches in the EigenQueue in the model's dtype: OV and QK L layers each, the one-hot and the weighted
    # positivities L - 1 layers each; their complex eigenvalues; on each thread one chunk's float64 copy
    queued = (
        4 * cfg.n_layers - 2
    ) * cfg.n_heads * cfg.d_head**2 * size + 4 * cfg.n_layers * cfg.n_heads * cfg.d_head * 16
    chunk = eigen_chunk(available_cores()) * cfg.d_head**2 * 8  # (at most every core's torch threads per branch)
    d, heads = cfg.d_model, cfg.n_layers * cfg.n_heads
    # FLOPs: the two d_model x d_model Grams over the vocabulary, G_E W_Q, and per head the OV and QK spectra's and
    # the K-composition positivities' d_model x d_head products (three of them)
    flops = 4 * cfg.d_vocab * d * d + 2 * heads * d * d * cfg.d_head + 6 * heads * d * cfg.d_head * (d + cfg.d_head)
    spectra = Cost(
        grams + cfg.n_layers * per_layer * size + queued + 2 * (per_layer * size + chunk) + 4 * d**2 * 8,
        flops=flops,
    )
    if reference_tokens is None:
        return spectra
    return spectra + kernel_cost(model, min(KERNEL_WINDOW, cfg.n_ctx - 1) + 1, reference_tokens)
