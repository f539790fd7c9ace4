"""Reading a GGUF file's metadata and tensors by name, for the architecture readers (gguf.py, gguf_experts.py):
`Metadata` gives typed scalars whose errors name the file and the key; `Tensors` checks each tensor's shape before
it is dequantised (gguf_quants.py) and refuses a file with tensors nobody read."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError
from circuits_core.formats.gguf_header import GGUFHeader, TensorInfo
from circuits_core.formats.gguf_quants import chunk_rows, dequantize, dequantize_transposed, read_rows
from circuits_core.formats.load_watchdog import checkpoint
from circuits_core.schedule import split_loop

F32 = torch.float32


class Metadata:
    """Typed reads of a GGUF header's scalars; errors name the file and the key."""

    def __init__(self, header: GGUFHeader):
        self.header, self.name = header, header.name

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.value(key, default)

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{self.name}: metadata {key} must be a non-negative integer, got {value!r}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise CheckpointError(f"{self.name}: metadata {key} must be a number, got {value!r}")
        return float(value)


class Tensors:
    """The tensors of a GGUF file by name; `take` checks a tensor's shape, then dequantises it."""

    def __init__(self, header: GGUFHeader):
        self.header, self.name = header, header.name
        self.raw = dict(header.tensors)

    def info(self, key: str, shape: tuple[int, ...], optional: bool = False) -> TensorInfo | None:
        """The directory entry of tensor `key` (taken: it counts as read), its shape checked."""
        info = self.raw.pop(key, None)
        if info is None:
            if optional:
                return None
            raise CheckpointError(f"{self.name}: missing tensor {key} (expected shape {list(shape)})")
        if info.shape != shape:
            raise CheckpointError(f"{self.name}: tensor {key}: expected shape {list(shape)}, given {list(info.shape)}")
        return info

    def need(self, key: str, shape: tuple[int, ...]) -> Tensor:
        info = self.info(key, shape)
        assert info is not None
        return dequantize(self.header, info)

    def need_transposed(self, key: str, shape: tuple[int, ...]) -> Tensor:
        """Matrix `key` of stored shape `shape` (or a stack of them), as its contiguous float32 transpose (the last two
        axes swapped)."""
        info = self.info(key, shape)
        assert info is not None
        return dequantize_transposed(self.header, info)

    def embeddings(self, d_vocab: int, d: int, scale: float | None) -> tuple[Tensor, Tensor]:
        """(W_E [d_vocab, d_model] times `scale` (None: as stored), W_U [d_model, d_vocab]) in one pass over
        token_embd (and output.weight when the file has one: untied)."""
        embed = self.info("token_embd.weight", (d_vocab, d))
        output = self.info("output.weight", (d_vocab, d), optional=True)
        assert embed is not None
        W_E = torch.empty(d_vocab, d)
        W_U = torch.empty(d, d_vocab) if output is None else dequantize_transposed(self.header, output)
        factor = torch.tensor(scale if scale is not None else 1.0, dtype=F32)

        def fill(part: slice) -> None:  # one chunk of rows: its rows of W_E (and columns of the tied W_U)
            checkpoint()  # the load's watchdog (load_watchdog.py; a no-op in the helper thread)
            rows = read_rows(self.header, embed, part)  # [n, d_model]
            if output is None:
                W_U[:, part].copy_(rows.T)  # tied: the unscaled embedding
            if scale is None:
                W_E[part].copy_(rows)
            else:
                torch.mul(rows, factor, out=W_E[part])

        # The largest tensor by far (Gemma 3: 262,144 x 640, decoded, scaled and transposed: about half the load on
        # one thread), so both cores share it when the load runs on one torch thread (schedule.one_thread).
        split_loop(d_vocab, chunk_rows(embed), fill, "qkov-gguf-embedding")
        return W_E, W_U

    def finish(self) -> None:
        if self.raw:
            names = list(self.raw)
            why = " (rope_freqs: llama3-style rope scaling is not supported)" if "rope_freqs.weight" in names else ""
            raise CheckpointError(f"{self.name}: {len(names)} unexpected tensor(s): {', '.join(names[:8])}{why}")
