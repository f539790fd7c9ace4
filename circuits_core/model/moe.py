"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE, OLMoE, gpt-oss): a router picks experts_per_token of num_experts
gated MLPs per token and mixes their outputs with its weights. Row vectors, TransformerLens-style names, experts
stacked on a leading axis:

    W_router [d_model, n_experts] (+ b_router [n_experts])       router logits r = x W_router + b_router
    W_gate, W_in [n_experts, d_model, d_mlp] (+ b_gate, b_in [n_experts, d_mlp])
    W_out [n_experts, d_mlp, d_model] (+ b_out [n_experts, d_model])

Routing: top-k of r, weighted by the softmax over the k chosen logits (moe_norm_topk: Mixtral, gpt-oss, Qwen3-MoE
with norm_topk_prob) or by the k largest entries of the softmax over all experts (OLMoE, Qwen3-MoE without it).
Expert e on x: silu(x W_gate[e]) * (x W_in[e]) W_out[e], or gpt-oss's clamped form (`clamped_swiglu`, config.py).
out = sum over the chosen experts of weight * expert(x).

Each expert's W_out[e] is a writer of the residual stream and its W_gate[e], W_in[e] readers, like a dense MLP's;
W_router is a reader too. On a prompt the routing (indices and weights) is a per-token fact like a norm scale:
`Frozen.routes` replays it, and hooks record it (hook_router_logits [batch, pos, n_experts], hook_expert_indices
and hook_expert_weights [batch, pos, k], hook_expert_out [batch, pos, k, d_model]: each chosen expert's weighted
output, summing to the MLP's output, with hook_shared_out [batch, pos, d_model] where shared experts add theirs).

DeepSeek (V2, V3) adds: sigmoid scores with a choice bias b_choice [n_experts], group-limited routing, a routed
scale, and shared experts W_shared_gate, W_shared_in [d_model, d_shared], W_shared_out [d_shared, d_model], always
on (`deepseek_route`, config.py's moe_* fields).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from circuits_core.model.config import ModelConfig
from circuits_core.model.hooks import Frozen, Recorder
from circuits_core.model.linear import activation, affine


def route(cfg: ModelConfig, logits: Tensor, b_choice: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(indices, weights) [..., k] of router logits [..., n_experts] under the config's normalisation (DeepSeek's
    rules: `deepseek_route`)."""
    k = cfg.experts_per_token
    if cfg.moe_scoring == "sigmoid" or cfg.moe_n_groups is not None:
        return deepseek_route(cfg, logits, b_choice)
    if cfg.moe_norm_topk:  # gpt-oss's order: top-k of the logits, then the softmax over those k
        top, indices = torch.topk(logits, k, dim=-1)
        return indices, top.softmax(dim=-1) * cfg.moe_routed_scale
    weights, indices = torch.topk(logits.softmax(dim=-1), k, dim=-1)
    return indices, weights * cfg.moe_routed_scale


def deepseek_route(cfg: ModelConfig, logits: Tensor, b_choice: Tensor | None) -> tuple[Tensor, Tensor]:
    """DeepSeek's routing of logits [..., n_experts]: scores s = softmax (V2) or sigmoid (V3) of the logits; the
    choice ranks s (+ b_choice under the sigmoid: a bias that moves the choice, never the weights); group-limited
    routing first keeps the moe_topk_groups groups whose best expert (V2) or best two (V3) rank highest; the weights
    are the chosen s, divided by their sum when moe_norm_topk (under the sigmoid), times moe_routed_scale."""
    E, k = logits.shape[-1], cfg.experts_per_token
    sigmoid = cfg.moe_scoring == "sigmoid"
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)  # [..., E]
    choice = scores + b_choice if sigmoid and b_choice is not None else scores
    if cfg.moe_n_groups is not None:
        assert cfg.moe_topk_groups is not None
        grouped = choice.unflatten(-1, (cfg.moe_n_groups, E // cfg.moe_n_groups))  # [..., groups, E / groups]
        rank = grouped.topk(2, dim=-1).values.sum(-1) if sigmoid else grouped.amax(-1)  # [..., groups]
        kept = torch.zeros_like(rank, dtype=torch.bool)
        kept.scatter_(-1, rank.topk(cfg.moe_topk_groups, dim=-1).indices, True)
        kept = kept[..., None].expand_as(grouped).flatten(-2)  # [..., E]
        choice = choice.masked_fill(~kept, float("-inf") if sigmoid else 0.0)
    indices = choice.topk(k, dim=-1).indices  # [..., k]
    weights = scores.gather(-1, indices)
    if sigmoid and cfg.moe_norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return indices, weights * cfg.moe_routed_scale


class MoE(nn.Module):
    """The mixture-of-experts MLP of one layer (module docstring)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        assert cfg.num_experts is not None and cfg.d_mlp is not None
        self.cfg, self.layer = cfg, layer
        E, d, m = cfg.num_experts, cfg.d_model, cfg.d_mlp
        self.W_router = nn.Parameter(torch.empty(d, E))
        self.W_gate = nn.Parameter(torch.empty(E, d, m))
        self.W_in = nn.Parameter(torch.empty(E, d, m))
        self.W_out = nn.Parameter(torch.empty(E, m, d))
        if cfg.moe_scoring == "sigmoid":
            self.b_choice = nn.Parameter(torch.zeros(E))  # DeepSeek-V3's e_score_correction_bias (choice only)
        if cfg.moe_shared_d_mlp is not None:  # always-on shared experts, one gated MLP
            self.W_shared_gate = nn.Parameter(torch.empty(d, cfg.moe_shared_d_mlp))
            self.W_shared_in = nn.Parameter(torch.empty(d, cfg.moe_shared_d_mlp))
            self.W_shared_out = nn.Parameter(torch.empty(cfg.moe_shared_d_mlp, d))
        if cfg.use_bias:
            self.b_router = nn.Parameter(torch.zeros(E))
            self.b_gate = nn.Parameter(torch.zeros(E, m))
            self.b_in = nn.Parameter(torch.zeros(E, m))
            self.b_out = nn.Parameter(torch.zeros(E, d))

    @property
    def deferred(self) -> bool:
        """Expert weights are always read at load (formats/lazy_mlp.py defers dense MLPs only)."""
        return False

    def router_logits(self, x: Tensor) -> Tensor:
        """x [..., d_model] -> [..., n_experts]."""
        return affine(x, self.W_router, self.b_router if self.cfg.use_bias else None)

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e's output (before its routing weight): x [m, d_model] -> [m, d_model]. The products stay on
        torch.addmm (linear.affine's onednn=False): oneDNN's per-call cost over a layer's 3 x n_experts matrices,
        each on a few hundred rows, made the MLP ~1.2x slower (8 x 128 tokens, 8 experts of 256, one thread: 48 ms
        against 40 ms)."""
        cfg, bias = self.cfg, self.cfg.use_bias
        up = affine(x, self.W_in[e], self.b_in[e] if bias else None, onednn=False)  # [m, d_mlp]
        gate = affine(x, self.W_gate[e], self.b_gate[e] if bias else None, onednn=False)
        if cfg.clamped_swiglu:
            gate = gate.clamp(max=cfg.swiglu_limit)
            up = up.clamp(min=-cfg.swiglu_limit, max=cfg.swiglu_limit)
            hidden = (up + 1) * gate * torch.sigmoid(gate * cfg.swiglu_alpha)
        else:  # in place: the products are fresh
            hidden = activation(cfg.act_fn, gate, in_place=True).mul_(up)
        return affine(hidden, self.W_out[e], self.b_out[e] if bias else None, onednn=False)

    def forward(self, x: Tensor, rec: Recorder, frozen: Frozen | None = None) -> Tensor:
        # x: [batch, pos, d_model] -> [batch, pos, d_model]
        p = f"blocks.{self.layer}.mlp"
        routes = frozen.routes.get(self.layer) if frozen is not None else None
        if routes is None:
            b_choice = self.b_choice if self.cfg.moe_scoring == "sigmoid" else None
            indices, weights = route(self.cfg, rec(f"{p}.hook_router_logits", self.router_logits(x)), b_choice)
        else:
            indices, weights = routes
        rec(f"{p}.hook_expert_indices", indices), rec(f"{p}.hook_expert_weights", weights)
        rows = x.reshape(-1, x.shape[-1])  # [batch pos, d_model]
        k = indices.shape[-1]
        chosen = indices.reshape(-1)  # [batch pos k]: the expert of each (token, slot)
        # The (token, slot) pairs grouped by expert: one sort and one gather, then each expert's rows are a contiguous
        # slice (no per-expert search, gather and scatter), and one index_add_ sums every weighted output into its
        # token, in expert order as before. With the products on addmm (`expert`) this took the MoE MLP from 1.65x to
        # 1.37x a dense MLP of the same active width (8 x 128 tokens, d_model 512, 8 experts of 256, top 2, one
        # thread, medians of 12 calls at load 6.8: 53.7 and 44.7 ms against 32.5 ms; bench/RESULTS.md).
        order = chosen.argsort(stable=True)  # [batch pos k]
        counts = torch.bincount(chosen, minlength=self.W_router.shape[1]).tolist()  # rows per expert
        token = order // k  # the token of each grouped pair
        grouped = rows[token]  # [batch pos k, d_model]
        weight = weights.reshape(-1)[order, None].to(rows.dtype)  # [batch pos k, 1]
        written = torch.empty_like(grouped)  # each pair's weighted expert output, grouped as `grouped`
        start = 0
        for e, n in enumerate(counts):
            if n:
                part = slice(start, start + n)
                torch.mul(self.expert(e, grouped[part]), weight[part], out=written[part])
            start += n
        out = torch.zeros_like(rows).index_add_(0, token, written)
        if rec.wants(f"{p}.hook_expert_out"):  # [batch, pos, k, d_model]: each slot's weighted output
            slots = torch.empty_like(written).index_copy_(0, order, written)
            rec(f"{p}.hook_expert_out", slots.view(*indices.shape, -1))
        out = out.view_as(x)
        if self.cfg.moe_shared_d_mlp is None:
            return out
        return out + rec(f"{p}.hook_shared_out", self.shared(x))

    def shared(self, x: Tensor) -> Tensor:
        """The shared experts' output (always on): silu(x W_shared_gate) * (x W_shared_in) W_shared_out,
        x [..., d_model] -> [..., d_model]."""
        hidden = activation(self.cfg.act_fn, affine(x, self.W_shared_gate)) * affine(x, self.W_shared_in)
        return affine(hidden, self.W_shared_out)
