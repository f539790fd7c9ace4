"""What parsing a safetensors header or a tokenizer.json may cost, bounded per entry.

Hostile headers (hundreds of thousands of empty entries, a huge name, an oversized header) are refused by name,
measured in a fresh process: the peak RSS grows by about the header's bytes where the previous reader built every
entry. A tokenizer.json larger than the model's vocabulary needs is refused before it is parsed, while a
Gemma-3-sized one (262,144 entries, about 515,000 merges, over 30 MB, written by the `tokenizers` library) loads into a
checkpoint whose embedding has 262,144 rows and encodes text like the library itself."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from circuits_core.errors import CheckpointError
from circuits_core.formats import safetensors_file
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.load_watchdog import LOAD_MEMORY_ALLOWANCE, LOAD_MEMORY_MULTIPLE
from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.formats.statedict import load_bytes, read_weight_file
from circuits_core.formats.tokenizer import TOKENIZER_BASE_BYTES, TOKENIZER_BYTES_PER_TOKEN, Tokenizer
from circuits_core.model.config import ModelConfig
from circuits_core.model.transformer import Transformer

REPO = Path(__file__).resolve().parents[2]

MEASURE = """
import json, sys, time
from pathlib import Path
from circuits_core.errors import CheckpointError
from circuits_core.formats.load_watchdog import LOAD_MEMORY_ALLOWANCE, LOAD_MEMORY_MULTIPLE
from circuits_core.formats.statedict import load_bytes, read_weight_file
def status(field):  # KiB; VmHWM is this process's peak (ru_maxrss would carry the parent's peak across exec)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
before = status("VmRSS")
start = time.perf_counter()
try:
    read_weight_file(Path(sys.argv[1]))
    outcome = "loaded"
except CheckpointError as exc:
    outcome = str(exc)
grown = status("VmHWM") - before
print(json.dumps({"outcome": outcome, "grown_kib": grown, "seconds": time.perf_counter() - start}))
"""


def _measured(path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path)], cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _raw_safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_a_header_of_a_million_tiny_entries_stops_at_the_bound(tmp_path):
    """250,000 well-formed empty tensors (a 14.7 MB header, under the header-length bound): refused when the parser
    finishes entry TENSORS_MAX + 1, before the rest is built."""
    n = 250_000
    entry = b'"%07d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    header = b"{" + b",".join(entry % i for i in range(n)) + b"}"
    assert len(header) < safetensors_file.HEADER_MAX_BYTES
    got = _measured(_raw_safetensors(tmp_path / "model.safetensors", header))
    assert "model.safetensors" in got["outcome"]
    assert f"more than {safetensors_file.TENSORS_MAX} tensors" in got["outcome"]
    # The previous reader (safetensors' own) returned 250,000 empty tensors: +350 MiB and 12.9 s, at load ~3. Stopping
    # at the bound costs the header's bytes twice (read, decoded) and 65,537 entries: +67 MiB, 1.4 s.
    assert got["grown_kib"] < 128 * 1024, got


def test_a_huge_name_and_an_oversized_header_are_refused(tmp_path):
    name = "w" * (safetensors_file.NAME_MAX_CHARS + 1)
    header = json.dumps({name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path = _raw_safetensors(tmp_path / "named.safetensors", header, b"\0\0\0\0")
    with pytest.raises(CheckpointError, match=r"named\.safetensors.*a name of 1025 characters"):
        read_weight_file(path)
    deep = {"w": {"dtype": "F32", "shape": [[[1]]], "data_offsets": [0, 4]}}
    path = _raw_safetensors(tmp_path / "deep.safetensors", json.dumps(deep).encode(), b"\0\0\0\0")
    with pytest.raises(CheckpointError, match=r"deep\.safetensors.*not an entry of the format"):
        read_weight_file(path)
    dims = {"w": {"dtype": "F32", "shape": [1] * (safetensors_file.DIMS_MAX + 1), "data_offsets": [0, 4]}}
    path = _raw_safetensors(tmp_path / "dims.safetensors", json.dumps(dims).encode(), b"\0\0\0\0")
    with pytest.raises(CheckpointError, match=r"dims\.safetensors.*shapes have at most"):
        read_weight_file(path)
    # The length word alone refuses an oversized header: nothing after it is read (the file is only 8 + 16 bytes).
    path = tmp_path / "long.safetensors"
    path.write_bytes(struct.pack("<Q", safetensors_file.HEADER_MAX_BYTES + 1) + b"{}" + b" " * 14)
    with pytest.raises(CheckpointError, match=r"long\.safetensors.*a header of \d+ bytes \(at most"):
        read_weight_file(path)


def test_real_files_read_as_safetensors_writes_them(tmp_path):
    """Every dtype the format names, read back equal to what safetensors wrote, with its metadata."""
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 2).to(torch.bfloat16),
        "i64": torch.arange(7),
        "mask": torch.tensor([True, False, True]),
        "u8": torch.arange(6, dtype=torch.uint8).view(2, 3),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x" * 1000})
    got = read_weight_file(path)
    assert set(got) == set(tensors)
    for key, value in tensors.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def _gemma_sized_tokenizer() -> HFTokenizer:
    """A BPE of 262,144 entries built from 64 three-byte characters: the 64 characters, their 4,096 pairs and
    258,048 triples, each pair and triple reachable by two merges (prefix + last, first + suffix) as SentencePiece's
    rebuilt vocabularies are: 262,144 - 64 + 258,048 = 520,128 merges, about Gemma 3's 515,000."""
    chars = [chr(0x4E00 + i) for i in range(64)]  # CJK ideographs: 3 bytes each in UTF-8
    vocab: dict[str, int] = {c: i for i, c in enumerate(chars)}
    merges: list[tuple[str, str]] = []
    for a in chars:
        for b in chars:
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    for a in chars:
        for b in chars:
            for c in chars:
                if len(vocab) == 262_144:
                    break
                vocab[a + b + c] = len(vocab)
                merges.append((a + b, c))
                merges.append((a, b + c))
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return hf


def test_a_gemma_sized_tokenizer_loads_and_an_oversized_one_is_refused_before_parsing(tmp_path):
    hf = _gemma_sized_tokenizer()
    text = hf.to_str(pretty=True)
    assert hf.get_vocab_size() == 262_144 and len(text.encode()) > 30_000_000  # Gemma 3's is about 33 MB
    cfg = ModelConfig(
        n_layers=1, d_model=8, n_heads=2, d_head=4, d_mlp=16, d_vocab=262_144, n_ctx=16, act_fn="gelu", bos_token_id=0
    )
    torch.manual_seed(0)
    folder = save_checkpoint(Transformer(cfg), tmp_path / "gemma-sized", tokenizer_json=text)
    # This stand-in's weights are 16 MiB (d_model 8), so the load watchdog (load_watchdog.py) would refuse parsing a
    # 32 MB tokenizer beside them; it gets the limit a model of Gemma 3 270M's shape has (its float32 weights).
    gemma = ModelConfig(
        n_layers=18, d_model=640, n_heads=4, n_key_value_heads=1, d_head=256, d_mlp=2048, d_vocab=262_144,
        n_ctx=32_768, act_fn="gelu", normalization_type="RMS", positional_embedding_type="rotary",
    )  # fmt: skip
    gemma_limit = int(LOAD_MEMORY_MULTIPLE * load_bytes(gemma)) + LOAD_MEMORY_ALLOWANCE
    loaded = load_checkpoint(folder, memory_allowance=gemma_limit)
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == 262_144
    sample = "\u4e00\u4e01\u4e02 \u4e3f\u4e3f \u4e05"
    assert loaded.tokenizer.encode(sample, prepend_bos=False) == hf.encode(sample).ids  # the library's own ids
    # ids by construction of the vocabulary: 64 characters, then pairs at 64 + 64 a + b, then triples after them
    assert loaded.tokenizer.encode(sample, prepend_bos=False) == [64 + 4096 + 1 * 64 + 2, 64 + 63 * 64 + 63, 5]

    # The same file beside a model of 32,000 tokens: over 32,000 x 512 + 8 MiB bytes, refused from its size alone.
    allowance = TOKENIZER_BASE_BYTES + TOKENIZER_BYTES_PER_TOKEN * 32_000
    assert len(text.encode()) > allowance
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: \d+ bytes for a model of 32000 tokens"):
        Tokenizer.from_folder(folder, max_tokens=32_000)
    assert time.perf_counter() - start < 1.0  # (parsing it takes seconds)


def test_a_vocabulary_longer_than_the_embedding_is_refused(tmp_path):
    """Under the byte allowance but listing more entries than W_E has rows: refused by count after the parse."""
    vocab = {f"t{i}": i for i in range(5000)}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=2, d_head=4, d_mlp=16, d_vocab=1000, n_ctx=16, act_fn="gelu")
    folder = save_checkpoint(Transformer(cfg), tmp_path / "short", tokenizer_json=hf.to_str())
    with pytest.raises(CheckpointError, match="tokenizer has 5000 tokens, the model only 1000"):
        load_checkpoint(folder)
