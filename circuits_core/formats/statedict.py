"""State dicts: read weight files without trusting pickle, check them against a model, then build it.

A state dict here always uses TransformerLens names and shapes (see circuits_core/model/transformer.py): format
converters (detect.py's REGISTRY) translate into it, `build_model` checks every key and shape and only
then constructs the Transformer -- nothing is ever half-loaded.

Safety: `.safetensors` is read by safetensors_file.py (its header parsed under bounds, tensors read with pread);
`.bin` / `.pth` / `.pt` only through
`torch.load(weights_only=True)`, which refuses any pickle that would build an arbitrary object or call a
function. Errors name the file, the key, and the expected vs given shape.

Files stay in their folder: every file a checkpoint names (shard index entries, tokenizer files, GGUF...) is
found with `folder_file`, which refuses absolute names, `..` and symlinks leading out of the model folder;
`check_contained` refuses a folder holding any such symlink before a loader runs. Messages name files
relative to the model folder, never by a server path. `read_json_object` reads the JSON a checkpoint carries
(bounded size and nesting), `model_config` its config fields as a ModelConfig. `load_bytes` prices a model from
its config before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError, InvalidInputError
from circuits_core.formats.load_watchdog import reserve
from circuits_core.formats.safetensors_file import read_safetensors
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer

SAFE_SUFFIXES = (".safetensors",)
PICKLE_SUFFIXES = (".bin", ".pth", ".pt")
# Common wrappers around a state dict in torch.save files (training scripts save {"model": state_dict}).
_WRAPPER_KEYS = ("state_dict", "model", "model_state_dict")
JSON_MAX_BYTES = 16 * 1024 * 1024  # config.json, qkov.json, shard indexes, cards (tokenizer.json: its own reader)
JSON_MAX_DEPTH = 64  # nesting of any JSON a checkpoint carries (real configs nest 3-4 deep)
CONTAINED_MAX_ENTRIES = 10_000  # entries of a model folder walked by check_contained


def folder_file(folder: Path, name: str | os.PathLike[str]) -> Path:
    """The file `name` (as a checkpoint names it) inside `folder`; CheckpointError if it would lie outside.

    Refused: a non-string or empty name, an absolute path, any `..` part, and a path that resolves (through
    symlinks) outside the folder. The returned path is resolved. Existence is not checked here.
    """
    if not isinstance(name, str | os.PathLike) or not str(name) or "\0" in str(name):
        raise CheckpointError(f"a file name in the checkpoint is not a usable name: {str(name)[:80]!r}")
    rel = PurePosixPath(str(name))
    if rel.is_absolute() or str(name).startswith("\\"):  # shown by its last part only: never a server path
        raise CheckpointError(
            f"an absolute path (.../{rel.name[:80]}): files named by a checkpoint must lie inside its folder"
        )
    if ".." in rel.parts:
        raise CheckpointError(f"{str(name)[:80]!r}: files named by a checkpoint must lie inside its folder")
    root = folder.resolve()
    try:
        resolved = (root / rel).resolve()
    except (RuntimeError, OSError) as exc:  # a symlink loop
        raise CheckpointError(f"{rel}: a symlink loop; refused") from exc
    if not resolved.is_relative_to(root):
        raise CheckpointError(f"{rel}: a symlink leading outside the model folder; refused")
    return resolved


def check_contained(folder: Path) -> None:
    """Refuse a folder holding a symlink (at any depth) that resolves outside it, before anything is read."""
    root = folder.resolve()
    stack, seen = [root], 0
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                seen += 1
                if seen > CONTAINED_MAX_ENTRIES:
                    raise CheckpointError(f"the model folder holds more than {CONTAINED_MAX_ENTRIES} entries")
                path = Path(entry.path)
                try:
                    target = path.resolve() if entry.is_symlink() else path
                except (RuntimeError, OSError) as exc:  # a symlink loop
                    raise CheckpointError(f"{path.relative_to(root)}: a symlink loop; refused") from exc
                if not target.is_relative_to(root):
                    raise CheckpointError(
                        f"{path.relative_to(root)}: a symlink leading outside the model folder; refused"
                    )
                if entry.is_dir(follow_symlinks=False):
                    stack.append(path)


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def read_json_object(folder: Path, name: str) -> dict[str, Any]:
    """A JSON object file of the checkpoint (inside the folder, bounded size and nesting); errors name `name`."""
    path = folder_file(folder, name)
    try:
        size = path.stat().st_size
        if size > JSON_MAX_BYTES:
            raise CheckpointError(f"{name}: {size} bytes; JSON files of a checkpoint are at most {JSON_MAX_BYTES}")
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        detail = "nested too deeply" if isinstance(exc, RecursionError) else type(exc).__name__
        if isinstance(exc, ValueError):
            detail = str(exc)[:200]
        raise CheckpointError(f"{name}: not readable JSON ({detail})") from exc
    # Depth first: whether a deep file raises RecursionError in json.loads depends on the interpreter's limit.
    if _depth(data) > JSON_MAX_DEPTH:
        raise CheckpointError(f"{name}: JSON nested too deeply (more than {JSON_MAX_DEPTH} levels)")
    if not isinstance(data, dict):
        raise CheckpointError(f"{name}: expected a JSON object, got {type(data).__name__}")
    return data


def model_config(data: dict[str, Any], path: Path, **overrides: Any) -> ModelConfig:
    """A ModelConfig from a checkpoint's config fields (+ overrides); a bad field is a CheckpointError naming `path`."""
    try:
        return ModelConfig.from_dict({**data, **overrides})
    except (InvalidInputError, TypeError) as exc:
        raise CheckpointError(f"{path.name}: {exc}") from exc


def folder_listing(folder: Path) -> str:
    """The file names in a folder, for error messages ("found: config.json, weights.bin")."""
    return ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"


def read_weight_file(path: Path) -> dict[str, Tensor]:
    """All tensors of one weight file, on the CPU, as stored (no dtype change)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file not found")
    if path.suffix in SAFE_SUFFIXES:  # bounded header, read with pread (safetensors_file.py)
        return read_safetensors(path, path.name)
    if path.suffix not in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: unknown weight file type; expected one of {SAFE_SUFFIXES + PICKLE_SUFFIXES}")
    # torch.load is one native step: the load's watchdog refuses it before it runs when it would cross the limit
    reserve(check_archive_records(path), f"reading {path.name}")
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


def check_archive_records(path: Path) -> int:
    """Refuse a torch zip archive whose records would expand before torch.load could check anything: torch.save
    writes every record stored (uncompressed), so a compressed record is refused by name, and the records' declared
    sizes must fit in the file itself (a stored record is its own bytes). Read from the zip's central directory
    only: nothing is inflated. The legacy (non-zip) format holds raw bytes and is bounded by the file's size.
    Returns the bytes torch.load will read into memory: the records' declared sizes (the file's size if legacy)."""
    size = path.stat().st_size
    if not zipfile.is_zipfile(path):
        return size
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable torch archive ({exc})") from exc
    for info in records:
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"{path}: record {info.filename!r} is compressed ({info.compress_size} bytes declared to expand to "
                f"{info.file_size}); torch.save stores records uncompressed, so this file is refused before "
                "anything is inflated. Re-save it with torch.save or convert it to .safetensors"
            )
        if info.file_size > size or info.file_size != info.compress_size:
            raise CheckpointError(
                f"{path}: record {info.filename!r} declares {info.file_size} bytes in a file of {size} bytes"
            )
    declared = sum(info.file_size for info in records)
    if declared > size:
        raise CheckpointError(f"{path}: its records declare more bytes than the file's {size}")
    return declared


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


def load_bytes(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the parameters and buffers of Transformer(cfg) in `dtype`, priced before anything is allocated.

    Exact, and it follows model.py: a model without layers and one with a single layer are built on the meta
    device (no memory), and the single layer's share is multiplied by n_layers.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()

    def count(n_layers: int) -> int:
        with torch.device("meta"):
            types = cfg.attn_types[:n_layers] if cfg.attn_types is not None else None  # one per layer kept
            skeleton = Transformer(dataclasses.replace(cfg, n_layers=n_layers, attn_types=types))
        return sum(t.numel() for t in (*skeleton.parameters(), *skeleton.buffers()))

    outer = count(0)
    per_layer = count(1) - outer if cfg.n_layers else 0
    return (outer + cfg.n_layers * per_layer) * itemsize


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
