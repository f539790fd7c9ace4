"""The global top-k of a factored matrix kept as its products (global_topk_folded) returns the dense product's top k.

Each factor is diag(s) X Y (A = W_E_eff W_V-like, B^T = W_U^T W_O^T-like, X stored by rows or by columns); the
answer is checked against torch's topk of the dense A @ B of the factors formed whole, in float32 and float64, with
the search's size thresholds made small. A basis far from the balanced one (N only approximately M^-1) makes the
folded products differ from the entries by far more than rounding: only the margins keep the answer exact."""

from __future__ import annotations

import pytest
import torch

from circuits_core.circuits import embedding, global_topk, global_topk_bounds, global_topk_folded
from circuits_core.circuits import head_circuits as C
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.folded import head_weights
from circuits_core.circuits.product_factor import ProductFactor
from tests.core.bounded_search_setup import poor_basis, shrink_search
from tests.core.rotary_models import rotary_model


@pytest.fixture(autouse=True)
def small_search(monkeypatch):
    shrink_search(monkeypatch)


def products(seed, dtype=torch.float64, ldim=300, rdim=260, d=40, m=24):
    """left = diag(s) X_A Y_A [ldim, m] and right = X_B Y_B [rdim, m] (B = right^T), X_B and Y_B stored by columns as
    W_U^T and W_O^T are; the product has a decaying spectrum and a few large-norm rows and columns."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, -2, m, dtype=dtype)
    X_A = torch.randn(ldim, d, generator=gen, dtype=dtype)
    X_A[:5] *= 4
    Y_A = torch.randn(d, m, generator=gen, dtype=dtype) * scale
    s = 0.5 + torch.rand(ldim, generator=gen, dtype=dtype)
    X_B = torch.randn(d, rdim, generator=gen, dtype=dtype)  # [d, rdim]: X_B^T stored by rows
    X_B[:, -3:] *= 3
    Y_B = torch.randn(m, d, generator=gen, dtype=dtype) * scale[:, None]
    return ProductFactor(X_A, Y_A, s), ProductFactor(X_B.T, Y_B.T)


def dense_topk(M, k):
    v, i = M.flatten().topk(k)
    return v, i // M.shape[1], i % M.shape[1]


def searched(monkeypatch):
    """Records each call of topk_folded and what it returned (None: the caller formed the factors)."""
    calls = []
    real = global_topk_folded.topk_folded
    monkeypatch.setattr(global_topk_folded, "topk_folded", lambda *a: calls.append(real(*a)) or calls[-1])
    return calls


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rows_are_the_whole_factors_rows_bit_for_bit(dtype):
    """ProductFactor.rows gives the rows of form() exactly, for one row as for many (padded to MIN_ROWS), X stored
    by rows or by columns; form() equals X @ Y scaled, and negated() its negation."""
    left, right = products(0, dtype)
    for f in (left, right):
        whole = f.form()
        for n in (1, 3, 16, 40):
            idx = torch.randperm(f.shape[0], generator=torch.Generator().manual_seed(n))[:n]
            assert torch.equal(f.rows(idx), whole[idx])
        assert torch.equal(f.negated().form(), -whole)
    expected = (left.X.double() @ left.Y.double()) * left.scale.double()[:, None]
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(left.form().double(), expected, rtol=0, atol=tol)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [1, 10, 300])
def test_the_folded_search_matches_the_dense_topk(monkeypatch, seed, dtype, k):
    """FactoredMatrix.of_products takes the folded search (largest and smallest) and returns the dense top k, found
    by that search or, past its budget, on the formed factors."""
    left, right = products(seed, dtype)
    calls = searched(monkeypatch)
    fm = FactoredMatrix.of_products(left, right)
    dense = fm.A @ fm.B  # [300, 260], the factors formed whole
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    for largest in (True, False):
        v, r, c = fm.topk_global(k, largest=largest)
        ref_v, ref_r, ref_c = dense_topk(dense if largest else -dense, k)
        torch.testing.assert_close(v, ref_v if largest else -ref_v, rtol=tol, atol=tol)
        assert torch.equal(r, ref_r) and torch.equal(c, ref_c)  # random data: no ties
    assert len(calls) == 2
    if k <= 10:  # (k = 300 of 78,000 entries: recomputing the entries near the k-th value would cost more than forming)
        assert all(found is not None for found in calls)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_poor_basis_leaves_the_answer_exact(monkeypatch, dtype):
    """With N = M^-1 only to 1e-3 (||M N - I||_2 = 0.23), the folded products A' B' = A M N B miss the entries by far
    more than rounding, and their own top k leaves out entries of the true one: the margins send those to be
    recomputed exactly."""
    left, right = products(3, dtype)
    fm = FactoredMatrix.of_products(left, right)
    dense = fm.A @ fm.B
    poor_basis(monkeypatch, 24, 1e-3, decades=1)
    M, N = global_topk_bounds.balanced_basis(fm.A, fm.B)
    approx = (fm.A @ M) @ (N @ fm.B)
    k = 60
    assert set(dense.flatten().topk(k).indices.tolist()) - set(approx.flatten().topk(k).indices.tolist())
    calls = searched(monkeypatch)
    monkeypatch.setattr(global_topk_folded, "exact_budget", lambda *a: 10**12)  # (many entries are near the k-th)
    v, r, c = fm.topk_global(k)
    ref_v, ref_r, ref_c = dense_topk(dense, k)
    assert calls[0] is not None
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)
    torch.testing.assert_close(v, ref_v, rtol=1e-12 if dtype == torch.float64 else 1e-4, atol=0)


def test_over_its_budget_or_non_finite_the_factors_are_formed(monkeypatch):
    """When the exact recomputations would cost more than forming the factors, or a factor holds a non-finite
    entry, the folded search gives up (None) and topk_global forms A and B and searches them."""
    left, right = products(3)
    calls = searched(monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(global_topk_folded, "exact_budget", lambda *a: 0)
        v, r, c = FactoredMatrix.of_products(left, right).topk_global(5)
    ref_v, ref_r, ref_c = dense_topk(left.form() @ right.form().T, 5)
    assert calls == [None] and torch.equal(r, ref_r) and torch.equal(c, ref_c)
    X = left.X.clone()
    X[7, 3] = float("inf")
    assert global_topk_folded.topk_folded(ProductFactor(X, left.Y, left.scale), right, 5) is None


@pytest.mark.parametrize("norm", ["RMS", "LN"])
def test_full_ov_circuit_keeps_its_factors_as_products_where_they_are_ones(norm):
    """On an RMSNorm model full_ov_circuit(every token) holds W_E_eff W_V and W_U^T W_O^T unformed, and forms them
    bit for bit as the eager formulas do; a LayerNorm's mean makes W_E_eff more than a scaled product: formed."""
    overrides = {} if norm == "RMS" else dict(normalization_type="LN", gated_mlp=False, act_fn="gelu_new")
    model = rotary_model(**overrides)
    fm = C.full_ov_circuit(model, 1, 0)
    _, _, W_V, W_O = head_weights(model, 1, 0)
    assert (fm.products is not None) == (norm == "RMS") == C.ov_unformed(model)
    assert torch.equal(fm.A, embedding.embed_eff_matmul(model, W_V))
    assert torch.equal(fm.B, (model.W_U.T @ W_O.T).T)


def cancelling_factors(seed, cancel, ldim=300, d=40, m=24):
    """Float32 factors (cancelling, other) [ldim, m]. cancelling = X Y, X stored by columns (as W_U^T): its first 100
    rows are two clusters of near-equal rows (1e-3 apart, of opposite sign), each X_i plus `cancel` times its norm
    along a direction n with n Y = 0, so fl(X_i Y) rounds far more than its value and the folded rows fl(X_i fl(Y T))
    miss its rows times T by far more than the product's own rounding. other = diag(s) X Y has one row 10x the
    others: the largest and the smallest entries of the product of the two are in that row (column), with a
    cluster."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, -1, m, dtype=torch.float64)
    X_c, X_o = (torch.randn(ldim, d, generator=gen, dtype=torch.float64) for _ in range(2))
    Y_c, Y_o = (torch.randn(d, m, generator=gen, dtype=torch.float64) * scale for _ in range(2))
    base = 3 * X_c[0]
    noise = 1e-3 * base.norm() / d**0.5
    X_c[:50] = base + noise * torch.randn(50, d, generator=gen, dtype=torch.float64)
    X_c[50:100] = -base + noise * torch.randn(50, d, generator=gen, dtype=torch.float64)
    n = torch.randn(d - m, generator=gen, dtype=torch.float64) @ torch.linalg.svd(Y_c.T).Vh[m:]  # n Y_c = 0
    X_c[:100] += cancel * X_c[:100].norm(dim=1, keepdim=True) * n / n.norm()
    X_o[0] *= 10
    s = 0.5 + torch.rand(ldim, generator=gen, dtype=torch.float64)
    return ProductFactor(X_c.T.float().T, Y_c.float()), ProductFactor(X_o.float(), Y_o.float(), s.float())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cancel", [1e4, 1e5])
@pytest.mark.parametrize("planted", ["left", "right"])
def test_the_rounding_margins_alpha_beta_keep_cancelling_rows_exact(monkeypatch, seed, cancel, planted):
    """With the cancelling factor (cancelling_factors) as A or as B^T, A' B' misses the entries near the k-th by far
    more than the margins other than alpha and beta (the product's rounding, the basis defect: ~1e-5 of an entry)
    and than the gaps between those entries: only alpha and beta (_side: the folded rows' distance to A_i M and
    N B_j) send them to be recomputed. The top 30, largest and smallest, must be those of the float64 product of the
    factors as formed (which the float32 dense product orders alike)."""
    cancelling, other = cancelling_factors(seed, cancel)
    left, right = (cancelling, other) if planted == "left" else (other, cancelling)
    monkeypatch.setattr(global_topk_folded, "exact_budget", lambda *a: 10**12)  # (many entries are near the k-th)
    brute = left.form().double() @ right.form().double().T  # [300, 300]
    dense = (left.form() @ right.form().T).flatten()  # float32, as the answer must rank them
    k = 30
    for largest in (True, False):
        ref = (brute if largest else -brute).flatten().topk(k)
        assert torch.equal((dense if largest else -dense).topk(k).indices.sort().values, ref.indices.sort().values)
        found = global_topk.topk_products(left, right, k, largest)
        assert found is not None
        v, r, c = found
        assert set((r * 300 + c).tolist()) == set(ref.indices.tolist())
        torch.testing.assert_close(v.double(), ref.values if largest else -ref.values, rtol=1e-5, atol=0)
