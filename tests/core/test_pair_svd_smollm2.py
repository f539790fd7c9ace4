"""The single-pair residual page's numbers on SmolLM2 in float32 (as served): every singular value against a dense
float64 SVD of the same float32 matrices, and the pair score against an independent float64 Gram identity
||W_w W_r||_F^2 = <W_w^T W_w, W_r W_r^T>, which the all-pairs table computes too (measured there: L10.mlp ->
unembed 0.0423, where the pair page said 0.0208 before its Grams went to float64)."""

from __future__ import annotations

import pytest
import torch

from circuits_core.circuits import stream_components as sc
from circuits_core.circuits import virtual_weights as vw
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from tests.core.test_smollm2 import folder  # noqa: F401  (the fixture: fails with how to fetch the file)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]


@pytest.fixture(scope="module")
def processed(folder) -> LoadedModel:  # noqa: F811
    loaded = load_checkpoint(folder)  # as the server loads it: processed, float32
    assert loaded.model.dtype == torch.float32
    return loaded


def _gram_score(W: torch.Tensor, R: torch.Tensor) -> float:
    W, R = W.double(), R.double()
    G, H = W.T @ W, R @ R.T  # [d, d] each
    return float((G * H).sum().sqrt() / (G.trace().sqrt() * H.trace().sqrt()))


def test_mlp_to_mlp_pair_has_every_singular_value_of_the_dense_float64_svd(processed):
    m = processed.model
    W, R = sc.parse_writer(m, "L5.mlp"), sc.parse_reader(m, "L10.mlp.up")
    rep = vw.pair_report(m, W, R, k=3)
    W_out, W_in = m.blocks[5].mlp.W_out.double(), m.blocks[10].mlp.W_in.double()
    S = torch.linalg.svdvals(W_out @ W_in)[: m.cfg.d_model]  # [1536, 1536], rank d_model
    got = torch.tensor(rep.singular_values, dtype=torch.float64)
    assert int((got > 0).sum()) == m.cfg.d_model  # the old cut kept 362 of 576
    torch.testing.assert_close(got, S, rtol=0, atol=1e-5 * float(S[0]))
    assert rep.score == pytest.approx(_gram_score(W_out, W_in), rel=1e-5)


def test_mlp_to_unembed_score_is_the_float64_gram_identity(processed):
    m = processed.model
    rep = vw.pair_report(m, sc.parse_writer(m, "L10.mlp"), sc.parse_reader(m, "unembed"), k=1)
    expected = _gram_score(m.blocks[10].mlp.W_out, m.W_U)
    assert rep.score == pytest.approx(expected, rel=1e-5)
    assert int((torch.tensor(rep.singular_values) > 0).sum()) == m.cfg.d_model
