"""Products on half-precision weights (model/half_products.py): float32 chunks where the device emulates bf16, and
the path chosen by the one probe.

The reference is always float64 on the same half-precision values (upcast exactly), formed densely and
independently: a chunk converted from the wrong columns, a missing norm or a product left in bf16 (relative error
~2^-9) is far outside the float32 tolerance used. The model is a bf16 Llama checkpoint that transformers writes
here and load_checkpoint reads with keep_half.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from circuits_core.circuits.head_circuits import direct_row, full_ov_row, full_qk_col
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.model import half_products
from circuits_core.model.half_products import half_matmul
from tests.bf16_llama import save_bf16_llama

CONFIG = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}  # fmt: skip


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device as an AVX2-only CPU: half products slow, so float32 chunks, several of them (small chunks)."""
    monkeypatch.setattr(half_products, "half_products_fast", lambda device, dtype=torch.bfloat16: False)
    monkeypatch.setattr(half_products, "CHUNK_BYTES", 64 * 4 * 7)  # 7 columns of a [64, n] operand per chunk


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = save_bf16_llama(tmp_path_factory.mktemp("half"), CONFIG, seed=7)
    loaded = load_checkpoint(path, keep_half=True, process=False).model  # norms' gains kept apart: checked below
    assert loaded.dtype == torch.bfloat16 and loaded.compute_dtype == torch.float32
    return loaded


def rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_matmul_in_float32_chunks_matches_float64(dtype: torch.dtype, emulated: None) -> None:
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(64, 300, generator=gen).to(dtype)  # 300 columns: 43 chunks of 7, the last one of 6
    x = torch.randn(5, 64, generator=gen)
    ref = x.double() @ W.double()
    out = half_matmul(x, W)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # the half operand on the left (W_E @ W): row chunks; a batched right operand; both operands half
    E = torch.randn(300, 64, generator=gen).to(dtype)
    Wb = torch.randn(3, 64, 4, generator=gen)
    for A, B in ((E, x.T), (E, Wb)):
        ref = A.double() @ B.double()
        torch.testing.assert_close(half_matmul(A, B).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for A, B in ((E, W[:, :9].float()), (x.to(dtype), W)):  # two half operands: the product rounded to their dtype
        ref, got = A.double() @ B.float().double(), half_matmul(A, B.to(A.dtype))
        assert got.dtype == dtype
        assert (got.double() - ref).abs().max() <= torch.finfo(dtype).eps * ref.abs().max()
    # a vector on the left
    ref1 = x[0].double() @ W.double()
    torch.testing.assert_close(half_matmul(x[0], W).double(), ref1, rtol=1e-5, atol=1e-5 * ref1.abs().max().item())


@pytest.mark.parametrize("threads", [1, 2])
def test_a_few_rows_times_a_half_matrix_go_tile_by_tile(threads: int, emulated: None, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Few rows (an OV row) take the tiled path, on one thread or two sharing the column blocks; tiles of 5 x 7 so
    both the rows and the columns of B end in a partial tile. More rows than FEW_ROWS take the chunks."""
    monkeypatch.setattr(half_products, "TILE_ROWS", 5)
    monkeypatch.setattr(half_products, "TILE_COLUMNS", 7)
    tiled: list[int] = []
    few_rows = half_products._few_rows
    monkeypatch.setattr(half_products, "_few_rows", lambda A, B: tiled.append(A.shape[-2]) or few_rows(A, B))
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(64, 300, generator=gen).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x in (torch.randn(1, 64, generator=gen), torch.randn(2, 3, 64, generator=gen), torch.randn(20, 64)):
            ref = x.double() @ W.double()
            out = half_matmul(x, W)
            assert out.dtype == torch.float32 and out.shape == ref.shape
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        assert torch.get_num_threads() == threads  # restored after the two threads' single-threaded tiles
    finally:
        torch.set_num_threads(before)
    assert tiled == [1, 3]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_few_rows_times_a_wide_full_precision_matrix_go_in_column_blocks(threads: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An OV row's last product ([1, d_model] @ W_U): on two torch threads its column blocks are shared by two threads
    of one, here blocks of 7 columns so the last one is partial; the reference is the products' sums formed
    elementwise in float64. On one thread, or with more than FEW_ROWS rows, it is A @ B."""
    monkeypatch.setattr(half_products, "SPLIT_BYTES", 0)
    blocks: list[int] = []
    column_blocks = half_products._column_blocks
    monkeypatch.setattr(
        half_products, "_column_blocks", lambda A, B: blocks.append(A.shape[:-1].numel()) or column_blocks(A, B)
    )
    gen = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
            monkeypatch.setattr(half_products, "BLOCK_BYTES", 7 * 64 * torch.finfo(dtype).bits // 8)
            W = torch.randn(64, 300, generator=gen, dtype=dtype)  # 300 columns: 42 blocks of 7, the last one of 6
            for x in (torch.randn(1, 64, generator=gen), torch.randn(2, 3, 64, generator=gen), torch.randn(64)):
                x = x.to(dtype)
                ref = (x.double()[..., :, None] * W.double()).sum(-2)  # [..., 300]
                out = half_matmul(x, W)
                assert out.dtype == dtype and out.shape == ref.shape
                torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
            many = torch.randn(20, 64, generator=gen, dtype=dtype)
            assert torch.equal(half_matmul(many, W), many @ W)
        assert torch.get_num_threads() == threads  # restored after the two threads' single-threaded blocks
    finally:
        torch.set_num_threads(before)
    assert blocks == ([1, 6, 1] * 2 if threads == 2 else [])  # rows of each product split


def test_full_precision_operands_are_multiplied_as_they_are() -> None:
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        A, B = torch.randn(6, 8, generator=gen, dtype=dtype), torch.randn(8, 5, generator=gen, dtype=dtype)
        out = half_matmul(A, B)
        assert out.dtype == dtype and torch.equal(out, A @ B)


@pytest.mark.parametrize("fast", [True, False])
def test_the_product_path_follows_the_probe(fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the probe says half products are fast, the product runs in bf16 (what the hardware offers); where it
    says not, in float32: the bf16 product's error (~1e-3 here) is then absent. (global_topk's screen asks the same
    probe: tests/core/test_factored.py.)"""
    monkeypatch.setattr(half_products, "half_products_fast", lambda device, dtype=torch.bfloat16: fast)
    gen = torch.Generator().manual_seed(2)
    W = torch.randn(256, 300, generator=gen).bfloat16()
    x = torch.randn(4, 256, generator=gen)
    ref = x.double() @ W.double()
    bf16 = (x.bfloat16() @ W).double()
    out = half_matmul(x, W).double()
    assert (bf16 - ref).abs().max() > 1e-3 * ref.abs().max()  # the bf16 product is visibly less precise
    if fast:
        assert torch.equal(out, bf16)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_the_probe_is_timed_once_per_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(half_products, "_fast", {})
    timed: list[tuple[tuple[int, int, int], torch.dtype]] = []
    best = half_products._best_time
    monkeypatch.setattr(
        half_products, "_best_time", lambda shape, dt, device: timed.append((shape, dt)) or best(shape, dt, device)
    )
    first = half_products.half_products_fast(torch.device("cpu"), torch.bfloat16)
    n = len(timed)
    assert n in (2, 4) and {dt for _, dt in timed} == {torch.float32, torch.bfloat16}  # small probe, then maybe large
    assert half_products.half_products_fast(torch.device("cpu"), torch.bfloat16) is first and len(timed) == n
    half_products.half_products_fast(torch.device("cpu"), torch.float16)
    assert len(timed) > n and timed[-1][1] in (torch.float32, torch.float16)


def _clock(seconds: dict[tuple[tuple[int, int, int], torch.dtype], float], asked: list[tuple[int, int, int]]) -> Any:
    """A probe clock: the seconds of each (shape, dtype), recording the shapes asked for."""

    def time_of(shape: tuple[int, int, int], dtype: torch.dtype) -> float:
        asked.append(shape)
        return seconds[shape, dtype]

    return time_of


SMALL, LARGE, F32, BF16 = half_products.SMALL_PROBE, half_products.LARGE_PROBE, torch.float32, torch.bfloat16


def test_the_probe_stops_at_the_small_product_when_the_half_one_is_emulated() -> None:
    asked: list[tuple[int, int, int]] = []
    emulated = {(SMALL, F32): 4e-5, (SMALL, BF16): 28 * 4e-5}  # an AVX2 CPU: bf16 28x slower
    assert half_products.probe_says_fast(_clock(emulated, asked), BF16) is False
    assert asked == [SMALL, SMALL]  # the large product, emulated, is never run


def test_the_probe_decides_on_the_large_product_where_the_small_one_is_a_tie() -> None:
    # the AVX-512/AMX Xeon: the small products within noise of each other (bf16 a little slower here), the large one
    # 5x faster in bf16: fast; float16's 0.74-1.0x there is a near tie: not fast; nor where the large product is slower
    tie = {(SMALL, F32): 4.2e-5, (SMALL, BF16): 4.9e-5}
    for large_bf16, fast in ((0.17e-3, True), (0.76e-3, False), (1.5e-3, False)):
        asked: list[tuple[int, int, int]] = []
        clock = _clock({**tie, (LARGE, F32): 0.95e-3, (LARGE, BF16): large_bf16}, asked)
        assert half_products.probe_says_fast(clock, BF16) is fast
        assert asked.count(LARGE) == 2


def test_ov_row_direct_row_and_qk_column_on_bf16_weights_match_float64(bf16_model: Any, emulated: None) -> None:
    model = bf16_model
    eps, group = model.cfg.eps, model.cfg.group_size
    W_E, W_U = model.W_E.double(), model.W_U.double()
    for layer, head, token in ((0, 1, 17), (1, 3, 250)):
        attn = model.blocks[layer].attn
        e = rms64(W_E[token], model.blocks[0].ln1.w, eps)  # W_E_eff[token], layer 0's RMS norm
        W_V, W_O = attn.grouped("W_V")[head // group].double(), attn.W_O[head].double()
        ref = e @ W_V @ W_O @ W_U  # [V]
        out = full_ov_row(model, layer, head, token)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        W_Q, W_K = attn.W_Q[head].double(), attn.grouped("W_K")[head // group].double()
        E_eff = rms64(W_E, model.blocks[0].ln1.w, eps)  # [V, d]
        ref_col = (E_eff @ W_Q) @ (e @ W_K) / model.cfg.scale  # [V]: every query token on key `token`
        col = full_qk_col(model, layer, head, token)
        torch.testing.assert_close(col.double(), ref_col, rtol=1e-5, atol=1e-5 * ref_col.abs().max().item())
    ref_direct = rms64(W_E[42], model.ln_final.w, eps) @ W_U
    out = direct_row(model, 42)
    torch.testing.assert_close(out.double(), ref_direct, rtol=1e-5, atol=1e-5 * ref_direct.abs().max().item())
