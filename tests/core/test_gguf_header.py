"""The lazy GGUF reader (gguf_header.py, gguf_quants.py) against the gguf library itself, and its memory bound.

- Every metadata value (strings with unicode and empty ones, scalars of each width, number arrays of each width, an
  empty array, arrays of strings) equals what `gguf.GGUFReader` decodes, and every tensor's directory entry and
  bytes equal the library's; nested arrays are stepped over.
- The torch decoders of Q8_0, Q4_0, Q4_1, Q5_0, Q4_K and Q6_K give the bit patterns of `gguf.quants.dequantize` on
  random bytes (every fp16 scale: subnormal, infinite, NaN) and on quantised random weights.
- A file with 16 MB of metadata qkov never reads (2 M empty strings in one array) loads in under 10 s and adds
  under 200 MiB of RSS (measured in a fresh process); the library's reader makes an object per element.
- An array qkov reads (the vocabulary, the merges) larger than the model allows is refused by name before it is
  decoded: the vocabulary at one entry per row of the embedding, the merges at MERGES_PER_TOKEN per row.
- On the real SmolLM2 and Gemma-3 270M files (slow): every field and every tensor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from circuits_core.errors import CheckpointError
from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.gguf_header import GGUFHeader
from circuits_core.formats.gguf_quants import TORCH_DECODERS, decode_rows, dequantize
from circuits_core.formats.gguf_tokenizer import MERGES_PER_TOKEN
from tests.core.test_gguf import _bpe, write_gguf

Q = gguf.GGMLQuantizationType
REPO = Path(__file__).resolve().parents[2]
REAL = [
    REPO / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf",
    REPO / "models" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf",
]


def same_as_library(path: Path) -> GGUFHeader:
    ours, theirs = GGUFHeader(path), gguf.GGUFReader(path, "r")
    assert [k for k in theirs.fields if not k.startswith("GGUF.")] == list(ours.fields)
    for key, want in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        if want.types[0] != gguf.GGUFValueType.ARRAY:
            assert ours.value(key) == want.contents(), key
        elif len(want.types) > 1 and want.types[1] == gguf.GGUFValueType.STRING:
            assert ours.strings(key, len(want.data)) == want.contents(), key
        elif len(want.types) > 1 and want.types[1] != gguf.GGUFValueType.ARRAY:
            got = ours.numbers(key, len(want.data))
            assert got is not None and got.tolist() == want.contents(), key
        if want.types[0] != gguf.GGUFValueType.ARRAY:
            assert ours.count(key) is None, key
        elif want.types[1] != gguf.GGUFValueType.ARRAY:  # (the library flattens arrays of arrays)
            assert ours.count(key) == len(want.contents()), key
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert (info.offset, info.nbytes, info.ggml_type) == (tensor.data_offset, tensor.n_bytes, tensor.tensor_type)
        assert info.shape == tuple(int(n) for n in reversed(tensor.shape)), tensor.name  # numpy order
        raw = ours.read_bytes(info.offset, info.nbytes)
        assert np.array_equal(raw, tensor.data.view(np.uint8).reshape(-1)), tensor.name
    return ours


def same_bits(header: GGUFHeader, name: str) -> None:
    info = header.tensors[name]
    raw = header.read_bytes(info.offset, info.nbytes).reshape(int(np.prod(info.shape[:-1])), -1)
    with np.errstate(all="ignore"):
        want = gguf.quants.dequantize(raw, info.ggml_type).reshape(info.shape)
    got = dequantize(header, info).numpy()
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def test_fields_tensors_and_block_types_equal_the_library(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "fields.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(["a", "", "héllo ✓", "Ġthe", "<|endoftext|>", "x" * 300])
    writer.add_token_types([1, 3, 1, 4, 3, 1])
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.int32", [-(2**31), 7])
    writer.add_uint64("test.big", 2**40)
    writer.add_int8("test.small", -3)
    writer.add_float64("test.f64", 0.1)
    writer.add_bool("test.flag", True)
    writer.add_string("test.text", "plain ✓")
    writer.add_string("test.empty_text", "")
    for qtype in TORCH_DECODERS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (6, 3 * size), dtype=np.uint8)  # 6 rows of 3 blocks: any scale bits at all
        writer.add_tensor(f"random.{qtype.name}", raw, raw_shape=(6, 3 * size), raw_dtype=qtype)
        if qtype in (Q.Q4_K, Q.Q6_K):  # the library cannot quantise these: real ones are checked on Gemma's file
            continue
        weights = (rng.standard_normal((5, 2 * block)) * rng.choice([0.0, 1e-3, 1.0, 40.0], (5, 1))).astype(np.float32)
        writer.add_tensor(f"weights.{qtype.name}", gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 4)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((2, 8)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = same_as_library(path)
    assert ours.count("test.nested") == 2  # stepped over, never decoded
    with pytest.raises(CheckpointError, match="test.nested must be an array of numbers"):
        ours.numbers("test.nested", 10)
    for name in ours.tensors:
        same_bits(ours, name)


def test_torch_decoders_equal_the_library_on_random_bytes() -> None:
    rng = np.random.default_rng(1)
    for qtype in TORCH_DECODERS:
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = rng.integers(0, 256, (64, 4 * size), dtype=np.uint8)
        with np.errstate(all="ignore"):
            want = gguf.quants.dequantize(raw, qtype)
        got = decode_rows(raw, qtype).numpy()
        assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), qtype.name


RSS_PROBE = """
import json, resource, sys, time
from pathlib import Path
from circuits_core.formats.checkpoint import load_checkpoint
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
load_checkpoint(Path(sys.argv[1]) / "small")  # warm: imports and first-load allocations
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before, start = rss(), time.perf_counter()
loaded = load_checkpoint(Path(sys.argv[1]) / "bloated")
print(json.dumps({"seconds": time.perf_counter() - start, "peak_growth": rss() - before,
                  "vocab": loaded.tokenizer.vocab_size}))
"""


def test_unread_metadata_costs_neither_time_nor_memory(tmp_path: Path) -> None:
    for name, junk in (("small", 0), ("bloated", 2_000_000)):
        (tmp_path / name).mkdir()
        write_gguf(tmp_path / name / "m.gguf", extra_arrays={"junk.strings": [""] * junk} if junk else None)
    size = (tmp_path / "bloated" / "m.gguf").stat().st_size - (tmp_path / "small" / "m.gguf").stat().st_size
    assert size >= 16_000_000  # 2 M length prefixes of 8 bytes
    out = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["seconds"] < 10 and result["peak_growth"] < 200 * 2**20, result
    assert GGUFHeader(tmp_path / "bloated" / "m.gguf").count("junk.strings") == 2_000_000


def test_a_vocabulary_larger_than_the_embedding_is_refused_before_it_is_decoded(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    write_gguf(tmp_path / "m" / "m.gguf", extra_tokens=5)
    with pytest.raises(CheckpointError, match=r"tokenizer.ggml.tokens holds \d+ items, more than the \d+ this model"):
        load_checkpoint(tmp_path / "m")


def test_merges_beyond_what_the_vocabulary_allows_are_refused_before_they_are_decoded(tmp_path: Path) -> None:
    rows = len(_bpe()[0])  # the embedding's rows: the vocabulary write_gguf writes
    (tmp_path / "at").mkdir()
    write_gguf(tmp_path / "at" / "m.gguf", n_merges=MERGES_PER_TOKEN * rows)  # as many as allowed: loads
    loaded = load_checkpoint(tmp_path / "at")
    assert loaded.model.cfg.d_vocab == rows and loaded.tokenizer is not None
    (tmp_path / "over").mkdir()
    write_gguf(tmp_path / "over" / "m.gguf", n_merges=MERGES_PER_TOKEN * rows + 1)
    with pytest.raises(
        CheckpointError, match=rf"tokenizer.ggml.merges holds {MERGES_PER_TOKEN * rows + 1} items, more than the "
        rf"{MERGES_PER_TOKEN * rows} this model allows",
    ):  # fmt: skip
        load_checkpoint(tmp_path / "over")


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_the_smollm2_file_reads_as_the_library_reads_it() -> None:
    if not REAL[0].is_file():
        pytest.fail(f"{REAL[0]} is missing: run `make smollm2` (`make test` runs it first)")
    ours = same_as_library(REAL[0])
    assert {Q.Q4_1, Q.Q8_0} <= {info.ggml_type for info in ours.tensors.values()}
    for name in ours.tensors:
        same_bits(ours, name)


@pytest.mark.slow
@pytest.mark.xdist_group("gemma3")
def test_every_gemma3_tensor_decodes_as_the_library_decodes_it() -> None:
    """(The library's reader takes a minute over Gemma's 262k-token metadata: its bytes are compared on SmolLM2.)"""
    if not REAL[1].is_file():
        pytest.fail(f"{REAL[1]} is missing: run `make gemma3` (`make test` runs it first)")
    header = GGUFHeader(REAL[1])
    assert {info.ggml_type for info in header.tensors.values()} == {Q.F32, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K}
    assert header.count("tokenizer.ggml.tokens") == 262_144 and header.value("general.architecture") == "gemma3"
    for name in header.tensors:
        same_bits(header, name)


APP_PROBE = """
import json, shutil, sys, time
from pathlib import Path
from fastapi.testclient import TestClient
from app.main import create_app
from app.settings import Settings
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
root, served = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(root / "small", served / "small")
with TestClient(create_app(Settings(models_dir=served, store_url="off"))) as client:
    for url in ("/readyz", "/api/v1/models", "/"):
        client.get(url)  # warm: the shipped toys and the small GGUF loaded once
    shutil.copytree(root / "bloated", served / "bloated")  # a new folder shows up on the next listing
    open("/proc/self/clear_refs", "w").write("5")
    before, start = peak(), time.perf_counter()
    codes = [client.get(url).status_code for url in ("/readyz", "/api/v1/models", "/")]
    listed = [m["id"] for m in client.get("/api/v1/models").json()]
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_growth": peak() - before, "codes": codes,
                      "listed": listed}))
"""


def test_the_listing_home_page_and_readiness_do_not_parse_unread_metadata(tmp_path: Path) -> None:
    """The routes that load every model folder (the listing, `/`, `/readyz`) on a folder holding the bloated file."""
    for name, junk in (("small", 0), ("bloated", 2_000_000)):
        (tmp_path / name).mkdir()
        write_gguf(tmp_path / name / "m.gguf", extra_arrays={"junk.strings": [""] * junk} if junk else None)
    served = tmp_path / "served"
    served.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", APP_PROBE, str(tmp_path), str(served)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "bloated" in result["listed"] and all(code in (200, 503) for code in result["codes"]), result
    assert result["seconds"] < 10 and result["peak_growth"] < 200 * 2**20, result
