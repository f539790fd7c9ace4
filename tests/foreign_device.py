"""A second device on a machine that has only one: the model's tensors are tagged "foreign" and every tensor op is
watched (a TorchFunctionMode), so a computation that would fail on a GPU fails here, on the CPU, with real values.

What CUDA refuses, and so what `ForeignDevice` refuses: an op whose tensor inputs lie on two devices (the model's
and the host's), except a 0-dim host tensor (a scalar, which CUDA accepts). Indexing, as ATen does it:
- `t[index]` (aten.index): host index tensors are moved to t's device; index tensors on the model's device into a
  host t are refused ("indices should be either on cpu or on the same device as the indexed tensor (cpu)"), masks
  as well; a 0-dim integer or bool index is read as a number (`.item()`), so it may lie anywhere;
- `t[index] = v` (index_put_): the index tensors may lie anywhere (moved to t's device); v must lie on t's device
  unless it is 0-dim; with no index tensor of one or more dimensions (`t[2:] = v`) it is a copy, across devices;
- index_select, gather, take, take_along_dim: t and its index on one device, even a 0-dim host index (no scalar
  exception there, unlike elementwise ops).
Where a tensor lies, as on a GPU:
- a tensor read from the model (a parameter or buffer, tagged by `ForeignDevice(model)`) is foreign;
- a factory (`torch.zeros`, `torch.tensor`, `torch.arange`...) that names no device makes a host tensor, as on a
  machine with a GPU; `t.cpu()` is a host tensor;
- the device object of a tensor on the model's device (`t.device`, so `model.device` too) is the model's device: a
  factory told it (`torch.arange(n, device=W.device)`), or `t.to(it)`, makes a tensor on the model's device;
- a factory that names another device (`device="cpu"`, a device object made elsewhere), or `t.to(device)` of a host
  tensor to one, is "placed": on this machine every device object reads `cpu`, so which one it named is unknown,
  and a placed tensor may meet either side (it then takes that side);
- `t.to(other)` follows `other`; `t.to(dtype)`, `t.to(device)` of a foreign tensor and `t.cuda()` keep or make it
  foreign; an op's outputs are foreign when an input is (elementwise ops, products, `zeros_like`, views...), host
  when a host input of one or more dimensions is, else placed.
Since the real values are computed (on the CPU), eigenvalues, SVDs, `.item()` and data-dependent control flow all
run: nothing is skipped, unlike on the meta device, where they cannot.

Blind spots: a factory naming the host explicitly (`device="cpu"`) is "placed", so it may meet the model's tensors
unnoticed; a device object the mode did not hand out (a module's stored `torch.device`) is not known as the
model's; and a TorchFunctionMode watches its own thread only (cost.side_by_side must run its branches in turn).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

Place = Literal["foreign", "host", "placed"]
_GET_ITEM = {Tensor.__getitem__, torch.ops.aten.index.Tensor}
_PUT_ITEM = {Tensor.__setitem__, Tensor.index_put, Tensor.index_put_, torch.index_put, torch.index_put_}
_SAME_DEVICE = {
    f
    for name in ("index_select", "gather", "take", "take_along_dim")
    for f in (getattr(Tensor, name), getattr(torch, name))
}
_FOLLOW_SELF = {Tensor.copy_, Tensor.new_zeros, Tensor.new_ones, Tensor.new_empty, Tensor.new_full, Tensor.new_tensor}


class DeviceMixError(AssertionError):
    """An op mixed the model's device with the host: on a GPU, 'Expected all tensors to be on the same device'."""


class ForeignDevice(TorchFunctionMode):
    """Within `with ForeignDevice(model):`, the model's tensors act as if on another device (see the module doc).
    One instance may be entered many times: tensors it tagged (buffers an analysis keeps) stay tagged."""

    def __init__(self, tensors: nn.Module | Iterable[Tensor]):
        super().__init__()
        self.places = WeakIdKeyDictionary()  # tensor -> "foreign" | "placed", by identity (== is elementwise)
        items = list(tensors.parameters()) + list(tensors.buffers()) if isinstance(tensors, nn.Module) else tensors
        for t in items:
            self.places[t] = "foreign"
        self.devices: dict[int, object] = {}  # id -> a device object read off a tensor on the model's device (held)
        self.ops = 0  # ops watched
        self.foreign_ops = 0  # ops whose outputs are on the model's device (a test checks the mode saw the work)

    def place(self, t: Tensor) -> Place:
        return self.places.get(t, "host")  # type: ignore[no-any-return]

    def is_foreign(self, t: Tensor) -> bool:
        return self.place(t) == "foreign"

    def is_model_device(self, device: object) -> bool:
        """Whether `device` is a device object read off a tensor on the model's device."""
        return self.devices.get(id(device)) is device

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") in ("__get__", "__set__") or func in (Tensor.__repr__, Tensor.__format__):
            # attribute access (t.shape, t.device...), printing; t.T, t.mT, t.data are t's views, on its device
            if isinstance(out, Tensor) and args and isinstance(args[0], Tensor) and self.place(args[0]) != "host":
                self.places[out] = self.place(args[0])
            if getattr(func, "__self__", None) is Tensor.device and args and self.is_foreign(args[0]):
                self.devices[id(out)] = out  # t.device of a tensor on the model's device: that device
            return out
        self.ops += 1
        place = self._placement(func, args, kwargs)
        if func in (Tensor.cpu, Tensor.cuda, Tensor.to) and out is args[0] and place != self.place(out):
            out = out.view_as(out)  # a move on this machine returns t itself: an alias stands for the moved copy
        if place != "host":
            self.foreign_ops += place == "foreign"
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor):
                    self.places[t] = place
        return out

    def _placement(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Place:
        """Where the op's outputs lie; DeviceMixError when its inputs could not meet on one device."""
        name = getattr(func, "__name__", str(func))
        if func is Tensor.cpu:
            return "host"
        if func is Tensor.cuda:
            return "foreign"
        if func is Tensor.to:
            target = _to_target(args[1:], kwargs)
            if isinstance(target, Tensor):
                return self.place(target)
            if target is not None:
                return "foreign" if self.is_foreign(args[0]) or self.is_model_device(target) else "placed"
            return self.place(args[0])
        if kwargs.get("device") is not None:  # a factory (or *_like) told where to put its result
            return "foreign" if self.is_model_device(kwargs["device"]) else "placed"
        if func in _FOLLOW_SELF:
            return self.place(args[0])
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        if func in _GET_ITEM or func in _PUT_ITEM:
            tensors = self._indexed(func, name, args, kwargs)
        strict = func in _SAME_DEVICE
        on_model = [t for t in tensors if self.is_foreign(t)]
        on_host = [t for t in tensors if self.place(t) == "host" and (t.dim() > 0 or strict)]
        if on_model and on_host:
            shapes = ", ".join(str(tuple(t.shape)) for t in on_host[:4])
            raise DeviceMixError(
                f"{name}: tensors on the model's device mixed with host tensors of shape {shapes} "
                "(on a GPU: 'Expected all tensors to be on the same device')"
            )
        if on_model:
            return "foreign"
        if on_host or not tensors:
            return "host"
        return "placed" if any(self.place(t) == "placed" for t in tensors) else "host"

    def _indexed(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
        """t[index], t[index] = v, index_put(t, indices, v): the tensors that must share a device (t, and v where it
        is written by index); DeviceMixError where t is a host tensor read at indices on the model's device."""
        base = args[0]
        index = [
            t for t in tree_flatten(args[1] if len(args) > 1 else kwargs.get("indices"))[0] if isinstance(t, Tensor)
        ]
        if func in (Tensor.__getitem__, Tensor.__setitem__):  # Python indexing reads a 0-dim integer index as a number
            index = [t for t in index if t.dim() > 0]
        if func in _GET_ITEM:
            if self.place(base) == "host" and any(self.is_foreign(t) for t in index):
                raise DeviceMixError(
                    f"{name}: a host tensor indexed by a tensor on the model's device (on a GPU: 'indices should be "
                    "either on cpu or on the same device as the indexed tensor (cpu)')"
                )
            return [base]
        value = args[2] if len(args) > 2 else kwargs.get("values")
        if not index or not isinstance(value, Tensor) or value.dim() == 0:
            return [base]  # a copy (t[2:] = v), or a 0-dim value (moved to t's device)
        return [base, value]


def _to_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Where t.to(...) sends t: a device, a tensor (its device), or None (a dtype-only conversion)."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    if "other" in kwargs:
        return kwargs["other"]
    for a in args:
        if isinstance(a, Tensor):
            return a
        if isinstance(a, str) or type(a).__name__ == "device":
            return a
    return None
