"""The peak memory a computation holds, counted op by op: the tests' measure of what a price must cover."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class HeldBytes(TorchDispatchMode):
    """The peak bytes of the storages that tensors made inside the mode keep alive (pre-existing ones, such as
    the model's weights, excluded), checked after every operation."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in existing}
        self.storages: dict[int, tuple[int, list[weakref.ref[torch.Tensor]]]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in self.skip or storage.nbytes() == 0:
                    continue
                nbytes, refs = self.storages.get(key, (storage.nbytes(), []))
                self.storages[key] = (max(nbytes, storage.nbytes()), [*refs, weakref.ref(t)])
        held = 0
        for key, (nbytes, refs) in list(self.storages.items()):
            alive = [r for r in refs if r() is not None]
            if alive:
                self.storages[key] = (nbytes, alive)
                held += nbytes
            else:
                del self.storages[key]
        self.peak = max(self.peak, held)
        return out
