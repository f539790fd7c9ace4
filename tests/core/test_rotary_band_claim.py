"""The rotary head page's sentence "Fast bands (short wavelengths) make positional heads, slow ones carry content"
(templates/_rotary_head.html) checked on SmolLM2-135M, the rotary model qkov serves.

Band energies are recomputed here without circuits_core.circuits.rotary: each rotary pair (i, j) and its frequency θ are
found by rotating the basis vector e_i by one position with model.rotate (checked against transformers elsewhere),
and a pair's QK energy is (||W_Q[:, i]||² + ||W_Q[:, j]||²)(||W_K[:, i]||² + ||W_K[:, j]||²) = ||A_k||² + ||B_k||²
for Ω(δ) = Σ_k [cos(δθ_k) A_k + sin(δθ_k) B_k] + C. Positional and content heads are the previous-token and
induction heads of the stored model summary (itself checked against transformers' patterns in test_smollm2.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.prompt.model_summary import load_summary
from tests.core.test_smollm2 import FOLDER, GGUF

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]


@pytest.fixture(scope="module")
def served() -> LoadedModel:
    if not (FOLDER / GGUF).is_file():
        pytest.fail(f"{FOLDER / GGUF} is missing: run `make smollm2`")
    return load_checkpoint(FOLDER)  # processed, as the head page serves it


def rotary_pairs(loaded: LoadedModel) -> list[tuple[int, int, float]]:
    """(i, j, θ) of every rotary pair, read off model.rotate: e_i R(1) = cos θ e_i ± sin θ e_j."""
    model = loaded.model
    eye = torch.eye(model.cfg.d_head, dtype=torch.float64)
    R = model.rotate(eye, torch.tensor(1)).double()  # [d_head, d_head], row i = e_i R(1)
    pairs = []
    for i in range(model.cfg.d_head):
        others = [j for j in range(model.cfg.d_head) if j != i and abs(float(R[i, j])) > 1e-12]
        if others and i < others[0]:
            (j,) = others
            pairs.append((i, j, math.atan2(abs(float(R[i, j])), float(R[i, i]))))
    return pairs


def fast_share(loaded: LoadedModel) -> dict[str, float]:
    """Per head: the share of its QK energy in the fastest quarter of the rotary bands."""
    model = loaded.model
    pairs = sorted(rotary_pairs(loaded), key=lambda p: -p[2])  # fastest first
    assert len(pairs) == (model.cfg.rotary_dim or model.cfg.d_head) // 2 and pairs[0][2] > 10 * pairs[-1][2]
    n_fast = len(pairs) // 4
    out = {}
    for layer in range(model.cfg.n_layers):
        attn = model.blocks[layer].attn
        for h in range(model.cfg.n_heads):
            W_Q = attn.W_Q[h].double()  # [d_model, d_head]
            W_K = attn._W_K[h // model.cfg.group_size].double()  # GQA: the group's key weights
            q, k = W_Q.pow(2).sum(0), W_K.pow(2).sum(0)  # [d_head]
            energy = [float((q[i] + q[j]) * (k[i] + k[j])) for i, j, _ in pairs]
            U = [d for d in range(model.cfg.d_head) if all(d not in p[:2] for p in pairs)]  # unrotated dims
            unrotated = float((W_Q[:, U] @ W_K[:, U].T).pow(2).sum()) if U else 0.0  # ||C||^2
            out[f"L{layer}H{h}"] = sum(energy[:n_fast]) / (sum(energy) + unrotated)
    return out


def test_positional_heads_use_fast_bands_and_content_heads_slow_ones(served: LoadedModel) -> None:
    summary = load_summary(FOLDER)
    assert summary is not None, "the stored model summary is stale or missing: make smollm2"
    previous = [d["head"] for d in summary["previous_token_heads"]]
    induction = [d["head"] for d in summary["induction_heads"]]
    assert len(previous) >= 4 and len(induction) >= 4
    share = fast_share(served)
    ranked = sorted(share.values())
    median, p80 = ranked[len(ranked) // 2], ranked[int(0.8 * len(ranked))]
    assert all(share[h] > p80 for h in previous), {h: share[h] for h in previous}
    assert all(share[h] < median for h in induction), {h: share[h] for h in induction}
