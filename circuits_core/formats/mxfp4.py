"""MXFP4 (OCP microscaling FP4), the format of gpt-oss's expert weights, dequantised as transformers does.

A block of 32 values is 16 bytes of 4-bit E2M1 codes (low nibble first) and one shared uint8 exponent e: each
value is FP4[code] * 2^(e - 127), FP4 = (0, 0.5, 1, 1.5, 2, 3, 4, 6) and their negatives (code bit 3 is the
sign). gpt-oss stores each expert projection [d_out, d_in] as blocks [d_out, d_in / 32, 16] and scales
[d_out, d_in / 32] (tensors `*_blocks`, `*_scales`).
"""

from __future__ import annotations

import torch
from torch import Tensor

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> values [..., G * 32] in `dtype` (exact: every value is
    a small multiple of a power of two)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 needs uint8 blocks [..., G, 16] and scales [..., G], got {blocks.shape} {scales.shape}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(*blocks.shape[:-1], 2 * blocks.shape[-1], dtype=dtype)  # [..., G, 32]
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127)[..., None])
    return out.flatten(-2)
