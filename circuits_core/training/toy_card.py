"""The shipped toys' folders: qkov's checkpoint format with fp16 weights (save_toy, load_toy) and their model cards,
whose numbers are measured on the saved checkpoint (remeasure: circuits_core.prompt.phenomena) beside the words that
describe each toy (DESCRIPTIONS, NOTES). train.py writes them; `python -m circuits_core.training.train measure`
refreshes a card.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from circuits_core.formats.checkpoint import load_checkpoint
from circuits_core.formats.qkov_format import save_checkpoint
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.alibi_phenomena import alibi_report
from circuits_core.prompt.phenomena import EvalData, check_thresholds, measure
from circuits_core.training.corpus import source_label


def save_toy(folder: Path, model: Transformer, tokenizer: Tokenizer, card: dict) -> None:
    """qkov's checkpoint format (circuits_core.formats.qkov_format) with fp16 weights; loading casts to float32."""
    half = Transformer(model.cfg)
    half.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    save_checkpoint(half.half(), folder, tokenizer.to_str(), card)


def load_toy(folder: Path) -> tuple[Transformer, Tokenizer, dict]:
    """(float32 model, unprocessed, on cpu; tokenizer; card) of a shipped checkpoint folder."""
    loaded = load_checkpoint(folder, process=False)
    return loaded.model, Tokenizer.from_file(str(folder / "tokenizer.json")), loaded.card


def first_crossings(history: list[dict], n_layers: int) -> dict[str, dict]:
    """{metric: {step, minutes}} of the first evaluation (training-time sample) meeting each threshold."""
    first: dict[str, dict] = {}
    for row in history:
        for key, ok in check_thresholds(n_layers, row).items():
            if ok and key not in first:
                first[key] = {"step": row["step"], "minutes": row["minutes"]}
    return first


def remeasure(folder: Path) -> dict:
    """Measure the saved (fp16 -> float32) checkpoint and write the numbers into its model card."""
    model, tokenizer, card = load_toy(folder)
    eval_data = EvalData.load(folder.parent / "eval_data.npz")
    card["phenomena"] = ph = measure(model, tokenizer, eval_data)
    if model.cfg.alibi is not None:  # what ALiBi's kernel does to the induction circuit
        card["alibi"] = alibi_report(model, str(ph["induction_head"]), str(ph["k_composition_partner"]))
    card["description"], card["notes"] = DESCRIPTIONS.get(card["name"], ""), NOTES.get(card["name"], "")
    card["data"]["source"] = (
        card["data"]["source"]
        if not str(card["data"].get("source", "")).startswith("/")
        else source_label(Path(card["data"]["source"]))
    )  # never the training machine's absolute path
    card["thresholds"] = check_thresholds(model.cfg.n_layers, card["phenomena"], detail=True)
    card["first_crossed"] = first_crossings(card.get("history", []), model.cfg.n_layers)
    (folder / "model_card.json").write_text(json.dumps(card, indent=1) + "\n")
    return card


DESCRIPTIONS = {
    "toy-0l": "Zero-layer transformer: logits = W_E W_U, the direct path, approximates bigram statistics.",
    "toy-1l": "One-layer attention-only transformer: heads implement skip-trigrams; every head's OV circuit has a "
    "positive eigenvalue copying score, yet few tokens raise their own logit most (see the self-copy shares).",
    "toy-2l": "Two-layer attention-only transformer: an induction head in layer 1 K-composes with a "
    "previous-token head in layer 0.",
}


NOTES = {
    "toy-0l": "No positional embedding: with no attention layer it would be unused. The bigram numbers compare the "
    "direct path with the empirical bigram distribution of the held-out text (sparse: 26 files), so even a perfect "
    "bigram model of the training text would not reach top-1 agreement 1.",
    "toy-1l": "Trained with batch 8: all 8 heads had a positive OV copying score at step 800 (see history); an earlier "
    "batch-32 run, not shipped, needed 2,500 steps.",
    "toy-2l": "Training data is NOT text alone: 25 % of the rows are BOS + r + r + ... with r 8-63 random tokens "
    "drawn from the tokens seen >= 50 times in training (the induction task made explicit). With text alone the "
    "same recipe reached induction 0.33 (previous-token head 0.93) after 60,000 steps, below the 0.6 threshold "
    "(an earlier run, not shipped). "
    "The shipped weights were trained on a GPU (see training.device) with six other runs sharing it, so "
    "'minutes' are shared-GPU wall time; `make models` retrains the same recipe on the CPU (not bit-identical). "
    "history and first_crossed come from the training monitor (64 repeats of frequent tokens, seed 1); the phenomena "
    "use the standard detector input named in phenomena.detector_input (uniform random tokens, as on the overview, "
    "the tour and the detectors page with its default parameters).",
}
