"""The header of a GGUF file (llama.cpp's single-file format), read lazily and bounded by what qkov reads.

Layout (little-endian; the GGUF specification, versions 2 and 3):
    magic "GGUF", u32 version, u64 tensor_count, u64 kv_count,
    kv_count x (string key, u32 value type, value),
    tensor_count x (string name, u32 n_dims, n_dims x u64 dims, u32 ggml type, u64 offset),
    padding to `general.alignment` (default 32), then the tensor data.
A string is a u64 byte length and that many UTF-8 bytes; an array is a u32 item type, a u64 count and the items.

What is read, and when:
- Opening a file walks the key/value section once without building a Python object per array element: each key is
  indexed by where its value starts; arrays of numbers are stepped over by count x width, arrays of strings by
  their length prefixes only (2 M empty strings: one pass over 16 MB, no string made). gguf's own reader makes
  an object for every element of every array, whatever is read later (3.4 GiB of RSS for a 15 MB file).
- `value(key)` decodes one scalar when asked; `strings(key, limit)` and `numbers(key, limit)` decode one array,
  refusing it by name when it holds more items than `limit` (the caller's bound from the model's config: the
  vocabulary from the embedding's rows, the merges from a multiple of it).
- The tensor directory (name, shape, type, offset) is read whole: it is what a load needs.
- Tensor bytes are read with pread into private buffers (`read_bytes`), never through a memory map, so a file
  truncated while it is read gives a CheckpointError naming it, not a SIGBUS.
Bounds: 65,536 keys, 65,536 tensors, 4 dimensions per tensor (ggml's GGML_MAX_DIMS), arrays nested 4 deep;
every length is checked against the file's size before it is used. Big-endian files are refused by name.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from circuits_core.errors import CheckpointError
from circuits_core.formats.load_watchdog import checkpoint

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_KEYS = 65_536
MAX_TENSORS = 65_536
MAX_DIMS = 4
MAX_NESTING = 4
WINDOW = 1 << 20  # bytes of the header read at a time
DEFAULT_ALIGNMENT = 32
T = gguf.GGUFValueType
# value type -> struct format (little-endian) of one item
SCALARS: dict[Any, str] = {
    T.UINT8: "B", T.INT8: "b", T.UINT16: "H", T.INT16: "h", T.UINT32: "I", T.INT32: "i", T.FLOAT32: "f",
    T.BOOL: "?", T.UINT64: "Q", T.INT64: "q", T.FLOAT64: "d",
}  # fmt: skip


@dataclass(frozen=True)
class Field:
    """One metadata key: its value type, where its value starts, and for an array the item type and count."""

    kind: Any  # gguf.GGUFValueType
    offset: int
    item: Any = None  # gguf.GGUFValueType of an array's items
    count: int = 0


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the directory: `shape` in numpy's order (ggml's dims reversed), absolute data offset."""

    name: str
    shape: tuple[int, ...]
    ggml_type: Any  # gguf.GGMLQuantizationType
    offset: int
    nbytes: int


class _Cursor:
    """Sequential reads over a file through a window of its bytes (pread; no memory map)."""

    def __init__(self, fd: int, size: int, name: str):
        self.fd, self.size, self.name = fd, size, name
        self.pos, self.start, self.buf = 0, 0, b""

    def fail(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.name}: not a readable GGUF file ({why})")

    def _fill(self, n: int) -> None:
        if self.pos + n > self.size:
            raise self.fail(f"{n} bytes at offset {self.pos} run past the end of the file ({self.size} bytes)")
        self.start = self.pos
        self.buf = os.pread(self.fd, max(n, WINDOW), self.pos)
        if len(self.buf) < n:
            raise self.fail(f"the file ended at {self.start + len(self.buf)} bytes while being read (changed?)")

    def take(self, n: int) -> bytes:
        rel = self.pos - self.start
        if rel < 0 or rel + n > len(self.buf):
            self._fill(n)
            rel = 0
        self.pos += n
        return self.buf[rel : rel + n]

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"a value of {n} bytes at offset {self.pos} runs past the end of the file")
        self.pos += n

    def string(self) -> bytes:
        return self.take(self._length())

    def _length(self) -> int:
        n = int(self.unpack("Q"))
        if self.pos + n > self.size:
            raise self.fail(f"a string of {n} bytes at offset {self.pos} runs past the end of the file")
        return n

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings by their length prefixes alone (no string is made)."""
        length = struct.Struct("<Q").unpack_from
        pos, start, buf, size = self.pos, self.start, self.buf, self.size
        for _ in range(count):
            rel = pos - start
            if rel < 0 or rel + 8 > len(buf):
                self.pos = pos
                self._fill(8)
                start, buf, rel = self.start, self.buf, 0
            (n,) = length(buf, rel)
            pos += 8 + n
            if pos > size:
                raise self.fail(f"a string of {n} bytes runs past the end of the file")
        self.pos = pos


def _value_type(cursor: _Cursor, raw: int, what: str) -> Any:
    try:
        return T(raw)
    except ValueError:
        raise cursor.fail(f"{what} has unknown value type {raw}") from None


class GGUFHeader:
    """The metadata index and tensor directory of one GGUF file (see the module docstring). Errors name the file."""

    def __init__(self, path: Path):
        self.path, self.name = path, path.name
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.name}: not a readable GGUF file ({exc.strerror})") from exc
        try:
            self._parse()
        except BaseException:
            os.close(self._fd)
            raise

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> GGUFHeader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- parsing -----------------------------------------------------------------------------------------
    def _parse(self) -> None:
        size = os.fstat(self._fd).st_size
        c = self._cursor = _Cursor(self._fd, size, self.name)
        if size < 24 or c.take(4) != MAGIC:
            raise c.fail("no GGUF magic number")
        version = c.unpack("I")
        if version & 0xFFFF == 0 and version:
            raise CheckpointError(f"{self.name}: a big-endian GGUF file; only little-endian files are read")
        if version not in VERSIONS:
            raise CheckpointError(f"{self.name}: GGUF version {version} is not supported (versions 2 and 3)")
        self.version = version
        n_tensors, n_keys = c.unpack("Q"), c.unpack("Q")
        if n_keys > MAX_KEYS or n_tensors > MAX_TENSORS:
            raise c.fail(
                f"it declares {n_keys} metadata keys and {n_tensors} tensors; at most {MAX_KEYS} of each are read"
            )
        self.fields: dict[str, Field] = {}
        for _ in range(n_keys):
            checkpoint()  # the load's watchdog (load_watchdog.py)
            key = self._text(c.string(), "a metadata key")
            kind = _value_type(c, c.unpack("I"), f"metadata {key}")
            field = Field(kind, c.pos)
            if kind == T.ARRAY:
                item = _value_type(c, c.unpack("I"), f"metadata {key}")
                field = Field(kind, c.pos - 4, item, int(c.unpack("Q")))
                self._skip_items(item, field.count, 1)
            else:
                self._skip_items(kind, 1, 0)
            if key in self.fields:
                raise c.fail(f"metadata {key} appears twice")
            self.fields[key] = field
        infos = [self._tensor_info() for _ in range(n_tensors)]
        end = c.pos
        alignment = self.value("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or not 0 < alignment <= 1 << 20:
            raise c.fail(f"general.alignment {alignment!r} is not a positive integer")
        data = -(-end // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset, nbytes in infos:
            if offset % alignment or data + offset + nbytes > size:
                raise c.fail(f"tensor {name}: {nbytes} bytes at data offset {offset} do not fit the file")
            if name in self.tensors:
                raise c.fail(f"tensor {name} appears twice")
            self.tensors[name] = TensorInfo(name, shape, ggml_type, data + offset, nbytes)

    def _text(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._cursor.fail(f"{what} is not UTF-8 ({exc})") from exc

    def _skip_items(self, kind: Any, count: int, depth: int) -> None:
        c = self._cursor
        if kind == T.STRING:
            c.skip_strings(count)
        elif kind == T.ARRAY:
            if depth >= MAX_NESTING:
                raise c.fail(f"arrays nested more than {MAX_NESTING} deep")
            for _ in range(count):
                item = _value_type(c, c.unpack("I"), "an array item")
                self._skip_items(item, int(c.unpack("Q")), depth + 1)
        else:
            c.skip(count * struct.calcsize(SCALARS[kind]))

    def _tensor_info(self) -> tuple[str, tuple[int, ...], Any, int, int]:
        c = self._cursor
        name = self._text(c.string(), "a tensor name")
        n_dims = c.unpack("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = [int(c.unpack("Q")) for _ in range(n_dims)]
        raw_type = c.unpack("I")
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise CheckpointError(f"{self.name}: tensor {name} has unknown ggml type {raw_type}") from None
        offset = int(c.unpack("Q"))
        if dims[0] % block:
            raise c.fail(f"tensor {name}: {dims[0]} values per row is not a multiple of {block} ({ggml_type.name})")
        count = 1
        for n in dims:
            count *= n
        nbytes = count // block * type_size
        if nbytes > c.size:
            raise c.fail(f"tensor {name} of shape {dims} needs {nbytes} bytes, more than the file holds")
        return name, tuple(reversed(dims)), ggml_type, offset, nbytes

    # -- values ------------------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.fields

    def value(self, key: str, default: Any = None) -> Any:
        """The scalar under `key` (int, float, bool or str), `default` when absent; an array is refused by name."""
        field = self.fields.get(key)
        if field is None:
            return default
        if field.kind == T.ARRAY:
            raise CheckpointError(f"{self.name}: metadata {key} is an array, a single value was expected")
        c = self._cursor
        c.pos = field.offset
        if field.kind == T.STRING:
            return self._text(c.string(), f"metadata {key}")
        return c.unpack(SCALARS[field.kind])

    def count(self, key: str) -> int | None:
        """How many items the array under `key` holds (None when absent or not an array); nothing is decoded."""
        field = self.fields.get(key)
        return field.count if field is not None and field.kind == T.ARRAY else None

    def _array(self, key: str, limit: int) -> Field | None:
        field = self.fields.get(key)
        if field is None:
            return None
        if field.kind != T.ARRAY:
            raise CheckpointError(f"{self.name}: metadata {key} must be an array")
        if field.count > limit:
            raise CheckpointError(
                f"{self.name}: metadata {key} holds {field.count} items, more than the {limit} this model allows"
            )
        self._cursor.pos = field.offset + 12  # past the item type and count
        return field

    def strings(self, key: str, limit: int) -> list[str] | None:
        """The array of strings under `key` (None when absent), refused by name above `limit` items."""
        field = self._array(key, limit)
        if field is None:
            return None
        if field.item != T.STRING:
            raise CheckpointError(f"{self.name}: metadata {key} must be an array of strings")
        c = self._cursor
        length = struct.Struct("<Q").unpack_from
        out: list[str] = []
        pos, start, buf = c.pos, c.start, c.buf
        try:
            for _ in range(field.count):
                rel = pos - start
                if rel < 0 or rel + 8 > len(buf) or rel + 8 + length(buf, rel)[0] > len(buf):
                    c.pos = pos
                    out.append(c.string().decode("utf-8"))
                    pos, start, buf = c.pos, c.start, c.buf
                    continue
                (n,) = length(buf, rel)
                out.append(buf[rel + 8 : rel + 8 + n].decode("utf-8"))
                pos += 8 + n
        except UnicodeDecodeError as exc:
            raise c.fail(f"metadata {key} item {len(out)} is not UTF-8 ({exc})") from exc
        c.pos = pos
        return out

    def numbers(self, key: str, limit: int) -> np.ndarray | None:
        """The array of numbers under `key` as a numpy array (None when absent), refused above `limit` items."""
        field = self._array(key, limit)
        if field is None:
            return None
        fmt = SCALARS.get(field.item)
        if fmt is None or field.item == T.BOOL:
            raise CheckpointError(f"{self.name}: metadata {key} must be an array of numbers")
        raw = self._cursor.take(field.count * struct.calcsize(fmt))
        return np.frombuffer(raw, dtype=np.dtype("<" + fmt)).copy()

    # -- tensor bytes ------------------------------------------------------------------------------------
    def read_bytes(self, offset: int, nbytes: int) -> np.ndarray:
        """`nbytes` bytes of the file from `offset`, in a private uint8 array (a short read is refused by name)."""
        out = np.empty(nbytes, dtype=np.uint8)
        view, done = memoryview(out.data), 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(
                    f"{self.name}: the file ended at {offset + done} bytes while its tensors were read "
                    f"(it was truncated or replaced during the load)"
                )
            done += got
        return out
