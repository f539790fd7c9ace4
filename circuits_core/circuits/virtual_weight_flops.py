"""FLOPs of the residual-stream virtual weights (virtual_weights.py): the table of every pair (all_scores) and one
pair's report (pair_report), counted from the factor chains the engine multiplies (stream_components.py), so the price
follows the same split and order as the work. Matrix products only, 2 per multiply-add, as torch's flop counter counts
them (vector products included); the eigendecompositions and the d x d SVD are not products and are not counted."""

from __future__ import annotations

from torch import Tensor

from circuits_core.circuits.composition import random_baseline_cost
from circuits_core.circuits.copying_spectra import embed_gram_flops
from circuits_core.circuits.head_circuits import embed_matmul_flops
from circuits_core.circuits.stream_components import (
    Chain,
    Reader,
    Writer,
    reader_chain,
    readers,
    writer_chain,
    writers,
)
from circuits_core.circuits.stream_grams import inner_products_flops
from circuits_core.model.transformer import Transformer


def all_scores_flops(model: Transformer) -> int:
    """all_scores: each layer's head factors (writers: W_O^T (W_V^T W_V) W_O's two products; readers: W_Q^T W_Q,
    W_K^T W_K, R KK R^T, R^T QQ R, W_O W_O^T and the three B B^T A^T), then the Gram inner products of every writer
    with the readers after it (stream_grams.inner_products_flops), and the sampled baseline (once per shape: its
    later calls are cached, so this bounds them)."""
    cfg = model.cfg
    L, H, d, dh = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    heads = L * H * (4 * d * dh**2 + 12 * d * dh**2 + 8 * dh**3)
    ws, rs = writers(model), readers(model)
    slots = [w.slot() for w in ws]
    limits = [sum(s < r.slot(model) for s in slots) for r in rs]
    ranks = [_rank(model, w.kind) for w in ws] + [_rank(model, r.role) for r in rs]
    return heads + inner_products_flops(d, ranks, limits) + random_baseline_cost(d, dh).flops


def _rank(model: Transformer, kind: str) -> int:
    """The inner dimension r of a writer's (kind) or reader's (role) Gram factors [r, d_model]."""
    cfg = model.cfg
    sizes = {"embed": cfg.d_vocab, "unembed": cfg.d_vocab, "pos": cfg.n_ctx, "router": cfg.num_experts or 0}
    if kind in ("mlp", "in", "gate", "up"):
        return cfg.d_mlp or 0
    return sizes.get(kind, cfg.d_head)


def pair_flops(model: Transformer, writer: Writer, reader: Reader, k: int, token_sides: int, offset: int = 0) -> int:
    """pair_report: the reader's chain formed twice (virtual_weight and its norm: R W_K^T for a Q or K reader), the
    virtual weight's factors (factored: its split and order), their SVD through the Grams (factored_svd), both chain
    norms, `token_sides` d_model sides read in tokens per direction (a d_vocab x d_model vector product each), and
    the sampled baseline (bounded as in all_scores_flops)."""
    cfg = model.cfg
    w_chain, r_chain = writer_chain(model, writer), reader_chain(model, reader, offset)
    rotated = 2 * 2 * cfg.d_head**2 * cfg.d_model if reader.role in ("Q", "K") else 0
    n_in, r, n_out, factors = _factored(model, w_chain + r_chain)
    k = min(k, r)
    svd = 2 * (n_in + n_out) * r * r + 2 * r**3 + 2 * 2 * r * r * k + 2 * (n_in + n_out) * r * k
    norms = _chain_norm(model, w_chain) + _chain_norm(model, r_chain)
    reads = token_sides * k * 2 * cfg.d_vocab * cfg.d_model
    return rotated + factors + svd + norms + reads + random_baseline_cost(cfg.d_model, cfg.d_head).flops


def _shape(model: Transformer, factor: Tensor | str) -> tuple[int, int]:
    return (model.cfg.d_vocab, model.cfg.d_model) if isinstance(factor, str) else (factor.shape[0], factor.shape[1])


def _matmul_all(shapes: list[tuple[int, int]]) -> int:
    """FLOPs of stream_components._matmul_all: the chain multiplied from its right end."""
    flops, cols = 0, shapes[-1][1]
    for rows, inner in reversed(shapes[:-1]):
        flops += 2 * rows * inner * cols
    return flops


def _factored(model: Transformer, chain: Chain) -> tuple[int, int, int, int]:
    """(n_in, r, n_out, FLOPs) of stream_components.factored(chain): split at its smallest inner dimension (the last
    of equal ones), each side's product; a leading EMBED through embed_eff_matmul."""
    shapes = [_shape(model, f) for f in chain]
    inner = [s[1] for s in shapes[:-1]]
    split = min(range(len(inner)), key=lambda i: (inner[i], -i)) + 1
    left, right = shapes[:split], shapes[split:]
    rest = left[1:] if isinstance(chain[0], str) else left
    flops = _matmul_all(rest) if len(rest) > 1 else 0
    if isinstance(chain[0], str) and rest:
        flops += embed_matmul_flops(model, rest[-1][1])
    flops += _matmul_all(right) if len(right) > 1 else 0
    return left[0][0], left[-1][1], right[-1][1], flops


def _chain_norm(model: Transformer, chain: Chain) -> int:
    """stream_components.chain_norm: the embedding's Gram for EMBED, <A^T A, B B^T> for two factors."""
    if len(chain) == 1:
        return embed_gram_flops(model) if isinstance(chain[0], str) else 0
    (a0, a1), (b0, b1) = (_shape(model, f) for f in chain)
    return 2 * a1 * a0 * a1 + 2 * b0 * b1 * b0
