"""Term importance: the paper's path-order ablation, and Olsson et al.'s pattern-preserving head ablation.

Paper section: "Term importance analysis" (Elhage et al. 2021; paper-math 2.13). With the clean run's
attention patterns and LayerNorm scales frozen, rerun the model so that every layer's *values* read the
residual stream of the previous rerun (`Frozen(value_resid=...)` in model.run; queries and keys keep the
clean patterns). Starting from value inputs of zero (only biases pass), rerun k contains exactly the paths
with at most k heads (V-composition depth k):
    logits_{<=k} = direct + bias terms + sum of path terms of order <= k    (paths.py, same bookkeeping)
    marginal effect of order k = L_{<=k-1} - L_{<=k};   L_{<=n_layers} == clean loss (asserted)
First-order terms by layer: order 0 plus the first-order terms of one layer (that layer's values read the
order-0 residual, the others read zero).

MLPs (paths.py's convention): an MLP is a fixed node, its clean output a *source* of paths like the embedding,
so it is order 0 and a path ("mlp:L0", "L1H2") has order 1 (the number of heads). Every rerun therefore
freezes each MLP's output to the clean run's (`Frozen(mlp_out=...)`): recomputing it inside a rerun would
mix orders (its nonlinearity would see a residual truncated at order k-1).

Head ablation: the head's result replaced by zero (its pattern frozen to zero) and the loss change, two ways,
each labelled where shown. Frozen (Olsson): every other pattern frozen at the clean run -- a head that acts
only through later queries or keys (toy-2l's previous-token head L0H5 feeding the induction head by
K-composition) then looks unimportant. Recomputed: later layers compute their patterns from the ablated
residual stream, so composition acts. Either way LayerNorm scales and downstream MLPs are recomputed on the
ablated residual stream (a causal intervention, not a path decomposition), so in MLP models the change also
includes the MLPs' reaction to the missing head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model import Frozen, Transformer, next_token_losses


@dataclass
class OrderAblation:
    losses: Tensor  # [n_layers + 1]: loss with paths of order <= k, k = 0..n_layers
    marginal: Tensor  # [n_layers]: losses[k-1] - losses[k], the effect of the order-k terms
    clean_loss: float
    first_order_by_layer: Tensor  # [n_layers]: loss with order 0 + the first-order terms of layer l
    first_order_gain: Tensor  # [n_layers]: losses[0] - first_order_by_layer


def lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Mean next-token cross-entropy: logits [b, n, V], tokens [b, n]."""
    return next_token_losses(logits.double(), tokens).mean()


def _clean_frozen(model: Transformer, tokens: Tensor) -> tuple[Tensor, Frozen]:
    """Clean logits [b, n, V] and the clean run's patterns, LayerNorm scales and MLP outputs."""
    with torch.no_grad():
        logits, cache = model.run(tokens, names=lambda n: n.endswith(("hook_pattern", "hook_scale", "hook_mlp_out")))
    patterns = {k: v for k, v in cache.items() if k.endswith("hook_pattern")}
    scales = {k: v for k, v in cache.items() if k.endswith("hook_scale")}
    mlp_out = {layer: cache[f"blocks.{layer}.hook_mlp_out"] for layer in range(model.cfg.n_layers) if not model.cfg.attn_only}
    return logits, Frozen(patterns, scales, mlp_out=mlp_out)


def _rerun(frozen: Frozen, value_resid: dict[int, Tensor]) -> Frozen:
    """Patterns, LayerNorm scales and MLP outputs of the clean run; values read `value_resid`."""
    return Frozen(frozen.patterns, frozen.ln_scales, value_resid, frozen.mlp_out)


def _check(model: Transformer, tokens: Tensor) -> Tensor:
    tokens = model.check_tokens(tokens)
    if tokens.shape[1] < 2:
        raise InvalidInputError(f"a loss needs at least 2 tokens per sequence, got {tokens.shape[1]}")
    return tokens


def order_logits(model: Transformer, tokens: Tensor, should_stop: Callable[[], bool] | None = None) -> list[Tensor]:
    """[logits with paths of order <= k for k = 0..n_layers], each [b, n, V]; the last equals the clean logits."""
    tokens = _check(model, tokens)
    _, frozen = _clean_frozen(model, tokens)
    return _order_logits(model, tokens, frozen, should_stop)


def _order_logits(model: Transformer, tokens: Tensor, frozen: Frozen, should_stop: Callable[[], bool] | None) -> list[Tensor]:
    L = model.cfg.n_layers
    b, n = tokens.shape
    zero = torch.zeros(b, n, model.cfg.d_model, dtype=model.dtype, device=model.device)
    value_resid = {layer: zero for layer in range(L)}
    out = []
    with torch.no_grad():
        for _k in range(L + 1):
            check_stop(should_stop, "order ablation")
            logits, cache = model.run(tokens, names=lambda nm: nm.endswith("hook_resid_pre"),
                                      frozen=_rerun(frozen, value_resid))
            out.append(logits)
            value_resid = {layer: cache[f"blocks.{layer}.hook_resid_pre"] for layer in range(L)}
    return out


def order_ablation(model: Transformer, tokens: Tensor, should_stop: Callable[[], bool] | None = None) -> OrderAblation:
    """Losses on `tokens` [b, n] with paths up to each order, marginal effects, first-order terms by layer."""
    tokens = _check(model, tokens)
    clean_logits, frozen = _clean_frozen(model, tokens)
    per_order = _order_logits(model, tokens, frozen, should_stop)
    scale = clean_logits.abs().max().clamp_min(1.0)
    tol = 1e-9 if model.dtype == torch.float64 else 1e-4
    if not torch.allclose(per_order[-1], clean_logits, atol=float(tol * scale), rtol=0):
        raise AssertionError("order-n_layers rerun does not reproduce the model's logits")
    losses = torch.stack([lm_loss(lg, tokens) for lg in per_order])
    clean = float(lm_loss(clean_logits, tokens))
    # first-order terms of one layer: its values read the order-0 residual, every other layer reads zero
    L = model.cfg.n_layers
    b, n = tokens.shape
    zero = torch.zeros(b, n, model.cfg.d_model, dtype=model.dtype, device=model.device)
    with torch.no_grad():
        _, cache0 = model.run(tokens, names=lambda nm: nm.endswith("hook_resid_pre"),
                              frozen=_rerun(frozen, {layer: zero for layer in range(L)}))
        by_layer = []
        for layer in range(L):
            check_stop(should_stop, "order ablation")
            vr = {other: zero for other in range(L)}
            vr[layer] = cache0[f"blocks.{layer}.hook_resid_pre"]
            logits, _ = model.run(tokens, frozen=_rerun(frozen, vr))
            by_layer.append(lm_loss(logits, tokens))
    first = torch.stack(by_layer) if by_layer else losses.new_zeros(0)
    return OrderAblation(losses, losses[:-1] - losses[1:], clean, first, losses[0] - first)


def ablate_head(model: Transformer, tokens: Tensor, layer: int, head: int, recompute_patterns: bool,
                names: Callable[[str], bool] | None = None, frozen: Frozen | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits [b, n, V] and the cache of `names` with head (layer, head)'s result zeroed.

    recompute_patterns=False (Olsson's ablation): every attention pattern is frozen at the clean run, so a head
    that only matters through later heads' queries or keys (a previous-token head feeding an induction head by
    K-composition) shows almost no effect. recompute_patterns=True: only this head's output is removed; every
    later layer computes its patterns from the ablated residual stream, so Q- and K-composition act.
    `frozen`: the clean run's Frozen (from _clean_frozen) when the caller already has it."""
    if frozen is None:
        frozen = _clean_frozen(model, tokens)[1]
    key = f"blocks.{layer}.attn.hook_pattern"
    pattern = frozen.patterns[key].clone()  # layer's clean pattern: its input is not changed by the ablation
    pattern[:, head] = 0  # z = A v = 0, so the head's result (b_V share included) is zero
    patterns = {key: pattern} if recompute_patterns else {**frozen.patterns, key: pattern}
    with torch.no_grad():
        return model.run(tokens, names=names, frozen=Frozen(patterns))


def head_ablation(model: Transformer, tokens: Tensor, should_stop: Callable[[], bool] | None = None,
                  recompute_patterns: bool = False) -> Tensor:
    """[n_layers, n_heads]: loss change when a head's result is zeroed (ablate_head), with every pattern frozen
    (Olsson, the default) or with later patterns recomputed (`recompute_patterns`).

    LayerNorm scales and MLPs are recomputed either way (see the module docstring)."""
    tokens = model.check_tokens(tokens)
    clean_logits, frozen = _clean_frozen(model, tokens)
    clean = lm_loss(clean_logits, tokens)
    cfg = model.cfg
    out = torch.zeros(cfg.n_layers, cfg.n_heads, dtype=torch.float64, device=model.device)
    for layer in range(cfg.n_layers):
        for h in range(cfg.n_heads):
            check_stop(should_stop, "head ablation")
            logits, _ = ablate_head(model, tokens, layer, h, recompute_patterns, frozen=frozen)
            out[layer, h] = lm_loss(logits, tokens) - clean
    return out


def cost(model: Transformer, n: int, batch: int = 1) -> Cost:
    """order_ablation then head_ablation twice (patterns frozen, then recomputed) on `batch` sequences of n
    tokens: the frozen patterns of every layer (and a copy of one), LayerNorm scales, MLP outputs, the residual
    streams of one rerun, the clean and the per-order logits; answer: the per-order and per-layer losses and two
    loss changes per head."""
    cfg = model.cfg
    b = batch
    resid = (4 if cfg.attn_only else 5) * cfg.n_layers * b * n * cfg.d_model
    patterns = cfg.n_layers * cfg.n_heads * b * n * n * 2
    logits = (cfg.n_layers + 3) * b * n * cfg.d_vocab  # clean, one per order, the rerun in flight
    layer = b * n * (4 * cfg.d_model + 4 * cfg.n_heads * cfg.d_head + (0 if cfg.attn_only else 3 * (cfg.d_mlp or 4 * cfg.d_model)))
    peak = (patterns + resid + logits + layer) * itemsize(model.dtype) + 2 * b * n * cfg.d_vocab * 8  # float64 loss
    L, H = cfg.n_layers, cfg.n_heads
    return Cost(peak).with_answer(numbers=3 * (L + 1) + L + 2 * H * L, labels=L * H + n)  # two head ablations
