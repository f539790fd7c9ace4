"""State dicts: read weight files without trusting pickle, check them against a model, then build it.

A state dict here always uses TransformerLens names and shapes (see circuits_core/model.py): format
converters (weights.py, formats_hf.py) translate into it, `build_model` checks every key and shape and only
then constructs the Transformer -- nothing is ever half-loaded.

Safety: `.safetensors` is read with safetensors; `.bin` / `.pth` / `.pt` only through
`torch.load(weights_only=True)`, which refuses any pickle that would build an arbitrary object or call a
function. Errors name the file, the key, and the expected vs given shape.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from circuits_core.config import ModelConfig
from circuits_core.errors import CheckpointError
from circuits_core.model import Transformer

SAFE_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".bin", ".pth", ".pt")
# Common wrappers around a state dict in torch.save files (training scripts save {"model": state_dict}).
_WRAPPER_KEYS = ("state_dict", "model", "model_state_dict")


def folder_listing(folder: Path) -> str:
    """The file names in a folder, for error messages ("found: config.json, weights.bin")."""
    return ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"


def read_weight_file(path: Path) -> dict[str, Tensor]:
    """All tensors of one weight file, on the CPU, as stored (no dtype change)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file not found")
    if path.suffix in SAFE_SUFFIXES:
        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    if path.suffix not in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: unknown weight file type; expected one of {SAFE_SUFFIXES + PICKLE_SUFFIXES}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: refused to unpickle: the file holds more than tensors (weights_only=True). "
            f"Convert it to .safetensors from a trusted environment. Detail: {str(exc).splitlines()[0]}"
        ) from exc
    except (RuntimeError, OSError, EOFError, ValueError, AttributeError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a readable torch file ({type(exc).__name__}: {exc})") from exc
    if isinstance(obj, Mapping) and not all(isinstance(v, Tensor) for v in obj.values()):
        inner = [k for k in _WRAPPER_KEYS if isinstance(obj.get(k), Mapping)]
        if inner:
            obj = obj[inner[0]]
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()):
        raise CheckpointError(f"{path}: expected a state dict (names -> tensors), got {type(obj).__name__}")
    return dict(obj)


def read_weight_files(paths: Iterable[Path]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Merge the tensors of several files (shards): (state dict, key -> file name it came from)."""
    state: dict[str, Tensor] = {}
    origin: dict[str, str] = {}
    for path in paths:
        for key, value in read_weight_file(path).items():
            if key in state:
                raise CheckpointError(f"{path}: key {key!r} is also in {origin[key]}")
            state[key], origin[key] = value, path.name
    return state, origin


def files_digest(paths: Iterable[Path]) -> str:
    """sha256 over (name, bytes) of the given files, in name order: the checkpoint's cache key."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """TransformerLens key -> shape for a model of this config (built on the meta device: no memory)."""
    with torch.device("meta"):
        skeleton = Transformer(cfg)
    return {name: tuple(param.shape) for name, param in skeleton.named_parameters()}


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_state_dict(cfg: ModelConfig, state: Mapping[str, Tensor], origin: Mapping[str, str] | str) -> None:
    """Raise CheckpointError unless `state` has exactly the keys and shapes of Transformer(cfg)."""

    def where(key: str) -> str:
        return origin if isinstance(origin, str) else origin.get(key, "converted weights")

    expected = expected_shapes(cfg)
    source = origin if isinstance(origin, str) else ", ".join(sorted(set(origin.values()))) or "weights"
    missing = [k for k in expected if k not in state]
    if missing:
        shown = ", ".join(f"{k} {_fmt(expected[k])}" for k in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"{source}: missing {len(missing)} key(s) the config needs: {shown}{more}")
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        shown = ", ".join(unexpected[:8])
        raise CheckpointError(
            f"{where(unexpected[0])}: {len(unexpected)} key(s) this config has no place for: {shown}"
            f"{' ...' if len(unexpected) > 8 else ''} (does config.json match the weights?)"
        )
    for key, shape in expected.items():
        given = state[key]
        if tuple(given.shape) != shape:
            raise CheckpointError(f"{where(key)}: key {key}: expected shape {_fmt(shape)}, given {_fmt(given.shape)}")
        if not given.is_floating_point():
            raise CheckpointError(f"{where(key)}: key {key}: expected a floating-point tensor, given {given.dtype}")


def build_model(
    cfg: ModelConfig, state: Mapping[str, Tensor], dtype: torch.dtype, origin: Mapping[str, str] | str
) -> Transformer:
    """Check the whole state dict first, then construct the model in `dtype` (eval, requires_grad False)."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise CheckpointError(f"dtype must be a floating-point torch dtype, got {dtype}")
    check_state_dict(cfg, state, origin)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict({k: v.to(dtype=dtype).contiguous() for k, v in state.items()}, strict=True, assign=True)
    return model.requires_grad_(False).eval()
