"""How the residual stream's bandwidth is used: ranks, shared subspaces and crowding (erasure: erasure.py).

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.copying_spectra import embed_gram
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.folded import stacked_weights
from circuits_core.circuits.stream_chains import mlp_input, mlp_output, rotation
from circuits_core.circuits.stream_components import Reader, Writer, readers, writers
from circuits_core.circuits.stream_flops import usage_flops
from circuits_core.circuits.stream_grams import GramSide, factors, inner_products
from circuits_core.cost import Cost, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model.transformer import Transformer
from circuits_core.ranking import top_k
from circuits_core.schedule import side_by_side

ENERGY = 0.9


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
    """Stream-side spectra of every writer and reader, keyed by name (the other writers, then the heads; the heads'
    readers, then the others). The heads' factored SVDs and the other components' Gram eigenproblems are independent:
    side by side when a core is idle (schedule.side_by_side)."""
    with torch.no_grad():
        (w_heads, r_heads), (w_other, r_other) = side_by_side(
            lambda: _head_spectra(model, offset), lambda: _other_spectra(model), "qkov-stream-spectra"
        )
    return {**w_other, **w_heads}, {**r_heads, **r_other}


def _head_spectra(model: Transformer, offset: int) -> tuple[dict[str, Spectrum], dict[str, Spectrum]]:
    """Every head's writer (its OV's output side) and its Q, K and V readers, from one factored SVD per circuit."""
    cfg, dt = model.cfg, model.compute_dtype
    L, H = cfg.n_layers, cfg.n_heads
    w_out: dict[str, Spectrum] = {}
    r_out: dict[str, Spectrum] = {}
    if not L:
        return w_out, r_out
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
    return w_out, r_out


def _other_spectra(model: Transformer) -> tuple[dict[str, Spectrum], dict[str, Spectrum]]:
    """The embedding's, positions', MLPs' and unembedding's spectra, each from its d_model x d_model Gram."""
    dt = model.compute_dtype
    w_out: dict[str, Spectrum] = {}
    r_out: dict[str, Spectrum] = {}
    for w in writers(model):
        if w.kind == "embed":
            w_out[w.name] = _eigh_spectrum(embed_gram(model).to(dt))
        elif w.kind == "pos":
            assert model.W_pos is not None
            w_out[w.name] = _eigh_spectrum(model.W_pos.T.to(dt) @ model.W_pos.to(dt))
        elif w.kind == "mlp":
            W_out = mlp_output(model, w).to(dt)  # [d_mlp, d] (this expert's), output gain folded
            w_out[w.name] = _eigh_spectrum(W_out.T @ W_out)
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


def _padded(bases: list[Tensor]) -> Tensor:
    """Bases [d, k_i] as one [N, k_max, d] factor with zero rows (a zero row adds nothing to U U^T)."""
    k_max = max(b.shape[1] for b in bases)
    out = bases[0].new_zeros(len(bases), k_max, bases[0].shape[0])
    for i, b in enumerate(bases):
        out[i, : b.shape[1]] = b.T
    return out


def projector_sides(bases: list[Tensor]) -> tuple[list[GramSide], list[int]]:
    """The projectors U U^T of orthonormal bases U [d, k] as stream_grams sides: those of at most 128 dimensions (heads)
    zero-padded to the largest of them in one side, each larger one a side of its own; and the bases' order in them."""
    small = [i for i, b in enumerate(bases) if b.shape[1] <= 128]
    big = [i for i in range(len(bases)) if i not in set(small)]
    groups = ([factors(_padded([bases[i] for i in small]))] if small else []) + [factors(bases[i].T[None]) for i in big]
    return groups, small + big


def overlaps(left: list[Tensor], right: list[Tensor], should_stop: Callable[[], bool] | None = None) -> Tensor:
    """||U_i^T U_j||_F^2 for all pairs via blocked projector Grams (stream_grams), bases grouped by dimension."""
    lg, lo = projector_sides(left)
    rg, ro = projector_sides(right)
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
        values, top = top_k(shares, min(n_writers, len(bases)))  # equal shares: in the writers' order
        crowded.append(
            (float(lam[i]), [(names[j], float(v)) for v, j in zip(values.tolist(), top.tolist(), strict=True)])
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
