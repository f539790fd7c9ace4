"""The frozen-attention linear view of a model: the clean run's patterns and LayerNorm scales, held fixed.

Paper section: "Path expansion" with "freezing the attention patterns" (Elhage et al. 2021; docs/maths.md §1.5,
2.11). Row-vector convention. With patterns A^{l,h} [n, n] and LayerNorm scales frozen at the clean run,
each layer is affine in its input residual stream X [n, d_model]:
    LN_l(X)      = D_l (X C) diag(w_l) + 1 b_l^T      C = I - 11^T/d_model (identity without LN),
                                                       D_l = diag(1/sigma) from `blocks.l.ln1.hook_scale`
    head (l,h):  X -> A^{l,h} D_l (X C) diag(w_l) W_V^h W_O^h   (linear part)
    bias beta_l  = b_O + sum_h (b_l W_V^h + b_V^h) W_O^h        (constant rows, because rows of A sum to 1;
                                                                 under learned sinks row i has A's row sum
                                                                 in front of each head's term: layer_bias_rows)
Everything here is shared by the logit path expansion (paths.py), the QK path expansion (qk_paths.py), the
virtual heads (virtual.py) and the term-importance ablation (ablation.py). LayerNorm weights are folded into
the reading weights here, so processed (LNPre) and unprocessed (LN) models are both exact.
Output norms (Gemma 2/3, OLMo 2/3: ln1_post after attention) are frozen the same way: layer l's write at position
i is (sum_h head_h + beta_l)(i) diag(gamma_post) / rho_post(i), so each head's W_O is read through diag(gamma_post)
(head_o_apply) and its coefficient at its destination i carries 1 / rho_post(i) (FrozenRun.inv_scale of
"blocks.{l}.ln1_post"); the bias beta_l becomes a per-position source (written_bias). A soft-capped logit
c tanh(z / c) = z g(z) is expanded with its cap factor g frozen per destination (FrozenRun.logit_cap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from circuits_core.cost import Cost, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model.flops import layers_flops, unembed_flops
from circuits_core.model.hooks import Recorder
from circuits_core.model.soft_cap import cap_factor, soft_cap
from circuits_core.model.transformer import Attention, Block, Transformer


@dataclass
class FrozenRun:
    """One clean run of a single sequence (batch dimension removed). The unembedding is applied only where it is
    read (`logits_at`): on a 128k vocabulary it is a fifth of the forward pass, and an expansion reads one row."""

    tokens: Tensor  # [n]
    final: Tensor  # [n, d_model]: the residual stream after ln_final, which the unembedding reads
    cache: dict[str, Tensor]  # TransformerLens names, batch dimension removed
    patterns: Tensor  # [n_layers, n_heads, n (query), n (key)]
    W_U: Tensor  # [d_model, d_vocab]
    b_U: Tensor | None  # [d_vocab]
    logit_cap: float | None = None  # the model's output_logits_soft_cap

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    def uncapped_logits_at(self, positions: Tensor | Sequence[int]) -> Tensor:
        """[q, d_vocab]: final @ W_U + b_U at these positions (the logits before a soft cap)."""
        logits = self.final[torch.as_tensor(positions, dtype=torch.long, device=self.final.device)] @ self.W_U
        return logits + self.b_U if self.b_U is not None else logits

    def logits_at(self, positions: Tensor | Sequence[int]) -> Tensor:
        """[q, d_vocab]: the logits at these positions, as the model's forward pass (soft-capped if it caps)."""
        return soft_cap(self.uncapped_logits_at(positions), self.logit_cap)

    @cached_property
    def logits(self) -> Tensor:
        """[n, d_vocab]: the logits at every position (computed when first read)."""
        return self.logits_at(range(self.n))

    def inv_scale(self, ln_name: str) -> Tensor:
        """1/sigma per position [n] of a LayerNorm ("blocks.0.ln1", "ln_final"); ones without LN."""
        key = f"{ln_name}.hook_scale"
        if key not in self.cache:
            return torch.ones(self.n, dtype=self.final.dtype, device=self.final.device)
        return 1.0 / self.cache[key][:, 0]


_CACHED = (
    "hook_pattern",
    "hook_shared_out",
    "hook_scale",
    "hook_mlp_out",
    "hook_expert_out",
    "hook_expert_indices",
    "hook_expert_weights",
    "hook_attn_scores",
    "hook_embed",
    "hook_pos_embed",
    "hook_resid_pre",
    "hook_resid_final",
    "hook_q",
    "hook_k",
)


def frozen_run(model: Transformer, tokens: Tensor) -> FrozenRun:
    """Run one sequence ([n] or [1, n]) up to ln_final and keep what the frozen-linear view needs."""
    tokens = model.check_tokens(tokens)
    if tokens.shape[0] != 1:
        raise InvalidInputError(f"path expansions take one sequence, got a batch of {tokens.shape[0]}")

    def keep(name: str) -> bool:
        return name.endswith(_CACHED)

    with torch.no_grad():
        cache = model.run_until(tokens, "hook_resid_final", names=keep)
        final_norm = Recorder(keep)  # ln_final's scale, recorded as the full run records it
        final = model.ln_final(cache["hook_resid_final"], final_norm, None)  # [1, n, d_model]
        cache |= final_norm.cache
    cache = {k: v[0] for k, v in cache.items()}
    L = model.cfg.n_layers
    patterns = (
        torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"] for layer in range(L)]) if L else final.new_zeros(0)
    )
    return FrozenRun(tokens[0], final[0], cache, patterns, model.W_U, model.b_U, model.cfg.output_logits_soft_cap)


def forward_cost(model: Transformer, n: int, batch: int = 1, kept_per_layer: int = 0, logits: bool = True) -> Cost:
    """A forward pass of `batch` sequences of n tokens: one layer's activations at a time (residual stream,
    q/k/v/z, scores (scaled and masked in place) and pattern, MLP hidden), `kept_per_layer` numbers cached per layer,
    the logits, and the [d_model, n_heads d_head] copy of W_Q, W_K or W_V that Attention.project multiplies by
    (the peak on short prompts)."""
    cfg = model.cfg
    mlp = 0 if cfg.attn_only else 3 * (cfg.d_mlp or 4 * cfg.d_model)  # hidden, activation (and gate)
    layer = n * (4 * cfg.d_model + 4 * cfg.n_heads * cfg.d_head + mlp) + 2 * cfg.n_heads * n * n
    out = n * cfg.d_vocab if logits else 0
    weights = cfg.d_model * cfg.n_heads * cfg.d_head
    flops = layers_flops(cfg, batch, n, True, True, range(cfg.n_layers)) + (
        unembed_flops(cfg, batch, n) if logits else 0
    )
    return Cost((batch * (layer + cfg.n_layers * kept_per_layer + out) + weights) * itemsize(model.dtype), flops=flops)


def run_cost(model: Transformer, n: int) -> Cost:
    """frozen_run on n tokens: the forward pass keeping, per layer, the pattern and scores [H, n, n], q and k,
    the residual stream, MLP output and LayerNorm scales."""
    cfg = model.cfg
    kept = 2 * cfg.n_heads * n * n + 2 * n * cfg.n_heads * cfg.d_head + 3 * n * cfg.d_model + 2 * n
    return forward_cost(model, n, 1, kept)


def attention(model: Transformer, layer: int) -> Attention:
    """The attention module of a layer (typed accessor for attention(model, layer))."""
    block = model.blocks[layer]
    assert isinstance(block, Block)
    return block.attn


def has_ln(model: Transformer) -> bool:
    """Whether the model's norm centres its input (LayerNorm: C = I - 11^T/d_model); RMSNorm does not."""
    return model.cfg.normalization_type in ("LN", "LNPre")


def centre(model: Transformer, x: Tensor) -> Tensor:
    """x C: subtract the mean over d_model (identity without LayerNorm). x [..., d_model]."""
    return x - x.mean(-1, keepdim=True) if has_ln(model) else x


def _ln_param(model: Transformer, ln_name: str, leaf: str) -> Tensor | None:
    module = model.get_submodule(ln_name)
    if not getattr(module, "has_weights", False) or leaf not in module._parameters:  # RMS has w but no b
        return None
    param = getattr(module, leaf)
    assert isinstance(param, Tensor)
    return param


def ln_weight(model: Transformer, ln_name: str) -> Tensor | None:
    """The LayerNorm weight w [d_model] ("blocks.0.ln1", "ln_final"), None for LNPre / no LN."""
    return _ln_param(model, ln_name, "w")


def ln_bias(model: Transformer, ln_name: str) -> Tensor | None:
    return _ln_param(model, ln_name, "b")


def ln_linear(model: Transformer, ln_name: str, x: Tensor, inv_scale: Tensor) -> Tensor:
    """Linear part of a frozen LayerNorm: D (x C) diag(w). x [..., n, d_model], inv_scale [n]."""
    w = ln_weight(model, ln_name)
    out = centre(model, x) * inv_scale[:, None]
    return out * w if w is not None else out


def reading_weights(model: Transformer, layer: int, name: str) -> Tensor:
    """diag(w_ln1) W_name [n_heads, d_model, d_head] for name in W_Q, W_K, W_V (LN weight folded)."""
    W = getattr(attention(model, layer), name)
    w = ln_weight(model, f"blocks.{layer}.ln1")
    return W * w[None, :, None] if w is not None else W


def reading_bias(model: Transformer, layer: int, name: str) -> Tensor:
    """b_ln1 W_name + b_name [n_heads, d_head] for name in Q, K, V (zeros without biases)."""
    attn = attention(model, layer)
    cfg = model.cfg
    out = torch.zeros(cfg.n_heads, cfg.d_head, dtype=model.dtype, device=model.device)
    b_ln = ln_bias(model, f"blocks.{layer}.ln1")
    if b_ln is not None:
        out = out + torch.einsum("d,hde->he", b_ln, getattr(attn, f"W_{name}"))
    bias = attn.bias(f"b_{name}")
    return out + bias if bias is not None else out


def layer_bias(model: Transformer, layer: int) -> Tensor:
    """beta_l [d_model] = b_O + sum_h (b_ln1 W_V^h + b_V^h) W_O^h: the constant output of attention layer l."""
    attn = attention(model, layer)
    beta = torch.einsum("he,hed->d", reading_bias(model, layer, "V"), attn.W_O)
    b_O = attn.bias("b_O")
    return beta + b_O if b_O is not None else beta


def layer_bias_rows(model: Transformer, run: FrozenRun, layer: int) -> Tensor:
    """beta_l as rows: [1, d_model] when every pattern row sums to 1, else [n, d_model]. Under learned sinks a
    row of head h keeps sum_j A^h_ij < 1 of its mass, so position i receives b_O + sum_h (sum_j A^h_ij)
    (b_ln1 W_V^h + b_V^h) W_O^h."""
    if not model.cfg.attn_sinks:
        return layer_bias(model, layer)[None]
    attn = attention(model, layer)
    per_head = torch.einsum("he,hed->hd", reading_bias(model, layer, "V"), attn.W_O)  # [H, d_model]
    beta = run.patterns[layer].sum(-1).T @ per_head  # [n, H] @ [H, d_model]
    b_O = attn.bias("b_O")
    return beta + b_O if b_O is not None else beta


def post_gain(model: Transformer, layer: int, name: str = "ln1_post") -> Tensor | None:
    """gamma [d_model] of layer's output norm (ln1_post after attention, ln2_post after the MLP); None without."""
    if not model.cfg.post_norms:
        return None
    return ln_weight(model, f"blocks.{layer}.{name}")


def written_bias(model: Transformer, run: FrozenRun, layer: int) -> Tensor:
    """What layer's attention bias beta_l adds to the stream: [1, d_model] (constant), or under an output norm
    [n, d_model] = beta_l diag(gamma_post) / rho_post(i) (frozen per position); under learned sinks beta_l is
    per position already (layer_bias_rows)."""
    beta = layer_bias_rows(model, run, layer)
    gamma = post_gain(model, layer)
    if gamma is None:
        return beta
    return beta * gamma * run.inv_scale(f"blocks.{layer}.ln1_post")[:, None]


def head_o_apply(model: Transformer, layer: int, w: Tensor) -> Tensor:
    """Readout vectors w [P, d_model] pulled back through every head's W_O (and the output norm's gain):
    g [H, P, d_head] = W_O diag(gamma_post) w."""
    gamma = post_gain(model, layer)
    return torch.matmul(w * gamma if gamma is not None else w, attention(model, layer).W_O.transpose(-2, -1))


def head_ov_apply(model: Transformer, layer: int, w: Tensor) -> tuple[Tensor, Tensor]:
    """Pull readout vectors back through every head of a layer (column side of W_OV).

    w [P, d_model] -> (g [H, P, d_head] = W_O w, w' [H, P, d_model] = C diag(w_ln) W_V g): for any source
    rows X, (X C diag(w_ln) W_V W_O) . w = X . w'. Under grouped-query attention W_V is applied per key/value
    group (query head h reads group h // group_size), never repeated over the group.
    """
    cfg = model.cfg
    G, P = cfg.n_kv_heads, w.shape[0]
    g = head_o_apply(model, layer, w)  # [H, P, dh]
    grouped = g.reshape(G, cfg.group_size * P, cfg.d_head)  # [G, group * P, dh]: head h = gi * group + j
    w_new = torch.matmul(grouped, attention(model, layer).grouped("W_V").transpose(-2, -1))  # [G, group * P, d]
    w_new = w_new.view(cfg.n_heads, P, cfg.d_model)
    ln_w = ln_weight(model, f"blocks.{layer}.ln1")
    if ln_w is not None:
        w_new.mul_(ln_w)
    if has_ln(model):
        w_new.sub_(w_new.mean(-1, keepdim=True))  # centre
    return g, w_new


def value_inv_scale(model: Transformer, run: FrozenRun, layer: int) -> Tensor:
    """[n]: the per-source-position factor of layer `layer`'s values: ln1's 1/sigma(j), and under multi-head latent
    attention also the key/value latent's 1 / rho_kv(j) (model/latent_attention.py: v_j = x̂_j W_V / rho_kv(j))."""
    inv = run.inv_scale(f"blocks.{layer}.ln1")
    if not model.cfg.latent_attention:
        return inv
    return inv / run.cache[f"blocks.{layer}.attn.kv_latent_norm.hook_scale"][:, 0]


def embed_source(model: Transformer, run: FrozenRun) -> Tensor:
    """x_0 [n, d_model]: W_E[t] (+ W_pos for standard positions), the residual stream before layer 0."""
    x0 = run.cache["hook_embed"]
    if model.cfg.positional_embedding_type == "standard":
        x0 = x0 + run.cache["hook_pos_embed"]
    return x0


def qk_positions(model: Transformer, run: FrozenRun) -> Tensor | None:
    """W_pos rows [n, d_model] added after ln1 to queries and keys (shortformer), else None."""
    if model.cfg.positional_embedding_type == "shortformer":
        return run.cache["hook_pos_embed"]
    return None


def target_direction(model: Transformer, target: int | tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(u [d_model], b [] ) with logit(target) = x_final_normed . u + b; a pair (a, b) means logit_a - logit_b."""
    V = model.cfg.d_vocab
    a, b = (target, None) if isinstance(target, int) else tuple(target)
    for t in (a, b):
        if t is not None and not 0 <= int(t) < V:
            raise InvalidInputError(f"target token {t} out of range [0, {V})")
    u = model.W_U[:, a] - (model.W_U[:, b] if b is not None else 0)
    b_U = model.b_U
    const = (b_U[a] - (b_U[b] if b is not None else 0)) if b_U is not None else u.new_zeros(())
    return u, const


def readout(
    model: Transformer, target: int | tuple[int, int], caps: tuple[float, float] = (1.0, 1.0)
) -> tuple[Tensor, Tensor]:
    """(r [d_model], const []) with target value at p = inv_f[p] * (x_L[p] . r) + const (final LN frozen).

    caps (g_a, g_b): frozen cap factors of the target's logits (soft_cap.cap_factor), so that the value is the capped
    g_a z_a (- g_b z_b); (1, 1) for a model without a logit cap."""
    g_a, g_b = caps
    if isinstance(target, int):
        u, const = target_direction(model, target)
        u, const = u * g_a, const * g_a
    else:
        (u_a, c_a), (u_b, c_b) = (target_direction(model, int(t)) for t in target)
        u, const = g_a * u_a - g_b * u_b, g_a * c_a - g_b * c_b
    w, b = ln_weight(model, "ln_final"), ln_bias(model, "ln_final")
    r = centre(model, u * w if w is not None else u)
    if b is not None:
        const = const + b @ u
    return r, const


def target_cap_factors(run: FrozenRun, target: int | tuple[int, int], position: int) -> tuple[float, float]:
    """(g_a, g_b): the frozen cap factors of the target's logits at a destination ((1, 1) without a logit cap)."""
    if run.logit_cap is None:
        return 1.0, 1.0
    z = run.uncapped_logits_at([position])[0]
    a, b = (target, target) if isinstance(target, int) else target
    g = cap_factor(z[[int(a), int(b)]], run.logit_cap)
    return float(g[0]), float(g[1])
