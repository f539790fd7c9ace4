"""Virtual weight scores of every writer x reader pair at once (virtual_weights.py scores one pair).

Paper section: "Virtual Weights and the Residual Stream as a Communication Channel" (Elhage et al. 2021;
docs/maths.md §2.1, §2.9); writers and readers as listed in stream_components.py, the score and its baseline as in
virtual_weights.py.

All pairs at once: ||W_w W_r||_F^2 = <G_w, H_r>_F with G_w = W_w^T W_w and H_r = W_r W_r^T [d, d]. No Gram is
ever held whole: each is formed one column block at a time from its d_head- or d_mlp-sized factors (a head
writer's G = W_O^T (W_V^T W_V) W_O from the d_head Gram W_V^T W_V; an MLP's G = W_out^T W_out), the blocks of
all writers against the same blocks of all readers are one matmul, and only the upper block triangle is formed
(the Grams are symmetric; off-diagonal blocks count twice), as composition.py does. The vocabulary sides are
factors like the others: W_E_eff [d_vocab, d] (materialised once, the LN applied row by row) and W_U^T.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.composition import gram_block_size, random_baseline
from circuits_core.circuits.embedding import embed_eff
from circuits_core.circuits.folded import layer_weights as stacked
from circuits_core.circuits.folded import mlp_output_weight
from circuits_core.circuits.stream_chains import mlp_input, mlp_output, rotation
from circuits_core.circuits.stream_components import (
    SHARED,
    Reader,
    Writer,
    earlier_writers,
    experts,
    has_pos_writer,
    mlp_roles,
    mlp_width,
    reaches,
    readers,
    writers,
)
from circuits_core.circuits.stream_flops import all_scores_flops
from circuits_core.circuits.stream_grams import GramSide, block_for, factors, inner_products
from circuits_core.circuits.virtual_weights import analytic_baseline
from circuits_core.cost import Cost, itemsize
from circuits_core.model.transformer import Transformer


def writer_groups(model: Transformer) -> list[tuple[list[Writer], GramSide]]:
    """The writers' Grams G_w = W_w^T W_w in the order of `writers` (embed, pos, then per layer heads and MLP)."""
    cfg, dt = model.cfg, model.compute_dtype
    # W_E_eff materialised [d_vocab, d] (LN rows); its Gram's blocks come from column slices like any factor
    groups = [([Writer("embed")], factors(embed_eff(model).to(dt)[None]))]
    if has_pos_writer(model):
        assert model.W_pos is not None
        groups.append(([Writer("pos")], factors(model.W_pos.to(dt)[None])))
    for layer in range(cfg.n_layers):
        W_V, W_O = (stacked(model, layer, name).to(dt) for name in ("W_V", "W_O"))  # [H, d, dh], [H, dh, d]
        heads = [Writer("head", layer, h) for h in range(cfg.n_heads)]
        groups.append((heads, factors(W_O, (W_V.transpose(-2, -1) @ W_V) @ W_O)))  # W_O^T (W_V^T W_V) W_O
        if not cfg.attn_only:
            W_out = mlp_output_weight(model, layer).to(dt)  # [d_mlp, d], or [n_experts, d_mlp, d]
            routed = [e for e in experts(model, layer) if e != SHARED]
            groups.append(
                ([Writer("mlp", layer, expert=e) for e in routed], factors(W_out.reshape(-1, *W_out.shape[-2:])))
            )
            if SHARED in experts(model, layer):  # DeepSeek's shared experts: a writer of their own
                shared = Writer("mlp", layer, expert=SHARED)
                groups.append(([shared], factors(mlp_output(model, shared).to(dt)[None])))
    return groups


def reader_groups(model: Transformer, offset: int = 0) -> list[tuple[list[Reader], GramSide]]:
    """The readers' Grams H_r = W_r W_r^T in the order of `readers` (per layer Q, K, V heads, MLP inputs; W_U)."""
    cfg, dt = model.cfg, model.compute_dtype
    groups: list[tuple[list[Reader], GramSide]] = []
    for layer in range(cfg.n_layers):
        R = rotation(model, offset, layer).to(dt)  # [dh, dh], the layer's own rope
        W_Q, W_K, W_V, W_O = (stacked(model, layer, n).to(dt) for n in ("W_Q", "W_K", "W_V", "W_O"))  # gains folded
        QQ, KK = W_Q.transpose(-2, -1) @ W_Q, W_K.transpose(-2, -1) @ W_K  # [H, dh, dh]
        # role -> (A, B B^T) of the reader A B: Q = W_Q (R W_K^T), K = W_K (R^T W_Q^T), V = W_V W_O
        parts = {"Q": (W_Q, R @ KK @ R.T), "K": (W_K, R.T @ QQ @ R), "V": (W_V, W_O @ W_O.transpose(-2, -1))}
        for role, (A, BBt) in parts.items():
            At = A.transpose(-2, -1)  # [H, dh, d]
            groups.append(([Reader(role, layer, h) for h in range(cfg.n_heads)], factors(At, BBt @ At)))  # type: ignore[arg-type]
        routed = [e for e in experts(model, layer) if e != SHARED]
        for role in mlp_roles(model):
            W = mlp_input(model, Reader(role, layer)).to(dt)  # [d, d_mlp] or [n_experts, d, d_mlp]
            W = W.reshape(-1, *W.shape[-2:]).transpose(-2, -1)  # [1 or n_experts, d_mlp, d]
            groups.append(([Reader(role, layer, expert=e) for e in routed], factors(W)))  # type: ignore[arg-type]
            if SHARED in experts(model, layer):
                shared = Reader(role, layer, expert=SHARED)  # type: ignore[arg-type]
                groups.append(([shared], factors(mlp_input(model, shared).to(dt).T[None])))
        if cfg.layer_has_experts(layer):
            groups.append(
                ([Reader("router", layer)], factors(mlp_input(model, Reader("router", layer)).to(dt).T[None]))
            )
    groups.append(([Reader("unembed")], factors(model.W_U.to(dt).T[None])))  # blocks are row slices of W_U
    return groups


@dataclass
class VirtualWeightScores:
    """Every writer x reader pair of a model (rows: `writers`, columns: `readers`, in those lists' order)."""

    writers: list[Writer]
    readers: list[Reader]
    raw: Tensor  # [Nw, Nr] ||W_w W_r|| / (||W_w|| ||W_r||), 0 where the reader does not see the writer
    minus_baseline: Tensor  # [Nw, Nr] raw - baseline where it reaches, 0 elsewhere
    mask: Tensor  # [Nw, Nr] bool: the reader sees the writer
    baseline: float  # composition.py's analytic 1/sqrt(d_model), the one subtracted
    sampled_baseline: float  # composition.random_baseline (ARENA's generator)
    sampled_std: float
    offset: int


def reach_mask(model: Transformer, ws: list[Writer], rs: list[Reader]) -> Tensor:
    """[Nw, Nr] bool on the model's device: stream_components.reaches for every pair, from the slots."""
    w_slot = torch.tensor([w.slot() for w in ws])
    r_slot = torch.tensor([r.slot(model) for r in rs])
    mask = w_slot[:, None] < r_slot[None, :]
    for i, w in enumerate(ws):
        if w.kind == "pos":  # shortformer positions reach only Q and K
            mask[i] = torch.tensor([reaches(model, w, r) for r in rs], dtype=torch.bool)
    return mask.to(model.device)


def all_scores(
    model: Transformer, offset: int = 0, should_stop: Callable[[], bool] | None = None, block: int | None = None
) -> VirtualWeightScores:
    """Scores of every writer x reader pair from blocked d x d Grams (see the module docstring); `block`: the
    Grams' column block (default: stream_grams.block_for the model's device)."""
    ws, rs = writers(model), readers(model)
    limits = earlier_writers(model, ws, rs)  # per reader, the writers written before it reads
    with torch.no_grad():
        wg, rg = writer_groups(model), reader_groups(model, offset)
        assert [w for g, _ in wg for w in g] == ws and [r for g, _ in rg for r in g] == rs
        num_sq, w_sq, r_sq = inner_products(
            [s for _, s in wg], [s for _, s in rg], should_stop, "virtual weight scores", limits, block
        )  # traces: ||W_w||^2, ||W_r||^2
        raw = num_sq.clamp_min(0).sqrt() / (w_sq[:, None].sqrt() * r_sq[None, :].sqrt())
    mask = reach_mask(model, ws, rs)
    raw = torch.where(mask, raw, torch.zeros_like(raw))
    baseline = analytic_baseline(model)
    sampled, std = random_baseline(model.cfg.d_model, model.cfg.d_head)
    minus = torch.where(mask, raw - baseline, torch.zeros_like(raw))
    return VirtualWeightScores(ws, rs, raw, minus, mask, baseline, sampled, std, offset)


def all_scores_cost(model: Transformer) -> Cost:
    """all_scores: the heads' d_head-sized factors (read in place: only the (W_V^T W_V) W_O-like products are new),
    W_E_eff, one block of every Gram and the [Nw, Nr] tables; answer: two tables plus the names."""
    cfg = model.cfg
    L, H, d, dh = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    size = gram_block_size(d, block_for(model.device))
    n_mlp = 0  # hidden units of every MLP input (each expert's, shared ones, dense layers') and router columns
    for layer in range(0 if cfg.attn_only else L):
        n_mlp += sum(mlp_width(model, layer, e) for e in experts(model, layer))
        n_mlp += cfg.num_experts or 0 if cfg.layer_has_experts(layer) else 0
    roles = len(mlp_roles(model))
    Nw, Nr = len(writers(model)), len(readers(model))
    n_ctx = cfg.n_ctx if has_pos_writer(model) else 0
    factor_numbers = 4 * L * H * dh * d  # one layer's products at a time would do; all are kept
    dtype_copies = (
        0 if model.dtype == model.compute_dtype else (4 * L * H * dh * d + (1 + roles) * n_mlp * d + n_ctx * d)
    )
    numbers = factor_numbers + dtype_copies + cfg.d_vocab * d + 2 * (Nw + Nr) * size * size + 3 * Nw * Nr
    return Cost(numbers * itemsize(model.compute_dtype), flops=all_scores_flops(model)).with_answer(
        numbers=2 * Nw * Nr, labels=Nw + Nr
    )
