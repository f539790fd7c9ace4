"""The fast paths of the GGUF reader against the gguf library itself.

- `_Reader` splits arrays of strings and numbers in one pass: every field (offset, name, parts with their
  dtypes, data indices, types, contents) equals `gguf.GGUFReader`'s, on a file with unicode and empty strings,
  number arrays of each width, an empty array and an array of arrays (which goes through the library).
- The torch decoders of Q8_0, Q4_0 and Q4_1 give the bit patterns of `gguf.quants.dequantize`, on random
  bytes (every fp16 scale: subnormal, infinite, NaN) and on quantised random weights.
- On the real SmolLM2 file (slow, as test_smollm2.py): every field and every tensor.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from circuits_core.formats.gguf import _TORCH_BLOCKS, _Reader, dequantize

Q = gguf.GGMLQuantizationType
SMOLLM2 = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _same_fields(path: Path) -> tuple[gguf.GGUFReader, _Reader]:
    ours, theirs = _Reader(path, "r"), gguf.GGUFReader(path, "r")
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.name, got.data, got.types) == (want.offset, want.name, want.data, want.types), key
        assert len(got.parts) == len(want.parts), key
        for a, b in zip(got.parts, want.parts, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), key
        assert got.contents() == want.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    return theirs, ours


def _same_bits(tensor: object) -> None:
    want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # type: ignore[attr-defined]
    got = dequantize(tensor, "test").numpy()
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), tensor.name  # type: ignore[attr-defined]


def test_fields_and_fast_block_types_equal_the_library(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "fields.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(["a", "", "héllo ✓", "Ġthe", "<|endoftext|>", "x" * 300])
    writer.add_token_types([1, 3, 1, 4, 3, 1])
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_uint64("test.big", 2**40)
    writer.add_string("test.text", "plain")
    for qtype, (size, _) in _TORCH_BLOCKS.items():
        raw = rng.integers(0, 256, (6, 3 * size), dtype=np.uint8)  # 6 rows of 3 blocks: any scale bits at all
        writer.add_tensor(f"random.{qtype.name}", raw, raw_shape=(6, 3 * size), raw_dtype=qtype)
        weights = (rng.standard_normal((5, 64)) * rng.choice([0.0, 1e-3, 1.0, 40.0], (5, 1))).astype(np.float32)
        writer.add_tensor(f"weights.{qtype.name}", gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, ours = _same_fields(path)
    assert ours.fields["test.nested"].contents() is not None  # the library's recursion, through the override
    for tensor in ours.tensors:
        assert tensor.tensor_type in _TORCH_BLOCKS
        _same_bits(tensor)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_the_smollm2_file_reads_as_the_library_reads_it() -> None:
    if not SMOLLM2.is_file():
        pytest.fail(f"{SMOLLM2} is missing: run `make smollm2` (`make test` runs it first)")
    _, ours = _same_fields(SMOLLM2)
    kinds = {t.tensor_type for t in ours.tensors}
    assert Q.Q4_1 in kinds and Q.Q8_0 in kinds  # both fast decoders are exercised
    for tensor in ours.tensors:
        _same_bits(tensor)
