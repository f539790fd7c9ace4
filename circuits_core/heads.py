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
                  on the positions j + 1 that followed an earlier occurrence. On BOS + r + r this is the
                  clean definition of paper-math 2.15: mean_{i=T+1..2T} A[i, i-T+1] (second repeat only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from circuits_core.circuits import ov_copying_scores
from circuits_core.config import head_name
from circuits_core.errors import InvalidInputError, NotFoundError
from circuits_core.frozen import attention, ln_linear
from circuits_core.model import Transformer
from circuits_core.qk_paths import k_composition_positivity

PatternDetector = Literal["previous_token", "current_token", "first_token", "duplicate_token", "induction"]


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
    """[batch, n, n] bool: key j (1 <= j <= i) follows an earlier occurrence of query i's token (tok[j-1] == tok[i], j-1 < i)."""
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

    def score(pattern: Tensor, tokens: Tensor) -> Tensor:
        return pattern_detector_scores(pattern, tokens)[name]

    return score


PATTERN_DETECTORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    name: _single_detector(name)
    for name in ("previous_token", "current_token", "first_token", "duplicate_token", "induction")
}


def detector_scores(model: Transformer, tokens: Tensor) -> dict[str, Tensor]:
    """Every pattern detector for every head from one forward pass: {name: [n_layers, n_heads]}.

    The pass stops at the last layer's pattern (no last MLP, final LayerNorm or unembedding) and keeps only
    the patterns.
    """
    L = model.cfg.n_layers
    if L == 0:
        return {}
    tokens = model.check_tokens(tokens)
    with torch.no_grad():
        cache = model.run_until(tokens, f"blocks.{L - 1}.attn.hook_pattern", names=lambda n: n.endswith("hook_pattern"))
        targets = (duplicate_targets(tokens), induction_targets(tokens))
        per_layer = [
            pattern_detector_scores(cache[f"blocks.{layer}.attn.hook_pattern"], tokens, targets) for layer in range(L)
        ]
        return {name: torch.stack([scores[name] for scores in per_layer]) for name in PATTERN_DETECTORS}


def get_detector(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    if name not in PATTERN_DETECTORS:
        raise NotFoundError(f"unknown detector {name!r}; valid: {', '.join(PATTERN_DETECTORS)}")
    return PATTERN_DETECTORS[name]


# -- standard inputs, Olsson et al.'s evaluators and the paper's 2-D induction view --------------------
# Prefix matching (Olsson et al. appendix, paper-math 2.15): on BOS + 25 random tokens repeated 4 times, the
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


def standard_tokens(model: Transformer, seed: int = 0, seq_len: int = STANDARD_SEQ_LEN, batch: int = STANDARD_BATCH) -> Tensor:
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
    return repeated_random_tokens(model.cfg.d_vocab, seq_len, STANDARD_BATCH, seed, bos=bos, vocab=vocab, repeats=OLSSON_REPEATS)


def prefix_matching_scores(model: Transformer, tokens: Tensor | None = None, seed: int = 0) -> Tensor:
    """[n_layers, n_heads] Olsson's prefix-matching score (on `tokens`, default olsson_tokens(seed))."""
    tokens = olsson_tokens(model, seed) if tokens is None else tokens
    return detector_scores(model, tokens)["induction"]


def copying_scores(model: Transformer, tokens: Tensor | None = None, seed: int = 0) -> Tensor:
    """[n_layers, n_heads] Olsson's copying evaluator in [-1, 1] (see the comment above)."""
    tokens = model.check_tokens(olsson_tokens(model, seed) if tokens is None else tokens)
    with torch.no_grad():
        _, cache = model.run(tokens, names=lambda n: n.endswith(("hook_pattern", "hook_z", "ln_final.hook_scale")))
        b, n = tokens.shape
        inv_f = 1.0 / cache["ln_final.hook_scale"][..., 0] if "ln_final.hook_scale" in cache else torch.ones(b, n, dtype=model.dtype)
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


def previous_token_head(model: Transformer, prev_scores: Tensor | None = None) -> tuple[int, int]:
    """The layer-0 head with the largest previous-token score (on standard_tokens by default)."""
    prev = detector_scores(model, standard_tokens(model))["previous_token"] if prev_scores is None else prev_scores
    return 0, int(prev[0].argmax())


@dataclass
class InductionView:
    """The paper's 2-D view (Image 22): OV copying vs positivity of the K-composition term, per head [L, H]."""

    ov_copying: Tensor  # [L, H] eigenvalue copying score of the full OV circuit (circuits.ov_copying_scores)
    qk_k_composition: Tensor  # [L, H] positivity with the previous-token head (0 for layer 0)
    qk_weighted: Tensor  # [L, H] Olsson's version: earlier heads weighted by previous-token score
    previous_token_head: str
    previous_token_scores: Tensor  # [L, H]


def induction_view(model: Transformer, tokens: Tensor | None = None) -> InductionView:
    """Every head's (OV copying, QK K-composition positivity) point, previous-token head auto-chosen."""

    prev = detector_scores(model, standard_tokens(model) if tokens is None else tokens)["previous_token"]
    layer, head = previous_token_head(model, prev)
    one_hot = torch.zeros_like(prev)
    one_hot[layer, head] = 1.0
    return InductionView(ov_copying_scores(model), k_composition_positivity(model, one_hot),
                         k_composition_positivity(model, prev), head_name(layer, head), prev)
