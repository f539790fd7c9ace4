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
from typing import Literal

import torch
from torch import Tensor

from circuits_core.errors import InvalidInputError, NotFoundError
from circuits_core.model import Transformer

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


def pattern_detector_scores(pattern: Tensor, tokens: Tensor) -> dict[str, Tensor]:
    """All attention-pattern detectors of one layer: pattern [batch, head, n, n], tokens [batch, n] -> {name: [head]}."""
    return {
        "previous_token": _diag_mean(pattern, -1, 1),
        "current_token": _diag_mean(pattern, 0, 0),
        "first_token": pattern[:, :, 1:, 0].mean(dim=(0, 2)) if pattern.shape[-1] > 1 else _diag_mean(pattern, 0, 1),
        "duplicate_token": _masked_mass(pattern, duplicate_targets(tokens)),
        "induction": _masked_mass(pattern, induction_targets(tokens)),
    }


PATTERN_DETECTORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    name: (lambda p, t, _n=name: pattern_detector_scores(p, t)[_n])
    for name in ("previous_token", "current_token", "first_token", "duplicate_token", "induction")
}


def detector_scores(model: Transformer, tokens: Tensor) -> dict[str, Tensor]:
    """Every pattern detector for every head from one forward pass: {name: [n_layers, n_heads]}."""
    with torch.no_grad():
        _, cache = model.run(tokens, names=lambda n: n.endswith("hook_pattern"))
    per_layer = [pattern_detector_scores(cache[f"blocks.{layer}.attn.hook_pattern"], tokens) for layer in range(model.cfg.n_layers)]
    return {name: torch.stack([scores[name] for scores in per_layer]) for name in PATTERN_DETECTORS} if per_layer else {}


def get_detector(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    if name not in PATTERN_DETECTORS:
        raise NotFoundError(f"unknown detector {name!r}; valid: {', '.join(PATTERN_DETECTORS)}")
    return PATTERN_DETECTORS[name]
