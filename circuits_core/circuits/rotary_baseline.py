"""The random baseline of Q- and K-composition under rotation and grouped-query attention.

Paper section: "Composition" (Elhage et al. 2021; docs/maths.md §2.9): the score of random matrices of the same shapes,
subtracted as the paper subtracts "the empirical expected amount for random matrices". For Gaussian factors the
distribution of W_K R(δ)^T is that of W_K, so the expected score does not depend on δ: one value serves every offset
of composition_rotary's profiles. `random_baseline` samples it with Gaussian factors of the model's shapes, one key
factor shared by the group_size query heads of a group, as grouped-query attention shares it, drawn directly as
d_head x d_head pieces with the same distribution (see its docstring); `dense_baseline_scores` draws the dense
factors (the reference it is tested against). Scores through the Gram formulas of composition_rotary.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError

BASELINE_DRAWS = 200  # samples of random_baseline (the views' baseline)
BASELINE_CHUNK = 50  # draws whose d_head x d_head products are formed at once (the draws themselves all at once)


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
    T = _normal(gen, m, dh, dh).triu_(1)
    T.diagonal(dim1=-2, dim2=-1).copy_(diag)
    return T


def _rotation_of(d_head: int, angle: float) -> Tensor:
    """[dh, dh] R: every rotate-half pair (k, k + dh/2) turned by `angle` (the key factor of an offset)."""
    c, s = math.cos(angle), math.sin(angle)
    half = d_head // 2
    R = torch.eye(d_head, dtype=torch.float64)
    R[:half, :half], R[half : 2 * half, half : 2 * half] = c * torch.eye(half), c * torch.eye(half)
    R[:half, half : 2 * half], R[half : 2 * half, :half] = s * torch.eye(half), -s * torch.eye(half)
    return R


def dense_baseline_scores(
    d_model: int, d_head: int, group_size: int, n_samples: int, seed: int = 0, offset_angle: float = 0.0
) -> Tensor:
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
        scores.append(
            _pair_scores(
                F[:, None] @ W_Q,
                W_Q.transpose(-2, -1) @ W_Q,
                (F @ W_K)[:, None],
                (W_K.transpose(-2, -1) @ W_K)[:, None],
                F.pow(2).sum((-2, -1))[:, None],
            )
        )
    return torch.cat(scores)


@functools.lru_cache(maxsize=16)
def random_baseline(
    d_model: int,
    d_head: int,
    group_size: int = 1,
    n_samples: int = BASELINE_DRAWS,
    seed: int = 0,
    offset_angle: float = 0.0,
) -> tuple[float, float]:
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
        q_parts, k_parts = [], []
        for i in range(0, m, BASELINE_CHUNK):  # the draws above at once (one random stream), their products in chunks
            s = slice(i, i + BASELINE_CHUNK)
            grams = Z[s].transpose(-2, -1) @ Z[s] + T_perp[s].transpose(-2, -1) @ T_perp[s]  # [c, g + 1, dh, dh]
            Z_K, G_K = Z[s, g:] @ R.T, R @ grams[:, g:] @ R.T  # the key factor W_K R(δ)^T
            F_s = F[s, None]
            q, k = _pair_scores(F_s @ Z[s, :g], grams[:, :g], F_s @ Z_K, G_K, F_s.pow(2).sum((-2, -1))).chunk(2)
            q_parts.append(q)
            k_parts.append(k)
        scores = torch.cat(q_parts + k_parts)  # Q scores of every draw, then K scores, as one _pair_scores call
    return float(scores.mean()), float(scores.std()) if scores.numel() > 1 else 0.0


def baseline_cost(d_model: int, d_head: int, group_size: int, n_samples: int) -> Cost:
    """random_baseline's working memory (float64), from its steps. Reduced route: the draws held throughout (T_V, T_O,
    F [m, dh, dh], Z and T_perp [m, g + 1, dh, dh], T_perp's float32 normals while it is formed), then one chunk's
    Grams, products and pair-score terms [c, g + 1, dh, dh]. Dense route (d_model < 2 d_head): one chunk of 32 draws
    of [d_model, d_head] factors (W_V, W_K, W_O, g W_Q and their QR copies) and the same pair-score terms."""
    m, g, dh = n_samples, group_size, d_head
    flops = baseline_flops(d_model, d_head, group_size, n_samples)
    if d_model < 2 * d_head:
        c = min(32, m)
        return Cost(8 * c * (2 * d_model * dh * (3 + g) + dh * dh * (8 * g + 8)), flops=flops)
    c = min(BASELINE_CHUNK, m)
    return Cost(8 * dh * dh * (3 * m + 5 * m * (g + 1) // 2 + c * (8 * g + 8)), flops=flops)


def baseline_flops(d_model: int, d_head: int, group_size: int, n_samples: int) -> int:
    """random_baseline's products (its first call: later ones are cached). Reduced route, per sample: F, the g + 1
    Grams Z^T Z + T^T T, Z_K and R G_K R^T, F Z per query head and F Z_K, and the pair scores' g + 1 products, all
    d_head^3. Dense route: R_V W_O, W_K R^T, F W_Q and W_Q^T W_Q per query head, F W_K, W_K^T W_K (d_model d_head^2
    each; the QR is not a product) and the same pair-score products."""
    g, dh = group_size, d_head
    if d_model < 2 * d_head:
        return n_samples * (2 * dh * dh * d_model * (4 + 2 * g) + 2 * dh**3 * (1 + g))
    return n_samples * 2 * dh**3 * (8 + 4 * g)
