"""The cache key of a load that defers tensors: the bytes it reads, hashed as they are read, and the identity of the
files it has not read yet.

A load's digest (LoadedModel.digest) is the key of every cached answer of the model, so it must change whenever a
weight the model reads could differ. `statedict.files_digest` hashes every byte of every weight file; for a
Llama-family load whose MLP weights are deferred (lazy_mlp.py) that is a second read of the whole checkpoint, MLP
included: 15.7 GB at Llama-3.1-8B shape, of which the load itself reads 4.5 GiB (99 s of hashing on the other core
at load average ~7, longer than the load). `ReadDigest` keys such a load by:
- every shard's name, size and header (the name, dtype, shape and offsets of every tensor, deferred ones included);
- for each tensor the load reads: the sha256 of its stored bytes, hashed from the buffer the read already filled (on
  the background thread, at most PENDING buffers waiting, so nothing is read twice and the hashing runs beside the
  conversions);
- for each shard holding a tensor the load defers: the file's identity, (device, inode, size, mtime, ctime) in
  nanoseconds. Writing a file sets its ctime to the current time and nothing but the system clock sets it back
  (utime sets mtime and atime only), so a file whose identity is unchanged holds the bytes it held at the load.
  DeferredMLP reads a deferred tensor only from shards whose identity is still the one in the key (else the model
  is loaded again: a CheckpointError says so), so every weight the model ever uses is covered by its key;
- a shard whose ctime is within RACY_S of the moment its identity was taken is hashed whole instead (git's "racy"
  rule: a write in the same timestamp tick as the one before, after the identity was taken, would leave it equal).

What this gives up: the deferred tensors are keyed by where they are, not by their bytes, so two copies of one
checkpoint (other inodes) or a restored backup get other keys than the original: only cache misses, never a wrong
hit. Loads that read every tensor (eager loads, other formats) keep `files_digest`, the content key.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.formats.safetensors_file import Identity, SafetensorsFile
from circuits_core.formats.statedict import files_digest

PENDING = 2  # stored buffers waiting for the hashing thread at most (each one tensor's bytes, already read)
RACY_S = 2.0  # a shard changed this recently is hashed whole (timestamp ticks are milliseconds on most filesystems)


def _sha256(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()  # (hashlib releases the GIL on large buffers)


class ReadDigest:
    """What a deferring load read and what it deferred, hashed into one key (see the module docstring).
    `start(job)` runs a job on the load's background thread (schedule.in_background's Background.start)."""

    def __init__(self, start: Callable[[Callable[[], str]], Future[str]]):
        self._start = start
        self._slots = threading.BoundedSemaphore(PENDING)
        self._tensors: dict[tuple[str, str], Future[str]] = {}  # (shard, tensor) -> sha256 of its stored bytes
        self._headers: dict[str, str] = {}  # shard -> "size sha256(header)"
        self._deferred: dict[str, tuple[Path, Identity, int]] = {}  # shards holding a deferred tensor
        self.identities: dict[str, Identity] = {}  # every shard's file identity when its header was read

    def shard(self, shard: SafetensorsFile) -> None:
        """A shard's name, size and header bytes (every tensor's name, dtype, shape and offsets), and its identity
        (DeferredMLP reads only from files that still have it)."""
        self._headers[shard.name] = f"{shard.size} {_sha256(shard.header)}"
        self.identities[shard.name] = shard.identity

    def read(self, name: str, key: str, stored: Tensor) -> None:
        """Tensor `key` of shard `name`, as stored (a contiguous buffer the read filled): hashed in the background;
        waits while PENDING buffers are already waiting."""
        self._slots.acquire()
        data = stored.reshape(-1).view(torch.uint8)

        def job() -> str:
            try:
                return _sha256(data.numpy().data)
            finally:
                self._slots.release()

        self._tensors[(name, key)] = self._start(job)

    def settle(self) -> None:
        """Wait until every buffer handed to `read` is hashed: called before the loader returns, so nothing the
        model does to a tensor kept as read (no conversion, no copy) can reach its hash."""
        for job in self._tensors.values():
            job.result()

    def deferred(self, shard: SafetensorsFile) -> None:
        """`shard` holds a tensor the load did not read: keyed by its file's identity (taken no earlier than
        shard.identity_taken_ns)."""
        self._deferred[shard.name] = (shard.path, shard.identity, shard.identity_taken_ns)

    def hexdigest(self) -> str:
        """The key: headers, the read tensors' hashes, the deferred shards' identities (or, racy, whole hashes)."""
        lines = [f"shard {name} {header}" for name, header in sorted(self._headers.items())]
        lines += [f"read {name} {key} {job.result()}" for (name, key), job in sorted(self._tensors.items())]
        for name, (path, identity, taken_ns) in sorted(self._deferred.items()):
            if taken_ns - identity[4] < RACY_S * 1e9:  # changed moments before: its identity alone might not tell
                lines.append(f"whole {name} {files_digest([path])}")
            else:
                lines.append(f"deferred {name} {' '.join(map(str, identity))}")
        return _sha256("\n".join(lines).encode())
