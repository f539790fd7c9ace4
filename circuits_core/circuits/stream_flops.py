"""FLOPs of the residual-stream analyses: the virtual weights' table of every pair (virtual_weight_table.all_scores),
one pair's report (pair_report), counted from the factor chains the engine multiplies (stream_chains.py), so the
price follows the same split and order as the work; and the stream usage with its erasure scan (residual_stream.py,
erasure.py).
Matrix products only, 2 per multiply-add, as torch's flop counter counts them (vector products included); the
eigendecompositions and the factor SVDs are not products and are not counted."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from circuits_core.circuits.composition import random_baseline_cost
from circuits_core.circuits.copying_spectra import embed_gram_flops
from circuits_core.circuits.head_circuits import embed_matmul_flops
from circuits_core.circuits.stream_chains import Chain, reader_chain, writer_chain
from circuits_core.circuits.stream_components import Reader, Writer, earlier_writers, reaches, readers, writers
from circuits_core.circuits.stream_grams import block_for, inner_products_flops
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
    limits = earlier_writers(model, ws, rs)
    ranks = [_rank(model, w.kind) for w in ws] + [_rank(model, r.role) for r in rs]
    block = block_for(model.device)
    return heads + inner_products_flops(d, ranks, limits, block) + random_baseline_cost(d, dh).flops


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
    """FLOPs of stream_chains._matmul_all: the chain multiplied from its right end."""
    flops, cols = 0, shapes[-1][1]
    for rows, inner in reversed(shapes[:-1]):
        flops += 2 * rows * inner * cols
    return flops


def _factored(model: Transformer, chain: Chain) -> tuple[int, int, int, int]:
    """(n_in, r, n_out, FLOPs) of stream_chains.factored(chain): split at its smallest inner dimension (the last
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
    """stream_chains.chain_norm: the embedding's Gram for EMBED, <A^T A, B B^T> for two factors."""
    if len(chain) == 1:
        return embed_gram_flops(model) if isinstance(chain[0], str) else 0
    (a0, a1), (b0, b1) = (_shape(model, f) for f in chain)
    return 2 * a1 * a0 * a1 + 2 * b0 * b1 * b0


def spectra_flops(model: Transformer) -> int:
    """residual_stream.spectra: the Grams of the embedding (its upper blocks), positions, MLP outputs and inputs and
    the unembedding, and both head circuits' SVDs through their factors (the d_head-sized core and the two
    back-products; R W_K^T first for QK). The eigendecompositions and factor SVDs are not products."""
    cfg = model.cfg
    L, H, d, dh = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    flops = 0
    for w in writers(model):
        rank = _rank(model, w.kind)
        flops += embed_gram_flops(model) if w.kind == "embed" else 0 if w.kind == "head" else 2 * rank * d * d
    for r in readers(model):
        flops += 0 if r.role in ("Q", "K", "V") else 2 * d * _rank(model, r.role) * d
    return flops + L * H * (2 * (2 * dh**3 + 4 * d * dh * dh) + 2 * dh * dh * d)


def usage_flops(
    model: Transformer,
    dims: Callable[[str], int] | None = None,
    candidates: list[str] | None = None,
    erasure: bool = True,
) -> int:
    """stream_usage then erasure on the same spectra (spectra_flops): the subspace overlaps of every writer with every
    writer and reader (inner_products over the projector factors: those of at most 128 dimensions padded together),
    the bandwidth's load and crowded directions, the heads' moments, each writer's scan of the later heads, and the
    candidates' restricted products. `dims(name)`: each component's subspace dimension k, and `candidates` the writer
    of each candidate, when known; the price (None) takes every dimension at its most (d_head for a head's side,
    d_model otherwise) and every (writer, later head) pair as a candidate: an upper bound."""
    cfg = model.cfg
    L, H, d, dh = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    ws, rs = writers(model), readers(model)
    k_w = {w.name: dims(w.name) if dims else (dh if w.kind == "head" else d) for w in ws}
    k_r = [dims(r.name) if dims else (dh if r.role in ("Q", "K", "V") else d) for r in rs]

    def side_ranks(ks: list[int]) -> list[int]:
        small = [k for k in ks if k <= 128]
        return [max(small)] * len(small) + [k for k in ks if k > 128] if small else ks

    left, right = side_ranks(list(k_w.values())), side_ranks([*k_w.values(), *k_r])
    overlaps = inner_products_flops(d, left + right, [len(ws)] * len(right))
    bandwidth = sum(2 * d * k * d + 5 * 2 * d * k for k in k_w.values())
    if not erasure:
        return spectra_flops(model) + overlaps + bandwidth
    moments = L * H * (5 * 2 * d * dh * dh + 2 * 2 * dh**3)  # W_O W_V, W_V^T W_V twice, W_O W_O^T twice; E, VV OO
    # the scan: every writer's projector against every head's M_s and K (erasure.py), as blocked Gram inner
    # products (the projectors padded as in the overlaps), after OO W_V^T per head
    scan = L * H * 2 * dh * dh * d if L else 0
    if L:
        ranks = left + [2 * dh] * (L * H) + [dh] * (L * H)
        scan += inner_products_flops(d, ranks, [len(ws)] * (2 * L * H), block_for(model.device))
    every_pair = []
    for w in ws:
        n = sum(reaches(model, w, Reader("V", layer, h)) for layer in range(L) for h in range(H))
        every_pair += [w.name] * n
    restricted = sum(  # a candidate's U^T W_V and W_O U, and their product the smaller way round
        2 * 2 * k_w[w] * d * dh + 2 * dh * k_w[w] * min(k_w[w], dh)
        for w in (every_pair if candidates is None else candidates)
    )
    return spectra_flops(model) + overlaps + bandwidth + moments + scan + restricted


def erasure_flops(model: Transformer) -> int:
    """The erasure scan's share of usage_flops at its price (every dimension at its most, every pair a candidate):
    the heads' moments, each writer's scan of the later heads and the candidates' restricted products."""
    return usage_flops(model) - usage_flops(model, erasure=False)
