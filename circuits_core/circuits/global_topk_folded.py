"""The global top-k of A @ B when both factors are themselves unformed products, the balanced basis folded into them.

global_topk_bounds changes both factors to the balanced singular basis, A' = A M and B' = N B, after forming them:
on Gemma-3 270M's full OV circuits that is A = W_E_eff W_V and B = W_O W_U (2 x 86 GFLOP), then A M and N B
(2 x 34 GFLOP). Kept as products (product_factor.ProductFactor), the basis folds into their small factors instead:
A' = W_E_eff (W_V M) and B' = (N W_O) W_U cost what A and B cost, and neither A nor B is formed. A' and B' differ
from A M and N B by rounding only, so they bound and approximate the entries with proven margins: the staircase of
global_topk_bounds multiplies A' B' (the same inner dimension as A B), and only the entries within the margin of the
k-th value are recomputed from rows of A and columns of B formed as the whole factors would hold them. The answer is
the exact top-k of the dense A @ B (docs/maths.md §5.13).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from circuits_core.circuits import global_topk_bounds as bounds
from circuits_core.circuits.product_factor import MIN_ROWS, ProductFactor
from circuits_core.cost import check_stop


def usable(left: ProductFactor, right: ProductFactor) -> bool:
    """Whether A = left [l, m] and B = right^T [m, r] are large enough for the search, their small factors and scales
    finite (the large ones are checked through their row norms), every tensor of one float dtype, and float32 products
    computed in float32 (the margins assume each product rounds in it)."""
    (ldim, mdim), rdim = left.shape, right.shape[0]
    tensors = [t for f in (left, right) for t in (f.X, f.Y, f.scale) if t is not None]
    small = [t for f in (left, right) for t in (f.Y, f.scale) if t is not None]
    dtype = left.X.dtype
    return (
        ldim * rdim >= bounds.MIN_ENTRIES
        and mdim >= bounds.MIN_INNER
        and dtype in (torch.float32, torch.float64)
        and all(t.dtype == dtype for t in tensors)
        and (dtype == torch.float64 or torch.get_float32_matmul_precision() == "highest")
        and all(bool(torch.isfinite(t.sum())) for t in small)
    )


def exact_budget(ldim: int, dl: int, mdim: int, rdim: int, dr: int) -> int:
    """FLOPs topk_folded may spend on exact rows, columns and entries before it gives up (then its caller forms both
    factors and searches them): what forming A and B would cost."""
    return 2 * (ldim * dl + rdim * dr) * mdim


def folded_flops(ldim: int, dl: int, mdim: int, rdim: int, dr: int) -> int:
    """Matrix-product FLOPs of topk_folded on A = [ldim, dl] @ [dl, mdim] and B^T = [rdim, dr] @ [dr, mdim] at most:
    the sampled rows and columns and their Grams, the folds, A' and B', every entry of A' B' (none bounded out) and
    the exact budget spent."""
    rows, cols = min(ldim, bounds.GRAM_ROWS), min(rdim, bounds.GRAM_ROWS)
    samples = 2 * (rows * dl + cols * dr) * mdim + 2 * (rows + cols) * mdim * mdim
    folds = 2 * (dl + dr) * mdim * mdim + 2 * (ldim * dl + rdim * dr) * mdim
    return samples + folds + 2 * ldim * rdim * mdim + exact_budget(ldim, dl, mdim, rdim, dr)


class _OverBudget(Exception):
    """The exact recomputations would cost more than forming the factors."""


def _sigma(P: Tensor) -> float:
    """An upper bound on the spectral norm of P (float64)."""
    return float(torch.linalg.matrix_norm(P, 2)) * (1 + 1e-10)


def _row_norms(X: Tensor) -> Tensor:
    """The row norms [n] (float64) of X [n, d], stored by rows or by columns (W_U^T): a columns' norm is summed row
    by row of X^T (0.06 s on W_U [640, 262,144], where torch's reduction over its leading dimension took 0.9 s)."""
    if X.is_contiguous() or not X.T.is_contiguous():
        return torch.linalg.vector_norm(X, dim=1).double()
    squares = torch.zeros(X.shape[0], dtype=X.dtype, device=X.device)
    for row in X.T:  # [n] each
        squares.addcmul_(row, row)
    return squares.sqrt().double()


def _side(f: ProductFactor, T: Tensor, should_stop: Callable[[], bool] | None) -> tuple[Tensor, Tensor, Tensor, float]:
    """For the factor F = diag(s) X Y [n, m] and T [m, m] (F's dtype): F' = fl(diag(s) X Y') [n, m] with Y' = fl(Y T),
    and float64 bounds [n] on ||F'_i|| (x) and ||F'_i - F_i T|| (alpha), F_i the row of the formed factor, and a bound
    on every ||F_i|| (non-finite where X has a non-finite entry: its norm is then non-finite).

    With g_d the rounding of an inner product of length d (bounds.rounding) and u the unit roundoff, fl(X_i Y) is
    within g_d |X_i| |Y| of X_i Y, so F_i = s_i X_i Y + f with ||f|| <= g1 |s_i| ||X_i|| || |Y| ||_2 (g1 = g_d + u (1 +
    g_d): the scaling's rounding); F'_i is within g_d |s_i| |X_i| |Y'| and a relative u of s_i X_i Y', and
    Y' = Y T + R with R measured in float64 (its own rounding within g64 |Y| |T|). Hence ||F'_i - F_i T|| <=
    |s_i| ||X_i|| kappa + u / (1 - u) ||F'_i||, kappa = ||R||_2 + g64 || |Y| |T| ||_2 + g_d || |Y'| ||_2 +
    g1 || |Y| ||_2 ||T||_2."""
    n, d = f.X.shape
    mdim = f.Y.shape[1]
    g_m, g_d = bounds.rounding(mdim, f.X.dtype), bounds.rounding(d, f.X.dtype)
    u = torch.finfo(f.X.dtype).eps / 2
    g1 = g_d + u * (1 + g_d)
    # [d, m], stored as Y is: a transposed Y (B^T = W_U^T W_O^T) keeps the product's operands as the whole factor's
    Y_T = (T.T @ f.Y.T).T if f.Y.T.is_contiguous() else f.Y @ T
    Yd, Td = f.Y.double(), T.double()
    R = Y_T.double() - Yd @ Td
    s_Y = _sigma(Yd.abs())
    kappa = (  # (the two small terms through the Frobenius norm, >= the spectral one: two SVDs fewer)
        float(R.norm())
        + bounds.rounding(mdim, torch.float64) * float((Yd.abs() @ Td.abs()).norm())
        + g_d * _sigma(Y_T.double().abs())
        + g1 * s_Y * _sigma(Td)
    )
    folded = f.form(Y_T)  # [n, m]
    check_stop(should_stop, "global top-k")
    x = _row_norms(folded) * (1 + 2 * g_m)  # each computed norm is within a factor (1 + gamma) of the norm it rounds
    w = _row_norms(f.X) * (1 + 2 * g_d)
    if f.scale is not None:
        w *= f.scale.double().abs()  # >= |s_i| ||X_i||
    return folded, x, w * kappa + u / (1 - u) * x, float(w.max()) * s_Y * (1 + g1)


def topk_folded(
    left: ProductFactor, right: ProductFactor, k: int, should_stop: Callable[[], bool] | None = None
) -> tuple[Tensor, Tensor, Tensor] | None:
    """The k largest entries of A @ B, A = left [l, m] and B = right^T [m, r] as their form() holds them: (values [k]
    descending, rows [k], columns [k]), or None when a bound is not finite or the entries to recompute exactly would
    cost more than forming A and B (exact_budget): then the caller forms them.

    Bounds: with A'_i, B'_j the folded rows and columns, x, y their norms and alpha, beta their distances to A_i M and
    N B_j (_side), D >= ||M N - I||_2 and g the rounding of a length-m product: A_i . B_j = (A_i M)(N B_j) +
    A_i (I - M N) B_j and the dense product rounds within g ||A_i|| ||B_j||, and ||A_i|| <= ||A_i M|| ||N||_2 / (1 - D)
    (||B_j|| likewise through ||M||_2), so fl(A_i . B_j) <= (1 + eps) (x_i + alpha_i)(y_j + beta_j) with
    eps = (g + D) ||M||_2 ||N||_2 / (1 - D)^2; and fl(A'_i . B'_j) is within
    g x_i y_j + alpha_i y_j + beta_j x_i + alpha_i beta_j + eps (x_i + alpha_i)(y_j + beta_j) of it: the staircase's
    margin on a chunk, where the entries within it of the k-th value are recomputed exactly."""
    (ldim, mdim), rdim = left.shape, right.shape[0]
    sample_r = torch.arange(0, ldim, max(1, ldim // bounds.GRAM_ROWS), device=left.X.device)
    sample_c = torch.arange(0, rdim, max(1, rdim // bounds.GRAM_ROWS), device=right.X.device)
    M, N = bounds.balanced_basis(left.rows(sample_r), right.rows(sample_c).T)  # [m, m] each
    D = bounds.basis_defect(M, N)
    A_f, x, alpha, a_max = _side(left, M, should_stop)  # A_f = A' [l, m]
    Bt_f, y, beta, b_max = _side(right, N.T, should_stop)  # Bt_f = B'^T [r, m]
    g = bounds.rounding(mdim, left.X.dtype)
    u64 = torch.finfo(torch.float64).eps
    if D >= 0.5:
        return None
    # ||A_i|| <= ||A_i M|| ||N||_2 / (1 - D) and ||B_j|| <= ||N B_j|| ||M||_2 / (1 - D): the terms in ||A_i|| ||B_j||
    # are a relative eps of the product of the rotated norms
    eps = (g + D) * _sigma(M.double()) * _sigma(N.double()) / (1 - D) ** 2
    p0, q0 = x + alpha, y + beta
    p, q = p0 * ((1 + eps) * (1 + 16 * u64)), q0 * (1 + 16 * u64)
    big = torch.finfo(left.X.dtype).max  # the formed factors and the products of their rows stay finite below it
    if not (a_max < big and b_max < big and float(p.max()) * float(q.max()) < big):
        return None
    p, row_order = p.sort(descending=True)  # [l]
    q, col_order = q.sort(descending=True)  # [r]
    alpha, beta = alpha[row_order], beta[col_order]

    def margin(i0: int, i1: int, c0: int, c1: int) -> float:
        """Above |fl(A'_i . B'_j) - fl(A_i . B_j)| on rows i0:i1 and columns c0:c1 in bound order."""
        X, Y = float(p[i0]), float(q[c0])  # >= x_i, y_j on the chunk (p_i >= x_i, and p falls in bound order)
        al, be = float(alpha[i0:i1].max()), float(beta[c0:c1].max())
        return ((g + eps) * X * Y + al * Y + be * X + al * be) * (1 + 1e-6)

    def exact_block(rows: Tensor, cols: Tensor) -> Tensor:
        """A[rows] @ B[:, cols] from rows of A and B^T formed as the whole factors hold them, in a product of at least
        MIN_ROWS x MIN_ROWS (the BLAS rounds smaller ones in another order than the dense product)."""
        r, c = rows.numel(), cols.numel()
        pad = [torch.cat([i, i[:1].expand(max(0, MIN_ROWS - i.numel()))]) for i in (rows, cols)]
        r_p, c_p = pad[0].numel(), pad[1].numel()
        spent[0] += 2 * (r_p * left.X.shape[1] + c_p * right.X.shape[1] + r_p * c_p) * mdim
        if spent[0] > budget:
            raise _OverBudget
        return (left.rows(pad[0]) @ right.rows(pad[1]).T)[:r, :c]

    spent, budget = [0], exact_budget(ldim, left.X.shape[1], mdim, rdim, right.X.shape[1])
    try:
        return bounds.staircase(A_f, Bt_f.T, p, row_order, q, col_order, k, exact_block, margin, should_stop)
    except _OverBudget:
        return None
