"""Hostile weight archives measured in a fresh process: a `.pth` whose one record is deflated (200 MiB of zeros in
about 200 KiB) is refused by name before torch.load inflates it, with the process's peak RSS growing by far less than
the record's expanded size; a record that lies about its size is refused too; a real torch.save file still loads."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from circuits_core.errors import CheckpointError
from circuits_core.formats.statedict import read_weight_file

REPO = Path(__file__).resolve().parents[2]
EXPANDED = 200 * 1024 * 1024

MEASURE = """
import json, resource, sys
from pathlib import Path
from circuits_core.errors import CheckpointError
from circuits_core.formats.statedict import read_weight_file
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_weight_file(Path(sys.argv[1]))
    outcome = "loaded"
except CheckpointError as exc:
    outcome = str(exc)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
print(json.dumps({"outcome": outcome, "grown_kib": grown}))
"""


def _measured(path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path)], cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _recompressed(tmp_path: Path, compress: int, expanded: int = EXPANDED) -> Path:
    """A torch.save archive whose data record holds `expanded` bytes of zeros, rewritten with `compress`
    (ZIP_DEFLATED: a bomb). The record is streamed into the archive a MiB at a time, so writing it costs no memory."""
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(expanded // 4)} if expanded <= EXPANDED else {"w": torch.zeros(4)}, buffer)
    buffer.seek(0)
    path = tmp_path / "model.pth"
    zeros = bytes(1 << 20)
    with zipfile.ZipFile(buffer) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("data/0"):
                dst.writestr(info.filename, src.read(info.filename), compress_type=zipfile.ZIP_STORED)
                continue
            record = zipfile.ZipInfo(info.filename)
            record.compress_type = compress
            with dst.open(record, "w", force_zip64=True) as out:
                for _ in range(expanded >> 20):
                    out.write(zeros)
    return path


def test_a_deflated_record_is_refused_before_it_expands(tmp_path):
    path = _recompressed(tmp_path, zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < EXPANDED // 100  # a bomb: under 2 MiB on disk
    result = _measured(path)
    assert "is compressed" in result["outcome"] and "data/0" in result["outcome"]
    assert result["grown_kib"] < 32 * 1024, result  # inflating it would add 200 MiB


@pytest.mark.slow
def test_a_3_gib_bomb_is_refused_before_it_expands(tmp_path):
    """The hostile-input pass's case: a few MB on disk that torch.load inflated to 3 GiB before its 422."""
    path = _recompressed(tmp_path, zipfile.ZIP_DEFLATED, expanded=3 << 30)
    assert path.stat().st_size < 16 << 20
    with zipfile.ZipFile(path) as archive:
        assert max(info.file_size for info in archive.infolist()) == 3 << 30  # what it would expand to
    result = _measured(path)
    assert "is compressed" in result["outcome"] and str(3 << 30) in result["outcome"], result
    assert result["grown_kib"] < 32 * 1024, result


def test_a_record_declaring_more_than_the_file_is_refused(tmp_path):
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(16)}, buffer)
    data = bytearray(buffer.getvalue())

    # the central directory entry of the data record: signature PK\1\2, name at +46, uncompressed size at +24
    def name(i: int) -> bytes:
        return bytes(data[i + 46 : i + 46 + int.from_bytes(data[i + 28 : i + 30], "little")])

    entry = next(i for i in range(len(data) - 46) if data[i : i + 4] == b"PK\x01\x02" and name(i).endswith(b"data/0"))
    data[entry + 24 : entry + 28] = (0xFFFFFFF0).to_bytes(4, "little")
    path = tmp_path / "model.pth"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="declares"):
        read_weight_file(path)


def test_a_stored_torch_save_file_still_loads(tmp_path):
    path = tmp_path / "model.pth"
    torch.save({"w": torch.arange(6.0).view(2, 3)}, path)
    assert torch.equal(read_weight_file(path)["w"], torch.arange(6.0).view(2, 3))
    assert json.loads(json.dumps(_measured(path)))["outcome"] == "loaded"
