"""Head detectors: behavioural scores of every head from one forward pass.

Paper sections: "Induction Heads" (Elhage et al. 2021) and the appendix of Olsson et al. 2022.
Patterns are TransformerLens-oriented: A[batch, head, query (destination), key (source)].

Attention-pattern detectors (all in [0, 1], averaged over the batch):
  previous_token  mean over i >= 1 of A[i, i-1]
  current_token   mean over i of A[i, i]
  first_token     mean over i >= 1 of A[i, 0]
  duplicate_token mean, over queries whose token occurred before, of the attention on earlier
                  occurrences of the same token
  induction       mean, over queries whose token occurred before at j (j + 1 <= i), of the attention
                  on the positions j + 1 that followed an earlier occurrence. On BOS + r + r it equals the
                  clean definition of docs/maths.md §2.15, mean_{i=T+1..2T} A[i, i-T+1] (second repeat only),
                  only when r has no repeated token and does not contain BOS's id: a token repeated inside r
                  makes first-copy queries eligible and gives second-copy queries several targets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from circuits_core.cost import Cost, check_stop, itemsize, polled, report_progress
from circuits_core.errors import InvalidInputError
from circuits_core.model.transformer import Transformer, next_token_losses
from circuits_core.prompt.frozen import attention, forward_cost, ln_linear, unembed_flops


def repeated_random_tokens(
    d_vocab: int,
    seq_len: int = 50,
    batch: int = 10,
    seed: int = 0,
    bos: int | None = None,
    vocab: Tensor | None = None,
    repeats: int = 2,
) -> Tensor:
    """[batch, 1 + repeats*seq_len] (or without the BOS column): BOS + r + r with r uniform random tokens.

    `vocab` restricts r to a set of token ids (e.g. excluding the rarest and commonest, as Olsson et al.).
    """
    if seq_len < 1 or batch < 1 or repeats < 2:
        raise InvalidInputError("repeated tokens need seq_len >= 1, batch >= 1 and repeats >= 2")
    gen = torch.Generator().manual_seed(seed)
    if vocab is None:
        r = torch.randint(0, d_vocab, (batch, seq_len), generator=gen)
    else:
        r = vocab[torch.randint(0, len(vocab), (batch, seq_len), generator=gen)]
    tokens = r.repeat(1, repeats)
    if bos is not None:
        tokens = torch.cat([torch.full((batch, 1), bos, dtype=tokens.dtype), tokens], dim=1)
    return tokens


def _diag_mean(pattern: Tensor, offset: int, start: int) -> Tensor:
    # pattern [batch, head, n, n] -> [head]: mean over queries i >= start of A[i, i + offset]
    n = pattern.shape[-1]
    if n <= start:
        return torch.zeros(pattern.shape[1], dtype=pattern.dtype, device=pattern.device)
    idx = torch.arange(start, n, device=pattern.device)
    return pattern[:, :, idx, idx + offset].mean(dim=(0, 2))


def _masked_mass(pattern: Tensor, targets: Tensor) -> Tensor:
    """Mean, over (batch, query) rows with at least one target, of the attention mass on the targets.

    pattern [batch, head, n, n]; targets [batch, n, n] bool (query, key) -> [head]
    """
    mass = (pattern * targets[:, None].to(pattern.dtype)).sum(-1)  # [batch, head, n]
    eligible = targets.any(-1)  # [batch, n]
    count = eligible.sum()
    if count == 0:
        return torch.full((pattern.shape[1],), float("nan"), dtype=pattern.dtype, device=pattern.device)
    return (mass * eligible[:, None].to(pattern.dtype)).sum(dim=(0, 2)) / count


def duplicate_targets(tokens: Tensor) -> Tensor:
    """[batch, n, n] bool: key j < i holds the same token as query i."""
    same = tokens[:, :, None] == tokens[:, None, :]
    return same & torch.ones_like(same[0]).tril(-1)


def induction_targets(tokens: Tensor) -> Tensor:
    """[batch, n, n] bool: key j (1 <= j <= i) follows an earlier occurrence of query i's token (tok[j-1] == tok[i], j-1
    < i)."""
    dup = duplicate_targets(tokens)  # [b, i, j'] with j' < i
    shifted = torch.zeros_like(dup)
    shifted[:, :, 1:] = dup[:, :, :-1]  # key j = j' + 1 <= i
    return shifted


def pattern_detector_scores(
    pattern: Tensor, tokens: Tensor, targets: tuple[Tensor, Tensor] | None = None
) -> dict[str, Tensor]:
    """All attention-pattern detectors of one layer: pattern [batch, head, n, n], tokens [batch, n] -> {name: [head]}.

    targets: (duplicate_targets(tokens), induction_targets(tokens)) when already computed for these tokens.
    """
    dup, ind = (duplicate_targets(tokens), induction_targets(tokens)) if targets is None else targets
    return {
        "previous_token": _diag_mean(pattern, -1, 1),
        "current_token": _diag_mean(pattern, 0, 0),
        "first_token": pattern[:, :, 1:, 0].mean(dim=(0, 2)) if pattern.shape[-1] > 1 else _diag_mean(pattern, 0, 1),
        "duplicate_token": _masked_mass(pattern, dup),
        "induction": _masked_mass(pattern, ind),
    }


def _single_detector(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """One entry of pattern_detector_scores as its own function: (pattern, tokens) -> [head]."""
    return lambda pattern, tokens: pattern_detector_scores(pattern, tokens)[name]


PATTERN_DETECTORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    name: _single_detector(name)
    for name in ("previous_token", "current_token", "first_token", "duplicate_token", "induction")
}


def detector_scores(
    model: Transformer, tokens: Tensor, should_stop: Callable[[], bool] | None = None, budget_bytes: int | None = None
) -> dict[str, Tensor]:
    """Every pattern detector for every head from one forward pass: {name: [n_layers, n_heads]}.

    The pass stops at the last layer's pattern (no last MLP, final LayerNorm or unembedding) and keeps only
    the patterns. With `budget_bytes`, the batch runs in chunks (see detector_run).
    """
    return detector_run(model, tokens, should_stop, budget_bytes).scores


@dataclass
class DetectorRun:
    """Detector scores of a batch, the first sequence's patterns and (optionally) the next-token losses."""

    scores: dict[str, Tensor]  # {name: [L, H]}
    first_patterns: Tensor  # [L, H, n, n] patterns of the first sequence
    losses: Tensor | None  # [batch, n - 1] float64: loss of predicting token i + 1 at position i


@dataclass
class DetectorSums:
    """The pattern detectors of some sequences times their weights (sequences, or eligible queries for the masked
    detectors), and the weights: the sums over the chunks of a batch give the batch's means (scores())."""

    sums: dict[str, Tensor] = field(default_factory=dict)  # {name: [L, H]}
    weights: dict[str, Tensor] = field(default_factory=dict)  # {name: [L, 1]}

    def add_chunk(self, patterns: list[Tensor], part: Tensor) -> None:
        """Add one chunk's scores: patterns, one [c, H, n, n] per layer, on tokens part [c, n]."""
        L, targets = len(patterns), (duplicate_targets(part), induction_targets(part))
        eligible = {"duplicate_token": targets[0].any(-1).sum(), "induction": targets[1].any(-1).sum()}
        for layer, pattern in enumerate(patterns):
            for name, value in pattern_detector_scores(pattern, part, targets).items():  # value [H]
                w = eligible.get(name, torch.tensor(part.shape[0])).to(value.dtype)
                contrib = torch.where(w > 0, value * w, torch.zeros_like(value))
                self.sums.setdefault(name, value.new_zeros(L, value.shape[0]))[layer] += contrib
                self.weights.setdefault(name, value.new_zeros(L, 1))[layer] += w

    def merge(self, other: DetectorSums) -> DetectorSums:
        """Both parts' sums (a part that scored no sequence adds nothing)."""
        if not self.sums or not other.sums:
            return self if other.sums == {} else other
        return DetectorSums(
            {k: v + other.sums[k] for k, v in self.sums.items()},
            {k: v + other.weights[k] for k, v in self.weights.items()},
        )

    def scores(self) -> dict[str, Tensor]:
        """{name: [L, H]}: the weighted means (NaN where no query was eligible); {} for a model without layers."""
        return (
            {
                name: torch.where(
                    self.weights[name] > 0, self.sums[name] / self.weights[name].clamp_min(1), float("nan")
                )
                for name in PATTERN_DETECTORS
            }
            if self.sums
            else {}
        )


def _chunk_pass(
    model: Transformer, part: Tensor, totals: DetectorSums, should_stop: Callable[[], bool] | None, with_loss: bool
) -> tuple[list[Tensor], Tensor | None]:
    """One chunk part [c, n] (under no_grad): its patterns' detectors added to `totals`; returns its patterns (one
    [c, H, n, n] per layer) and, `with_loss`, its next-token losses [c, n - 1] (a full pass; else the pass stops at
    the last layer's pattern)."""
    L = model.cfg.n_layers
    check_stop(should_stop, "head detectors")
    keep = polled(lambda nm: nm.endswith("hook_pattern"), should_stop, "head detectors")  # polls per hook
    losses = None
    if with_loss:
        logits, cache = model.run(part, names=keep)  # [c, n, d_vocab]
        losses = next_token_losses(logits, part, torch.float64)  # [c, n - 1]
        del logits
    else:
        cache = model.run_until(part, f"blocks.{L - 1}.attn.hook_pattern", names=keep)
    patterns = [cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(L)]
    totals.add_chunk(patterns, part)
    return patterns, losses


def detector_sums(
    model: Transformer,
    tokens: Tensor,
    take: Callable[[], slice | None],
    should_stop: Callable[[], bool] | None = None,
    losses: dict[int, Tensor] | None = None,
) -> DetectorSums:
    """The detectors of the chunks of tokens [b, n] that `take` hands out (row slices) until it gives None: several
    threads sharing one `take` (schedule.shared_chunks) split a batch, and their DetectorSums merge to its scores. With
    `losses`, each chunk runs the whole pass and puts its next-token losses [c, n - 1] there under its first row."""
    totals = DetectorSums()
    with torch.no_grad():
        while (rows := take()) is not None:
            check_stop(should_stop, "head detectors")
            report_progress(rows.start, tokens.shape[0])
            _, loss = _chunk_pass(model, tokens[rows], totals, should_stop, with_loss=losses is not None)
            if losses is not None and loss is not None:
                losses[rows.start] = loss
    return totals


def detector_run(
    model: Transformer,
    tokens: Tensor,
    should_stop: Callable[[], bool] | None = None,
    budget_bytes: int | None = None,
    with_loss: bool = False,
) -> DetectorRun:
    """detector_scores, the first sequence's patterns and, `with_loss`, the per-position losses (a full pass).

    With `budget_bytes`, the batch runs in chunks of sequences whose cost (detectors_cost) fits it; chunk
    scores are combined with their weights (sequences, or eligible queries for the masked detectors), so the
    result is the same mean. The stop flag is polled between chunks.
    """
    cfg = model.cfg
    tokens = model.check_tokens(tokens)
    b, n = tokens.shape
    chunk = b if budget_bytes is None else detector_chunk(model, n, b, budget_bytes, with_loss)
    no_heads = torch.zeros(0, cfg.n_heads, n, n, dtype=model.dtype)  # first_patterns of a model without layers
    if cfg.n_layers == 0 and not with_loss:
        return DetectorRun({}, no_heads, None)
    totals, first, losses = DetectorSums(), no_heads, []
    with torch.no_grad():
        for start in range(0, b, chunk):
            patterns, loss = _chunk_pass(model, tokens[start : start + chunk], totals, should_stop, with_loss)
            if start == 0 and patterns:
                first = torch.stack([p[0] for p in patterns])  # [L, H, n, n]
            if loss is not None:
                losses.append(loss)
    # no layers: no head to score, and the loss is the direct path's predictions (the model's all the same)
    return DetectorRun(totals.scores(), first, torch.cat(losses) if with_loss else None)


def detectors_cost(model: Transformer, n: int, batch: int, logits: bool = False) -> Cost:
    """detector_scores on `batch` sequences of n tokens in one pass: every layer's pattern [batch, H, n, n]
    kept, one layer's activations, the duplicate/induction targets and one masked product; with `logits`,
    a full pass's logits [batch, n, d_vocab] and their float64 next-token losses. Answer: 5 scores per head."""
    cfg = model.cfg
    size = itemsize(model.dtype)
    patterns = cfg.n_layers * cfg.n_heads * batch * n * n * size
    scoring = batch * n * n * (2 + cfg.n_heads * size)
    run = forward_cost(model, n, batch, logits=False)
    out = Cost(batch * n * cfg.d_vocab * (size + 2 * 8), flops=unembed_flops(cfg, batch, n)) if logits else Cost(0)
    return (Cost(patterns + scoring) + run + out).with_answer(
        numbers=5 * cfg.n_layers * cfg.n_heads, labels=cfg.n_layers * cfg.n_heads
    )


# With logits, a chunk's unembedding and float64 loss run between two polls of the stop flag: at most this many
# logits per chunk (64 MiB in float32) keeps that stretch short (~0.1 s for a 400-token GPT-2 sequence alone).
CHUNK_LOGITS = 2**24


def detector_chunk(model: Transformer, n: int, batch: int, budget_bytes: int, logits: bool = False) -> int:
    """The most sequences (<= batch, >= 1) whose detectors_cost peak fits budget_bytes (and, with logits, whose
    logits stay within CHUNK_LOGITS, so the stop flag is polled often)."""
    if logits:
        batch = max(1, min(batch, CHUNK_LOGITS // max(1, n * model.cfg.d_vocab)))
    for c in range(batch, 1, -1):
        if detectors_cost(model, n, c, logits).peak_bytes <= budget_bytes:
            return c
    return 1


# -- standard inputs, Olsson et al.'s evaluators and the paper's 2-D induction view --------------------
# Prefix matching (Olsson et al. appendix, docs/maths.md §2.15): on BOS + 25 random tokens repeated 4 times, the
# mean attention mass from each token to the tokens that followed the same token in earlier repeats -- the
# `induction` pattern detector evaluated on that input.
# Copying (Olsson et al.): the head's direct logit effect at each query position i (its output through the
# frozen final LayerNorm and W_U), minus its mean over the vocabulary, through a ReLU; then
#     ratio_i = attended_i / (attended_i + all_i),  attended_i = sum_j A[i, j] relu_logit_i[t_j],
#     all_i = sum over the distinct tokens t of the sequence of relu_logit_i[t],
# in [0, 0.5] (0.5 when the head raises only the attended tokens), averaged over queries i >= 1 and the
# batch, and scaled to [-1, 1] as 4 ratio - 1. (The appendix's wording leaves the exact denominator open;
# this reading gives its stated range.)
STANDARD_SEQ_LEN, STANDARD_BATCH = 50, 10
OLSSON_SEQ_LEN, OLSSON_REPEATS = 25, 4


def standard_tokens(
    model: Transformer, seed: int = 0, seq_len: int = STANDARD_SEQ_LEN, batch: int = STANDARD_BATCH
) -> Tensor:
    """[batch, 1 + 2 seq_len]: BOS (cfg.bos_token_id, else 0) + r + r with r uniform random tokens.

    seq_len shrinks to fit a short context: min(seq_len, (n_ctx - 1) // 2).
    """
    seq_len = min(seq_len, (model.cfg.n_ctx - 1) // 2)
    bos = model.cfg.bos_token_id if model.cfg.bos_token_id is not None else 0
    return repeated_random_tokens(model.cfg.d_vocab, seq_len, batch, seed, bos=bos)


def olsson_tokens(model: Transformer, seed: int = 0, vocab: Tensor | None = None) -> Tensor:
    """[10, 1 + 4 x 25]: Olsson et al.'s input. `vocab`: allowed ids (e.g. without the most/least common)."""
    bos = model.cfg.bos_token_id if model.cfg.bos_token_id is not None else 0
    seq_len = min(OLSSON_SEQ_LEN, (model.cfg.n_ctx - 1) // OLSSON_REPEATS)
    return repeated_random_tokens(
        model.cfg.d_vocab, seq_len, STANDARD_BATCH, seed, bos=bos, vocab=vocab, repeats=OLSSON_REPEATS
    )


def copying_scores(model: Transformer, tokens: Tensor | None = None, seed: int = 0) -> Tensor:
    """[n_layers, n_heads] Olsson's copying evaluator in [-1, 1] (see the comment above)."""
    tokens = model.check_tokens(olsson_tokens(model, seed) if tokens is None else tokens)
    with torch.no_grad():
        _, cache = model.run(tokens, names=lambda n: n.endswith(("hook_pattern", "hook_z", "ln_final.hook_scale")))
        b, n = tokens.shape
        inv_f = (
            1.0 / cache["ln_final.hook_scale"][..., 0]
            if "ln_final.hook_scale" in cache
            else torch.ones(b, n, dtype=model.dtype)
        )
        U_seq = model.W_U[:, tokens].permute(1, 0, 2)  # [b, d, n]: logit direction of each position's token
        U_mean = model.W_U.mean(1)  # [d]
        first = torch.ones(b, n, dtype=torch.bool)  # first occurrence of each distinct token
        first[:, 1:] = ~duplicate_targets(tokens)[:, 1:].any(-1)
        out = []
        for layer in range(model.cfg.n_layers):
            result = torch.einsum("bqhe,hed->bhqd", cache[f"blocks.{layer}.attn.hook_z"], attention(model, layer).W_O)
            effect = torch.stack([ln_linear(model, "ln_final", result[i], inv_f[i]) for i in range(b)])  # [b, H, q, d]
            logits = torch.einsum("bhqd,bdk->bhqk", effect, U_seq) - (effect @ U_mean)[..., None]  # [b, H, q, k]
            relu = logits.clamp_min(0)
            attended = (cache[f"blocks.{layer}.attn.hook_pattern"] * relu).sum(-1)  # [b, H, q]
            total = (relu * first[:, None, None, :].to(relu.dtype)).sum(-1)
            ratio = torch.where(attended + total > 0, attended / (attended + total).clamp_min(1e-30), 0.0)
            out.append(4 * ratio[:, :, 1:].mean(dim=(0, 2)) - 1)
    return torch.stack(out)


HEADS_RULE = (
    "the strongest induction head of layers >= 1, and the strongest previous-token head of an earlier layer (the "
    "head its keys can K-compose with), by their detector scores on the standard input"
)


def heads_that_matter(induction: Tensor, previous: Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
    """(previous-token head, induction head) as (layer, head), by HEADS_RULE from [L, H] induction and previous-token
    scores (NaN scores never win). One layer: (L0's strongest previous-token head, the same head)."""
    ind, prev = induction.double().nan_to_num(-math.inf), previous.double().nan_to_num(-math.inf)  # [L, H]
    n_layers, n_heads = ind.shape
    if n_layers < 2:
        h = int(prev[0].argmax())
        return (0, h), (0, h)
    flat = int(ind[1:].flatten().argmax())
    layer, h = 1 + flat // n_heads, flat % n_heads  # the induction head, in layers 1..
    earlier = int(prev[:layer].flatten().argmax())
    return (earlier // n_heads, earlier % n_heads), (layer, h)


def previous_token_head(model: Transformer, scores: dict[str, Tensor] | None = None) -> tuple[int, int]:
    """The previous-token head of heads_that_matter (detector scores on standard_tokens by default)."""
    scores = detector_scores(model, standard_tokens(model)) if scores is None else scores
    return heads_that_matter(scores["induction"], scores["previous_token"])[0]
