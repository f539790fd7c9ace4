"""A safetensors file truncated or replaced between its header being parsed and its tensors being read: a
CheckpointError naming the file, in a fresh process that keeps running (through a memory map the truncation was a
SIGBUS that killed the process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]

READ_AFTER_CHANGE = """
import json, os, shutil, sys
from pathlib import Path
import torch
from circuits_core.errors import CheckpointError
from circuits_core.formats.llama import _MappedFile
path, how = Path(sys.argv[1]), sys.argv[2]
weights = _MappedFile(path, path.name)  # header parsed, no tensor read yet
if how == "truncate":
    os.truncate(path, weights.base + 64)
else:
    shutil.copy(path, path.with_suffix(".new"))
    os.replace(path.with_suffix(".new"), path)  # another file of the same bytes under the name
try:
    weights.read("big", torch.float32, lambda t: t)
    outcome = "read"
except CheckpointError as exc:
    outcome = str(exc)
print(json.dumps({"outcome": outcome}))
"""


@pytest.mark.parametrize("how", ["truncate", "replace"])
def test_a_file_changed_under_a_lazy_read_is_a_named_error_not_a_crash(tmp_path, how):
    path = tmp_path / "model.safetensors"
    save_file({"big": torch.randn(512, 1024), "small": torch.ones(4)}, str(path))
    done = subprocess.run(
        [sys.executable, "-c", READ_AFTER_CHANGE, str(path), how], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-500:])  # -7: killed by SIGBUS
    outcome = json.loads(done.stdout.strip().splitlines()[-1])["outcome"]
    assert "model.safetensors" in outcome and "changed while it was being read" in outcome
