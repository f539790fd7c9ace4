"""How the residual stream's bandwidth is used: ranks, shared subspaces, crowding and erasure.

Paper section: "The Residual Stream as a Communication Channel" and "Subspaces and Residual Stream
Bottlenecks" (Elhage et al. 2021; docs/maths.md §2.1). Row-vector convention. Every writer W_w [n_in, d_model] writes
into the row space of W_w; every reader W_r [d_model, n_out] reads the column space of W_r (components in
stream_components.py). With stream-side singular values s_i and vectors u_i of a component:

    effective rank     (sum s_i^2)^2 / sum s_i^4: the participation ratio of the squared singular values (k for
                       k equal ones, 1 for a single direction)
    subspace           span of the top directions holding `energy` (default 90 %) of sum s_i^2; k = its dimension
    overlap(U1, U2)    ||U1^T U2||_F^2 / min(k1, k2): the mean squared cosine of the min(k1, k2) principal angles,
                       1 for nested/identical subspaces, 0 for orthogonal ones; random subspaces of the same
                       dimensions give max(k1, k2) / d_model in expectation, so `overlap_excess` =
                       (overlap - random) / (1 - random) is 0 at chance
    bandwidth          load = sum_w U_w U_w^T [d, d] over writers: its eigenvalues say how many writers share each
                       direction (sum = total writer dimensions); used dimensions = participation ratio of the
                       load; crowded directions = top eigenvectors with the writers that load them most
    erasure score      of an earlier writer e (subspace U_e, k dims) and a later head h (W_OV = W_V W_O):
                       -tr(U_e^T W_OV U_e) / (sqrt(k) ||U_e^T W_OV||_F), in [-1, 1]. U_e^T W_OV U_e [k, k] is the
                       virtual weight restricted to e's subspace (read there, written back there); its trace is the
                       sum of its eigenvalues, so the score is 1 when h writes back exactly the negative of what it
                       reads from e's subspace (the paper's memory management) and 0 on average for random heads.
                       Candidates: z-score > ERASURE_Z against the same head's scores on uniformly random k-dim
                       subspaces (erasure_null: a head whose W_OV is negative almost everywhere scores high on any
                       subspace, so it is compared with itself, not with random heads) and a read share
                       ||U_e^T W_OV||^2 / ||W_OV||^2 above a random subspace's k / d_model.

Weight-only: the erasure score ignores whether h attends to the position e wrote at (memory-management heads
mostly attend to the present token) and the LN scale in between; MLPs are not erasers here (not linear).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.copying_spectra import embed_gram
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.folded import stacked_weights
from circuits_core.circuits.host_linalg import eigvals
from circuits_core.circuits.stream_components import (
    Reader,
    Writer,
    mlp_input,
    mlp_output,
    reaches,
    readers,
    rotation,
    writers,
)
from circuits_core.circuits.stream_flops import erasure_flops, usage_flops
from circuits_core.circuits.stream_grams import factors, inner_products
from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model.transformer import Transformer

ENERGY = 0.9
ERASURE_Z = 5.0


@dataclass
class Spectrum:
    """A component's stream-side singular values [r] (descending) and vectors [d_model, r]."""

    S: Tensor
    basis: Tensor

    def effective_rank(self) -> float:
        s2 = self.S.double().pow(2)
        return float(s2.sum() ** 2 / s2.pow(2).sum()) if s2.sum() > 0 else 0.0

    def subspace(self, energy: float = ENERGY) -> Tensor:
        """[d_model, k]: the top directions holding `energy` of the squared singular values."""
        s2 = self.S.double().pow(2)
        share = s2.cumsum(0) / s2.sum()
        k = int((share < energy - 1e-12).sum()) + 1
        return self.basis[:, : min(k, self.S.shape[0])]


def _eigh_spectrum(G: Tensor) -> Spectrum:
    """From a Gram G = M^T M (or M M^T) [d, d]: singular values of M and the stream-side vectors.

    Through the Gram, singular values below sqrt(d eps) s_max are rounding noise: they are reported as 0."""
    e, E = torch.linalg.eigh(G)
    S = e.flip(0).clamp_min(0).sqrt()
    S = torch.where(S > S[0] * (S.shape[0] * torch.finfo(S.dtype).eps) ** 0.5, S, torch.zeros_like(S))
    return Spectrum(S, E.flip(1))


def spectra(model: Transformer, offset: int = 0) -> tuple[dict[str, Spectrum], dict[str, Spectrum]]:
    """Stream-side spectra of every writer and reader, keyed by name."""
    cfg, dt = model.cfg, model.compute_dtype
    L, H = cfg.n_layers, cfg.n_heads
    w_out: dict[str, Spectrum] = {}
    r_out: dict[str, Spectrum] = {}
    with torch.no_grad():
        for w in writers(model):
            if w.kind == "embed":
                w_out[w.name] = _eigh_spectrum(embed_gram(model).to(dt))
            elif w.kind == "pos":
                assert model.W_pos is not None
                w_out[w.name] = _eigh_spectrum(model.W_pos.T.to(dt) @ model.W_pos.to(dt))
            elif w.kind == "mlp":
                W_out = mlp_output(model, w).to(dt)  # [d_mlp, d] (this expert's), output gain folded
                w_out[w.name] = _eigh_spectrum(W_out.T @ W_out)
        if L:
            W_Q, W_K, W_V, W_O = (stacked_weights(model, n).flatten(0, 1).to(dt) for n in ("W_Q", "W_K", "W_V", "W_O"))
            R = rotation(model, offset).to(dt)  # (the global layers' rope)
            # W_OV = U S V^T: U is the side the V input reads from the stream, V the side the head writes into it.
            # W_QK = W_Q R W_K^T = U S V^T: U is read by the query; the key reads through W_QK^T = W_K R^T W_Q^T, whose
            # left singular vectors are W_QK's right ones: one SVD per circuit serves both of its sides.
            U_ov, S_ov, V_ov = FactoredMatrix(W_V, W_O).svd()  # [LH, d, dh], [LH, dh], [LH, d, dh]
            U_qk, S_qk, V_qk = FactoredMatrix(W_Q, R @ W_K.transpose(-2, -1)).svd()
            for i in range(L * H):
                layer, h = i // H, i % H
                w_out[Writer("head", layer, h).name] = Spectrum(S_ov[i], V_ov[i])
                for role, S, side in (("Q", S_qk, U_qk), ("K", S_qk, V_qk), ("V", S_ov, U_ov)):
                    r_out[Reader(role, layer, h).name] = Spectrum(S[i], side[i])  # type: ignore[arg-type]
        for r in readers(model):
            if r.role in ("in", "gate", "up", "router"):
                W = mlp_input(model, r).to(dt)
                r_out[r.name] = _eigh_spectrum(W @ W.T)
            elif r.role == "unembed":
                W_U = model.W_U.to(dt)
                r_out[r.name] = _eigh_spectrum(W_U @ W_U.T)
    return w_out, r_out


# -- overlaps -------------------------------------------------------------------------------------------
def overlap(U1: Tensor, U2: Tensor) -> float:
    """Mean squared cosine of the principal angles between span(U1) [d, k1] and span(U2) [d, k2] (orthonormal)."""
    return float((U1.T @ U2).pow(2).sum() / min(U1.shape[1], U2.shape[1]))


def random_overlap(k1: int, k2: int, d_model: int) -> float:
    """E[overlap] of independent uniformly random subspaces of dimensions k1, k2 in R^d: max(k1, k2) / d."""
    return max(k1, k2) / d_model


def _padded(bases: list[Tensor]) -> Tensor:
    """Bases [d, k_i] as one [N, k_max, d] factor with zero rows (a zero row adds nothing to U U^T)."""
    k_max = max(b.shape[1] for b in bases)
    out = bases[0].new_zeros(len(bases), k_max, bases[0].shape[0])
    for i, b in enumerate(bases):
        out[i, : b.shape[1]] = b.T
    return out


def overlaps(left: list[Tensor], right: list[Tensor], should_stop: Callable[[], bool] | None = None) -> Tensor:
    """||U_i^T U_j||_F^2 for all pairs via blocked projector Grams (stream_grams), bases grouped by dimension."""

    def sides(bases: list[Tensor]) -> tuple[list, list[int]]:  # type: ignore[type-arg]
        small = [i for i, b in enumerate(bases) if b.shape[1] <= 128]  # heads: pad to d_head together
        big = [i for i in range(len(bases)) if i not in set(small)]
        groups = ([factors(_padded([bases[i] for i in small]))] if small else []) + [
            factors(bases[i].T[None]) for i in big
        ]
        return groups, small + big

    lg, lo = sides(left)
    rg, ro = sides(right)
    raw = inner_products(lg, rg, should_stop, "subspace overlaps")[0]
    out = torch.empty_like(raw)
    out[torch.tensor(lo)[:, None], torch.tensor(ro)[None, :]] = raw
    return out


@dataclass
class StreamUsage:
    writers: list[str]
    readers: list[str]
    effective_rank: dict[str, float]  # writers and readers
    dims: dict[str, int]  # subspace dimension k at `energy`
    energy: float
    overlap: Tensor  # [Nw, Nw + Nr]: columns writers then readers; mean squared cosine
    random_overlap: Tensor  # [Nw, Nw + Nr]: max(k1, k2) / d
    overlap_excess: Tensor  # (overlap - random) / (1 - random); 0 where random == 1
    bandwidth: Bandwidth


@dataclass
class Bandwidth:
    d_model: int
    total_dims: int  # sum of the writers' subspace dimensions
    uniform_load: float  # total_dims / d_model: every direction's load if they were spread evenly
    load: list[float]  # eigenvalues of sum_w U_w U_w^T, descending [d_model]
    used_dims: float  # participation ratio of the load
    crowded: list[tuple[float, list[tuple[str, float]]]]  # top directions: load, writers sharing it (share u^T P_w u)


def bandwidth(names: list[str], bases: list[Tensor], d_model: int, n_crowded: int = 5, n_writers: int = 5) -> Bandwidth:
    """Load of the writers' subspaces on d_model (see the module docstring)."""
    load_matrix = sum((b @ b.T for b in bases), bases[0].new_zeros(d_model, d_model))
    lam, E = torch.linalg.eigh(load_matrix)
    lam, E = lam.flip(0).clamp_min(0), E.flip(1)
    total = sum(b.shape[1] for b in bases)
    crowded = []
    for i in range(min(n_crowded, d_model)):
        shares = torch.stack([(b.T @ E[:, i]).pow(2).sum() for b in bases])
        top = shares.topk(min(n_writers, len(bases)))
        crowded.append(
            (
                float(lam[i]),
                [(names[j], float(v)) for v, j in zip(top.values.tolist(), top.indices.tolist(), strict=True)],
            )
        )
    used = float(lam.sum() ** 2 / lam.pow(2).sum()) if lam.sum() > 0 else 0.0
    return Bandwidth(d_model, total, total / d_model, lam.tolist(), used, crowded)


Spectra = tuple[dict[str, Spectrum], dict[str, Spectrum]]


def stream_usage(
    model: Transformer,
    energy: float = ENERGY,
    offset: int = 0,
    should_stop: Callable[[], bool] | None = None,
    spec: Spectra | None = None,
) -> StreamUsage:
    """Effective ranks, subspace overlaps of every writer with every writer and reader, and the bandwidth.
    `spec`: spectra(model, offset) when already computed (erasure uses the same writers' spectra)."""
    if not 0 < energy <= 1:
        raise InvalidInputError(f"energy must be in (0, 1], got {energy}")
    w_spec, r_spec = spectra(model, offset) if spec is None else spec
    wn, rn = [w.name for w in writers(model)], [r.name for r in readers(model)]
    w_sub = [w_spec[n].subspace(energy) for n in wn]
    r_sub = [r_spec[n].subspace(energy) for n in rn]
    with torch.no_grad():
        raw = overlaps(w_sub, w_sub + r_sub, should_stop)
    d = model.cfg.d_model
    k_w = torch.tensor([b.shape[1] for b in w_sub], dtype=raw.dtype, device=raw.device)
    k_all = torch.tensor([b.shape[1] for b in w_sub + r_sub], dtype=raw.dtype, device=raw.device)
    ov = raw / torch.minimum(k_w[:, None], k_all[None, :])
    rand = torch.maximum(k_w[:, None], k_all[None, :]) / d
    excess = torch.where(rand < 1, (ov - rand) / (1 - rand).clamp_min(1e-12), torch.zeros_like(ov))
    ranks = {n: s.effective_rank() for n, s in {**w_spec, **r_spec}.items()}
    dims = {n: int(b.shape[1]) for n, b in zip(wn + rn, w_sub + r_sub, strict=True)}
    return StreamUsage(wn, rn, ranks, dims, energy, ov, rand, excess, bandwidth(wn, w_sub, d))


def usage_cost(model: Transformer, rows: int | None = None) -> Cost:
    """stream_usage: every component's d x d Gram or d x d_head factors and bases, one Gram block per side, the
    [Nw, Nw + Nr] tables; answer: three tables (`rows` of their Nw writer rows: a page of them), the ranks and the
    load spectrum."""
    cfg = model.cfg
    Nw, Nr = len(writers(model)), len(readers(model))
    shown = Nw if rows is None else min(rows, Nw)
    d, dh = cfg.d_model, cfg.d_head
    numbers = (
        (Nw + Nr) * (d * dh + 128 * 128) + 8 * d * d + 3 * Nw * (Nw + Nr) + cfg.n_layers * cfg.n_heads * 4 * d * dh
    )
    return Cost(numbers * itemsize(model.compute_dtype), flops=usage_flops(model, erasure=False)).with_answer(
        numbers=3 * shown * (Nw + Nr) + 2 * (Nw + Nr) + d, labels=Nw + Nr
    )


# -- erasure --------------------------------------------------------------------------------------------
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
        W_V_all = W_V.permute(1, 0, 2).reshape(d, L * H * cfg.d_head)  # [d, LH dh]: every head in one matmul
        W_O_all = W_O.reshape(L * H * cfg.d_head, d)  # [LH dh, d]
        dh = cfg.d_head
        for i, w in enumerate(ws):
            check_stop(should_stop, "erasure scores")
            if not mask[i].any():
                continue
            j0 = int(mask[i].nonzero()[0])  # heads are in layer order: the later heads are a suffix
            assert bool(mask[i, j0:].all())
            n = L * H - j0
            U = w_spec[w.name].subspace(energy).to(dt)  # [d, k]
            k = U.shape[1]
            X = (U.T @ W_V_all[:, j0 * dh :]).reshape(k, n, dh).transpose(0, 1)  # U^T W_V [n, k, dh]
            Y = (W_O_all[j0 * dh :] @ U).reshape(n, dh, k)  # W_O U [n, dh, k]
            trace = (X * Y.transpose(-2, -1)).sum((-2, -1))  # tr(U^T W_OV U)
            read_sq = ((X.transpose(-2, -1) @ X) * OO[j0:]).sum((-2, -1))  # ||U^T W_OV||^2
            s = -trace / (math.sqrt(k) * read_sq.clamp_min(torch.finfo(dt).tiny).sqrt())
            mean, std = erasure_null(moments.slice(j0), k, d)
            zs = ((s.double() - mean) / std.clamp_min(torch.finfo(torch.float64).tiny)).to(dt)
            sh = read_sq / ov_sq[j0:]
            score[i, j0:], z[i, j0:], share[i, j0:] = s, zs, sh
            for j in torch.nonzero((zs > threshold_z) & (sh > k / d)).flatten().tolist():
                # eigenvalues of X Y = U^T W_OV U [k, k], through the smaller of X Y and Y X (same nonzero ones)
                eig = eigvals((X[j] @ Y[j] if k <= dh else Y[j] @ X[j]).double())
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
    """erasure: the spectra (usage_cost's working memory) and, per writer, U^T W_V and W_O U for every head
    ([L H, k, d_head] twice, k <= d_model), plus the per-head null's float64 d_head-sized products; answer: the three
    [Nw, L H] tables, or with `shown` only that many candidates (each a few numbers and at most d_head eigenvalues)."""
    cfg = model.cfg
    LH, Nw = cfg.n_layers * cfg.n_heads, len(writers(model))
    numbers = 2 * LH * cfg.d_model * cfg.d_head + 3 * Nw * LH
    null = LH * (2 * cfg.d_model * cfg.d_head + 6 * cfg.d_head**2) * 8  # head_moments' float64 copies and products
    scan = Cost(usage_cost(model).peak_bytes).then(
        Cost(numbers * itemsize(model.compute_dtype) + null, flops=erasure_flops(model))
    )
    if shown is None:
        return scan.with_answer(numbers=3 * Nw * LH, labels=Nw + LH)
    return scan.with_answer(numbers=shown * (5 + 2 * cfg.d_head), labels=2 * shown)
