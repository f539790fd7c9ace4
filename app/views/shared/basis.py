"""The basis of a model's circuit numbers, in words: which weights they come from.

Processing (circuits_core/formats/processing.py) changes circuit numbers but not the model's outputs: centring W_U
shifts every full OV circuit by a rank-one term, folding LayerNorm scales the reading weights. Every circuit view says
which weights it used, next to the numbers.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Literal

from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel, load_checkpoint
from circuits_core.formats.statedict import load_bytes

Basis = Literal["served", "raw"]
_RAW: dict[tuple[str, str, str], LoadedModel] = {}  # (folder, digest, dtype) -> the same checkpoint, unprocessed
_RAW_KEEP = 2  # raw copies kept (each a second copy of a model's weights)
_LOCK = threading.Lock()


def changes_weights(loaded: LoadedModel) -> bool:
    """Whether the served weights differ from the stored ones (a processing step that changed something)."""
    return basis(loaded) != RAW


def with_basis(loaded: LoadedModel, which: Basis) -> LoadedModel:
    """The model as served, or (which="raw") the same checkpoint loaded without processing, kept for reuse."""
    if which == "served" or not changes_weights(loaded):
        return loaded
    key = (str(loaded.path), loaded.digest, str(loaded.model.dtype))
    with _LOCK:
        raw = _RAW.get(key)
    if raw is None:
        raw = load_checkpoint(loaded.path, dtype=loaded.model.dtype, process=False)
        raw = dataclasses.replace(raw, card=loaded.card)
        with _LOCK:
            if len(_RAW) >= _RAW_KEEP:
                _RAW.pop(next(iter(_RAW)))
            _RAW[key] = raw
    return raw


RAW = "raw weights, as stored"


def raw_copy_cost(loaded: LoadedModel, which: Basis) -> Cost:
    """Memory of the unprocessed copy with_basis loads (0 when served, identical, or already kept)."""
    if (
        which == "served"
        or not changes_weights(loaded)
        or (str(loaded.path), loaded.digest, str(loaded.model.dtype)) in _RAW
    ):
        return Cost(0)
    return Cost(load_bytes(loaded.model.cfg, loaded.model.dtype))


def basis(loaded: LoadedModel) -> str:
    """Which weights the circuit numbers use: raw, centred unembedding, folded LayerNorm (or RMSNorm)."""
    done = loaded.model.processing
    cfg = loaded.model.cfg
    parts = []
    if done.get("fold_ln") and cfg.normalization_type is not None:
        norm = "RMSNorm" if cfg.normalization_type.startswith("RMS") else "LayerNorm"
        parts.append(f"{norm} folded into the reading weights")
    if done.get("center_writing_weights") and cfg.normalization_type is not None:
        parts.append("writing weights centred")
    if done.get("center_unembed"):
        parts.append("unembedding centred (W_U minus its mean over the vocabulary)")
    return "processed weights: " + ", ".join(parts) if parts else RAW
