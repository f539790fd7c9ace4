"""ModelRegistry: which models exist (folders of checkpoints) and loading them once, lazily, under a lock.

A model id is the name of a folder directly inside `settings.shipped_dir` or `settings.models_dir` that
holds a checkpoint: a config.json, or a single .gguf file (circuits_core.formats.detect.detect_format). Ids are
matched by a strict pattern (letters, digits, `.`, `_`, `-`; no leading dot), so a request can never name a
path outside those folders. Folders are rescanned on every listing: a new folder becomes a model without a
restart. A folder with a config.json that no loader recognises is still listed (as unavailable, with the
reason); a folder with neither is not a model. Where the same name exists in both folders, the shipped model
wins (ids of the shipped models are stable).

Failure isolation: a folder that cannot be read (malformed or hostile config, files leading outside it, a
model priced over `settings.max_model_bytes`, a loader bug) is listed as unavailable with the reason and
answers 422 on its own routes; nothing else changes. Each load, failed or not, is remembered with the
folder's fingerprint (name, size, mtime and inode of each of its files, by stat): a failed folder is not
retried, and a loaded one not reloaded, until its files change; then the next request loads it again. A load
refused by its memory watchdog (circuits_core/formats/load_watchdog.py: it measures the whole process, so other work
running beside the load counts too) is retried after `settings.load_retry_s` even when the files are unchanged.
Error messages never show a server path (the folder's path is replaced by the model id).

A slow folder never holds up the listing, `/` or /readyz: `entries` reads the user folders' formats on detection
threads and `settle` starts the loads they need on background loader threads, both waiting until one deadline
(`settings.listing_wait_s` from the listing's start) and only for work that listing started; a folder still being
read or loaded then is reported as loading (its work goes on, and a later listing shows it). The shipped models are
the repository's own and small: they are always waited for.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from app.settings import Settings
from circuits_core.errors import CheckpointError, NotFoundError, QkovError
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.formats.detect import detect_format
from circuits_core.formats.gguf import gguf_file
from circuits_core.formats.load_watchdog import LoadMemoryExceeded

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
    pending: bool = False  # its format is still being read (a slow config read): listed as loading


Fingerprint = tuple[tuple[str, int, int, int], ...]


def fingerprint(folder: Path) -> Fingerprint:
    """(name, size, mtime_ns, inode) of every entry of the folder, by stat through links: changes with its files."""
    rows = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except OSError:
                    rows.append((entry.name, -1, -1, -1))
                    continue
                rows.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
    except OSError:
        return ()
    return tuple(sorted(rows))


def _holds_checkpoint(folder: Path) -> bool:
    """A folder with a config.json, or a single-file GGUF folder (several .gguf files: a model that fails)."""
    if not folder.is_dir():
        return False
    if (folder / "config.json").is_file():
        return True
    try:
        return gguf_file(folder) is not None
    except (CheckpointError, OSError):
        return True


def public_message(message: str, entry: ModelEntry) -> str:
    """An error message with the server paths of the folder replaced by the model id."""
    for path in sorted({str(entry.path.resolve()), str(entry.path)}, key=len, reverse=True):
        message = message.replace(path + os.sep, "").replace(path, entry.id)
    for root in {str(entry.path.parent.resolve()), str(entry.path.parent)}:
        message = message.replace(root + os.sep, "")
    return message


class ModelRegistry:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.dtype = torch.float64 if settings.dtype == "float64" else torch.float32
        self.device = settings.compute_device()  # QKOV_DEVICE, resolved once: every model loads onto it
        self._loaded: dict[str, LoadedModel] = {}
        self._prints: dict[str, Fingerprint] = {}  # fingerprint of each loaded folder when it was loaded
        self._failed: dict[str, tuple[Fingerprint, str]] = {}  # id -> (fingerprint, reason) of failed loads
        self._retry_at: dict[str, float] = {}  # id -> when a load its watchdog refused may run again (monotonic)
        self._scans: dict[Path, tuple[Fingerprint, ModelEntry]] = {}  # folder -> (fingerprint, detected entry)
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[LoadedModel]] = {}  # background loads (settle)
        self._background = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="qkov-registry")
        self._scanning: dict[Path, concurrent.futures.Future[ModelEntry | None]] = {}  # detections under way
        self._detector = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="qkov-detect")

    # -- discovery -------------------------------------------------------------------------------------
    def _roots(self) -> list[tuple[Path, bool]]:
        roots = [(self.settings.shipped_dir, True)]
        if self.settings.models_dir is not None:
            roots.append((self.settings.models_dir, False))
        return roots

    def _scan_one(self, folder: Path, shipped: bool) -> ModelEntry | None:
        if not MODEL_ID_RE.match(folder.name) or not _holds_checkpoint(folder):
            return None
        if folder.resolve().parent != folder.parent.resolve():  # a symlink leading out of the models folder
            log.warning("skipping %s: it links outside %s", folder, folder.parent)
            return None
        stamp = fingerprint(folder)
        known = self._scans.get(folder)
        if known is not None and known[0] == stamp and known[1].shipped == shipped:
            return known[1]  # detection reads config.json: once per version of the folder, not per listing
        entry = ModelEntry(folder.name, folder, "unknown", shipped)
        try:
            entry = ModelEntry(folder.name, folder, str(detect_format(folder)), shipped)
        except CheckpointError as exc:
            entry = ModelEntry(folder.name, folder, "unknown", shipped, error=public_message(str(exc), entry))
        except Exception as exc:  # noqa: BLE001 - a hostile folder must never break the listing
            log.exception("model folder %s: unexpected error while detecting its format", folder)
            reason = public_message(f"unreadable checkpoint ({type(exc).__name__}: {exc})", entry)
            entry = ModelEntry(folder.name, folder, "unknown", shipped, error=reason[:500])
        with self._guard:
            self._scans[folder] = (stamp, entry)
        return entry

    def _scan_soon(self, folder: Path) -> tuple[concurrent.futures.Future[ModelEntry | None], bool]:
        """_scan_one of a user folder on a detection thread (one at a time per folder): (its future, whether this
        call started it)."""
        with self._guard:
            future = self._scanning.get(folder)
            if future is not None and not future.done():
                return future, False
            future = self._scanning[folder] = self._detector.submit(self._scan_one, folder, False)
            return future, True

    def deadline(self) -> float:
        """When a listing started now stops waiting for user folders (time.monotonic; `settings.listing_wait_s`)."""
        return time.monotonic() + self.settings.listing_wait_s

    def _scanned(self, root: Path, shipped: bool, deadline: float) -> list[ModelEntry | None]:
        """The folders of one root scanned: the shipped ones here; the user's on detection threads, waited for until
        `deadline` (a folder whose config is still being read is a pending entry)."""
        folders = sorted(root.iterdir())
        if shipped:
            return [self._scan_one(folder, True) for folder in folders]
        started = [self._scan_soon(folder) for folder in folders]
        futures = [future for future, _ in started]
        fresh = [future for future, new in started if new]  # one already under way held up an earlier listing
        concurrent.futures.wait(fresh, timeout=max(0.0, deadline - time.monotonic()))
        return [
            f.result() if f.done() else ModelEntry(folder.name, folder, "unknown", False, pending=True)
            for folder, f in zip(folders, futures, strict=True)
        ]

    def entries(self, deadline: float | None = None) -> list[ModelEntry]:
        """Every model folder, rescanned now, sorted by id (a user folder whose format is still being read at
        `deadline`, by default the listing wait from now, is listed pending)."""
        deadline = self.deadline() if deadline is None else deadline
        found: dict[str, ModelEntry] = {}
        for root, shipped in self._roots():
            if not root.is_dir():
                continue
            for entry in self._scanned(root, shipped, deadline):
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
            raise NotFoundError(
                f"unknown model {model_id!r}: model ids are folder names of letters, digits, '.', '_' and '-'"
            )
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

    def _fresh(self, model_id: str, loaded: LoadedModel) -> bool:
        """Whether the folder of a loaded model still has the files it was loaded from."""
        return self._prints.get(model_id) == fingerprint(loaded.path)

    def get(self, model_id: str) -> LoadedModel:
        """The loaded model (loads it on first use, once, under a per-model lock). Blocking: call from a thread.

        A folder whose last load failed raises the same CheckpointError at once until its files change.
        """
        loaded = self._loaded.get(model_id)
        if loaded is not None and self._fresh(model_id, loaded):
            return loaded
        entry = self.entry(model_id)
        with self._lock(model_id):
            loaded = self._loaded.get(model_id)
            if loaded is not None and self._fresh(model_id, loaded):
                return loaded
            before = fingerprint(entry.path)
            if self._known_failure(model_id, before):
                raise CheckpointError(self._failed[model_id][1])
            try:
                if entry.error is not None:
                    raise CheckpointError(entry.error)
                loaded = load_checkpoint(
                    entry.path,
                    dtype=self.dtype,
                    max_bytes=self.settings.max_model_bytes,
                    device=self.device,
                    keep_half=self.settings.keeps_half_weights(),
                    lazy_mlp=True,  # Llama-family MLP weights read on first use (formats/lazy_mlp.py)
                    memory_multiple=self.settings.load_memory_multiple,
                    memory_allowance=self.settings.load_memory_allowance_bytes,
                )
                loaded.model.requires_grad_(False).eval()
            except Exception as exc:  # noqa: BLE001 - any failure of one folder is that folder's, remembered
                if not isinstance(exc, CheckpointError):
                    log.exception("model %s: unexpected error while loading", model_id)
                    exc = CheckpointError(f"unreadable checkpoint ({type(exc).__name__}: {str(exc)[:300]})")
                reason = f"model {model_id!r} cannot be loaded: {public_message(str(exc), entry)}"
                log.error("%s", reason)
                self._loaded.pop(model_id, None)
                self._failed[model_id] = (before, reason)
                if isinstance(exc, LoadMemoryExceeded):
                    self._retry_at[model_id] = time.monotonic() + self.settings.load_retry_s
                else:
                    self._retry_at.pop(model_id, None)
                raise CheckpointError(reason) from None
            self._failed.pop(model_id, None)
            self._retry_at.pop(model_id, None)
            self._loaded[model_id], self._prints[model_id] = loaded, before
            log.info("loaded model %s (%s)", model_id, entry.format)
        return loaded

    def _known_failure(self, model_id: str, stamp: Fingerprint) -> bool:
        """The folder's last load failed with the files as they are now, and is not due to be retried."""
        failed = self._failed.get(model_id)
        if failed is None or failed[0] != stamp:
            return False
        retry_at = self._retry_at.get(model_id)
        return retry_at is None or time.monotonic() < retry_at

    def is_loaded(self, model_id: str) -> bool:
        """Loaded, and its folder unchanged since (get() returns it without loading)."""
        loaded = self._loaded.get(model_id)
        return loaded is not None and self._fresh(model_id, loaded)

    def settled(self, entry: ModelEntry) -> bool:
        """get() answers without loading (cheap work, no compute slot): the model is loaded, or its folder cannot
        be read (detection failed), or its failed load is remembered for the folder as it is now."""
        if entry.error is not None or self.is_loaded(entry.id):
            return True
        return self._known_failure(entry.id, fingerprint(entry.path))

    def load_soon(self, model_id: str) -> tuple[concurrent.futures.Future[LoadedModel], bool]:
        """get(model_id) on a background loader thread (one at a time per model): (its future, whether this call
        started it)."""
        with self._guard:
            future = self._pending.get(model_id)
            if future is not None and not future.done():
                return future, False
            future = self._pending[model_id] = self._background.submit(self.get, model_id)
            return future, True

    def settle(
        self, entries: Sequence[ModelEntry], deadline: float | None = None
    ) -> dict[str, LoadedModel | CheckpointError | None]:
        """Each entry's model, its load's error, or None while it is still loading (or its format being read) at
        `deadline` (by default the listing wait from now; the load goes on in the background). Shipped models are
        always waited for; the rest load on background threads, all at once, so one slow folder costs the caller at
        most the wait (entries() and settle() given one deadline share it), and only the first caller: a load (or a
        detection) already under way when a listing starts is reported as it stands, without waiting for it again."""
        deadline = self.deadline() if deadline is None else deadline
        started = {
            e.id: self.load_soon(e.id) for e in entries if not e.shipped and not e.pending and not self.settled(e)
        }
        futures = {model_id: future for model_id, (future, _) in started.items()}
        fresh = [future for future, new in started.values() if new]
        if fresh:
            concurrent.futures.wait(fresh, timeout=max(0.0, deadline - time.monotonic()))
        out: dict[str, LoadedModel | CheckpointError | None] = {}
        for entry in entries:
            future = futures.get(entry.id)
            if entry.pending:
                out[entry.id] = None  # its format is still being read
                continue
            try:
                if future is None:
                    out[entry.id] = self.get(entry.id)  # shipped, or settled: answers at once
                elif future.done():
                    out[entry.id] = future.result()
                else:
                    out[entry.id] = None
            except QkovError as exc:  # (the folder vanished since the scan: NotFoundError)
                out[entry.id] = exc if isinstance(exc, CheckpointError) else CheckpointError(str(exc))
        return out

    def preload(self) -> None:
        """Load every model now (settings.preload); a model that fails is logged, not fatal."""
        for entry in self.entries():
            try:
                self.get(entry.id)
            except CheckpointError:
                pass
