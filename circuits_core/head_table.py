"""The heads table: every head's detector scores, full-circuit copying scores and the paper's 2-D induction view,
and how that work is shared by two cores.

Paper sections (Elhage et al. 2021): "Induction Heads" (Image 22: OV copying vs the positivity of the
K-composition term with the previous-token head) and the eigenvalue copying analysis (paper-math 2.8, 2.15).
Row-vector convention; the pieces are heads.py (detectors), circuits.py (Grams, spectra) and qk_paths.py
(K-composition positivity).

The work, on GPT-2 small's shape and its standard input (10 x 101 tokens):
    detector pass      every layer's pattern, chunks of sequences                        ~165 GFLOP
    Grams              G = W_U W_E_eff, G_E = W_E_eff^T W_E_eff, one pass over the vocabulary
                       (G_E by its blocks on and above the diagonal)                       ~95 GFLOP
    spectra            G W_V and G_E W_Q (shared with the positivity), 2 x L x H eigenvalue problems
    positivities       one-hot (previous-token head) and weighted (previous-token scores): they need the
                       detector pass's previous-token scores, so they come last
When the caller's torch threads leave a core idle (cost.side_by_side), two threads share it:
    this thread     detector chunks ........................................ | weighted positivity
    helper thread   Grams, spectra (, kernel peaks) then detector chunks ..... | one-hot positivity
The detector chunks come from one queue (cost.shared_chunks: large ones first, single sequences at the end), so both
threads finish the pass at about the same time; chunk sums are combined with their weights (heads.DetectorSums), so the scores are the same
means as one pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits import (
    EMBED_CHUNK,
    embed_gram,
    embed_grams,
    gram_queries,
    ov_copying_scores,
    qk_copying_scores,
)
from circuits_core.config import head_name
from circuits_core.cost import Cost, check_stop, itemsize, shared_chunks, side_by_side
from circuits_core.heads import (
    DetectorSums,
    detector_chunk,
    detector_scores,
    detector_sums,
    detectors_cost,
    previous_token_head,
    standard_tokens,
)
from circuits_core.model import Transformer
from circuits_core.qk_paths import k_composition_positivity
from circuits_core.rotary import KERNEL_WINDOW, kernel_cost, kernel_peak_offsets


@dataclass
class InductionView:
    """The paper's 2-D view (Image 22): OV copying vs positivity of the K-composition term, per head [L, H]."""

    ov_copying: Tensor  # [L, H] eigenvalue copying score of the full OV circuit (circuits.ov_copying_scores)
    qk_k_composition: Tensor  # [L, H] positivity with the previous-token head (0 for layer 0)
    qk_weighted: Tensor  # [L, H] Olsson's version: earlier heads weighted by previous-token score
    previous_token_head: str
    previous_token_scores: Tensor  # [L, H]


def induction_view(model: Transformer, tokens: Tensor | None = None, prev_scores: Tensor | None = None,
                   ov_copying: Tensor | None = None, G_E: Tensor | None = None,
                   G_E_W_Q: Tensor | None = None) -> InductionView:
    """Every head's (OV copying, QK K-composition positivity) point, previous-token head auto-chosen.

    prev_scores [L, H], ov_copying [L, H], G_E [d, d], G_E_W_Q [L, H, d, d_head]: the previous-token scores on
    `tokens`, ov_copying_scores, embed_gram and gram_queries when the caller has them already (head_table), so none
    is computed twice."""
    if prev_scores is None:
        prev_scores = detector_scores(model, standard_tokens(model) if tokens is None else tokens)["previous_token"]
    prev = prev_scores
    layer, head = previous_token_head(model, prev)
    one_hot = torch.zeros_like(prev)
    one_hot[layer, head] = 1.0
    ov = ov_copying_scores(model) if ov_copying is None else ov_copying
    G_E = embed_gram(model) if G_E is None else G_E  # [d, d], shared by both positivities
    # Two independent halves for two threads: the one-hot positivity (factored: cheap products, L x H eigenvalue
    # problems) and the weighted one's low layers; the weighted one's upper layers (its S_l chain runs through them).
    split = 1 + (model.cfg.n_layers - 1) * 2 // 5
    (one, low), high = side_by_side(
        lambda: (k_composition_positivity(model, one_hot, G_E, G_E_W_Q),
                 k_composition_positivity(model, prev, G_E, G_E_W_Q, range(1, split))),
        lambda: k_composition_positivity(model, prev, G_E, G_E_W_Q, range(split, model.cfg.n_layers)),
        "qkov-heads-positivity")
    weighted = low + high  # each 0 outside its layers
    return InductionView(ov, one, weighted, head_name(layer, head), prev)


@dataclass
class HeadTable:
    """Every head's detector scores on one input, copying scores, 2-D induction view and kernel peak offset."""

    detectors: dict[str, Tensor]  # {name: [L, H]}
    ov_copying: Tensor  # [L, H] circuits.ov_copying_scores
    qk_copying: Tensor  # [L, H] circuits.qk_copying_scores
    induction: InductionView | None  # None for a model without layers
    kernel_peak_offset: Tensor | None = None  # [L, H] rotary.kernel_peak_offsets (rotary models, `means` given)


@dataclass
class _Spectra:
    ov: Tensor  # [L, H] OV copying scores
    qk: Tensor  # [L, H] QK copying scores
    G_E: Tensor  # [d, d]
    G_E_W_Q: Tensor  # [L, H, d, d_head]
    peaks: Tensor | None  # [L, H] kernel peak offsets (rotary models, μ given)


def head_table(model: Transformer, tokens: Tensor, should_stop: Callable[[], bool] | None = None,
               budget_bytes: int | None = None, means: Callable[[], Tensor] | None = None,
               reference_tokens: int | None = None) -> HeadTable:
    """The heads table: one detector pass on `tokens` (its previous-token scores reused by the induction view),
    and the full-circuit spectra from the two d_model x d_model Grams, each formed once; `means` (rotary models):
    gives μ [L, d_model] (stored, or measured on at most `reference_tokens` tokens) for the kernel peak offsets.

    With a core idle, the helper thread forms the Grams and spectra, then takes detector chunks from the queue this
    thread works through (see the module docstring); one after the other otherwise."""
    if model.cfg.n_layers == 0:
        empty = torch.zeros(0, model.cfg.n_heads, dtype=torch.float64)
        return HeadTable(detector_scores(model, tokens, should_stop, budget_bytes), empty, empty, None)
    tokens = model.check_tokens(tokens)
    b, n = tokens.shape
    take = shared_chunks(b, table_chunk(model, n, b, budget_bytes, reference_tokens if means else None))

    def detect() -> DetectorSums:
        return detector_sums(model, tokens, take, should_stop)

    def spectra_then_detect() -> tuple[_Spectra, DetectorSums]:
        with torch.no_grad():
            G, G_E = embed_grams(model)  # [d, d] each
            check_stop(should_stop, "heads table")
            G_E_W_Q = gram_queries(model, G_E)  # [L, H, d, d_head]
            ov, qk = ov_copying_scores(model, G), qk_copying_scores(model, G_E, G_E_W_Q)
            check_stop(should_stop, "heads table")
            peaks = None if means is None else kernel_peak_offsets(model, means())
        return _Spectra(ov, qk, G_E, G_E_W_Q, peaks), detect()

    mine, (spectra, theirs) = side_by_side(detect, spectra_then_detect, "qkov-heads-spectra")
    detectors = mine.merge(theirs).scores()
    check_stop(should_stop, "heads table")
    with torch.no_grad():
        iv = induction_view(model, tokens, detectors["previous_token"], spectra.ov, spectra.G_E, spectra.G_E_W_Q)
    return HeadTable(detectors, spectra.ov, spectra.qk, iv, spectra.peaks)


def table_chunk(model: Transformer, n: int, batch: int, budget_bytes: int | None,
                reference_tokens: int | None = None) -> int:
    """The most sequences in one detector chunk of head_table: the first slice of cost.shared_chunks (a quarter of the
    batch, rounded up), fewer when two chunks (one per thread) and the spectra held beside them would not fit."""
    chunk = -(-batch // 4)
    if budget_bytes is None:
        return chunk
    room = max(1, (budget_bytes - _spectra_cost(model, reference_tokens).peak_bytes) // 2)
    return min(chunk, detector_chunk(model, n, batch, room))


def head_table_cost(model: Transformer, n: int, batch: int, budget_bytes: int | None = None,
                    reference_tokens: int | None = None) -> Cost:
    """head_table on `batch` sequences of n tokens: two detector chunks (one per thread) held beside the Grams,
    spectra and (`reference_tokens` given) kernel peaks."""
    cfg = model.cfg
    chunk = detectors_cost(model, n, table_chunk(model, n, batch, budget_bytes, reference_tokens))
    return (chunk + chunk + _spectra_cost(model, reference_tokens)).with_answer(
        numbers=8 * cfg.n_layers * cfg.n_heads, labels=2 * cfg.n_layers * cfg.n_heads)


def _spectra_cost(model: Transformer, reference_tokens: int | None = None) -> Cost:
    """The Grams (one LN chunk of W_E at a time), G_E W_Q and the spectra's [L, H, d_model, d_head] products, then
    μ's pass on `reference_tokens` tokens and the kernel (rotary.kernel_cost)."""
    cfg = model.cfg
    size, per_head = itemsize(model.dtype), cfg.n_layers * cfg.n_heads * cfg.d_model * cfg.d_head
    grams = (2 * cfg.d_model**2 + 2 * EMBED_CHUNK * cfg.d_model) * size
    spectra = Cost(grams + per_head * size + 2 * per_head * 8 + 4 * cfg.d_model**2 * 8)
    if reference_tokens is None:
        return spectra
    return spectra.then(kernel_cost(model, min(KERNEL_WINDOW, cfg.n_ctx - 1) + 1, reference_tokens))
