"""Gram matrices rotated by R(δ) for every query-key offset at once: the four-term form composition_rotary.py uses.

In the pair order (pair_order: the rotary pairs' first dims, then their second dims, then the unrotated ones)
R(δ) = C + S J with C = diag(cos δθ_k), S = diag(sin δθ_k) and J the quarter turn of each pair, so
R^T G R = c c^T∘G + c s^T∘(G J) + s c^T∘(J^T G) + s s^T∘(J^T G J) (docs/maths.md §6.4): four offset-independent
tables of G (rotated_tables) weighted by four offset weights (term_weights). Symmetric Grams are packed (packed)
so an inner product <M, X> reads 3/4 of their entries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.model.transformer import Transformer, rotary_angles, rotary_pairs


def pair_order(model: Transformer) -> Tensor:
    """A permutation of the d_head dims putting the rotary pairs' first dims, then their second dims, then the
    unrotated ones: in that basis R(δ) acts on halves (rotate-half layout) whatever the model's layout. Inner
    products <M, X> are unchanged when both are permuted alike."""
    first, second = rotary_pairs(model.cfg)
    rest = [i for i in range(model.cfg.d_head) if i not in set(first.tolist()) | set(second.tolist())]
    return torch.cat([first, second, torch.tensor(rest, dtype=torch.long)]).to(model.device)


def term_weights(
    model: Transformer, delta: Tensor, dtype: torch.dtype, layer: int | None = None
) -> tuple[Tensor, Tensor]:
    """The offset weights of the four terms of R(δ)^T G R(δ) in the pair order, packed (packed): ([4, h dh, n],
    [4, (dh - h)^2, n]); the first part's off-diagonal block (columns >= h) doubled, as the packed inner product
    counts it twice. Terms: c c^T, c s^T, s c^T, s s^T with c = cos δθ_k and s = sin δθ_k on both dims of pair k
    (1 and 0 on the unrotated dims); θ_k of layer `layer`'s rope (None: the global layers')."""
    dh, K = model.cfg.d_head, rotary_pairs(model.cfg)[0].numel()
    rope = model.cfg if layer is None else model.cfg.layer_rope(layer)
    angles = rotary_angles(rope, delta.to(model.device))  # [n, K] δ θ_k
    c = torch.ones(delta.numel(), dh, dtype=dtype, device=model.device)
    s = torch.zeros_like(c)
    c[:, : 2 * K], s[:, : 2 * K] = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    W = torch.stack(
        [
            c[:, :, None] * c[:, None, :],
            c[:, :, None] * s[:, None, :],
            s[:, :, None] * c[:, None, :],
            s[:, :, None] * s[:, None, :],
        ]
    ).permute(0, 2, 3, 1)  # [4, dh, dh, n]
    h = dh // 2
    W[:, :h, h:] *= 2
    return W[:, :h].reshape(4, h * dh, -1).contiguous(), W[:, h:, h:].reshape(4, (dh - h) ** 2, -1).contiguous()


def packed(M: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric M [..., dh, dh] as (its first h = dh // 2 rows [..., h dh], its last block [..., (dh - h)^2]):
    <M, X> = <first rows, first rows of X with columns >= h doubled> + <last blocks> for symmetric M, X."""
    h = M.shape[-1] // 2
    return M[..., :h, :].flatten(-2), M[..., h:, h:].flatten(-2)


def rotated_tables(G: Tensor, weights: tuple[Tensor, Tensor], swap: Tensor, turn: int) -> list[Tensor]:
    """R(δ)^T G R(δ) (turn 1) or R(δ) G R(δ)^T (turn -1) for G [N, dh, dh] in the pair order and every offset,
    packed and weighted for <M, X> (term_weights): [[N, h dh, n], [N, (dh - h)^2, n]].

    R(δ) = C + S J in the pair order (C = diag(c), S = diag(s), J[f_k, s_k] = 1, J[s_k, f_k] = -1: x R turns pair
    k as model.rotate does), so R^T G R = c c^T∘G + c s^T∘(G J) + s c^T∘(J^T G) + s s^T∘(J^T G J), and R G R^T
    the same with s -> -s. `swap` [dh] holds J's column signs: (G J)[:, j] = swap_j G[:, partner(j)]."""
    K = int((swap != 0).sum()) // 2
    partner = torch.cat([torch.arange(K, 2 * K), torch.arange(K), torch.arange(2 * K, G.shape[-1])]).to(G.device)
    GJ = G[..., partner] * swap  # G J
    JG = G[..., partner, :] * swap[:, None]  # J^T G
    terms = (G, turn * GJ, turn * JG, JG[..., partner] * swap)  # [N, dh, dh] each
    tables = []
    for part, W in enumerate(weights):  # W [4, E, n]
        B = [packed(t)[part] for t in terms]  # [N, E] each
        X = torch.mul(B[0][..., None], W[0])
        for t in range(1, 4):
            X.addcmul_(B[t][..., None], W[t])
        tables.append(X)  # [N, E, n]
    return tables


def swap_signs(model: Transformer, dtype: torch.dtype) -> Tensor:
    """[dh] the column signs of J in the pair order: -1 on the pairs' first dims, 1 on their second, 0 elsewhere."""
    K, dh = rotary_pairs(model.cfg)[0].numel(), model.cfg.d_head
    return torch.cat([-torch.ones(K), torch.ones(K), torch.zeros(dh - 2 * K)]).to(dtype=dtype, device=model.device)
