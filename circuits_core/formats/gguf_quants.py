"""GGUF tensor types to float32: ggml's block formats decoded in torch, every other type through `gguf.quants`.

A quantised tensor is rows of blocks; each block holds `block` values in `type_size` bytes (gguf.GGML_QUANT_SIZES).
The commonest types are decoded here in torch (vectorised, bit-identical to `gguf.quants.dequantize`, the ggml
project's reference code: tests/core/test_gguf_header.py checks every bit on random bytes, any fp16 scale included):
    Q8_0 [34 B / 32]: fp16 d, 32 int8 q                        -> d q
    Q4_0 [18 B / 32]: fp16 d, 16 bytes of nibbles q            -> d (q - 8)
    Q4_1 [20 B / 32]: fp16 d, fp16 m, 16 bytes of nibbles q    -> d q + m
    Q5_0 [22 B / 32]: fp16 d, 32 high bits qh, 16 bytes of nibbles -> d (q - 16), q = nibble | high bit << 4
    Q4_K [144 B / 256]: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins (8 each), 128 bytes of nibbles
                        -> (d sc_j) q - (dmin m_j) for sub-block j of 32
    Q6_K [210 B / 256]: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d -> (d sc_j) (q - 32)
    MXFP4 [17 B / 32]: E8M0 e, 16 bytes of nibbles q (gpt-oss's experts) -> value(q) 2^(e - 128), value(q) the
                       E2M1 numbers doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives)
Every other type the gguf library knows (Q2_K, Q3_K, Q5_K, IQ*, ...) goes through `gguf.quants.dequantize`
(numpy). Rows are read from the file and decoded a chunk of about CHUNK_VALUES values at a time (`row_chunks`), so
the quantised bytes never sit in memory whole beside the float32 tensor, and a chunk is still in the cache when it
is copied to its place (`dequantize`), or transposed there (`dequantize_transposed`: W_U, the MLP matrices).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from circuits_core.errors import CheckpointError
from circuits_core.formats.gguf_header import GGUFHeader, TensorInfo
from circuits_core.formats.load_watchdog import checkpoint

Q = gguf.GGMLQuantizationType
CHUNK_VALUES = 1 << 18  # float32 values per chunk (1 MiB)


def _half(blocks: Tensor, start: int) -> Tensor:
    """The fp16 numbers at bytes start, start + 1 of each block, [n, 1] float32, converted by numpy as the
    reference is (torch turns a NaN scale into another NaN bit pattern)."""
    return torch.from_numpy(blocks[:, start : start + 2].contiguous().numpy().view(np.float16).astype(np.float32))


def _nibbles(qs: Tensor) -> Tensor:
    """[n, k] bytes -> [n, 2k] uint8: the k low nibbles, then the k high ones (ggml's order within 32 values)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q8_0(blocks: Tensor) -> Tensor:
    """q d in one pass (numpy casts each int8 to float32 exactly, then one rounding: the reference's product)."""
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        np.multiply(blocks[:, 2:].numpy().view(np.int8), _half(blocks, 0).numpy(), out=out)
    return torch.from_numpy(out)


def _q4_0(blocks: Tensor) -> Tensor:
    return (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float().mul_(_half(blocks, 0))


def _q4_1(blocks: Tensor) -> Tensor:
    """d q + m with two roundings, as the reference (a multiply, then an add, never fused)."""
    return _nibbles(blocks[:, 4:]).float().mul_(_half(blocks, 0)).add_(_half(blocks, 2))


_BIT = torch.arange(32, dtype=torch.int32)


def _q5_0(blocks: Tensor) -> Tensor:
    qh = blocks[:, 2:6].contiguous().view(torch.int32)  # [n, 1] little-endian u32 of high bits
    high = ((qh >> _BIT) & 1).to(torch.uint8)  # [n, 32]
    q = _nibbles(blocks[:, 6:]) | (high << 4)
    return (q.to(torch.int8) - 16).float().mul_(_half(blocks, 0))


def _k_scales(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's 12 bytes [n, 12] -> (sc, m) [n, 8] uint8: 6-bit scales and mins (ggml's get_scale_min_k4)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _q4_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_half(blocks, 0) * sc.float()).view(n, 8, 1)  # [n, 8 sub-blocks, 1]
    dm = (_half(blocks, 2) * mn.float()).view(n, 8, 1)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)  # 4 groups of 32 bytes: low nibbles, then high, per group
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    return (d * q - dm).view(n, 256)


_SHIFT2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)


def _q6_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    qh = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT2) & 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = (_half(blocks, 208) * scales).view(n, 16, 1)
    return (d * q).view(n, 256)


_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)  # E2M1 x 2


def _mxfp4(blocks: Tensor) -> Tensor:
    """E8M0 e, 16 bytes of nibbles q -> value(q) 2^(e - 128) (ggml's e8m0_to_fp32_half, its bits built directly:
    e < 2 gives the subnormals 2^-127 and 2^-126)."""
    e = blocks[:, :1].to(torch.int32)  # [n, 1]
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.tensor(0x00200000, dtype=torch.int32), e), (e - 1) << 23)
    return _MXFP4_VALUES[_nibbles(blocks[:, 1:]).long()] * bits.view(torch.float32)


# type -> decoder of [n, type_size] uint8 blocks to [n, block] float32
TORCH_DECODERS: dict[Any, Callable[[Tensor], Tensor]] = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k, Q.MXFP4: _mxfp4,
}  # fmt: skip
_PLAIN = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64}


def decode_rows(raw: np.ndarray, ggml_type: Any) -> Tensor:
    """[rows, bytes per row] uint8 of one type -> [rows, values per row] float32 (owning its memory)."""
    rows = raw.shape[0]
    type_size = gguf.GGML_QUANT_SIZES[ggml_type][1]
    if ggml_type in _PLAIN:
        return torch.from_numpy(raw.view(_PLAIN[ggml_type]).astype(np.float32)).view(rows, -1)
    if ggml_type == Q.BF16:
        return torch.from_numpy(raw).view(torch.bfloat16).float().view(rows, -1)
    decode = TORCH_DECODERS.get(ggml_type)
    if decode is not None:
        return decode(torch.from_numpy(raw).view(-1, type_size)).view(rows, -1)
    try:
        values = gguf.quants.dequantize(raw, ggml_type)
    except (NotImplementedError, ValueError) as exc:
        raise CheckpointError(f"the gguf library cannot dequantise {ggml_type.name} ({exc})") from exc
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(rows, -1)


def chunk_rows(info: TensorInfo) -> int:
    """Rows per chunk of `row_chunks`: about CHUNK_VALUES values."""
    return max(1, CHUNK_VALUES // info.shape[-1])


def read_rows(header: GGUFHeader, info: TensorInfo, part: slice) -> Tensor:
    """Rows part.start..part.stop of a tensor taken as a matrix (its leading dims flattened), [rows, values per
    row] float32."""
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    row_bytes = info.nbytes // rows
    n = part.stop - part.start
    raw = header.read_bytes(info.offset + part.start * row_bytes, n * row_bytes).reshape(n, row_bytes)
    try:
        return decode_rows(raw, info.ggml_type)
    except CheckpointError as exc:
        raise CheckpointError(f"{header.name}: tensor {info.name}: {exc}") from exc


def row_chunks(header: GGUFHeader, info: TensorInfo) -> Iterator[tuple[int, Tensor]]:
    """(first row, [rows, values per row] float32) over a tensor taken as a matrix (its leading dims flattened), a
    chunk of about CHUNK_VALUES values at a time (chunk_rows): small enough that the caller's copy reads it from the
    cache."""
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    if not info.nbytes:
        return
    step = chunk_rows(info)
    for start in range(0, rows, step):
        checkpoint()  # the load's watchdog (load_watchdog.py)
        yield start, read_rows(header, info, slice(start, min(start + step, rows)))


def dequantize(header: GGUFHeader, info: TensorInfo) -> Tensor:
    """One tensor of the file as float32 in numpy's shape."""
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    out = torch.empty(rows, info.shape[-1], dtype=torch.float32)
    for start, values in row_chunks(header, info):
        out[start : start + values.shape[0]].copy_(values)
    return out.view(info.shape)


def dequantize_transposed(header: GGUFHeader, info: TensorInfo) -> Tensor:
    """A matrix of the file [rows, cols] as its float32 transpose [cols, rows], contiguous, or a stack of them
    [..., rows, cols] (llama.cpp's merged experts) as [..., cols, rows]: each chunk of rows is transposed while it
    is in the cache (one pass, instead of a dequantised copy and then a transposing one)."""
    *lead, rows, cols = info.shape
    out = torch.empty(*lead, cols, rows, dtype=torch.float32)
    stacked = out.view(-1, cols, rows)  # [matrices, cols, rows]
    for start, values in row_chunks(header, info):  # a chunk may run over from one matrix into the next
        done = 0
        while done < values.shape[0]:
            matrix, row = divmod(start + done, rows)
            n = min(values.shape[0] - done, rows - row)
            stacked[matrix, :, row : row + n].copy_(values[done : done + n].T)
            done += n
    return out
