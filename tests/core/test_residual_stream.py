"""Residual-stream usage (float64): spectra vs dense SVDs, overlaps vs principal angles and sampled random
subspaces, the blocked all-pairs overlaps vs a per-pair loop, planted erasure found, none in random models."""

import math

import pytest
import torch

from circuits_core.circuits import erasure as stream_erasure
from circuits_core.circuits import residual_stream as rs
from circuits_core.circuits import stream_components as sc
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import random_model
from tests.core.rotary_models import rotary_model
from tests.core.test_virtual_weights import dense_reader, dense_writer


def _model(seed=0, **kw):
    fields = dict(
        n_layers=2,
        d_model=16,
        n_heads=2,
        d_head=4,
        d_vocab=30,
        n_ctx=10,
        attn_only=False,
        d_mlp=24,
        act_fn="gelu",
        normalization_type="LN",
        positional_embedding_type="standard",
    )
    fields.update(kw)
    return random_model(ModelConfig(**fields), seed=seed, dtype=torch.float64, std_embed=0.5)


def _orthonormal(d, k, seed):
    return torch.linalg.qr(torch.randn(d, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))[0]


def test_overlap_is_one_for_identical_and_nested_and_zero_for_orthogonal_subspaces():
    Q = _orthonormal(12, 12, 0)
    A, B = Q[:, :4], Q[:, 4:9]
    assert rs.overlap(A, A) == pytest.approx(1.0)
    assert rs.overlap(A @ _orthonormal(4, 4, 1), A) == pytest.approx(1.0)  # another basis of the same subspace
    assert rs.overlap(Q[:, :2], Q[:, :6]) == pytest.approx(1.0)  # nested
    assert rs.overlap(A, B) == pytest.approx(0.0, abs=1e-15)
    # mean squared cosine of the principal angles, from the angles themselves
    C = _orthonormal(12, 3, 2)
    cosines = torch.linalg.svdvals(A.T @ C)
    assert rs.overlap(A, C) == pytest.approx(float(cosines.pow(2).mean()), rel=1e-12)


@pytest.mark.parametrize("k1,k2,d", [(2, 5, 16), (8, 8, 16), (1, 30, 64)])
def test_random_subspaces_overlap_max_k_over_d_on_average(k1, k2, d):
    """The chance level stream_usage subtracts, E[overlap] = max(k1, k2) / d, against sampled random subspaces."""
    n = 600
    gen = torch.Generator().manual_seed(k1 + k2 + d)
    U1 = torch.linalg.qr(torch.randn(n, d, k1, generator=gen, dtype=torch.float64))[0]
    U2 = torch.linalg.qr(torch.randn(n, d, k2, generator=gen, dtype=torch.float64))[0]
    samples = torch.tensor([rs.overlap(a, b) for a, b in zip(U1, U2, strict=True)])
    se = samples.std().item() / math.sqrt(n)
    assert samples.mean().item() == pytest.approx(max(k1, k2) / d, abs=4 * se)


def test_effective_rank_is_the_participation_ratio():
    assert rs.Spectrum(torch.ones(5, dtype=torch.float64), torch.eye(5)).effective_rank() == pytest.approx(5)
    assert rs.Spectrum(torch.tensor([1.0, 0, 0]), torch.eye(3)).effective_rank() == pytest.approx(1)
    S = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    assert rs.Spectrum(S, torch.eye(3)).effective_rank() == pytest.approx(14**2 / 98)


@pytest.mark.parametrize(
    "make, offset",
    [(_model, 0), (lambda: rotary_model(n_key_value_heads=2), 0), (lambda: rotary_model(n_key_value_heads=2), 3)],
)
def test_spectra_are_the_dense_singular_values_and_stream_sides(make, offset):
    """Every side against the dense writer or reader (the key's W_K R^T W_Q^T at a query-key offset too)."""
    model = make()
    w_spec, r_spec = rs.spectra(model, offset)
    for w in sc.writers(model):
        W = dense_writer(model, w)  # [n_in, d]: the stream side is its row space
        S = torch.linalg.svdvals(W)
        got = w_spec[w.name]
        n = min(S.shape[0], got.S.shape[0])
        torch.testing.assert_close(got.S[:n], S[:n], rtol=1e-8, atol=1e-9 * float(S[0]))
        top = got.basis[:, :1]  # the top stream direction is W's top right singular vector
        assert float((W @ top).norm()) == pytest.approx(float(S[0]), rel=1e-8)
    for r in sc.readers(model):
        R = dense_reader(model, r, offset)  # [d, n_out]: the stream side is its column space
        S = torch.linalg.svdvals(R)
        got = r_spec[r.name]
        n = min(S.shape[0], got.S.shape[0])
        torch.testing.assert_close(got.S[:n], S[:n], rtol=1e-8, atol=1e-9 * float(S[0]))
        assert float((got.basis[:, :1].T @ R).norm()) == pytest.approx(float(S[0]), rel=1e-8)


def test_stream_usage_overlaps_equal_the_per_pair_principal_angles():
    model = _model()
    usage = rs.stream_usage(model, energy=0.8)
    w_spec, r_spec = rs.spectra(model)
    subs = {n: s.subspace(0.8) for n, s in {**w_spec, **r_spec}.items()}
    cols = usage.writers + usage.readers
    for i, a in enumerate(usage.writers):
        for j, b in enumerate(cols):
            assert usage.overlap[i, j].item() == pytest.approx(rs.overlap(subs[a], subs[b]), rel=1e-9, abs=1e-12)
            rand = max(subs[a].shape[1], subs[b].shape[1]) / model.cfg.d_model  # the chance level tested above
            assert usage.random_overlap[i, j].item() == pytest.approx(rand)
    assert torch.allclose(
        usage.overlap[:, : len(usage.writers)].diagonal(), torch.ones(len(usage.writers), dtype=torch.float64)
    )
    # the 80 % subspace holds at least 80 % of the energy, one direction fewer holds less
    for name, spec in w_spec.items():
        k, s2 = usage.dims[name], spec.S.pow(2)
        assert s2[:k].sum() >= 0.8 * s2.sum() - 1e-12 and (k == 1 or s2[: k - 1].sum() < 0.8 * s2.sum())


def test_bandwidth_load_counts_writers_sharing_a_direction():
    d = 10
    Q = _orthonormal(d, d, 5)
    bases = [Q[:, :3], Q[:, 1:4], Q[:, 2:3], Q[:, 8:10]]  # direction 2 is shared by three writers
    bw = rs.bandwidth(["a", "b", "c", "e"], bases, d, n_crowded=1, n_writers=3)
    assert bw.total_dims == 9 and bw.uniform_load == pytest.approx(0.9)
    assert bw.load[0] == pytest.approx(3.0) and bw.load[-1] == pytest.approx(0.0, abs=1e-12)
    assert {n for n, _ in bw.crowded[0][1]} == {"a", "b", "c"}
    lam = torch.tensor(bw.load)
    assert bw.used_dims == pytest.approx(float(lam.sum() ** 2 / lam.pow(2).sum()))


def _plant_erasure(model, writer_layer=0, writer_head=0, eraser_layer=1, eraser_head=1, seed=0):
    """L{writer}'s W_O writes only into a subspace S; the eraser's W_OV is -P_S (reads S, writes -S)."""
    d, dh = model.cfg.d_model, model.cfg.d_head
    U = _orthonormal(d, dh, seed)  # S
    with torch.no_grad():
        w = model.blocks[writer_layer].attn
        w.W_O[writer_head] = (
            torch.randn(dh, dh, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) @ U.T
        )
        e = model.blocks[eraser_layer].attn
        e.W_V[eraser_head] = U
        e.W_O[eraser_head] = -U.T
    return model


def test_planted_erasure_is_found():
    model = _plant_erasure(_model(n_layers=3, attn_only=True, d_mlp=None, act_fn=None))
    found = stream_erasure.erasure(model)
    top = found.candidates[0]
    assert (top.writer, top.eraser) == ("L0H0", "L1H1")
    assert top.score == pytest.approx(1.0, abs=1e-9)
    assert all(abs(ev.real + 1) < 1e-9 for ev in top.eigenvalues)  # restricted virtual weight = -I
    assert top.read_share > top.random_share
    # the score table agrees with the definition on a dense restricted virtual weight
    U = rs.spectra(model)[0]["L0H0"].subspace()
    W_OV = dense_writer(model, sc.Writer("head", 1, 1))
    i, j = found.writers.index("L0H0"), found.erasers.index("L1H1")
    dense = -torch.trace(U.T @ W_OV @ U) / (math.sqrt(U.shape[1]) * (U.T @ W_OV).norm())
    assert found.score[i, j].item() == pytest.approx(float(dense), rel=1e-10)
    assert not found.mask[found.writers.index("L1H0"), found.erasers.index("L1H1")]  # same layer: not read
    spectra = rs.spectra(model)[0]
    for i, w in enumerate(found.writers):  # every (writer, later head) entry against the dense definition
        U = spectra[w].subspace()
        for j, h in enumerate(found.erasers):
            if not found.mask[i, j]:
                assert found.score[i, j] == 0
                continue
            W = dense_writer(model, sc.parse_writer(model, h))
            expected = -torch.trace(U.T @ W @ U) / (math.sqrt(U.shape[1]) * (U.T @ W).norm())
            assert found.score[i, j].item() == pytest.approx(float(expected), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_erasure_in_random_models_beyond_the_baseline(seed):
    model = _model(seed=seed, n_layers=3, d_model=32, n_heads=4, d_head=8)
    found = stream_erasure.erasure(model)
    assert found.candidates == []
    z = found.z[found.mask]
    assert z.numel() > 50 and z.abs().max() < found.threshold_z  # random heads sit inside the null's spread


@pytest.mark.parametrize("k", [1, 2, 6, 20])
def test_per_head_null_matches_the_head_on_sampled_random_subspaces(k):
    """erasure_null's analytic moments against 4,000 uniformly random k-dim subspaces (QR of Gaussians), for a
    random head, a head whose W_OV is -P (negative everywhere it reads) and a mixture: the null is the head's own."""
    d, dh, n = 48, 8, 4000
    gen = torch.Generator().manual_seed(3)
    Q = _orthonormal(d, dh, 7)
    noise = torch.randn(dh, d, generator=gen, dtype=torch.float64)
    heads = {
        "gaussian": (torch.randn(d, dh, generator=gen, dtype=torch.float64), noise),
        "negative projector": (Q, -Q.T),
        "mixture": (Q, -Q.T + 0.3 * noise),
    }
    U = torch.linalg.qr(torch.randn(n, d, k, generator=gen, dtype=torch.float64))[0]  # [n, d, k]
    for name, (W_V, W_O) in heads.items():
        M = W_V @ W_O
        s = -torch.einsum("nik,ij,njk->n", U, M, U) / (math.sqrt(k) * (U.transpose(-1, -2) @ M).flatten(1).norm(dim=1))
        mean, std = stream_erasure.erasure_null(stream_erasure.head_moments(W_V[None], W_O[None]), k, d)
        assert float(mean) == pytest.approx(s.mean().item(), abs=4 * s.std().item() / math.sqrt(n)), name
        assert float(std) == pytest.approx(s.std().item(), rel=0.06), name
    # the negative projector sits far above zero on any subspace: a null of random heads would flag it everywhere
    assert float(stream_erasure.erasure_null(stream_erasure.head_moments(Q[None], -Q.T[None]), k, d)[0]) > 0.3


def test_a_head_negative_everywhere_is_not_an_eraser_of_unrelated_writers():
    """A later head with W_OV = -P_S over a subspace S that no writer writes into scores well above 0 on every
    writer's subspace, as on random ones; against its own null none of those pairs is a candidate, while the
    planted writer -> eraser pair still is."""
    model = _plant_erasure(_model(n_layers=3, attn_only=True, d_mlp=None, act_fn=None, d_model=48, d_head=4))
    d, dh = model.cfg.d_model, model.cfg.d_head
    S = _orthonormal(d, 3 * dh, 11)[:, 2 * dh :]  # another subspace than the planted one
    with torch.no_grad():
        model.blocks[2].attn.W_V[0] = S
        model.blocks[2].attn.W_O[0] = -S.T
    found = stream_erasure.erasure(model)
    pairs = {(c.writer, c.eraser) for c in found.candidates}
    assert ("L0H0", "L1H1") in pairs
    j = found.erasers.index("L2H0")
    rows = [i for i, w in enumerate(found.writers) if found.mask[i, j] and w != "L1H1"]
    assert len(rows) >= 3 and all(found.score[i, j] > 0.1 for i in rows)  # it does score high everywhere
    assert all((found.writers[i], "L2H0") not in pairs for i in rows)
    assert all(abs(found.z[i, j]) < found.threshold_z for i in rows)
