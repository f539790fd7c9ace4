"""The basis of a model's circuit numbers, in words: which weights they come from (issue 12.3).

Processing (circuits_core/processing.py) changes circuit numbers but not the model's outputs: centring W_U shifts
every full OV circuit by a rank-one term, folding LayerNorm scales the reading weights. Every circuit view says
which weights it used, next to the numbers.
"""

from __future__ import annotations

from circuits_core.weights import LoadedModel


def basis(loaded: LoadedModel) -> str:
    """Which weights the circuit numbers use: raw, centred unembedding, folded LayerNorm."""
    done = loaded.model.processing
    cfg = loaded.model.cfg
    parts = []
    if done.get("fold_ln") and cfg.normalization_type is not None:
        parts.append("LayerNorm folded into the reading weights")
    if done.get("center_writing_weights") and cfg.normalization_type is not None:
        parts.append("writing weights centred")
    if done.get("center_unembed"):
        parts.append("unembedding centred (W_U minus its mean over the vocabulary)")
    return "processed weights: " + ", ".join(parts) if parts else "raw weights, as stored"
