"""ModelRegistry: which models exist (folders of checkpoints) and loading them once, lazily, under a lock.

A model id is the name of a folder directly inside `settings.shipped_dir` or `settings.models_dir` that
holds a checkpoint `circuits_core.weights.detect_format` recognises. Ids are matched by a strict pattern
(letters, digits, `.`, `_`, `-`; no leading dot), so a request can never name a path outside those folders.
Folders are rescanned on every listing: a new folder becomes a model without a restart. A folder with a
config.json that no loader recognises is still listed (as unavailable, with the reason); a folder without
config.json is not a model. Where the same name exists in both folders, the shipped model wins (ids of the
shipped models are stable). A loaded model stays loaded until the process ends (or `forget(id)`).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from app.settings import Settings
from circuits_core.errors import CheckpointError, NotFoundError
from circuits_core.weights import LoadedModel, detect_format, load_checkpoint

log = logging.getLogger("qkov.registry")

MODEL_ID_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class ModelEntry:
    """A checkpoint folder that can be loaded (not loaded yet)."""

    id: str
    path: Path
    format: str
    shipped: bool
    error: str | None = None  # why the folder cannot be loaded, when detection already failed


class ModelRegistry:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.dtype = torch.float64 if settings.dtype == "float64" else torch.float32
        self._loaded: dict[str, LoadedModel] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    # -- discovery -------------------------------------------------------------------------------------
    def _roots(self) -> list[tuple[Path, bool]]:
        roots = [(self.settings.shipped_dir, True)]
        if self.settings.models_dir is not None:
            roots.append((self.settings.models_dir, False))
        return roots

    def _scan_one(self, folder: Path, shipped: bool) -> ModelEntry | None:
        if not MODEL_ID_RE.match(folder.name) or not (folder / "config.json").is_file():
            return None
        if folder.resolve().parent != folder.parent.resolve():  # a symlink leading out of the models folder
            log.warning("skipping %s: it links outside %s", folder, folder.parent)
            return None
        try:
            return ModelEntry(folder.name, folder, str(detect_format(folder)), shipped)
        except CheckpointError as exc:
            return ModelEntry(folder.name, folder, "unknown", shipped, error=str(exc))

    def entries(self) -> list[ModelEntry]:
        """Every model folder, rescanned now, sorted by id."""
        found: dict[str, ModelEntry] = {}
        for root, shipped in self._roots():
            if not root.is_dir():
                continue
            for folder in sorted(root.iterdir()):
                entry = self._scan_one(folder, shipped)
                if entry is None:
                    continue
                if entry.id in found:
                    log.warning("model %s in %s is shadowed by %s", entry.id, entry.path, found[entry.id].path)
                    continue
                found[entry.id] = entry
        return [found[k] for k in sorted(found)]

    def entry(self, model_id: str) -> ModelEntry:
        """The folder of one model; NotFoundError for a malformed or unknown id (never a path)."""
        if not isinstance(model_id, str) or not MODEL_ID_RE.match(model_id):
            raise NotFoundError(f"unknown model {model_id!r}: model ids are folder names of letters, digits, '.', '_' and '-'")
        for root, shipped in self._roots():
            entry = self._scan_one(root / model_id, shipped)
            if entry is not None:
                return entry
        known = ", ".join(e.id for e in self.entries()) or "none"
        raise NotFoundError(f"unknown model {model_id!r}; available: {known}")

    # -- loading ---------------------------------------------------------------------------------------
    def _lock(self, model_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(model_id, threading.Lock())

    def get(self, model_id: str) -> LoadedModel:
        """The loaded model (loads it on first use, once, under a per-model lock). Blocking: call from a thread."""
        loaded = self._loaded.get(model_id)
        if loaded is not None:
            return loaded
        entry = self.entry(model_id)
        with self._lock(model_id):
            loaded = self._loaded.get(model_id)
            if loaded is None:
                try:
                    if entry.error is not None:
                        raise CheckpointError(entry.error)
                    loaded = load_checkpoint(entry.path, dtype=self.dtype)
                except CheckpointError as exc:
                    log.error("model %s cannot be loaded: %s", model_id, exc)
                    raise CheckpointError(f"model {model_id!r} cannot be loaded: {exc}") from exc
                loaded.model.requires_grad_(False).eval()
                self._loaded[model_id] = loaded
                log.info("loaded model %s (%s) from %s", model_id, entry.format, entry.path)
        return loaded

    def forget(self, model_id: str) -> None:
        """Drop a loaded model (the next request loads the folder again)."""
        with self._lock(model_id):
            self._loaded.pop(model_id, None)

    def is_loaded(self, model_id: str) -> bool:
        return model_id in self._loaded

    def preload(self) -> None:
        """Load every model now (settings.preload); a model that fails is logged, not fatal."""
        for entry in self.entries():
            try:
                self.get(entry.id)
            except CheckpointError:
                pass
