"""Composition profiles over δ (circuits_core/circuits/composition_rotary.py) against dense brute force in float64."""

import pytest
import torch
from rotary_models import CASES, rotary_model

from circuits_core.circuits import composition, gram_pair_sums
from circuits_core.circuits.composition import composition_scores
from circuits_core.circuits.composition_rotary import (
    composition_at,
    composition_at_cost,
    composition_profiles,
    pair_profile,
    profiles_cost,
)
from circuits_core.circuits.rotary import rotation
from circuits_core.circuits.rotary_baseline import _pair_scores, baseline_cost, dense_baseline_scores, random_baseline
from circuits_core.circuits.rotated_grams import pair_order, rotated_tables, swap_signs, term_weights
from circuits_core.errors import InvalidInputError
from circuits_core.model.head_names import head_name
from circuits_core.model.transformer import Transformer
from circuits_core.schedule import available_cores
from tests.held_bytes import HeldBytes


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


@pytest.mark.parametrize("threads", [1, 2], ids=["side-by-side", "one-after-the-other"])
@pytest.mark.parametrize(
    "case",
    [
        dict(n_key_value_heads=2, rotary_adjacent_pairs=True),
        dict(
            n_key_value_heads=1, d_head=5, rotary_dim=4, rope_type="linear", rope_factor=2.0
        ),  # odd d_head: unequal halves
    ],
    ids=["gqa-adjacent", "odd-d_head-partial-gqa"],
)
def test_profiles_in_source_chunks_and_two_workers_match_dense(case, threads):
    """The target layers split between two workers (side by side at 1 torch thread on >= 2 cores, in turn at 2) and
    the sources in chunks of 1, 3 and all heads (the chunk boundaries fall inside layers) give the dense scores."""
    model = rotary_model(n_layers=4, **case)
    offsets = [0, 1, 4, 9, 30]
    L, H = 4, model.cfg.n_heads
    dense = torch.zeros(3, L, H, L, H, len(offsets), dtype=torch.float64)
    for l1 in range(L):
        for l2 in range(l1 + 1, L):
            for h1 in range(H):
                for h2 in range(H):
                    for n, delta in enumerate(offsets):
                        dense[:, l1, h1, l2, h2, n] = torch.stack(dense_scores(model, l1, h1, l2, h2, delta))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for chunk in (1, 3, L * H):
            prof = composition_profiles(model, offsets, n_samples=4, source_chunk=chunk)
            torch.testing.assert_close(prof.q, dense[0], atol=1e-12, rtol=0)
            torch.testing.assert_close(prof.k, dense[1], atol=1e-12, rtol=0)
            torch.testing.assert_close(prof.v, dense[2, ..., 0], atol=1e-12, rtol=0)
    finally:
        torch.set_num_threads(before)
    assert random_baseline(model.cfg.d_model, model.cfg.d_head, model.cfg.group_size, n_samples=4) == (
        prof.baseline,
        prof.baseline_std,
    )


@pytest.mark.parametrize(("case", "chunk", "n_samples"), [("gqa", 5, 50), ("half", 100, 20), ("odd", 3, 40)])
def test_profiles_price_covers_the_held_peak(case, chunk, n_samples):
    """profiles_cost is never below the peak of the tensors composition_profiles holds (counted op by op; the
    tasks run in this thread, one after the other, so the dispatch mode sees them all), within 3x of it although
    it prices two workers and every task at once; the baseline's own price covers both of its sampling routes."""
    overrides = dict(d_head=5, rotary_dim=4, n_key_value_heads=2) if case == "odd" else CASES[case]
    model = rotary_model(n_layers=4, **overrides)
    offsets = list(range(0, 24, 2))
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, available_cores()))  # 2 x threads > cores: side_by_side runs its branches in turn
    try:
        random_baseline.cache_clear()
        with torch.no_grad(), HeldBytes(list(model.parameters())) as held:
            composition_profiles(model, offsets, n_samples=n_samples, source_chunk=chunk)
    finally:
        torch.set_num_threads(before)
    priced = profiles_cost(model, len(offsets), chunk, n_samples).peak_bytes
    assert 0 < held.peak <= priced < 3 * held.peak, (held.peak, priced)
    for d_model in (2 * 6, 2 * 6 - 1):  # the reduced route (d_model >= 2 d_head) and the dense one
        random_baseline.cache_clear()
        with HeldBytes([]) as held:
            random_baseline(d_model, 6, 3, n_samples=n_samples)
        assert 0 < held.peak <= baseline_cost(d_model, 6, 3, n_samples).peak_bytes < 3 * held.peak, (d_model, held.peak)


def test_rotated_gram_tables_are_the_dense_rotations():
    """rotated_tables' four-term form, unpacked, is R(δ)^T G R(δ) and R(δ) G R(δ)^T with R(δ) from rope.py's
    rotation (both layouts, partial rotary), on a non-symmetric G so that every term's orientation is checked."""
    for case in ("half", "adjacent", "partial"):
        model = rotary_model(**CASES[case])
        dh, offsets = model.cfg.d_head, [0, 1, 3, 17]
        order = pair_order(model)
        R = rotation(model, offsets)[:, order][:, :, order]  # [n, dh, dh] in the pair order
        G = torch.randn(3, dh, dh, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        weights = term_weights(model, torch.tensor(offsets), torch.float64)
        for turn, want in (
            (1, R.transpose(-2, -1)[None] @ G[:, None] @ R[None]),
            (-1, R[None] @ G[:, None] @ R.transpose(-2, -1)[None]),
        ):  # [3, n, dh, dh]
            first, last = rotated_tables(G, weights, swap_signs(model, torch.float64), turn)  # [3, E, n]
            h = dh // 2
            doubled = torch.ones(h, dh, dtype=torch.float64)
            doubled[:, h:] = 2
            torch.testing.assert_close(
                first, (want[:, :, :h] * doubled).flatten(-2).transpose(1, 2), atol=1e-13, rtol=0
            )
            torch.testing.assert_close(last, want[:, :, h:, h:].flatten(-2).transpose(1, 2), atol=1e-13, rtol=0)


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
            torch.testing.assert_close(
                composition_at(model, kind, delta), prof.profile(kind)[..., delta], atol=1e-12, rtol=0
            )
        p = pair_profile(model, head_name(0, 3), head_name(2, 1), kind, offsets)
        torch.testing.assert_close(p, prof.profile(kind)[0, 3, 2, 1], atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", ["q", "k"])
def test_composition_at_in_budgeted_chunks_prices_its_held_peak(kind):
    """composition_at in the chunks a budget picks (1 and 2 target layers per chunk, all at once without one) gives
    the profiles' scores at that offset, holds no more than composition_at_cost and within 2x of it."""
    model = rotary_model(n_layers=5, **CASES["gqa-adjacent-partial-linear"])
    want = composition_profiles(model, [6], n_samples=4).profile(kind)[..., 0]
    kinds = (kind,)
    shape = (5, model.cfg.n_heads, model.cfg.group_size, model.cfg.d_model, model.cfg.d_head)
    for chunk in (1, 2, None):
        budget = None if chunk is None else composition._priced(model, kinds, chunk).peak_bytes
        if not composition.grouped_route(shape, kinds, gram_pair_sums.GRAM_BLOCK):  # (the grouped route has no chunks)
            assert composition.layers_per_chunk(model, kinds, budget) == chunk
        with torch.no_grad(), HeldBytes(list(model.parameters())) as held:
            got = composition_at(model, kind, 6, budget_bytes=budget)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
        priced = composition_at_cost(model, kind, budget).peak_bytes
        assert 0 < held.peak <= priced < 2 * held.peak, (chunk, held.peak, priced)


def test_composition_at_on_the_one_billion_shape_fits_the_default_budget():
    """Q- and K-composition at an offset on the Llama-3.2-1B shape (16 layers, 32 heads, 8
    key/value heads, rotary) priced within Limits().peak_bytes, on a model built without memory."""
    from app.settings import Limits
    from bench.modern import LLAMA_1B
    from circuits_core.formats.llama import llama_config

    with torch.device("meta"):
        model = Transformer(llama_config(LLAMA_1B))
    budget = Limits().peak_bytes
    for kind in ("q", "k"):
        assert composition_at_cost(model, kind, budget).peak_bytes <= budget


def test_one_layer_model_has_no_pairs():
    prof = composition_profiles(rotary_model(n_layers=1), [0, 2], n_samples=4)
    assert prof.q.shape == (1, 4, 1, 4, 2) and not prof.q.any() and not prof.k.any() and not prof.v.any()


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
    return torch.cat(
        [
            ((W_OV @ Om).norm(dim=(-2, -1)) / den).flatten(),
            ((W_OV @ Om.transpose(-2, -1)).norm(dim=(-2, -1)) / den).flatten(),
        ]
    )


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
    reduced = _pair_scores(
        F[:, None] @ Z_Q,
        W_Q.transpose(-2, -1) @ W_Q,
        (F @ Z_K)[:, None],
        (W_K.transpose(-2, -1) @ W_K)[:, None],
        F.pow(2).sum((-2, -1))[:, None],
    )
    torch.testing.assert_close(reduced, dense, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(24, 6, 2), (20, 4, 1)])
def test_reduced_baseline_sampler_has_the_dense_distribution(shape):
    """random_baseline (d_head x d_head Bartlett draws) vs dense Gaussian factors: means and stds agree within
    sampling error (standard errors from 12 independent replicates of each)."""
    d, dh, g = shape
    fast = torch.tensor([random_baseline(d, dh, g, n_samples=100, seed=s) for s in range(12)])  # [12, 2]
    dense = torch.stack(
        [
            torch.stack([x.mean(), x.std()])
            for x in (dense_baseline_scores(d, dh, g, 100, seed=100 + s) for s in range(12))
        ]
    )
    diff = fast.mean(0) - dense.mean(0)
    se = (fast.var(0) / 12 + dense.var(0) / 12).sqrt()
    assert (diff.abs() < 4 * se).all(), (diff, se)
    first = random_baseline(d, dh, g, n_samples=100, seed=3)
    random_baseline.cache_clear()  # drawn again, not the cached tuple: a seed fixes the draws
    assert random_baseline(d, dh, g, n_samples=100, seed=3) == first != random_baseline(d, dh, g, n_samples=100, seed=4)
    assert random_baseline(d, 2 * d, g, n_samples=4)[0] == float(dense_baseline_scores(d, 2 * d, g, 4).mean())


def test_random_baseline_does_not_depend_on_the_offset():
    big = 320
    m0, s0 = random_baseline(32, 8, 3, n_samples=big, seed=1)
    m1, s1 = random_baseline(32, 8, 3, n_samples=big, seed=2, offset_angle=1.3)
    assert abs(m0 - m1) < 4 * (s0**2 / big + s1**2 / big) ** 0.5
