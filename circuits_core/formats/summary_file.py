"""The stored model summary file (`model_summary.json` beside the weights): where it lives and when it is current.

The summary itself is measured by circuits_core.prompt.model_summary; this module only reads the file back, so that
loading a checkpoint (formats.checkpoint) can show a current summary as the card of a folder without one, without
the formats depending on the analyses that measure it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from circuits_core.errors import CheckpointError
from circuits_core.formats.statedict import folder_file, read_json_object

SUMMARY_FILE = "model_summary.json"
SUMMARY_VERSION = 1


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _weight_names(folder: Path) -> list[str]:
    """The files a summary depends on: the .gguf of a GGUF folder, else the weight files and config.json."""
    names = sorted(
        p.name for p in folder.iterdir() if p.is_file() and p.suffix in (".gguf", ".safetensors", ".bin", ".pth", ".pt")
    )
    return names + (["config.json"] if (folder / "config.json").is_file() else [])


def _weights_source(folder: Path) -> dict[str, str]:
    """{file name: sha256} of the files the summary depends on."""
    return {name: file_sha256(folder_file(folder, name)) for name in _weight_names(folder)}


def _stat(folder: Path) -> dict[str, list[int]]:
    """{file name: [size, mtime_ns]}: while these are unchanged the files are not hashed again on each load."""
    stats = {name: folder_file(folder, name).stat() for name in _weight_names(folder)}
    return {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}


def load_summary(folder: str | Path) -> dict[str, Any] | None:
    """The stored summary of a model folder; None when there is none, it is of another version, or the weights it
    was measured on have changed since."""
    folder = Path(folder)
    if not folder_file(folder, SUMMARY_FILE).is_file():
        return None
    try:
        summary = read_json_object(folder, SUMMARY_FILE)  # bounded size and nesting, like every checkpoint JSON
    except CheckpointError:
        return None
    if not isinstance(summary, dict) or summary.get("summary_version") != SUMMARY_VERSION:
        return None
    source = summary.get("source")
    if not isinstance(source, dict):
        return None
    if source.get("stat") == _stat(folder) and list(source.get("weights", {})) == _weight_names(folder):
        return summary  # the same files, untouched since the measurement (size and modification time)
    return summary if source.get("weights") == _weights_source(folder) else None
