"""Attention entropy per head: how spread out each query's attention is (docs/maths.md §1.3, the pattern A^{l,h}).

For head (l, h) on a sequence of n tokens, query position i attends with the distribution A[i, :] over the
causal keys 0..i. Its entropy, in nats,
    H_i = -sum_j A[i, j] log A[i, j]          (0 log 0 = 0)
is 0 for a head that puts all its attention on one key (a previous-token head, a BOS sink) and log(i + 1) for
uniform attention over every key it can see. `normalised` divides by that maximum (positions i >= 1), so
heads are comparable across positions: 0 = one key, 1 = uniform.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.cost import Cost, itemsize
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.frozen import forward_cost


def entropy(patterns: Tensor) -> Tensor:
    """[..., n, n] attention patterns (rows sum to 1) -> [..., n] entropy of each row, in nats."""
    return -torch.special.xlogy(patterns, patterns).sum(-1)


def head_entropies(model: Transformer, tokens: Tensor) -> Tensor:
    """[n_layers, n_heads, n] entropy H_i of every head's attention at every query position on `tokens` [n]."""
    with torch.no_grad():
        _, cache = model.run(tokens[None], names=lambda name: name.endswith("hook_pattern"))
    patterns = [cache[f"blocks.{layer}.attn.hook_pattern"][0] for layer in range(model.cfg.n_layers)]  # [H, n, n] each
    return (
        torch.stack([entropy(p.double()) for p in patterns])
        if patterns
        else torch.zeros(0, model.cfg.n_heads, len(tokens))
    )


def normalised(entropies: Tensor) -> Tensor:
    """[..., n] entropies -> [..., n - 1]: H_i / log(i + 1) for positions i >= 1 (1 = uniform over the keys)."""
    n = entropies.shape[-1]
    return entropies[..., 1:] / torch.log(torch.arange(2, n + 1, dtype=torch.float64, device=entropies.device))


def cost(model: Transformer, n: int) -> Cost:
    """head_entropies on n tokens: one forward pass keeping every layer's pattern [H, n, n], their float64
    copies; answer: n entropies per head and two means."""
    cfg = model.cfg
    kept = cfg.n_heads * n * n
    copies = Cost(cfg.n_layers * cfg.n_heads * n * n * (8 + itemsize(model.dtype)))
    return (
        forward_cost(model, n, 1, kept).then(copies).with_answer(numbers=cfg.n_layers * cfg.n_heads * (n + 2), labels=n)
    )
