"""One .safetensors file: its header parsed under bounds, its tensors read with pread (never a memory map).

Layout: 8 bytes (little-endian u64 N), N bytes of JSON header, then the tensors' bytes. The header maps each tensor
name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data after the header), plus an optional
"__metadata__" object of strings.

What parsing a header may cost is bounded before and while it is parsed, so a hostile file is refused early, by
name, while every real checkpoint loads (a real header lists hundreds to a few thousand tensors in tens of KiB to a
few MiB: Llama-3.1-8B's largest shard names 104 tensors in 12 KiB):
    HEADER_MAX_BYTES    the header's length (the length word is checked before anything else is read);
    TENSORS_MAX         entries per file: counted as the parser finishes each entry's object, so a header of
                        millions of tiny entries stops at the first one over, before the rest is built;
    NAME_MAX_CHARS      a tensor's name, and each metadata key and value (METADATA_MAX_CHARS for a value);
    DIMS_MAX            dimensions of a shape; the header nests exactly as the format says (entry objects holding
                        lists of integers), anything deeper is refused.
Reading with pread (not a memory map): a file truncated or replaced while its tensors are read would be a SIGBUS
through a mapping, killing the process; here each tensor is read from the same file the header came from (inode,
size and modification time checked on every read) to its last byte, else a CheckpointError naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError
from circuits_core.formats.load_watchdog import checkpoint, reserve

HEADER_MAX_BYTES = 16 * 1024 * 1024  # safetensors' own reader allows 100 MB
TENSORS_MAX = 65_536  # entries of one file's header
NAME_MAX_CHARS = 1024  # a tensor's name (real ones: under 100 characters), a metadata key
METADATA_MAX_CHARS = 65_536  # a metadata value
DIMS_MAX = 8  # dimensions of one tensor's shape

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class HeaderBoundExceeded(ValueError):
    """A header over one of the bounds (raised from inside the parser, so the rest is never built)."""


def _entry_or_metadata(pairs: list[tuple[str, Any]], counter: list[int]) -> dict[str, Any]:
    """object_pairs_hook of the header parser: called for every JSON object as soon as it is complete (entries
    first, the top-level object last), so the count and the lengths are checked as the parse goes."""
    counter[0] += 1
    checkpoint()  # the load's watchdog (load_watchdog.py)
    if counter[0] > TENSORS_MAX + 2:  # the entries, __metadata__ and the top-level object
        raise HeaderBoundExceeded(f"the header lists more than {TENSORS_MAX} tensors")
    for key, value in pairs:
        if len(key) > NAME_MAX_CHARS:
            raise HeaderBoundExceeded(f"a name of {len(key)} characters (at most {NAME_MAX_CHARS}): {key[:60]!r}...")
        if isinstance(value, str) and len(value) > METADATA_MAX_CHARS:
            raise HeaderBoundExceeded(
                f"{key[:60]!r}: a value of {len(value)} characters (at most {METADATA_MAX_CHARS})"
            )
        if isinstance(value, list) and len(value) > DIMS_MAX:
            raise HeaderBoundExceeded(f"{key[:60]!r}: a list of {len(value)} items (shapes have at most {DIMS_MAX})")
    return dict(pairs)


def parse_header(raw: bytes) -> dict[str, Any]:
    """The header's JSON under the module's bounds; ValueError (HeaderBoundExceeded, JSONDecodeError) otherwise."""
    counter = [0]
    header = json.loads(raw, object_pairs_hook=lambda pairs: _entry_or_metadata(pairs, counter))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    for key, entry in header.items():
        if not isinstance(entry, dict) or any(isinstance(v, dict | list) and _nested(v) for v in entry.values()):
            raise HeaderBoundExceeded(f"{key[:60]!r}: not an entry of the format (an object of strings and lists)")
    return header


def _nested(value: dict[str, Any] | list[Any]) -> bool:
    """Whether an entry's field holds an object or list inside it (the format's fields are flat)."""
    items = value.values() if isinstance(value, dict) else value
    return any(isinstance(v, dict | list) for v in items)


Identity = tuple[int, int, int, int, int]


def file_identity(st: os.stat_result) -> Identity:
    """(device, inode, size, mtime, ctime) in nanoseconds: any write changes it (read_digest.py says why)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class SafetensorsFile:
    """The header of one .safetensors file, parsed under bounds; its tensors read one at a time with pread."""

    def __init__(self, path: Path, name: str):
        self.name, self.path = name, path
        try:
            with path.open("rb") as handle:
                self.identity_taken_ns = time.time_ns()  # (no later than the identity: read_digest's racy rule)
                self.identity = file_identity(os.fstat(handle.fileno()))
                self.size = self.identity[2]
                head = os.pread(handle.fileno(), 8, 0)
                if len(head) < 8:
                    raise ValueError(f"{len(head)} bytes: too short for a header length")
                (size,) = struct.unpack("<Q", head)
                if size > HEADER_MAX_BYTES:
                    raise HeaderBoundExceeded(f"a header of {size} bytes (at most {HEADER_MAX_BYTES})")
                if not 0 < size <= self.size - 8:
                    raise ValueError(f"header length {size} does not fit the file of {self.size} bytes")
                raw = os.pread(handle.fileno(), size, 8)
                if len(raw) < size:
                    raise ValueError("the file ended inside its header")
                self.header = raw
            header = parse_header(raw)
        except (OSError, ValueError, struct.error, RecursionError) as exc:  # JSONDecodeError is a ValueError
            detail = "header nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise CheckpointError(f"{name}: not a readable safetensors file ({detail})") from exc
        self.base = 8 + size
        self.entries: dict[str, Any] = {k: v for k, v in header.items() if k != "__metadata__"}

    def shape(self, key: str) -> tuple[int, ...]:
        entry = self.entries[key]
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise CheckpointError(f"{self.name}: tensor {key}: malformed shape {shape!r}")
        return tuple(shape)

    def stored_dtype(self, key: str) -> torch.dtype:
        """The dtype tensor `key` is stored in; CheckpointError for a name the format does not define."""
        name = self.entries[key].get("dtype")
        if name not in DTYPES:
            raise CheckpointError(f"{self.name}: tensor {key}: unknown dtype {name!r} ({', '.join(DTYPES)})")
        return DTYPES[name]

    def span(self, key: str, source: torch.dtype) -> tuple[int, int]:
        """(file offset, bytes) of tensor `key` stored as `source`, checked against its shape and the file."""
        offsets = self.entries[key].get("data_offsets")
        nbytes = math.prod(self.shape(key)) * source.itemsize
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or offsets[1] - offsets[0] != nbytes
            or offsets[0] < 0
            or self.base + offsets[1] > self.size
        ):
            raise CheckpointError(f"{self.name}: tensor {key}: data offsets {offsets!r} do not hold {nbytes} bytes")
        return self.base + offsets[0], nbytes

    def stored_bytes(self, key: str, start: int, nbytes: int) -> Tensor:
        """The tensor's stored bytes [nbytes] (uint8), from the same file its header came from, read to the last
        byte into an uninitialised buffer (a bytearray would first zero every page the read then writes)."""
        changed = CheckpointError(f"{self.name}: the file changed while it was being read (tensor {key}); load again")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        try:
            with self.path.open("rb") as handle:
                if file_identity(os.fstat(handle.fileno())) != self.identity:
                    raise changed
                view, done = buffer.numpy().data, 0
                while done < nbytes:
                    n = os.preadv(handle.fileno(), [view[done:]], start + done)
                    if n <= 0:
                        raise changed  # truncated under us
                    done += n
        except OSError as exc:
            raise CheckpointError(f"{self.name}: tensor {key}: not readable ({exc})") from exc
        return buffer

    def stored(self, key: str, source: torch.dtype | None = None) -> Tensor:
        """Tensor `key` as stored (shape and dtype), in a buffer of its own (no copy beyond the read)."""
        checkpoint()  # the load's watchdog (load_watchdog.py)
        source = source or self.stored_dtype(key)
        shape = self.shape(key)
        start, nbytes = self.span(key, source)
        reserve(nbytes, f"tensor {key} of {self.name}")  # one read is one native step: refused before it runs
        if not nbytes:
            return torch.empty(shape, dtype=source)
        return self.stored_bytes(key, start, nbytes).view(source).view(shape)


def read_safetensors(path: Path, name: str) -> dict[str, Tensor]:
    """Every tensor of one file, as stored, each in its own buffer (a file of `n` bytes costs about `n`)."""
    weights = SafetensorsFile(path, name)
    return {key: weights.stored(key) for key in weights.entries}
