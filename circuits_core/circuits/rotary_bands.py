"""Energy per rotary band: how much of each head's QK circuit each rotary frequency carries (docs/maths.md §6.3).

R(δ) = Σ_k [cos(δθ_k) I_k + sin(δθ_k) J_k] + I_C over the rotary pairs k = (first_k, second_k) (I_k the identity
on the pair, J_k[first, second] = 1, J_k[second, first] = -1, I_C the unrotated dims), so Ω_h(δ) = W_Q^h R(δ)
W_K^{gT} (rotary.py) is Σ_k [cos(δθ_k) A_k + sin(δθ_k) B_k] + C. The energy of band k is ||A_k||^2 + ||B_k||^2
(Barbero et al., arXiv 2410.06205: high frequencies make positional heads, low ones carry content); for each k it
equals ||W_Q[:, k]||^2 ||W_K[:, k]||^2, and the mean of ||Ω||^2 over independent uniform phases δθ_k is
||C||^2 + Σ_k (||A_k||^2 + ||B_k||^2) / 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.folded import stacked_weights
from circuits_core.circuits.rotary import check_rotary
from circuits_core.cost import Cost, float64_copy_size, itemsize
from circuits_core.model.transformer import Transformer, rotary_inv_freq, rotary_pairs


@dataclass
class BandEnergies:
    """Ω_h(δ) = Σ_k [cos(δθ_k) A_k + sin(δθ_k) B_k] + C per head (module docstring)."""

    theta: Tensor  # [L, K] radians per position of band k in each layer (θ_k, descending: band 0 is the fastest;
    # local and global layers differ where the model has a local rope base, as Gemma 3)
    cos_part: Tensor  # [L, H, K] ||A_k||_F^2
    sin_part: Tensor  # [L, H, K] ||B_k||_F^2
    unrotated: Tensor  # [L, H] ||C||_F^2 (0 without partial rotary)

    @property
    def energy(self) -> Tensor:
        """[L, H, K] ||A_k||^2 + ||B_k||^2."""
        return self.cos_part + self.sin_part

    @property
    def wavelength(self) -> Tensor:
        """[L, K] 2π / θ_k positions."""
        return 2 * torch.pi / self.theta


def band_energies(model: Transformer) -> BandEnergies:
    """Each head's QK energy per rotary frequency band, from the 2 x 2 blocks of its d_head x d_head Grams (float64)."""
    check_rotary(model)
    first, second = (i.to(model.device) for i in rotary_pairs(model.cfg))  # [K]
    W_Q, W_K = stacked_weights(model, "W_Q").double(), stacked_weights(model, "W_K").double()  # [L, H, d, dh], folded
    G_Q, G_K = W_Q.transpose(-2, -1) @ W_Q, W_K.transpose(-2, -1) @ W_K  # [L, H, dh, dh]

    def block(G: Tensor, a: Tensor, b: Tensor) -> Tensor:
        return G[..., a, b]  # [L, H, K]: G[first or second, first or second] of every pair

    qff, qss, qfs = block(G_Q, first, first), block(G_Q, second, second), block(G_Q, first, second)
    kff, kss, kfs = block(G_K, first, first), block(G_K, second, second), block(G_K, first, second)
    # A_k = Q_p K_p^T: ||A_k||^2 = <G_Q[p, p], G_K[p, p]>; B_k = Q_p J K_p^T: ||B_k||^2 = <J^T G_Q[p, p] J, G_K[p, p]>
    cos_part = qff * kff + qss * kss + 2 * qfs * kfs
    sin_part = qss * kff + qff * kss - 2 * qfs * kfs
    rd = 2 * first.numel()
    rest = torch.ones(model.cfg.d_head, dtype=torch.bool, device=W_Q.device)
    rest[first], rest[second] = False, False
    unrotated = (
        (G_Q[..., rest][..., rest, :] * G_K[..., rest][..., rest, :]).sum((-2, -1))
        if rd < model.cfg.d_head
        else W_Q.new_zeros(W_Q.shape[:2])
    )
    theta = torch.stack([rotary_inv_freq(model.cfg.layer_rope(layer)) for layer in range(model.cfg.n_layers)])
    return BandEnergies(theta.to(cos_part.device), cos_part, sin_part, unrotated)  # theta [L, K]


def bands_cost(model: Transformer) -> Cost:
    """band_energies: the weights stacked [L, H, d_model, d_head] in float64, W_Q's held while W_K's are stacked (each
    layer's per query head, a list of new tensors, then their stack, in the model's dtype; then its float64 copy unless
    the model is float64), and their d_head x d_head Grams; answer 3 numbers per band. Rotary models only."""
    check_rotary(model)
    cfg = model.cfg
    L, H, d, dh = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    size, wide = itemsize(model.dtype), float64_copy_size(model.dtype)
    weights = L * H * d * dh * (max(wide, size) + 2 * size + wide)  # W_Q in float64; W_K's layers, stack, float64
    flops = 2 * L * H * 2 * d * dh * dh  # W_Q^T W_Q and W_K^T W_K per query head
    return Cost(weights + 2 * L * H * dh * dh * 8, flops=flops).with_answer(numbers=3 * dh // 2 + 1)
