"""Erasure: later heads that write back the negative of what an earlier writer put in the residual stream.

Paper section: "Subspaces and Residual Stream Bottlenecks" (Elhage et al. 2021; docs/maths.md §2.1), the memory
management it describes. Row-vector convention; writers, readers and their stream-side subspaces as in
residual_stream.py.

    erasure score      of an earlier writer e (subspace U_e, k dims) and a later head h (W_OV = W_V W_O):
                       -tr(U_e^T W_OV U_e) / (sqrt(k) ||U_e^T W_OV||_F), in [-1, 1]. U_e^T W_OV U_e [k, k] is the
                       virtual weight restricted to e's subspace (read there, written back there); its trace is the
                       sum of its eigenvalues, so the score is 1 when h writes back exactly the negative of what it
                       reads from e's subspace (the paper's memory management) and 0 on average for random heads.
                       Candidates: z-score > ERASURE_Z against the same head's scores on uniformly random k-dim
                       subspaces (erasure_null: a head whose W_OV is negative almost everywhere scores high on any
                       subspace, so it is compared with itself, not with random heads) and a read share
                       ||U_e^T W_OV||^2 / ||W_OV||^2 above a random subspace's k / d_model.

How it is computed: with P = U_e U_e^T, tr(U_e^T W_OV U_e) = <P, M_s> (M_s = (W_OV + W_OV^T) / 2) and
||U_e^T W_OV||_F^2 = <P, W_OV W_OV^T>: every (writer, later head) pair's two numbers are inner products of symmetric
d_model x d_model matrices, taken for all pairs at once by stream_grams.inner_products (upper block triangle, Grams
kept as factors), never a k x d_head product per pair (~4x faster on SmolLM2-135M than one per pair).

Weight-only: the erasure score ignores whether h attends to the position e wrote at (memory-management heads
mostly attend to the present token) and the LN scale in between; MLPs are not erasers here (not linear).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.folded import stacked_weights
from circuits_core.circuits.gram_pair_sums import gram_block_size
from circuits_core.circuits.host_linalg import eigvals
from circuits_core.circuits.residual_stream import ENERGY, Spectra, projector_sides, spectra, usage_cost
from circuits_core.circuits.stream_components import Reader, Writer, reaches, writers
from circuits_core.circuits.stream_flops import erasure_flops
from circuits_core.circuits.stream_grams import block_for, factors, inner_products
from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.model.transformer import Transformer

ERASURE_Z = 5.0


@dataclass
class HeadMoments:
    """Per head [LH], float64: what the erasure score's per-head null needs of M = W_OV = W_V W_O and K = M M^T.

    With P = U U^T the projector on a subspace, the score's numerator is N = -tr(U^T M U) = -<P, M_s> (M_s the
    symmetric part) and its squared denominator D = ||U^T M||_F^2 = <P, K>: both linear in P."""

    tr_M: Tensor
    sq_Ms: Tensor  # ||M_s||_F^2
    tr_K: Tensor  # ||M||_F^2
    sq_K: Tensor  # ||K||_F^2
    MK: Tensor  # <M_s, K>

    def slice(self, start: int) -> HeadMoments:
        """The heads from `start` on."""
        return HeadMoments(*(getattr(self, f)[start:] for f in ("tr_M", "sq_Ms", "tr_K", "sq_K", "MK")))


def head_moments(W_V: Tensor, W_O: Tensor) -> HeadMoments:
    """From W_V [LH, d, dh] and W_O [LH, dh, d] through d_head-sized products only (all in float64):
    tr M = tr(W_O W_V), tr(M^2) = tr((W_O W_V)^2), ||M||^2 = <W_V^T W_V, W_O W_O^T>, ||K||^2 = tr((W_O W_O^T W_V^T
    W_V)^2), <M, K> = tr(W_V^T W_V W_O W_O^T (W_O W_V)^T)."""
    W_V, W_O = W_V.double(), W_O.double()
    C = W_O @ W_V  # [LH, dh, dh]
    VV, OO = W_V.transpose(-2, -1) @ W_V, W_O @ W_O.transpose(-2, -1)
    E = OO @ VV
    tr_K = (VV * OO).sum((-2, -1))
    sq_M2 = (C * C.transpose(-2, -1)).sum((-2, -1))  # tr(M^2)
    return HeadMoments(
        tr_M=C.diagonal(dim1=-2, dim2=-1).sum(-1),
        sq_Ms=(tr_K + sq_M2) / 2,
        tr_K=tr_K,
        sq_K=(E * E.transpose(-2, -1)).sum((-2, -1)),
        MK=(VV @ OO * C).sum((-2, -1)),
    )


def erasure_null(m: HeadMoments, k: int, d_model: int) -> tuple[Tensor, Tensor]:
    """(mean, std) [heads] of each head's erasure score over uniformly random k-dim subspaces of R^d_model.

    The first two moments of (N, D) are exact for a uniformly random rank-k projector P: E P = (k/d) I and, for
    symmetric X, Y, Cov(<P, X>, <P, Y>) = a (<X, Y> - tr X tr Y / d) with a = 2 k (d - k) / (d (d - 1) (d + 2)).
    The score f = -N / sqrt(k D) then takes its mean to second order and its variance to first order (the delta
    method); the sampled distribution agrees within a few percent once D's spread is small (test_residual_stream).
    A head whose W_OV is negative almost everywhere scores high on any subspace: its null is centred there.
    """
    d = d_model
    a = 2 * k * (d - k) / (d * (d - 1) * (d + 2)) if d > 1 else 0.0
    mu_N, mu_D = -k / d * m.tr_M, k / d * m.tr_K
    var_N = a * (m.sq_Ms - m.tr_M**2 / d)
    var_D = a * (m.sq_K - m.tr_K**2 / d)
    cov = -a * (m.MK - m.tr_M * m.tr_K / d)  # N carries the minus sign
    D = mu_D.clamp_min(torch.finfo(torch.float64).tiny)
    rk = math.sqrt(k)
    f = mu_N / (rk * D.sqrt())
    f_N, f_D = 1 / (rk * D.sqrt()), -mu_N / (2 * rk * D**1.5)
    f_ND, f_DD = -1 / (2 * rk * D**1.5), 3 * mu_N / (4 * rk * D**2.5)
    mean = f + f_ND * cov + f_DD * var_D / 2
    var = f_N**2 * var_N + 2 * f_N * f_D * cov + f_D**2 * var_D
    return mean, var.clamp_min(0).sqrt()


@dataclass
class ErasureCandidate:
    writer: str
    eraser: str  # a later head
    score: float
    z: float
    read_share: float  # ||U_e^T W_OV||^2 / ||W_OV||^2
    random_share: float  # k / d_model
    eigenvalues: list[complex]  # of the restricted virtual weight U_e^T W_OV U_e (min(k, d_head) of them)


@dataclass
class Erasure:
    writers: list[str]
    erasers: list[str]
    score: Tensor  # [Nw, L*H], 0 where the head does not read the writer
    z: Tensor  # [Nw, L*H]
    read_share: Tensor  # [Nw, L*H]
    mask: Tensor  # [Nw, L*H] bool
    candidates: list[ErasureCandidate]
    threshold_z: float
    energy: float


def erasure(
    model: Transformer,
    energy: float = ENERGY,
    threshold_z: float = ERASURE_Z,
    should_stop: Callable[[], bool] | None = None,
    spec: Spectra | None = None,
) -> Erasure:
    """Erasure scores of every (earlier writer, later head) pair and the candidates (module docstring)."""
    cfg, dt = model.cfg, model.compute_dtype
    L, H, d = cfg.n_layers, cfg.n_heads, cfg.d_model
    w_spec = (spectra(model) if spec is None else spec)[0]  # writers' spectra do not depend on the Q/K offset
    ws = writers(model)
    heads = [Writer("head", i // H, i % H) for i in range(L * H)]
    shape = (len(ws), L * H)
    score, z, share = (torch.zeros(shape, dtype=dt, device=model.device) for _ in range(3))  # [Nw, L H] each
    mask = torch.tensor(
        [[reaches(model, w, Reader("V", h.layer, h.head)) for h in heads] for w in ws], dtype=torch.bool
    )
    candidates = []
    if L:
        W_V, W_O = (stacked_weights(model, n).flatten(0, 1).to(dt) for n in ("W_V", "W_O"))  # [LH, d, dh], [LH, dh, d]
        OO = W_O @ W_O.transpose(-2, -1)  # [LH, dh, dh]
        moments = head_moments(W_V, W_O)
        ov_sq = ((W_V.transpose(-2, -1) @ W_V) * OO).sum((-2, -1))  # ||W_OV||^2 [LH]
        # every writer's projector U U^T against every head's symmetric M_s = (W_V W_O + W_O^T W_V^T) / 2 and
        # K = W_OV W_OV^T = W_V (W_O W_O^T) W_V^T, as blocked Gram inner products (stream_grams):
        # <U U^T, M_s> = tr(U^T W_OV U) and <U U^T, K> = ||U^T W_OV||_F^2, no k x d_head product per pair
        bases = [w_spec[w.name].subspace(energy).to(dt) for w in ws]  # [d, k] each
        left, order = projector_sides(bases)
        W_Vt = W_V.transpose(-2, -1)  # [LH, dh, d]
        M_s = factors(torch.cat([W_Vt, W_O], 1), torch.cat([W_O, W_Vt], 1) / 2)  # [LH, 2 dh, d] twice
        K = factors(W_Vt, OO @ W_Vt)  # [LH, dh, d] twice
        raw = inner_products(left, [M_s, K], should_stop, "erasure scores")[0]  # [Nw, 2 LH], rows in `order`
        sums = torch.empty_like(raw)
        sums[order] = raw
        traces, reads = sums[:, : L * H], sums[:, L * H :]  # [Nw, LH] each, writers in order
        for i, w in enumerate(ws):
            check_stop(should_stop, "erasure scores")
            if not mask[i].any():
                continue
            j0 = int(mask[i].nonzero()[0])  # heads are in layer order: the later heads are a suffix
            assert bool(mask[i, j0:].all())
            U = bases[i]
            k = U.shape[1]
            trace, read_sq = traces[i, j0:], reads[i, j0:]  # [n]: tr(U^T W_OV U), ||U^T W_OV||^2
            s = -trace / (math.sqrt(k) * read_sq.clamp_min(torch.finfo(dt).tiny).sqrt())
            mean, std = erasure_null(moments.slice(j0), k, d)
            zs = ((s.double() - mean) / std.clamp_min(torch.finfo(torch.float64).tiny)).to(dt)
            sh = read_sq / ov_sq[j0:]
            score[i, j0:], z[i, j0:], share[i, j0:] = s, zs, sh
            for j in torch.nonzero((zs > threshold_z) & (sh > k / d)).flatten().tolist():
                X, Y = U.T @ W_V[j0 + j], W_O[j0 + j] @ U  # U^T W_V [k, dh], W_O U [dh, k]
                # eigenvalues of X Y = U^T W_OV U [k, k], through the smaller of X Y and Y X (same nonzero ones)
                eig = eigvals((X @ Y if k <= cfg.d_head else Y @ X).double())
                candidates.append(
                    ErasureCandidate(
                        w.name,
                        heads[j0 + j].name,
                        float(s[j]),
                        float(zs[j]),
                        float(sh[j]),
                        k / d,
                        sorted(eig.tolist(), key=lambda c: c.real),
                    )
                )
    candidates.sort(key=lambda c: -c.score)
    return Erasure(
        [w.name for w in ws], [h.name for h in heads], score, z, share, mask, candidates, threshold_z, energy
    )


def erasure_cost(model: Transformer, shown: int | None = None) -> Cost:
    """erasure: the spectra (usage_cost's working memory), then the heads' stacked W_V and W_O, the factors of M_s
    ([L H, 2 d_head, d_model] twice) and of K (OO W_V^T), the writers' padded projector factors (at most 128 of
    d_model dimensions each), one Gram block [s, s] per writer and per right row (stream_grams), the [Nw, 2 L H] inner
    products (and their writer-ordered copy) and the three [Nw, L H] tables, plus the per-head null's float64
    d_head-sized products; answer: the three tables, or with `shown` only that many candidates (each a few numbers and
    at most d_head eigenvalues)."""
    cfg = model.cfg
    LH, Nw, d, dh = cfg.n_layers * cfg.n_heads, len(writers(model)), cfg.d_model, cfg.d_head
    block = gram_block_size(d, block_for(model.device))  # inner_products' Gram blocks
    numbers = (
        2 * LH * d * dh
        + 2 * LH * 2 * dh * d
        + LH * dh * d
        + Nw * min(d, 128) * d
        + (Nw + 2 * LH) * block * block
        + 2 * Nw * 2 * LH
        + 3 * Nw * LH
    )
    null = LH * (2 * d * dh + 6 * dh**2) * 8  # head_moments' float64 copies and products
    scan = Cost(usage_cost(model).peak_bytes).then(
        Cost(numbers * itemsize(model.compute_dtype) + null, flops=erasure_flops(model))
    )
    if shown is None:
        return scan.with_answer(numbers=3 * Nw * LH, labels=Nw + LH)
    return scan.with_answer(numbers=shown * (5 + 2 * dh), labels=2 * shown)
