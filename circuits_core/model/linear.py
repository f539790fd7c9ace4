"""The affine map every weight matrix applies, x W + b (row vectors), with the activation that may follow it.

On CPU in float32 without autograd, the product goes through oneDNN (torch.ops.mkldnn._linear_pointwise, the
kernel torch's own compiler emits for linear layers), with the bias and a GELU or ReLU applied by the product's
epilogue instead of passes over its output. The arithmetic is the same float32 GEMM; only the summation order
inside it differs from MKL's, as between any two BLAS libraries. On GPT-2 small's shapes, one thread, products
alternated in one process (load ~1): 97-104 GFLOP/s against MKL's 93-99, and the MLP's first product with its
tanh GELU at 91-101 against 69-78 for MKL's plus a separate GELU. `python -m bench http` prints the heads table's
detector pass and Grams both ways (1.05x to 1.20x in favour of oneDNN, quiet to busy machine: MKL suffers more
from a busy neighbour). Elsewhere (float64, half precision, CUDA, gradients, a torch without oneDNN) it is
torch.addmm and the activation as its own op.

The off switch: the environment variable QKOV_ONEDNN=0 (read once, when this module is imported) sends every product
to torch.addmm, e.g. to rule oneDNN out when a result differs between machines. The op is private to torch;
tests/core/test_linear.py fails loudly if a torch release drops or changes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from circuits_core.errors import InvalidInputError

# act_fn -> oneDNN epilogue (attr, algorithm); the others run after the product.
_EPILOGUES = {
    "relu": ("relu", ""),
    "gelu": ("gelu", "none"),
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
}
ONEDNN_SWITCH = "QKOV_ONEDNN"


def onednn_wanted(value: str | None) -> bool:
    """The switch's value: unset, 1/true/yes/on: oneDNN where it applies; 0/false/no/off: never."""
    said = (value or "1").strip().lower()
    if said in ("1", "true", "yes", "on"):
        return True
    if said in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ONEDNN_SWITCH} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


_ONEDNN_LINEAR: Callable[..., Tensor] | None = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if torch.backends.mkldnn.is_available() and onednn_wanted(os.environ.get(ONEDNN_SWITCH))
    else None
)
# Below this many multiply-adds oneDNN's fixed cost per call (~20 us) outweighs its faster kernel (measured: a
# 10 x 64 x 256 product 30 us against MKL's 12 us; even at 50 x 128 x 512; 8 % faster at 100 x 256 x 1024).
ONEDNN_MIN_MACS = 2**23


def activation(name: str | None, x: Tensor, in_place: bool = False) -> Tensor:
    """act(x); `in_place` writes it over x (a tensor nothing else reads: no fresh [..., d_mlp] buffer)."""
    if name == "relu":
        return F.relu(x, inplace=in_place)
    if name in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        approximate = "none" if name == "gelu" else "tanh"
        return torch.ops.aten.gelu_(x, approximate=approximate) if in_place else F.gelu(x, approximate=approximate)
    if name == "silu":
        return F.silu(x, inplace=in_place)
    raise InvalidInputError(f"unknown act_fn {name!r}")


def _onednn(x: Tensor, W: Tensor, b: Tensor | None) -> bool:
    """Whether oneDNN takes x [rows, n_in] @ W [n_in, n_out] + b: float32 on CPU, no autograd, rows unit-strided and
    W dense in either order (a W whose rows are a slice of wider ones, W[:, :n], sends oneDNN to a reference kernel
    ~1,000x slower: 16 s for a 512 x 2048 x 576 product; MKL takes those)."""
    dense_W = W.is_contiguous() or W.t().is_contiguous()
    grad = torch.is_grad_enabled() and (x.requires_grad or W.requires_grad or (b is not None and b.requires_grad))
    return (
        _ONEDNN_LINEAR is not None
        and x.device.type == W.device.type == "cpu"
        and x.dtype == W.dtype == torch.float32
        and (b is None or (b.dtype == torch.float32 and b.is_contiguous()))
        and x.stride(-1) == 1
        and dense_W
        and x.shape[0] * W.shape[0] * W.shape[1] >= ONEDNN_MIN_MACS
        and not grad
    )


def affine(x: Tensor, W: Tensor, b: Tensor | None = None, act: str | None = None, onednn: bool = True) -> Tensor:
    """act(x W + b): x [..., n_in], W [n_in, n_out] (any strides), b [n_out] or None -> [..., n_out] (a fresh
    tensor). `onednn=False` keeps the product on torch.addmm: mixture-of-experts layers, whose many weight matrices
    each see a few hundred rows per call, run 1.2x faster there (model/moe.py)."""
    x2 = x.reshape(-1, x.shape[-1])  # [rows, n_in]
    if onednn and _onednn(x2, W, b) and (act is None or act in _EPILOGUES):
        attr, algorithm = _EPILOGUES[act] if act is not None else ("none", "")
        assert _ONEDNN_LINEAR is not None  # (_onednn checked it)
        out = _ONEDNN_LINEAR(x2, W.t(), b, attr, [], algorithm)  # W.t(): [n_out, n_in]
    else:
        out = x2 @ W if b is None else torch.addmm(b, x2, W)
        if act is not None:  # the product is fresh: nothing else reads it, unless autograd keeps it for backward
            out = activation(act, out, in_place=not out.requires_grad)
    return out.view(*x.shape[:-1], W.shape[-1])
