"""Composition profiles over δ (circuits_core/composition_rotary.py) against dense brute force in float64."""

import pytest
import torch
from rotary_models import CASES, rotary_model

from circuits_core.composition import composition_scores
from circuits_core.composition_rotary import (
    _pair_scores,
    composition_at,
    composition_profiles,
    dense_baseline_scores,
    pair_profile,
    random_baseline,
)
from circuits_core.config import head_name
from circuits_core.errors import InvalidInputError
from circuits_core.rotary import rotation


def dense_scores(model, l1, h1, l2, h2, delta):
    """(C_Q, C_K, C_V) of one pair at δ from the dense d_model x d_model matrices."""
    a, b = model.blocks[l1].attn, model.blocks[l2].attn
    W_OV = a.W_V[h1] @ a.W_O[h1]
    Om = b.W_Q[h2] @ rotation(model, [delta])[0] @ b.W_K[h2].T
    W_OV2 = b.W_V[h2] @ b.W_O[h2]
    den = W_OV.norm() * Om.norm()
    return (W_OV @ Om).norm() / den, (W_OV @ Om.T).norm() / den, (W_OV @ W_OV2).norm() / (W_OV.norm() * W_OV2.norm())


@pytest.mark.parametrize("case", ["gqa", "gqa-adjacent-partial-linear", "half"])
def test_profiles_match_dense_brute_force(case):
    model = rotary_model(n_layers=3, **CASES[case])
    offsets = [0, 1, 2, 5, 13, 31]
    prof = composition_profiles(model, offsets, n_samples=8)
    H = model.cfg.n_heads
    for l1 in range(3):
        for l2 in range(3):
            for h1 in range(H):
                for h2 in range(H):
                    if l1 >= l2:
                        assert float(prof.q[l1, h1, l2, h2].abs().max()) == 0.0
                        assert float(prof.k[l1, h1, l2, h2].abs().max()) == 0.0
                        continue
                    for n, delta in enumerate(offsets):
                        cq, ck, cv = dense_scores(model, l1, h1, l2, h2, delta)
                        assert abs(float(prof.q[l1, h1, l2, h2, n] - cq)) < 1e-12
                        assert abs(float(prof.k[l1, h1, l2, h2, n] - ck)) < 1e-12
                    assert abs(float(prof.v[l1, h1, l2, h2] - cv)) < 1e-12
    values, where = prof.peak("k")
    assert torch.equal(values, prof.k.max(-1).values)
    assert torch.equal(where, torch.tensor(offsets)[prof.k.argmax(-1)])
    # the profile is not flat: the rotation matters for Q and K composition
    assert float((prof.k[0, 0, 2, 1] - prof.k[0, 0, 2, 1, 0]).abs().max()) > 1e-3


def test_offset_zero_is_composition_py_and_single_offsets_agree():
    """At δ = 0 the profiles are composition.py's Q/K scores (its d x d Gram route, TransformerLens's QK);
    composition_at (that route with W_Q R(δ)) and pair_profile agree with the profiles at every offset."""
    model = rotary_model(n_layers=3, **CASES["gqa"])
    offsets = list(range(0, 9))
    prof = composition_profiles(model, offsets, n_samples=8)
    ref = composition_scores(model, n_samples=8)
    torch.testing.assert_close(prof.q[..., 0], ref.raw["q"], atol=1e-12, rtol=0)
    torch.testing.assert_close(prof.k[..., 0], ref.raw["k"], atol=1e-12, rtol=0)
    torch.testing.assert_close(prof.v, ref.raw["v"], atol=1e-12, rtol=0)
    for kind in ("q", "k"):
        for delta in (3, 8):
            torch.testing.assert_close(composition_at(model, kind, delta), prof.profile(kind)[..., delta], atol=1e-12, rtol=0)
        p = pair_profile(model, head_name(0, 3), head_name(2, 1), kind, offsets)
        torch.testing.assert_close(p, prof.profile(kind)[0, 3, 2, 1], atol=1e-12, rtol=0)


def test_bad_pairs_and_kinds_are_refused():
    model = rotary_model(n_layers=2)
    with pytest.raises(InvalidInputError, match="earlier layer"):
        pair_profile(model, "L1H0", "L0H1", "k")
    with pytest.raises(InvalidInputError, match="kind"):
        pair_profile(model, "L0H0", "L1H1", "v")
    with pytest.raises(InvalidInputError, match="kind"):
        composition_at(model, "v", 1)


def dense_draw_scores(W_V, W_O, W_Q, W_K):
    """Q and K scores of Gaussian draws from dense d_model x d_model products (the definition)."""
    W_OV = (W_V @ W_O)[:, None]  # [n, 1, d, d]
    Om = W_Q @ W_K[:, None].transpose(-2, -1)  # [n, g, d, d], the group shares W_K
    den = W_OV.norm(dim=(-2, -1)) * Om.norm(dim=(-2, -1))
    return torch.cat([((W_OV @ Om).norm(dim=(-2, -1)) / den).flatten(),
                      ((W_OV @ Om.transpose(-2, -1)).norm(dim=(-2, -1)) / den).flatten()])


def test_baseline_gram_route_and_its_d_head_reduction_vs_dense_norms():
    """On the same Gaussian draws: the dense sampler's Gram formulas, and the reduction the fast sampler draws from
    (F = T_V T_O^T, Z = Q_O^T W_Q, W_Q^T W_Q), reproduce the dense norms."""
    d, dh, g, n = 12, 4, 3, 32
    scores = dense_baseline_scores(d, dh, g, n, seed=5)
    gen = torch.Generator().manual_seed(5)
    W_V, W_K = torch.randn(2, n, d, dh, generator=gen, dtype=torch.float64)
    W_O = torch.randn(n, dh, d, generator=gen, dtype=torch.float64)
    W_Q = torch.randn(n, g, d, dh, generator=gen, dtype=torch.float64)
    dense = dense_draw_scores(W_V, W_O, W_Q, W_K)
    torch.testing.assert_close(scores, dense, rtol=0, atol=1e-12)
    T_V = torch.linalg.qr(W_V)[1]
    Q_O, T_O = torch.linalg.qr(W_O.transpose(-2, -1))  # [n, d, dh], [n, dh, dh]
    F = T_V @ T_O.transpose(-2, -1)  # [n, dh, dh]
    Z_Q, Z_K = Q_O.transpose(-2, -1)[:, None] @ W_Q, Q_O.transpose(-2, -1) @ W_K
    reduced = _pair_scores(F[:, None] @ Z_Q, W_Q.transpose(-2, -1) @ W_Q, (F @ Z_K)[:, None],
                           (W_K.transpose(-2, -1) @ W_K)[:, None], F.pow(2).sum((-2, -1))[:, None])
    torch.testing.assert_close(reduced, dense, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(24, 6, 2), (20, 4, 1)])
def test_reduced_baseline_sampler_has_the_dense_distribution(shape):
    """random_baseline (d_head x d_head Bartlett draws) vs dense Gaussian factors: means and stds agree within
    sampling error (standard errors from 12 independent replicates of each)."""
    d, dh, g = shape
    fast = torch.tensor([random_baseline(d, dh, g, n_samples=100, seed=s) for s in range(12)])  # [12, 2]
    dense = torch.stack([torch.stack([x.mean(), x.std()]) for x in
                         (dense_baseline_scores(d, dh, g, 100, seed=100 + s) for s in range(12))])
    diff = fast.mean(0) - dense.mean(0)
    se = (fast.var(0) / 12 + dense.var(0) / 12).sqrt()
    assert (diff.abs() < 4 * se).all(), (diff, se)
    assert random_baseline(d, dh, g, n_samples=100, seed=3) == random_baseline(d, dh, g, n_samples=100, seed=3)
    assert random_baseline(d, 2 * d, g, n_samples=4)[0] == float(dense_baseline_scores(d, 2 * d, g, 4).mean())


def test_random_baseline_does_not_depend_on_the_offset():
    big = 320
    m0, s0 = random_baseline(32, 8, 3, n_samples=big, seed=1)
    m1, s1 = random_baseline(32, 8, 3, n_samples=big, seed=2, offset_angle=1.3)
    assert abs(m0 - m1) < 4 * (s0**2 / big + s1**2 / big) ** 0.5
