"""A measured summary of a pretrained model (its card, computed by code, never typed by hand).

For a model qkov did not train (SmolLM2-135M from its GGUF file), the summary reports what the
paper's two-layer phenomena look like in it, measured on one stated input:
- the input: heads.standard_tokens (the app's standard detector input): BOS + r + r, r = 50 token ids drawn
  uniformly from the whole vocabulary, 10 sequences, seed 0;
- the loss on the first copy of r and on the second (phenomena.repeat_losses): induction lowers the second;
- every head's induction score and previous-token score (heads.detector_scores), and the heads scoring at
  least HEAD_THRESHOLD, strongest first.

The summary is derived data stored next to the weights as `model_summary.json`, together with the sha256 of
the weight file it was measured on; `load_summary` ignores it once that file has changed, and
`python -m circuits_core.prompt.model_summary FOLDER` (make smollm2) measures it again then. A folder without a
model_card.json shows its current summary as its card (weights.load_checkpoint).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from circuits_core.formats.summary_file import SUMMARY_FILE, SUMMARY_VERSION, _stat, _weights_source, load_summary
from circuits_core.model.head_names import head_name
from circuits_core.prompt.detectors import detector_scores, standard_tokens
from circuits_core.prompt.phenomena import repeat_losses

if TYPE_CHECKING:  # weights.py reads stored summaries (load_summary) as the card of a folder without one
    from circuits_core.formats.checkpoint import LoadedModel

HEAD_THRESHOLD = 0.4  # a head is listed as an induction / previous-token head when its score is at least this
SEED = 0


def _top_heads(scores: torch.Tensor) -> list[dict[str, Any]]:
    """Heads with score >= HEAD_THRESHOLD, strongest first: [{"head": "L3H1", "score": 0.91}]."""
    layers, heads = torch.nonzero(scores >= HEAD_THRESHOLD, as_tuple=True)
    found = [(float(scores[layer, h]), head_name(int(layer), int(h))) for layer, h in zip(layers, heads, strict=True)]
    return [{"head": name, "score": round(score, 4)} for score, name in sorted(found, reverse=True)]


def _listing(heads: list[dict[str, Any]], most: int = 6) -> str:
    shown = ", ".join(f"{h['head']} ({h['score']:.2f})" for h in heads[:most])
    return shown + (f" and {len(heads) - most} more" if len(heads) > most else "") if heads else "none"


def summarise(
    induction: torch.Tensor, previous: torch.Tensor, first: float, second: float, basis: str
) -> dict[str, Any]:
    """The summary's figures and sentences from [L, H] induction and previous-token scores and the losses on the first
    and second copy of the repeated input (`basis`: that input, in words). Shared by `measure` (model_summary.json)
    and the app's summary computed on first use (app/views/model_summary.py)."""
    induction, previous = induction.double(), previous.double()
    ind_heads, prev_heads = _top_heads(induction), _top_heads(previous)
    total = induction.shape[0] * induction.shape[1]
    sentences = [
        f"On a random sequence repeated once, its loss drops from {first:.2f} nats on the first copy to "
        f"{second:.2f} on the second: it predicts the second copy from the first."
        if second < first
        else f"On a random sequence repeated once, its loss is {first:.2f} nats on the first copy and {second:.2f} "
        "on the second: it does not predict the second copy from the first.",
        f"{len(ind_heads)} of its {total} heads are induction heads (score >= {HEAD_THRESHOLD}): "
        f"{_listing(ind_heads)}.",
        f"{len(prev_heads)} heads are previous-token heads (score >= {HEAD_THRESHOLD}): {_listing(prev_heads)}.",
    ]
    return {
        "basis": basis,
        "loss_first_copy": round(first, 4),
        "loss_second_copy": round(second, 4),
        "head_threshold": HEAD_THRESHOLD,
        "induction_heads": ind_heads,
        "previous_token_heads": prev_heads,
        "induction_scores": [[round(float(v), 4) for v in row] for row in induction],
        "previous_token_scores": [[round(float(v), 4) for v in row] for row in previous],
        "sentences": sentences,
        "description": " ".join(sentences),
    }


def measure(loaded: LoadedModel, seed: int = SEED) -> dict[str, Any]:
    """The summary of a loaded model: the figures, the per-head scores behind them, and the sentences."""
    model = loaded.model
    tokens = standard_tokens(model, seed=seed)  # [batch, 1 + 2T]
    with torch.no_grad():
        scores = detector_scores(model, tokens)
    losses = repeat_losses(model, tokens)
    t = (tokens.shape[1] - 1) // 2
    basis = (
        f"measured on BOS + r + r, r = {t} token ids drawn uniformly from all {model.cfg.d_vocab}, "
        f"{tokens.shape[0]} sequences, seed {seed}; raw weights' outputs (processing does not change them)"
    )
    summary = summarise(scores["induction"], scores["previous_token"], losses["rep1_loss"], losses["rep2_loss"], basis)
    return {
        "summary_version": SUMMARY_VERSION,
        "source": {"model": loaded.path.name, "weights": _weights_source(loaded.path), "stat": _stat(loaded.path)},
        "input": {"seq_len": t, "batch": int(tokens.shape[0]), "seed": seed, "bos": int(tokens[0, 0])},
        **summary,
        "notes": f"{basis}. Computed by circuits_core/prompt/model_summary.py and stored in {SUMMARY_FILE} beside the "
        "weights, with their sha256; measured again when they change.",
    }


def ensure_summary(folder: str | Path) -> tuple[dict[str, Any], bool]:
    """(summary, measured now): the stored one while it is current, else a fresh measurement written to disk."""
    folder = Path(folder)
    current = load_summary(folder)
    if current is not None:
        if current["source"].get("stat") != _stat(folder):  # same bytes, touched: record the new times
            current["source"]["stat"] = _stat(folder)
            (folder / SUMMARY_FILE).write_text(json.dumps(current, indent=1) + "\n")
        return current, False
    from circuits_core.formats.checkpoint import load_checkpoint

    summary = measure(load_checkpoint(folder, process=False))
    (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary, True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m circuits_core.prompt.model_summary MODEL_FOLDER", file=sys.stderr)
        return 2
    summary, fresh = ensure_summary(argv[0])
    print(f"{argv[0]}/{SUMMARY_FILE}: {'measured' if fresh else 'current'}")
    for sentence in summary["sentences"]:
        print(" ", sentence)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
