"""The measured sentences of the page introductions: what the model on screen shows, from its own numbers.

A page introduction explains a concept (what K-composition or a head ablation is); where it used to state a fact
about "the model" ("induction heads K-compose with a previous-token head", "the loss drops on the second copy",
"induction heads sit top right"), that fact now comes from a sentence built here from the views the page already
computed, naming the heads and numbers it rests on. It cannot drift from the model; tests/app/test_page_claims.py
recomputes every value independently on the shipped toys (dense float64 products of the stored weights, plain
forward passes) and fails when a sentence stops saying what they show.
"""

from __future__ import annotations

from app.schemas import HeadScores, HeadsView, MatrixEntry
from app.schemas.analyses import CompositionView, TermImportanceView
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.prompt.model_summary import HEAD_THRESHOLD
from circuits_core.prompt.phenomena import load_token_counts


def strongest(heads: list[HeadScores], score: str, layers: range | None = None) -> HeadScores | None:
    """The head with the highest `score` (optionally within `layers`), None when no head has one."""
    scored = [h for h in heads if getattr(h, score) is not None and (layers is None or h.layer in layers)]
    return max(scored, key=lambda h: getattr(h, score)) if scored else None


def composition_sentence(model_id: str, heads: HeadsView | None, k_view: CompositionView | None) -> str | None:
    """The strongest induction head, its strongest K-composition partner, and whether that partner is the
    strongest previous-token head of an earlier layer (detector scores on the standard input)."""
    if heads is None or k_view is None or not heads.heads:
        return None
    induction = strongest(heads.heads, "induction", range(1, max(h.layer for h in heads.heads) + 1))
    if induction is None or induction.head not in k_view.targets:
        return None
    j = k_view.targets.index(induction.head)
    partners = [
        (k_view.minus_baseline[i][j], src)
        for i, src in enumerate(k_view.sources)
        if k_view.minus_baseline[i][j] is not None
    ]
    over, partner = max(partners)
    i = k_view.sources.index(partner)
    prev = strongest(heads.heads, "previous_token", range(0, induction.layer))
    if induction.induction is None or prev is None or prev.previous_token is None:
        return None
    where = (
        f"on {heads.detector_input.batch} sequences of BOS + r + r" if heads.detector_input.seq_len else "on its input"
    )
    sentence = (
        f"On {model_id}: the strongest induction head is {induction.head} (induction score {induction.induction:.2f} "
        f"{where}); its strongest K-composition partner is {partner} ({k_view.scores[i][j]:.3f}, "
        f"{over:+.3f} over the baseline)"
    )
    if partner == prev.head:
        return (
            sentence + f", the strongest previous-token head of the earlier layers (score {prev.previous_token:.2f})."
        )
    return (
        sentence
        + f"; the strongest previous-token head of the earlier layers is {prev.head} (score {prev.previous_token:.2f})."
    )


def loss_sentence(first: float | None, second: float | None) -> str | None:
    """Whether the loss drops from the first copy of the repeated segment to the second, and by how much."""
    if first is None or second is None:
        return None
    if second < first:
        return f"Here the mean loss drops by {first - second:.3f} nats from the first copy to the second."
    return (
        f"Here the mean loss does not drop on the second copy ({second - first:+.3f} nats): no head predicts it from "
        "the first."
    )


def ablation_sentence(view: TermImportanceView | None, heads: HeadsView | None) -> str | None:
    """Removing the previous-token head of the heads that matter (the heads view's previous_token_head, HEADS_RULE:
    the one feeding the strongest induction head; scoring at least HEAD_THRESHOLD), patterns frozen against later
    patterns recomputed."""
    if view is None or heads is None or not heads.heads or max(h.layer for h in heads.heads) < 1:
        return None
    prev = next((h for h in heads.heads if h.head == heads.previous_token_head), None)
    row = next((r for r in view.heads if prev is not None and r.head == prev.head), None)
    if prev is None or row is None or (prev.previous_token or 0.0) < HEAD_THRESHOLD:
        return None  # no previous-token head (model_summary's threshold): no sentence calls a head one that is none
    return (
        f"Here, removing the previous-token head {prev.head} changes the loss by {row.loss_change:+.3f} nats with "
        f"every other pattern frozen and by {row.loss_change_recomputed:+.3f} with the later patterns recomputed."
    )


def scatter_sentence(points: list[dict[str, float | str | None]], heads: HeadsView) -> str | None:
    """Where the strongest induction head sits among the later-layer heads: its rank on each axis of the scatter."""
    names = {str(p["head"]) for p in points}
    induction = strongest([h for h in heads.heads if h.head in names], "induction")
    if induction is None or induction.induction is None:
        return None
    me = next(p for p in points if p["head"] == induction.head)
    rank = {
        axis: 1 + sum(float(p[axis] or 0.0) > float(me[axis] or 0.0) for p in points)
        for axis in ("ov_copying", "k_composition_positivity")
    }
    return (
        f"The strongest induction head, {induction.head} (induction score {induction.induction:.2f}), ranks "
        f"{rank['k_composition_positivity']} of {len(points)} on K-composition positivity and {rank['ov_copying']} "
        "on OV copying."
    )


def rare_entries_sentence(loaded: LoadedModel, entries: list[MatrixEntry], threshold: int) -> str | None:
    """How many distinct tokens of a circuit table were seen fewer than `threshold` times in training (None when the
    model folder has no token counts)."""
    counts = load_token_counts(loaded.path, loaded.model.cfg.d_vocab)
    if counts is None or not entries:
        return None
    tokens = {t.id for e in entries for t in (e.row, e.col)}
    rare = sum(int(counts[t]) < threshold for t in tokens)
    return (
        f"Of the {len(tokens)} distinct tokens in this table, {rare} {'was' if rare == 1 else 'were'} seen fewer than "
        f"{threshold} times in training."
    )
