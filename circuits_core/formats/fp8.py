"""Block-scaled FP8 weights (DeepSeek-V3's released files: quantization_config.quant_method "fp8", e4m3).

A linear weight W [d_out, d_in] is stored as float8_e4m3fn values q with one float32 factor per block of
block_out x block_in entries, `weight_scale_inv` [ceil(d_out / block_out), ceil(d_in / block_in)] (the last blocks of
a dimension not divisible by the block are partial): W[i, j] = q[i, j] * scale_inv[i // block_out, j // block_in],
as transformers dequantises them (its finegrained_fp8 integration). Only weights are stored this way; transformers'
own FP8 forward pass also quantises the activations on the fly, which a dequantised model (what qkov reads, and
what transformers loads with dequantize=True) does not.
"""

from __future__ import annotations

import torch
from torch import Tensor


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of weight_scale_inv for a weight of `shape` stored in blocks of `block`."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize_fp8(q: Tensor, scale_inv: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """W [d_out, d_in] in `dtype` from float8 values q [d_out, d_in] and the block factors scale_inv (module
    docstring), computed in float32."""
    rows = torch.arange(q.shape[0]) // block[0]  # [d_out]: each row's block
    cols = torch.arange(q.shape[1]) // block[1]  # [d_in]
    return (q.to(torch.float32) * scale_inv.to(torch.float32)[rows][:, cols]).to(dtype)
