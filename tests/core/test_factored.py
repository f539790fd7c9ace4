"""FactoredMatrix against the dense matrix A @ B, in float64, on random shapes (docs/maths.md §5.10)."""

from __future__ import annotations

import math

import pytest
import torch

from circuits_core.circuits import global_topk
from circuits_core.circuits.factored import FactoredMatrix, svd_cost
from circuits_core.errors import InvalidInputError, LimitExceededError
from tests.held_bytes import HeldBytes


@pytest.fixture(autouse=True)
def float64_by_default():
    """Every tensor of these tests is float64; restored afterwards so other test modules are unaffected."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# (batch, ldim, mdim, rdim): square and rectangular, low-rank (mdim < dims) and mdim > dims.
SHAPES = [((), 7, 3, 7), ((), 9, 4, 6), ((2, 3), 8, 5, 8), ((3,), 5, 7, 6), ((2,), 6, 6, 6)]


def random_fm(batch, ldim, mdim, rdim, seed=0, broadcast_a=False):
    gen = torch.Generator().manual_seed(seed)
    a_batch = () if broadcast_a else batch
    A = torch.randn(*a_batch, ldim, mdim, generator=gen)
    B = torch.randn(*batch, mdim, rdim, generator=gen)
    return FactoredMatrix(A, B)


def dense(fm):
    return (fm.A @ fm.B).expand(fm.shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_T_and_dense_views(shape):
    fm = random_fm(*shape)
    batch, ldim, mdim, rdim = shape
    M = dense(fm)  # [..., ldim, rdim]
    assert fm.shape == (*batch, ldim, rdim) and fm.mdim == mdim
    assert torch.allclose(fm.T.AB, M.transpose(-2, -1))
    assert torch.allclose(fm.rows([0, 2]), M[..., [0, 2], :])
    assert torch.allclose(fm.cols([1, -1]), M[..., :, [1, -1]].transpose(-2, -1))
    if ldim == rdim:
        assert torch.allclose(fm.diag(), torch.diagonal(M, dim1=-2, dim2=-1))
        assert torch.allclose(fm.BA, fm.B @ fm.A)
    else:
        with pytest.raises(InvalidInputError):
            fm.diag()


@pytest.mark.parametrize("shape", SHAPES)
def test_svd_reconstructs_and_is_orthonormal(shape):
    fm = random_fm(*shape, seed=1)
    U, S, V = fm.svd()
    r = S.shape[-1]
    assert torch.allclose(U @ torch.diag_embed(S) @ V.transpose(-2, -1), dense(fm), atol=1e-10)
    eye = torch.eye(r).expand(*U.shape[:-2], r, r)
    assert torch.allclose(U.transpose(-2, -1) @ U, eye, atol=1e-10)
    assert torch.allclose(V.transpose(-2, -1) @ V, eye, atol=1e-10)
    # Singular values agree with the dense ones (the dense matrix has rank <= r).
    dense_S = torch.linalg.svdvals(dense(fm))[..., :r]
    assert torch.allclose(S, dense_S, atol=1e-10)


@pytest.mark.parametrize("shape", SHAPES)
def test_norm_equals_the_dense_frobenius_norm(shape):
    fm = random_fm(*shape, seed=2)
    assert torch.allclose(fm.norm(), torch.linalg.matrix_norm(dense(fm)))


def sorted_complex(z):
    # Sort by (real, imag) after rounding, so conjugate pairs line up.
    z = z.to(torch.complex128)
    key = torch.round(z.real * 1e6) * 1e7 + z.imag
    return z[key.argsort()]


@pytest.mark.parametrize("ldim,mdim", [(7, 3), (10, 4), (6, 6)])
def test_eigenvalues_equal_nonzero_eigenvalues_of_AB(ldim, mdim):
    fm = random_fm((), ldim, mdim, ldim, seed=3)
    eig = fm.eigenvalues  # [mdim]
    dense_eig = torch.linalg.eigvals(dense(fm))  # [ldim]
    nonzero = dense_eig[dense_eig.abs().argsort(descending=True)[:mdim]]  # the rest are ~0
    assert torch.allclose(sorted_complex(eig), sorted_complex(nonzero), atol=1e-8)
    if ldim > mdim:
        assert dense_eig.abs().sort().values[: ldim - mdim].max() < 1e-9
    # Trace identity: sum of eigenvalues == trace == sum of the diagonal.
    assert torch.allclose(eig.sum().real, torch.trace(dense(fm)))
    assert torch.allclose(fm.diag().sum(), torch.trace(dense(fm)))


def test_eigenvalues_batched_match_looped():
    fm = random_fm((2, 3), 8, 4, 8, seed=4)
    eig = fm.eigenvalues  # [2, 3, 4]
    for i in range(2):
        for j in range(3):
            dense_eig = torch.linalg.eigvals(dense(fm)[i, j])
            nonzero = dense_eig[dense_eig.abs().argsort(descending=True)[:4]]
            assert torch.allclose(sorted_complex(eig[i, j]), sorted_complex(nonzero), atol=1e-8)


def test_products_keep_the_smallest_inner_dimension():
    gen = torch.Generator().manual_seed(5)
    fm = FactoredMatrix(torch.randn(2, 20, 3, generator=gen), torch.randn(2, 3, 20, generator=gen))
    left, right = torch.randn(15, 20, generator=gen), torch.randn(20, 17, generator=gen)
    M = dense(fm)
    out = left @ fm @ right
    assert out.mdim == 3 and out.shape == (2, 15, 17)
    assert torch.allclose(out.AB, left @ M @ right)
    # When the inner dimension is larger than the outer one, the product is materialised instead.
    small = FactoredMatrix(torch.randn(4, 6, generator=gen), torch.randn(6, 4, generator=gen))
    prod = small @ torch.randn(4, 2, generator=gen)
    assert prod.mdim == 4
    other = random_fm((), 20, 2, 9, seed=6)
    both = fm @ other
    assert torch.allclose(both.AB, M @ dense(other))
    assert torch.allclose((fm * 2.5).AB, 2.5 * M) and torch.allclose((2.5 * fm).AB, 2.5 * M)
    with pytest.raises(InvalidInputError):
        fm @ torch.randn(20)


def test_batch_indexing_including_negative_and_broadcast():
    fm = random_fm((3, 4), 6, 2, 5, seed=7, broadcast_a=True)  # A has no batch dims: broadcast
    M = dense(fm)
    for idx in [(0, 0), (-1, -1), (2, -3), (-2,)]:
        sub = fm[idx]
        assert sub.AB.numel() > 0
        assert torch.allclose(sub.AB, M[idx])
    assert torch.allclose(fm[1].AB, M[1])
    with pytest.raises(InvalidInputError):
        fm[0, 0, 0]


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_topk_row_and_col(shape, largest):
    fm = random_fm(*shape, seed=8)
    M = dense(fm)
    batch, ldim, _, rdim = shape
    for i in (0, ldim - 1, -1):
        v, idx = fm.topk_row(i, 3, largest=largest)
        ref_v, ref_idx = M[..., i, :].topk(3, dim=-1, largest=largest)
        assert torch.allclose(v, ref_v) and torch.equal(idx, ref_idx)
    for j in (0, rdim - 1, -2):
        v, idx = fm.topk_col(j, 4, largest=largest)
        ref_v, ref_idx = M[..., :, j].topk(4, dim=-1, largest=largest)
        assert torch.allclose(v, ref_v) and torch.equal(idx, ref_idx)


def test_topk_errors():
    fm = random_fm((), 5, 2, 4)
    with pytest.raises(InvalidInputError):
        fm.topk_row(5, 2)
    with pytest.raises(InvalidInputError):
        fm.topk_col(0, 6)
    with pytest.raises(InvalidInputError):
        fm.topk_row(0, 0)
    with pytest.raises(InvalidInputError):
        fm.topk_global(21)


def dense_topk_global(M, k, largest):
    flat = M.reshape(*M.shape[:-2], -1)
    v, i = flat.topk(k, dim=-1, largest=largest)
    return v, i // M.shape[-1], i % M.shape[-1]


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize(
    "budget_rows,tile_cols,screen", [(1, 4096, False), (3, 7, True), (1000, 4096, True), (1000, 6, False)]
)
@pytest.mark.parametrize("shape", [((), 40, 3, 30), ((2, 3), 25, 4, 20), ((), 33, 40, 17)])
def test_topk_global_matches_dense(shape, budget_rows, tile_cols, screen, largest, monkeypatch):
    monkeypatch.setattr(global_topk, "TILE_COLS", tile_cols)  # several column tiles, the last one partial
    monkeypatch.setattr(global_topk, "TILE_ROWS", 4)
    # bfloat16 screening (normally only for >= 2^24 entries), then exact recomputation of the kept rows
    monkeypatch.setattr(global_topk, "SCREEN_MIN_ENTRIES", 0 if screen else 2**62)
    monkeypatch.setattr(global_topk, "half_products_fast", lambda device, dtype: True)  # screen where asked, on any CPU
    fm = random_fm(*shape, seed=9)
    M = dense(fm)
    rdim = shape[-1]
    budget = budget_rows * min(rdim, tile_cols) * 8 * 4  # budget_rows rows of a tile in 4 buffers, float64
    for k in (1, 7, 50):
        v, r, c = fm.topk_global(k, budget_bytes=budget, largest=largest)
        ref_v, ref_r, ref_c = dense_topk_global(M, k, largest)
        assert v.shape == (*shape[0], k)
        assert torch.allclose(v, ref_v)
        assert torch.equal(r, ref_r) and torch.equal(c, ref_c)  # random data: no ties
        flat = M.reshape(*M.shape[:-2], -1)  # the entries at the returned (row, col) are the values
        assert torch.allclose(flat.gather(-1, r * rdim + c), v)


@pytest.mark.parametrize("shift", [0.0, -3.0, 3.0])  # k-th values of both signs, rows without a positive entry
def test_topk_global_screen_row_maxima_on_bits_and_values_match_dense(shift, monkeypatch):
    """The bfloat16 screen's row maxima (on the int16 bits once the threshold is positive, else on the values) keep
    every row that holds a top-k entry: float64 vs dense, matrices mostly positive, mixed, mostly negative."""
    monkeypatch.setattr(global_topk, "SEED_ROWS", 2)
    monkeypatch.setattr(global_topk, "TILE_ROWS", 5)
    monkeypatch.setattr(global_topk, "SCREEN_MIN_ENTRIES", 0)
    monkeypatch.setattr(global_topk, "half_products_fast", lambda device, dtype: True)  # screen where asked, on any CPU
    gen = torch.Generator().manual_seed(12)
    A = torch.cat([torch.randn(37, 6, generator=gen, dtype=torch.float64), torch.ones(37, 1, dtype=torch.float64)], 1)
    B = torch.cat(
        [torch.randn(6, 29, generator=gen, dtype=torch.float64), torch.full((1, 29), shift, dtype=torch.float64)]
    )
    M = A @ B  # every entry shifted by `shift`
    for k in (1, 9, 40):
        for largest in (True, False):
            v, r, c = FactoredMatrix(A, B).topk_global(k, largest=largest)
            ref_v, ref_r, ref_c = dense_topk_global(M, k, largest)
            torch.testing.assert_close(v, ref_v, rtol=1e-12, atol=1e-12)
            assert torch.equal(r, ref_r) and torch.equal(c, ref_c)


def test_row_max_on_bits_is_the_maximum_where_a_row_has_a_positive_entry():
    x = torch.randn(300, 50, generator=torch.Generator().manual_seed(3)).to(global_topk.SCREEN_DTYPE)
    x[:40] = -x[:40].abs()  # rows without a positive entry
    bits, values = global_topk._row_max(x, positive=True), global_topk._row_max(x, positive=False)
    assert torch.equal(values, x.amax(1))
    has = (x > 0).any(1)
    assert torch.equal(bits[has], values[has]) and bool((bits[~has] <= 0).all())


@pytest.mark.parametrize("seed_rows,tile_rows", [(1, 6), (2, 5), (3, 64), (64, 4)])
@pytest.mark.parametrize("screen", [True, False])
def test_topk_global_with_a_small_seed_block_matches_dense(seed_rows, tile_rows, screen, monkeypatch):
    """The first row block is SEED_ROWS rows (then TILE_ROWS): k larger than the seed block's entries, equal to
    them, and smaller; float64 against the dense product."""
    monkeypatch.setattr(global_topk, "SEED_ROWS", seed_rows)
    monkeypatch.setattr(global_topk, "TILE_ROWS", tile_rows)
    monkeypatch.setattr(global_topk, "TILE_COLS", 7)
    monkeypatch.setattr(global_topk, "SCREEN_MIN_ENTRIES", 0 if screen else 2**62)
    monkeypatch.setattr(global_topk, "half_products_fast", lambda device, dtype: True)  # screen where asked, on any CPU
    gen = torch.Generator().manual_seed(11)
    fm = FactoredMatrix(
        torch.randn(41, 5, generator=gen, dtype=torch.float64), torch.randn(5, 23, generator=gen, dtype=torch.float64)
    )
    M = fm.A @ fm.B
    for k in (1, 7, 14, 60):
        for largest in (True, False):
            v, r, c = fm.topk_global(k, largest=largest)
            ref_v, ref_r, ref_c = dense_topk_global(M, k, largest)
            torch.testing.assert_close(v, ref_v, rtol=1e-12, atol=1e-12)
            assert torch.equal(r, ref_r) and torch.equal(c, ref_c)  # random data: no ties


@pytest.mark.parametrize("tile_cols", [4096, 9])
def test_topk_global_bound_skips_rows_without_changing_the_answer(tile_cols, monkeypatch):
    monkeypatch.setattr(global_topk, "TILE_COLS", tile_cols)
    # A few rows with a much larger norm hold every top entry: the bound lets the scan stop early.
    gen = torch.Generator().manual_seed(10)
    A = torch.randn(500, 4, generator=gen) * 0.01
    A[[3, 250, 499]] *= 1000
    B = torch.randn(4, 60, generator=gen)
    fm = FactoredMatrix(A, B)
    blocks_seen = []
    real_matmul = torch.matmul

    def counting_matmul(x, y, out=None):
        blocks_seen.append(x.shape[0])
        return real_matmul(x, y, out=out)

    torch.matmul = counting_matmul
    try:
        v, r, c = fm.topk_global(10, budget_bytes=5 * min(60, tile_cols) * 8 * 4)  # 5-row blocks
    finally:
        torch.matmul = real_matmul
    ref_v, ref_r, ref_c = dense_topk_global(A @ B, 10, True)
    assert torch.allclose(v, ref_v) and torch.equal(r, ref_r) and torch.equal(c, ref_c)
    assert sum(blocks_seen) < 500  # rows were skipped
    assert all(n == 5 for n in blocks_seen)  # only tiles of the first row block were computed


def test_topk_global_bound_skips_column_tiles(monkeypatch):
    monkeypatch.setattr(global_topk, "TILE_COLS", 9)
    gen = torch.Generator().manual_seed(12)
    A = torch.randn(50, 4, generator=gen) * 0.01
    B = torch.randn(4, 60, generator=gen)
    A[[3, 20, 33, 49], 0] = 10.0  # 4 rows x 3 columns of entries ~ 1000, every other entry < ~40
    B[0, [7, 30, 59]] = 100.0
    fm = FactoredMatrix(A, B)
    tiles = []
    real_matmul = torch.matmul

    def counting_matmul(x, y, out=None):
        tiles.append((x.shape[0], y.shape[1]))
        return real_matmul(x, y, out=out)

    torch.matmul = counting_matmul
    try:
        v, r, c = fm.topk_global(10, budget_bytes=5 * 9 * 8 * 4)  # 5-row blocks
    finally:
        torch.matmul = real_matmul
    ref_v, ref_r, ref_c = dense_topk_global(A @ B, 10, True)
    assert torch.allclose(v, ref_v) and torch.equal(r, ref_r) and torch.equal(c, ref_c)
    assert tiles == [(5, 9)]  # the first 5 rows x first 9 columns by norm; the other 6 x 7 tiles are bounded out


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("shape", [((), 40, 3, 30), ((2, 3), 25, 4, 20)])
def test_topk_global_on_a_subset_matches_the_dense_masked_topk(shape, largest, monkeypatch):
    monkeypatch.setattr(global_topk, "TILE_COLS", 7)  # several column tiles of the restricted factors
    batch, ldim, _, rdim = shape
    fm = random_fm(*shape, seed=13)
    M = dense(fm)
    gen = torch.Generator().manual_seed(14)
    rows = torch.randperm(ldim, generator=gen)[: ldim // 3]  # unsorted, distinct
    cols = torch.randperm(rdim, generator=gen)[: rdim // 2]
    keep = torch.zeros(ldim, rdim, dtype=torch.bool)
    keep[rows[:, None], cols[None, :]] = True
    fill = float("-inf") if largest else float("inf")
    masked = M.masked_fill(~keep, fill)  # [..., ldim, rdim], entries outside rows x cols can never win
    for k in (1, 9, rows.numel() * cols.numel()):
        v, r, c = fm.topk_global(k, budget_bytes=3 * 7 * 8 * 4, largest=largest, rows=rows, cols=cols)
        ref_v, ref_r, ref_c = dense_topk_global(masked, k, largest)
        assert v.shape == (*batch, k)
        assert torch.allclose(v, ref_v)
        assert torch.equal(r, ref_r) and torch.equal(c, ref_c)  # indices of the full matrix
        assert torch.allclose(M.reshape(*batch, -1).gather(-1, r * rdim + c), v)
    # Only one side restricted: the other defaults to all indices.
    v, r, c = fm.topk_global(5, rows=rows, largest=largest)
    keep_rows = torch.zeros(ldim, rdim, dtype=torch.bool)
    keep_rows[rows] = True
    ref_v, ref_r, ref_c = dense_topk_global(M.masked_fill(~keep_rows, fill), 5, largest)
    assert torch.allclose(v, ref_v) and torch.equal(r, ref_r) and torch.equal(c, ref_c)


def test_topk_global_subset_errors():
    fm = random_fm((), 6, 2, 5)
    for rows in (
        torch.tensor([0, 6]),
        torch.tensor([1, 1]),
        torch.tensor([], dtype=torch.long),
        torch.tensor([0.0]),
        [0, 1],
    ):
        with pytest.raises(InvalidInputError):
            fm.topk_global(1, rows=rows)
    with pytest.raises(InvalidInputError):
        fm.topk_global(7, rows=torch.tensor([0, 1]), cols=torch.tensor([2, 3, 4]))  # only 6 entries


def test_budget_too_small_raises():
    fm = random_fm((), 10, 3, 1000)
    with pytest.raises(LimitExceededError):
        fm.topk_global(5, budget_bytes=1000)
    with pytest.raises(LimitExceededError):
        fm.rows_per_block(budget_bytes=100)


def test_rows_per_block_fits_the_budget():
    fm = random_fm((2,), 23, 3, 11, seed=11)
    assert fm.rows_per_block(budget_bytes=2 * 5 * 11 * 8) == 5  # 5 rows of both batch entries (float64)
    assert fm.rows_per_block(budget_bytes=2 * 5 * 11 * 8 - 1) == 4
    assert fm.rows_per_block(budget_bytes=10**9) == 23  # never more than the matrix has


def test_batch_broadcast_agrees_with_torch_broadcast_shapes() -> None:
    import random

    from circuits_core.circuits.factored import batch_broadcast
    from circuits_core.errors import InvalidInputError

    rng = random.Random(0)
    for _ in range(500):
        a = torch.Size(rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 3)))
        b = torch.Size(rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 3)))
        try:
            want = torch.broadcast_shapes(a, b)
        except RuntimeError:
            with pytest.raises(InvalidInputError):
                batch_broadcast(a, b)
            continue
        assert batch_broadcast(a, b) == want


@pytest.mark.parametrize("faster", [True, False])
def test_the_bfloat16_screen_runs_only_where_it_is_faster(faster, monkeypatch):
    """On a CPU that emulates bfloat16 GEMMs (28x slower than float32 on AVX2) the search must not screen: the
    screen's row maxima are read only when half_products_fast says so; the answer is the dense one either way."""
    monkeypatch.setattr(global_topk, "SCREEN_MIN_ENTRIES", 0)
    monkeypatch.setattr(global_topk, "half_products_fast", lambda device, dtype: faster)
    screened: list[int] = []
    row_max = global_topk._row_max
    monkeypatch.setattr(global_topk, "_row_max", lambda x, positive: screened.append(1) or row_max(x, positive))
    gen = torch.Generator().manual_seed(13)
    fm = FactoredMatrix(torch.randn(300, 6, generator=gen), torch.randn(6, 200, generator=gen))
    v, r, c = fm.topk_global(5)
    ref_v, ref_r, ref_c = dense_topk_global(fm.A @ fm.B, 5, True)
    torch.testing.assert_close(v, ref_v)
    assert torch.equal(r, ref_r) and torch.equal(c, ref_c)
    assert bool(screened) == faster


@pytest.mark.parametrize(
    "a_batch,b_batch,ldim,mdim,rdim", [((3, 1), (3, 4), 30, 6, 25), ((2,), (2,), 40, 8, 40), ((), (5,), 20, 4, 30)]
)
def test_svd_cost_covers_the_held_peak(
    a_batch: tuple[int, ...], b_batch: tuple[int, ...], ldim: int, mdim: int, rdim: int
) -> None:
    """factored.svd_cost against the bytes the factored SVD really holds (tensors it makes; A, B excluded)."""
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(*a_batch, ldim, mdim, generator=gen, dtype=torch.float64)
    B = torch.randn(*b_batch, mdim, rdim, generator=gen, dtype=torch.float64)
    with torch.no_grad(), HeldBytes([A, B]) as held:
        S = FactoredMatrix(A, B).S  # [n..., mdim]
    assert S.shape[-1] == mdim
    n = math.prod(torch.broadcast_shapes(a_batch, b_batch))
    priced = svd_cost(math.prod(a_batch), math.prod(b_batch), n, ldim, mdim, rdim, 8)
    assert 0 < held.peak <= priced.peak_bytes <= 2 * held.peak, (held.peak, priced.peak_bytes)
