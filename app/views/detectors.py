"""Detector run: per-head scores, the patterns of selected heads and the per-position loss.

Input: BOS + r + r repeated random tokens (seq_len, batch, seed), or one prompt. On the repeated input the
loss of the second copy of r falls below the first when the model copies in context (induction heads;
paper "Induction Heads", docs/maths.md §2.15). losses[i] is the loss of predicting token i + 1 at position i.
"""

from __future__ import annotations

import torch
from torch import Tensor

from app.analysis import Analysis, cache_key, split_heads
from app.params import DetectorParams, NoParams
from app.scheduling import cached
from app.schemas import DetectorInput, DetectorsView, HeadPattern, HeadsView, LossByPosition
from app.settings import Limits
from app.views.shared.heads_table import HEADS, bos_id, head_scores, num, repeated_input, standard_input
from app.views.shared.inputs import model_ref, parse_heads, resolve_prompt, token_refs
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name
from circuits_core.prompt import detectors as heads
from circuits_core.prompt.detectors import detector_run

DETECTOR_NAMES = ("previous_token", "induction", "duplicate_token", "current_token", "first_token")


def _best_heads(detectors: dict[str, Tensor]) -> list[tuple[int, int]]:
    """The highest-scoring head of each detector, without repeats."""
    picked: list[tuple[int, int]] = []
    for name in DETECTOR_NAMES:
        scores = detectors.get(name)
        if scores is None or scores.numel() == 0:
            continue
        flat = int(scores.nan_to_num(-1.0).argmax())
        pair = divmod(flat, scores.shape[1])
        if pair not in picked:
            picked.append(pair)
    return picked


def _losses(per_sequence: Tensor, seq_len: int | None, has_bos: bool) -> LossByPosition:
    # per_sequence [batch, n - 1] next-token losses -> loss per position [n - 1], mean over the batch
    losses = per_sequence.mean(0)
    per_pos: list[float | None] = [num(v) for v in losses.tolist()] + [None]
    if seq_len is None:
        return LossByPosition(loss=per_pos)
    start = 0 if has_bos else -1  # with BOS, losses[0:T] predict the first copy, losses[T:2T] the second
    first = losses[max(start, 0) : start + seq_len]
    second = losses[start + seq_len : start + 2 * seq_len]
    return LossByPosition(loss=per_pos, first_repeat=num(first.mean()), second_repeat=num(second.mean()))


def build_detectors_view(loaded: LoadedModel, p: DetectorParams, limits: Limits) -> DetectorsView:
    """Detector scores of every head on BOS + r + r (or on a prompt), patterns of `heads` (default: the best
    head of each detector) on the first sequence, and the per-position loss."""
    p = p.normalised(loaded)  # seq_len fitted to the context when not given
    assert p.seq_len is not None
    seq_len, batch, seed, prompt, tokens, heads = p.seq_len, p.batch, p.seed, p.prompt, p.tokens, split_heads(p.heads)
    if prompt is not None or tokens is not None:
        ids = resolve_prompt(loaded, prompt, tokens, limits)
        run_tokens = torch.tensor([ids], dtype=torch.long, device=loaded.model.device)
        meta = DetectorInput(kind="prompt", seq_len=None, batch=1, seed=None, bos=None, n_tokens=len(ids))
        repeat_len = None
    else:
        run_tokens, meta = repeated_input(loaded, seq_len, batch, seed)
        repeat_len = seq_len
    chosen = parse_heads(heads, loaded, limits.max_heads) if heads else None
    table = standard_table(loaded, p)
    if table is not None and table.loss_by_position is not None:  # the heads table's pass on this very input
        run = detector_run(loaded.model, run_tokens[:1])  # only the first sequence's patterns are shown
        detectors = _scores(loaded, table)
        per_sequence = torch.tensor([table.loss_by_position], dtype=torch.float64)  # [1, n - 1] batch means
        scored = table.heads
    else:
        run = detector_run(loaded.model, run_tokens, budget_bytes=limits.peak_bytes, with_loss=True)  # chunked
        detectors = run.scores
        assert run.losses is not None
        per_sequence, scored = run.losses, head_scores(loaded, detectors)
    chosen = chosen if chosen is not None else _best_heads(detectors)
    head_patterns = [
        HeadPattern(head=head_name(layer, h), pattern=run.first_patterns[layer, h].double().tolist())
        for layer, h in chosen
    ]
    loss = _losses(per_sequence, repeat_len, meta.bos is not None)
    return DetectorsView(
        model=model_ref(loaded),
        detector_input=meta,
        tokens=token_refs(loaded, run_tokens[0].tolist()),
        heads=scored,
        selected=[p.head for p in head_patterns],
        patterns=head_patterns,
        loss=loss,
    )


def standard_table(loaded: LoadedModel, p: DetectorParams) -> HeadsView | None:
    """The heads table when it is computed already and `p` asks for its input (the standard BOS + r + r): its
    detector scores and losses are this view's, so only the first sequence's patterns are left to compute."""
    if p.prompt is not None or p.tokens is not None:
        return None
    meta = standard_input(loaded)[1]
    if (p.seq_len, p.batch, p.seed) != (meta.seq_len, meta.batch, meta.seed):
        return None
    return cached(cache_key(HEADS, loaded.path.name, loaded, NoParams()), HeadsView)


def _scores(loaded: LoadedModel, table: HeadsView) -> dict[str, Tensor]:
    """{detector: [L, H]} from the heads table's rows (NaN where a head has no score)."""
    cfg = loaded.model.cfg
    out = {name: torch.full((cfg.n_layers, cfg.n_heads), float("nan"), dtype=torch.float64) for name in DETECTOR_NAMES}
    for h in table.heads:
        for name in DETECTOR_NAMES:
            value = getattr(h, name)
            if value is not None:
                out[name][h.layer, h.index] = value
    return out


def detectors_cost(loaded: LoadedModel, p: DetectorParams, limits: Limits) -> Cost:
    """One pass with logits on the prompt (1 sequence) or on batch x (BOS + 2 seq_len) tokens; on the heads table's
    own input, once that is computed, the first sequence's pass alone."""
    p = p.normalised(loaded)
    assert p.seq_len is not None
    if standard_table(loaded, p) is not None:
        n = 2 * p.seq_len + (bos_id(loaded) is not None)
        return heads.detectors_cost(loaded.model, n, 1).with_answer(numbers=len(DETECTOR_NAMES) * n * n + 2 * n)
    if p.prompt is not None or p.tokens is not None:
        n, batch = len(resolve_prompt(loaded, p.prompt, p.tokens, limits)), 1
    else:
        n, batch = 2 * p.seq_len + (bos_id(loaded) is not None), p.batch
    chunk = heads.detector_chunk(loaded.model, n, batch, limits.peak_bytes, logits=True)
    one = heads.detectors_cost(loaded.model, n, chunk, logits=True)  # a chunk held at once; FLOPs of every chunk
    cost = Cost(one.peak_bytes, one.answer_bytes, one.flops * -(-batch // chunk))
    shown = len(split_heads(p.heads)) or len(DETECTOR_NAMES)
    return cost.with_answer(numbers=shown * n * n + 2 * n, labels=n)


DETECTORS = Analysis(
    name="detectors",
    path="detectors",
    params=DetectorParams,
    view=DetectorsView,
    build=build_detectors_view,
    cost=detectors_cost,
    summary="Head detectors on repeated random tokens",
    tags=["detectors"],
    needs_layers=1,
)
