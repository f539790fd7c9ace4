"""Another backend's answers on the CPU: within `with AnotherBackend():`, the answers torch leaves to the backend come
out otherwise than the CPU's kernels give them, so a result that leans on the CPU's choice fails here, as it can on a
GPU (the first GPU check: two zero path terms listed in the other order, and a singular direction of the opposite
sign, on an H200).
- torch.topk, and every sort or argsort not asked to be stable, give equal values in the reverse order of their
  indices (the highest first): topk and an unstable sort promise nothing about equal values, and the CPU's kernels
  happen to keep index order on small inputs. A sort asked to be stable (stable=True) keeps index order on every
  backend and is left as it is.
- torch.linalg.svd gives every second pair of singular vectors (u_i, v_i), i odd, and torch.linalg.eigh every
  eigenvector, times -1: each is defined up to that sign (a pair up to one common sign), and which one a backend
  returns is its own. (Not every pair: factored_svd's Grams' eigenvectors and the SVD of their core would cancel.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

_TOPK = {torch.topk, Tensor.topk}
_SORTS = {torch.sort, Tensor.sort, torch.argsort, Tensor.argsort}


def _flipped(x: Tensor, dim: int, run: Callable[[Tensor], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """run on x reversed along dim (a choice in index order there is the reverse order here)."""
    values, indices = run(x.flip(dim))
    return values, x.shape[dim] - 1 - indices


class AnotherBackend(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0  # rankings and decompositions seen (a test checks the mode saw the work it guards)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _TOPK | _SORTS or func in (torch.linalg.svd, torch.linalg.eigh):
            self.calls += 1
        if func in _TOPK:
            x, k, *rest = args
            given = dict(zip(("dim", "largest", "sorted"), rest, strict=False)) | kwargs
            dim = -1 if given.get("dim") is None else given["dim"]
            largest = given.get("largest", True)
            values, indices = _flipped(x, dim, lambda y: torch.sort(y, dim=dim, descending=largest, stable=True))
            return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))
        if func in _SORTS and not kwargs.get("stable", False):
            x, *rest = args
            given = dict(zip(("dim", "descending"), rest, strict=False)) | kwargs
            dim, descending = given.get("dim", -1), given.get("descending", False)
            values, indices = _flipped(x, dim, lambda y: torch.sort(y, dim=dim, descending=descending, stable=True))
            return indices if func in (torch.argsort, Tensor.argsort) else torch.return_types.sort((values, indices))
        if func is torch.linalg.svd:
            U, S, Vh = func(*args, **kwargs)
            r = S.shape[-1]
            sign = 1 - 2 * (torch.arange(r, device=S.device) % 2).to(U.dtype)  # [r]: 1, -1, 1, ...
            U, Vh = U.clone(), Vh.clone()
            U[..., :, :r] *= sign
            Vh[..., :r, :] *= sign[:, None]
            return torch.return_types.linalg_svd((U, S, Vh))
        if func is torch.linalg.eigh:
            L, Q = func(*args, **kwargs)
            return torch.return_types.linalg_eigh((L, -Q))
        return func(*args, **kwargs)
