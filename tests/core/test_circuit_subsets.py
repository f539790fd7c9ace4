"""circuits.full_ov_circuit / full_qk_circuit with `tokens`: the [n, n] submatrix of the given rows and columns,
its factors formed on those tokens only (the global tables of a large vocabulary rank a token subset).
Checked against the dense float64 circuit built from the whole vocabulary and indexed, on a LayerNorm model (the
embedding rows go through layer 0's ln1) and a model without norms."""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from circuits_core.circuits import head_circuits as circuits
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model


@pytest.mark.parametrize("norm", [None, "LN", "RMS"])
def test_a_token_subset_of_a_full_circuit_is_the_dense_submatrix(norm: Literal["LN", "RMS"] | None) -> None:
    cfg = ModelConfig(n_layers=2, d_model=24, n_heads=3, d_head=8, d_vocab=90, n_ctx=16, normalization_type=norm)
    model = random_model(cfg, seed=5, dtype=torch.float64, std_embed=0.7)
    ids = torch.tensor([0, 3, 4, 17, 40, 41, 89])
    for layer, head in [(0, 0), (1, 2)]:
        ov = circuits.full_ov_circuit(model, layer, head).AB  # [V, V]
        qk = circuits.full_qk_circuit(model, layer, head).AB
        sub_ov = circuits.full_ov_circuit(model, layer, head, ids)
        sub_qk = circuits.full_qk_circuit(model, layer, head, ids)
        assert sub_ov.shape == sub_qk.shape == (len(ids), len(ids))
        torch.testing.assert_close(sub_ov.AB, ov[ids][:, ids], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sub_qk.AB, qk[ids][:, ids], rtol=1e-12, atol=1e-12)


def test_the_whole_circuit_is_the_dense_product_of_the_weights() -> None:
    """Anchors the reference above to the weights (no norm): W_E W_V W_O W_U and W_E W_Q W_K^T W_E^T / sqrt(d_head)."""
    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, d_head=4, d_vocab=50, n_ctx=8)
    model = random_model(cfg, seed=6, dtype=torch.float64)
    W_E, W_Q, W_K, W_V, W_O = (
        model.W_E,
        model.W_Q[0, 1],
        model.W_K[0, 1],
        model.W_V[0, 1],
        model.W_O[0, 1],
    )  # stacked [L, H, ...]
    ids = torch.tensor([1, 2, 30])
    ov = (W_E @ W_V @ W_O @ model.W_U)[ids][:, ids]
    qk = (W_E @ W_Q @ W_K.T @ W_E.T / 2.0)[ids][:, ids]
    torch.testing.assert_close(circuits.full_ov_circuit(model, 0, 1, ids).AB, ov, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(circuits.full_qk_circuit(model, 0, 1, ids).AB, qk, rtol=1e-12, atol=1e-12)
