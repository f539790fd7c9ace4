"""Term importance by path order and pattern-preserving head ablation (paper-math 2.13).

All runs keep the clean run's attention patterns and LayerNorm scales (circuits_core.model.Frozen), so only
V-composition paths change. Order-k run: the values of every layer read the residual stream of the order-(k-1)
run (`Frozen.value_resid`), so the output holds paths through at most k heads:
    order 0   values read 0: a frozen LN of 0 is its bias, so heads add only their constant beta_l
    order 1   values read X0 (the embedding): direct path + every head's first-order term (+ biases)
    order k   values read resid_pre of the order-(k-1) run;   order n_layers reproduces the clean loss
marginal effect of order k = loss[k-1] - loss[k]. First-order terms by layer: values of layer l read X0 and
every other layer reads 0 (direct path + layer l's first-order terms), compared with order 0.
Per-head ablation (Olsson et al.): the head's pattern is set to 0 (its result vector is 0), every other
pattern and scale stays frozen; loss change = ablated - clean. Exact for attention-only models; an MLP reads
the current residual stream in every run.

The default text, when neither prompt nor tokens is given: the model card's `sample_text` (held-out text
shipped with the model) when present, else BUILTIN_TEXT, a short Python snippet (the toy models learn code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from app.schemas.analyses import HeadAblation, TermImportanceView
from app.settings import Limits
from app.views.inputs import max_prompt_tokens, model_ref, resolve_prompt, token_refs
from circuits_core.config import head_name
from circuits_core.errors import InvalidInputError, LimitExceededError
from circuits_core.frozen import FrozenRun, embed_source, frozen_run
from circuits_core.model import Frozen
from circuits_core.weights import LoadedModel

BUILTIN_TEXT = (
    "class Stack(object):\n"
    "    def __init__(self):\n"
    "        self.items = []\n\n"
    "    def push(self, item):\n"
    "        self.items.append(item)\n\n"
    "    def pop(self):\n"
    "        return self.items.pop()\n"
)


def default_text(loaded: LoadedModel) -> tuple[str, str]:
    """(text, where it came from): the card's held-out sample, else the built-in snippet."""
    card = loaded.card if isinstance(loaded.card, dict) else {}
    sample = card.get("sample_text")
    return (sample, "card") if isinstance(sample, str) and sample else (BUILTIN_TEXT, "builtin")


def _default_ids(loaded: LoadedModel, limits: Limits) -> tuple[list[int], str]:
    if loaded.tokenizer is None:
        raise InvalidInputError(f"model {loaded.path.name!r} has no tokenizer: give the text as tokens=<ids>")
    text, source = default_text(loaded)
    bos = loaded.tokenizer.bos_token_id is not None
    ids = [int(i) for i in loaded.tokenizer.encode(text, prepend_bos=bos)]
    return ids[: max_prompt_tokens(loaded, limits)], source


def ablation_bytes(loaded: LoadedModel, n: int) -> int:
    """Frozen patterns of every layer, the residual streams of one run and the logits."""
    cfg = loaded.model.cfg
    itemsize = torch.finfo(loaded.model.dtype).bits // 8
    return (cfg.n_layers * cfg.n_heads * n * n * 2 + 4 * cfg.n_layers * n * cfg.d_model + 2 * n * cfg.d_vocab) * itemsize


class _Runner:
    """Reruns of one sequence with frozen patterns and LayerNorm scales."""

    def __init__(self, loaded: LoadedModel, tokens: Tensor, run: FrozenRun):
        self.model, self.tokens = loaded.model, tokens[None]  # [1, n]
        self.patterns = {f"blocks.{layer}.attn.hook_pattern": run.patterns[layer][None] for layer in range(self.model.cfg.n_layers)}
        self.scales = {name: value[None] for name, value in run.cache.items() if name.endswith("hook_scale")}
        self.x0 = embed_source(self.model, run)[None]  # [1, n, d_model]

    def loss(self, value_resid: dict[int, Tensor], patterns: dict[str, Tensor] | None = None) -> tuple[float, dict[str, Tensor]]:
        """Mean next-token loss of a frozen rerun, and its resid_pre of every layer."""
        frozen = Frozen(patterns if patterns is not None else self.patterns, self.scales, value_resid)
        logits, cache = self.model.run(self.tokens, names=lambda name: name.endswith("hook_resid_pre"), frozen=frozen)
        return mean_loss(logits[0], self.tokens[0]), cache


def mean_loss(logits: Tensor, tokens: Tensor) -> float:
    """logits [n, d_vocab], tokens [n] -> mean cross-entropy of predicting tokens[1:] (nats)."""
    return float(F.cross_entropy(logits[:-1].double(), tokens[1:]))


def build_term_importance_view(
    loaded: LoadedModel, limits: Limits, prompt: str | None = None, tokens: str | None = None
) -> TermImportanceView:
    """Loss by max path order, marginal effect of each order, first-order terms by layer, per-head ablations."""
    model = loaded.model
    cfg = model.cfg
    if prompt is None and tokens is None:
        ids, source = _default_ids(loaded, limits)
    else:
        ids, source = resolve_prompt(loaded, prompt, tokens, limits), "prompt" if prompt is not None else "tokens"
    n = len(ids)
    if n < 2:
        raise InvalidInputError(f"term importance needs at least 2 tokens (a next-token loss), got {n}")
    need = ablation_bytes(loaded, n)
    if need > limits.matrix_budget_bytes:
        raise LimitExceededError(
            f"term importance on {n} tokens needs about {need} bytes; the budget (matrix_budget_bytes) is "
            f"{limits.matrix_budget_bytes}: shorten the text"
        )
    seq = torch.tensor(ids, dtype=torch.long, device=model.device)
    L = cfg.n_layers
    with torch.no_grad():
        run = frozen_run(model, seq)
        clean = mean_loss(run.logits, seq)
        runner = _Runner(loaded, seq, run)
        zeros = torch.zeros_like(runner.x0)
        losses = [runner.loss({layer: zeros for layer in range(L)})[0]]
        value_in = {layer: runner.x0 for layer in range(L)}
        for _ in range(L):
            loss, cache = runner.loss(value_in)
            losses.append(loss)
            value_in = {layer: cache[f"blocks.{layer}.hook_resid_pre"] for layer in range(L)}
        by_layer = [
            losses[0] - runner.loss({other: (runner.x0 if other == layer else zeros) for other in range(L)})[0]
            for layer in range(L)
        ]
        heads = []
        for layer in range(L):
            for h in range(cfg.n_heads):
                key = f"blocks.{layer}.attn.hook_pattern"
                pattern = runner.patterns[key].clone()
                pattern[:, h] = 0.0
                ablated = runner.loss({}, {**runner.patterns, key: pattern})[0]
                heads.append(HeadAblation(head=head_name(layer, h), loss_change=ablated - clean))
    return TermImportanceView(
        model=model_ref(loaded), text_source=source, tokens=token_refs(loaded, ids), clean_loss=clean,
        loss_by_order=losses, marginal_by_order=[losses[k - 1] - losses[k] for k in range(1, L + 1)],
        first_order_by_layer=by_layer, heads=heads,
    )
