"""Products on half-precision weights: where the device multiplies bf16/fp16 fast, and float32 chunks where it does not.

A checkpoint stored in bf16 or fp16 may keep that dtype in memory (load_checkpoint's keep_half: a Llama-3.1-8B
model's attention and embeddings are 4.5 GiB in bf16, 9 GiB in float32). The circuits compute in float32
(Transformer.compute_dtype), and a half-precision product is only worth running where the hardware has it: GPUs and
CPUs with AVX512-BF16/AMX do, while a CPU with AVX2 only emulates it (a bf16 [1024, 64] @ [64, 16384] product took
10.6 s against 0.38 s in float32; a bf16 OV row of the 8B shape over its 128,256 logits 9.4 s). `half_products_fast`
is the one place that decides, by timing both once per device and dtype; `half_matmul` follows it: half-precision
products where they are fast, else the half operand converted to float32 a bounded chunk at a time (its float32
copy never exists whole) and multiplied in float32. The result has torch's promoted dtype, so a caller that passes
a float32 operand gets float32 (an OV row of a bf16 model in its compute dtype) and one that passes two half
operands gets half, as `@` would give. The global top-k's bf16 screen (global_topk.py) asks the same
probe.

Full-precision operands are multiplied as they are, except a few rows times a wide matrix (an OV row over Gemma-3's
262,144 logits: [1, 640] @ W_U [640, 262144], 671 MB read once for 168 MFLOP): that product is memory-bound and MKL's
gemv runs it on one core (the same ~50 ms with one torch thread or two), so its column blocks go to two threads of
one torch thread each, as the half path's tiles do (`_column_blocks`). Each column of the result is the same dot
product over k either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from circuits_core.schedule import one_thread, shared_chunks, side_by_side

HALF_DTYPES = (torch.bfloat16, torch.float16)
# The float32 copy of one chunk of a half operand (a [4096, 2048] block of an 8B model's W_U): large enough for
# efficient products, small enough to stay a bounded extra beside weights of many GiB.
CHUNK_BYTES = 32 * 2**20
# A few rows of A times a half B (an OV row: [1, d_model] @ W_U [d_model, d_vocab]): the product is memory-bound, so B
# is converted a [TILE_ROWS, TILE_COLUMNS] tile at a time into a float32 buffer that stays in the L2 cache (512 KiB)
# and multiplied at once, instead of written to and read back from memory as a 32 MiB chunk; column blocks go to two
# threads of one torch thread each (OpenMP teams stall on these short ops on a busy machine). At the 8B shape's W_U
# on this 2-core CPU (load ~8): 0.26 s on one thread for a quarter of the vocabulary, against 0.77 s in chunks.
FEW_ROWS, TILE_ROWS, TILE_COLUMNS = 16, 32, 4096
# A few rows times a full-precision B of at least SPLIT_BYTES: its column blocks of about BLOCK_BYTES on both cores.
# Blocks of tens of MB keep each thread streaming while the two share the vocabulary evenly. Below SPLIT_BYTES MKL's
# own gemv is faster: on the AVX-512 Xeon (two torch threads, quiet, medians of 15) [1, 768] @ [768, 50257] (GPT-2's
# W_U, 147 MiB) took 4.1-4.5 ms plain against 5.4-5.6 ms in blocks, and GPT-2's whole OV row 4.3-5.0 ms against
# 9.1-9.9 ms; SmolLM2's W_U (108 MiB) 2.5-2.6 against 3.7 ms. Above it the two were even there (Gemma-3's 640 MiB
# W_U: 23.8-24.0 ms plain, 24.3-24.6 ms in blocks; Llama-3.2-1B's 1 GiB: 34.6-35.5 against 39.4-39.6 ms) and the blocks
# won on the AVX2 machine the split was made for (above).
SPLIT_BYTES, BLOCK_BYTES = 512 * 2**20, 32 * 2**20
# The probe's products [m, k] @ [k, n]: a small one, where an emulated half-precision GEMM shows at once (28x slower),
# then one large enough that a native one's fixed costs (the kernel's set-up, AMX tile configuration) are a small part.
# On the AVX-512/AMX Xeon the small product alone was a coin toss (bf16 0.035-0.041 ms, float32 0.042-0.049 ms, so
# the probe said "slow" in some processes), while at the global top-k's tile shape [1024, 576] @ [576, 16384] bf16 ran
# 3.5x faster (1,035-1,144 against 291-301 GFLOP/s); the large probe (2^28 FLOP, ~1 ms in float32) shows that gap.
SMALL_PROBE, LARGE_PROBE = (128, 64, 1024), (256, 512, 1024)
EMULATED = 2.0  # a half product this many times slower than float32 on the small probe is emulated: no second probe
# Fast means at most FASTER times float32's time on the large probe, timed on one thread: on the AVX-512/AMX Xeon bf16
# took 0.27-0.29 against 1.36-1.48 ms there (0.2x), float16 1.26-1.45 ms (a tie: not fast).
FASTER = 0.5
_fast: dict[tuple[torch.device, torch.dtype], bool] = {}


def _best_time(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> float:
    """Seconds of the fastest of 5 products [m, k] @ [k, n] in `dtype`, after one untimed warm-up product."""
    m, k, n = shape
    x, y = torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype)
    x @ y  # the first call builds the kernel: not timed
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x @ y
        times.append(time.perf_counter() - t0)
    return min(times)


def probe_says_fast(time_of: Callable[[tuple[int, int, int], torch.dtype], float], dtype: torch.dtype) -> bool:
    """The probe's decision from `time_of(shape, dtype)` (seconds): not fast when the half product is EMULATED times
    slower than float32 on SMALL_PROBE (then LARGE_PROBE is not run: emulated, it would take ~0.1 s); else fast when it
    takes at most FASTER times float32's time on LARGE_PROBE."""
    if time_of(SMALL_PROBE, dtype) > EMULATED * time_of(SMALL_PROBE, torch.float32):
        return False
    return time_of(LARGE_PROBE, dtype) <= FASTER * time_of(LARGE_PROBE, torch.float32)


def half_products_fast(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a `dtype` GEMM beats a float32 one on `device`, timed once per (device, dtype) (probe_says_fast; a
    CUDA device is taken as fast). CPUs without bf16 instructions (AVX2 only) emulate it: 28x slower than float32
    on such a CPU; GPUs and CPUs with AVX512-BF16/AMX run it faster."""
    key = (torch.device(device), dtype)
    if key not in _fast:
        if key[0].type == "cuda":
            _fast[key] = True
        else:
            with one_thread():  # two OpenMP threads on a busy 2-core machine stall ~5 ms per product on their barrier
                _fast[key] = probe_says_fast(lambda shape, dt: _best_time(shape, dt, key[0]), dtype)
    return _fast[key]


def half_matmul(A: Tensor, B: Tensor, chunk_bytes: int | None = None) -> Tensor:
    """A [..., m, k] @ B [k, n] (or A [m, k] @ B [..., k, n]) in torch's promoted dtype (float32 for a half operand
    times a float32 one, half for two half operands): as `A @ B` when neither is half-precision; else from
    half-precision products where `half_products_fast` says so, otherwise in float32 with the half operand (the
    larger one when both are) converted `chunk_bytes` (default CHUNK_BYTES) of float32 at a time: B by column
    blocks, A by row blocks. The other operand is converted whole (a few rows or a head's factor). A few rows times a
    full-precision B of SPLIT_BYTES or more run as column blocks on both cores (`_column_blocks`)."""
    half = [t.dtype for t in (A, B) if t.dtype in HALF_DTYPES]
    if not half:
        wide = B.dim() == 2 and B.numel() * B.element_size() >= SPLIT_BYTES
        if wide and A.shape[:-1].numel() <= FEW_ROWS and torch.get_num_threads() > 1:
            return _column_blocks(A, B)
        return A @ B
    result = torch.promote_types(A.dtype, B.dtype)
    if half_products_fast(A.device, half[0]):
        return (A.to(half[0]) @ B.to(half[0])).to(result)
    return _float32_chunks(A, B, CHUNK_BYTES if chunk_bytes is None else chunk_bytes).to(result)


def _float32_chunks(A: Tensor, B: Tensor, chunk_bytes: int) -> Tensor:
    """A @ B in float32, the half operand converted chunk by chunk into one reused float32 buffer (tile by tile for a
    few rows of A: `_few_rows`)."""
    if B.dtype in HALF_DTYPES and B.dim() == 2 and (A.dtype not in HALF_DTYPES or B.numel() >= A.numel()):
        A = A.float()
        if A.shape[:-1].numel() <= FEW_ROWS:
            return _few_rows(A, B)
        out = A.new_empty(*A.shape[:-1], B.shape[1])  # [..., m, n]
        step = max(1, chunk_bytes // (4 * B.shape[0]))
        buf = A.new_empty(B.shape[0], min(step, B.shape[1]))  # [k, step] float32, reused
        for j in range(0, B.shape[1], step):
            block = buf[:, : min(step, B.shape[1] - j)].copy_(B[:, j : j + step])
            out[..., j : j + block.shape[1]] = A @ block
        return out
    if A.dtype in HALF_DTYPES and A.dim() == 2:
        B = B.float()
        out = B.new_empty(*B.shape[:-2], A.shape[0], B.shape[-1])  # [..., m, n]
        step = max(1, chunk_bytes // (4 * A.shape[1]))
        buf = B.new_empty(min(step, A.shape[0]), A.shape[1])  # [step, k] float32, reused
        for i in range(0, A.shape[0], step):
            block = buf[: min(step, A.shape[0] - i)].copy_(A[i : i + step])
            out[..., i : i + block.shape[0], :] = block @ B
        return out
    return A.float() @ B.float()  # batched half operands: small (per-head factors), converted whole


def _few_rows(A: Tensor, B: Tensor) -> Tensor:
    """A [..., m, k] (float32, m * batch <= FEW_ROWS) @ B [k, n] (half) in float32: each column block of TILE_COLUMNS
    sums its products over row tiles of B converted into a cache-sized buffer; the column blocks are shared by two
    threads of one torch thread each when the caller runs more than one (schedule.side_by_side), else done here."""
    k, n = B.shape
    out = A.new_zeros(*A.shape[:-1], n)  # [..., m, n]
    take = shared_chunks(n, TILE_COLUMNS)

    def worker() -> None:
        buf = A.new_empty(TILE_ROWS, TILE_COLUMNS)  # float32, reused
        while (cols := take()) is not None:
            block = out[..., cols]
            for r0 in range(0, k, TILE_ROWS):
                r1 = min(k, r0 + TILE_ROWS)
                tile = buf[: r1 - r0, : cols.stop - cols.start].copy_(B[r0:r1, cols])
                block += A[..., r0:r1] @ tile

    _on_both_cores(worker)
    return out


def _column_blocks(A: Tensor, B: Tensor) -> Tensor:
    """A [..., m, k] @ B [k, n] (both full precision, m * batch <= FEW_ROWS): column blocks of B of about BLOCK_BYTES,
    shared by two threads of one torch thread each (a memory-bound product that one gemv keeps on one core)."""
    k, n = B.shape
    out = A.new_empty(*A.shape[:-1], n)  # [..., m, n]
    take = shared_chunks(n, max(1, BLOCK_BYTES // (k * B.element_size())))

    def worker() -> None:
        while (cols := take()) is not None:
            out[..., cols] = A @ B[:, cols]  # [..., m, block]

    _on_both_cores(worker)
    return out


def _on_both_cores(worker: Callable[[], None]) -> None:
    """worker() here and in a helper thread, each with one torch thread (they share one queue of blocks), when the
    caller runs more than one torch thread; here alone otherwise."""
    if torch.get_num_threads() == 1:
        worker()
    else:
        with one_thread():
            side_by_side(worker, worker, "qkov-few-rows")
