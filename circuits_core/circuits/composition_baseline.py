"""The random baseline of composition scores: the score of random matrices of the heads' shapes.

Paper section: "Composition" (Elhage et al. 2021; docs/maths.md §2.9). For independent random rank-d_head factors
E||AB||^2 = ||A||^2 ||B||^2 / d_model, so the expected score is about 1/sqrt(d_model) (the paper subtracts "the
empirical expected amount for random matrices of the same shapes"). `random_baseline` samples it with ARENA's
generator (kaiming-uniform [d_model, d_head] factors, U(-1/sqrt(d_head), 1/sqrt(d_head))) as a check beside the
analytic value that composition.py subtracts.
"""

from __future__ import annotations

import functools

import torch

from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError

# Draws of the sampled random baseline. The scores of random matrices concentrate (std ~1 % of the mean at GPT-2
# small's shapes), so 64 draws fix the mean to ~0.15 %; sampling them is a cold request's cost (the uniform
# stream alone took ~1.5 s for 300 draws at d_model 768), cached per shape afterwards.
BASELINE_SAMPLES = 64


@functools.lru_cache(maxsize=16)
def random_baseline(d_model: int, d_head: int, n_samples: int = BASELINE_SAMPLES, seed: int = 0) -> tuple[float, float]:
    """(mean, std) of the composition score of random matrices with ARENA's generator (cached per arguments).

    ARENA `generate_single_random_comp_score`: four [d_model, d_head] matrices with
    kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(d_head), 1/sqrt(d_head)); W_A = A_l A_r^T, W_B = B_l B_r^T.
    Each score through d_head x d_head matrices (no QR): with G_x = X^T X and M = A_r^T B_l,
    ||W_A W_B||^2 = <G_Al M, M G_Br>, ||W_A||^2 = <G_Al, G_Ar>, ||W_B||^2 = <G_Bl, G_Br>.
    """
    if n_samples < 1:
        raise InvalidInputError(f"n_samples must be >= 1, got {n_samples}")
    gen = torch.Generator().manual_seed(seed)
    chunks = []
    for start in range(0, n_samples, 32):  # chunks keep the memory at 4 x 32 x d_model x d_head
        size = min(32, n_samples - start)
        # U(-bound, bound) = 2 bound (U(0, 1) - 1/2); the score does not depend on the common factor 2 bound
        W = torch.rand(4, size, d_model, d_head, generator=gen, dtype=torch.float64).sub_(0.5)
        G_Al, G_Ar, G_Bl, G_Br = W.transpose(-2, -1) @ W  # [S, dh, dh] each
        M = W[1].transpose(-2, -1) @ W[2]  # A_r^T B_l [S, dh, dh]
        num_sq = ((G_Al @ M) * (M @ G_Br)).sum((-2, -1))
        den_sq = (G_Al * G_Ar).sum((-2, -1)) * (G_Bl * G_Br).sum((-2, -1))
        chunks.append((num_sq.clamp_min(0) / den_sq).sqrt())
    scores = torch.cat(chunks)
    return float(scores.mean()), float(scores.std()) if n_samples > 1 else 0.0


def random_baseline_cost(d_model: int, d_head: int, n_samples: int = BASELINE_SAMPLES) -> Cost:
    """random_baseline's working memory (float64): one chunk of 4 x 32 [d_model, d_head] draws, their four
    d_head Grams, M and the two products of the score; FLOPs of every sample's products (its first call: later ones
    are cached)."""
    flops = n_samples * (10 * d_model * d_head**2 + 4 * d_head**3)
    return Cost(8 * (4 * 32 * d_model * d_head + 7 * 32 * d_head * d_head), flops=flops)
