"""Term importance: the paper's path-order ablation, and Olsson et al.'s pattern-preserving head ablation.

Paper section: "Term importance analysis" (Elhage et al. 2021; docs/maths.md §2.13). With the clean run's
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

Speed, with the same numbers as one full rerun per order and per head (tests/core/test_ablation.py checks them
against weight-edited models and paths.py in float64):
- a rerun starts at the first layer whose input changes, from the clean run's stream entering it (`run_from`):
  rerun k of the order ablation reproduces the clean stream up to layer k (the paths through the first k layers
  have order <= k), a head ablation changes nothing before the head's layer;
- the ablated heads share one batch, a block of rows each, joining it at their layer (`head_ablations`); losses
  unembed only the positions with a next token, a group of rows against a block of the vocabulary (`_row_losses`);
- the order reruns run side by side with the two head ablations (schedule.side_by_side) when a core is idle.
`cost` prices it all, FLOPs included (the app compares them with the request deadline).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model.config import ModelConfig
from circuits_core.model.flops import layer_flops, layers_flops, unembed_flops
from circuits_core.model.head_names import all_heads
from circuits_core.model.hooks import Recorder
from circuits_core.model.transformer import Frozen, Transformer, next_token_losses
from circuits_core.schedule import side_by_side

# Working memory of one batch of rerun rows (the ablated heads' rows run together), and of one block of unembedded
# logits with their exponentials: bounds the peak on long prompts and big vocabularies. LOSS_TOKENS: positions
# unembedded at once, enough rows for a matrix product near the machine's peak.
CHUNK_BYTES = 128 * 2**20
LOSS_CHUNK_BYTES = 64 * 2**20
LOSS_TOKENS = 2048


@dataclass
class OrderAblation:
    losses: Tensor  # [n_layers + 1]: loss with paths of order <= k, k = 0..n_layers
    marginal: Tensor  # [n_layers]: losses[k-1] - losses[k], the effect of the order-k terms
    clean_loss: float
    first_order_by_layer: Tensor  # [n_layers]: loss with order 0 + the first-order terms of layer l
    first_order_gain: Tensor  # [n_layers]: losses[0] - first_order_by_layer


@dataclass
class CleanRun:
    """What the reruns take from the clean run."""

    loss: Tensor  # [] float64: the clean run's mean next-token loss (lm_loss of its logits, which are not kept)
    frozen: Frozen  # its patterns, LayerNorm scales and MLP outputs
    resid_pre: list[Tensor]  # [n_layers + 1] x [b, n, d_model]: the stream entering each layer; last: after the last


def lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Mean next-token cross-entropy: logits [b, n, V], tokens [b, n]."""
    return next_token_losses(logits, tokens, torch.float64).mean()


def clean_run(model: Transformer, tokens: Tensor) -> CleanRun:
    """The clean run of `tokens` [b, n] with everything a rerun needs from it."""
    L = model.cfg.n_layers
    wanted = ("hook_pattern", "hook_scale", "hook_mlp_out", "hook_resid_pre", "hook_resid_final")
    with torch.no_grad():
        logits, cache = model.run(tokens, names=lambda n: n.endswith(wanted))
    patterns = {k: v for k, v in cache.items() if k.endswith("hook_pattern")}
    scales = {k: v for k, v in cache.items() if k.endswith("hook_scale")}
    mlp_out = {layer: cache[f"blocks.{layer}.hook_mlp_out"] for layer in range(L) if not model.cfg.attn_only}
    resid = [cache[f"blocks.{layer}.hook_resid_pre"] for layer in range(L)] + [cache["hook_resid_final"]]
    return CleanRun(lm_loss(logits, tokens), Frozen(patterns, scales, mlp_out=mlp_out), resid)


def _rerun(frozen: Frozen, value_resid: dict[int, Tensor]) -> Frozen:
    """Patterns, LayerNorm scales and MLP outputs of the clean run; values read `value_resid`."""
    return Frozen(frozen.patterns, frozen.ln_scales, value_resid, frozen.mlp_out)


def _check(model: Transformer, tokens: Tensor) -> Tensor:
    tokens = model.check_tokens(tokens)
    if tokens.shape[1] < 2:
        raise InvalidInputError(f"a loss needs at least 2 tokens per sequence, got {tokens.shape[1]}")
    return tokens


def _loss_block(tokens: int) -> int:
    """Vocabulary columns unembedded at once for `tokens` positions: the logits and their exponentials within
    LOSS_CHUNK_BYTES."""
    return max(256, LOSS_CHUNK_BYTES // (16 * max(1, tokens)))


def _row_losses(model: Transformer, final: Tensor, tokens: Tensor, ln_scale: Tensor | None = None) -> Tensor:
    """[R] mean next-token loss of each row: final [R, n, d_model] (the stream after the last layer), tokens [R, n],
    ln_scale [R, n, 1] (ln_final's frozen scale; None: computed). Only the positions with a next token are
    unembedded, the rows of about LOSS_TOKENS positions at a time against a block of the vocabulary, the log-sum-exp
    accumulated over blocks in float64: the cross-entropy of next_token_losses on the whole logits."""
    R, n = tokens.shape
    W_U, b_U = model.W_U, model.b_U  # [d_model, V], [V]
    V = model.cfg.d_vocab
    rows = max(1, LOSS_TOKENS // (n - 1))
    out = []
    for i in range(0, R, rows):
        scale = ln_scale[i : i + rows] if ln_scale is not None else None
        frozen = Frozen(ln_scales={"ln_final.hook_scale": scale}) if scale is not None else None
        x = model.ln_final(final[i : i + rows], Recorder(None), frozen)[:, :-1].reshape(-1, model.cfg.d_model)  # [t, d]
        ts = tokens[i : i + rows, 1:].reshape(-1)  # [t]
        lse = torch.full((x.shape[0],), float("-inf"), dtype=torch.float64, device=x.device)
        target = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        step = _loss_block(x.shape[0])
        for v in range(0, V, step):
            logits = x @ W_U[:, v : v + step]  # [t, block]
            if b_U is not None:
                logits = logits + b_U[v : v + step]
            lse = torch.logaddexp(lse, logits.logsumexp(-1).double())  # in the logits' dtype: float32 sums
            # with a float64 result differ from a float64 log-sum-exp by ~1e-7 nats (measured on SmolLM2)
            here = (ts >= v) & (ts < v + step)
            target[here] = logits[here, ts[here] - v].double()
        out.append((lse - target).view(-1, n - 1).mean(1))
    return torch.cat(out)


def order_logits(model: Transformer, tokens: Tensor, should_stop: Callable[[], bool] | None = None) -> list[Tensor]:
    """[logits with paths of order <= k for k = 0..n_layers], each [b, n, V]; the last equals the clean logits."""
    tokens = _check(model, tokens)
    clean = clean_run(model, tokens)
    finals: list[Tensor] = []
    _order_finals(model, clean, finals.append, should_stop)
    with torch.no_grad():
        return [model.unembed_resid(f, frozen=clean.frozen) for f in finals]


def _order_finals(
    model: Transformer, clean: CleanRun, keep: Callable[[Tensor], None], should_stop: Callable[[], bool] | None
) -> dict[str, Tensor]:
    """`keep`s the stream after the last layer of rerun k = 0..n_layers (paths of order <= k); rerun 0's cache.

    Rerun k's values read rerun k-1's stream (zero for k = 0). The paths through the first k layers have order <= k,
    so rerun k's stream equals the clean one up to layer k: it starts there, from the clean stream (run_from)."""
    L = model.cfg.n_layers
    zero = torch.zeros_like(clean.resid_pre[0])
    value_resid = dict.fromkeys(range(L), zero)
    first: dict[str, Tensor] = {}
    with torch.no_grad():
        for k in range(L + 1):
            check_stop(should_stop, "order ablation")
            final, cache = model.run_from(
                clean.resid_pre[k],
                k,
                names=lambda nm: nm.endswith("hook_resid_pre"),
                frozen=_rerun(clean.frozen, value_resid),
            )
            keep(final)
            first = first or cache
            value_resid = {layer: cache[f"blocks.{layer}.hook_resid_pre"] for layer in range(k, L)}
    return first


class _Losses:
    """Reruns' final streams [b, n, d_model] waiting for their mean losses, unembedded together (_row_losses) once
    they hold LOSS_TOKENS positions, so that neither the matrix products nor the memory held depend on their count."""

    def __init__(self, model: Transformer, tokens: Tensor, ln_scale: Tensor | None):
        self.model, self.tokens, self.ln_scale = model, tokens, ln_scale  # [b, n], [b, n, 1]
        self.pending: list[Tensor] = []
        self.losses: list[Tensor] = []

    def add(self, final: Tensor) -> None:
        self.pending.append(final)
        b, n = self.tokens.shape
        if len(self.pending) * b * (n - 1) >= LOSS_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        c, b = len(self.pending), self.tokens.shape[0]
        scale = None if self.ln_scale is None else self.ln_scale.repeat(c, 1, 1)
        rows = _row_losses(self.model, torch.cat(self.pending), self.tokens.repeat(c, 1), scale)  # [c*b]
        self.losses.append(rows.view(c, b).mean(1))
        self.pending = []

    def result(self) -> Tensor:
        self.flush()
        return torch.cat(self.losses)


def order_ablation(
    model: Transformer, tokens: Tensor, should_stop: Callable[[], bool] | None = None, clean: CleanRun | None = None
) -> OrderAblation:
    """Losses on `tokens` [b, n] with paths up to each order, marginal effects, first-order terms by layer."""
    tokens = _check(model, tokens)
    clean = clean or clean_run(model, tokens)
    L = model.cfg.n_layers
    queue = _Losses(model, tokens, clean.frozen.ln_scales.get("ln_final.hook_scale"))
    order0 = _order_finals(model, clean, queue.add, should_stop)
    # first-order terms of one layer: its values read the order-0 stream, every other layer's read zero; the layers
    # before it then run as in rerun 0, so it starts at that layer from rerun 0's stream
    zero = torch.zeros_like(clean.resid_pre[0])
    with torch.no_grad():
        for layer in range(L):
            check_stop(should_stop, "order ablation")
            start = order0[f"blocks.{layer}.hook_resid_pre"]
            vr = {other: zero for other in range(layer + 1, L)} | {layer: start}
            queue.add(model.run_from(start, layer, frozen=_rerun(clean.frozen, vr))[0])
        losses = queue.result()  # (n_layers + 1) orders, then n_layers single layers
    by_order, first = losses[: L + 1], losses[L + 1 :]
    clean_loss = float(clean.loss)
    return OrderAblation(by_order, by_order[:-1] - by_order[1:], clean_loss, first, by_order[0] - first)


def ablate_head(
    model: Transformer,
    tokens: Tensor,
    layer: int,
    head: int,
    recompute_patterns: bool,
    names: Callable[[str], bool] | None = None,
    frozen: Frozen | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits [b, n, V] and the cache of `names` with head (layer, head)'s result zeroed, one full run.

    recompute_patterns=False (Olsson's ablation): every attention pattern is frozen at the clean run, so a head
    that only matters through later heads' queries or keys (a previous-token head feeding an induction head by
    K-composition) shows almost no effect. recompute_patterns=True: only this head's output is removed; every
    later layer computes its patterns from the ablated residual stream, so Q- and K-composition act.
    `frozen`: the clean run's Frozen (clean_run(...).frozen) when the caller already has it."""
    if frozen is None:
        frozen = clean_run(model, tokens).frozen
    key = f"blocks.{layer}.attn.hook_pattern"
    pattern = frozen.patterns[key].clone()  # layer's clean pattern: its input is not changed by the ablation
    pattern[:, head] = 0  # z = A v = 0, so the head's result (b_V share included) is zero
    patterns = {key: pattern} if recompute_patterns else {**frozen.patterns, key: pattern}
    with torch.no_grad():
        return model.run(tokens, names=names, frozen=Frozen(patterns))


def _chunk_heads(cfg: ModelConfig, n: int, b: int) -> int:
    """How many heads are ablated in one batch (each b rows), within CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // max(1, _row_bytes(cfg, n) * b))


def _row_bytes(cfg: ModelConfig, n: int) -> int:
    """Working bytes of one rerun row of n tokens inside a layer (float32): the stream and its norm, q/k/v/z, the
    scores (scaled and masked in place) and pattern of every head, the MLP's hidden activations."""
    d_mlp = 0 if cfg.attn_only else (cfg.d_mlp or 4 * cfg.d_model) * (3 if cfg.gated_mlp else 2)
    return 4 * n * (4 * cfg.d_model + 4 * cfg.n_heads * cfg.d_head + 2 * cfg.n_heads * n + d_mlp)


def head_ablations(
    model: Transformer,
    tokens: Tensor,
    heads: Sequence[tuple[int, int]],
    recompute_patterns: bool = False,
    should_stop: Callable[[], bool] | None = None,
    clean: CleanRun | None = None,
) -> Tensor:
    """[len(heads)]: the loss change when each head (layer, head)'s result is zeroed (ablate_head), with every
    pattern frozen (Olsson) or the later ones recomputed.

    The heads go in batches of rows (head i: b rows) in layer order; a head's rows join the batch at its layer, from
    the clean stream entering it (nothing before it changes), that layer run for them with the head's pattern
    zeroed; the rows already in the batch run every layer together (clean patterns, or recomputed ones)."""
    tokens = _check(model, tokens)
    clean = clean or clean_run(model, tokens)
    cfg = model.cfg
    b, n = tokens.shape
    clean_loss = clean.loss
    out = torch.zeros(len(heads), dtype=torch.float64, device=model.device)
    order = sorted(range(len(heads)), key=lambda i: heads[i])
    step = _chunk_heads(cfg, n, b)
    for s in range(0, len(order), step):
        group = order[s : s + step]
        active: Tensor | None = None  # [len(members)*b, n, d_model]: the stream entering `layer`
        members: list[int] = []
        with torch.no_grad():
            for layer in range(heads[group[0]][0], cfg.n_layers):
                check_stop(should_stop, "head ablation")
                key = f"blocks.{layer}.attn.hook_pattern"
                parts = []
                if active is not None:  # later patterns: the clean ones ([b, ...] broadcasts when b == 1) or computed
                    later = {key: _rows(clean.frozen.patterns[key], len(members))} if not recompute_patterns else {}
                    parts.append(model.run_from(active, layer, frozen=Frozen(later), stop=layer + 1)[0])
                joining = [i for i in group if heads[i][0] == layer]
                if joining:
                    pattern = clean.frozen.patterns[key].repeat(len(joining), 1, 1, 1)  # [c*b, H, n, n]
                    for row, i in enumerate(joining):
                        pattern[row * b : (row + 1) * b, heads[i][1]] = 0  # z = A v = 0: the head's result is zero
                    start = _rows(clean.resid_pre[layer], len(joining), expand=True)
                    parts.append(model.run_from(start, layer, frozen=Frozen({key: pattern}), stop=layer + 1)[0])
                    members += joining
                active = parts[0] if len(parts) == 1 else torch.cat(parts)
            assert active is not None
            losses = _row_losses(model, active, tokens.repeat(len(members), 1)).view(len(members), b).mean(1)
        out[torch.tensor(members)] = losses - clean_loss
    return out


def _rows(x: Tensor, c: int, expand: bool = False) -> Tensor:
    """x [b, ...] for c copies of the batch: itself when b == 1 (it broadcasts), else repeated to [c*b, ...]
    (`expand`: always [c*b, ...], a view when b == 1)."""
    if x.shape[0] == 1:
        return x.expand(c, *x.shape[1:]) if expand else x
    return x.repeat(c, *([1] * (x.dim() - 1)))


def head_ablation(
    model: Transformer, tokens: Tensor, should_stop: Callable[[], bool] | None = None, recompute_patterns: bool = False
) -> Tensor:
    """[n_layers, n_heads]: head_ablations of every head, patterns frozen (Olsson, the default) or recomputed.

    LayerNorm scales and MLPs are recomputed either way (see the module docstring)."""
    cfg = model.cfg
    return head_ablations(model, tokens, all_heads(cfg), recompute_patterns, should_stop).view(
        cfg.n_layers, cfg.n_heads
    )


def term_importance(
    model: Transformer, tokens: Tensor, heads: Sequence[tuple[int, int]], should_stop: Callable[[], bool] | None = None
) -> tuple[OrderAblation, Tensor, Tensor]:
    """order_ablation and both head_ablations of `heads` ([len(heads)] frozen, [len(heads)] recomputed) from one clean
    run; the order reruns run side by side with the head ablations when a core is idle (about equal work on SmolLM2's
    default: 61 unembeddings of the text against 2 x 16 ablated heads)."""
    tokens = _check(model, tokens)
    clean = clean_run(model, tokens)

    def ablations() -> tuple[Tensor, Tensor]:
        return (
            head_ablations(model, tokens, heads, False, should_stop, clean),
            head_ablations(model, tokens, heads, True, should_stop, clean),
        )

    (frozen, recomputed), orders = side_by_side(
        ablations, lambda: order_ablation(model, tokens, should_stop, clean), name="qkov-ablation"
    )
    return orders, frozen, recomputed


# -- the price ----------------------------------------------------------------------------------------------------
def cost(model: Transformer, n: int, batch: int = 1, heads: Sequence[tuple[int, int]] | None = None) -> Cost:
    """term_importance on `batch` sequences of n tokens ablating `heads` (default every head): the clean run, the order
    reruns (each from its start layer; patterns, norms and MLPs frozen), the frozen and the recomputed head
    ablations (from each head's layer; MLPs and norms computed) side by side, with their FLOPs.

    Peak: the clean run's patterns, streams, MLP outputs and logits, the order reruns' streams and one loss block,
    and beside them (side by side) one batch of ablated rows with its loss block (the two kinds run in turn); answer:
    the per-order and per-layer losses and two loss changes per head."""
    cfg = model.cfg
    L, b, d, size = cfg.n_layers, batch, cfg.d_model, itemsize(model.dtype)
    heads = all_heads(cfg) if heads is None else heads
    mlp = not cfg.attn_only
    queued = min(LOSS_TOKENS + b * n, (2 * L + 1) * b * n)  # positions waiting in _Losses: never more than the reruns'
    group = min(max(LOSS_TOKENS, n), queued)  # positions _row_losses normalises at once (one row when n > LOSS_TOKENS)
    loss_chunk = min(LOSS_CHUNK_BYTES, b * (2 * L + 1) * n * cfg.d_vocab * 16) + 3 * group * d * size
    clean = (L * cfg.n_heads * b * n * n + (3 * L + 1) * b * n * d + b * n * cfg.d_vocab) * size
    orders = 3 * L * b * n * d * size + 2 * queued * d * size + loss_chunk  # values x 2, rerun 0's, queue
    c = min(_chunk_heads(cfg, n, b), max(1, len(heads)))  # heads in one batch
    in_flight = (
        c * b * (_row_bytes(cfg, n) // 4 + 2 * cfg.n_heads * n * n + n * d) * size
    )  # + one layer's patterns, cat
    ablations = in_flight + min(LOSS_CHUNK_BYTES, c * b * n * cfg.d_vocab * 16)  # one kind at a time
    unembed = unembed_flops(cfg, b, n - 1)  # a rerun's loss unembeds the positions with a next token
    flops = layers_flops(cfg, b, n, True, mlp, range(L)) + unembed_flops(cfg, b, n)  # the clean run
    flops += L * (L + 1) * layer_flops(cfg, b, n, False, False, 0) + (2 * L + 1) * unembed  # order reruns, layer terms
    for layer, _ in heads:
        flops += layers_flops(cfg, b, n, False, mlp, range(layer, L)) + unembed  # patterns frozen
        flops += layer_flops(cfg, b, n, False, mlp, layer) + layers_flops(cfg, b, n, True, mlp, range(layer + 1, L))
        flops += unembed
    return Cost(clean + orders + ablations, flops=flops).with_answer(
        numbers=3 * (L + 1) + L + 2 * len(heads), labels=len(heads) + n
    )
