"""Q- and K-composition of rotary models as profiles over the query-key offset δ; V-composition unchanged.

Paper section: "Composition" (Elhage et al. 2021; paper-math 2.9) with the QK circuit at an offset of
rotary.py: Ω_B(δ) = W_Q^B R(δ) W_K^{gT}. Row-vector convention, as composition.py. For an earlier head A
(W_OV^A = W_V^A W_O^A) and a later head B:
    C_Q(δ) = ||W_OV^A Ω_B(δ)||_F   / (||W_OV^A||_F ||Ω_B(δ)||_F)
    C_K(δ) = ||W_OV^A Ω_B(δ)^T||_F / (||W_OV^A||_F ||Ω_B(δ)||_F)
    C_V    = composition.py's V-composition (rotation does not touch values)
At δ = 0 these are composition.py's scores (TransformerLens's QK is Ω(0)).

Exactly through d_head x d_head Gram matrices, ||X R Y||^2 = <X^T X, R (Y^T Y) R^T>: with F_A = R_V^A W_O^A
(R_V^A the R factor of W_V^A's QR, so ||W_OV^A Z|| = ||F_A Z||), P = F_A W_Q^B and P' = F_A W_K^g [d_head, d_head]:
    num_Q(δ)^2 = <P^T P, R(δ) G_K^g R(δ)^T>       num_K(δ)^2 = <P'^T P', R(δ)^T G_Q^B R(δ)>
    ||Ω_B(δ)||^2 = <G_Q^B, R(δ) G_K^g R(δ)^T>      (G_Q = W_Q^T W_Q, G_K = W_K^T W_K)
so a whole profile costs one d_head x d_model x d_head product per pair (per key/value group for K) plus
d_head^2 per offset. The offset window is PROFILE_OFFSETS (δ = 0..64) unless given.

Random baseline: for Gaussian factors the distribution of W_K R(δ)^T is that of W_K, so the expected score
does not depend on δ. `random_baseline` samples it with Gaussian factors of the model's shapes, one key
factor shared by the group_size query heads of a group, as grouped-query attention shares it (drawn directly
as d_head x d_head pieces with the same distribution: see its docstring).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.composition import cost as composition_cost
from circuits_core.composition import raw_composition_scores
from circuits_core.config import head_name, parse_head
from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model import Transformer, rotary_angles, rotary_pairs
from circuits_core.rotary import KERNEL_WINDOW, check_offsets, check_rotary, rotation

PROFILE_OFFSETS = tuple(range(KERNEL_WINDOW + 1))  # δ = 0..64


@dataclass
class CompositionProfiles:
    """Every (earlier head, later head) pair's Q and K profiles over `offsets`, and V-composition.

    q, k: [L, H (earlier), L, H (later), n_offsets]; v: [L, H, L, H]; 0 unless layer1 < layer2.
    """

    offsets: Tensor  # [n]
    q: Tensor
    k: Tensor
    v: Tensor
    baseline: float  # sampled mean score of random factors (rotation-invariant: one value for every δ)
    baseline_std: float
    mask: Tensor  # [L, H, L, H] bool: layer1 < layer2

    def peak(self, kind: str) -> tuple[Tensor, Tensor]:
        """(max over offsets [L, H, L, H], the offset where it is reached [L, H, L, H]) for kind q or k."""
        scores = self.profile(kind)
        values, where = scores.max(dim=-1)
        return values, self.offsets.to(where.device)[where]

    def profile(self, kind: str) -> Tensor:
        if kind not in ("q", "k"):
            raise InvalidInputError(f"composition profiles are for kind q or k, got {kind!r}")
        return self.q if kind == "q" else self.k


def _source_factors(model: Transformer, dtype: torch.dtype) -> Tensor:
    """F [L, H, d_head, d_model] = R_V W_O: ||W_OV Z||_F = ||F Z||_F for any Z (R_V from the group's W_V)."""
    W_V, W_O = model.W_V_groups.to(dtype), model.W_O.to(dtype)  # [L, G, d, dh], [L, H, dh, d]
    R_V = torch.linalg.qr(W_V, mode="r")[1]  # [L, G, dh, dh]
    return R_V.repeat_interleave(model.cfg.group_size, dim=1) @ W_O  # [L, H, dh, d]


def _pair_order(model: Transformer) -> Tensor:
    """A permutation of the d_head dims putting the rotary pairs' first dims, then their second dims, then the
    unrotated ones: in that basis R(δ) acts on halves (rotate-half layout) whatever the model's layout. Inner
    products <M, X> are unchanged when both are permuted alike."""
    first, second = rotary_pairs(model.cfg)
    rest = [i for i in range(model.cfg.d_head) if i not in set(first.tolist()) | set(second.tolist())]
    return torch.cat([first, second, torch.tensor(rest, dtype=torch.long)]).to(model.device)


def _rotated_grams(G: Tensor, cos: Tensor, sin: Tensor, transpose_side: bool) -> Tensor:
    """R(δ) G R(δ)^T (transpose_side False) or R(δ)^T G R(δ) (True) for G [N, dh, dh] in the pair order of
    _pair_order, cos/sin [n, K] of δ θ_k: [N, n, dh, dh], by rotating columns then rows (O(dh^2) per offset).

    x R(δ) turns pair k: x_f' = x_f cos - x_s sin, x_s' = x_s cos + x_f sin (model.rotate); R(δ)^T = R(-δ)."""
    K = cos.shape[-1]
    s = sin if transpose_side else -sin  # R^T G R: columns by R(δ); R G R^T: columns by R(-δ)

    def right(X: Tensor) -> Tensor:  # X [..., dh] rows, each times R(±δ): [..., n, dh]
        f, sec, rest = X[..., None, :K], X[..., None, K:2 * K], X[..., None, 2 * K:]
        a, b = f * cos - sec * s, sec * cos + f * s  # [..., n, K]
        return torch.cat([a, b, rest.expand(*a.shape[:-1], rest.shape[-1])], -1)

    GR = right(G).transpose(-3, -2)  # [N, n, dh (rows of G), dh]: G R(±δ)
    c2, s2 = cos[:, :, None], s[:, :, None]  # [n, K, 1]: the same turn applied to rows
    f, sec, rest = GR[..., :K, :], GR[..., K:2 * K, :], GR[..., 2 * K:, :]
    return torch.cat([f * c2 - sec * s2, sec * c2 + f * s2, rest], -2)  # R(±δ)^T G R(±δ)


def composition_profiles(
    model: Transformer,
    offsets: Sequence[int] | Tensor = PROFILE_OFFSETS,
    n_samples: int = 200,
    seed: int = 0,
) -> CompositionProfiles:
    """All pairs' Q/K profiles over the offsets and V-composition, exactly from d_head x d_head Grams."""
    check_rotary(model)
    cfg = model.cfg
    L, H, G, dh = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    delta = check_offsets(model, offsets)
    n = delta.numel()
    dtype = model.compute_dtype
    q = torch.zeros(L, H, L, H, n, dtype=dtype, device=model.device)
    k = torch.zeros_like(q)
    with torch.no_grad():
        W_Q, W_K = model.W_Q.to(dtype), model.W_K_groups.to(dtype)  # [L, H, d, dh], [L, G, d, dh]
        F = _source_factors(model, dtype)  # [L, H, dh, d]
        src = F.pow(2).sum((-2, -1)).sqrt()  # [L, H] ||W_OV||
        G_Q = W_Q.transpose(-2, -1) @ W_Q  # [L, H, dh, dh]
        G_K = W_K.transpose(-2, -1) @ W_K  # [L, G, dh, dh] per key/value group
        order = _pair_order(model)  # every d_head x d_head matrix below in this basis
        G_Q, G_K = G_Q[..., order][..., order, :], G_K[..., order][..., order, :]
        angles = rotary_angles(cfg, delta.to(model.device))  # [n, K] δ θ_k
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        gs, d = cfg.group_size, cfg.d_model
        W_Qo, W_Ko = W_Q[..., order], W_K[..., order]
        for l2 in range(1, L):
            check_stop(what="composition profiles")
            A = l2 * H  # sources: every head of layers < l2
            X_Q = _rotated_grams(G_K[l2], cos, sin, transpose_side=False)  # [G, n, dh, dh]: R G_K R^T
            X_K = _rotated_grams(G_Q[l2], cos, sin, transpose_side=True)  # [H, n, dh, dh]: R^T G_Q R
            omega_sq = (G_Q[l2].view(G, gs, 1, dh, dh) * X_Q[:, None]).sum((-2, -1)).view(H, n)  # ||Ω_B(δ)||^2
            XQ, XK = X_Q.reshape(G, n, dh * dh), X_K.reshape(G, gs * n, dh * dh)
            sources = F[:l2].reshape(A * dh, d)  # [A dh, d]
            P = (sources @ W_Qo[l2].permute(1, 0, 2).reshape(d, H * dh)).view(A, dh, H, dh)
            P = P.permute(2, 0, 1, 3).contiguous()  # [H, A, dh, dh]: P = F_A W_Q^B
            MQ = (P.transpose(-2, -1) @ P).view(G, gs * A, dh * dh)  # head b uses X_Q of its group
            num_q = torch.bmm(MQ, XQ.transpose(1, 2)).view(H, A, n)
            P2 = (sources @ W_Ko[l2].permute(1, 0, 2).reshape(d, G * dh)).view(A, dh, G, dh)
            P2 = P2.permute(2, 0, 1, 3).contiguous()  # [G, A, dh, dh]: P' = F_A W_K^g
            MK = (P2.transpose(-2, -1) @ P2).view(G, A, dh * dh)
            num_k = torch.bmm(MK, XK.transpose(1, 2)).view(G, A, gs, n).permute(0, 2, 1, 3).reshape(H, A, n)
            den = src[:l2].reshape(1, A, 1) * omega_sq.clamp_min(0).sqrt()[:, None]  # [H, A, n]
            q[:l2, :, l2] = (num_q.clamp_min(0).sqrt() / den).permute(1, 0, 2).reshape(l2, H, H, n)
            k[:l2, :, l2] = (num_k.clamp_min(0).sqrt() / den).permute(1, 0, 2).reshape(l2, H, H, n)
        v = raw_composition_scores(model.W_Q.to(dtype), model.W_K.to(dtype), model.W_V.to(dtype),
                                   model.W_O.to(dtype), kinds=("v",))[0]  # [L, H, L, H]
    layer = torch.arange(L, device=model.device)
    mask = (layer[:, None, None, None] < layer[None, None, :, None]).expand(L, H, L, H)
    mean, std = random_baseline(cfg.d_model, dh, cfg.group_size, n_samples=n_samples, seed=seed)
    return CompositionProfiles(delta, q, k, v, mean, std, mask)


def pair_profile(model: Transformer, source: str, target: str, kind: str,
                 offsets: Sequence[int] | Tensor = PROFILE_OFFSETS) -> Tensor:
    """One pair's profile [n_offsets] (kind q or k), source head earlier than target head."""
    check_rotary(model)
    (l1, h1), (l2, h2) = parse_head(source, model.cfg), parse_head(target, model.cfg)
    if l1 >= l2:
        raise InvalidInputError(f"{head_name(l1, h1)} must be in an earlier layer than {head_name(l2, h2)}")
    if kind not in ("q", "k"):
        raise InvalidInputError(f"composition profiles are for kind q or k, got {kind!r}")
    dtype = model.compute_dtype
    with torch.no_grad():
        F = _source_factors(model, dtype)[l1, h1]  # [dh, d]
        W_Q = model.W_Q[l2, h2].to(dtype)  # [d, dh]
        W_K = model.W_K_groups[l2, h2 // model.cfg.group_size].to(dtype)
        R = rotation(model, offsets, dtype=dtype)  # [n, dh, dh]
        G_Q, G_K = W_Q.T @ W_Q, W_K.T @ W_K
        P = F @ (W_Q if kind == "q" else W_K)  # [dh, dh]
        X = R @ G_K @ R.transpose(-2, -1) if kind == "q" else R.transpose(-2, -1) @ G_Q @ R  # [n, dh, dh]
        num_sq = ((P.T @ P)[None] * X).sum((-2, -1))  # [n]
        omega_sq = (G_Q[None] * (R @ G_K @ R.transpose(-2, -1))).sum((-2, -1))  # [n]
        return num_sq.clamp_min(0).sqrt() / (F.norm() * omega_sq.clamp_min(0).sqrt())


def composition_at(model: Transformer, kind: str, offset: int) -> Tensor:
    """All pairs' Q- or K-composition at one offset [L, H, L, H], composition.py's d x d Gram computation
    with W_Q^B R(δ) in place of W_Q^B (its Q target W_Q W_K^T becomes Ω_B(δ), its K target Ω_B(δ)^T)."""
    check_rotary(model)
    if kind not in ("q", "k"):
        raise InvalidInputError(f"composition at an offset is for kind q or k, got {kind!r}")
    dtype = model.compute_dtype
    with torch.no_grad():
        R = rotation(model, [offset], dtype=dtype)[0]  # [dh, dh]
        W_Q = model.W_Q.to(dtype) @ R  # [L, H, d, dh]
        return raw_composition_scores(W_Q, model.W_K.to(dtype), model.W_V.to(dtype), model.W_O.to(dtype),
                                      kinds=(kind,))[0]  # type: ignore[arg-type]


def _pair_scores(F_Z: Tensor, G_Q: Tensor, F_K: Tensor, G_K: Tensor, F_sq: Tensor) -> Tensor:
    """Q and K scores [2 m g] of sampled heads from their d_head x d_head pieces: F_Z = F W_Q [m, g, dh, dh] (g query
    heads per key factor), G_Q = W_Q^T W_Q [m, g, dh, dh], F_K = F W_K [m, 1, dh, dh], G_K = W_K^T W_K [m, 1, dh, dh],
    F_sq = ||F||^2 = ||W_OV||^2 [m, 1] (the Gram formulas of the module docstring)."""
    num_q = ((F_Z.transpose(-2, -1) @ F_Z) * G_K).sum((-2, -1))  # [m, g]
    num_k = ((F_K.transpose(-2, -1) @ F_K) * G_Q).sum((-2, -1))
    den = F_sq * (G_Q * G_K).sum((-2, -1))
    return torch.cat([(num_q / den).sqrt().flatten(), (num_k / den).sqrt().flatten()])


def _normal(gen: torch.Generator, *shape: int) -> Tensor:
    """Standard normal draws as float64 (drawn in float32: 5x faster, and a Monte Carlo baseline needs no more)."""
    return torch.randn(*shape, generator=gen).double()


def _bartlett(dof: int, m: int, dh: int, gen: torch.Generator) -> Tensor:
    """[m, dh, dh] upper-triangular T with T^T T ~ Wishart(dof, I_dh) (Bartlett): T_ii = sqrt(chi^2 of dof - i),
    T_ij ~ N(0, 1) above the diagonal. T is distributed as the R factor of the QR of a Gaussian [dof, dh] matrix."""
    df = torch.arange(dof, dof - dh, -1, dtype=torch.float64)  # [dh], dof >= dh
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    with torch.random.fork_rng(devices=[]):  # torch's gamma sampler reads the global generator: a private seeded one
        torch.manual_seed(seed)
        diag = torch.distributions.Chi2(df).sample((m,)).sqrt()  # [m, dh]
    T = _normal(gen, m, dh, dh).triu(1)
    return T + torch.diag_embed(diag)


def _rotation_of(d_head: int, angle: float) -> Tensor:
    """[dh, dh] R: every rotate-half pair (k, k + dh/2) turned by `angle` (the key factor of an offset)."""
    c, s = math.cos(angle), math.sin(angle)
    half = d_head // 2
    R = torch.eye(d_head, dtype=torch.float64)
    R[:half, :half], R[half:2 * half, half:2 * half] = c * torch.eye(half), c * torch.eye(half)
    R[:half, half:2 * half], R[half:2 * half, :half] = s * torch.eye(half), -s * torch.eye(half)
    return R


def dense_baseline_scores(d_model: int, d_head: int, group_size: int, n_samples: int, seed: int = 0,
                          offset_angle: float = 0.0) -> Tensor:
    """The baseline's scores [2 n g] from dense Gaussian factors W_V, W_K [d, dh], W_O [dh, d], W_Q [g, d, dh] (the
    reference random_baseline's reduced sampler is tested against, and its route when d_model < 2 d_head)."""
    gen = torch.Generator().manual_seed(seed)
    R = _rotation_of(d_head, offset_angle)
    scores = []
    for start in range(0, n_samples, 32):
        m = min(32, n_samples - start)
        W_V, W_K = torch.randn(2, m, d_model, d_head, generator=gen, dtype=torch.float64)
        W_O = torch.randn(m, d_head, d_model, generator=gen, dtype=torch.float64)
        W_Q = torch.randn(m, group_size, d_model, d_head, generator=gen, dtype=torch.float64)
        F = torch.linalg.qr(W_V, mode="r")[1] @ W_O  # [m, dh, d]: ||W_OV Z|| = ||F Z||
        W_K = W_K @ R.T  # [m, d, dh]: W_K R(δ)^T, Ω = W_Q R(δ) W_K^T
        scores.append(_pair_scores(F[:, None] @ W_Q, W_Q.transpose(-2, -1) @ W_Q, (F @ W_K)[:, None],
                                   (W_K.transpose(-2, -1) @ W_K)[:, None], F.pow(2).sum((-2, -1))[:, None]))
    return torch.cat(scores)


@functools.lru_cache(maxsize=16)
def random_baseline(d_model: int, d_head: int, group_size: int = 1, n_samples: int = 200, seed: int = 0,
                    offset_angle: float = 0.0) -> tuple[float, float]:
    """(mean, std) of the Q- and K-composition scores of Gaussian factors of the model's shapes.

    Each sample is a source (W_V, W_O), one key factor W_K and group_size query factors W_Q that share it, as
    grouped-query attention shares it; each query head is scored (both kinds). `offset_angle` rotates every
    rotary pair of the key factor by that angle (tests use it to see that the baseline does not depend on δ).

    Drawn in d_head x d_head pieces, with the distribution of dense Gaussian factors (dense_baseline_scores):
    W_V = Q_V T_V and W_O^T = Q_O T_O (QR; T Bartlett-distributed, Q independent), so F = T_V T_O^T Q_O^T; in an
    orthonormal basis [Q_O, Q_perp] of the d_model space a Gaussian W_Q independent of W_O has independent
    Gaussian coordinates Z = Q_O^T W_Q [dh, dh] and Q_perp^T W_Q, whose Gram is Wishart(d_model - d_head) = T^T T.
    So F W_Q = T_V T_O^T Z and W_Q^T W_Q = Z^T Z + T^T T: O(d_head^3) per sample instead of O(d_model d_head^2).
    """
    if n_samples < 1:
        raise InvalidInputError(f"n_samples must be >= 1, got {n_samples}")
    if d_model < 2 * d_head:  # the Bartlett factor of Q_perp^T W_Q needs d_model - d_head >= d_head
        scores = dense_baseline_scores(d_model, d_head, group_size, n_samples, seed, offset_angle)
    else:
        gen = torch.Generator().manual_seed(seed)
        R = _rotation_of(d_head, offset_angle)
        g, dh, m = group_size, d_head, n_samples
        T_V, T_O = _bartlett(d_model, m, dh, gen), _bartlett(d_model, m, dh, gen)
        F = T_V @ T_O.transpose(-2, -1)  # [m, dh, dh]: F Q_O
        Z = _normal(gen, m, g + 1, dh, dh)  # Q_O^T W_Q (g heads), Q_O^T W_K
        T_perp = _bartlett(d_model - d_head, m * (g + 1), dh, gen).view(m, g + 1, dh, dh)
        grams = Z.transpose(-2, -1) @ Z + T_perp.transpose(-2, -1) @ T_perp  # [m, g + 1, dh, dh]
        Z_K, G_K = Z[:, g:] @ R.T, R @ grams[:, g:] @ R.T  # the key factor W_K R(δ)^T
        scores = _pair_scores(F[:, None] @ Z[:, :g], grams[:, :g], F[:, None] @ Z_K, G_K, F.pow(2).sum((-2, -1))[:, None])
    return float(scores.mean()), float(scores.std()) if scores.numel() > 1 else 0.0


# -- costs (circuits_core.cost) ------------------------------------------------------------------------
def profiles_cost(model: Transformer, n_offsets: int) -> Cost:
    """composition_profiles: the [L, H, L, H, n] results, then per target layer the products P, P' and
    their Grams [Ns, H, d_head, d_head] and the rotated Grams [H, n, d_head, d_head]; V-composition after."""
    cfg = model.cfg
    L, H, dh, d = cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_model
    size = itemsize(model.compute_dtype)
    results = 2 * L * H * L * H * n_offsets * size
    weights = (3 * L * H * d * dh + 2 * L * H * dh * dh) * size
    Ns = max(L - 1, 0) * H
    per_layer = (4 * Ns * H * dh * dh + 2 * Ns * H * n_offsets + 3 * H * n_offsets * dh * dh) * size
    pairs = L * H * L * H // 2
    return Cost(results + weights + per_layer).then(composition_cost(model, ("v",))).with_answer(
        numbers=pairs * (2 * n_offsets + 1), labels=L * H)


def pair_profile_cost(model: Transformer, n_offsets: int) -> Cost:
    cfg = model.cfg
    dh = cfg.d_head
    return Cost((3 * n_offsets * dh * dh + 4 * cfg.d_model * dh) * 8).with_answer(numbers=3 * n_offsets + 1)


def composition_at_cost(model: Transformer) -> Cost:
    """composition.py's all-pairs computation for one kind (the rotated W_Q is one more copy of W_Q)."""
    cfg = model.cfg
    return composition_cost(model, ("q",)) + Cost(cfg.n_layers * cfg.n_heads * cfg.d_model * cfg.d_head * itemsize(model.dtype))
