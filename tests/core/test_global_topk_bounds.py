"""The search of global_topk_bounds returns the dense product's top k.

Each case is checked against torch's topk of the dense A @ B, on matrices shaped like circuits (a decaying spectrum,
a few large-norm rows and columns) and on unstructured ones; the search's size thresholds, seed and blocks are made
small so that small matrices take it and its staircase has many steps. Its bound p_i q_j is checked against every
entry of the dense product, also with a basis that is not the singular one (M N != I, ill-conditioned): the margins,
not the basis, make it exact."""

from __future__ import annotations

import pytest
import torch

from circuits_core.circuits import global_topk, global_topk_bounds
from circuits_core.circuits.factored import FactoredMatrix
from tests.core.bounded_search_setup import poor_basis, shrink_search
from tests.held_bytes import HeldBytes


@pytest.fixture(autouse=True)
def small_search(monkeypatch):
    shrink_search(monkeypatch)


def circuit_like(ldim, mdim, rdim, seed, dtype=torch.float64):
    """Factors whose product has a decaying spectrum, with a few large-norm rows and columns."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, -2, mdim, dtype=dtype)
    A = torch.randn(ldim, mdim, generator=gen, dtype=dtype) * scale
    B = torch.randn(mdim, rdim, generator=gen, dtype=dtype) * scale[:, None]
    A[:5] *= 4
    B[:, -3:] *= 3
    return A, B


def dense_topk(M, k):
    v, i = M.flatten().topk(k)
    return v, i // M.shape[1], i % M.shape[1]


def exact_entries(monkeypatch):
    """Counts the entries the search multiplies out exactly (products of A's rows with B's columns, by `@` or
    torch.matmul)."""
    counted = []
    real_matmul, real_torch_matmul = torch.Tensor.__matmul__, torch.matmul

    def exact(x, y, out):
        if x.shape[-1] == y.shape[0] == 24 and x.shape[0] != 24 and y.shape[-1] != 24:
            counted.append(out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda x, y: exact(x, y, real_matmul(x, y)))
    monkeypatch.setattr(torch, "matmul", lambda x, y, **kw: exact(x, y, real_torch_matmul(x, y, **kw)))
    return counted


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [1, 10, 300])
@pytest.mark.parametrize("columns_contiguous", [False, True])
def test_bounded_search_matches_the_dense_topk(seed, dtype, k, columns_contiguous):
    """B stored by rows or by columns (as the circuits' B = key^T and the OV circuit's B are): the same answer."""
    A, B = circuit_like(300, 24, 260, seed, dtype)
    if columns_contiguous:
        B = B.T.contiguous().T
    assert global_topk_bounds.usable(A, B)
    v, r, c = global_topk_bounds.topk_bounded(A, B, k)
    ref_v, ref_r, ref_c = dense_topk(A @ B, k)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(v, ref_v, rtol=tol, atol=tol)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)  # random data: no ties


def test_unstructured_factors_and_non_multiple_sizes():
    gen = torch.Generator().manual_seed(5)
    A, B = (
        torch.randn(131, 21, generator=gen, dtype=torch.float64),
        torch.randn(21, 77, generator=gen, dtype=torch.float64),
    )
    v, r, c = global_topk_bounds.topk_bounded(A, B, 40)
    ref_v, ref_r, ref_c = dense_topk(A @ B, 40)
    torch.testing.assert_close(v, ref_v, rtol=1e-12, atol=1e-12)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)


@pytest.mark.parametrize("k", [64 * 80, 64 * 80 - 7, 700])
def test_every_entry_or_most_of_them(k):
    """k up to every entry: the seed grows past SEED x SEED to hold k, the k-th value falls below 0 where the norm
    bounds prune nothing, and the staircase covers the whole matrix once (no entry twice)."""
    gen = torch.Generator().manual_seed(6)
    A, B = (
        torch.randn(64, 24, generator=gen, dtype=torch.float64),
        torch.randn(24, 80, generator=gen, dtype=torch.float64),
    )
    v, r, c = global_topk_bounds.topk_bounded(A, B, k)
    ref_v, ref_r, ref_c = dense_topk(A @ B, k)
    torch.testing.assert_close(v, ref_v, rtol=1e-12, atol=1e-12)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)


def test_where_nothing_prunes_each_entry_is_multiplied_once_in_chunks(monkeypatch):
    """Unstructured factors and k large enough that no bound prunes: the staircase multiplies every entry once (the
    seed's twice), in products of at most CHUNK_ENTRIES entries and COLS columns, so each is read back from cache.
    One product of a whole row block across every column (85 x 49,152 on the rotary benchmark's circuit) made that
    search 2.7x slower."""
    gen = torch.Generator().manual_seed(14)
    A, B = (
        torch.randn(150, 24, generator=gen, dtype=torch.float64),
        torch.randn(24, 130, generator=gen, dtype=torch.float64),
    )
    with monkeypatch.context() as patch:
        exact = exact_entries(patch)
        cols = []
        counting = torch.matmul  # exact_entries' counter
        patch.setattr(torch, "matmul", lambda x, y, **kw: cols.append(y.shape[-1]) or counting(x, y, **kw))
        v, r, c = global_topk_bounds.topk_bounded(A, B, 2000)
    seed = exact[0]  # the seed block (16 x 130 entries to hold k), by `@`
    assert seed == 16 * 130 and sum(exact) == 150 * 130 + seed
    chunk_cols = [n for n in cols if n != 24]  # (the changes of basis are [n, 24] @ [24, 24])
    assert len(chunk_cols) == len(exact) - 1 > 150 * 130 / global_topk_bounds.CHUNK_ENTRIES
    assert max(exact[1:]) <= global_topk_bounds.CHUNK_ENTRIES and max(chunk_cols) <= global_topk_bounds.COLS
    ref_v, ref_r, ref_c = dense_topk(A @ B, 2000)
    torch.testing.assert_close(v, ref_v, rtol=1e-12, atol=1e-12)
    assert torch.equal(r * 130 + c, ref_r * 130 + ref_c)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("noise", [0.0, 1e-3])
@pytest.mark.parametrize("columns_contiguous", [False, True])
def test_the_bound_holds_for_every_entry(monkeypatch, dtype, noise, columns_contiguous):
    """p_i q_j >= the dense entry for all pairs, in the balanced basis and in a poor one, with B stored by rows or by
    columns (its bounds then come from the rows of B^T); and it is tight enough to prune: in the balanced basis most
    pairs are bounded below the 10th value."""
    A, B = circuit_like(300, 24, 260, 8, dtype)
    if columns_contiguous:
        B = B.T.contiguous().T
    dense = A @ B
    p, q, _, _ = global_topk_bounds._bound_factors(A, B, None)
    bound = p[:, None] * q[None]  # [l, r] float64
    assert bool((bound >= dense.double()).all())
    if noise == 0.0:
        tenth = float(dense.flatten().topk(10).values[-1])
        assert float((bound >= tenth).double().mean()) < 0.1
    poor_basis(monkeypatch, 24, noise, decades=2)
    p, q, _, _ = global_topk_bounds._bound_factors(A, B, None)
    assert bool((p[:, None] * q[None] >= dense.double()).all())


def test_the_margin_for_an_inexact_inverse(monkeypatch):
    """N = (1 - 1e-3) M^-1 and a column planted so that N_true B_0 is parallel to A_0 M: Cauchy-Schwarz is tight
    there, so without the margin on ||M N - I|| the bound would fall short of the entry by a factor 1 - 1e-3."""
    A, B = circuit_like(100, 24, 120, 11)
    gen = torch.Generator().manual_seed(12)
    M = torch.randn(24, 24, generator=gen, dtype=torch.float64) * torch.logspace(0, 1, 24, dtype=torch.float64)
    B[:, 0] = M @ (M.T @ A[0])  # A_0 . B_0 = ||A_0 M||^2
    monkeypatch.setattr(global_topk_bounds, "balanced_basis", lambda A, B: (M, (1 - 1e-3) * torch.linalg.inv(M)))
    p, q, _, _ = global_topk_bounds._bound_factors(A, B, None)
    assert float(p[0] * q[0]) >= float(A[0] @ B[:, 0])
    v, r, c = global_topk_bounds.topk_bounded(A, B, 5)
    ref_v, ref_r, ref_c = dense_topk(A @ B, 5)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)


def test_norms_in_the_basis_bound_the_exact_ones():
    """Rows x nearly in the direction that an ill-conditioned T shrinks: fl(x T) loses most of its digits, and the
    bound on ||x T|| still covers the exact float64 norm (the rounding term gamma ||x|| || |T| ||_2)."""
    gen = torch.Generator().manual_seed(13)
    Q1, _ = torch.linalg.qr(torch.randn(24, 24, generator=gen, dtype=torch.float64))
    Q2, _ = torch.linalg.qr(torch.randn(24, 24, generator=gen, dtype=torch.float64))
    T = (Q1 * torch.logspace(0, -5, 24, dtype=torch.float64)) @ Q2.T  # [24, 24], condition 1e5
    X = Q1[:, -1] + 1e-6 * torch.randn(500, 24, generator=gen, dtype=torch.float64)  # [500, 24]
    X32, T32 = X.float(), T.float()
    exact = torch.linalg.vector_norm(X32.double() @ T32.double(), dim=1)
    gamma = global_topk_bounds.rounding(24, torch.float32)
    abs_T = float(torch.linalg.matrix_norm(T32.double().abs(), 2))
    rot, norm = global_topk_bounds._norm_bounds(X32, T32, abs_T, gamma, None)
    assert bool((rot >= exact).all())
    assert bool((norm >= torch.linalg.vector_norm(X32.double(), dim=1)).all())
    assert float((torch.linalg.vector_norm(X32 @ T32, dim=1).double() < exact).double().mean()) > 0.1  # it matters


def test_any_invertible_basis_gives_the_same_answer(monkeypatch):
    """A poor basis with N only approximately M^-1: the margin on M N - I keeps the answer exact."""
    A, B = circuit_like(200, 24, 150, 3)
    poor_basis(monkeypatch, 24, 1e-4, decades=2)
    v, r, c = global_topk_bounds.topk_bounded(A, B, 25)
    ref_v, ref_r, ref_c = dense_topk(A @ B, 25)
    torch.testing.assert_close(v, ref_v, rtol=1e-12, atol=1e-12)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)


def test_the_search_prunes_and_serves_topk_global(monkeypatch):
    """On circuit-like factors fewer entries are computed exactly than the matrix holds, and FactoredMatrix.topk_global
    (largest and smallest, a batch) takes this search and matches dense."""
    A, B = circuit_like(400, 24, 400, 7)
    with monkeypatch.context() as patch:
        exact = exact_entries(patch)
        v, r, c = global_topk_bounds.topk_bounded(A, B, 10)
    assert 0 < sum(exact) < 400 * 400 / 4
    ref_v, ref_r, ref_c = dense_topk(A @ B, 10)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)
    called = []
    real_search = global_topk_bounds.topk_bounded
    monkeypatch.setattr(global_topk_bounds, "topk_bounded", lambda *a, **kw: called.append(1) or real_search(*a, **kw))
    As = torch.stack([A, A.flip(0)])
    fm = FactoredMatrix(As, B)
    for largest in (True, False):
        v, r, c = fm.topk_global(12, largest=largest)
        for i in range(2):
            M = As[i] @ B
            ref = (M if largest else -M).flatten().topk(12)
            torch.testing.assert_close(v[i], ref.values if largest else -ref.values, rtol=1e-12, atol=1e-12)
            assert torch.equal(r[i] * 400 + c[i], ref.indices)
    assert len(called) == 4
    assert global_topk.topk_global_flops(400, 24, 400) >= global_topk_bounds.bounded_flops(400, 24, 400)


def test_overflowing_bounds_fall_back_to_the_tiles():
    """Factors whose norms overflow float32 (the entries do not): no bound, and topk_global still matches dense."""
    A, B = circuit_like(300, 24, 260, 9, torch.float32)
    A[7] = 1e37  # ||A_7||^2 overflows, its sum does not, nor its entries (about 1e37 times B's)
    B = B / B.abs().max() * 0.5
    assert global_topk_bounds.usable(A, B) and global_topk_bounds.topk_bounded(A, B, 5) is None
    v, r, c = FactoredMatrix(A, B).topk_global(5)
    ref_v, ref_r, ref_c = dense_topk(A @ B, 5)
    torch.testing.assert_close(v, ref_v)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)


def unbalanced_circuit(seed):
    """Circuit-like factors with their inner dimensions scaled by 10^-1.5..10^1.5 in A and by the inverse in B (the
    product unchanged): every row and column norm is large, so the norm bound prunes almost nothing, while the
    balanced basis undoes the scaling and its staircase prunes as on the circuit itself."""
    A, B = circuit_like(400, 24, 400, seed)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(3))
    d = torch.logspace(-1.5, 1.5, 24, dtype=torch.float64)[order]  # [m]
    return A * d, B / d[:, None]


@pytest.mark.parametrize("screened", [True, False])
def test_topk_global_takes_the_search_estimated_to_cost_less(monkeypatch, screened):
    """With the seed's k-th value, FactoredMatrix.topk_global counts the entries each bound cannot rule out: on the
    unbalanced circuit the staircase runs (about 1 % of the entries against nearly all for the norms); on random
    factors both counts are all entries, so the staircase runs only where its entries cost less than the tiles' (not
    under the bfloat16 screen). Either way the answer is the dense float64 one."""
    monkeypatch.setattr(global_topk, "SCREEN_MIN_ENTRIES", 1000)
    monkeypatch.setattr(global_topk, "half_products_fast", lambda device, dtype: screened)
    ran = []
    real_staircase = global_topk_bounds.staircase
    monkeypatch.setattr(global_topk_bounds, "staircase", lambda *a, **kw: ran.append(1) or real_staircase(*a, **kw))
    gen = torch.Generator().manual_seed(5)
    random = (
        torch.randn(400, 24, generator=gen, dtype=torch.float64),
        torch.randn(24, 400, generator=gen, dtype=torch.float64),
    )
    for (A, B), staircase in ((unbalanced_circuit(7), True), (random, not screened)):
        v, r, c = FactoredMatrix(A, B).topk_global(10)
        ref_v, ref_r, ref_c = dense_topk(A @ B, 10)
        torch.testing.assert_close(v, ref_v, rtol=0, atol=1e-12)
        assert torch.equal(r, ref_r) and torch.equal(c, ref_c)
        assert ran == ([1] if staircase else [])
        ran.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_price_covers_the_held_peak(dtype):
    """The search's own peak bytes (bounded_peak_bytes, its seed and candidates) cover what it holds (torch's own
    allocations, measured), and topk_global_cost's peak covers them."""
    A, B = circuit_like(600, 24, 500, 10, dtype)
    fm = FactoredMatrix(A, B)
    with torch.no_grad(), HeldBytes([A, B]) as held:
        fm.topk_global(30)
    size = A.element_size()
    seed = 30 * (size + 16) + global_topk_bounds.SEED * 30 * size  # the seed block and the candidates
    bounded = global_topk_bounds.bounded_peak_bytes(600, 24, 500, size) + 2 * seed
    assert held.peak <= bounded <= fm.topk_global_cost(30).peak_bytes


SCREEN = (torch.bfloat16, global_topk.SCREEN_MARGIN)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [1, 10, 300])
def test_the_bfloat16_screened_search_matches_the_dense_topk(seed, dtype, k):
    """The staircase's products in bfloat16 (where the device multiplies them fast), the entries within the screen's
    margin of the k-th value recomputed exactly: the dense product's top k."""
    A, B = circuit_like(300, 24, 260, seed, dtype)
    v, r, c = global_topk_bounds.topk_bounded(A, B, k, screen=SCREEN)
    ref_v, ref_r, ref_c = dense_topk(A @ B, k)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(v, ref_v, rtol=tol, atol=tol)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)


def near_ties():
    """Float64 entries all within ~1e-4 of each other (rank-one factors plus small noise), far inside bfloat16's
    rounding (2^-9 relative): the screen's approximations cannot order them, so its margin decides what is recomputed.
    """
    gen = torch.Generator().manual_seed(9)
    dtype = torch.float64
    a, b = torch.rand(24, generator=gen, dtype=dtype) + 0.5, torch.rand(24, generator=gen, dtype=dtype) + 0.5
    A = a + 1e-4 * torch.randn(200, 24, generator=gen, dtype=dtype)  # [200, 24]
    B = b[:, None] + 1e-4 * torch.randn(24, 180, generator=gen, dtype=dtype)  # [24, 180]
    return A, B


def test_the_screen_keeps_near_ties():
    A, B = near_ties()
    ref_v, ref_r, ref_c = dense_topk(A @ B, 25)
    v, r, c = global_topk_bounds.topk_bounded(A, B, 25, screen=SCREEN)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)
    torch.testing.assert_close(v, ref_v, rtol=0, atol=1e-12)  # the exact entries, not their bfloat16 screen


def test_the_global_topk_screens_the_bounded_search_where_bfloat16_is_fast(monkeypatch):
    """FactoredMatrix.topk_global hands the screen to the bounded search when the device's probe says bfloat16 is fast
    (and the matrix is large enough to screen), and not otherwise; the answer is the dense one either way."""
    monkeypatch.setattr(global_topk, "SCREEN_MIN_ENTRIES", 1000)
    seen = []
    bounded = global_topk_bounds.topk_bounded
    monkeypatch.setattr(
        global_topk_bounds,
        "topk_bounded",
        lambda *a, **kw: seen.append(a[4] if len(a) > 4 else None) or bounded(*a, **kw),
    )
    A, B = near_ties()
    ref_v, ref_r, ref_c = dense_topk(A @ B, 25)
    for fast in (True, False):
        monkeypatch.setattr(global_topk, "half_products_fast", lambda device, dtype, fast=fast: fast)
        v, r, c = FactoredMatrix(A, B).topk_global(25)
        assert torch.equal(r, ref_r) and torch.equal(c, ref_c)
        torch.testing.assert_close(v, ref_v, rtol=0, atol=1e-12)
        assert seen.pop() == (SCREEN if fast else None)
