"""GGUF checkpoints (llama.cpp's single-file format) of the Llama family, read with the `gguf` library.

A GGUF file carries the architecture and hyper-parameters as metadata (`llama.block_count`, ...), the tokenizer
(`tokenizer.ggml.*`) and the tensors, many of them quantised (Q4_1, Q8_0, ...). `gguf.quants.dequantize`
(the ggml project's own reference code) turns each tensor back into float32, one tensor at a time.

Layouts (ggml stores a linear layer like nn.Linear, [d_out, d_in] rows; TransformerLens uses x @ W):
    token_embd.weight  [d_vocab, d_model]            -> embed.W_E
    blk.l.attn_q.weight [n_heads * d_head, d_model]  -> blocks.l.attn.W_Q  [n_heads, d_model, d_head]
    blk.l.attn_k/v      [n_kv * d_head, d_model]     -> blocks.l.attn._W_K/_W_V [n_kv, d_model, d_head]
    blk.l.attn_output   [d_model, n_heads * d_head]  -> blocks.l.attn.W_O  [n_heads, d_head, d_model]
    blk.l.ffn_gate/up   [d_mlp, d_model]             -> blocks.l.mlp.W_gate / W_in [d_model, d_mlp]
    blk.l.ffn_down      [d_model, d_mlp]             -> blocks.l.mlp.W_out [d_mlp, d_model]
    blk.l.attn_norm, ffn_norm, output_norm           -> ln1.w, ln2.w, ln_final.w (RMSNorm gains)
    output.weight       [d_vocab, d_model]           -> unembed.W_U = output.T (absent: tied, W_E.T)

Rotary layout, the classic trap: llama.cpp's converter permutes the Q and K rows of "llama" models so that
ADJACENT dims (2i, 2i+1) form the rotary pairs (Hugging Face files pair i with i + d_head/2). Reading a GGUF
with the rotate-half layout still runs and gives plausible but wrong numbers (SmolLM2: 12.9 nats instead of
3.0 on the repeated half of a random sequence), so the config says `rotary_adjacent_pairs=True`. "qwen2"
files are not permuted (rotate-half) and add blk.l.attn_q/k/v.bias -> b_Q [n_heads, d_head], _b_K/_b_V.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from circuits_core.errors import CheckpointError, InvalidInputError
from circuits_core.formats.llama import laid_out, one_thread
from circuits_core.formats.tokenizer import Tokenizer
from circuits_core.model.config import ModelConfig

State = dict[str, Tensor]
F32 = torch.float32
GGUF_SUFFIX = ".gguf"
# architecture (general.architecture) -> its Q/K rows are in adjacent-pairs order. llama.cpp writes Llama,
# Mistral and SmolLM models as "llama" (Q/K rows permuted); Qwen2 files keep Hugging Face's rotate-half rows
# (llama.cpp runs them with its NEOX rope) and carry q/k/v biases. Other families are refused by name.
ARCHITECTURES: dict[str, bool] = {"llama": True, "qwen2": False}
# tokenizer.ggml.pre -> split every digit before byte-level BPE (llama.cpp's pre-tokenizer regexes: the
# "smollm"/"starcoder" group adds \p{N} before GPT-2's pattern, the "gpt-2" group is GPT-2's pattern alone).
PRE_TOKENIZERS: dict[str, bool] = {
    "gpt-2": False, "gpt2": False, "mpt": False, "olmo": False, "jais": False,
    "smollm": True, "starcoder": True, "refact": True, "command-r": True, "codeshell": True, "exaone": True,
    "minerva-7b": True,
}  # fmt: skip
CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4  # tokenizer.ggml.token_type values that encode as themselves


def gguf_file(folder: Path) -> str | None:
    """The name of the one `.gguf` file in a model folder, None when there is none; several are refused (which
    one would the model be?). Files beside it (a summary, qkov.json) do not count."""
    found = sorted(p.name for p in folder.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        raise CheckpointError(f"several .gguf files ({', '.join(found)}); a model folder holds one model")
    return found[0] if found else None


class _Reader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map: the same bytes, but each slice skips
    np.memmap's bookkeeping, which made parsing SmolLM2's 98k vocabulary and merge strings ~3x slower. Arrays of
    strings and numbers (the vocabulary, merges, token types) are split in one pass with struct instead of one
    recursive call per element; the parts, data indices and types are the library's own (tested field by field
    against GGUFReader)."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)  # still backed by the memory map (value stays its .base)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        ARRAY, STRING = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
        data = self._plain
        if self.byte_order != "I" or raw_type != ARRAY or orig_offs + 12 > len(data):
            return super()._get_field_parts(orig_offs, raw_type)  # type: ignore[no-any-return]
        raw_itype, alen = (
            data[orig_offs : orig_offs + 4].view(np.uint32),
            data[orig_offs + 4 : orig_offs + 12].view(np.uint64),
        )
        itype, count = int(raw_itype[0]), int(alen[0])
        nptype = self.gguf_scalar_to_np.get(gguf.GGUFValueType(itype)) if itype != STRING else None
        if itype != STRING and nptype is None:  # arrays of arrays: the library's own recursion
            return super()._get_field_parts(orig_offs, raw_type)  # type: ignore[no-any-return]
        parts: list[np.ndarray] = [raw_itype, alen]
        idxs: list[int] = []
        offs = orig_offs + 12
        if itype == STRING:
            length = struct.Struct("<Q").unpack_from
            buffer = data.data  # a memoryview of the same bytes
            for _ in range(count):
                (size,) = length(buffer, offs)
                if offs + 8 + size > len(data):
                    raise ValueError(f"string at offset {offs} runs past the end of the file")
                parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + size])
                idxs.append(len(parts) - 1)
                offs += 8 + size
        else:
            assert nptype is not None
            width = np.dtype(nptype).itemsize
            if offs + width * count > len(data):
                raise ValueError(f"array at offset {offs} runs past the end of the file")
            values = data[offs : offs + width * count].view(nptype)
            parts += (values[i : i + 1] for i in range(count))
            idxs += range(2, 2 + count)
            offs += width * count
        return (
            offs - orig_offs,
            parts,
            idxs,
            [gguf.GGUFValueType(raw_type)] + ([gguf.GGUFValueType(itype)] if count else []),
        )


def _reader(path: Path) -> Any:
    try:
        return _Reader(path, "r")
    except (OSError, ValueError, KeyError, IndexError, struct.error) as exc:
        raise CheckpointError(f"{path.name}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


class _Metadata:
    """The key/value fields of a GGUF file, read with checks; errors name the file and the key."""

    def __init__(self, reader: Any, name: str):
        self.fields, self.name = reader.fields, name

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{self.name}: metadata {key} is not readable ({exc})") from exc

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{self.name}: metadata {key} must be a non-negative integer, got {value!r}")
        return value

    def float(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise CheckpointError(f"{self.name}: metadata {key} must be a number, got {value!r}")
        return float(value)


def gguf_config(meta: _Metadata, d_vocab: int, attention_bias: bool = False) -> ModelConfig:
    """ModelConfig of a Llama-family GGUF from its metadata (`{arch}.block_count`, ...). `attention_bias`: the
    file has q/k/v biases (Qwen2); the model's other biases (b_O, MLP, b_U) are then zero."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{meta.name}: architecture {arch!r} is not supported; GGUF architectures read here: "
            f"{', '.join(ARCHITECTURES)} (the Llama family)"
        )
    if meta.get(f"{arch}.expert_count", 0):
        raise CheckpointError(f"{meta.name}: mixture-of-experts models ({arch}.expert_count) are not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise CheckpointError(f"{meta.name}: rope scaling type {scaling!r} is not supported in GGUF files (none only)")
    d_model, n_heads = meta.int(f"{arch}.embedding_length"), meta.int(f"{arch}.attention.head_count")
    if n_heads < 1 or d_model % n_heads:
        raise CheckpointError(f"{meta.name}: embedding_length {d_model} is not divisible by head_count {n_heads}")
    d_head = meta.int(f"{arch}.attention.key_length", d_model // n_heads)
    n_kv = meta.int(f"{arch}.attention.head_count_kv", n_heads)
    try:
        return ModelConfig(
            n_layers=meta.int(f"{arch}.block_count"), d_model=d_model, n_heads=n_heads, d_head=d_head,
            d_vocab=d_vocab, n_ctx=meta.int(f"{arch}.context_length"), d_mlp=meta.int(f"{arch}.feed_forward_length"),
            attn_only=False, normalization_type="RMS", positional_embedding_type="rotary", act_fn="silu",
            gated_mlp=True, n_key_value_heads=n_kv, eps=meta.float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            use_bias=attention_bias, rotary_dim=meta.int(f"{arch}.rope.dimension_count", d_head),
            rotary_base=meta.float(f"{arch}.rope.freq_base", 10000.0), rotary_adjacent_pairs=ARCHITECTURES[arch],
            bos_token_id=_token_id(meta, "tokenizer.ggml.bos_token_id", d_vocab),
        )  # fmt: skip
    except (InvalidInputError, TypeError) as exc:
        raise CheckpointError(f"{meta.name}: {exc}") from exc


def _token_id(meta: _Metadata, key: str, d_vocab: int) -> int | None:
    """The token id the metadata names under `key` (None when absent); an id outside the vocabulary is refused,
    since every answer would otherwise start from another BOS than the file says."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < d_vocab:
        raise CheckpointError(f"{key} {value!r} is not a token id (vocabulary {d_vocab})")
    return value


def _scale(blocks: Tensor, start: int) -> Tensor:
    """The fp16 numbers at bytes start, start + 1 of each block, [n, 1] float32, converted by numpy as the
    reference is (torch turns a NaN scale into another NaN bit pattern)."""
    return torch.from_numpy(blocks[:, start : start + 2].contiguous().numpy().view(np.float16).astype(np.float32))


def _blocks_q8_0(blocks: Tensor) -> Tensor:
    """Q8_0 blocks [n, 34] (fp16 scale d, 32 int8 q) -> [n, 32] float32 q * d."""
    d = _scale(blocks, 0)  # [n, 1]
    return blocks[:, 2:].view(torch.int8).float().mul_(d)


def _nibbles(qs: Tensor) -> Tensor:
    """[n, 16] bytes -> [n, 32] uint8: the 16 low nibbles, then the 16 high ones (ggml's Q4 order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _blocks_q4_0(blocks: Tensor) -> Tensor:
    """Q4_0 blocks [n, 18] (fp16 d, 16 bytes of nibbles q) -> [n, 32] float32 d * (q - 8)."""
    d = _scale(blocks, 0)
    return (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float().mul_(d)


def _blocks_q4_1(blocks: Tensor) -> Tensor:
    """Q4_1 blocks [n, 20] (fp16 d, fp16 m, 16 bytes of nibbles q) -> [n, 32] float32 d * q + m (two roundings,
    as the reference: a multiply, then an add, never fused)."""
    d, m = _scale(blocks, 0), _scale(blocks, 2)
    return _nibbles(blocks[:, 4:]).float().mul_(d).add_(m)


# The commonest block types, in torch (vectorised, multi-threaded; bit-identical to gguf.quants, tested):
# type -> (bytes per block of 32 values, decoder). Every other type goes through gguf.quants.dequantize.
_TORCH_BLOCKS: dict[Any, tuple[int, Callable[[Tensor], Tensor]]] = {
    gguf.GGMLQuantizationType.Q8_0: (34, _blocks_q8_0),
    gguf.GGMLQuantizationType.Q4_0: (18, _blocks_q4_0),
    gguf.GGMLQuantizationType.Q4_1: (20, _blocks_q4_1),
}


def dequantize(tensor: Any, name: str) -> Tensor:
    """One GGUF tensor as float32, in numpy's (row-major, reversed ggml) shape, owning its memory."""
    fast = _TORCH_BLOCKS.get(tensor.tensor_type)
    raw = tensor.data  # [rows, bytes per row] of the memory map (quantised types)
    if fast is not None and raw.dtype == np.uint8 and raw.ndim >= 1 and raw.shape[-1] % fast[0] == 0:
        size, decode = fast
        blocks = torch.from_numpy(np.array(raw)).view(-1, size)  # a private copy of the (small) quantised bytes
        return decode(blocks).view(*raw.shape[:-1], raw.shape[-1] // size * 32)
    try:
        array = gguf.quants.dequantize(raw, tensor.tensor_type)
    except (NotImplementedError, ValueError) as exc:
        raise CheckpointError(
            f"{name}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf library cannot "
            f"dequantise ({exc})"
        ) from exc
    if array.base is not None or not array.flags.writeable or array.dtype != np.float32:  # a view of the file
        array = np.array(array, dtype=np.float32)
    return torch.from_numpy(array)


class _Tensors:
    """The tensors of a GGUF file by name; `take` dequantises one and checks its shape."""

    def __init__(self, reader: Any, name: str):
        self.raw = {t.name: t for t in reader.tensors}
        self.name = name

    def take(self, key: str, shape: tuple[int, ...], optional: bool = False) -> Tensor | None:
        tensor = self.raw.pop(key, None)
        if tensor is None:
            if optional:
                return None
            raise CheckpointError(f"{self.name}: missing tensor {key} (expected shape {list(shape)})")
        value = dequantize(tensor, self.name)
        if tuple(value.shape) != shape:
            raise CheckpointError(f"{self.name}: tensor {key}: expected shape {list(shape)}, given {list(value.shape)}")
        return value

    def need(self, key: str, shape: tuple[int, ...]) -> Tensor:
        value = self.take(key, shape)
        assert value is not None
        return value

    def finish(self) -> None:
        if self.raw:
            names = list(self.raw)
            why = " (rope_freqs: llama3-style rope scaling is not supported)" if "rope_freqs.weight" in names else ""
            raise CheckpointError(f"{self.name}: {len(names)} unexpected tensor(s): {', '.join(names[:8])}{why}")


def gguf_state(cfg: ModelConfig, tensors: _Tensors) -> State:
    """TransformerLens state dict of a Llama-family GGUF (see the module docstring for the layouts)."""
    d, H, dh, d_vocab = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_vocab
    n_kv, d_mlp = cfg.n_key_value_heads or H, cfg.d_mlp or 0
    W_E = tensors.need("token_embd.weight", (d_vocab, d))
    sd: State = {"embed.W_E": W_E, "ln_final.w": tensors.need("output_norm.weight", (d,))}
    for layer in range(cfg.n_layers):
        b, p = f"blk.{layer}", f"blocks.{layer}"
        sd[f"{p}.ln1.w"] = tensors.need(f"{b}.attn_norm.weight", (d,))
        sd[f"{p}.ln2.w"] = tensors.need(f"{b}.ffn_norm.weight", (d,))
        W_Q = tensors.need(f"{b}.attn_q.weight", (H * dh, d))  # rows (head, d_head) in adjacent-pairs order
        sd[f"{p}.attn.W_Q"] = laid_out(W_Q.view(H, dh, d).transpose(1, 2), F32)  # [n_heads, d_model, d_head]
        for x in "KV":
            W = tensors.need(f"{b}.attn_{x.lower()}.weight", (n_kv * dh, d))
            sd[f"{p}.attn._W_{x}"] = laid_out(W.view(n_kv, dh, d).transpose(1, 2), F32)  # [n_kv, d_model, d_head]
        if cfg.use_bias:  # q/k/v biases [heads * d_head] -> [heads, d_head]; the rest of the model has none
            sd[f"{p}.attn.b_Q"] = tensors.need(f"{b}.attn_q.bias", (H * dh,)).reshape(H, dh)
            sd[f"{p}.attn._b_K"] = tensors.need(f"{b}.attn_k.bias", (n_kv * dh,)).reshape(n_kv, dh)
            sd[f"{p}.attn._b_V"] = tensors.need(f"{b}.attn_v.bias", (n_kv * dh,)).reshape(n_kv, dh)
            sd[f"{p}.attn.b_O"], sd[f"{p}.mlp.b_in"], sd[f"{p}.mlp.b_out"] = (
                torch.zeros(d),
                torch.zeros(d_mlp),
                torch.zeros(d),
            )
        W_O = tensors.need(f"{b}.attn_output.weight", (d, H * dh))  # [d_model(out), n_heads * d_head(in)]
        sd[f"{p}.attn.W_O"] = laid_out(W_O.T.view(H, dh, d), F32)  # [n_heads, d_head, d_model]
        # Each tensor made contiguous as it is read, so its file-order copy is freed at once (peak: one tensor).
        sd[f"{p}.mlp.W_gate"] = laid_out(tensors.need(f"{b}.ffn_gate.weight", (d_mlp, d)).T, F32)  # [d_model, d_mlp]
        sd[f"{p}.mlp.W_in"] = laid_out(tensors.need(f"{b}.ffn_up.weight", (d_mlp, d)).T, F32)  # [d_model, d_mlp]
        sd[f"{p}.mlp.W_out"] = laid_out(tensors.need(f"{b}.ffn_down.weight", (d, d_mlp)).T, F32)  # [d_mlp, d_model]
    output = tensors.take("output.weight", (d_vocab, d), optional=True)
    sd["unembed.W_U"] = laid_out((output if output is not None else W_E).T, F32)  # [d_model, d_vocab] (tied: a copy)
    if cfg.use_bias:
        sd["unembed.b_U"] = torch.zeros(d_vocab)
    tensors.finish()
    return sd


def gguf_tokenizer(meta: _Metadata, bos_token_id: int | None) -> Tokenizer | None:
    """The byte-level BPE described by `tokenizer.ggml.*`; None when the file has no tokenizer; CheckpointError
    naming the tokenizer model or pre-tokenizer when it is one this code does not build."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        return None
    if model != "gpt2":
        raise CheckpointError(
            f"{meta.name}: tokenizer.ggml.model {model!r} is not supported (byte-level BPE 'gpt2' only); "
            f"convert the file's tokenizer to a tokenizer.json"
        )
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{meta.name}: tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges", [])
    types = meta.get("tokenizer.ggml.token_type", [])
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise CheckpointError(f"{meta.name}: tokenizer.ggml.tokens is not a list of strings")
    pairs = [tuple(m.split(" ")) for m in merges] if isinstance(merges, list) else []
    if len(pairs) != len(merges) or any(len(pair) != 2 for pair in pairs):
        raise CheckpointError(f"{meta.name}: tokenizer.ggml.merges must be strings 'left right'")
    special = [t for t, kind in zip(tokens, types, strict=False) if kind in (CONTROL_TOKEN, USER_DEFINED_TOKEN)]
    return Tokenizer.from_bpe(
        tokens, pairs, special, split_digits=PRE_TOKENIZERS[pre], bos_token_id=bos_token_id,  # type: ignore[arg-type]
        source=f"{meta.name} (tokenizer.ggml.*)",
    )  # fmt: skip


def read_gguf(
    path: Path, check: Callable[[ModelConfig], None] | None = None
) -> tuple[ModelConfig, State, dict[str, str], Tokenizer | None]:
    """(config, TransformerLens state dict in float32, key -> file name, tokenizer) of one GGUF file.

    `check(cfg)` runs once the config is known, before any tensor is dequantised (a price check may refuse)."""
    reader = _reader(path)
    meta, tensors = _Metadata(reader, path.name), _Tensors(reader, path.name)
    embed = tensors.raw.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{path.name}: missing tensor token_embd.weight")
    d_vocab = int(embed.shape[-1])  # ggml shape [d_model, d_vocab]
    cfg = gguf_config(meta, d_vocab, attention_bias="blk.0.attn_q.bias" in tensors.raw)
    if check is not None:
        check(cfg)
    tokenizer = gguf_tokenizer(meta, cfg.bos_token_id)
    if tokenizer is not None and tokenizer.vocab_size > d_vocab:
        raise CheckpointError(f"{path.name}: tokenizer has {tokenizer.vocab_size} tokens, the model only {d_vocab}")
    with one_thread():  # thousands of short ops: see formats_llama.one_thread
        state = gguf_state(cfg, tensors)
    return cfg, state, dict.fromkeys(state, path.name), tokenizer
