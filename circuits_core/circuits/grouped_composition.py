"""K- and V-composition of grouped-query models through the key/value weights the group's heads share.

Paper section: "Composition" (Elhage et al. 2021; docs/maths.md §2.9); composition.py forms the source factors and
chooses this route. A later head h2 of key/value group g reads through M = A B with A [d, dh] shared by the group:
    K-composition  M = W_QK^{h2 T} = W_K^g W_Q^{h2 T}    (A = W_K^g, B = W_Q^{h2 T})
    V-composition  M = W_OV^{h2}   = W_V^g W_O^{h2}      (A = W_V^g, B = W_O^{h2})
With the source factor F [k, d] of an earlier head (F^T F = W_OV^T W_OV, composition_factors.source_factor):
    ||W_OV^{h1} M||_F^2 = ||F A B||_F^2 = <Y^T Y, B B^T>_F,   Y = F A [k, dh],
and ||M||_F^2 = <A^T A, B B^T>_F. Y of every earlier head against every group of a layer is one product of the
stacked factors [n_src k, d] with the layer's A of all groups [d, G dh]: d k dh multiply-adds per (source, group),
shared by the group's heads. composition.py's Gram route spends about d^2 / 2 per head pair and the Grams' blocks.
This route's large products run faster per FLOP than the Gram blocks' small ones: 66-67 GFLOP/s per core against
32-55 for one Gram block pair side by side (load ~9), and over whole computations of the 8B layer shape on 12 layers
~56 GFLOP/s against ~47 (load ~10). composition.py takes it where its FLOPs are within GROUPED_RATE of the Gram
route's: the 1B shape's K-composition (~0.6x), not the 8B shape's (1.24x, where the two are within a few percent).

Two workers of one torch thread each take the target layers, largest first (schedule.shared_tasks, as
gram_pair_sums), each with its own Y buffer; every (layer, kind) writes its own scores, so the result does not depend
on which worker took it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.gram_pair_sums import workers
from circuits_core.cost import check_stop
from circuits_core.schedule import on_workspaces

# The grouped route runs when its FLOPs are at most this multiple of the Gram route's: whole computations ran at
# ~1.2x the Gram route's rate on this 2-core CPU (module docstring).
GROUPED_RATE = 1.2
GroupedKind = str  # "k" or "v"
Weight = Callable[[int, str], Tensor]  # composition_factors.LayerWeight


@dataclass
class _Space:
    Y: Tensor  # [n_src_max * k * G * dh] flat
    grams: Tensor  # [n_src_max * dh * dh] flat


def grouped_scores(
    F: Tensor,
    weight: Weight,
    shape: tuple[int, int, int, int, int],
    kinds: tuple[GroupedKind, ...],
    should_stop: Callable[[], bool] | None = None,
) -> Tensor:
    """[K, L, H, L, H] scores for kinds within ("k", "v") from the source factors F [(L - 1) H, k, d] (layer-major,
    head-major rows) and each later layer's weights; 0 unless l1 < l2."""
    L, H, gs, d, dh = shape
    K, k, G = len(kinds), F.shape[1], H // gs
    raw = F.new_zeros(K, L, H, L, H)
    if L < 2:
        return raw
    src_norm = torch.linalg.vector_norm(F, dim=(-2, -1))  # ||W_OV^{h1}||_F [(L - 1) H]
    rows = F.view(-1, d)  # [(L - 1) H k, d]
    spaces = [
        _Space(F.new_empty((L - 1) * H * k * G * dh), F.new_empty((L - 1) * H * dh * dh))
        for _ in range(workers(F.device))
    ]

    def target(l2: int, i: int, space: _Space) -> None:
        check_stop(should_stop, "composition scores")
        n = l2 * H  # the earlier heads: layers 0..l2-1
        W = weight(l2, "W_K" if kinds[i] == "k" else "W_V")  # A [G, d, dh]
        A = W.permute(1, 0, 2).reshape(d, G * dh)
        B = weight(l2, "W_Q").transpose(-2, -1) if kinds[i] == "k" else weight(l2, "W_O")  # [H, dh, d]
        BBt = (B @ B.transpose(-2, -1)).view(G, gs, dh * dh)  # B B^T per head
        AtA = (W.transpose(-2, -1) @ W).view(G, dh * dh)  # A^T A per group
        tgt_norm = (BBt * AtA[:, None]).sum(-1).clamp_min(0).sqrt().view(H)  # ||M^{h2}||_F
        Y = torch.mm(rows[: n * k], A, out=space.Y[: n * k * G * dh].view(n * k, G * dh)).view(n, k, G, dh)
        grams = space.grams[: n * dh * dh].view(n, dh, dh)
        num_sq = F.new_empty(G, n, gs)
        for g in range(G):
            torch.bmm(Y[:, :, g].transpose(-2, -1), Y[:, :, g], out=grams)  # (F A_g)^T (F A_g) per source
            torch.mm(grams.view(n, dh * dh), BBt[g].T, out=num_sq[g])
        den = src_norm[:n, None] * tgt_norm[None, :]
        scores = num_sq.permute(1, 0, 2).reshape(n, H).clamp_min_(0).sqrt_() / den
        raw[i, :l2, :, l2, :] = scores.view(l2, H, H)

    tasks = [lambda sp, l2=l2, i=i: target(l2, i, sp) for l2 in range(L - 1, 0, -1) for i in range(K)]
    on_workspaces(tasks, spaces)
    return raw


def grouped_flops(shape: tuple[int, int, int, int, int], k: int, n_kinds: int) -> int:
    """FLOPs of grouped_scores' products: per later layer and kind Y, its Grams per group, their inner products with
    B B^T, and the targets' own Grams B B^T and A^T A."""
    L, H, gs, d, dh = shape
    G = H // gs
    sources = sum(layer * H for layer in range(1, L))  # (earlier head, later layer) pairs
    per_pair = 2 * k * d * G * dh + G * 2 * dh * k * dh + 2 * dh * dh * H  # Y, its Grams, <., B B^T>
    per_layer = 2 * H * dh * d * dh + 2 * G * dh * d * dh  # B B^T, A^T A
    return n_kinds * (sources * per_pair + (L - 1) * per_layer)


def grouped_numbers(shape: tuple[int, int, int, int, int], k: int, n_kinds: int, device: torch.device) -> int:
    """Numbers grouped_scores holds beyond its input and the scores: per worker (two but on a GPU) a Y buffer and a
    Gram buffer for all earlier heads, and one layer's weights, B B^T and A^T A, the pair sums and denominators."""
    L, H, gs, d, dh = shape
    G, n = H // gs, (L - 1) * H
    per_worker = n * k * G * dh + n * dh * dh
    layer = 2 * H * d * dh + 2 * G * d * dh + H * dh * dh + G * dh * dh + 3 * n * H + 3 * H
    return (1 if device.type == "cuda" else 2) * (per_worker + layer) + n
